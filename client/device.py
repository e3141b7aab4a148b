"""Device (CUDA / Ascend NPU) KV memory, engine side: what an engine sends the daemon so it can map its KV cache.

`export_kv_memory(memories, num_blocks, regions)` turns a KV cache held in device allocations (vLLM:
one int8 buffer with a strided view per layer; vllm-ascend: a K and a V tensor per layer) into a
`MemorySpec` whose `handles` name those allocations through the device's IPC mechanism (the codec is
`kvstore_client.protocol.handle`), and whose `reexport` makes fresh handles for each later
registration (after a daemon restart):

* CUDA: `UntypedStorage._share_cuda_()` (a cudaIpcMemHandle of the caching allocator's segment,
  the storage's offset in it, torch's shared-memory reference counter and an IPC event), plus the
  handle of the engine's ordering event (`order_event`);
* NPU: `UntypedStorage._share_npu_()` from torch_npu (the same eight fields; Ascend IPC).

`order_before_copies(device)` is the ordering step the engine runs before it submits a step's
stores or loads: on CUDA it records the ordering event (the daemon's copy stream waits on it), on
NPU it synchronizes the device (`synchronize_before_store`).
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

# The engine's interprocess event per CUDA device index: one per process and device, exported with
# every registration of that device's KV memory and recorded before each step's copies.
_order_events: dict[int, torch.cuda.Event] = {}


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
    order = b""
    if device.type == "cuda":
        uuid = cuda_device_uuid(index)
        order = cuda_order_event_handle(index)
    else:
        for storage in storages:
            check_npu_alignment(storage.data_ptr())
        uuid = npu_device_uuid(index)

    def export() -> tuple[bytes, ...]:
        # Each export gets its own IPC reference counter (torch: GetNewRefCountedSentData, set to 1),
        # which the daemon that opens the handle gives back once: so one export per registration.
        shares = [s._share_cuda_() if device.type == "cuda" else s._share_npu_()  # type: ignore[attr-defined]
                  for s in storages]
        return tuple(encode_handle(handle_from_share(device.type, share, uuid, order)) for share in shares)

    return MemorySpec(device.type, export(), tuple(s.nbytes() for s in storages), num_blocks, tuple(regions),
                      device=index, reexport=export)


def order_event(index: int) -> torch.cuda.Event:
    """The engine's interprocess event on CUDA device `index`, made on first use."""
    import torch

    event = _order_events.get(index)
    if event is None:
        # CUDA allows IPC only for events without timing and without blocking sync (torch's defaults).
        event = _order_events[index] = torch.cuda.Event(interprocess=True)
    return event


def cuda_order_event_handle(index: int) -> bytes:
    """The 64-byte cudaIpcEventHandle_t of the ordering event, which goes into every device handle.
    Recording it first creates it on device `index` (an event never recorded takes the current device)."""
    import torch

    event = order_event(index)
    event.record(torch.cuda.current_stream(index))
    return bytes(event.ipc_handle())


def order_before_copies(device: torch.device | str) -> None:
    """Run before submitting a step's stores or loads: the daemon starts copying the moment a job
    arrives, from its own process, while this step's (or, for a load into blocks just taken from a
    preempted request, the previous step's) kernels may still write the blocks.

    CUDA: records the engine's interprocess event on the current stream; the daemon's copy stream
    waits on it before the copies (cuStreamWaitEvent), so nothing here waits. Work on other streams
    must be joined into the current stream before this (vLLM's forward ends on it). NPU: no event
    crosses processes here, so the device is synchronized (`synchronize_before_store`). CPU: nothing."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        order_event(index).record(torch.cuda.current_stream(index))
    else:
        synchronize_before_store(dev)


def synchronize_before_store(device: torch.device | str) -> None:
    """Wait until all work queued on the device, on every stream, has finished: the host-side
    ordering where no IPC event is used (NPU; CUDA at registration, and tools such as the bench).
    A full-device sync, because KV writes may come from more than the current stream."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "npu":
        torch.npu.synchronize(dev)  # type: ignore[attr-defined]
    else:
        raise ValueError(f"no store ordering rule for {dev.type} devices")
