"""The connector's scheduler side: bookkeeping only (keys, block ids, leases); holds no tensors.

Every call runs on vLLM's engine step loop, most of them right after a forward pass with cold CPU
caches, where each object made and each attribute read costs: the per-step paths touch little (one
record per request, shared metadata for steps without jobs), and a lookup is only queued here: its
keys, its tail's hash and its RPC run on the session's background thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvstore_client.client import KVStoreClient, Session
from kvstore_client.protocol.groups import needed_blocks
from kvstore_client.vllm.common import (
    LOOKUP_WAIT_S,
    ConnectorSettings,
    InProcess,
    KVStoreConnectorMetadata,
    Transfer,
    engine_core_sleeps_when_idle,
    group_key,
    group_spans,
    split_group_key,
    state_groups,
)
from kvstore_client.vllm.events import Announcer, describe

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_hashing: tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None = None
# Keys the pool holds as far as this scheduler knows (the last key of each prefix it stored, found,
# or offered), kept until the session re-registers (a new daemon may have an empty pool): at most
# this many, oldest dropped first.
KNOWN_KEYS = 65536


def _vllm_hashing() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """vLLM's block-hashing helpers, imported once (not on every call: an import statement costs µs)."""
    global _hashing
    if _hashing is None:
        from vllm.multimodal.utils import get_mm_features_in_window
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, hash_block_tokens

        _hashing = (generate_block_hash_extra_keys, hash_block_tokens, get_mm_features_in_window)
    return _hashing


class _Lookup:
    """One request's lookup, and its own future: the background thread fills in the reply and sets
    `replied` last; the scheduler reads it once (`read`). A lookup released before its reply came is
    `dropped`: the background thread then gives its lease back (`Scheduler._handoff` decides who).
    Defaults are class attributes: making one sets a single attribute (cheaper with cold caches)."""

    keys: Sequence[bytes] = ()  # looked up: the full blocks' hashes, then the partial tail's key if any
    tail = 0  # tokens of the tail key (0: none)
    hits = 0  # leading keys present (several KV cache groups: blocks of the hit every group serves)
    lease_id = b""
    error: BaseException | None = None
    unavailable = False  # the sidecar was not connected: nothing looked up
    replied = False
    read = False
    dropped = False
    start = 0  # vLLM's local hit (blocks) when we last answered: the load starts there

    def __init__(self, full: int) -> None:
        self.full = full  # the request's full blocks when it was looked up

    def cached_tokens(self, block_size: int) -> int:
        """Tokens the present keys hold."""
        if self.tail and self.hits == len(self.keys):
            return (self.hits - 1) * block_size + self.tail
        return self.hits * block_size


class _Req:
    """What the scheduler keeps per request, in one place (one dict operation per request and step).
    Defaults are class attributes, as in _Lookup."""

    stored_upto = -1  # blocks already sent for store (-1: not known yet)
    had_stores = False  # stores were planned: vLLM keeps its blocks until they are done
    load_failed = False  # its load failed: recompute, never offer again
    tail_done = False  # its prompt's partial tail is stored, or was in the pool
    store_at = 0  # computed tokens before which it has nothing new to store (_plan_store's lower bound)
    # Blocks vLLM had locally when it was scheduled (`local`), of which the pool holds the first
    # `pool_has` (-1: not known): the rest is offered to the pool (Scheduler._plan_offers).
    local = 0
    pool_has = -1
    # Sliding-window blocks and Mamba states stored, (group, block index, block id): vLLM frees such a block
    # once out of its window (a state once the next is computed), without telling the connector, and may
    # reuse it in the next forward (see _volatile_freed).
    volatile: list[tuple[int, int, int]] | None = None

    def __init__(self, request: Request) -> None:
        self.request = request


# Metadata of steps without loads, stores or preemptions, shared (never changed once made): most steps.
_NO_JOBS = KVStoreConnectorMetadata()
_IDLE = {(wait, lookups): KVStoreConnectorMetadata(idle_wait=wait, lookups=lookups, forward=False)
         for wait in (False, True) for lookups in (False, True)}


