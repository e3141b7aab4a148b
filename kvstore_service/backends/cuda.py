"""CUDA backend: the engine's KV cache stays in GPU memory; the daemon opens it through CUDA IPC and
moves blocks between it and the pinned pool with the native copy engine (copy engines, batched).

Run on an NVIDIA H100 (tests/device/test_device_backends.py, tests/device/test_cuda_engines.py: vLLM's CUDA
layouts across engine processes, copies ordered by the engine's IPC event, an engine killed
mid-copy); the host-side logic is also tested without a GPU. See docs/devices.md.

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
* ordering: a version-2 handle carries the engine's ring of interprocess events (one ring per engine
  device, recorded round robin by the engine on its stream before it submits a step's copies). map
  opens them (cuIpcOpenEventHandle, once per engine ring and device: the mappings of a session, and a
  re-registration of the same engine, share them) and the last unmap using them destroys them
  (cuEventDestroy). When a job arrives, `order_pending` notes whether the job's own record (its
  `order_seq`: event (seq - 1) % ring length) is still pending, or for a job without one (an older
  client) which events of the ring are (cuEventQuery, from the host); the job's copies start once
  each of those has completed
  (`order_waiting`, polled by kvstore_service.jobs with a deadline and the session's liveness). No
  daemon stream ever waits on an engine's event: such a wait never ends when the engine dies or its
  stream stalls. A version-1 handle (an older client) has none: its copies are not ordered here, and
  such a client synchronizes its stream before stores itself.
* pool: pinned (cuMemHostRegister, portable: one registration serves every GPU) in segment-sized
  pieces (base.pool_pieces), all or none: at the daemon's start (--devices cuda) on its GPU 0,
  else on the device of the first mapping, not on GPU 0, which would create a context on a GPU no
  engine uses. Unpinned piece by piece at close.
* copy: `native_device.cuda_copy_blocks` on the device's primary context (the one torch's runtime uses,
  so the IPC pointer is valid there), returning once every byte landed. A sticky driver error
  (700 illegal address, 719 launch failed, ...: the context is dead for the whole process) raises
  `StickyDeviceError` (kvstore_service.native_device): the daemon must exit and be restarted.
* a load's checksum sample (--verify-loads) is taken on the copy thread once the chunk's DMA is
  enqueued, while it runs (`load_checksummed`): hidden behind the copy, not before it (as the cpu
  backend's, a corrupt block may land in the engine; the job names it failed).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvstore_client.protocol.handle import (
    IPC_EVENT_HANDLE_BYTES,
    check_inside_allocation,
    normalize_uuid,
    resolve_handle,
)
from kvstore_service import native, native_device
from kvstore_service.backends.base import Backend, ChecksumSample, Mapping, TransferPlan
from kvstore_service.errors import KVError
from kvstore_service.native_device import StickyDeviceError, is_sticky_cuda_error

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


def local_cuda_uuids() -> list[str]:
    """The UUID of each GPU the daemon sees, by its index here (an engine's indices may differ: its
    handle names the GPU by UUID)."""
    import torch

    return [normalize_uuid(str(torch.cuda.get_device_properties(i).uuid)) for i in range(torch.cuda.device_count())]


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


@dataclass
class Held:
    """What a CUDA mapping keeps until unmap."""

    storage: Any  # torch's shared storage: dropping it closes the IPC mapping
    events: list[int]  # the engine's ring of ordering events opened here (CUevents); []: none (version 1)
    event_key: tuple[int, bytes] | None  # (device, event handles): their entry in CudaBackend.events


class CudaBackend(Backend):
    name = "cuda"
    checksums_while_copying = True

    def __init__(self) -> None:
        self.torch = require_cuda()
        self.uuids = local_cuda_uuids()
        self.pieces: list[tuple[int, int]] = []  # the pool's (address, size) pieces, to pin once
        self.pinned: list[tuple[int, int]] = []  # the pieces pinned
        self.pinned_on: int | None = None  # the device whose context pinned them
        self.pin_failure = ""  # why pinning failed (it is not retried)
        self._pin_lock = threading.Lock()
        # Engine event rings opened here: (device, handles) -> ([CUevent, ...], mappings using them).
        self.events: dict[tuple[int, bytes], tuple[list[int], list[int]]] = {}
        self._event_lock = threading.Lock()
        self._warned_unordered = False
        self._cuda: ctypes.CDLL | None = None

    def register_pool(self, pieces: Sequence[tuple[int, int]], device: int | None = None) -> None:
        # Without a device, only recorded: the first mapping pins it on its own device (pin_pool_on).
        self.pieces = list(pieces)
        if device is not None:
            self.pin_pool_on(device)

    def pin_pool_on(self, device: int) -> None:
        """Pin the recorded pool on `device`'s context, once, piece by piece: cuMemHostRegister
        (portable: one registration serves every GPU), not pin_memory, which would round the size up
        to a power of two. All or none: a piece that fails unpins the ones before it. Failing to pin
        is not retried, and not fatal (pageable copies still work, slower) unless the copy kernel is on
        (KVSTORE_CUDA_COPY_KERNEL): it reads the pool through its mapped addresses, and an unmapped
        one would fault the GPU (a sticky error: the daemon exits), so every mapping is refused. A
        sticky error is raised."""
        kernel = native.features().get("cuda_copy_kernel")
        with self._pin_lock:
            if self.pieces and self.pinned_on is None:
                pinned: list[tuple[int, int]] = []
                try:
                    for addr, size in self.pieces:
                        native_device.cuda_host_register(addr, size, device)
                        pinned.append((addr, size))
                except StickyDeviceError:
                    raise
                except RuntimeError as e:
                    self.pin_failure = f"piece {len(pinned) + 1} of {len(self.pieces)}: {e}"
                    log.warning("could not pin the pool for GPU copies (%s); %s", self.pin_failure,
                                "engines are refused (KVSTORE_CUDA_COPY_KERNEL)" if kernel else "copies will be slower")
                    self._unpin(pinned, device)
                    self.pieces = []  # do not retry on every mapping
                else:
                    self.pinned, self.pinned_on = pinned, device
            if self.pin_failure and kernel:
                raise KVError("FAILED_PRECONDITION", "KVSTORE_CUDA_COPY_KERNEL is set, but the pool could not be "
                              f"pinned and mapped for the GPU ({self.pin_failure}); unset it to copy with the "
                              "copy engines")

    def unregister_pool(self) -> None:
        with self._pin_lock:
            if self.pinned_on is not None:
                self._unpin(self.pinned, self.pinned_on)
            self.pinned, self.pinned_on = [], None

    @staticmethod
    def _unpin(pieces: list[tuple[int, int]], device: int) -> None:
        for addr, _ in pieces:
            try:
                native_device.cuda_host_unregister(addr, device)
            except RuntimeError as e:
                log.warning("cuMemHostUnregister of a pool piece failed: %s", e)

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
                events = self._open_events(local, h.order_event)
            except BaseException:
                del storage  # close the IPC mapping now, not when the traceback goes
                raise
        key = (local, h.order_event) if events else None
        mapping = Mapping(base, size, device=local, handle=Held(storage, events, key))
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

    def _open_events(self, device: int, handles: bytes) -> list[int]:
        """The engine's ring of ordering events on `device`, opened once per ring ([] without one)."""
        if not handles:
            if not self._warned_unordered:
                log.warning("an engine sent a CUDA handle without an ordering event (a client older than handle "
                            "version 2): the daemon does not order its copies; such a client synchronizes its "
                            "stream before stores")
                self._warned_unordered = True
            return []
        with self._event_lock:
            known = self.events.get((device, handles))
            if known is not None:
                known[1][0] += 1
                return known[0]
            events: list[int] = []
            try:
                for i in range(0, len(handles), IPC_EVENT_HANDLE_BYTES):
                    events.append(native_device.cuda_open_ipc_event(handles[i:i + IPC_EVENT_HANDLE_BYTES], device))
            except RuntimeError as e:
                self._destroy(events, device)
                if isinstance(e, StickyDeviceError):
                    raise
                raise ValueError(f"cannot open the engine's IPC event on GPU {device}: {e}; the copies could not "
                                 "be ordered after the engine's writes") from None
            self.events[(device, handles)] = (events, [1])
            return events

    def _release_events(self, key: tuple[int, bytes]) -> None:
        with self._event_lock:
            events, users = self.events[key]
            users[0] -= 1
            if users[0] > 0:
                return
            del self.events[key]
        self._destroy(events, key[0])

    @staticmethod
    def _destroy(events: list[int], device: int) -> None:
        for event in events:
            try:
                native_device.cuda_destroy_event(event, device)
            except RuntimeError as e:
                log.warning("cuEventDestroy of an engine's event failed: %s", e)

    def unmap(self, mapping: Mapping) -> None:
        held, mapping.handle = mapping.handle, None
        assert isinstance(held, Held)
        key, held.storage = held.event_key, None  # torch's deleter: stream sync, ref counter release, IPC close
        if key is not None:  # this session's copies are over: nothing polls its events any more
            self._release_events(key)

    def order_pending(self, mapping: Mapping, seq: int = 0) -> list[int]:
        held = mapping.handle
        assert isinstance(held, Held)
        if seq > 0 and held.events:
            # Just the job's own record: not the records made after it (the next step's forward). Its
            # event may have been recorded again since (the ring came round, or a re-registration
            # recorded every event): the job then waits for that later record too. Conservative (a
            # later record completes after the job's own one, on the same stream), so still correct.
            return self.order_waiting(mapping, [held.events[(seq - 1) % len(held.events)]])
        return self.order_waiting(mapping, held.events)

    def order_waiting(self, mapping: Mapping, pending: list[int]) -> list[int]:
        return [e for e in pending if not native_device.cuda_query_event(e, mapping.device)]

    def load_checksummed(self, mapping: Mapping, pool_base: int, plan: TransferPlan,
                         check: ChecksumSample) -> list[int]:
        return native_device.cuda_transfer(pool_base, plan.runs, True, mapping.device, check.offsets, check.size)

    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        # Ordered already: the job's copies start only once the engine's records made before the job
        # arrived are done (order_pending / order_waiting).
        native_device.cuda_transfer(pool_base, plan.runs, to_engine, mapping.device)
