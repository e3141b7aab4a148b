from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion

class Region(_message.Message):
    __slots__ = ("offset", "block_stride", "block_bytes")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    offset: int
    block_stride: int
    block_bytes: int
    def __init__(self, offset: int | None = ..., block_stride: int | None = ..., block_bytes: int | None = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_blocks", "regions")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    def __init__(self, num_blocks: int | None = ..., regions: _Iterable[Region | _Mapping] | None = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("backend", "handle", "size", "device")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    handle: bytes
    size: int
    device: int
    def __init__(self, backend: str | None = ..., handle: bytes | None = ..., size: int | None = ..., device: int | None = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("protocol_version", "engine_id", "namespace", "layout", "memory", "completion_slots", "peer_token")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    engine_id: str
    namespace: str
    layout: KVLayout
    memory: MemoryHandle
    completion_slots: int
    peer_token: bytes
    def __init__(self, protocol_version: int | None = ..., engine_id: str | None = ..., namespace: str | None = ..., layout: KVLayout | _Mapping | None = ..., memory: MemoryHandle | _Mapping | None = ..., completion_slots: int | None = ..., peer_token: bytes | None = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "block_bytes", "max_inflight_jobs", "daemon_version", "daemon_boot_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_JOBS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    DAEMON_BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    block_bytes: int
    max_inflight_jobs: int
    daemon_version: str
    daemon_boot_id: bytes
    def __init__(self, session_id: bytes | None = ..., block_bytes: int | None = ..., max_inflight_jobs: int | None = ..., daemon_version: str | None = ..., daemon_boot_id: bytes | None = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: bytes | None = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("attached", "shutdown")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    shutdown: Shutdown
    def __init__(self, attached: Attached | _Mapping | None = ..., shutdown: Shutdown | _Mapping | None = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("daemon_boot_id",)
    DAEMON_BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    daemon_boot_id: bytes
    def __init__(self, daemon_boot_id: bytes | None = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: str | None = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: bytes | None = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "keys", "key_size", "lease", "lease_ttl_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace: str
    keys: bytes
    key_size: int
    lease: bool
    lease_ttl_ms: int
    def __init__(self, session_id: bytes | None = ..., namespace: str | None = ..., keys: bytes | None = ..., key_size: int | None = ..., lease: bool | None = ..., lease_ttl_ms: int | None = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits", "lease_id")
    HITS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    hits: int
    lease_id: bytes
    def __init__(self, hits: int | None = ..., lease_id: bytes | None = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    lease_id: bytes
    def __init__(self, session_id: bytes | None = ..., lease_id: bytes | None = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("session_id", "job_id", "keys", "key_size", "block_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    job_id: int
    keys: bytes
    key_size: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: bytes | None = ..., job_id: int | None = ..., keys: bytes | None = ..., key_size: int | None = ..., block_ids: _Iterable[int] | None = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: int | None = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("session_id", "wait_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    wait_ms: int
    def __init__(self, session_id: bytes | None = ..., wait_ms: int | None = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("job_id", "is_store", "block_ok", "error")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    IS_STORE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    is_store: bool
    block_ok: _containers.RepeatedScalarFieldContainer[bool]
    error: str
    def __init__(self, job_id: int | None = ..., is_store: bool | None = ..., block_ok: _Iterable[bool] | None = ..., error: str | None = ...) -> None: ...

class PollResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobResult]
    def __init__(self, jobs: _Iterable[JobResult | _Mapping] | None = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "blocks", "used_bytes", "block_bytes", "hits", "misses", "stored_blocks", "loaded_blocks", "evictions", "engines")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    blocks: int
    used_bytes: int
    block_bytes: int
    hits: int
    misses: int
    stored_blocks: int
    loaded_blocks: int
    evictions: int
    engines: int
    def __init__(self, namespace: str | None = ..., blocks: int | None = ..., used_bytes: int | None = ..., block_bytes: int | None = ..., hits: int | None = ..., misses: int | None = ..., stored_blocks: int | None = ..., loaded_blocks: int | None = ..., evictions: int | None = ..., engines: int | None = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "blocks", "hits", "misses", "stored_blocks", "loaded_blocks", "evictions", "engines", "leases", "jobs_in_flight", "failed_blocks", "store_failures_pool_full", "lease_expiries", "corrupt_blocks", "uptime_s", "namespaces", "daemon_version")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    JOBS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    FAILED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_FAILURES_POOL_FULL_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    stored_blocks: int
    loaded_blocks: int
    evictions: int
    engines: int
    leases: int
    jobs_in_flight: int
    failed_blocks: int
    store_failures_pool_full: int
    lease_expiries: int
    corrupt_blocks: int
    uptime_s: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    daemon_version: str
    def __init__(self, capacity_bytes: int | None = ..., used_bytes: int | None = ..., blocks: int | None = ..., hits: int | None = ..., misses: int | None = ..., stored_blocks: int | None = ..., loaded_blocks: int | None = ..., evictions: int | None = ..., engines: int | None = ..., leases: int | None = ..., jobs_in_flight: int | None = ..., failed_blocks: int | None = ..., store_failures_pool_full: int | None = ..., lease_expiries: int | None = ..., corrupt_blocks: int | None = ..., uptime_s: int | None = ..., namespaces: _Iterable[NamespaceStats | _Mapping] | None = ..., daemon_version: str | None = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace", "peer_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    peer_token: bytes
    def __init__(self, namespace: str | None = ..., peer_token: bytes | None = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("cleared_blocks",)
    CLEARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cleared_blocks: int
    def __init__(self, cleared_blocks: int | None = ...) -> None: ...
