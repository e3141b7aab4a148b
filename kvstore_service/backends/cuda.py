"""CUDA backend: the engine's KV cache stays in GPU memory; the daemon opens it through CUDA IPC and
moves blocks between it and the pinned pool with the native copy engine (copy engines, batched).

NOT YET RUN ON A GPU: written against torch's and CUDA's documented behaviour; the host-side logic
(handle parsing, device mapping, bounds) is tested without a GPU, tests/test_device_backends.py has
the end-to-end GPU test. See docs/devices.md.

* map: the handle (kvstore_client.device format, JSON, never pickle) carries `_share_cuda_()`'s
  fields and the GPU UUID. The local device is found by UUID (engine and daemon may see different
  CUDA_VISIBLE_DEVICES); `torch.UntypedStorage._new_shared_cuda` opens the IPC handle
  (cudaIpcOpenMemHandle, cached per process by torch) and returns a storage whose data pointer is
  already segment base + storage_offset: that pointer is the mapping's base.
* unmap: dropping the storage runs torch's deleter: it syncs the daemon's current stream, gives the
  engine's reference counter back and, on the last reference, cudaIpcCloseMemHandle; this happens
  when the session ends, i.e. before an engine that closes its session frees the memory.
* bounds: the driver's range of the allocation holding the mapping (cuMemGetAddressRange) must
  contain the `size` bytes the layout needs; when it cannot be queried the registration is refused
  (fail closed: the handle's sizes come from the client).
* pool: pinned (cuMemHostRegister, portable) on the device of the first mapping, not on GPU 0,
  which would create a context on a GPU no engine uses (and fails in EXCLUSIVE_PROCESS mode).
* copy: `native.cuda_copy_blocks` on the device's primary context (the one torch's runtime uses,
  so the IPC pointer is valid there), returning once every byte landed. A sticky driver error
  (700 illegal address, 719 launch failed, ...: the context is dead for the whole process) raises
  `StickyDeviceError` (kvstore_service.native): the daemon must exit and be restarted.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from types import ModuleType

from kvstore_client.protocol.handle import check_inside_allocation, local_cuda_uuids, resolve_handle
from kvstore_service import native
from kvstore_service.backends.base import Backend, Mapping, TransferPlan
from kvstore_service.native import StickyDeviceError, is_sticky_cuda_error

__all__ = ["CudaBackend", "StickyDeviceError", "check_ipc_bounds", "is_sticky_cuda_error", "require_cuda"]

log = logging.getLogger(__name__)

# (CUresult, allocation base, allocation size) of cuMemGetAddressRange for a device pointer.
AddressRangeQuery = Callable[[int], tuple[int, int, int]]


def check_ipc_bounds(base: int, size: int, query: AddressRangeQuery) -> None:
    """Refuse (ValueError) unless the driver confirms that [base, base + size) lies inside one
    allocation. Fails closed: a query that cannot run or returns an error refuses the registration,
    since the sizes in the handle are only the client's word."""
    try:
        rc, alloc_base, alloc_size = query(base)
    except (OSError, AttributeError) as e:
        raise ValueError(f"cannot check that the engine's CUDA memory holds the {size} bytes its layout needs: "
                         f"cuMemGetAddressRange is not callable ({e}); refusing the registration") from None
    if rc != 0:
        raise ValueError(f"cannot check that the engine's CUDA memory holds the {size} bytes its layout needs: "
                         f"cuMemGetAddressRange failed for address {base:#x} (CUDA error {rc}); "
                         "refusing the registration")
    check_inside_allocation(base, size, alloc_base, alloc_size)


