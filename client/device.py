"""Device (CUDA / Ascend NPU) KV memory, engine side: what an engine sends the daemon so it can map its KV cache.

`export_kv_memory(memories, num_blocks, regions)` turns a KV cache held in device allocations (vLLM:
one int8 buffer with a strided view per layer; vllm-ascend: a K and a V tensor per layer) into a
`MemorySpec` whose `handles` name those allocations through the device's IPC mechanism (the codec is
`kvstore_client.protocol.handle`), and whose `reexport` makes fresh handles for each later
registration (after a daemon restart):

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


def export_kv_memory(memories: Sequence[torch.Tensor], num_blocks: int,
                     regions: Sequence[tuple[int, ...]]) -> MemorySpec:
    """A MemorySpec for a CUDA or NPU KV cache: one IPC handle per allocation (`memories`: a tensor
    of each, all on one device), and where each block lies in them (regions as in MemorySpec, offsets
    from each allocation's start; see `kvstore_client.layouts`).

    The storages stay shared with the daemon for as long as the engine lives: keep the tensors
    alive, and close the kvstore session before freeing them (the daemon must unmap first).
    """
    if not memories:
        raise ValueError("no KV memory to register")
    device = memories[0].device
    if device.type not in KINDS:
        raise ValueError(f"{device.type} KV tensors cannot be exported as device memory; for CPU use "
                         "kvstore_client.shm.move_to_shared_memory")
    if any(t.device != device for t in memories):
        raise ValueError(f"the KV memories are on several devices: {sorted({str(t.device) for t in memories})}")
    storages = [t.untyped_storage() for t in memories]
    index = device.index if device.index is not None else 0
    # Whatever initialised the cache (zero fill) must be done before the daemon can write into it.
    synchronize_before_store(device)
    if device.type == "cuda":
        uuid = cuda_device_uuid(index)
    else:
        for storage in storages:
            check_npu_alignment(storage.data_ptr())
        uuid = npu_device_uuid(index)

    def export() -> tuple[bytes, ...]:
        # Each export gets its own IPC reference counter (torch: GetNewRefCountedSentData, set to 1),
        # which the daemon that opens the handle gives back once: so one export per registration.
        shares = [s._share_cuda_() if device.type == "cuda" else s._share_npu_()  # type: ignore[attr-defined]
                  for s in storages]
        return tuple(encode_handle(handle_from_share(device.type, share, uuid)) for share in shares)

    return MemorySpec(device.type, export(), tuple(s.nbytes() for s in storages), num_blocks, tuple(regions),
                      device=index, reexport=export)


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
