"""Ascend NPU backend: the CUDA backend's shape on torch_npu and CANN.

UNVERIFIED ON HARDWARE: written against the documented torch_npu IPC API (`_share_npu_` /
`UntypedStorage._new_shared_npu`, torch_npu >= 7.2, CANN >= 8.3, HDK >= 25.0.RC1) and AscendCL
(aclrtHostRegisterV2 / aclrtHostRegister, aclrtMemcpy[Batch]Async via the native engine,
aclrtMemGetAddressRange through ctypes); never run on an Ascend device. The pure pieces (kernel
check, size rounding, the bounds decision) are tested in tests/device/test_npu_backend.py.

* map: the handle (kvstore_client.device format) carries `_share_npu_()`'s fields and a device
  identity (the ACL runtime has no UUID: npu-smi's VDie / PCIe id of the physical chip; empty =
  match by index). torch_npu exports the base allocation (or the expandable segment's handles) and the
  handle carries the storage's offset in it, so the KV cache needs no alignment of its own. torch_npu
  handles the importer PID whitelist on CANN >= 8.3.
* Bounds: where libascendcl has aclrtMemGetAddressRange, the mapped range must lie inside the
  allocation it reports, rounded up to the 2 MiB page; an error from the query refuses the mapping.
  Where the query is missing or answers "not supported", the daemon trusts the handle's
  `storage_bytes` (the client's claim; `_new_shared_npu` sizes the storage from it) and logs so.
* No event is used across the process boundary (torch_npu's IPC event is not wired up here): the
  engine synchronizes the whole device before submitting a step's stores and loads
  (`kvstore_client.device.order_before_copies`).
* register_pool: registration needs a current device context, so the pool is registered at the
  daemon's start (--devices npu) on its device 0, else on the device of the first mapping, in
  segment-sized pieces (base.pool_pieces: 4 KiB-aligned starts; each size rounded up to 4 KiB), all
  or none, unregistered piece by piece at close. The native engine page-locks with
  aclrtHostRegisterV2(MAPPED | PINNED) (CANN >= 8.5) and falls back to the legacy
  aclrtHostRegister, which does not pin: copies are then synchronous.
  Skipped on kernels <= 5.10, where CANN documents that registering memory not from
  aclrtMallocHost "causes exceptions". Whether one registration serves copies to every NPU is
  unverified; a failed registration only costs speed.
* a load's checksum sample is taken on the copy thread while its DMA runs, as on CUDA (with the
  legacy registration the copy is synchronous: the checksums then follow it).
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import subprocess
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from kvstore_client.protocol.handle import NPU_IPC_ALIGNMENT, check_inside_allocation, resolve_handle
from kvstore_client.protocol.npu_identity import npu_identity
from kvstore_service import native, native_device
from kvstore_service.backends.base import Backend, ChecksumSample, Mapping, TransferPlan
from kvstore_service.native_device import StickyDeviceError

log = logging.getLogger(__name__)

HOST_PAGE = 4096  # aclrtHostRegister[V2] wants 4 KiB-aligned addresses and sizes
# aclError results meaning "this runtime/driver/chip does not offer the call" (acl_base.h, acl_rt.h):
# ACL_ERROR_RT_FEATURE_NOT_SUPPORT, ACL_ERROR_FEATURE_UNSUPPORTED, ACL_ERROR_API_NOT_SUPPORT.
ACL_NOT_SUPPORTED = frozenset({207000, 200006, 200001})


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


def local_npu_uuids(torch: ModuleType) -> list[str]:
    """The identity of each NPU the daemon sees, by its index here, read as engines read theirs
    (kvstore_client.protocol.npu_identity): a handle's device_uuid is looked up in it."""
    npu = torch.npu
    uuids = [npu_identity(npu.get_device_properties(i), i, os.environ, _npu_smi) for i in range(npu.device_count())]
    unknown = [i for i, uuid in enumerate(uuids) if not uuid]
    if unknown:
        log.warning("NPU(s) %s have no identity (no uuid from torch_npu, no answer from npu-smi): engines on them "
                    "cannot register; give the daemon npu-smi", unknown)
    return uuids


