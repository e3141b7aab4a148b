"""Device copies of the native extension, typed: CUDA (csrc/cuda_copy.cpp) and Ascend (csrc/acl_copy.cpp).

Copies between device and host memory with checksums taken meanwhile, pinning of host memory, engines'
IPC events; RuntimeError without a driver or device. A driver error that leaves the device unusable for
the process is raised as ``StickyDeviceError``: the daemon exits on it, to be restarted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Final

from kvstore_service.native import Runs, U64Array, _as_u64, _native, _u64_list, features

# CUresults the CUDA driver API documents as sticky: "This leaves the process in an inconsistent
# state and any further CUDA work will return the same error. To continue using CUDA, the process
# must be terminated and relaunched." (cuda.h, CUresult; the MPS one says the same in other words.)
STICKY_CUDA_ERRORS: Final[dict[int, str]] = {
    226: "CUDA_ERROR_CONTAINED",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    702: "CUDA_ERROR_LAUNCH_TIMEOUT",
    714: "CUDA_ERROR_HARDWARE_STACK_ERROR",
    715: "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    716: "CUDA_ERROR_MISALIGNED_ADDRESS",
    717: "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    718: "CUDA_ERROR_INVALID_PC",
    719: "CUDA_ERROR_LAUNCH_FAILED",
    721: "CUDA_ERROR_TENSOR_MEMORY_LEAK",
    810: "CUDA_ERROR_MPS_CLIENT_TERMINATED",
    911: "CUDA_ERROR_EXTERNAL_DEVICE",
}


class StickyDeviceError(RuntimeError):
    """A device error that left the device context unusable for the whole process (every later
    call fails the same way): the daemon must exit non-zero and be restarted by its supervisor;
    the pool (shared memory) survives and is re-attached. `code` is the driver's error code."""

    def __init__(self, message: str, code: int, device: int) -> None:
        super().__init__(message)
        self.code = code
        self.device = device


# aclErrors (acl_base.h) after which the NPU or its memory is gone for this process: device memory
# (UCE) and HBM ECC errors, which torch_npu itself answers by stopping the device, a lost device
# heartbeat, a closed host-device channel, a driver-internal error. The daemon exits on them as on a
# sticky CUDA error (unverified on hardware: which codes a real fault returns is not known here).
STICKY_ACL_ERRORS: Final[dict[int, str]] = {
    507010: "ACL_ERROR_RT_LOST_HEARTBEAT",
    507053: "ACL_ERROR_RT_DEVICE_MEM_ERROR",
    507054: "ACL_ERROR_RT_HBM_MULTI_BIT_ECC_ERROR",
    507055: "ACL_ERROR_RT_SUSPECT_DEVICE_MEM_ERROR",
    507899: "ACL_ERROR_RT_DRV_INTERNAL_ERROR",
    507901: "ACL_ERROR_RT_SOCKET_CLOSE",
}


def is_sticky_cuda_error(code: int | None) -> bool:
    """Whether a CUresult leaves the CUDA context (and the process) unusable."""
    return code in STICKY_CUDA_ERRORS


@contextlib.contextmanager
def _sticky_errors(device: int, attribute: str, which: Callable[[int], str | None]) -> Iterator[None]:
    """Around a native device call: a failure whose driver code (the engine sets it as `attribute`)
    leaves the device unusable (`which` names it) is raised as StickyDeviceError, any other as it is."""
    try:
        yield
    except RuntimeError as e:
        code = getattr(e, attribute, None)
        if not isinstance(code, int) or (what := which(code)) is None:
            raise
        raise StickyDeviceError(f"{e} [{what} is unusable until the daemon restarts]", code, device) from e


def _sticky_cuda_errors(device: int) -> contextlib.AbstractContextManager[None]:
    return _sticky_errors(device, "cuda_error",
                          lambda code: f"sticky: the CUDA context of device {device}"
                          if is_sticky_cuda_error(code) else None)


def cuda_copy_blocks(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array,
                     sizes: U64Array, direction: str, device: int, stream: int = 0,
                     allow_batch: bool = True, checksum_base: int = 0, checksum_offsets: U64Array | None = None,
                     checksum_size: int = 0) -> list[int]:
    """Copy between GPU memory and host memory ('h2d', 'd2h', 'd2d') and wait for completion.
    Returns the CRC32C of each `checksum_size`-byte host block at checksum_base + checksum_offsets[i],
    taken while the copy runs (after it was enqueued, before the wait). StickyDeviceError when the
    driver reports an error that leaves the context unusable."""
    with _sticky_cuda_errors(device):
        return _copy_blocks(_native.cuda_copy_blocks, src_base, dst_base, src_offsets, dst_offsets, sizes, direction,
                            device, stream, allow_batch, checksum_base, checksum_offsets, checksum_size)


