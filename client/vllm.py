"""vLLM 0.32 KV connector: offload KV blocks to the kvstore sidecar and load them back.

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore_client.vllm", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"socket": "/run/kvstore/kvstore.sock"}}'

Scheduler side (no tensors): looks a request's block hashes up in the sidecar asynchronously
(`get_num_new_matched_tokens` answers None, "ask again", until the reply is in), pins the hits with a
lease, pairs keys with the engine blocks vLLM allocates, and plans each step's loads and stores.
Worker side: moves the KV cache into shared memory (CPU) and registers it, submits the planned jobs
without waiting, and polls their completions from shared memory in the steps that have jobs in
flight. No RPC is ever made on the engine's step loop (lookups and lease releases run on the
session's background thread); if the sidecar is down, lookups miss, loads fail (vLLM recomputes)
and stores are dropped, and the connector reconnects on its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore_client.client import KVStoreClient, Session
from kvstore_client.device import export_kv_memory, synchronize_before_store
from kvstore_client.errors import KVStoreError
from kvstore_client.layouts import KV_TUPLES, UnsupportedKVCache, describe_kv_cache, heads_first
from kvstore_client.protocol.completion import Completion
from kvstore_client.shm import SharedKVMemory, move_to_shared_memory, shared_memory_spec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PREEMPTION_WAIT_S = 30.0
# A step with nothing to compute while the connector waits on the sidecar sleeps this long: vLLM
# spins such steps back to back, and the spinning thread holds the GIL and a core that the
# lookup/submit threads and the daemon's copies need.
IDLE_WAIT_S = 0.0005


# -- settings and identity ----------------------------------------------------------------------


@dataclass(frozen=True)
class ConnectorSettings:
    socket: str | None = None
    tenant_salt: str = ""
    timeout_s: float = 5.0
    lease_ttl_ms: int = 120_000
    store: bool = True  # offload newly computed full blocks (eagerly, each step)
    load: bool = True
    # The KV cache layout asked of vLLM where the attention backend allows it: block-outermost gives
    # one run of every layer per block (large copies). "" lets vLLM choose.
    kv_layout: str = "BLHNC"

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

    def stores(self, tp_rank: int, block_id: int) -> bool:
        """Replicas split the stores of their shard: each stores the blocks `block_id % replicas`
        names, so an MLA latent is stored once, the work spread over the ranks."""
        return block_id % self.replicas == tp_rank % self.replicas


def page_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str:
    """How a page's bytes are ordered in the pool: by head then token (HNC), by token then head
    (NHC), or vllm-ascend's K and V tensors. Layouts that differ only in where the layer and block
    axes sit give the same pool bytes (kvstore_client.layouts), so they share a namespace."""
    from vllm.platforms import current_platform

    if current_platform.device_type == "npu":
        return KV_TUPLES.lower()
    layout = (kv_cache_config.kv_cache_layout if kv_cache_config is not None else None) \
        or vllm_config.cache_config.kv_cache_layout
    if layout is None:
        raise UnsupportedKVCache("the KV cache layout is not resolved")
    return "HNC" if heads_first(layout) else "NHC"


def namespace_for(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, tenant_salt: str) -> str:
    """Blocks are shareable exactly when model, KV page format, hashing, TP sharding and tenant match:
    every rank of an engine (and the scheduler) names the same namespace; a block holds every shard."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    dtype = cache.cache_dtype if cache.cache_dtype != "auto" else str(model.dtype).removeprefix("torch.")
    parts = [
        f"model={model.model}",
        f"dtype={dtype}",
        f"block={cache.block_size}",
        f"layers={model.get_num_layers(parallel)}",
        f"kv_heads={model.get_num_kv_heads(parallel)}",
        f"head={model.get_head_size()}",
        f"hash={cache.prefix_caching_hash_algo}",
        f"page={page_format(vllm_config, kv_cache_config)}",
        f"kv_shards={Sharding.of(vllm_config, kv_cache_config).shards}",
    ]
    if tenant_salt:
        parts.append(f"salt={tenant_salt}")
    return ";".join(parts)


