"""The device-handle codec and device identity: how an engine names its device KV memory to the daemon.

The handle is JSON (UTF-8, at most `MAX_HANDLE_BYTES` bytes), never pickle: the daemon parses
client bytes and must not execute them. Format version 1:

    {"format": "kvstore-device-handle", "version": 1, "kind": "cuda" | "npu",
     "device": <int, the engine's device index>,
     "device_uuid": <str, e.g. the GPU UUID "0b7e...-..."; "" allowed for npu only>,
     "ipc_handle": <base64 of _share_*_()[1]>, "storage_bytes": <int [2]>, "storage_offset": <int [3]>,
     "ref_counter": <str [4], torch's "/torch_<pid>_<rand>_<n>" shared-memory name>,
     "ref_counter_offset": <int [5]>, "event_handle": <base64 of [6]>, "event_sync": <bool [7]>}

Version 2 is version 1 plus "order_event": base64 of the engine's interprocess events (CUDA: the
64-byte cudaIpcEventHandle_t of each `torch.cuda.Event(interprocess=True)`, 1..MAX_ORDER_EVENTS of
them back to back), a ring the engine records round robin before it submits a step's copies and
the daemon polls from the host before it copies. Only CUDA handles carry them, so a handle without
an event is written as version 1, which older daemons read. Both versions
are read; a version-1 CUDA handle (an older client) has no event: the daemon copies unordered, and
such a client synchronizes its stream before stores itself.

Every field of the version is required and no other is allowed; integers are JSON integers (not
booleans) within their ranges; base64 is strict. `decode_handle` checks "format" and "version"
before anything else, so a handle from a newer client fails with a message about the version, not
about its fields. Anything malformed, truncated or oversized is a ValueError with a message naming
the problem.

Devices are matched by UUID, not index: engine and daemon may see different CUDA_VISIBLE_DEVICES.
Each side finds its devices' UUIDs itself (kvstore_client.device, kvstore_service.backends); an NPU's,
which no runtime gives, is read from npu-smi by `npu_identity` (one reading for both sides).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

HANDLE_FORMAT = "kvstore-device-handle"
HANDLE_VERSION = 2  # the newest this side reads and writes; 1 is still read (and written without an event)
KINDS = ("cuda", "npu")
NPU_IPC_ALIGNMENT = 2 << 20  # the granularity of Ascend device allocations (the NPU bounds check rounds to it)

# cudaIpcMemHandle is 64 bytes (+ torch's 2-byte prefix), an ACL export key 65. torch_npu's share of an
# expandable segment (vllm-ascend's default allocator) is a header plus 8 bytes per 20 MiB physical
# handle (NPUCachingAllocator.cpp, kLargeBuffer): 64 KiB covers a 160 GiB tensor.
MAX_IPC_HANDLE_BYTES = 64 << 10
MAX_HANDLE_BYTES = 96 << 10  # the JSON: the IPC handle in base64 (4/3) plus the other fields
MAX_EVENT_HANDLE_BYTES = 256
IPC_EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t (CU_IPC_HANDLE_SIZE)
MAX_ORDER_EVENTS = 16  # the engine's ring of ordering events (kvstore_client.device.ORDER_EVENTS)
MAX_DEVICE = 127  # c10::DeviceIndex is int8
REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE (torch_npu uses the same)
# torch's at::NewProcessWideShmHandle(): "/torch_<pid>_<random>_<counter>" (older: no counter).
# Anything else is refused: torch would shm_open the name and decrement an int64 in it.
REF_COUNTER_RE = re.compile(r"/torch_[0-9]{1,10}_[0-9]{1,20}(_[0-9]{1,20})?")
UUID_RE = re.compile(r"[0-9A-Za-z._:-]{0,128}")
_INT_LIMIT = 1 << 63

_FIELDS_V1 = frozenset({"format", "version", "kind", "device", "device_uuid", "ipc_handle", "storage_bytes",
                        "storage_offset", "ref_counter", "ref_counter_offset", "event_handle", "event_sync"})
_FIELDS = {1: _FIELDS_V1, 2: _FIELDS_V1 | {"order_event"}}


@dataclass(frozen=True)
class DeviceHandle:
    """The engine's KV allocation as exported by `_share_cuda_()` / `_share_npu_()`, plus its device UUID."""

    kind: str  # "cuda" | "npu"
    device: int  # the engine's device index (its own numbering)
    device_uuid: str  # identity that survives differing *_VISIBLE_DEVICES
    ipc_handle: bytes  # _share_*_()[1]: names the allocator segment
    storage_bytes: int  # [2]: bytes of the storage
    storage_offset: int  # [3]: offset of the storage inside the exported segment
    ref_counter: str  # [4]: torch's shared-memory reference counter file
    ref_counter_offset: int  # [5]: this export's slot in it
    event_handle: bytes  # [6]: IPC event recorded at export (CUDA; ignored by torch_npu)
    event_sync: bool  # [7]: whether the importer must wait on that event
    order_event: bytes = b""  # the engine's interprocess event for copy ordering (CUDA; b"": none)

    def share_args(self, local_device: int) -> tuple[int, bytes, int, int, bytes, int, bytes, bool]:
        """Arguments of `UntypedStorage._new_shared_cuda` / `_new_shared_npu` in the importing process."""
        return (local_device, self.ipc_handle, self.storage_bytes, self.storage_offset, self.ref_counter.encode(),
                self.ref_counter_offset, self.event_handle, self.event_sync)


