"""Device (CUDA / Ascend NPU) KV memory, engine side: what an engine sends the daemon so it can map its KV cache.

`export_kv_memory(memories, num_blocks, regions)` turns a KV cache held in device allocations (vLLM:
one int8 buffer with a strided view per layer; vllm-ascend: a K and a V tensor per layer) into a
`MemorySpec` whose `handles` name those allocations through the device's IPC mechanism (the codec is
`kvstore_client.protocol.handle`), and whose `reexport` makes fresh handles for each later
registration (after a daemon restart):

* CUDA: `UntypedStorage._share_cuda_()` (a cudaIpcMemHandle of the caching allocator's segment,
  the storage's offset in it, torch's shared-memory reference counter and an IPC event), plus the
  handles of the engine's ring of ordering events (`order_event`);
* NPU: `UntypedStorage._share_npu_()` from torch_npu (the same eight fields; Ascend IPC; for an
  expandable segment, vllm-ascend's default, the list of its physical handles).

`order_before_copies(device)` is the ordering step the engine runs before it submits a step's
stores or loads: on CUDA it records the next event of the ring (the daemon polls it from the host
before it copies), on NPU it synchronizes the device (`synchronize_before_store`).

`unsupported_allocator(vllm_config)` says why an engine's KV memory cannot be exported at all (vLLM
sleep mode, the cumem allocator, vllm-ascend's CaMem allocator): the connector stays off then.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvstore_client.client import MemorySpec
from kvstore_client.protocol.handle import KINDS, encode_handle, handle_from_share, normalize_uuid
from kvstore_client.protocol.npu_identity import npu_identity

if TYPE_CHECKING:
    import torch

# The engine's ring of interprocess events per CUDA device index: one ring per process and device,
# exported with every registration of that device's KV memory; each step's copies record the next
# event, numbered (the order_seq its jobs carry). The daemon waits for that job's own record: event
# (seq - 1) % ORDER_EVENTS, not the records made after the job (the next step's forward); a job
# without a number (an older client) waits for every event pending when it arrives. A ring (not one
# event) because an event re-recorded by the next step before the daemon looks would make it wait
# for that step too, and under steady load for ever later ones. vLLM's host runs at most a step or
# two ahead of its GPU, far fewer than ORDER_EVENTS records.
ORDER_EVENTS = 8
_order_events: dict[int, list[torch.cuda.Event]] = {}
_order_count: dict[int, int] = {}  # records made per device ring: the last one's sequence number (from 1)


def unsupported_allocator(vllm_config: Any) -> str:
    """Why this engine's KV memory cannot be shared with the daemon ("" if it can): call it where the
    connector decides whether it is on, and leave it off with this reason.

    vLLM's sleep mode (`enable_sleep_mode`) and its cumem allocator (`enable_cumem_allocator`, which
    sleep mode forces on CUDA) allocate the KV cache with cuMemCreate/cuMemMap: legacy CUDA IPC cannot
    export such memory (`_share_cuda_()` raises), and `sleep()` unmaps its pages under the daemon's
    mapping, where a copy would fault the daemon for every engine. vllm-ascend's sleep mode does the
    same with its CaMem allocator (aclrtMallocPhysical/aclrtMapMem)."""
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return ""
    if getattr(model, "enable_sleep_mode", False):
        return ("vLLM sleep mode (enable_sleep_mode) allocates the KV cache with the cumem (CUDA) or CaMem "
                "(Ascend) allocator, which device IPC cannot export, and sleep() would unmap it under the "
                "daemon: turn sleep mode off to use kvstore")
    if getattr(model, "enable_cumem_allocator", False):
        return ("vLLM's cumem allocator (enable_cumem_allocator) allocates the KV cache with cuMemCreate, which "
                "CUDA IPC cannot export: turn it off to use kvstore")
    return ""


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
        # No alignment demand on the storage: torch_npu exports the base allocation (or the expandable
        # segment's handles) and sends the storage's offset in it.
        uuid = npu_device_uuid(index)
        if not uuid:
            raise ValueError(f"cannot identify NPU {index} (no uuid from torch_npu, no answer from npu-smi): the "
                             "daemon would have to guess it by index, and an import on another NPU fails every "
                             "copy; make npu-smi available to the engine")

    def export() -> tuple[bytes, ...]:
        # Each export gets its own IPC reference counter (torch: GetNewRefCountedSentData, set to 1),
        # which the daemon that opens the handle gives back once: so one export per registration.
        shares = [s._share_cuda_() if device.type == "cuda" else s._share_npu_()  # type: ignore[attr-defined]
                  for s in storages]
        return tuple(encode_handle(handle_from_share(device.type, share, uuid, order)) for share in shares)

    return MemorySpec(device.type, export(), tuple(s.nbytes() for s in storages), num_blocks, tuple(regions),
                      device=index, reexport=export)


def cuda_device_uuid(index: int) -> str:
    """The UUID of CUDA device `index`, which the daemon finds among its own GPUs."""
    import torch

    return normalize_uuid(str(torch.cuda.get_device_properties(index).uuid))


def npu_device_uuid(index: int) -> str:
    """UNVERIFIED ON HARDWARE. The identity of NPU `index`, as the daemon reads its own NPUs'
    (kvstore_client.protocol.npu_identity); "" when neither torch_npu nor npu-smi gives one."""
    import torch

    props = torch.npu.get_device_properties(index)  # type: ignore[attr-defined]
    return npu_identity(props, index, os.environ, _npu_smi)


def _npu_smi(*args: str) -> str:
    """The output of `npu-smi info <args>`; "" where npu-smi is missing or fails (the engine then
    refuses to export: export_kv_memory says why)."""
    try:
        return subprocess.run(["npu-smi", "info", *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def order_events(index: int) -> list[torch.cuda.Event]:
    """The engine's ring of interprocess events on CUDA device `index`, made on first use."""
    import torch

    ring = _order_events.get(index)
    if ring is None:
        # CUDA allows IPC only for events without timing and without blocking sync (torch's defaults).
        ring = _order_events[index] = [torch.cuda.Event(interprocess=True) for _ in range(ORDER_EVENTS)]
        _order_count[index] = 0
    return ring


