"""The daemon's statistics as one typed object, from the core to gRPC, Prometheus and the CLI.

`Stats` and `NamespaceStats` carry exactly the fields of the `kvstore.v1.StatsResponse` and
`kvstore.v1.NamespaceStats` messages, in their order (a test keeps the two in step), and convert
to and from them generically: `to_proto`, `from_proto`. Derived figures (lookup hit rates, tokens
loaded, a namespace's short id) are properties here, computed in one place for every consumer.

What the sidecar served is what it LOADED into engines (loaded blocks, bytes, tokens). Lookup hits
are only what was asked: the connector also looks up blocks its engine holds itself and never loads.

Of the client package this module imports only `kvstore_client.protocol` (the daemon loads it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from google.protobuf.message import Message

from kvstore_client.protocol import kvstore_pb2 as pb

__all__ = ["DiskStats", "NamespaceStats", "RemoteStats", "Stats", "block_tokens", "from_dict", "from_proto",
           "namespace_id", "to_json_dict", "to_proto"]


def namespace_id(namespace: str) -> str:
    """A short stable id for a namespace string: 8 hex digits of its BLAKE2b hash."""
    return hashlib.blake2b(namespace.encode(), digest_size=4).hexdigest()


def block_tokens(namespace: str) -> int:
    """Tokens per block, from a namespace's `block=N` part (the vLLM connector's names carry it); 0: unknown."""
    for part in namespace.split(";"):
        key, _, value = part.partition("=")
        if key == "block" and value.isdigit():
            return int(value)
    return 0


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceStats:
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
    loaded_bytes: int  # copied into engines (with TP shards, each load copies its shard's part)

    @property
    def hit_rate(self) -> float:
        """Lookup hits / blocks looked up, since the daemon started (0 before any lookup). Not what was
        served: a lookup also finds blocks the engine holds itself and does not load."""
        return _ratio(self.hits, self.hits + self.misses)

    @property
    def stored_bytes(self) -> int:
        return self.stored_blocks * self.block_bytes

    @property
    def block_tokens(self) -> int:
        """Tokens per block when the namespace names it (`block=N`), else 0."""
        return block_tokens(self.namespace)

    @property
    def loaded_tokens(self) -> int:
        """Tokens loaded into engines: whole blocks' bytes loaded x tokens per block (0 when unknown)."""
        return self.loaded_bytes // self.block_bytes * self.block_tokens if self.block_bytes else 0

    @property
    def short_id(self) -> str:
        return namespace_id(self.namespace)


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteStats:
    """The remote tier (tiers/remote/); all zero and url "" when there is none."""

    url: str = ""  # masked
    breaker: str = ""  # closed, open, half-open
    breaker_opens: int = 0
    fetches: int = 0  # fetch calls with keys
    hits: int = 0  # blocks fetched and verified
    misses: int = 0  # blocks asked for and not returned (absent, failed, corrupt, after the first miss, skipped)
    skipped: int = 0  # of the misses: not asked, the breaker was open
    bytes_down: int = 0  # payload bytes returned by fetch
    fetch_seconds_sum: float = 0.0  # fetch calls that asked the store: total and count
    fetch_seconds_count: int = 0
    queued_blocks: int = 0  # write-behind queue, values in flight included
    queued_bytes: int = 0
    queue_limit_bytes: int = 0
    uploaded: int = 0  # blocks stored
    bytes_up: int = 0  # value bytes stored (headers included)
    upload_failed: int = 0  # blocks whose upload failed (error or timeout)
    dropped_full: int = 0  # offered blocks dropped: queue full
    dropped_unhealthy: int = 0  # offered or queued blocks dropped: breaker open
    dropped_closed: int = 0  # queued blocks dropped when the tier closed
    errors: int = 0  # per key: store errors, timeouts included
    timeouts: int = 0
    corrupt: int = 0  # values that failed verification (deleted)


