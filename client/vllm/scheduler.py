"""The connector's scheduler side: vLLM's scheduler calls turned into planner calls (plan/), and the
planner's decisions carried out: lookups, lease releases and block descriptions on the session's
background thread, loads and stores in the step's metadata. Holds no tensors.

Every call runs on vLLM's engine step loop, most of them right after a forward pass with cold CPU
caches, where each object made and each attribute read costs: the per-step paths touch little (one
record per request, shared metadata for steps without jobs), and a lookup is only queued here: its
keys, its tail's hash and its RPC run on the session's background thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvstore_client.client import KVStoreClient, Session
from kvstore_client.vllm import compat, pacing
from kvstore_client.vllm.adapters import Adapters, KeyedRequest
from kvstore_client.vllm.common import (
    ConnectorSettings,
    KVStoreConnectorMetadata,
    group_spans,
    state_groups,
)
from kvstore_client.vllm.events import Announcer, describe
from kvstore_client.vllm.pacing import ProcessConnectors
from kvstore_client.vllm.plan import Lookup, Planner, Req, split_group_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_hashing: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None = None


def _vllm_hashing() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """vLLM's block-hashing helpers, imported once (not on every call: an import statement costs µs)."""
    global _hashing
    if _hashing is None:
        from vllm.multimodal.utils import get_mm_features_in_window
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

        _hashing = (generate_block_hash_extra_keys, hash_block_tokens, get_mm_features_in_window)
    return _hashing


# Metadata of steps without loads, stores or preemptions, shared (never changed once made): most steps.
_NO_JOBS = KVStoreConnectorMetadata()
_IDLE = {(wait, lookups): KVStoreConnectorMetadata(idle_wait=wait, lookups=lookups, forward=False)
         for wait in (False, True) for lookups in (False, True)}