# -- codec ----------------------------------------------------------------------------------------


def handle_from_share(kind: str, share: Sequence[Any], device_uuid: str, order_event: bytes = b"") -> DeviceHandle:
    """A DeviceHandle from the 8-tuple `storage._share_cuda_()` / `_share_npu_()` returns, and the
    engine's ring of ordering events (each `event.ipc_handle()`, back to back; CUDA only)."""
    if len(share) != 8:
        raise ValueError(f"_share_{kind}_() returned {len(share)} fields, expected 8")
    device, ipc_handle, size, offset, ref_counter, ref_offset, event_handle, event_sync = share
    if not isinstance(ipc_handle, bytes) or not ipc_handle:
        raise ValueError(f"the {kind} storage has no IPC handle (empty storage?)")
    if isinstance(ref_counter, bytes):
        ref_counter = ref_counter.decode("ascii", errors="replace")
    handle = DeviceHandle(kind, int(device), normalize_uuid(device_uuid), ipc_handle, int(size), int(offset),
                          str(ref_counter), int(ref_offset), bytes(event_handle or b""), bool(event_sync),
                          bytes(order_event))
    validate_handle(handle)
    return handle


def encode_handle(handle: DeviceHandle) -> bytes:
    validate_handle(handle)
    doc: dict[str, Any] = {
        "format": HANDLE_FORMAT, "version": 1, "kind": handle.kind, "device": handle.device,
        "device_uuid": handle.device_uuid, "ipc_handle": base64.b64encode(handle.ipc_handle).decode(),
        "storage_bytes": handle.storage_bytes, "storage_offset": handle.storage_offset,
        "ref_counter": handle.ref_counter, "ref_counter_offset": handle.ref_counter_offset,
        "event_handle": base64.b64encode(handle.event_handle).decode(), "event_sync": handle.event_sync,
    }
    if handle.order_event:  # version 2; without an event the handle stays version 1 (older daemons read it)
        doc.update(version=2, order_event=base64.b64encode(handle.order_event).decode())
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    if len(data) > MAX_HANDLE_BYTES:
        raise ValueError(f"device handle: {len(data)} bytes encoded, more than {MAX_HANDLE_BYTES}")
    return data