def require_cuda() -> ModuleType:
    """torch, once the daemon can drive a GPU; RuntimeError naming what is missing otherwise."""
    feats = native.features()
    if not feats.get("cuda_available"):
        raise RuntimeError(f"no CUDA device: {feats.get('cuda_error') or 'the native engine has no CUDA support'}")
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(f"no CUDA device: torch is not importable in the daemon ({e})") from None
    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device visible to torch {torch.__version__} in the daemon "
                           f"(CUDA build: {torch.version.cuda or 'none'}); the daemon needs a CUDA build of torch")
    return torch


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self) -> None:
        self.torch = require_cuda()
        self.uuids = local_cuda_uuids()
        self.pool: tuple[int, int] | None = None  # (base, size) to pin with the first mapping
        self.pinned: int | None = None  # base of the pinned pool
        self.pinned_on: int | None = None  # the device whose context pinned it
        self._pin_lock = threading.Lock()
        self._cuda: ctypes.CDLL | None = None

    def register_pool(self, base: int, size: int) -> None:
        # Only recorded: the pool is pinned on the device of the first mapping (pin_pool_on), so that
        # no context is created on a GPU no engine uses.
        self.pool = (base, size)

    def pin_pool_on(self, device: int) -> None:
        """Pin the recorded pool on `device`'s context, once. cuMemHostRegister (portable: one
        registration serves every GPU), not pin_memory, which would round the size up to a power of
        two. Failing to pin is not fatal: pageable copies still work (slower); it is not retried."""
        with self._pin_lock:
            if self.pool is None or self.pinned is not None:
                return
            base, size = self.pool
            try:
                native.cuda_host_register(base, size, device)
                self.pinned, self.pinned_on = base, device
            except StickyDeviceError:
                raise
            except RuntimeError as e:
                log.warning("could not pin the %d-byte pool for GPU copies (%s); copies will be slower", size, e)
                self.pool = None  # do not retry on every mapping

    def unregister_pool(self, base: int) -> None:
        with self._pin_lock:
            if self.pinned == base and self.pinned_on is not None:
                try:
                    native.cuda_host_unregister(base, self.pinned_on)
                except RuntimeError as e:
                    log.warning("cuMemHostUnregister of the pool failed: %s", e)
                self.pinned = self.pinned_on = None

    def map(self, handle: bytes, size: int, device: int, fd: int | None = None) -> Mapping:
        local, h = resolve_handle(handle, size, "cuda", self.uuids, device)
        torch = self.torch
        with torch.cuda.device(local):
            try:
                storage = torch.UntypedStorage._new_shared_cuda(*h.share_args(local))
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"cannot open the engine's CUDA IPC handle on GPU {local} ({h.device_uuid}): {e}; "
                                 "the daemon must run on the same node, and expandable_segments needs "
                                 "pidfd_getfd (ptrace) permission") from None
            try:
                base = storage.data_ptr()
                if storage.nbytes() < size:
                    raise ValueError(f"the shared storage has {storage.nbytes()} bytes, the layout needs {size}")
                check_ipc_bounds(base, size, self._allocation_range)
            except BaseException:
                del storage  # close the IPC mapping now, not when the traceback goes
                raise
        mapping = Mapping(base, size, device=local, handle=storage)
        try:
            self.pin_pool_on(local)
        except BaseException:
            self.unmap(mapping)
            raise
        return mapping

    def _allocation_range(self, ptr: int) -> tuple[int, int, int]:
        """(CUresult, base, size) of cuMemGetAddressRange for ptr, on the current context (the one
        torch's runtime made current to open the IPC handle). OSError/AttributeError when libcuda or
        the entry point cannot be loaded."""
        if self._cuda is None:
            self._cuda = ctypes.CDLL("libcuda.so.1")
        fn = self._cuda.cuMemGetAddressRange_v2
        fn.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        fn.restype = ctypes.c_int
        alloc_base, alloc_size = ctypes.c_uint64(), ctypes.c_size_t()
        rc = fn(ctypes.byref(alloc_base), ctypes.byref(alloc_size), ctypes.c_uint64(ptr))
        return int(rc), alloc_base.value, alloc_size.value

    def unmap(self, mapping: Mapping) -> None:
        storage, mapping.handle = mapping.handle, None
        del storage  # torch's deleter: stream sync, ref counter release, cudaIpcCloseMemHandle

    def copy(self, device: int, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        if to_engine:
            native.cuda_copy_blocks(pool_base, 0, plan.pool_offsets, plan.engine_addresses, plan.sizes,
                                    "h2d", device)
        else:
            native.cuda_copy_blocks(0, pool_base, plan.engine_addresses, plan.pool_offsets, plan.sizes,
                                    "d2h", device)