class Scheduler:
    """vLLM's scheduler-side calls, over a Planner; the planner's Outside (hashing, leases, descriptions)."""

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, namespace: str,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        spans = group_spans(kv_cache_config)
        block_size = vllm_config.cache_config.block_size
        if spans is not None:
            assert kv_cache_config is not None
            block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        from vllm.utils.hashing import get_hash_fn_by_name

        self.hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        self.block_size = block_size
        self.settings = settings
        self.namespace = namespace  # one for every TP rank: a hit means every rank's shard is in
        self.client = KVStoreClient(settings.socket, timeout=settings.timeout_s)
        self.session: Session = self.client.session(namespace or "off", None, engine_id="vllm-scheduler",
                                                    wait=False)
        # vLLM's KV events on: this engine announces the namespace's pool and disk blocks as its CPU and
        # STORAGE tiers (client/vllm/events.py) and describes the blocks it stores.
        events = vllm_config.kv_events_config
        self.announcer: Announcer | None = None
        if namespace and settings.kv_events and events is not None and events.enable_kv_cache_events:
            groups = kv_cache_config.kv_cache_groups if spans is not None and kv_cache_config else None
            self.announcer = Announcer(self.session, block_size, groups)
        self.plan = Planner(block_size, spans, state_groups(kv_cache_config), self, load=settings.load,
                            store=settings.store, offer_blocks_per_step=settings.offer_blocks_per_step,
                            describe=self.announcer is not None, min_load_tokens=settings.min_load_tokens)
        self._handoff = threading.Lock()  # who releases the lease of a lookup dropped before its reply
        self.core_sleeps_when_idle = pacing.engine_core_sleeps_when_idle()
        # With several KV cache groups vLLM takes load failures only from requests still waiting for
        # their loads (failed_recving): a load is reported once it landed, never early.
        self.early_loads = (self.core_sleeps_when_idle and settings.layerwise_loads
                            and (kv_cache_config is None or len(kv_cache_config.kv_cache_groups) == 1))
        # vLLM 0.23 gives no block state: the block tables are kept from the scheduler output.
        self.tables = None if compat.LAYOUTS else compat.BlockTables()
        self.adapters = Adapters(self)
        self._keyed: dict[str, KeyedRequest] = {}  # LoRA requests as the planner sees them
        ProcessConnectors.schedulers += 1

    # -- vLLM's calls ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.lora_request is not None and (request := self._planned(request)) is None:
            return 0, False
        decision = self.plan.match(request, num_computed_tokens)
        if type(decision) is tuple:
            return decision
        assert isinstance(decision, Lookup)
        # All the rest (the keys, the tail's hash, the RPC) runs on the session's background thread:
        # this thread only queues it. A worker in this process waits for the reply in idle steps.
        wait_here = self.core_sleeps_when_idle and len(self.plan.reqs) == 1
        if wait_here:
            pacing.expect_reply()
        if not self.session.run_in_background(self._lookup, decision, request):
            self.plan.forget_lookup(request.request_id)  # the session is closed
            return 0, False
        if not (wait_here and pacing.wait_for_reply(decision)):
            return None, False
        return self.plan.answer(decision, request, num_computed_tokens)

    def on_new_request(self, request: Request) -> None:
        if request.lora_request is None or (request := self._planned(request)) is not None:
            self.plan.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        planned: Any = self._keyed.get(request.request_id, request) if request.lora_request is not None else request
        self.plan.allocated(planned, blocks.get_block_ids(), num_external_tokens)

    def _planned(self, request: Request) -> Any:
        """A LoRA request as the planner sees it (adapters.py); None where it is not cached."""
        if self.tables is not None and compat.uncacheable(request):
            return None
        keyed = self._keyed.get(request.request_id)
        if keyed is None or keyed.request is not request:
            if (made := self.adapters.keyed(request)) is None:
                return None
            keyed = self._keyed[request.request_id] = made
        return keyed

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        plan = self.plan
        tables = self.tables.update(scheduler_output) if self.tables is not None else None
        preempted = scheduler_output.preempted_req_ids
        if preempted:
            plan.preempted(preempted)
        if not scheduler_output.total_num_scheduled_tokens:
            wait, lookups = self._idle_wait()
            if not plan.loads and not preempted:
                return _IDLE[wait, lookups]
            return KVStoreConnectorMetadata(loads=plan.take_loads(), preempted=set(preempted or ()), idle_wait=wait,
                                            lookups=lookups, early=self.early_loads, forward=False)
        stores, flush = plan.plan_stores(scheduler_output.num_scheduled_tokens,
                                         tables or scheduler_output.kv_connector_block_state)
        if not plan.loads and not stores and not preempted and not flush:
            return _NO_JOBS
        return KVStoreConnectorMetadata(loads=plan.take_loads(), stores=stores, preempted=set(preempted or ()),
                                        flush=flush)

    def _idle_wait(self) -> tuple[bool, bool]:
        plan = self.plan
        return pacing.idle_wait(plan.lookups.values(), bool(plan.load_block_ids), self.core_sleeps_when_idle)

    def finish_loads(self, req_ids: set[str], invalid: set[int], failed: Collection[str]) -> None:
        self.plan.loaded(req_ids, invalid, failed)

    def request_finished(self, request: Request) -> bool:
        """True: vLLM keeps the blocks until the worker reports the request's stores done."""
        if self._keyed:
            self._keyed.pop(request.request_id, None)
        return self.plan.finished(request.request_id)

    # -- the planner's Outside -------------------------------------------------------------------

    def hash_tail(self, request: Request, start: int, end: int) -> bytes:
        """The hash vLLM's block hasher would give tokens [start, end) of a request after its full blocks
        (parent hash, token ids, the same extra keys: LoRA, multimodal inputs, cache_salt); a LoRA
        request's chained on its own keys (adapters.py)."""
        if isinstance(request, KeyedRequest):
            return request.hash_tail(start, end)
        parent = request.block_hashes[-1] if request.block_hashes else None
        return self.hash_tokens(parent, request.all_token_ids[start:end], self.extra_keys(request, start, end))

    def extra_keys(self, request: Request, start: int, end: int) -> tuple[Any, ...] | None:
        generate_block_hash_extra_keys, _, get_mm_features_in_window = _vllm_hashing()
        mm_index = 0
        if request.mm_features:
            mm_index, _ = get_mm_features_in_window(request.mm_features, start, end)
        return generate_block_hash_extra_keys(request, start, end, mm_index)[0]

    def hash_tokens(self, parent: bytes | None, tokens: Sequence[int], extra: tuple[Any, ...] | None) -> bytes:
        return _vllm_hashing()[1](self.hash_fn, parent, tokens, extra)

    def pool_epoch(self) -> int:
        return self.session.registrations

    def release(self, lookup: Lookup) -> None:
        """Give a lookup's lease back, also one whose reply is unread or still on its way (then the
        background thread does, when it comes). Releases run on the session's background thread: no
        RPC on the scheduler's."""
        if not lookup.read:
            with self._handoff:
                lookup.dropped = True
                if not lookup.replied:
                    return  # the background thread releases it
        lease_id, lookup.lease_id = lookup.lease_id, b""
        if lease_id:
            self.session.release_lease(lease_id)

    def describe(self, request: Request, keys: list[bytes]) -> None:
        """Describe these full blocks' keys to the daemon for routers' events, on the background thread
        (not a LoRA request's: its keys are not vLLM's hashes, which routers compute)."""
        if keys and not isinstance(request, KeyedRequest):
            self.session.run_in_background(self._send_descriptions, request, keys)

    def ask_pool(self, rec: Req, keys: Sequence[bytes]) -> None:
        self.session.run_in_background(self._ask_pool, rec, keys)

    # -- on the session's background thread ------------------------------------------------------

    def _lookup(self, state: Lookup, request: Request) -> None:
        """The request's keys looked up with a lease on the hits; the reply goes into `state`, `replied` last."""
        try:
            keys = self.plan.lookup_keys(state, request)
            if self.session.connected:
                state.hits, state.lease_id = self.session.lookup(keys, lease=True, group_spans=self.plan.spans or (),
                                                                 lease_ttl_ms=self.settings.lease_ttl_ms)
            else:
                state.unavailable = True
        except Exception as e:  # noqa: BLE001 - reported (and recomputed) by the scheduler thread
            state.hits, state.error = 0, e
        finally:
            with self._handoff:
                state.replied = True
                dropped = state.dropped
            ProcessConnectors.lookup_replied.set()
            if dropped and state.lease_id:
                self.session.release_lease(state.lease_id)

    def _ask_pool(self, rec: Req, keys: Sequence[bytes]) -> None:
        """How many of `keys` the pool holds (for offers)."""
        try:
            if self.session.connected:
                hits, _ = self.session.lookup(keys)
                self.plan.stores.pool_holds(rec, len(keys), hits)
        except Exception as e:  # noqa: BLE001 - an offer is a nicety: nothing to recompute
            log.debug("kvstore: asking the pool for %d blocks failed: %s", len(keys), e)

    def _send_descriptions(self, request: Request, keys: list[bytes]) -> None:
        index = {bytes(h): i for i, h in enumerate(request.block_hashes)}
        blocks = [index[k if self.plan.spans is None else split_group_key(k)[0]] for k in keys]
        self.session.describe_blocks(keys, describe(request, blocks, self.block_size))

    def close(self) -> None:
        ProcessConnectors.schedulers -= 1
        if self.announcer is not None:
            self.announcer.close()
        self.session.close()
        self.client.close()