def cuda_order_event_handle(index: int) -> bytes:
    """The ring's cudaIpcEventHandle_t's (64 bytes each, in ring order), which go into every device
    handle. Recording each first creates it on device `index` (an event never recorded takes the
    current device)."""
    import torch

    stream = torch.cuda.current_stream(index)
    handles = []
    for event in order_events(index):
        event.record(stream)
        handles.append(bytes(event.ipc_handle()))
    return b"".join(handles)


def order_before_copies(device: torch.device | str) -> int:
    """Run before submitting a step's stores or loads: the daemon starts copying the moment a job
    arrives, from its own process, while this step's (or, for a load into blocks just taken from a
    preempted request, the previous step's) kernels may still write the blocks. Returns the record's
    sequence number, to pass as `order_seq` to the jobs submitted right after (Session.store/load).

    CUDA: records the next event of the ring on the current stream and returns its sequence number
    (records made on this device so far, counting from 1; the daemon finds the ring event as
    (seq - 1) % ORDER_EVENTS). The daemon polls that event (cuEventQuery) before it copies the jobs
    carrying it, so nothing here waits, and a job does not wait for records made after it. Work on
    other streams must be joined into the current stream before this (vLLM's forward ends on it),
    and the ring must be recorded on one stream. NPU: no event crosses processes here, so the device
    is synchronized (`synchronize_before_store`); returns 0. CPU: nothing; returns 0."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        ring = order_events(index)
        seq = _order_count[index] + 1
        _order_count[index] = seq
        ring[(seq - 1) % len(ring)].record(torch.cuda.current_stream(index))  # as the daemon finds it
        return seq
    synchronize_before_store(dev)
    return 0


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
