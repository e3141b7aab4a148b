from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]

class Medium(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEDIUM_POOL: _ClassVar[Medium]
    MEDIUM_DISK: _ClassVar[Medium]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion
MEDIUM_POOL: Medium
MEDIUM_DISK: Medium

class Region(_message.Message):
    __slots__ = ("offset", "block_stride", "block_bytes", "memory")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    offset: int
    block_stride: int
    block_bytes: int
    memory: int
    def __init__(self, offset: _Optional[int] = ..., block_stride: _Optional[int] = ..., block_bytes: _Optional[int] = ..., memory: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_blocks", "regions", "shards", "shard")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    regions: _containers.RepeatedCompositeFieldContainer[Region]
    shards: int
    shard: int
    def __init__(self, num_blocks: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[Region, _Mapping]]] = ..., shards: _Optional[int] = ..., shard: _Optional[int] = ...) -> None: ...

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
    def __init__(self, backend: _Optional[str] = ..., handle: _Optional[bytes] = ..., size: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("protocol_version", "engine_id", "namespace", "layout", "memories", "completion_slots", "peer_token")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    engine_id: str
    namespace: str
    layout: KVLayout
    memories: _containers.RepeatedCompositeFieldContainer[MemoryHandle]
    completion_slots: int
    peer_token: bytes
    def __init__(self, protocol_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., namespace: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., memories: _Optional[_Iterable[_Union[MemoryHandle, _Mapping]]] = ..., completion_slots: _Optional[int] = ..., peer_token: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("session_id", "block_bytes", "max_inflight_jobs", "daemon_version", "daemon_boot_id", "progress_load_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_JOBS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    DAEMON_BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    block_bytes: int
    max_inflight_jobs: int
    daemon_version: str
    daemon_boot_id: bytes
    progress_load_bytes: int
    def __init__(self, session_id: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., max_inflight_jobs: _Optional[int] = ..., daemon_version: _Optional[str] = ..., daemon_boot_id: _Optional[bytes] = ..., progress_load_bytes: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("attached", "shutdown")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    shutdown: Shutdown
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("daemon_boot_id",)
    DAEMON_BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    daemon_boot_id: bytes
    def __init__(self, daemon_boot_id: _Optional[bytes] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "keys", "key_size", "lease", "lease_ttl_ms", "peer_token", "group_spans")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    GROUP_SPANS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    namespace: str
    keys: bytes
    key_size: int
    lease: bool
    lease_ttl_ms: int
    peer_token: bytes
    group_spans: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[bytes] = ..., namespace: _Optional[str] = ..., keys: _Optional[bytes] = ..., key_size: _Optional[int] = ..., lease: _Optional[bool] = ..., lease_ttl_ms: _Optional[int] = ..., peer_token: _Optional[bytes] = ..., group_spans: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hits", "lease_id")
    HITS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    hits: int
    lease_id: bytes
    def __init__(self, hits: _Optional[int] = ..., lease_id: _Optional[bytes] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    lease_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., lease_id: _Optional[bytes] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("session_id", "job_id", "keys", "key_size", "block_ids", "partial_tail", "order_seq", "block_id_bytes", "expires_ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_TAIL_FIELD_NUMBER: _ClassVar[int]
    ORDER_SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_ID_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_NS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    job_id: int
    keys: bytes
    key_size: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    partial_tail: bool
    order_seq: int
    block_id_bytes: bytes
    expires_ns: int
    def __init__(self, session_id: _Optional[bytes] = ..., job_id: _Optional[int] = ..., keys: _Optional[bytes] = ..., key_size: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., partial_tail: _Optional[bool] = ..., order_seq: _Optional[int] = ..., block_id_bytes: _Optional[bytes] = ..., expires_ns: _Optional[int] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("session_id", "wait_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    wait_ms: int
    def __init__(self, session_id: _Optional[bytes] = ..., wait_ms: _Optional[int] = ...) -> None: ...

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
    def __init__(self, job_id: _Optional[int] = ..., is_store: _Optional[bool] = ..., block_ok: _Optional[_Iterable[bool]] = ..., error: _Optional[str] = ...) -> None: ...

class PollResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobResult]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobResult, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("peer_token",)
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    peer_token: bytes
    def __init__(self, peer_token: _Optional[bytes] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "blocks", "used_bytes", "block_bytes", "hits", "misses", "stored_blocks", "loaded_blocks", "evictions", "engines", "tenant", "loaded_bytes")
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
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
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
    tenant: str
    loaded_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., blocks: _Optional[int] = ..., used_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., engines: _Optional[int] = ..., tenant: _Optional[str] = ..., loaded_bytes: _Optional[int] = ...) -> None: ...

class DescribeBlocksRequest(_message.Message):
    __slots__ = ("session_id", "keys", "key_size", "descriptions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEY_SIZE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    keys: bytes
    key_size: int
    descriptions: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[bytes] = ..., keys: _Optional[bytes] = ..., key_size: _Optional[int] = ..., descriptions: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DescribeBlocksResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchBlocksRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    def __init__(self, session_id: _Optional[bytes] = ...) -> None: ...

class BlockEvents(_message.Message):
    __slots__ = ("reset", "events")
    RESET_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    events: _containers.RepeatedCompositeFieldContainer[BlockEvent]
    def __init__(self, reset: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[BlockEvent, _Mapping]]] = ...) -> None: ...

class BlockEvent(_message.Message):
    __slots__ = ("removed", "key", "description", "medium")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    key: bytes
    description: bytes
    medium: Medium
    def __init__(self, removed: _Optional[bool] = ..., key: _Optional[bytes] = ..., description: _Optional[bytes] = ..., medium: _Optional[_Union[Medium, str]] = ...) -> None: ...

class EventStats(_message.Message):
    __slots__ = ("sent", "resyncs", "dropped", "bytes")
    SENT_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    sent: int
    resyncs: int
    dropped: int
    bytes: int
    def __init__(self, sent: _Optional[int] = ..., resyncs: _Optional[int] = ..., dropped: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "blocks", "hits", "misses", "stored_blocks", "loaded_blocks", "evictions", "engines", "leases", "jobs_in_flight", "failed_blocks", "store_failures_pool_full", "lease_expiries", "corrupt_blocks", "uptime_s", "namespaces", "daemon_version", "unsealed_blocks", "failed_load_blocks", "unverified_blocks", "remote", "disk", "loaded_bytes", "loaded_tokens", "events", "ready_bytes")
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
    UNSEALED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FAILED_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNVERIFIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    READY_BYTES_FIELD_NUMBER: _ClassVar[int]
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
    unsealed_blocks: int
    failed_load_blocks: int
    unverified_blocks: int
    remote: RemoteStats
    disk: DiskStats
    loaded_bytes: int
    loaded_tokens: int
    events: EventStats
    ready_bytes: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., engines: _Optional[int] = ..., leases: _Optional[int] = ..., jobs_in_flight: _Optional[int] = ..., failed_blocks: _Optional[int] = ..., store_failures_pool_full: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., uptime_s: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., daemon_version: _Optional[str] = ..., unsealed_blocks: _Optional[int] = ..., failed_load_blocks: _Optional[int] = ..., unverified_blocks: _Optional[int] = ..., remote: _Optional[_Union[RemoteStats, _Mapping]] = ..., disk: _Optional[_Union[DiskStats, _Mapping]] = ..., loaded_bytes: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., events: _Optional[_Union[EventStats, _Mapping]] = ..., ready_bytes: _Optional[int] = ...) -> None: ...

class DiskStats(_message.Message):
    __slots__ = ("blocks", "bytes", "capacity_bytes", "segments", "hits", "misses", "read_blocks", "read_bytes", "read_seconds", "written", "write_bytes", "write_seconds", "write_dropped", "queued_bytes", "corrupt", "errors", "reclaimed_segments", "direct_io", "healthy", "error")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    READ_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    bytes: int
    capacity_bytes: int
    segments: int
    hits: int
    misses: int
    read_blocks: int
    read_bytes: int
    read_seconds: float
    written: int
    write_bytes: int
    write_seconds: float
    write_dropped: int
    queued_bytes: int
    corrupt: int
    errors: int
    reclaimed_segments: int
    direct_io: bool
    healthy: bool
    error: str
    def __init__(self, blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., segments: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., read_blocks: _Optional[int] = ..., read_bytes: _Optional[int] = ..., read_seconds: _Optional[float] = ..., written: _Optional[int] = ..., write_bytes: _Optional[int] = ..., write_seconds: _Optional[float] = ..., write_dropped: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., corrupt: _Optional[int] = ..., errors: _Optional[int] = ..., reclaimed_segments: _Optional[int] = ..., direct_io: _Optional[bool] = ..., healthy: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class RemoteStats(_message.Message):
    __slots__ = ("url", "breaker", "breaker_opens", "fetches", "hits", "misses", "skipped", "bytes_down", "fetch_seconds_sum", "fetch_seconds_count", "queued_blocks", "queued_bytes", "queue_limit_bytes", "uploaded", "bytes_up", "upload_failed", "dropped_full", "dropped_unhealthy", "dropped_closed", "errors", "timeouts", "corrupt")
    URL_FIELD_NUMBER: _ClassVar[int]
    BREAKER_FIELD_NUMBER: _ClassVar[int]
    BREAKER_OPENS_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_SUM_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_COUNT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOADED_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FAILED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FULL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_UNHEALTHY_FIELD_NUMBER: _ClassVar[int]
    DROPPED_CLOSED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    url: str
    breaker: str
    breaker_opens: int
    fetches: int
    hits: int
    misses: int
    skipped: int
    bytes_down: int
    fetch_seconds_sum: float
    fetch_seconds_count: int
    queued_blocks: int
    queued_bytes: int
    queue_limit_bytes: int
    uploaded: int
    bytes_up: int
    upload_failed: int
    dropped_full: int
    dropped_unhealthy: int
    dropped_closed: int
    errors: int
    timeouts: int
    corrupt: int
    def __init__(self, url: _Optional[str] = ..., breaker: _Optional[str] = ..., breaker_opens: _Optional[int] = ..., fetches: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., skipped: _Optional[int] = ..., bytes_down: _Optional[int] = ..., fetch_seconds_sum: _Optional[float] = ..., fetch_seconds_count: _Optional[int] = ..., queued_blocks: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., queue_limit_bytes: _Optional[int] = ..., uploaded: _Optional[int] = ..., bytes_up: _Optional[int] = ..., upload_failed: _Optional[int] = ..., dropped_full: _Optional[int] = ..., dropped_unhealthy: _Optional[int] = ..., dropped_closed: _Optional[int] = ..., errors: _Optional[int] = ..., timeouts: _Optional[int] = ..., corrupt: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace", "peer_token", "tenant")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PEER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    peer_token: bytes
    tenant: str
    def __init__(self, namespace: _Optional[str] = ..., peer_token: _Optional[bytes] = ..., tenant: _Optional[str] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("cleared_blocks",)
    CLEARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cleared_blocks: int
    def __init__(self, cleared_blocks: _Optional[int] = ...) -> None: ...