def decode_handle(data: bytes, kind: str | None = None) -> DeviceHandle:
    """Parse and validate a handle; `kind` (cuda/npu) is the kind the caller can map. ValueError on any problem."""
    if len(data) > MAX_HANDLE_BYTES:
        raise ValueError(f"device handle: {len(data)} bytes, more than the {MAX_HANDLE_BYTES} allowed")
    if not data:
        raise ValueError("device handle: empty")
    try:
        doc = json.loads(data.decode("utf-8"), object_pairs_hook=_unique_keys, parse_constant=_no_constants)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"device handle: not a kvstore device handle (not JSON: {e}); "
                         "truncated, or sent by an incompatible client") from None
    except RecursionError:
        raise ValueError("device handle: nested too deeply") from None
    if not isinstance(doc, dict) or doc.get("format") != HANDLE_FORMAT:
        raise ValueError(f"device handle: not a kvstore device handle (no \"format\": {HANDLE_FORMAT!r})")
    version = doc.get("version")
    if type(version) is not int or version not in _FIELDS:
        raise ValueError(f"device handle: version {version!r} is not supported (this side reads versions "
                         f"1..{HANDLE_VERSION}); upgrade the client or the daemon so both match")
    fields = _FIELDS[version]
    missing = sorted(fields - doc.keys())
    if missing:
        raise ValueError(f"device handle: missing field(s) {', '.join(missing)}")
    unknown = sorted(doc.keys() - fields)
    if unknown:
        raise ValueError(f"device handle: unknown field(s) {', '.join(unknown)}")
    handle = DeviceHandle(
        kind=_str(doc, "kind"), device=_int(doc, "device"), device_uuid=_str(doc, "device_uuid"),
        ipc_handle=_b64(doc, "ipc_handle"), storage_bytes=_int(doc, "storage_bytes"),
        storage_offset=_int(doc, "storage_offset"), ref_counter=_str(doc, "ref_counter"),
        ref_counter_offset=_int(doc, "ref_counter_offset"), event_handle=_b64(doc, "event_handle"),
        event_sync=_bool(doc, "event_sync"), order_event=_b64(doc, "order_event") if version >= 2 else b"")
    if version >= 2 and not handle.order_event:
        raise ValueError("device handle: a version 2 handle carries an order_event; it is empty")
    validate_handle(handle)
    if kind is not None and handle.kind != kind:
        raise ValueError(f"device handle: a {handle.kind} handle was sent for the {kind} backend")
    return handle


def validate_handle(h: DeviceHandle) -> None:
    """Range and shape checks shared by encoding and decoding."""
    if h.kind not in KINDS:
        raise ValueError(f"device handle: kind {h.kind!r} is not one of {', '.join(KINDS)}")
    if not 0 <= h.device <= MAX_DEVICE:
        raise ValueError(f"device handle: device {h.device} is outside 0..{MAX_DEVICE}")
    if not UUID_RE.fullmatch(h.device_uuid):
        raise ValueError("device handle: device_uuid must be at most 128 characters of [0-9A-Za-z._:-]")
    if h.kind == "cuda" and not h.device_uuid:
        raise ValueError("device handle: a cuda handle needs the GPU's device_uuid")
    if not 0 < len(h.ipc_handle) <= MAX_IPC_HANDLE_BYTES:
        raise ValueError(f"device handle: ipc_handle has {len(h.ipc_handle)} bytes, expected 1..{MAX_IPC_HANDLE_BYTES}")
    if h.order_event and (h.kind != "cuda" or len(h.order_event) % IPC_EVENT_HANDLE_BYTES
                          or len(h.order_event) > MAX_ORDER_EVENTS * IPC_EVENT_HANDLE_BYTES):
        raise ValueError(f"device handle: order_event has {len(h.order_event)} bytes; only a cuda handle carries "
                         f"them, 1..{MAX_ORDER_EVENTS} events of {IPC_EVENT_HANDLE_BYTES} bytes "
                         "(cudaIpcEventHandle_t)")
    if len(h.event_handle) > MAX_EVENT_HANDLE_BYTES:
        raise ValueError(f"device handle: event_handle has {len(h.event_handle)} bytes, "
                         f"more than {MAX_EVENT_HANDLE_BYTES}")
    if not 0 < h.storage_bytes < _INT_LIMIT or not 0 <= h.storage_offset < _INT_LIMIT \
            or h.storage_bytes + h.storage_offset >= _INT_LIMIT:
        raise ValueError(f"device handle: storage_bytes {h.storage_bytes} / storage_offset {h.storage_offset} "
                         "out of range")
    if not REF_COUNTER_RE.fullmatch(h.ref_counter):
        raise ValueError(f"device handle: ref_counter {h.ref_counter[:80]!r} is not a torch IPC reference counter "
                         "name (/torch_<pid>_<n>_<n>)")
    if not 0 <= h.ref_counter_offset < REF_COUNTER_SLOTS:
        raise ValueError(f"device handle: ref_counter_offset {h.ref_counter_offset} is outside "
                         f"0..{REF_COUNTER_SLOTS - 1}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise ValueError(f"device handle: field {key!r} appears twice")
        doc[key] = value
    return doc


def _no_constants(name: str) -> Any:
    raise ValueError(f"device handle: {name} is not allowed")


def _int(doc: dict[str, Any], name: str) -> int:
    value = doc[name]
    if type(value) is not int:  # bool is an int subclass: refused too
        raise ValueError(f"device handle: {name} must be an integer, got {type(value).__name__}")
    if not 0 <= value < _INT_LIMIT:
        raise ValueError(f"device handle: {name} {value} is out of range")
    return value


def _str(doc: dict[str, Any], name: str) -> str:
    value = doc[name]
    if not isinstance(value, str):
        raise ValueError(f"device handle: {name} must be a string, got {type(value).__name__}")
    return value


def _bool(doc: dict[str, Any], name: str) -> bool:
    value = doc[name]
    if type(value) is not bool:
        raise ValueError(f"device handle: {name} must be true or false, got {type(value).__name__}")
    return value


def _b64(doc: dict[str, Any], name: str) -> bytes:
    value = _str(doc, name)
    if len(value) > 2 * MAX_IPC_HANDLE_BYTES:
        raise ValueError(f"device handle: {name} is too long")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"device handle: {name} is not valid base64") from None


