"""vLLM's real v1 Scheduler driving both sides of the kvstore connector: no model, no kernels, one process.

The Scheduler makes its SCHEDULER-role KVStoreConnector itself, from the kv_transfer_config; the loop makes the
WORKER-role one as vLLM's worker does and registers KV tensors from vLLM's own allocator (CPU) with it. A stand-in
forward, between the worker's connector calls in vLLM's order, writes for every token it computes a word that
depends only on the token's prefix into each attention layer's slot of the block vLLM assigned (a Mamba layer
folds the chunk into the state it reads): a load that lands is checked exactly. Sampling: always NEXT_TOKEN.

vLLM 0.23's sources (no KV cache layout) run it too: where they differ, feature checks below choose what 0.23's
engine core, CPU model runner and connector mixin do (each marked "0.23").
"""

from __future__ import annotations

import copy
import inspect
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.parallel_state import model_parallel_is_initialized
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu_worker import init_worker_distributed_environment
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

try:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache
except ImportError:  # 0.23: no KV cache layout; each layer's tensor is shaped by its attention backend
    KVCacheLayout = None  # type: ignore[assignment,misc]

try:  # vLLM 0.33 moved it
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

# 0.23's connector mixin: the results come from get_finished (no failed_recving), a step without a forward
# skips wait_for_save, and start_load_kv always runs before the forward (no sync/async loads).
TRANSFER_RESULTS = "failed_recving" in KVConnectorOutput.__dataclass_fields__
NO_FORWARD_SAVES = "wait_for_save" not in inspect.signature(
    KVConnectorModelRunnerMixin._get_kv_connector_output).parameters
SYNC_LOADS = hasattr(SchedulerOutput, "has_sync_kv_loads")

BLOCK, HEADS, HEAD_SIZE = 16, 2, 8
FULL = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
NEXT_TOKEN = 7  # what the stand-in sampler always samples
SEED = 0x3B9ACA07  # the pattern's hash before any token
WIPE = -0x5A5A5A5B  # what wiped KV memory holds (int32 words)


def attention(first: int, count: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(first, first + count)]


def with_sliding_window(window: int) -> list[KVCacheGroupSpec]:
    """Gemma-3-like: full attention and sliding-window layers (vLLM's HybridKVCacheCoordinator)."""
    spec = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32,
                             sliding_window=window)
    return [KVCacheGroupSpec(attention(0, 2), FULL), KVCacheGroupSpec(attention(2, 2), spec)]


def with_mamba() -> list[KVCacheGroupSpec]:
    """Qwen3-Next-like: full attention and Mamba layers in "align" mode, their states padded to the page."""
    spec = MambaSpec(shapes=((3, 32), (2, 8, 16)), dtypes=(torch.float32, torch.float32), block_size=BLOCK,
                     page_size_padded=FULL.page_size_bytes, mamba_cache_mode="align")
    mixers = [f"model.layers.{i}.mixer" for i in (2, 3)]
    return [KVCacheGroupSpec(attention(0, 2), FULL), KVCacheGroupSpec(mixers, spec)]


def fold(h: int, tokens: Sequence[int], start: int) -> list[int]:
    """The pattern's rolling hash after each of `tokens` (at positions start, start + 1, ...), from `h`."""
    out = []
    for pos, token in enumerate(tokens, start):
        h = (h * 1_000_003 + token * 7919 + pos) & 0x7FFFFFFF
        out.append(h)
    return out


def word(h: int, layer: int) -> int:
    """Layer `layer`'s int32 word for hash `h` (its own inverse: word(word(h, l), l) == h)."""
    return h ^ (layer * 0x01000193 & 0x7FFFFFFF)


