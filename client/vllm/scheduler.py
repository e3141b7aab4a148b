"""The connector's scheduler side: bookkeeping only (keys, block ids, leases); holds no tensors."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore_client.client import KVStoreClient, Session
from kvstore_client.errors import KVStoreError
from kvstore_client.vllm.common import ConnectorSettings, KVStoreConnectorMetadata, Transfer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


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


class Scheduler:
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

    def _tail_key(self, request: Request) -> bytes | None:
        """The key of the prompt's partial last block: the one its lookup hashed, if it had one."""
        state = self.lookups.get(request.request_id)
        if state is not None and state.tail:
            return state.keys[-1]
        tail = self._tail(request)
        return tail[0] if tail is not None else None

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
        tail_key = self._tail_key(request) if tail else None
        if tail_key is not None:
            keys.append(tail_key)
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
