"""A prototype of changes proposed for `kvstore_client.vllm.KVStoreConnector`'s per-step path (benchmark only).

`bench_vllm.py --proposed` runs its connector-on engines with this class (timed the same way) so the effect
of the proposals on the per-step cost can be measured; the shipped connector is not changed. Behaviour is
the same as the shipped connector's:

1. `has_connector_metadata()` answers False on the worker. vLLM's attention wrapper
   (`model_executor/layers/attention/kv_transfer_utils.py:47`) then skips `wait_for_layer_load` and
   `save_kv_layer`, two Python calls per layer and step that do nothing here (loads finish before a request
   is scheduled; stores are whole blocks, submitted in `wait_for_save`). Nothing else in vLLM 0.32 calls it;
   `_get_connector_metadata()` (used by start_load_kv / wait_for_save) does not depend on it.
2. `handle_preemptions` looks at the in-flight stores only when a request was preempted this step (the
   shipped `_Worker.flush` builds a list over every in-flight store job on every step).
3. `get_transfer_results` is answered directly (no `get_finished` indirection) and, when no job is in flight,
   no completion is queued and no request finished, without taking the session lock or scanning the
   completion channel.
4. `get_kv_connector_stats` on the worker skips `KVStoreConnectorStats.is_empty()` (a scan of every
   counter) while no job completed since the last call.
5. In a step with no forward (vLLM spins such steps, ~0.1 ms each, while requests wait for their loads),
   `get_transfer_results` sleeps `IDLE_WAIT_S` when loads are in flight: the engine's busy loop stops
   taking a whole core (and the GIL) from the daemon's copies and the client's submit thread. Only steps
   with nothing to compute wait.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore_client.vllm import KVStoreConnector, KVStoreConnectorMetadata

IDLE_WAIT_S = 0.0005


class ProposedKVStoreConnector(KVStoreConnector):
    _idle_step = False

    def has_connector_metadata(self) -> bool:
        if self.worker is not None:
            return False  # nothing to do per layer: vLLM skips wait_for_layer_load / save_kv_layer
        return super().has_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self.worker is not None and isinstance(kv_connector_metadata, KVStoreConnectorMetadata)
        if kv_connector_metadata.preempted:
            self.worker.flush(kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        self._idle_step = getattr(forward_context, "attn_metadata", None) is None  # no forward this step

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        w = self.worker
        assert w is not None
        if self._idle_step and w.load_jobs:
            time.sleep(IDLE_WAIT_S)  # nothing to compute: let the daemon copy
        session: Any = w.session
        if (not finished_req_ids and not w.finished_waiting and session is not None and not session._pending
                and not session._done and session.connected):
            return KVConnectorTransferResults()
        sending, recving = w.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        w = self.worker
        if w is None:
            return None
        data = w.stats.data
        if not (data["loaded_blocks"] or data["load_failed_blocks"] or data["stored_blocks"]
                or data["store_failed_blocks"] or data["sidecar_unavailable"]):
            return None
        return w.take_stats()