def _tiny_model(path: Path) -> str:
    """A model directory vLLM's ModelConfig reads: an hf config only (no weights, no tokenizer)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS, "head_dim": HEAD_SIZE, "max_position_embeddings": 4096}))
    return str(path)


def _allocate_by_backend(kv_cache_config: KVCacheConfig) -> dict[str, Any]:
    """0.23's CPU model runner (gpu_model_runner._allocate_kv_cache_tensors, _reshape_kv_cache_tensors): one
    zeroed int8 tensor per KVCacheTensor, viewed per layer sharing it: attention as the CPU backend's
    get_kv_cache_shape, [blocks, heads, block_size, 2 * head_size]; a Mamba layer as its states, a page apart."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    specs = {name: g.kv_cache_spec for g in kv_cache_config.kv_cache_groups for name in g.layer_names}
    kv_caches: dict[str, Any] = {}
    for kv_cache_tensor in kv_cache_config.kv_cache_tensors:
        raw = torch.zeros(kv_cache_tensor.size, dtype=torch.int8)
        for name in kv_cache_tensor.shared_by:
            spec = specs[name]
            num_blocks = raw.numel() // spec.page_size_bytes
            if isinstance(spec, MambaSpec):
                states, offset = [], 0
                for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
                    stride = torch.empty(num_blocks, *shape).stride()
                    states.append(torch.as_strided(raw.view(dtype), (num_blocks, *shape),
                                                   (spec.page_size_bytes // dtype.itemsize, *stride[1:]),
                                                   offset // dtype.itemsize))
                    offset += stride[0] * dtype.itemsize
                kv_caches[name] = states
            else:
                kv_caches[name] = raw.view(spec.dtype).view(CPUAttentionBackend.get_kv_cache_shape(
                    num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size))
    return kv_caches


def _words(kv_cache: Any) -> torch.Tensor:
    """A layer's KV as int32 words: attention [blocks, heads, tokens, words], Mamba [blocks, 1, 1, words] (0.23
    hands a Mamba layer as its states, a page apart: their pages whole, from the first state's start)."""
    if not isinstance(kv_cache, list):
        return kv_cache.view(torch.int32)
    first = kv_cache[0]
    page = first.stride(0) * first.element_size() // 4
    return torch.empty(0, dtype=torch.int32).set_(first.untyped_storage(), first.storage_offset() *
                                                  first.element_size() // 4, (first.shape[0], 1, 1, page),
                                                  (page, page, page, 1))


def _init_worker_distributed(config: VllmConfig, tmp: Path) -> None:
    """The worker's TP group (one rank, gloo), once per process: the worker side asks for its TP rank."""
    if not model_parallel_is_initialized():
        with set_current_vllm_config(config):
            init_worker_distributed_environment(config, 0, f"file://{tmp / 'dist-init'}", 0, "gloo")


class Loop:
    """vLLM's scheduler and the connector's two sides, one engine step at a time (`step`, `run`)."""

    def __init__(self, socket: str, tmp: Path, groups: list[KVCacheGroupSpec] | None = None, num_blocks: int = 64,
                 kv_events: bool = False, max_batched_tokens: int = 256, layout: str = "LBHNC") -> None:
        self.groups = groups = groups or [KVCacheGroupSpec(attention(0, 2), FULL)]
        self.mamba_groups = {g for g, group in enumerate(groups) if isinstance(group.kv_cache_spec, MambaSpec)}
        transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore_client.vllm",
                                    kv_role="kv_both", kv_connector_extra_config={
                                        "socket": socket, "model_identity": "scheduler-loop"})
        config = self.config = VllmConfig(
            model_config=ModelConfig(model=_tiny_model(tmp / "model"), skip_tokenizer_init=True, dtype="float32",
                                     max_model_len=2048),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=num_blocks,
                                     **({"mamba_cache_mode": "align"} if self.mamba_groups else {})),
            kv_transfer_config=transfer,
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None)
        config.scheduler_config.max_num_batched_tokens = max_batched_tokens
        # What the engine core does (vllm/v1/engine/core.py): resolve the layout, plan the KV cache, size blocks.
        # (0.23 has no layout, and its KVCacheConfig no hash block size: the Scheduler is told it alone.)
        if KVCacheLayout is not None:
            config.cache_config.kv_cache_layout = layout
        kv_cache_config = get_kv_cache_config_from_groups(config, groups, available_memory=1 << 30)
        config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, config)
        if KVCacheLayout is not None:
            kv_cache_config.kv_cache_layout = layout
            kv_cache_config.hash_block_size = hash_block_size
        worker_kv_cache_config = copy.deepcopy(kv_cache_config)  # the workers get their own
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(hash_block_size, hash_fn)
        self.scheduler = Scheduler(config, kv_cache_config, StructuredOutputManager(config), block_size=block_size,
                                   hash_block_size=hash_block_size)
        self.connector: Any = self.scheduler.connector  # the scheduler side, made by vLLM
        self.events: list[Any] = []  # every KV event vLLM publishes (its own and the connector's)
        self.scheduler.kv_event_publisher.publish = lambda batch: self.events.extend(batch.events)  # type: ignore
        # The worker side, as vLLM's worker makes it (gpu_model_runner.initialize_kv_cache).
        from kvstore_client.vllm import KVStoreConnector

        _init_worker_distributed(config, tmp)
        self.worker: Any = KVStoreConnector(config, KVConnectorRole.WORKER, worker_kv_cache_config)
        if KVCacheLayout is not None:
            self.kv_caches = allocate_kv_cache(worker_kv_cache_config, torch.device("cpu"), KVCacheLayout[layout],
                                               [g.kv_cache_spec.block_size for g in groups])
        else:
            self.kv_caches = _allocate_by_backend(worker_kv_cache_config)
        self.worker.register_kv_caches(self.kv_caches)  # (which may move the memory: views of it come after)
        names = [(g, name) for g, group in enumerate(groups) for name in group.layer_names]
        # (layer, group, name, int32 view): attention [blocks, heads, tokens, words], Mamba [blocks, 1, 1, words]
        self.layers = [(layer, g, name, _words(self.kv_caches[name])) for layer, (g, name) in enumerate(names)]
        self.requests: dict[str, Request] = {}
        self.tables: dict[str, list[list[int]]] = {}  # the worker's block table per request and group
        self.outputs: list[tuple[SchedulerOutput, KVConnectorOutput]] = []  # every step's
        self.jobs: list[tuple[list, list]] = []  # every step's loads and stores, as the worker was handed them
        self.before_execute: list[Callable[[SchedulerOutput], None]] = []  # test hooks, after schedule()
        self._hashes: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: Sequence[int], max_tokens: int = 4) -> Request:
        request = Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                          block_hasher=self.block_hasher)
        self.requests[req_id] = request
        self.scheduler.add_request(request)
        return request

    def run(self, until: Callable[[], object] | None = None, max_steps: int = 5000) -> int:
        """Step until `until()` (default: vLLM holds no request, stores included); returns the steps taken."""
        until = until or (lambda: not self.scheduler.has_requests())
        for n in range(max_steps):
            if until():
                return n
            self.step()
        raise AssertionError(f"not done after {max_steps} steps")

    # -- one engine step (vllm/v1/engine/core.py EngineCore.step) -----------------------------------------------

    def step(self) -> tuple[SchedulerOutput, KVConnectorOutput]:
        self._settle_lookups()
        out = self.scheduler.schedule()
        for hook in self.before_execute:
            hook(out)
        meta: Any = out.kv_connector_metadata
        self.jobs.append((list(meta.loads), list(meta.stores)))
        kv_output = self.execute(out)
        req_ids = list(out.num_scheduled_tokens)  # a token for each request at the end of its tokens
        sampled = [[NEXT_TOKEN] if (r := self.requests[req_id]).num_computed_tokens >= r.num_tokens else []
                   for req_id in req_ids]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_output))
        self.outputs.append((out, kv_output))
        if not out.total_num_scheduled_tokens:  # as vLLM's engine core does (EngineCoreProc._process_engine_step):
            time.sleep(0.001)  # it yields to the threads that make progress (the connector's, the daemon)
        return out, kv_output

    def _settle_lookups(self) -> None:
        """Wait for the replies of the lookups in flight (on the connector's background thread): a new request
        then waits exactly one step for its lookup, and vLLM admits requests at the same steps in every run."""
        lookups = self.connector.scheduler.plan.lookups  # the connector's own record of them
        deadline = time.monotonic() + 10
        while not all(lookup.replied for lookup in lookups.values()):
            assert time.monotonic() < deadline, "a lookup got no reply"
            time.sleep(0.0001)

    def execute(self, out: SchedulerOutput) -> KVConnectorOutput:
        """The worker's step: the connector's calls in vLLM's order, the forward between them."""
        worker, meta = self.worker, out.kv_connector_metadata
        assert meta is not None
        worker.handle_preemptions(meta)
        self._update_tables(out)
        forward = out.total_num_scheduled_tokens > 0
        worker.bind_connector_metadata(meta)
        sync_load = forward and (not SYNC_LOADS or out.has_sync_kv_loads)
        if sync_load:
            worker.start_load_kv(None)
        if forward:
            self._forward(out)
        if not sync_load:
            worker.start_load_kv(None)
        if forward or NO_FORWARD_SAVES:
            worker.wait_for_save()
        else:  # 0.23: the stores of a step without a forward would never be submitted
            assert not meta.stores, f"stores planned for a step without a forward: {meta.stores}"
        if TRANSFER_RESULTS:
            results = worker.get_transfer_results(out.finished_req_ids)
            finished = {"finished_sending": results.finished_sending or None,
                        "finished_recving": results.finished_recving or None,
                        "failed_recving": results.failed_recving}
        else:  # 0.23
            sending, recving = worker.get_finished(out.finished_req_ids)
            finished = {"finished_sending": sending, "finished_recving": recving}
        output = KVConnectorOutput(**finished, invalid_block_ids=worker.get_block_ids_with_load_errors(),
                                   kv_connector_stats=worker.get_kv_connector_stats(),
                                   kv_cache_events=worker.get_kv_connector_kv_cache_events(),
                                   kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        return output

    def _update_tables(self, out: SchedulerOutput) -> None:
        """The worker's block tables (gpu_model_runner._update_states), and vLLM's zeroing of new blocks."""
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = out.scheduled_cached_reqs
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = [list(ids) for ids in new_ids or ()]
            elif new_ids is not None:
                for table, ids in zip(self.tables[req_id], new_ids, strict=True):
                    table.extend(ids)
        for block in out.new_block_ids_to_zero or ():
            for *_, view in self.layers:
                view[block] = 0

    def _forward(self, out: SchedulerOutput) -> None:
        """The scheduled tokens' KV, layer by layer, with the layer hooks where vLLM's attention layers call
        them. A Mamba layer reads the state before the chunk from slot (start - 1) // BLOCK and writes the state
        after it into the slot of its last token (vLLM's "align" mode: slot p holds the state after its last
        token)."""
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        hooks = self.worker.has_connector_metadata()
        for layer, g, name, view in self.layers:
            if hooks:
                self.worker.wait_for_layer_load(name)
            for req_id, count in out.num_scheduled_tokens.items():
                table, start, end = self.tables[req_id][g], starts[req_id], starts[req_id] + count
                if g in self.mamba_groups:
                    h = word(int(view[table[(start - 1) // BLOCK], 0, 0, 0]), layer) if start else SEED
                    view[table[(end - 1) // BLOCK]] = word(
                        fold(h, self.requests[req_id].all_token_ids[start:end], start)[-1], layer)
                    continue
                for pos, h in enumerate(self.hashes(req_id, end)[start:], start):
                    view[table[pos // BLOCK], :, pos % BLOCK, :] = word(h, layer)
            if hooks:
                self.worker.save_kv_layer(name, self.kv_caches[name], None)

    # -- what the tests check -----------------------------------------------------------------------------------

    def hashes(self, req_id: str, upto: int) -> list[int]:
        """The pattern's hash after each of the request's first `upto` tokens."""
        done = self._hashes.setdefault(req_id, [])
        if len(done) < upto:
            tokens = self.requests[req_id].all_token_ids
            done += fold(done[-1] if done else SEED, tokens[len(done):upto], len(done))
        return done[:upto]

    def wipe(self) -> None:
        """Overwrite ALL KV memory."""
        for *_, view in self.layers:
            view.fill_(WIPE)

    def wrong_tokens(self, req_id: str, upto: int) -> list[tuple[int, int]]:
        """(layer, position) of the request's first `upto` tokens whose KV in its blocks is not their pattern
        (attention layers; blocks vLLM does not hold, out of a window, are skipped)."""
        hashes, wrong = self.hashes(req_id, upto), []
        for layer, g, _, view in self.layers:
            table = self.tables[req_id][g]
            for pos in range(upto) if g not in self.mamba_groups else ():
                block = table[pos // BLOCK]
                if block and not bool((view[block, :, pos % BLOCK, :] == word(hashes[pos], layer)).all()):
                    wrong.append((layer, pos))
        return wrong

    def state(self, block: int) -> list[list[int]]:
        """Per Mamba layer, the hashes its state in `block` holds (a state: one, after the token it ends with)."""
        return [[word(int(w), layer) for w in view[block].unique()]
                for layer, g, _, view in self.layers if g in self.mamba_groups]

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