class Scheduler:
    """Bookkeeping only: keys, block ids, leases. Holds no tensors."""

    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings, namespace: str,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # Several KV cache groups, or one of a sliding window or states: per group the blocks a hit needs
        # before it (kvstore_client.protocol.groups); None: one full-attention group (today's keys and
        # namespace). Mamba states (`states`) are stored as vLLM offers them, not per block.
        self.spans = group_spans(kv_cache_config)
        self.states = state_groups(kv_cache_config)
        if self.spans is not None:  # no partial-tail keys and no offers for grouped keys (yet)
            settings = replace(settings, offer_blocks_per_step=0)
        self.settings = settings
        self.block_size = vllm_config.cache_config.block_size
        if self.spans is not None:
            assert kv_cache_config is not None
            self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        from vllm.utils.hashing import get_hash_fn_by_name

        self.hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        self.namespace = namespace  # one for every TP rank: a hit means every rank's shard is in
        self.client = KVStoreClient(settings.socket, timeout=settings.timeout_s)
        self.session: Session = self.client.session(namespace or "off", None, engine_id="vllm-scheduler",
                                                    wait=False)
        # vLLM's KV events on: this engine announces the namespace's pool blocks as its CPU tier
        # (client/vllm/events.py) and describes the blocks it stores.
        events = vllm_config.kv_events_config
        self.announcer: Announcer | None = None
        if namespace and settings.kv_events and events is not None and events.enable_kv_cache_events:
            self.announcer = Announcer(self.session, self.block_size,
                                       kv_cache_config.kv_cache_groups if self.spans is not None and kv_cache_config
                                       else None)
        self.reqs: dict[str, _Req] = {}
        self.lookups: dict[str, _Lookup] = {}
        self.loads: list[Transfer] = []
        self.load_block_ids: dict[str, set[int]] = {}  # loads in flight
        self.unavailable_warned = False
        self.lookup_errors = 0
        self.known: dict[bytes, None] = {}  # see KNOWN_KEYS
        self.known_registration = 0
        self.offers: list[_Req] = []  # requests with blocks to offer (appended by the background thread too)
        self._handoff = threading.Lock()  # who releases the lease of a lookup dropped before its reply
        self.core_sleeps_when_idle = engine_core_sleeps_when_idle()
        # With several KV cache groups vLLM takes load failures only from requests still waiting for
        # their loads (failed_recving): a load is reported once it landed, never early.
        self.early_loads = (self.core_sleeps_when_idle and settings.layerwise_loads
                            and (kv_cache_config is None or len(kv_cache_config.kv_cache_groups) == 1))
        InProcess.schedulers += 1

    def on_new_request(self, request: Request) -> None:
        self.reqs[request.request_id] = _Req(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        rec = self.reqs.get(req_id)
        if rec is None:
            rec = self.reqs[req_id] = _Req(request)
        if not self.settings.load or rec.load_failed:
            return 0, False
        start = num_computed_tokens // self.block_size
        full = len(request.block_hashes)
        # The lookup covers the whole prompt (its full blocks and its partial tail) and is asked once
        # per request: vLLM's local hit (`start`) can move between calls while blocks churn, and a
        # lookup keyed on it would be asked afresh forever.
        state = self.lookups.get(req_id)
        if state is None or state.full != full:
            if state is not None:
                self._release(state)
            tail = self._has_tail(request, full)
            if full + tail <= start:  # vLLM has every block locally: does the pool?
                self._check_pool(rec, request, min(start, full))
                return 0, False
            # All the rest (the keys, the tail's hash, the RPC) runs on the session's background thread:
            # this thread only queues it. A worker in this process waits for the reply in idle steps.
            state = self.lookups[req_id] = _Lookup(full)
            # vLLM's engine core in a process of its own turns a step with nothing to run into a round
            # trip to the workers and a 1 ms sleep: with no other request in the engine, waiting for
            # the reply here (at most LOOKUP_WAIT_S) is cheaper, and the load starts this step.
            wait_here = self.core_sleeps_when_idle and len(self.reqs) == 1
            if wait_here:
                InProcess.lookup_replied.clear()
            if not self.session.run_in_background(self._lookup, state, request, tail):
                del self.lookups[req_id]  # the session is closed
                return 0, False
            if not (wait_here and InProcess.lookup_replied.wait(LOOKUP_WAIT_S) and state.replied):
                return None, False
        if not state.read:
            if not state.replied:
                return None, False
            self._read(state, rec, min(start, full))
        state.start = start
        cached = self._cached(state, start, request.num_tokens)
        if cached <= num_computed_tokens:
            return 0, False
        return cached - num_computed_tokens, True

    def group_keys(self, hashes: Sequence[bytes]) -> list[bytes]:
        """Every group's key of each block, block by block: [block 0 of group 0, of group 1, ..., block 1 of
        group 0, ...]. The pool's count of leading present keys then gives the blocks every group holds."""
        groups = range(len(self.spans or ()))
        return [group_key(h, g) for h in hashes for g in groups]

    def _cached(self, state: _Lookup, start: int, num_tokens: int) -> int:
        """Tokens a lookup's reply lets vLLM skip, from the first (vLLM's local hit: `start` blocks)."""
        if self.spans is None:
            # Every cached token but the last: vLLM computes at least one token (a full hit loads the
            # last block whole and recomputes only its final token).
            return min(state.cached_tokens(self.block_size), num_tokens - 1)
        # Several groups: the daemon answered with the blocks every group serves by vLLM's rule (whole
        # blocks, all but the last token at most: the lookup covered no more, see _lookup).
        return state.hits * self.block_size

    def _read(self, state: _Lookup, rec: _Req, local: int) -> None:
        """Take a lookup's reply (once): its errors and the sidecar's absence are logged here; `local`:
        the blocks vLLM holds itself, offered to the pool where it lacks them."""
        state.read = True
        if state.error is not None:
            self.lookup_errors += 1
            log.warning("kvstore lookup failed (%s); recomputing", state.error)
        elif not state.unavailable:
            self.unavailable_warned = False
            self._pool_holds(rec, local, state.hits)
        elif not self.unavailable_warned:
            log.warning("kvstore sidecar unavailable: serving without it (recompute) until it is back")
            self.unavailable_warned = True

    def _lookup(self, state: _Lookup, request: Request, tail: bool) -> None:
        """On the session's background thread: the keys of the request's first `state.full` blocks and
        of its prompt's partial tail (`tail`), looked up with a lease on the hits; the reply goes into
        `state`, `replied` last."""
        try:
            hashes = request.block_hashes[: state.full]
            if self.spans is not None:  # whole blocks before the last token: a Mamba state is needed exactly there
                hashes = hashes[: (request.num_tokens - 1) // self.block_size]
            keys: list[bytes] = list(hashes) if self.spans is None else self.group_keys(hashes)
            if tail and (tail_key := self._tail(request)) is not None:
                keys.append(tail_key[0])
                state.tail = tail_key[1]
            state.keys = keys
            if self.session.connected:
                state.hits, state.lease_id = self.session.lookup(keys, lease=True, group_spans=self.spans or (),
                                                                 lease_ttl_ms=self.settings.lease_ttl_ms)
            else:
                state.unavailable = True
        except Exception as e:  # noqa: BLE001 - reported (and recomputed) by the scheduler thread
            state.hits, state.error = 0, e
        finally:
            with self._handoff:
                state.replied = True
                dropped = state.dropped
            InProcess.lookup_replied.set()
            if dropped and state.lease_id:
                self.session.release_lease(state.lease_id)

    # -- offers: blocks vLLM holds and the pool lacks -------------------------------------------

    def _knows(self, key: bytes) -> bool:
        if self.known_registration != self.session.registrations:  # a new daemon: forget
            self.known.clear()
            self.known_registration = self.session.registrations
        return key in self.known

    def _remember(self, key: bytes) -> None:
        known = self.known
        known[key] = None
        if len(known) > KNOWN_KEYS:
            del known[next(iter(known))]

    def _check_pool(self, rec: _Req, request: Request, local: int) -> None:
        """vLLM serves the request's first `local` blocks itself: unless this scheduler knows the pool
        holds them, ask (on the background thread, no lease) and offer what it lacks."""
        if not self.settings.offer_blocks_per_step or not local or rec.pool_has >= 0 or rec.local:
            return
        keys = request.block_hashes[:local]
        rec.local = local
        if self._knows(keys[-1]):
            rec.pool_has = local
            return
        self.session.run_in_background(self._ask_pool, rec, keys)

    def _ask_pool(self, rec: _Req, keys: Sequence[bytes]) -> None:
        """On the session's background thread: how many of `keys` the pool holds."""
        try:
            if self.session.connected:
                hits, _ = self.session.lookup(keys)
                self._pool_holds(rec, len(keys), hits)
        except Exception as e:  # noqa: BLE001 - an offer is a nicety: nothing to recompute
            log.debug("kvstore: asking the pool for %d blocks failed: %s", len(keys), e)

    def _pool_holds(self, rec: _Req, local: int, hits: int) -> None:
        rec.local = local
        rec.pool_has = hits
        if hits < local and self.settings.offer_blocks_per_step and self.settings.store:
            self.offers.append(rec)

    def _plan_offers(self, block_state: Any, stores: list[Transfer]) -> None:
        """Stores of blocks vLLM served from its own cache that the pool lacks: for requests scheduled
        this step (their block ids are at hand), at most `offer_blocks_per_step` blocks in all."""
        budget = self.settings.offer_blocks_per_step
        keep: list[_Req] = []
        for rec in self.offers:
            req_id = rec.request.request_id
            if self.reqs.get(req_id) is not rec:
                continue  # finished: its blocks are vLLM's again
            ids = block_state.get_block_ids(req_id)
            if ids is None or not budget:
                keep.append(rec)
                continue
            first = rec.pool_has
            end = min(rec.local, first + budget)
            keys: list[bytes] = list(rec.request.block_hashes[first:end])
            stores.append(Transfer(req_id, keys, list(ids[0][first:end])))
            if self.announcer is not None:
                self._describe(rec.request, keys)
            self._remember(keys[-1])
            rec.had_stores = True
            rec.pool_has = end
            budget -= end - first
            if end < rec.local:
                keep.append(rec)
        self.offers = keep

    def _has_tail(self, request: Request, full: int) -> bool:
        """Whether a request is a fresh prompt with a partial last block (see _tail); cheap."""
        end = request.num_prompt_tokens
        return (self.spans is None and request.num_tokens == end
                and 0 < end - full * self.block_size < self.block_size)

    def _tail_key(self, request: Request) -> bytes | None:
        """The key of the prompt's partial last block: the one its lookup hashed, if it had one."""
        state = self.lookups.get(request.request_id)
        if state is not None and state.read and state.tail:
            return state.keys[-1]
        tail = self._tail(request)
        return tail[0] if tail is not None else None

    def _tail(self, request: Request) -> tuple[bytes, int] | None:
        """(key, tokens) of a fresh prompt's partial last block: the hash vLLM's block hasher would
        give it (parent hash, its token ids, the same extra keys: LoRA, multimodal inputs,
        cache_salt). Its token tuple is shorter than a full block's, so it never equals one's key."""
        full, end = len(request.block_hashes), request.num_prompt_tokens
        if not self._has_tail(request, full):
            return None  # no partial tail, or not a fresh prompt (resumed with output tokens)
        start = full * self.block_size
        generate_block_hash_extra_keys, hash_block_tokens, get_mm_features_in_window = _vllm_hashing()
        mm_index = 0
        if request.mm_features:
            mm_index, _ = get_mm_features_in_window(request.mm_features, start, end)
        extra, _ = generate_block_hash_extra_keys(request, start, end, mm_index)
        parent = request.block_hashes[-1] if full else None
        key = hash_block_tokens(self.hash_fn, parent, request.all_token_ids[start:end], extra)
        return key, end - start

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        state = self.lookups.get(req_id)
        rec = self.reqs.get(req_id)
        if state is None or rec is None:
            return
        count = -(-num_external_tokens // self.block_size)  # the last one may be loaded for part of its tokens
        if self.spans is None:
            block_ids = blocks.get_block_ids()[0][state.start : state.start + count]
            keys = list(state.keys[state.start : state.start + count])
        else:  # each group's blocks the hit needs, those vLLM allocated (it holds none out of a window)
            groups, ids = len(self.spans), blocks.get_block_ids()
            keys, block_ids = [], []
            for g, i in needed_blocks(self.spans, state.start, state.start + count):
                if ids[g][i]:
                    keys.append(state.keys[i * groups + g])
                    block_ids.append(ids[g][i])
        self.loads.append(Transfer(req_id, keys, list(block_ids)))
        self.load_block_ids[req_id] = set(block_ids)
        if self.announcer is not None:  # (a daemon restarted since they were stored no longer knows them)
            self._describe(request, keys)
        # Loaded full blocks need no store; a loaded tail's block does once output tokens fill it.
        rec.stored_upto = max(rec.stored_upto, min(state.start + count, len(request.block_hashes)))
        if state.tail and state.hits == len(state.keys):  # the tail is in the pool: no need to store it
            rec.tail_done = True
        rec.store_at = self._store_at(rec, state.start * self.block_size + num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVStoreConnectorMetadata:
        loads = self.loads
        preempted = scheduler_output.preempted_req_ids
        if preempted:
            for req_id in preempted:  # it starts over: look it up afresh when it is back
                state = self.lookups.pop(req_id, None)
                if state is not None:
                    self._release(state)
        if not scheduler_output.total_num_scheduled_tokens:
            wait, lookups = self._idle_wait()
            if not loads and not preempted:
                return _IDLE[wait, lookups]
            self.loads = []
            return KVStoreConnectorMetadata(loads=loads, preempted=set(preempted or ()), idle_wait=wait,
                                            lookups=lookups, early=self.early_loads, forward=False)
        stores: list[Transfer] = []
        flush: set[str] = set()
        block_state = scheduler_output.kv_connector_block_state
        if self.settings.store and block_state is not None:
            self._plan_stores(scheduler_output.num_scheduled_tokens, block_state, stores, flush)
            if self.states and block_state.boundary_state_offloads:
                self._plan_state_stores(block_state.boundary_state_offloads, stores)
            if self.offers:
                self._plan_offers(block_state, stores)
        if not loads and not stores and not preempted and not flush:
            return _NO_JOBS
        self.loads = []
        return KVStoreConnectorMetadata(loads=loads, stores=stores, preempted=set(preempted or ()), flush=flush)

    def _plan_stores(self, scheduled_tokens: dict[str, int], block_state: Any, stores: list[Transfer],
                     flush: set[str]) -> None:
        reqs = self.reqs
        for req_id, scheduled in scheduled_tokens.items():
            rec = reqs.get(req_id)
            if rec is None:
                continue
            if rec.volatile and self._volatile_freed(rec, block_state):
                flush.add(req_id)
            if rec.request.num_computed_tokens + scheduled >= rec.store_at:
                self._plan_store(rec, scheduled, block_state, stores)

    def _volatile_freed(self, rec: _Req, block_state: Any) -> bool:
        """Whether vLLM freed a sliding-window block of the request's stores (it left the window) this step:
        another request may be given it, so the stores must have read it before this step's forward
        (KVStoreConnectorMetadata.flush). Then the request's stores so far are waited for: forget them."""
        ids = block_state.get_block_ids(rec.request.request_id)
        volatile = rec.volatile
        assert volatile is not None
        if ids is not None and all(i < len(ids[g]) and ids[g][i] == b for g, i, b in volatile):
            return False
        rec.volatile = None
        return True

    def _idle_wait(self) -> tuple[bool, bool]:
        """(wait, lookups) for a step with nothing to compute: whether the worker waits for progress,
        and whether lookup replies are awaited (the worker in this process wakes on them)."""
        replied = InProcess.lookup_replied
        if InProcess.workers and replied.is_set():
            replied.clear()  # replies from here on wake the wait; earlier ones are seen below
        lookups = False
        for state in self.lookups.values():
            if not state.read:
                if state.replied:
                    return False, False  # a reply to read: the next step makes progress at once
                lookups = True
        if self.load_block_ids:
            return True, lookups
        if lookups and (InProcess.workers or not self.core_sleeps_when_idle):
            return True, True
        return False, False  # nothing to wait for, or vLLM's engine core sleeps on its own

    def _plan_store(self, rec: _Req, scheduled: int, block_state: Any, stores: list[Transfer]) -> None:
        """The blocks of a request whose KV this step's forward completes: full blocks (most steps:
        none new), and the prompt's partial tail in the step that finishes the prompt."""
        request, size = rec.request, self.block_size
        computed = request.num_computed_tokens
        first = rec.stored_upto
        if first < 0:  # blocks vLLM had cached locally when the request arrived
            first = rec.stored_upto = computed // size
        done = (computed + scheduled) // size
        prompt = request.num_prompt_tokens
        tail = computed < prompt <= computed + scheduled and prompt % size != 0 and not rec.tail_done
        if done <= first and not tail:
            rec.store_at = self._store_at(rec, computed + scheduled)
            return
        done = min(done, len(request.block_hashes))  # ... and hashed
        req_id = request.request_id
        ids = block_state.get_block_ids(req_id)
        if ids is None:
            return
        if self.spans is not None:
            keys, block_ids = self._group_stores(rec, ids, first, done)
        else:
            keys = list(request.block_hashes[first:done])
            block_ids = list(ids[0][first:done])
        tail_key = self._tail_key(request) if tail else None
        if tail_key is not None:
            keys.append(tail_key)
            block_ids.append(ids[0][prompt // size])
            rec.tail_done = True
        if keys:
            stores.append(Transfer(req_id, keys, block_ids, tail_key is not None))
            rec.had_stores = True
            if self.announcer is not None:
                self._describe(request, keys[:len(keys) - (tail_key is not None)])
            if done > first:
                self._remember(request.block_hashes[done - 1])
        rec.stored_upto = max(first, done)
        rec.store_at = self._store_at(rec, computed + scheduled)

    def _group_stores(self, rec: _Req, ids: tuple[list[int], ...], first: int,
                      done: int) -> tuple[list[bytes], list[int]]:
        """Keys and block ids of blocks [first, done) in every group (all in vLLM's tables: they were just
        computed); the sliding-window ones are remembered as volatile. Mamba states are not per block: see
        _plan_state_stores."""
        assert self.spans is not None
        keys = self.group_keys(rec.request.block_hashes[first:done])
        groups = len(self.spans)
        out_keys, block_ids = [], []
        for i in range(first, done):
            for g, span in enumerate(self.spans):
                block = ids[g][i] if i < len(ids[g]) else 0
                if not block or g in self.states:
                    continue
                out_keys.append(keys[(i - first) * groups + g])
                block_ids.append(block)
                if span:
                    self._volatile(rec, g, i, block)
        return out_keys, block_ids

    def _plan_state_stores(self, offers: dict[str, list[tuple[int, int, int]]], stores: list[Transfer]) -> None:
        """Stores of the Mamba states vLLM offers (boundary_state_offloads: group, block id, tokens before
        it), each under the key of the block it ends: computed by this step's forward and held by vLLM
        only until the next (KVStoreConnectorMetadata.flush)."""
        size = self.block_size
        for req_id, offered in offers.items():
            rec = self.reqs.get(req_id)
            if rec is None:
                continue
            hashes = rec.request.block_hashes
            keys, block_ids = [], []
            for g, block, tokens in offered:
                i = tokens // size - 1
                if g not in self.states or tokens % size or not 0 <= i < len(hashes):
                    continue
                keys.append(group_key(hashes[i], g))
                block_ids.append(block)
                self._volatile(rec, g, i, block)
            if keys:
                stores.append(Transfer(req_id, keys, block_ids))
                rec.had_stores = True
                if self.announcer is not None:
                    self._describe(rec.request, keys)

    def _describe(self, request: Request, keys: list[bytes]) -> None:
        """Describe these full blocks' keys to the daemon for routers' events, on the background thread."""
        if keys:
            self.session.run_in_background(self._send_descriptions, request, keys)

    def _send_descriptions(self, request: Request, keys: list[bytes]) -> None:
        index = {bytes(h): i for i, h in enumerate(request.block_hashes)}
        blocks = [index[k if self.spans is None else split_group_key(k)[0]] for k in keys]
        self.session.describe_blocks(keys, describe(request, blocks, self.block_size))

    @staticmethod
    def _volatile(rec: _Req, g: int, i: int, block: int) -> None:
        if rec.volatile is None:
            rec.volatile = []
        rec.volatile.append((g, i, block))

    def _store_at(self, rec: _Req, computed: int) -> int:
        """With `computed` tokens computed: the count (a step's tokens included) that completes the
        request's next block to store, its next full block or its prompt's partial tail. Below it
        _plan_store has nothing to do (most steps)."""
        size, prompt = self.block_size, rec.request.num_prompt_tokens
        next_block = (rec.stored_upto + 1) * size
        if computed < prompt and prompt % size and not rec.tail_done:
            return min(next_block, prompt)
        return next_block

    def finish_loads(self, req_ids: set[str], invalid: set[int], failed: set[str]) -> None:
        """These requests' loads are done; `invalid`: blocks that failed to load, `failed`: requests
        whose loads failed (several KV cache groups); those requests recompute and are never offered a
        load again."""
        for req_id in req_ids:
            state = self.lookups.pop(req_id, None)
            if state is not None:
                self._release(state)
            block_ids = self.load_block_ids.pop(req_id, None)
            if req_id in failed or (invalid and block_ids and not invalid.isdisjoint(block_ids)):
                rec = self.reqs.get(req_id)
                if rec is not None:
                    rec.load_failed = True

    def request_finished(self, request: Request) -> bool:
        """True: vLLM keeps the blocks until the worker reports the request's stores done."""
        req_id = request.request_id
        if self.lookups:  # empty in most steps: a hit's lookup ends with its load
            state = self.lookups.pop(req_id, None)
            if state is not None:
                self._release(state)
        if self.load_block_ids:
            self.load_block_ids.pop(req_id, None)
        rec = self.reqs.pop(req_id, None)
        return rec is not None and rec.had_stores

    def _release(self, state: _Lookup) -> None:
        """Give a lookup's lease back, also one whose reply is unread or still on its way (then the
        background thread does, when it comes). Releases run on the session's background thread: no
        RPC on the scheduler's."""
        if not state.read:
            with self._handoff:
                state.dropped = True
                if not state.replied:
                    return  # the background thread releases it
        lease_id, state.lease_id = state.lease_id, b""
        if lease_id:
            self.session.release_lease(lease_id)

    def close(self) -> None:
        InProcess.schedulers -= 1
        if self.announcer is not None:
            self.announcer.close()
        self.session.close()
        self.client.close()
