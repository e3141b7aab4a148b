"""The connector's worker side: moves bytes (registers the KV memory, submits jobs, reports completions)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from kvstore_client.client import KVStoreClient, Session
from kvstore_client.device import order_before_copies
from kvstore_client.layouts import UnsupportedKVCache
from kvstore_client.protocol.completion import Completion
from kvstore_client.shm import SharedKVMemory
from kvstore_client.vllm import compat, kv_memory
from kvstore_client.vllm.common import ConnectorSettings, KVStoreConnectorStats, Sharding
from kvstore_client.vllm.early_loads import EarlyLoads
from kvstore_client.vllm.kv_memory import KVCaches
from kvstore_client.vllm.pacing import (
    PREEMPTION_WAIT_S,
    ProcessConnectors,
    wait_for_jobs,
    wait_for_progress,
)
from kvstore_client.vllm.plan import Transfer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger(__name__)

# What a step with nothing to report returns, shared (vLLM only reads them): made once, not per step.
KVConnectorTransferResults = compat.KVConnectorTransferResults
NO_RESULTS = KVConnectorTransferResults()
NO_LOAD_ERRORS: set[int] = set()


class Worker:
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
        # With several KV cache groups a block id names a block of each group: vLLM takes load failures
        # per request (failed_recving), not per block id; those requests then recompute.
        self.groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
        self.failed_reqs: set[str] = set()
        self.stats = KVStoreConnectorStats()
        self.stats_changed = False  # spares the per-step is_empty() scan of the counters
        self.order_copies = False  # device memory: order the step's kernels before each job (not on CPU)
        self.early = EarlyLoads()  # loads reported done before they landed, read layer by layer
        self.block_bytes = 0  # this engine's bytes of a block
        ProcessConnectors.workers += 1

    def register(self, kv_caches: KVCaches) -> None:
        """Describe the KV memory and register it with the daemon (kv_memory.py); what cannot be described
        exactly, or shared, leaves the connector off (vLLM recomputes)."""
        if not self.namespace:
            return
        try:
            description, kv_caches = kv_memory.describe(self.vllm_config, self.kv_cache_config, kv_caches)
        except UnsupportedKVCache as e:
            log.error("kvstore connector off for this engine (worker side, rank %d; vLLM recomputes): %s",
                      self.rank, e)
            return
        self.device = description.memories[0].device
        self.order_copies = self.device.type != "cpu"
        self.block_bytes = sum(r.block_bytes for r in description.regions)
        self.early.set_layers(description.layer_regions, len(description.regions))
        try:
            sharding = self.sharding
            spec, self.memories = kv_memory.share(self.vllm_config, kv_caches, description, sharding.shards,
                                                  sharding.shard(self.rank))
            # wait=False: a daemon that is away or refuses the registration is retried in the background
            self.session = self.client.session(self.namespace, spec, engine_id=f"vllm-worker-tp{self.rank}",
                                               wait=False, says=logging.DEBUG)  # the scheduler's says it
        except Exception as e:  # noqa: BLE001 - nothing of kvstore's may stop the engine
            log.error("kvstore connector off for this engine (worker side, rank %d; vLLM recomputes): cannot share "
                      "the KV cache with the daemon: %s", self.rank, e)
            return
        log.info("kvstore connector active (worker side, rank %d): %s KV cache, %d regions in %d allocations, "
                 "%d blocks, shard %d of %d, namespace %s", self.rank, description.layout, len(description.regions),
                 len(description.memories), spec.num_blocks, spec.shard, spec.shards, self.namespace)

    def start_loads(self, loads: list[Transfer], early: bool = False) -> None:
        """Submit the loads; with `early` (KVStoreConnectorMetadata.early) those the daemon copies
        layer by layer are reported done in this step."""
        session = self.session
        if session is None:  # off: every planned load fails (vLLM recomputes those blocks)
            for t in loads:
                self._load_failed(t.req_id, t.block_ids)
                self.refused_loads.add(t.req_id)
            return
        seq = 0  # the ordering record these jobs follow (0 on CPU: nothing to order)
        if loads and self.order_copies:
            assert self.device is not None
            seq = order_before_copies(self.device)  # blocks taken from a preempted request may still be written
        early = early and bool(self.early.layer_regions)
        for t in loads:
            # An early load's blocks are recomputed if it does not land in time (the forward gives up):
            # the daemon must not write into them later. Others are waited for.
            early_one = early and len(t.block_ids) * self.block_bytes <= session.progress_load_bytes
            give_up_s = self.settings.timeout_s if early_one else 0.0
            job = session.load(t.keys, t.block_ids, order_seq=seq, give_up_s=give_up_s)
            self.load_jobs[job] = (t.req_id, t.block_ids, time.monotonic())
            self.loads_left[t.req_id] = self.loads_left.get(t.req_id, 0) + 1
            if early_one:
                self.early.add(job, t.req_id)

    def wait_for_layer(self, regions: int) -> None:
        """Before a layer of a forward: the early loads' first `regions` regions have landed (EarlyLoads)."""
        assert self.session is not None
        self.early.wait_for_layer(self.session, regions, self.settings.timeout_s, self._early_failed)

    def _early_failed(self, job: int) -> None:
        self._load_failed(*self.load_jobs[job][:2])

    def start_stores(self, stores: list[Transfer]) -> None:
        if self.session is None:
            return  # off: nothing stored, and nothing keeps a finished request's blocks
        if self.sharding.replicas > 1:  # replicas of a shard split its stores
            stores = [mine for t in stores if (mine := self.sharding.part(self.rank, t)) is not None]
        seq = 0  # the ordering record these jobs follow (0 on CPU: nothing to order)
        if stores and self.order_copies:
            assert self.device is not None
            seq = order_before_copies(self.device)  # the daemon may read the blocks as soon as a job arrives
        for t in stores:
            # (A preemption's flush gives up after PREEMPTION_WAIT_S, and vLLM reuses the blocks.)
            job = self.session.store(t.keys, t.block_ids, t.partial_tail, order_seq=seq, give_up_s=PREEMPTION_WAIT_S)
            self.store_jobs[job] = t.req_id
            self.stores_left[t.req_id] = self.stores_left.get(t.req_id, 0) + 1
            self.had_stores.add(t.req_id)

    def flush(self, preempted: set[str]) -> None:
        """A preempted request's blocks may be reused right away: its stores must finish first."""
        jobs = [j for j, r in self.store_jobs.items() if r in preempted]
        if jobs and self.session is not None:
            try:
                for completion in wait_for_jobs(self.session, jobs, PREEMPTION_WAIT_S).values():
                    self._completed(completion)
            except TimeoutError:
                log.error("kvstore: stores of preempted requests did not finish in %ss", PREEMPTION_WAIT_S)

    def transfer_results(self, finished_req_ids: set[str], idle_wait: bool = False,
                         lookups: bool = False) -> KVConnectorTransferResults:
        """Requests whose loads are all done (recving) and finished requests whose stores are (sending).
        `idle_wait`: the step computed nothing while lookups (`lookups`) or loads are in flight: wait
        for progress first (_wait_for_progress)."""
        if not (idle_wait or self.load_jobs or self.store_jobs or self.refused_loads or self.finished_waiting
                or (finished_req_ids and self.had_stores)):
            return NO_RESULTS  # most steps: nothing in flight, nothing to report
        results = KVConnectorTransferResults()
        early = self.early
        if early.report or early.read:
            idle_wait = early.take_report(results.finished_recving, self.session, self.settings.timeout_s,
                                          self._completed, self._early_failed) and idle_wait
        if self.session is None:
            return self._results_off(results, idle_wait, lookups)
        if finished_req_ids and self.had_stores:
            self.finished_waiting.update(r for r in finished_req_ids if r in self.had_stores)
        # Every job is in load_jobs/store_jobs until its completion is seen: with none there is
        # nothing to poll (most steps).
        if self.load_jobs or self.store_jobs:
            session = self.session
            if not session.connected:  # its jobs fail (and are seen failed below)
                self.stats.data["sidecar_unavailable"] = 1
                self.stats_changed = True
            completions = session.poll()
            if idle_wait and not completions:
                completions = self._wait_for_progress(lookups)
            for completion in completions:
                loaded = self._completed(completion)
                if loaded is not None:
                    self._loaded(loaded, results)
        elif idle_wait:
            self._wait_for_progress(lookups)
        if self.finished_waiting:
            self._finished_sending(results.finished_sending)
        return results

    def _loaded(self, req_id: str, results: KVConnectorTransferResults) -> None:
        results.finished_recving.add(req_id)
        if req_id in self.failed_reqs:
            self.failed_reqs.discard(req_id)
            results.failed_recving.add(req_id)

    def _results_off(self, results: KVConnectorTransferResults, idle_wait: bool,
                     lookups: bool) -> KVConnectorTransferResults:
        """The connector is off: the loads planned meanwhile are reported done (and failed)."""
        if idle_wait:
            self._wait_for_progress(lookups)
        results.finished_recving.update(self.refused_loads)
        results.failed_recving.update(self.failed_reqs & self.refused_loads)
        self.failed_reqs -= self.refused_loads
        self.refused_loads.clear()
        return results

    def _finished_sending(self, sending: set[str]) -> None:
        """Finished requests whose stores are all done: vLLM may free their blocks."""
        sending.update(r for r in self.finished_waiting if r not in self.stores_left)
        self.finished_waiting -= sending
        self.had_stores -= sending

    def _wait_for_progress(self, lookups: bool) -> list[Completion]:
        return wait_for_progress(self.session, bool(self.load_jobs or self.store_jobs), bool(self.load_jobs), lookups)

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
                self._load_failed(req_id, block_ids)
                self.stats.data["load_failed_blocks"] += len(block_ids)
            self.loads_left[req_id] -= 1
            last = self.loads_left[req_id] == 0
            if last:
                del self.loads_left[req_id]
            if self.early.completed(c.job_id, req_id if last else None):
                return None  # reported when it started
            return req_id if last else None
        elif c.job_id in self.store_jobs:
            req_id = self.store_jobs.pop(c.job_id)
            self.stats.data["stored_blocks"] += c.blocks_ok
            self.stats.data["store_failed_blocks"] += c.blocks_failed
            self.stores_left[req_id] -= 1
            if self.stores_left[req_id] == 0:
                del self.stores_left[req_id]
        return None

    def _load_failed(self, req_id: str, block_ids: list[int]) -> None:
        if self.groups > 1:
            self.failed_reqs.add(req_id)
        else:
            self.load_errors.update(block_ids)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def take_stats(self) -> KVStoreConnectorStats | None:
        self.stats_changed = False
        stats, self.stats = self.stats, KVStoreConnectorStats()
        return None if stats.is_empty() else stats

    def close(self) -> None:
        ProcessConnectors.workers -= 1
        if self.session is not None:
            self.session.close()
        self.client.close()
        for memory in self.memories:
            memory.close()  # the engine's KV tensors keep their own mapping