def _copy_blocks(copy: Callable[..., bytes], src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array,
                 sizes: U64Array, direction: str, device: int, stream: int, allow_batch: bool, checksum_base: int,
                 checksum_offsets: U64Array | None, checksum_size: int) -> list[int]:
    """A device's native copy (`copy`: CUDA's or ACL's, one signature) with its arrays as the engine takes them."""
    return _u64_list(copy(src_base, dst_base, _as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes), direction,
                          device, stream, allow_batch, checksum_base,
                          None if checksum_offsets is None else _as_u64(checksum_offsets), checksum_size))


def cuda_transfer(pool_base: int, runs: Runs, to_engine: bool, device: int, checksum_offsets: U64Array | None = None,
                  checksum_size: int = 0) -> list[int]:
    """A chunk's runs (native.plan_transfer's) copied as cuda_copy_blocks copies, pool -> engine if
    `to_engine`; returns the CRC32C of each `checksum_size`-byte pool block at pool_base +
    checksum_offsets[i], taken while the copy runs."""
    with _sticky_cuda_errors(device):
        return _transfer(_native.cuda_transfer, pool_base, runs, to_engine, device, checksum_offsets, checksum_size)


def _transfer(transfer: Callable[..., bytes], pool_base: int, runs: Runs, to_engine: bool, device: int,
              checksum_offsets: U64Array | None, checksum_size: int) -> list[int]:
    """A device's native transfer (`transfer`: CUDA's or ACL's, one signature), its offsets converted."""
    return _u64_list(transfer(pool_base, runs, to_engine, device,
                              None if checksum_offsets is None else _as_u64(checksum_offsets), checksum_size))


def cuda_open_ipc_event(handle: bytes, device: int) -> int:
    """Open another process's interprocess event (its 64-byte cudaIpcEventHandle_t) in `device`'s
    primary context, the one the copies run in; returns the CUevent. Destroy it with cuda_destroy_event."""
    with _sticky_cuda_errors(device):
        return int(_native.cuda_open_ipc_event(handle, device))


def cuda_query_event(event: int, device: int) -> bool:
    """Whether the work recorded in an event opened with cuda_open_ipc_event is done (cuEventQuery,
    never blocks). RuntimeError for any other answer (StickyDeviceError for a sticky one)."""
    with _sticky_cuda_errors(device):
        return bool(_native.cuda_query_event(event, device))


def cuda_destroy_event(event: int, device: int) -> None:
    _native.cuda_destroy_event(event, device)


def cuda_host_register(addr: int, size: int, device: int = 0) -> None:
    """Pin host memory (e.g. the pool) for fast asynchronous GPU copies."""
    with _sticky_cuda_errors(device):
        _native.cuda_host_register(addr, size, device)


def cuda_host_unregister(addr: int, device: int = 0) -> None:
    _native.cuda_host_unregister(addr, device)


def cuda_batch_memcpy_allowed() -> bool:
    """The KVSTORE_CUDA_BATCH_MEMCPY switch as the engine read it (once, when CUDA was first used):
    False for 0/false/no/off. `features()["cuda_batch_memcpy"]` says whether copies use the batch API."""
    return bool(features().get("cuda_batch_memcpy_allowed", True))


def _sticky_acl_errors(device: int) -> contextlib.AbstractContextManager[None]:
    """StickyDeviceError for an aclError in STICKY_ACL_ERRORS (the engine's `acl_error`)."""
    return _sticky_errors(device, "acl_error",
                          lambda code: f"{STICKY_ACL_ERRORS[code]}: NPU {device}" if code in STICKY_ACL_ERRORS
                          else None)


def acl_copy_blocks(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array,
                    sizes: U64Array, direction: str, device: int, stream: int = 0,
                    allow_batch: bool = True, checksum_base: int = 0, checksum_offsets: U64Array | None = None,
                    checksum_size: int = 0) -> list[int]:
    """Ascend counterpart of cuda_copy_blocks, checksums included (unverified on hardware).
    StickyDeviceError for an error in STICKY_ACL_ERRORS."""
    with _sticky_acl_errors(device):
        return _copy_blocks(_native.acl_copy_blocks, src_base, dst_base, src_offsets, dst_offsets, sizes, direction,
                            device, stream, allow_batch, checksum_base, checksum_offsets, checksum_size)


def acl_transfer(pool_base: int, runs: Runs, to_engine: bool, device: int, checksum_offsets: U64Array | None = None,
                 checksum_size: int = 0) -> list[int]:
    """Ascend counterpart of cuda_transfer (unverified on hardware). StickyDeviceError for an error in
    STICKY_ACL_ERRORS."""
    with _sticky_acl_errors(device):
        return _transfer(_native.acl_transfer, pool_base, runs, to_engine, device, checksum_offsets, checksum_size)


def acl_host_register(addr: int, size: int, device: int = 0) -> int:
    """aclrtHostRegister(MAPPED); returns the device-side address of the host range."""
    with _sticky_acl_errors(device):
        return int(_native.acl_host_register(addr, size, device))


def acl_host_unregister(addr: int, device: int = 0) -> None:
    _native.acl_host_unregister(addr, device)
