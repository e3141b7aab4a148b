"""What the connector's two sides share: settings, the engine's identity (namespace, TP sharding),
the scheduler -> worker metadata and the worker's stats."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvstore_client.identity import ModelNotFound, weights_identity
from kvstore_client.layouts import KV_TUPLES, UnsupportedKVCache, heads_first, served_groups
from kvstore_client.vllm import compat
from kvstore_client.vllm.plan import Transfer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

# -- settings and identity ----------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorSettings:
    socket: str | None = None
    tenant_salt: str = ""
    timeout_s: float = 5.0
    lease_ttl_ms: int = 120_000
    store: bool = True  # offload newly computed full blocks (eagerly, each step)
    load: bool = True
    # Multi-process engines on CPU: a hit's load is reported done when it starts and read layer by
    # layer by the next forward (KVStoreConnectorMetadata.early). False: reported once landed.
    layerwise_loads: bool = True
    # The KV cache layout asked of vLLM where the attention backend allows it: block-outermost gives
    # one run of every layer per block (large copies). "" lets vLLM choose.
    kv_layout: str = "BLHNC"
    # Blocks vLLM serves from its own cache that the pool lacks (a pool emptied by a new daemon pod,
    # stores dropped while it was away) are offered to it: at most this many a step (0: never).
    offer_blocks_per_step: int = 256
    # A hit that saves vLLM fewer tokens than this is recomputed, not loaded (nor looked up where the
    # pool could not save as many): a load, and a lookup's reply, cost the request a step, more than
    # computing a few tokens in the step it is scheduled anyway (e.g. the last block of a prompt whose
    # other blocks vLLM holds). None: one block; 0: every hit loads.
    min_load_tokens: int | None = None
    # The model's identity in the namespace; empty: a fingerprint of its files (kvstore_client/identity.py).
    # Set it to name the weights yourself (e.g. "llama-3.1-8b@2026-11-27"), or where vLLM streams them
    # from a store this machine does not hold; change it to start over with an empty cache.
    model_identity: str = ""
    # With vLLM's KV events on (--kv-events-config), announce the node's pool and disk blocks as this
    # engine's CPU and STORAGE tiers, for cache-aware routers (client/vllm/events.py). False: never.
    kv_events: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kvstore connector settings {sorted(unknown)}; known: {sorted(known)}")
        return cls(**extra)


@dataclass(frozen=True)
class Sharding:
    """How TP ranks split the KV: ranks holding identical KV (MLA latents; KV heads fewer than ranks)
    are `replicas` of one shard; the namespace's blocks have `shards` parts."""

    replicas: int
    shards: int

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> Sharding:
        tp = vllm_config.parallel_config.tensor_parallel_size
        replicas = getattr(kv_cache_config, "kv_tp_replicas", 1) or 1
        if tp % replicas:
            raise ValueError(f"kv_tp_replicas {replicas} does not divide the TP size {tp}")
        return cls(replicas, tp // replicas)

    def shard(self, tp_rank: int) -> int:
        return tp_rank // self.replicas

    def part(self, tp_rank: int, t: Transfer) -> Transfer | None:
        """Replicas split the stores of their shard: each stores the blocks `block_id % replicas` names,
        so an MLA latent is stored once, the work spread over the ranks. The blocks of a store this rank
        stores, if any."""
        kept = [i for i, b in enumerate(t.block_ids) if b % self.replicas == tp_rank % self.replicas]
        if not kept:
            return None
        return Transfer(t.req_id, [t.keys[i] for i in kept], [t.block_ids[i] for i in kept],
                        t.partial_tail and kept[-1] == len(t.keys) - 1)


def page_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """How a page's bytes are ordered in the pool: by head then token (HNC), by token then head
    (NHC), or vllm-ascend's K and V tensors. Layouts that differ only in where the layer and block
    axes sit give the same pool bytes (kvstore_client.layouts), so they share a namespace."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "npu" or not compat.LAYOUTS:
        return KV_TUPLES.lower()
    layout = (kv_cache_config.kv_cache_layout if kv_cache_config is not None else None) \
        or compat.kv_cache_layout(vllm_config)
    if layout is None:
        raise UnsupportedKVCache("the KV cache layout is not resolved")
    return "HNC" if heads_first(layout) else "NHC"


def model_identity(vllm_config: VllmConfig, settings: ConnectorSettings) -> str:
    """What the weights are (not where): the `model_identity` setting, or a fingerprint of the files.
    Raises UnsupportedKVCache where neither is known: without it a changed model would be served old KV."""
    if settings.model_identity:
        return f"identity={settings.model_identity}"
    model = vllm_config.model_config
    try:
        identity = weights_identity(model.model, model.revision, model.tokenizer, model.tokenizer_revision)
    except (ModelNotFound, OSError, ValueError) as e:
        raise UnsupportedKVCache(f"cannot tell the model's identity from its files ({e}); set the connector "
                                 "setting model_identity to name the weights") from None
    extra = [f"quantization={model.quantization}"] if model.quantization else []
    if model.hf_overrides:  # e.g. rope scaling: changes the KV of the same weights
        extra.append(f"overrides={hashlib.sha256(repr(model.hf_overrides).encode()).hexdigest()[:16]}")
    return ";".join([identity, *extra])


def namespace_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None,
                  settings: ConnectorSettings) -> str:
    """Blocks are shareable exactly when model identity, KV page format, hashing, TP sharding and tenant
    match: every rank of an engine (and the scheduler) names the same namespace; a block holds every
    shard."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    dtype = cache.cache_dtype if cache.cache_dtype != "auto" else str(model.dtype).removeprefix("torch.")
    parts = [
        model_identity(vllm_config, settings),
        f"dtype={dtype}",
        f"block={cache.block_size}",
        f"layers={model.get_num_layers(parallel)}",
        f"kv_heads={model.get_num_kv_heads(parallel)}",
        f"head={model.get_head_size()}",
        f"hash={cache.prefix_caching_hash_algo}",
        f"page={page_format(vllm_config, kv_cache_config)}",
        f"kv_shards={Sharding.of(vllm_config, kv_cache_config).shards}",
    ]
    if group_spans(kv_cache_config) is not None:  # a single full-attention group keeps today's namespace
        assert kv_cache_config is not None
        parts.append(group_signature(kv_cache_config))
    parts += compat.namespace_parts()
    if settings.tenant_salt:
        parts.append(f"salt={settings.tenant_salt}")
    return ";".join(parts)


def unsupported(vllm_config: VllmConfig) -> str:
    """Why the connector cannot serve this engine ("" if it can)."""
    parallel = vllm_config.parallel_config
    others = {"pipeline": parallel.pipeline_parallel_size, "decode context": parallel.decode_context_parallel_size,
              "prefill context": getattr(parallel, "prefill_context_parallel_size", 1)}
    used = [f"{name} parallel size {size}" for name, size in others.items() if size > 1]
    return f"{', '.join(used)}: only tensor parallelism is supported" if used else ""


def unsupported_kv_cache(kv_cache_config: KVCacheConfig | None) -> str:
    """Why the connector cannot serve this KV cache config ("" if it can): checked on both sides, so
    that with a config it cannot serve (several groups of the hybrid allocator, sliding-window or
    Mamba groups) the scheduler plans nothing and the worker registers nothing."""
    if kv_cache_config is None:
        return "vLLM gave no KV cache config"
    if why := compat.unsupported(kv_cache_config):
        return why
    try:
        groups = served_groups(kv_cache_config)
    except UnsupportedKVCache as e:
        return str(e)
    block_size = groups[0].kv_cache_spec.block_size
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size not in (None, block_size):
        return (f"vLLM hashes blocks of {hash_block_size} tokens, not the KV cache's "
                f"{block_size}-token blocks")
    return ""


def group_spans(kv_cache_config: KVCacheConfig | None) -> list[int] | None:
    """Per KV cache group, the blocks a hit needs before it (kvstore_client.protocol.groups): 0 for full
    attention, vLLM's ceil((window - 1) / block size) for a sliding window, 1 for a Mamba state (the one
    at the hit); None for a single full-attention group (today's keys)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    if kv_cache_config is None:
        return None
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    if len(specs) == 1 and not isinstance(specs[0], (SlidingWindowSpec, MambaSpec)):
        return None
    return [-(-(spec.sliding_window - 1) // spec.block_size) if isinstance(spec, SlidingWindowSpec)
            else 1 if isinstance(spec, MambaSpec) else 0 for spec in specs]


def state_groups(kv_cache_config: KVCacheConfig | None) -> frozenset[int]:
    """The KV cache groups of Mamba or linear-attention states: stored only as vLLM offers them."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    return frozenset(g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, MambaSpec))


def group_signature(kv_cache_config: KVCacheConfig) -> str:
    """The KV cache groups as the namespace names them: kind, block size, window or state shapes and dtypes,
    layers; and the hash block size. Keys of different groups differ by their tag (Scheduler.group_keys)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    parts = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        kind = f"{type(spec).__name__}/{spec.block_size}" + (f"/w{window}" if window else "")
        if isinstance(spec, MambaSpec):  # the state's layout in its page
            kind += (f"/{spec.mamba_type}/{list(spec.shapes)}/{[str(d).removeprefix('torch.') for d in spec.dtypes]}"
                     f"/{spec.page_size_bytes}")
        parts.append(f"{kind}/{len(group.layer_names)}")
    hash_block = kv_cache_config.hash_block_size or kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
    return f"groups={','.join(parts)};hash_block={hash_block}"


# -- scheduler -> worker ------------------------------------------------------------------------


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    # Requests whose sliding-window blocks vLLM freed this step: their stores must finish before the forward.
    flush: set[str] = field(default_factory=set)
    # Nothing scheduled while lookups or loads are in flight: the worker waits for progress (see
    # pacing.py); `lookups`: lookup replies are awaited too (progress a worker in the scheduler's
    # process sees).
    idle_wait: bool = False
    lookups: bool = False
    # The loads may be reported done before they land, where the daemon reports their progress: the
    # forwards that follow read them layer by layer (Worker.wait_for_layer). Set only in a step with
    # nothing to compute in vLLM's engine core in its own process, which sleeps 1 ms after such a step:
    # by the next forward the copy is under way. In-process, or after a forward, the next forward
    # would come at once and wait for the copy to begin, delaying every request it computes.
    early: bool = False
    forward: bool = True  # this step runs a forward (False: nothing scheduled)


# -- stats --------------------------------------------------------------------------------------


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """Worker-side counters per logging interval, summed across workers."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"loaded_blocks": 0, "load_failed_blocks": 0, "stored_blocks": 0, "store_failed_blocks": 0,
                     "load_seconds": [], "sidecar_unavailable": 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data.setdefault(key, []).extend(value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        delays = sorted(self.data.get("load_seconds", []))
        out: dict[str, int | float] = {k: v for k, v in self.data.items() if not isinstance(v, list)}
        out["load_delay_p50_ms"] = 1000 * delays[len(delays) // 2] if delays else 0.0
        out["load_delay_max_ms"] = 1000 * delays[-1] if delays else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values())


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The worker's counters on vLLM's /metrics (`vllm:kvstore_*`, per engine), and its load delays.
    vLLM's MultiConnector also requires them of every child that reports stats."""

    COUNTERS = {"loaded_blocks": "Blocks loaded from the kvstore sidecar",
                "load_failed_blocks": "Blocks that failed to load from the kvstore sidecar (recomputed)",
                "stored_blocks": "Blocks stored in the kvstore sidecar",
                "store_failed_blocks": "Blocks the kvstore sidecar failed to store"}

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls  # (vLLM types them as a union of the three kinds)
        histogram: Any = self._histogram_cls
        self.counters = {key: counter(name=f"vllm:kvstore_{key}_total", documentation=doc, labelnames=labelnames)
                         for key, doc in self.COUNTERS.items()}
        self.load_seconds = histogram(
            name="vllm:kvstore_load_seconds", documentation="Load jobs from submission to completion",
            labelnames=labelnames, buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, counter in self.counters.items():
            if transfer_stats_data.get(key):
                counter.labels(*labels).inc(transfer_stats_data[key])
        for seconds in transfer_stats_data.get("load_seconds", ()):
            self.load_seconds.labels(*labels).observe(seconds)
