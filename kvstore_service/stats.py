"""The daemon's statistics as one typed object, from the core to gRPC, Prometheus and the CLI.

`Stats` and `NamespaceStats` carry exactly the fields of the `kvstore.v1.StatsResponse` and
`kvstore.v1.NamespaceStats` messages, in their order (a test keeps the two in step), and convert
to and from them generically: `to_proto`, `from_proto`. Derived figures (lookup hit rates, tokens
loaded, a namespace's short id) are properties here, computed in one place for every consumer.

What the sidecar served is what it LOADED into engines (loaded blocks, bytes, tokens). Lookup hits
are only what was asked: the connector also looks up blocks its engine holds itself and never loads.

Each field that /metrics exports declares its Prometheus metric where it is defined (`gauge` or
`counter` in the field's metadata); metrics.py walks them.

Of the client package this module imports only `kvstore_client.protocol` (the daemon loads it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar, cast

from google.protobuf.message import Message

from kvstore_client.protocol import kvstore_pb2 as pb

__all__ = ["DiskStats", "EventStats", "MetricSpec", "NamespaceStats", "RemoteStats", "Stats", "block_tokens",
           "counter", "from_dict", "from_proto", "gauge", "metrics_of", "namespace_id", "to_json_dict", "to_proto"]


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


class MetricSpec(NamedTuple):
    """A Prometheus metric family: its name, kind and help text (a counter's samples end in _total)."""

    kind: Literal["gauge", "counter"]
    name: str
    doc: str


def gauge(name: str, doc: str) -> dict[str, MetricSpec]:
    """A field's metadata: /metrics exports the field as the gauge `name`."""
    return {"metric": MetricSpec("gauge", name, doc)}


def counter(name: str, doc: str) -> dict[str, MetricSpec]:
    """A field's metadata: /metrics exports the field as the counter `name`."""
    return {"metric": MetricSpec("counter", name, doc)}


def metrics_of(cls: type[Any]) -> list[tuple[str, MetricSpec]]:
    """(field name, its metric) for each field of the dataclass `cls` that declares one, in field order."""
    return [(f.name, f.metadata["metric"]) for f in dataclasses.fields(cls) if "metric" in f.metadata]


@dataclass(frozen=True, slots=True, kw_only=True)
class NamespaceStats:
    namespace: str
    blocks: int = field(metadata=gauge("kvstore_blocks", "Blocks in the pool."))
    used_bytes: int = field(metadata=gauge("kvstore_namespace_used_bytes", "Pool bytes per namespace."))
    block_bytes: int
    hits: int = field(metadata=counter("kvstore_lookup_hits", "Looked-up blocks found (asked, not served: see "
                                       "kvstore_loaded_blocks)."))
    misses: int = field(metadata=counter("kvstore_lookup_misses", "Looked-up blocks missing."))
    stored_blocks: int = field(metadata=counter("kvstore_stored_blocks", "Blocks stored."))
    loaded_blocks: int = field(metadata=counter("kvstore_loaded_blocks", "Served: block loads into engines (TP: one "
                                                "per shard's part)."))
    evictions: int = field(metadata=counter("kvstore_evictions", "Blocks evicted (LRU)."))
    engines: int
    tenant: str
    # copied into engines (with TP shards, each load copies its shard's part)
    loaded_bytes: int = field(metadata=counter("kvstore_namespace_loaded_bytes", "Served: bytes loaded into engines."))

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
    hits: int = field(default=0, metadata=counter("kvstore_remote_hits", "Blocks fetched from the remote store and "
                                                  "verified."))
    # blocks asked for and not returned (absent, failed, corrupt, after the first miss, skipped)
    misses: int = field(default=0, metadata=counter("kvstore_remote_misses", "Blocks asked of the remote store and not "
                                                    "found (or failed)."))
    skipped: int = 0  # of the misses: not asked, the breaker was open
    # payload bytes returned by fetch
    bytes_down: int = field(default=0, metadata=counter("kvstore_remote_bytes_down", "Bytes fetched."))
    fetch_seconds_sum: float = 0.0  # fetch calls that asked the store: total and count
    fetch_seconds_count: int = 0
    # write-behind queue, values in flight included
    queued_blocks: int = field(default=0, metadata=gauge("kvstore_remote_queued_blocks", "Blocks waiting for their "
                                                         "upload."))
    queued_bytes: int = field(default=0, metadata=gauge("kvstore_remote_queued_bytes", "Bytes waiting for their "
                                                        "upload."))
    queue_limit_bytes: int = 0
    uploaded: int = field(default=0, metadata=counter("kvstore_remote_uploaded_blocks", "Blocks uploaded."))
    # value bytes stored (headers included)
    bytes_up: int = field(default=0, metadata=counter("kvstore_remote_bytes_up", "Bytes uploaded."))
    upload_failed: int = 0  # blocks whose upload failed (error or timeout)
    dropped_full: int = 0  # offered blocks dropped: queue full
    dropped_unhealthy: int = 0  # offered or queued blocks dropped: breaker open
    dropped_closed: int = 0  # queued blocks dropped when the tier closed
    # per key: store errors, timeouts included
    errors: int = field(default=0, metadata=counter("kvstore_remote_errors", "Keys whose call to the remote store "
                                                    "failed (timeouts included)."))
    timeouts: int = 0
    corrupt: int = field(default=0, metadata=counter("kvstore_remote_corrupt_blocks", "Fetched values that failed "
                                                     "verification (deleted)."))


@dataclass(slots=True, kw_only=True)
class EventStats:
    """Routers' block events (events.py): counters since the daemon started."""

    sent: int = field(default=0, metadata=counter("kvstore_events_sent", "Block events streamed to engines "
                                                  "(routers' KV events)."))
    resyncs: int = field(default=0, metadata=counter("kvstore_events_resyncs", "Engines' event streams reset after "
                                                     "falling --max-event-queue events behind."))
    dropped: int = field(default=0, metadata=counter("kvstore_events_dropped", "Block descriptions not kept (over "
                                                     "--max-event-bytes or --max-event-description-bytes)."))
    bytes: int = field(default=0, metadata=gauge("kvstore_event_bytes", "Bytes of block descriptions held."))


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskStats:
    """The disk tier (tiers/disk/): counters since the daemon started; all zero when there is none."""

    blocks: int = field(default=0, metadata=gauge("kvstore_disk_blocks", "Blocks on disk."))
    bytes: int = field(default=0, metadata=gauge("kvstore_disk_used_bytes", "Disk space the segment files take."))
    capacity_bytes: int = field(default=0, metadata=gauge("kvstore_disk_capacity_bytes", "--disk-size, in whole "
                                                          "segments."))
    segments: int = 0
    hits: int = field(default=0, metadata=counter("kvstore_disk_hits", "Looked-up blocks found on disk."))
    misses: int = 0
    read_blocks: int = field(default=0, metadata=counter("kvstore_disk_read_blocks", "Blocks read back into the pool "
                                                         "and verified."))
    read_bytes: int = field(default=0, metadata=counter("kvstore_disk_read_bytes", "Bytes read back into the pool."))
    read_seconds: float = 0.0
    written: int = field(default=0, metadata=counter("kvstore_disk_written_blocks", "Blocks written to disk."))
    write_bytes: int = field(default=0, metadata=counter("kvstore_disk_write_bytes", "Bytes written to disk."))
    write_seconds: float = 0.0
    write_dropped: int = field(default=0, metadata=counter("kvstore_disk_write_dropped_blocks", "Blocks not written: "
                                                           "queue full, no space, tier disabled, evicted before "
                                                           "their seal."))
    queued_bytes: int = 0  # waiting to be written
    corrupt: int = field(default=0, metadata=counter("kvstore_disk_corrupt_blocks", "Records that failed "
                                                     "verification at a read (dropped)."))
    errors: int = field(default=0, metadata=counter("kvstore_disk_errors", "Failed disk I/O calls."))
    reclaimed_segments: int = 0  # oldest segments dropped to make room
    direct_io: bool = False  # O_DIRECT in use
    # false: no disk tier, or disabled by an error (see error)
    healthy: bool = field(default=False, metadata=gauge("kvstore_disk_healthy", "0 once an I/O error, a full disk "
                                                        "or a missing directory disabled the disk tier (the pool "
                                                        "keeps serving)."))
    error: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Stats:
    capacity_bytes: int = field(metadata=gauge("kvstore_pool_capacity_bytes", "Pool capacity."))
    used_bytes: int = field(metadata=gauge("kvstore_pool_used_bytes", "Pool bytes holding blocks."))
    blocks: int  # (blocks to evictions: on /metrics per namespace only)
    hits: int
    misses: int
    stored_blocks: int
    loaded_blocks: int
    evictions: int
    engines: int = field(metadata=gauge("kvstore_engines", "Engines connected."))
    leases: int = field(metadata=gauge("kvstore_leases", "Lookup leases held."))
    jobs_in_flight: int = field(metadata=gauge("kvstore_jobs_in_flight", "Copy jobs not finished."))
    failed_blocks: int = field(metadata=counter("kvstore_failed_blocks", "Blocks whose job failed."))
    store_failures_pool_full: int = field(metadata=counter("kvstore_store_failures_pool_full", "Stores refused "
                                                           "because no slot could be freed."))
    lease_expiries: int = field(metadata=counter("kvstore_lease_expiries", "Leases that expired before release."))
    corrupt_blocks: int = field(metadata=counter("kvstore_corrupt_blocks", "Blocks dropped after a checksum mismatch "
                                                 "(at a load, or when verifying recovered blocks after a restart)."))
    uptime_s: int
    namespaces: list[NamespaceStats]
    daemon_version: str
    unsealed_blocks: int = field(metadata=gauge("kvstore_unsealed_blocks", "Stored blocks waiting for their "
                                                "checksum."))
    failed_load_blocks: int = field(metadata=counter("kvstore_failed_load_blocks", "Blocks whose load failed "
                                                     "(engines recompute them)."))
    unverified_blocks: int = field(metadata=gauge("kvstore_unverified_blocks", "Blocks recovered from the pool after "
                                                  "a restart, not yet checked against their checksums (lookups miss "
                                                  "them until then)."))
    remote: RemoteStats
    disk: DiskStats
    loaded_bytes: int = field(metadata=counter("kvstore_loaded_bytes", "Served: bytes loaded into engines."))
    # of the namespaces whose block size in tokens is known
    loaded_tokens: int = field(metadata=counter("kvstore_loaded_tokens", "Served: tokens loaded into engines, of the "
                                                "namespaces that name their block size in tokens."))
    events: EventStats = field(default_factory=EventStats)
    ready_bytes: int = field(default=0, metadata=gauge("kvstore_pool_ready_bytes", "Pool bytes set up and usable: "
                                                       "a new pool grows to its capacity while the daemon serves."))

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
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list):
            value = [_to_message(v) if dataclasses.is_dataclass(v) else v for v in value]
        elif dataclasses.is_dataclass(value):
            value = _to_message(value)
        values[f.name] = value
    return _MESSAGE_OF[type(obj)](**values)


def _build(cls: type[_T], source: Any, get: Callable[[Any, str], Any]) -> _T:
    """A `cls` from a message or a mapping (`get` reads one field); nested messages per the .proto."""
    values: dict[str, Any] = {}
    descriptors = _MESSAGE_OF[cls].DESCRIPTOR.fields_by_name
    for f in dataclasses.fields(cast(Any, cls)):
        value = get(source, f.name)
        descriptor = descriptors[f.name]
        if descriptor.message_type is not None:
            sub = _DATACLASS_OF[descriptor.message_type.full_name]
            value = [_build(sub, v, get) for v in value] if descriptor.is_repeated else _build(sub, value, get)
        elif descriptor.is_repeated:
            value = list(value)
        values[f.name] = value
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