def unsupported(vllm_config: VllmConfig) -> str:
    """Why the connector cannot serve this engine ("" if it can)."""
    parallel = vllm_config.parallel_config
    others = {"pipeline": parallel.pipeline_parallel_size, "decode context": parallel.decode_context_parallel_size,
              "prefill context": getattr(parallel, "prefill_context_parallel_size", 1)}
    used = [f"{name} parallel size {size}" for name, size in others.items() if size > 1]
    return f"{', '.join(used)}: only tensor parallelism is supported" if used else ""


# -- scheduler -> worker ------------------------------------------------------------------------


@dataclass
class Transfer:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    partial_tail: bool = False  # store: the last key is the prompt's partial last block


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    idle_wait: bool = False  # nothing scheduled while lookups or loads are in flight: sleep IDLE_WAIT_S


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


# -- the connector ------------------------------------------------------------------------------


class KVStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer is None:  # vLLM creates a connector only from a kv_transfer_config
            raise ValueError("KVStoreConnector needs vllm_config.kv_transfer_config")
        self.settings = ConnectorSettings.from_extra_config(dict(transfer.kv_connector_extra_config or {}))
        # A cache miss is never fatal: a block that fails to load is recomputed.
        transfer.kv_load_failure_policy = "recompute"
        try:
            why = unsupported(vllm_config)
            namespace = "" if why else namespace_for(vllm_config, kv_cache_config, self.settings.tenant_salt)
        except (UnsupportedKVCache, ValueError) as e:
            why = str(e)
        if why:
            log.error("kvstore connector off for this engine (vLLM recomputes): %s", why)
            self.settings = replace(self.settings, load=False, store=False)
        self.scheduler: _Scheduler | None = None
        self.worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = _Scheduler(vllm_config, self.settings, namespace)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = _Worker(vllm_config, kv_cache_config, self.settings, namespace,
                                  get_tensor_model_parallel_rank())

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout to ask vLLM for (setting kv_layout); vLLM keeps its own where the attention
        backend does not support it (the CPU backend has LBHNC only)."""
        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {}) if transfer is not None else {}
        return ConnectorSettings.from_extra_config(extra).kv_layout or None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped store is a future miss, never a correctness problem

    # scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        if self.scheduler is not None:
            self.scheduler.requests[request.request_id] = request

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request), None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data) if data else {})

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def _meta(self) -> KVStoreConnectorMetadata:
        meta = self._connector_metadata
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta

    def has_connector_metadata(self) -> bool:
        # Always False: vLLM's attention layers then skip wait_for_layer_load/save_kv_layer, two
        # calls per layer and step (~50 µs a step) that have nothing to do here. In vLLM 0.32 only
        # those layer hooks ask; this connector reads its metadata with _meta().
        return False

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None and isinstance(kv_connector_metadata, KVStoreConnectorMetadata)
        if kv_connector_metadata.preempted:
            self.worker.flush(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker is not None
        loads = self._meta().loads
        if loads:
            self.worker.start_loads(loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads finish before the request is scheduled (asynchronous loading)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # whole blocks are stored after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        assert self.worker is not None
        stores = self._meta().stores
        if stores:
            self.worker.start_stores(stores)  # submits and returns: never waits for the copies

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.worker is not None
        if self._meta().idle_wait:
            time.sleep(IDLE_WAIT_S)
        return self.worker.transfer_results(finished_req_ids)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.worker.take_stats() if self.worker is not None else None

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()


@dataclass
class _Lookup:
    keys: list[bytes]  # looked up: the full blocks' hashes, then the prompt's partial tail's key if any
    tail: int  # tokens of the tail key (0: none)
    future: Future[tuple[int, bytes]] | None
    hits: int = 0  # leading keys present
    lease_id: bytes = b""
    start: int = 0  # vLLM's local hit (blocks) when we last answered: the load starts there

    def cached_tokens(self, block_size: int) -> int:
        """Tokens the present keys hold."""
        if self.tail and self.hits == len(self.keys):
            return (self.hits - 1) * block_size + self.tail
        return self.hits * block_size


class _Scheduler:
    """Bookkeeping only: keys, block ids, leases. Holds no tensors."""

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, namespace: str) -> None:
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        from vllm.utils.hashing import get_hash_fn_by_name

        self.hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        self.namespace = namespace  # one for every TP rank: a hit means every rank's shard is in
        self.client = KVStoreClient(settings.socket, timeout=settings.timeout_s)
        self.session: Session = self.client.session(namespace or "off", None, engine_id="vllm-scheduler",
                                                    wait=False)
        self.requests: dict[str, Request] = {}
        self.lookups: dict[str, _Lookup] = {}
        self.loads: list[Transfer] = []
        self.stored_upto: dict[str, int] = {}  # blocks of the request already sent for store
        self.had_stores: set[str] = set()
        self.load_failed: set[str] = set()  # requests whose load failed: recompute, never offer again
        self.load_block_ids: dict[str, set[int]] = {}
        self.tails_done: set[str] = set()  # requests whose prompt tail is stored or was loaded
        self.unavailable_warned = False
        self.lookup_errors = 0

    def _available(self) -> bool:
        if self.session.connected:
            self.unavailable_warned = False
            return True
        if not self.unavailable_warned:
            log.warning("kvstore sidecar unavailable: serving without it (recompute) until it is back")
            self.unavailable_warned = True
        return False

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        self.requests.setdefault(req_id, request)
        start = num_computed_tokens // self.block_size
        full = len(request.block_hashes)
        if not self.settings.load or req_id in self.load_failed:
            return 0, False
        # The lookup covers the whole prompt (its full blocks and its partial tail) and is asked once
        # per request: vLLM's local hit (`start`) can move between calls while blocks churn, and a
        # lookup keyed on it would be asked afresh forever.
        state = self.lookups.get(req_id)
        if state is None or len(state.keys) - (1 if state.tail else 0) != full:
            if state is not None:
                self._release(state)
            keys: list[bytes] = list(request.block_hashes)
            tail = self._tail(request)
            if tail is not None:
                keys.append(tail[0])
            if len(keys) <= start or not self._available():
                return 0, False
            future = self.session.lookup_future(keys, lease=True, lease_ttl_ms=self.settings.lease_ttl_ms)
            self.lookups[req_id] = _Lookup(keys, tail[1] if tail is not None else 0, future)
            return None, False
        if state.future is not None:
            if not state.future.done():
                return None, False
            try:
                state.hits, state.lease_id = state.future.result()
            except KVStoreError as e:
                self.lookup_errors += 1
                log.warning("kvstore lookup failed (%s); recomputing", e)
            state.future = None
        state.start = start
        # Every cached token but the last: vLLM computes at least one token (a full hit loads the
        # last block whole and recomputes only its final token).
        cached = min(state.cached_tokens(self.block_size), request.num_tokens - 1)
        if cached <= num_computed_tokens:
            return 0, False
        return cached - num_computed_tokens, True

    def _tail(self, request: Request) -> tuple[bytes, int] | None:
        """(key, tokens) of a fresh prompt's partial last block: the hash vLLM's block hasher would
        give it (parent hash, its token ids, the same extra keys: LoRA, multimodal inputs,
        cache_salt). Its token tuple is shorter than a full block's, so it never equals one's key."""
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

        full, end = len(request.block_hashes), request.num_prompt_tokens
        start = full * self.block_size
        if request.num_tokens != end or not 0 < end - start < self.block_size:
            return None  # no partial tail, or not a fresh prompt (resumed with output tokens)
        mm_index = 0
        if request.mm_features:
            from vllm.multimodal.utils import get_mm_features_in_window

            mm_index, _ = get_mm_features_in_window(request.mm_features, start, end)
        extra, _ = generate_block_hash_extra_keys(request, start, end, mm_index)
        parent = request.block_hashes[-1] if full else None
        key = hash_block_tokens(self.hash_fn, parent, request.all_token_ids[start:end], extra)
        return key, end - start

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        state = self.lookups.get(req_id)
        if num_external_tokens == 0 or state is None:
            return
        count = -(-num_external_tokens // self.block_size)  # the last one may be loaded for part of its tokens
        block_ids = blocks.get_block_ids()[0][state.start : state.start + count]
        keys = state.keys[state.start : state.start + count]
        self.loads.append(Transfer(req_id, keys, list(block_ids)))
        self.load_block_ids[req_id] = set(block_ids)
        # Loaded full blocks need no store; a loaded tail's block does once output tokens fill it.
        loaded_full = min(state.start + count, len(request.block_hashes))
        self.stored_upto[req_id] = max(self.stored_upto.get(req_id, 0), loaded_full)
        if state.tail and state.hits == len(state.keys):  # the tail is in the pool: no need to store it
            self.tails_done.add(req_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self.loads)
        self.loads = []
        if scheduler_output.preempted_req_ids:
            meta.preempted = set(scheduler_output.preempted_req_ids)
            for req_id in meta.preempted:  # it starts over: look it up afresh when it is back
                state = self.lookups.pop(req_id, None)
                if state is not None:
                    self._release(state)
        if not scheduler_output.total_num_scheduled_tokens:
            meta.idle_wait = bool(self.load_block_ids) or any(
                s.future is not None and not s.future.done() for s in self.lookups.values())
            return meta
        block_state = scheduler_output.kv_connector_block_state
        if self.settings.store and block_state is not None:
            requests = self.requests
            for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
                request = requests.get(req_id)
                if request is not None:
                    self._plan_store(request, scheduled, block_state, meta.stores)
        return meta

    def _plan_store(self, request: Request, scheduled: int, block_state: Any, stores: list[Transfer]) -> None:
        """The blocks of a request whose KV this step's forward completes: full blocks (most steps:
        none new), and the prompt's partial tail in the step that finishes the prompt."""
        req_id, size = request.request_id, self.block_size
        computed = request.num_computed_tokens
        first = self.stored_upto.get(req_id)
        if first is None:  # blocks vLLM had cached locally when the request arrived
            first = self.stored_upto[req_id] = computed // size
        done = (computed + scheduled) // size
        tail = computed < request.num_prompt_tokens <= computed + scheduled and req_id not in self.tails_done
        if done <= first and not tail:
            return
        done = min(done, len(request.block_hashes))  # ... and hashed
        ids = block_state.get_block_ids(req_id)
        if ids is None:
            return
        keys: list[bytes] = list(request.block_hashes[first:done])
        block_ids = list(ids[0][first:done])
        tail_key = self._tail(request) if tail else None
        if tail_key is not None:
            keys.append(tail_key[0])
            block_ids.append(ids[0][request.num_prompt_tokens // size])
            self.tails_done.add(req_id)
        if keys:
            stores.append(Transfer(req_id, keys, block_ids, tail_key is not None))
            self.had_stores.add(req_id)
        self.stored_upto[req_id] = max(first, done)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if not connector_output.finished_recving:
            return  # load errors come with the request's finished_recving
        invalid = connector_output.invalid_block_ids
        for req_id in connector_output.finished_recving:
            state = self.lookups.pop(req_id, None)
            if state is not None:
                self._release(state)
            block_ids = self.load_block_ids.pop(req_id, None)
            if invalid and block_ids and not invalid.isdisjoint(block_ids):
                self.load_failed.add(req_id)

    def request_finished(self, request: Request) -> bool:
        """True: vLLM keeps the blocks until the worker reports the request's stores done."""
        req_id = request.request_id
        state = self.lookups.pop(req_id, None)
        if state is not None:
            self._release(state)
        self.requests.pop(req_id, None)
        self.stored_upto.pop(req_id, None)
        self.load_failed.discard(req_id)
        self.load_block_ids.pop(req_id, None)
        self.tails_done.discard(req_id)
        if req_id in self.had_stores:
            self.had_stores.discard(req_id)
            return True
        return False

    def _release(self, state: _Lookup) -> None:
        """Give a lookup's lease back, also one whose answer is unread or still on its way. The
        release runs on the session's background thread: no RPC on the scheduler's."""
        future, lease_id = state.future, state.lease_id
        state.future, state.lease_id = None, b""
        if future is not None:
            future.add_done_callback(self._release_late)  # at once if the answer is in
        elif lease_id:
            self.session.release_lease(lease_id)

    def _release_late(self, future: Future[tuple[int, bytes]]) -> None:
        if not future.cancelled() and future.exception() is None and future.result()[1]:
            self.session.release_lease(future.result()[1])

    def close(self) -> None:
        self.session.close()
        self.client.close()


class _Worker:
    """Moves bytes: registers the KV memory, submits jobs, reports completions."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings,
                 namespace: str, rank: int) -> None:
        self.settings = settings
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.namespace = namespace  # "": the connector is off for this engine
        self.rank = rank  # in the TP group
        self.sharding = Sharding.of(vllm_config, kv_cache_config) if namespace else Sharding(1, 1)
        self.client = KVStoreClient(settings.socket, timeout=settings.timeout_s)
        self.session: Session | None = None  # None: the connector is off for this engine
        self.device: torch.device | None = None
        self.memories: list[SharedKVMemory] = []
        self.refused_loads: set[str] = set()  # loads planned while off: failed, reported as done
        self.load_jobs: dict[int, tuple[str, list[int], float]] = {}  # job -> request, block ids, submit time
        self.store_jobs: dict[int, str] = {}  # job -> request
        self.loads_left: dict[str, int] = {}
        self.stores_left: dict[str, int] = {}
        self.finished_waiting: set[str] = set()  # finished requests whose stores are in flight
        self.had_stores: set[str] = set()
        self.load_errors: set[int] = set()
        self.stats = KVStoreConnectorStats()
        self.stats_changed = False  # spares the per-step is_empty() scan of the counters

    def register(self, kv_caches: Mapping[str, torch.Tensor | tuple[torch.Tensor, ...]]) -> None:
        """Describe the KV memory from vLLM's own placement (kvstore_client.layouts) and register it;
        what cannot be described exactly leaves the connector off (vLLM recomputes), never guessing."""
        if not self.namespace:
            return
        try:
            layout = self.vllm_config.cache_config.kv_cache_layout
            description = describe_kv_cache(self.kv_cache_config, kv_caches, layout)
        except UnsupportedKVCache as e:
            log.error("kvstore connector off for this engine (vLLM recomputes): %s", e)
            return
        regions = [(r.offset, r.block_stride, r.block_bytes, r.memory) for r in description.regions]
        self.device = description.memories[0].device
        if self.device.type == "cpu":
            # The daemon maps shared-memory files: move the KV allocations there, in place (every tensor
            # vLLM holds of them, also of layers that share another layer's cache).
            addresses = [m.untyped_storage().data_ptr() for m in description.memories]
            tensors = [t for v in kv_caches.values() for t in (v if isinstance(v, (tuple, list)) else (v,))]
            moved = move_to_shared_memory(tensors)
            self.memories = [moved[a] for a in addresses]
            spec = shared_memory_spec(self.memories, description.num_blocks, regions)
        else:  # cuda/npu: the daemon opens the allocations by IPC
            spec = export_kv_memory(description.memories, description.num_blocks, regions)
        spec = replace(spec, shards=self.sharding.shards, shard=self.sharding.shard(self.rank))
        self.session = self.client.session(self.namespace, spec, engine_id=f"vllm-worker-tp{self.rank}", wait=False)
        log.info("kvstore: registered %s KV cache (%d regions in %d allocations, %d blocks, shard %d of %d) in "
                 "namespace %s", description.layout, len(regions), len(description.memories), spec.num_blocks,
                 spec.shard, spec.shards, self.namespace)

    def start_loads(self, loads: list[Transfer]) -> None:
        if self.session is None:  # off: every planned load fails (vLLM recomputes those blocks)
            for t in loads:
                self.load_errors.update(t.block_ids)
                self.refused_loads.add(t.req_id)
            return
        for t in loads:
            job = self.session.load(t.keys, t.block_ids)
            self.load_jobs[job] = (t.req_id, t.block_ids, time.monotonic())
            self.loads_left[t.req_id] = self.loads_left.get(t.req_id, 0) + 1

    def start_stores(self, stores: list[Transfer]) -> None:
        if self.session is None:
            return  # off: nothing stored, and nothing keeps a finished request's blocks
        if self.sharding.replicas > 1:  # replicas of a shard split its stores
            rank, sharding = self.rank, self.sharding
            stores = [Transfer(t.req_id, [k for k, _ in kept], [b for _, b in kept],
                               t.partial_tail and kept[-1][0] == t.keys[-1])
                      for t in stores
                      if (kept := [(k, b) for k, b in zip(t.keys, t.block_ids, strict=True)
                                   if sharding.stores(rank, b)])]
        if stores and self.device is not None:
            synchronize_before_store(self.device)  # the daemon may read the blocks as soon as a job arrives
        for t in stores:
            job = self.session.store(t.keys, t.block_ids, t.partial_tail)
            self.store_jobs[job] = t.req_id
            self.stores_left[t.req_id] = self.stores_left.get(t.req_id, 0) + 1
            self.had_stores.add(t.req_id)

    def flush(self, preempted: set[str]) -> None:
        """A preempted request's blocks may be reused right away: its stores must finish first."""
        jobs = [j for j, r in self.store_jobs.items() if r in preempted]
        if jobs and self.session is not None:
            try:
                for completion in self.session.wait(jobs, timeout=PREEMPTION_WAIT_S).values():
                    self._completed(completion)
            except TimeoutError:
                log.error("kvstore: stores of preempted requests did not finish in %ss", PREEMPTION_WAIT_S)

    def transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Requests whose loads are all done (recving) and finished requests whose stores are (sending)."""
        results = KVConnectorTransferResults()
        if self.session is None:
            results.finished_recving.update(self.refused_loads)
            self.refused_loads.clear()
            return results
        if not self.session.connected:
            self.stats.data["sidecar_unavailable"] = 1
            self.stats_changed = True
        # Every job is in load_jobs/store_jobs until its completion is seen: with none, and no
        # request waiting for its stores, there is nothing to poll (most decode steps).
        if not (self.load_jobs or self.store_jobs or self.finished_waiting or finished_req_ids):
            return results
        for completion in self.session.poll():
            loaded = self._completed(completion)
            if loaded is not None:
                results.finished_recving.add(loaded)
        if finished_req_ids:
            self.finished_waiting.update(r for r in finished_req_ids if r in self.had_stores)
        if self.finished_waiting:
            sending = results.finished_sending
            sending.update(r for r in self.finished_waiting if r not in self.stores_left)
            self.finished_waiting -= sending
            self.had_stores -= sending
        return results

    def _completed(self, c: Completion) -> str | None:
        """Account for a finished job; returns the request whose loads are now all done, if any."""
        self.stats_changed = True
        if c.job_id in self.load_jobs:
            req_id, block_ids, submitted = self.load_jobs.pop(c.job_id)
            self.stats.data["load_seconds"].append(time.monotonic() - submitted)
            if c.ok:
                self.stats.data["loaded_blocks"] += c.blocks_ok
            else:
                # Which blocks failed is not in the completion word: recompute them all.
                self.load_errors.update(block_ids)
                self.stats.data["load_failed_blocks"] += len(block_ids)
            self.loads_left[req_id] -= 1
            if self.loads_left[req_id] == 0:
                del self.loads_left[req_id]
                return req_id
        elif c.job_id in self.store_jobs:
            req_id = self.store_jobs.pop(c.job_id)
            self.stats.data["stored_blocks"] += c.blocks_ok
            self.stats.data["store_failed_blocks"] += c.blocks_failed
            self.stores_left[req_id] -= 1
            if self.stores_left[req_id] == 0:
                del self.stores_left[req_id]
        return None

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def take_stats(self) -> KVStoreConnectorStats | None:
        if not self.stats_changed:
            return None
        self.stats_changed = False
        stats, self.stats = self.stats, KVStoreConnectorStats()
        return None if stats.is_empty() else stats

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        self.client.close()
        for memory in self.memories:
            memory.close()  # the engine's KV tensors keep their own mapping