@dataclass(slots=True, kw_only=True)
class EventStats:
    """Routers' block events (events.py): counters since the daemon started."""

    sent: int = 0  # events streamed to engines
    resyncs: int = 0  # streams reset after falling --max-event-queue events behind
    dropped: int = 0  # descriptions not kept (over --max-event-bytes or --max-event-description-bytes)
    bytes: int = 0  # descriptions held


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskStats:
    """The disk tier (tiers/disk/): counters since the daemon started; all zero when there is none."""

    blocks: int = 0  # on disk
    bytes: int = 0  # disk space the segment files take
    capacity_bytes: int = 0  # --disk-size, in whole segments
    segments: int = 0
    hits: int = 0  # looked-up keys found on disk
    misses: int = 0
    read_blocks: int = 0  # read back into the pool and verified
    read_bytes: int = 0
    read_seconds: float = 0.0
    written: int = 0  # blocks written
    write_bytes: int = 0
    write_seconds: float = 0.0
    write_dropped: int = 0  # not written: queue full, no space, tier disabled, evicted before their seal
    queued_bytes: int = 0  # waiting to be written
    corrupt: int = 0  # records that failed verification at a read (dropped)
    errors: int = 0  # failed I/O calls
    reclaimed_segments: int = 0  # oldest segments dropped to make room
    direct_io: bool = False  # O_DIRECT in use
    healthy: bool = False  # false: no disk tier, or disabled by an error (see error)
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
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
    namespaces: list[NamespaceStats]
    daemon_version: str
    unsealed_blocks: int
    failed_load_blocks: int
    unverified_blocks: int
    remote: RemoteStats
    disk: DiskStats
    loaded_bytes: int
    loaded_tokens: int  # of the namespaces whose block size in tokens is known
    events: EventStats = dataclasses.field(default_factory=EventStats)

    @property
    def hit_rate(self) -> float:
        """Lookup hits / blocks looked up, since the daemon started (0 before any lookup): what was asked,
        not what was served (see loaded_blocks)."""
        return _ratio(self.hits, self.hits + self.misses)

    @property
    def used_fraction(self) -> float:
        return _ratio(self.used_bytes, self.capacity_bytes)

    @property
    def stored_bytes(self) -> int:
        return sum(ns.stored_bytes for ns in self.namespaces)

    @property
    def tokens_unknown(self) -> bool:
        """Some shown namespace loaded blocks whose size in tokens it does not name (not in loaded_tokens)."""
        return any(ns.loaded_blocks and not ns.block_tokens for ns in self.namespaces)


# -- conversions, written once over dataclasses.fields -----------------------------------------------

_MESSAGE_OF: dict[type, type[Message]] = {NamespaceStats: pb.NamespaceStats, RemoteStats: pb.RemoteStats,
                                          DiskStats: pb.DiskStats, EventStats: pb.EventStats,
                                          Stats: pb.StatsResponse}
_DATACLASS_OF: dict[str, type] = {m.DESCRIPTOR.full_name: d for d, m in _MESSAGE_OF.items()}
_T = TypeVar("_T")


def _to_message(obj: Any) -> Message:
    values: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if isinstance(value, list):
            value = [_to_message(v) if dataclasses.is_dataclass(v) else v for v in value]
        elif dataclasses.is_dataclass(value):
            value = _to_message(value)
        values[field.name] = value
    return _MESSAGE_OF[type(obj)](**values)


def _build(cls: type[_T], source: Any, get: Callable[[Any, str], Any]) -> _T:
    """A `cls` from a message or a mapping (`get` reads one field); nested messages per the .proto."""
    values: dict[str, Any] = {}
    descriptors = _MESSAGE_OF[cls].DESCRIPTOR.fields_by_name
    for field in dataclasses.fields(cast(Any, cls)):
        value = get(source, field.name)
        descriptor = descriptors[field.name]
        if descriptor.message_type is not None:
            sub = _DATACLASS_OF[descriptor.message_type.full_name]
            value = [_build(sub, v, get) for v in value] if descriptor.is_repeated else _build(sub, value, get)
        elif descriptor.is_repeated:
            value = list(value)
        values[field.name] = value
    return cls(**values)


def to_proto(stats: Stats) -> pb.StatsResponse:
    return cast(pb.StatsResponse, _to_message(stats))


def from_proto(msg: pb.StatsResponse) -> Stats:
    return _build(Stats, msg, getattr)


def from_dict(data: Mapping[str, Any]) -> Stats:
    """The inverse of `dataclasses.asdict` (and of `to_json_dict`: keys beyond the fields are ignored)."""
    return _build(Stats, data, operator.getitem)


def to_json_dict(stats: Stats) -> dict[str, Any]:
    """Every field (namespaces as a list of objects) plus the derived `hit_rate` (of lookups) and, per
    namespace, `block_tokens` and `loaded_tokens`: `kvstore stats --json`."""
    data = {**dataclasses.asdict(stats), "hit_rate": stats.hit_rate}
    for ns, row in zip(stats.namespaces, data["namespaces"], strict=True):
        row.update(block_tokens=ns.block_tokens, loaded_tokens=ns.loaded_tokens)
    return data
