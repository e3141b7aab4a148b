"""Ascend NPU backend: the CUDA backend's shape on torch_npu and CANN.

UNVERIFIED ON HARDWARE: written against the documented torch_npu IPC API (`_share_npu_` /
`UntypedStorage._new_shared_npu`, torch_npu >= 7.2, CANN >= 8.3, HDK >= 25.0.RC1) and AscendCL
(aclrtHostRegister, aclrtMemcpy[Batch]Async via the native engine); never run on an Ascend device.

* map: the handle (kvstore_client.device format) carries `_share_npu_()`'s fields and a device
  identity (the ACL runtime has no UUID: npu-smi's VDie / PCIe id; empty = match by index). The
  engine's KV cache must start 2 MiB aligned (Ascend IPC exports page-aligned memory only); the
  engine checks that before exporting. torch_npu handles the importer PID whitelist on CANN >= 8.3.
* No event crosses the process boundary (Ascend IPC cannot carry events): the engine synchronizes
  its stream before submitting stores (`kvstore_client.device.synchronize_before_store`).
* register_pool: aclrtHostRegister needs a current device context, so the pool is registered on
  the device of the first mapping (the pool's data area is 2 MiB aligned already). Whether one
  registration serves copies to every NPU is unverified; a failed registration only costs speed.
"""

from __future__ import annotations

import logging
from types import ModuleType

from kvstore_client.protocol.handle import local_npu_uuids, resolve_handle
from kvstore_service import native
from kvstore_service.backends.base import Backend, Mapping, TransferPlan

log = logging.getLogger(__name__)


def require_npu() -> ModuleType:
    """torch (with torch_npu loaded), once the daemon can drive an NPU; RuntimeError naming what is missing."""
    feats = native.features()
    if not feats.get("acl_available"):
        reason = feats.get("acl_error") or "the native engine has no ACL support"
        raise RuntimeError(f"no NPU (Ascend) device: {reason}")
    try:
        import torch
        import torch_npu  # noqa: F401  # registers torch.npu and the NPU storage IPC methods
    except ImportError as e:
        raise RuntimeError(f"no NPU (Ascend) device: torch_npu is not importable in the daemon ({e})") from None
    if not torch.npu.is_available():  # type: ignore[attr-defined]
        raise RuntimeError("no NPU (Ascend) device visible to torch_npu in the daemon")
    return torch


class NpuBackend(Backend):
    name = "npu"

    def __init__(self) -> None:
        self.torch = require_npu()
        self.uuids = local_npu_uuids()
        self.pool: tuple[int, int] | None = None
        self.registered_on: int | None = None  # device whose context registered the pool

    def register_pool(self, base: int, size: int) -> None:
        self.pool = (base, size)  # registered with the first mapping's device (needs its context)

    def _register_pool_on(self, device: int) -> None:
        if self.pool is None or self.registered_on is not None:
            return
        base, size = self.pool
        try:
            native.acl_host_register(base, size, device)
            self.registered_on = device
        except RuntimeError as e:
            log.warning("aclrtHostRegister of the %d-byte pool failed (%s); NPU copies will be slower", size, e)
            self.pool = None  # do not retry on every mapping

    def unregister_pool(self, base: int) -> None:
        if self.registered_on is not None:
            try:
                native.acl_host_unregister(base, self.registered_on)
            except RuntimeError as e:
                log.warning("aclrtHostUnregister of the pool failed: %s", e)
            self.registered_on = None

    def map(self, handle: bytes, size: int, device: int, fd: int | None = None) -> Mapping:
        local, h = resolve_handle(handle, size, "npu", self.uuids, device)
        torch = self.torch
        with torch.npu.device(local):
            try:
                storage = torch.UntypedStorage._new_shared_npu(*h.share_args(local))
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"cannot import the engine's NPU memory on device {local}: {e}; needs torch_npu "
                                 ">= 7.2, CANN >= 8.3 and HDK >= 25.0.RC1 on the same node") from None
            if storage.nbytes() < size:
                del storage
                raise ValueError(f"the shared NPU storage has fewer bytes than the {size} the layout needs")
        self._register_pool_on(local)
        return Mapping(storage.data_ptr(), size, device=local, handle=storage)

    def unmap(self, mapping: Mapping) -> None:
        storage, mapping.handle = mapping.handle, None
        del storage  # torch_npu's deleter: stream sync, ref counter release, IPC close

    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        if to_engine:
            native.acl_copy_blocks(pool_base, mapping.base, plan.pool_offsets, plan.engine_offsets, plan.sizes,
                                   "h2d", mapping.device)
        else:
            native.acl_copy_blocks(mapping.base, pool_base, plan.engine_offsets, plan.pool_offsets, plan.sizes,
                                   "d2h", mapping.device)
