"""Device (CUDA / Ascend NPU) KV memory, engine side: what an engine sends the daemon so it can map its KV cache.

`export_kv_memory(tensors)` turns a KV cache that lives in one device allocation (vLLM allocates one
int8 buffer and hands out one strided view per layer) into a `MemorySpec` whose `handle` names that
allocation through the device's IPC mechanism (the codec is `kvstore_client.protocol.handle`), and
whose `reexport` makes a fresh handle for each later registration (after a daemon restart):

* CUDA: `UntypedStorage._share_cuda_()` (a cudaIpcMemHandle of the caching allocator's segment,
  the storage's offset in it, torch's shared-memory reference counter and an IPC event);
* NPU: `UntypedStorage._share_npu_()` from torch_npu (the same eight fields; Ascend IPC).

`synchronize_before_store(device)` is the ordering step the engine runs before it submits stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvstore_client.client import MemorySpec
from kvstore_client.protocol.handle import (
    KINDS,
    check_npu_alignment,
    cuda_device_uuid,
    encode_handle,
    handle_from_share,
    npu_device_uuid,
)

if TYPE_CHECKING:
    import torch


def kv_regions(tensors: Sequence[torch.Tensor]) -> tuple[int, list[tuple[int, int, int]]]:
    """(num_blocks, regions) of KV tensors that share one storage, block index first (shape[0]).

    Region i, block b occupies bytes [offset + b * stride, + block_bytes) of the storage, with
    offset = tensor start - storage start, stride = stride(0) * element size and block_bytes =
    t[0].numel() * element size; t[0] must be contiguous. Tensors keep the caller's order.
    """
    if not tensors:
        raise ValueError("no KV tensors to register")
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    if len(storages) != 1:
        raise ValueError(f"the KV tensors live in {len(storages)} allocations; kvstore maps one "
                         "(vLLM's single KV buffer with per-layer views)")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"the KV tensors are on several devices: {sorted(map(str, devices))}")
    storage = tensors[0].untyped_storage()
    base, nbytes = storage.data_ptr(), storage.nbytes()
    if tensors[0].dim() == 0 or tensors[0].shape[0] == 0:
        raise ValueError("a KV tensor needs a leading block dimension with at least one block")
    num_blocks = tensors[0].shape[0]
    regions = []
    for i, t in enumerate(tensors):
        if t.dim() == 0 or t.shape[0] != num_blocks:
            raise ValueError(f"KV tensor {i} has shape {tuple(t.shape)}; every tensor needs {num_blocks} blocks "
                             "in dimension 0")
        if not t[0].is_contiguous():
            raise ValueError(f"KV tensor {i}: a block of shape {tuple(t.shape)} with strides {t.stride()} "
                             "is not contiguous")
        size = t.element_size()
        offset, stride, block_bytes = t.data_ptr() - base, t.stride(0) * size, t[0].numel() * size
        end = offset + (num_blocks - 1) * stride + block_bytes
        if offset < 0 or end > nbytes:
            raise ValueError(f"KV tensor {i} spans bytes {offset}..{end}, outside its {nbytes}-byte storage")
        regions.append((offset, stride, block_bytes))
    return num_blocks, regions


def export_kv_memory(tensors: Sequence[torch.Tensor]) -> MemorySpec:
    """A MemorySpec for a CUDA or NPU KV cache held in one device allocation (see `kv_regions`).

    The storage stays shared with the daemon for as long as the engine lives: keep the tensors
    alive, and close the kvstore session before freeing them (the daemon must unmap first).
    """
    if not tensors:
        raise ValueError("no KV tensors to register")
    device = tensors[0].device
    if device.type not in KINDS:
        raise ValueError(f"{device.type} KV tensors cannot be exported as device memory; for CPU use "
                         "kvstore_client.shm.move_to_shared_memory")
    num_blocks, regions = kv_regions(tensors)
    storage = tensors[0].untyped_storage()
    index = device.index if device.index is not None else 0
    # Whatever initialised the cache (zero fill) must be done before the daemon can write into it.
    synchronize_before_store(device)
    if device.type == "cuda":
        uuid = cuda_device_uuid(index)
    else:
        check_npu_alignment(storage.data_ptr())
        uuid = npu_device_uuid(index)

    def export() -> bytes:
        # Each export gets its own IPC reference counter (torch: GetNewRefCountedSentData, set to 1),
        # which the daemon that opens the handle gives back once: so one export per registration.
        if device.type == "cuda":
            share = storage._share_cuda_()
        else:
            share = storage._share_npu_()  # type: ignore[attr-defined]
        return encode_handle(handle_from_share(device.type, share, uuid))

    return MemorySpec(device.type, export(), storage.nbytes(), num_blocks, tuple(regions), device=index,
                      reexport=export)


def synchronize_before_store(device: torch.device | str) -> None:
    """Wait until the device work queued so far on the current stream (the forward that wrote the
    blocks) has finished. Run it before submitting stores: the daemon copies device -> pool from its
    own process the moment the job arrives and cannot wait on the engine's stream. CUDA could pass an
    IPC event instead; Ascend events cannot cross processes, so a host-side sync is the portable rule.
    Loads need no step here: a load completes (copy finished) before its completion is posted."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()
    elif dev.type == "npu":
        torch.npu.current_stream(dev).synchronize()  # type: ignore[attr-defined]
    else:
        raise ValueError(f"no store ordering rule for {dev.type} devices")