def _npu_smi(*args: str) -> str:
    """The output of `npu-smi info <args>`; "" where npu-smi is missing or fails."""
    try:
        return subprocess.run(["npu-smi", "info", *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("npu-smi info %s failed: %s", " ".join(args), e)
        return ""


def kernel_allows_host_register(release: str) -> bool:
    """Whether CANN supports registering non-aclrtMallocHost memory (our /dev/shm pool) on this kernel.

    `release` is `os.uname().release`, e.g. "5.10.0-60.18.0.50.oe2203.aarch64". CANN documents that
    on kernels 5.10 and older such a registration "causes exceptions" (aclrtHostRegister[V2] doc);
    an unparsable release is treated as old."""
    m = re.match(r"\s*(\d+)\.(\d+)", release)
    if m is None:
        return False
    return (int(m.group(1)), int(m.group(2))) > (5, 10)


def host_register_size(size: int) -> int:
    """`size` rounded up to the 4 KiB page aclrtHostRegister[V2] works in."""
    if size <= 0:
        raise ValueError("the pool size must be positive")
    return -(-size // HOST_PAGE) * HOST_PAGE


def acl_address_range(ptr: int, lib: Any = None) -> tuple[int, int] | None:
    """(base, size) of the device allocation containing `ptr`, from aclrtMemGetAddressRange(ptr,
    &base, &size), with the device's context current. None when libascendcl lacks the call or
    answers "not supported"; ValueError on any other failure (fail closed). `lib` is for tests."""
    if lib is None:
        try:
            lib = ctypes.CDLL("libascendcl.so")  # already loaded by torch_npu; this only finds it
        except OSError:
            return None
    fn = getattr(lib, "aclrtMemGetAddressRange", None)
    if fn is None:
        return None
    if hasattr(fn, "argtypes"):  # a real ctypes function; tests pass plain callables
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
    base = ctypes.c_void_p(0)
    size = ctypes.c_size_t(0)
    rc = int(fn(ctypes.c_void_p(ptr), ctypes.pointer(base), ctypes.pointer(size)))
    if rc in ACL_NOT_SUPPORTED:
        return None
    if rc != 0:
        raise ValueError(f"aclrtMemGetAddressRange failed for the imported NPU memory at 0x{ptr:x} (aclError {rc})")
    return int(base.value or 0), int(size.value)


def check_npu_bounds(base: int, size: int, allocation: tuple[int, int] | None) -> bool:
    """Cap the mapping at the page-rounded allocation the runtime reports. Returns False when there
    is no report (the handle's storage_bytes is then all that bounds the copies); ValueError if
    [base, base + size) leaves the allocation."""
    if allocation is None:
        return False
    alloc_base, alloc_size = allocation
    if alloc_size <= 0:
        raise ValueError(f"aclrtMemGetAddressRange reported an empty allocation for 0x{base:x}")
    end = -(-(alloc_base + alloc_size) // NPU_IPC_ALIGNMENT) * NPU_IPC_ALIGNMENT
    check_inside_allocation(base, size, alloc_base, end - alloc_base)
    return True


class NpuBackend(Backend):
    name = "npu"
    checksums_while_copying = True

    def __init__(self) -> None:
        self.torch = require_npu()
        self.uuids = local_npu_uuids(self.torch)
        self.pieces: list[tuple[int, int]] = []  # the pool's (address, size) pieces, to register once
        self.registered: list[int] = []  # addresses of the pieces registered
        self.registered_on: int | None = None  # device whose context registered the pool
        self._warned_unbounded = False

    def register_pool(self, pieces: Sequence[tuple[int, int]], device: int | None = None) -> None:
        release = os.uname().release
        if not kernel_allows_host_register(release):
            log.warning("kernel %s is 5.10 or older: CANN cannot register memory it did not allocate there, so "
                        "the pool is not registered and NPU copies are synchronous and slower", release)
            return
        self.pieces = list(pieces)  # without a device: registered with the first mapping's (needs its context)
        if device is not None:
            self._register_pool_on(device)

    def _register_pool_on(self, device: int) -> None:
        """Register every piece on `device`, all or none; a failure only warns and is not retried."""
        if not self.pieces or self.registered_on is not None:
            return
        done: list[int] = []
        try:
            for addr, size in self.pieces:
                native_device.acl_host_register(addr, host_register_size(size), device)
                done.append(addr)
        except StickyDeviceError:  # the NPU is gone for this process: the daemon restarts
            raise
        except (RuntimeError, ValueError) as e:
            log.warning("registering the pool with ACL failed (piece %d of %d: %s); NPU copies will be slower",
                        len(done) + 1, len(self.pieces), e)
            self._unregister(done, device)
            self.pieces = []  # do not retry on every mapping
            return
        self.registered, self.registered_on = done, device
        if native.features().get("acl_host_pinned") is False:
            log.warning("the pool was registered with the legacy aclrtHostRegister (aclrtHostRegisterV2 needs "
                        "CANN >= 8.5): it is mapped for the NPU but not page-locked, so every NPU copy is "
                        "synchronous")

    def unregister_pool(self) -> None:
        if self.registered_on is not None:
            self._unregister(self.registered, self.registered_on)
        self.registered, self.registered_on = [], None

    @staticmethod
    def _unregister(addresses: list[int], device: int) -> None:
        for addr in addresses:
            try:
                native_device.acl_host_unregister(addr, device)
            except RuntimeError as e:
                log.warning("aclrtHostUnregister of a pool piece failed: %s", e)

    def map(self, handle: bytes, size: int, device: int, fd: int | None = None) -> Mapping:
        local, h = resolve_handle(handle, size, "npu", self.uuids, device)
        torch = self.torch
        with torch.npu.device(local):
            try:
                storage = torch.UntypedStorage._new_shared_npu(*h.share_args(local))
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"cannot import the engine's NPU memory on device {local}: {e}; needs torch_npu "
                                 ">= 7.2, CANN >= 8.3 and HDK >= 25.0.RC1 on the same node") from None
            try:
                if storage.nbytes() < size:
                    raise ValueError(f"the shared NPU storage has fewer bytes than the {size} the layout needs")
                # The copies are bounded by `size`, already checked against storage_bytes. That is the
                # client's claim; the runtime's view of the allocation, where it has one, caps it.
                if not check_npu_bounds(storage.data_ptr(), size, acl_address_range(storage.data_ptr())):
                    if not self._warned_unbounded:
                        log.warning("this CANN has no aclrtMemGetAddressRange: NPU mappings are bounded only by "
                                    "the storage_bytes the engine's handle claims")
                        self._warned_unbounded = True
            except ValueError:
                del storage
                raise
        self._register_pool_on(local)
        return Mapping(storage.data_ptr(), size, device=local, handle=storage)

    def unmap(self, mapping: Mapping) -> None:
        storage, mapping.handle = mapping.handle, None
        del storage  # torch_npu's deleter: stream sync, ref counter release, IPC close

    def load_checksummed(self, mapping: Mapping, pool_base: int, plan: TransferPlan,
                         check: ChecksumSample) -> list[int]:
        return native_device.acl_transfer(pool_base, plan.runs, True, mapping.device, check.offsets, check.size)

    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        native_device.acl_transfer(pool_base, plan.runs, to_engine, mapping.device)
