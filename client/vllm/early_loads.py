"""Loads read layer by layer as they land. Where the daemon reports a load's progress (CPU), a load
planned `early` (KVStoreConnectorMetadata.early) is reported done in the step that starts it; the
forwards that follow wait, before each layer, until the regions that layer reads have landed
(`wait_for_layer`); after a forward that read them, their completions are awaited, so that a load that
failed is reported (as load errors) with the step that used it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvstore_client.vllm.pacing import wait_for_jobs, wait_for_landing

if TYPE_CHECKING:
    from kvstore_client.client import Session
    from kvstore_client.protocol.completion import Completion

log = logging.getLogger(__name__)


class EarlyLoads:
    def __init__(self) -> None:
        self.jobs: dict[int, str] = {}  # job -> request, until it completes
        self.reqs: set[str] = set()  # requests reported, whose loads are not complete
        self.report: set[str] = set()  # requests to report done in this step's results
        self.read = False  # this step's forward waited on them: see them complete
        # Regions of the layout that must have landed before a layer's attention runs: its own and the
        # next layer's (vLLM writes a layer's new KV just before that layer's attention, where it waits:
        # the next layer's pages must be in by then). Set where loads report their progress (CPU).
        self.layer_regions: dict[str, int] = {}
        self.first_regions = 0  # before a forward: the first layer's
        self.total_regions = 0

    def set_layers(self, layer_ends: dict[str, int], total_regions: int) -> None:
        """`layer_ends`: each layer's last region (+1), in region order, the order a load copies them."""
        self.total_regions = total_regions
        ends = list(layer_ends.values())
        if ends:
            self.first_regions = ends[0]
            self.layer_regions = {name: ends[min(i + 1, len(ends) - 1)] for i, name in enumerate(layer_ends)}

    def add(self, job: int, req_id: str) -> None:
        self.jobs[job] = req_id
        self.reqs.add(req_id)
        self.report.add(req_id)

    def completed(self, job: int, req_id: str | None) -> bool:
        """A load job completed; with its request's last load (`req_id`): whether it was reported already."""
        self.jobs.pop(job, None)
        if req_id is not None and req_id in self.reqs:
            self.reqs.discard(req_id)
            return True
        return False

    def wait_for_layer(self, session: Session, regions: int, timeout_s: float, failed: Callable[[int], None]) -> None:
        """Before a layer of a forward: wait until the first `regions` regions of every early load landed
        (or the load finished). A load that does not progress within `timeout_s` fails (`failed(job)`)."""
        self.read = True
        deadline = 0.0
        for job in list(self.jobs):
            landed, deadline = wait_for_landing(session, job, regions, deadline, timeout_s)
            if not landed:
                log.error("kvstore: load job %d did not land in %ss; its blocks are recomputed", job, timeout_s)
                failed(job)
                del self.jobs[job]

    def take_report(self, finished_recving: set[str], session: Session | None, timeout_s: float,
                    completed: Callable[[Completion], object], failed: Callable[[int], None]) -> bool:
        """Report the loads started early in this step as done; after a forward that read early loads,
        wait for their completions (`completed`). Returns False if a request was reported (it runs next
        step: no idle wait)."""
        reported = bool(self.report)
        finished_recving.update(self.report)
        self.report.clear()
        if self.read and self.jobs:
            assert session is not None
            try:
                done = wait_for_jobs(session, list(self.jobs), timeout_s)
            except TimeoutError:  # their blocks are recomputed; the forward does not wait for them again
                log.error("kvstore: early loads %s did not complete in %ss", sorted(self.jobs), timeout_s)
                for job in self.jobs:
                    failed(job)
                self.jobs.clear()
                done = {}
            for completion in done.values():
                completed(completion)
        self.read = False
        return not reported