# -- devices by UUID ------------------------------------------------------------------------------


def normalize_uuid(uuid: str) -> str:
    """`GPU-0B7E...` (nvidia-smi) and `0b7e...` (torch) name the same GPU."""
    uuid = uuid.strip().lower()
    return uuid.removeprefix("gpu-")


def device_index_for_uuid(uuid: str, local_uuids: Sequence[str]) -> int:
    """The daemon's index of the device the engine calls `uuid`; `local_uuids[i]` is the UUID of local device i."""
    want = normalize_uuid(uuid)
    if not want:
        raise ValueError("the engine sent no device UUID")
    matches = [i for i, u in enumerate(local_uuids) if normalize_uuid(u) == want]
    if not matches:
        raise ValueError(f"the engine's device {uuid} is not visible to the daemon (it sees {len(local_uuids)} "
                         f"device(s): {', '.join(local_uuids) or 'none'}); give the daemon every device of the "
                         "node (e.g. CUDA_VISIBLE_DEVICES unset, NVIDIA_VISIBLE_DEVICES=all)")
    if len(matches) > 1:
        raise ValueError(f"device UUID {uuid} matches several local devices {matches}")
    return matches[0]


def resolve_handle(data: bytes, size: int, kind: str, local_uuids: Sequence[str],
                   device: int | None = None) -> tuple[int, DeviceHandle]:
    """Daemon side, before touching the device: parse the handle, check that `size` bytes (the
    registration's memory size) fit in the exported storage, and find the local device index."""
    h = decode_handle(data, kind)
    if device is not None and device != h.device:
        raise ValueError(f"memory.device {device} does not match device {h.device} in the {kind} handle")
    if size <= 0:
        raise ValueError("memory.size must be positive")
    if size > h.storage_bytes:
        raise ValueError(f"the layout needs {size} bytes but the exported {kind} storage has {h.storage_bytes}")
    if not h.device_uuid:
        # Falling back to the index would import on whichever device has it here; on Ascend an import on
        # another device succeeds and then fails every host <-> device copy (CANN: not supported).
        raise ValueError(f"the engine could not identify its {kind} device {h.device} (no UUID, no npu-smi in its "
                         "container?): refusing to guess it by index; give the engine npu-smi (or a torch_npu "
                         "with the uuid property)")
    return device_index_for_uuid(h.device_uuid, local_uuids), h


def check_inside_allocation(ptr: int, size: int, alloc_base: int, alloc_size: int) -> None:
    """The mapped range must lie inside the device allocation the IPC handle opened (the client's
    storage_bytes/offset are claims; the driver's address range is not)."""
    if ptr < alloc_base or ptr + size > alloc_base + alloc_size:
        raise ValueError(f"the engine's KV memory [0x{ptr:x}, +{size}) is not inside the shared allocation "
                         f"[0x{alloc_base:x}, +{alloc_size}): storage_bytes/storage_offset are wrong")
