"""The KVStoreConnector class vLLM instantiates (see the package docstring): settings, the scheduler and
worker sides, and vLLM's connector calls routed to them."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvstore_client.device import unsupported_allocator
from kvstore_client.layouts import UnsupportedKVCache
from kvstore_client.vllm import compat
from kvstore_client.vllm.common import (
    ConnectorSettings,
    KVStoreConnectorMetadata,
    KVStoreConnectorStats,
    KVStorePromMetrics,
    namespace_for,
    unsupported,
    unsupported_kv_cache,
)
from kvstore_client.vllm.scheduler import Scheduler
from kvstore_client.vllm.worker import NO_LOAD_ERRORS, Worker

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

def log_through_vllm() -> None:
    """vLLM configures only its own logger ("vllm", which does not propagate): where nothing else
    configured logging (the root logger has no handler, as in `vllm serve`), the client's loggers write
    through vLLM's handlers at its level, so that vLLM's output shows their lines as its own."""
    ours, theirs = logging.getLogger("kvstore_client"), logging.getLogger("vllm")
    if theirs.handlers and not ours.handlers and not logging.getLogger().handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """Declares SupportsHMA so that vLLM keeps its hybrid allocator on (window memory savings; Mamba
    and linear-attention hybrids start at all); KV cache configs it cannot serve turn it off."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_through_vllm()
        transfer = vllm_config.kv_transfer_config
        if transfer is None:  # vLLM creates a connector only from a kv_transfer_config
            raise ValueError("KVStoreConnector needs vllm_config.kv_transfer_config")
        self.settings = ConnectorSettings.from_extra_config(dict(transfer.kv_connector_extra_config or {}))
        # A cache miss is never fatal: a block that fails to load is recomputed.
        transfer.kv_load_failure_policy = "recompute"
        try:
            why = (unsupported(vllm_config) or unsupported_allocator(vllm_config)
                   or unsupported_kv_cache(kv_cache_config))
            namespace = "" if why else namespace_for(vllm_config, kv_cache_config, self.settings)
        except (UnsupportedKVCache, ValueError) as e:
            why = str(e)
        side = "scheduler side" if role == KVConnectorRole.SCHEDULER else "worker side"
        if why:
            if role == KVConnectorRole.SCHEDULER:  # the workers would say the same: once is enough
                log.error("kvstore connector off for this engine (vLLM recomputes): %s", why)
            self.settings = replace(self.settings, load=False, store=False)
        self.scheduler: Scheduler | None = None
        self.worker: Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = Scheduler(vllm_config, self.settings, namespace, kv_cache_config)
            if not why:
                log.info("kvstore connector active (%s): socket %s, loads %s, stores %s, namespace %s", side,
                         self.scheduler.client.target, "on" if self.settings.load else "off",
                         "on" if self.settings.store else "off", namespace)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.worker = Worker(vllm_config, kv_cache_config, self.settings, namespace,
                                  get_tensor_model_parallel_rank())

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The layout to ask vLLM for (setting kv_layout); vLLM keeps its own where the attention
        backend does not support it (the CPU backend has LBHNC only). vLLM 0.23 takes the answer as the
        attention backend's own layout ("NHD"/"HND"): none is asked there."""
        if not compat.LAYOUTS:
            return None
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

    # The calls of every step check here whether they have anything to do: after a forward pass
    # each call and attribute read costs microseconds (caches are cold), and most steps have nothing.

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if num_external_tokens:  # vLLM calls it for every request it schedules anew
            assert self.scheduler is not None
            self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        loaded = connector_output.finished_recving  # load errors come with it
        if loaded and self.scheduler is not None:
            failed = compat.failed_recving(connector_output)
            self.scheduler.finish_loads(loaded, connector_output.invalid_block_ids, failed)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None
        return self.scheduler.request_finished(request), None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler is not None  # SupportsHMA: vLLM calls this one, not request_finished
        return self.scheduler.request_finished(request), None

    def take_events(self) -> Iterable[KVCacheEvent]:
        announcer = self.scheduler.announcer if self.scheduler is not None else None
        return announcer.take() if announcer is not None and announcer.events else ()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVStoreConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register(kv_caches)

    def has_connector_metadata(self) -> bool:
        # False but while early loads are in flight: vLLM's attention layers then skip
        # wait_for_layer_load/save_kv_layer, two calls per layer and step (~50 µs a step) that have
        # nothing to do. In vLLM 0.32 only those layer hooks ask; this connector reads
        # `_connector_metadata` itself.
        worker = self.worker
        return worker is not None and bool(worker.early.jobs)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        worker = self.worker
        if worker is not None and worker.early.jobs and connector_metadata.forward:  # type: ignore[attr-defined]
            worker.wait_for_layer(worker.early.first_regions)  # the first layer's new KV is written before it waits

    # The worker-side calls of every step read the bound metadata directly.

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        preempted = kv_connector_metadata.preempted  # type: ignore[attr-defined]
        flush = kv_connector_metadata.flush  # type: ignore[attr-defined]
        if preempted or flush:  # their blocks may be reused in this forward: their stores finish first
            assert self.worker is not None
            self.worker.flush(preempted | flush)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta: KVStoreConnectorMetadata = self._connector_metadata  # type: ignore[assignment]
        if meta.loads:
            assert self.worker is not None
            self.worker.start_loads(meta.loads, meta.early)

    def wait_for_layer_load(self, layer_name: str) -> None:
        worker = self.worker  # called only while early loads are in flight (has_connector_metadata)
        if worker is not None and (early := worker.early).jobs:
            worker.wait_for_layer(early.layer_regions.get(layer_name, early.total_regions))

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # whole blocks are stored after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        meta: KVStoreConnectorMetadata = self._connector_metadata  # type: ignore[assignment]
        if meta.stores:
            assert self.worker is not None
            self.worker.start_stores(meta.stores)  # submits and returns: never waits for the copies

    def get_transfer_results(self, finished_req_ids: set[str]) -> compat.KVConnectorTransferResults:
        assert self.worker is not None
        meta: KVStoreConnectorMetadata = self._connector_metadata  # type: ignore[assignment]
        return self.worker.transfer_results(finished_req_ids, meta.idle_wait, meta.lookups)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        worker = self.worker
        assert worker is not None
        return worker.take_load_errors() if worker.load_errors else NO_LOAD_ERRORS

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        worker = self.worker
        return worker.take_stats() if worker is not None and worker.stats_changed else None

    def shutdown(self) -> None:
        for side in (self.scheduler, self.worker):
            if side is not None:
                side.close()


# vLLM's MultiConnector rebuilds a child's stats from the class it finds by name in vLLM's registry,
# where a connector loaded by module path is not: name it there (once per process).
try:
    KVConnectorFactory.register_connector("KVStoreConnector", __name__, "KVStoreConnector")
except ValueError:  # already registered
    pass
