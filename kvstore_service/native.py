"""Block copies, checksums and slot headers: a typed wrapper over the native engine.

The extension (``kvstore_service._native``, built from ``csrc/`` by setup.py, required) copies
with memcpy/streaming stores on several threads and checksums with hardware CRC32C, all with the
GIL released. It also owns the pool's slot-header layout (``SlotHeader`` in csrc/copy_engine.cpp):
``write_slot_headers`` and ``parse_slot_header`` are the only code that knows it.

Offsets and sizes are uint64 buffers (``array('Q')``, numpy uint64, bytes of native uint64) or
sequences of ints. Keeping every block inside its mapping is the caller's job: nothing here knows
the mappings' sizes; only 64-bit overflow of base + offset + size is rejected (OverflowError).
"""

from __future__ import annotations

import contextlib
import importlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Generic, TypeAlias, TypeVar

try:
    _native: ModuleType = importlib.import_module("kvstore_service._native")
except ImportError as exc:
    raise ImportError(
        f"kvstore's native copy engine kvstore_service._native cannot be imported ({exc}). It is built from "
        "csrc/ when kvstore is installed: reinstall it (pip install ./client .) on a machine with a C++17 "
        "compiler and the Python development headers, and check the build output for errors."
    ) from exc

CHECKSUM_ALGORITHM: Final = "crc32c"

# The pool's slot-header geometry, from the engine that defines the layout.
SLOT_HEADER_BYTES: Final[int] = _native.SLOT_HEADER_BYTES  # stride of the headers in a segment
SLOT_MAGIC: Final[int] = _native.SLOT_MAGIC
SLOT_MAX_KEY: Final[int] = _native.SLOT_MAX_KEY

# What the copy functions accept for offsets and sizes (a string: array is not subscriptable at runtime).
U64Array: TypeAlias = "array[int] | bytes | bytearray | memoryview | Sequence[int]"

# (state, payload_len, checksum, generation, ns_hash, key) of a slot header.
SlotHeaderFields = tuple[int, int, int, int, bytes, bytes]


def copy_blocks(src_base: int, dst_base: int, src_offsets: U64Array, dst_offsets: U64Array, sizes: U64Array,
                threads: int = 1, streaming: bool = True) -> int:
    """Copy ``sizes[i]`` bytes from ``src_base + src_offsets[i]`` to ``dst_base + dst_offsets[i]``.

    Blocks contiguous in both source and destination are merged into one run first; the runs are
    split across ``threads`` threads by bytes. Overlapping ranges are undefined (as with memcpy).
    ``streaming``: non-temporal stores (for a destination nothing reads soon: the pool). Returns the
    number of merged runs.
    """
    return int(_native.copy_blocks(src_base, dst_base, _as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes),
                                   threads, streaming))


# A checksum no block has (CRC32C is 32 bits): in `transfer`'s `expected`, "not known yet, not checked".
UNKNOWN_CHECKSUM: Final = (1 << 64) - 1


def check_job(keys: bytes, key_size: int, block_ids: U64Array, num_blocks: int, distinct_ids: bool) -> str:
    """What is wrong with a job's keys (packed, `key_size` bytes each) and engine block ids: an id outside
    0..num_blocks-1, duplicate keys, or (distinct_ids) duplicate ids; "" if nothing."""
    return str(_native.check_job(keys, key_size, _as_u64(block_ids), num_blocks, distinct_ids))


def plan_transfer(slot_offsets: U64Array, block_ids: U64Array, regions: U64Array, num_blocks: int, pool_size: int,
                  shard_offset: int = 0) -> tuple[array[int], array[int], array[int]]:
    """The byte runs of a chunk's blocks in one call: ``(pool_offsets, engine_addresses, sizes)``,
    region-major (region r's run of block k is run ``r * n + k``). Block k's slot payload is at pool
    offset ``slot_offsets[k]`` (this engine's part of it ``shard_offset`` bytes in), its engine block
    id ``block_ids[k]``; ``regions`` holds five values per region: the address of its block 0, its
    stride and block bytes, and the mapping ``[lo, hi)`` it lies in. Every run is checked against
    ``pool_size`` and its mapping, and every id against ``num_blocks``, before anything is returned
    (ValueError naming the block)."""
    raw = _native.plan_transfer(_as_u64(slot_offsets), _as_u64(block_ids), _as_u64(regions), num_blocks, pool_size,
                                shard_offset)
    total = len(raw) // 24
    out = []
    for part in range(3):
        values = array("Q")
        values.frombytes(raw[part * total * 8:(part + 1) * total * 8])
        out.append(values)
    return out[0], out[1], out[2]


def transfer(pool_base: int, pool_offsets: U64Array, engine_addresses: U64Array, sizes: U64Array, to_engine: bool,
             blocks: int, threads: int = 1, streaming: bool = True, progress: int = 0, progress_word: int = 0,
             check: U64Array | None = None, check_offsets: U64Array | None = None, check_size: int = 0,
             expected: U64Array | None = None) -> list[int]:
    """A chunk of a job in one native call, the GIL released throughout. Its runs (``plan_transfer``'s,
    ``blocks`` per region) go pool -> engine if ``to_engine``. First the blocks at positions ``check``
    are verified: the CRC32C of ``check_size`` bytes at ``pool_base + check_offsets[i]`` must be
    ``expected[i]`` (UNKNOWN_CHECKSUM: not checked); a block that differs is corrupt and none of its
    runs is copied. With ``progress`` (an address: a completion channel's progress word) the copy goes
    in layout order on this thread, a group of regions of at least 256 KiB a block at a time, and
    stores ``progress_word | regions landed`` there after each;
    else the runs are coalesced and copied on ``threads`` threads. Returns the corrupt positions."""
    return _u64_list(_native.transfer(pool_base, _as_u64(pool_offsets), _as_u64(engine_addresses), _as_u64(sizes),
                                      to_engine, blocks, threads, streaming, progress, progress_word,
                                      None if check is None else _as_u64(check),
                                      None if check_offsets is None else _as_u64(check_offsets), check_size,
                                      None if expected is None else _as_u64(expected)))


def _u64_list(data: bytes) -> list[int]:
    """Native-endian uint64 values, as the native engine returns them."""
    out = array("Q")
    out.frombytes(data)
    return out.tolist()


def checksum_blocks(base: int, offsets: U64Array, size: int, threads: int = 1) -> list[int]:
    """CRC32C of each ``size``-byte block at ``base + offsets[i]``."""
    return _u64_list(_native.checksum_blocks(base, _as_u64(offsets), size, threads))


def crc32c(data: bytes | bytearray | memoryview, crc: int = 0) -> int:
    """CRC32C of a bytes-like object, continuing from ``crc`` (a previous result, 0 to start)."""
    return int(_native.crc32c(data, crc))


def crc32c_copy(src: bytes | memoryview, dst: memoryview) -> int:
    """Copy ``src`` into ``dst`` (at least as long) and return its CRC32C, both in one pass."""
    return int(_native.crc32c_copy(src, dst))


def write_slot_headers(base: int, offsets: U64Array, state: int, payload_len: int, generation: int, ns_hash: bytes,
                       keys: bytes, key_size: int, checksums: U64Array | None = None) -> None:
    """Write the pool slot header of block i at ``base + offsets[i]``; ``keys`` holds the blocks'
    keys packed, ``key_size`` (1..SLOT_MAX_KEY) bytes each; ``checksums`` None means 0."""
    _native.write_slot_headers(base, _as_u64(offsets), state, payload_len, generation, ns_hash, keys, key_size,
                               None if checksums is None else _as_u64(checksums))


def add_pins(blocks: Sequence[_Record], delta: int, doomed: object) -> list[_Record]:
    """Each block's pins += delta, in order; the blocks whose pins reached 0 in state `doomed`.
    ValueError (every change undone) if a block's pins would go below 0."""
    return list(_native.add_pins(blocks, delta, doomed))


def commit(blocks: list[_Record], writing: dict[bytes, _Record], committed: dict[bytes, _Record],
           state: object) -> list[_Record]:
    """Each block still in `writing` under its key moved to `committed` and set to `state`; those, in
    order (one C call for a store's chunk)."""
    return list(_native.commit(blocks, writing, committed, state))


def block_offsets(blocks: list[_Record], headers: bool = False) -> bytes:
    """The blocks' payload offsets in the pool (their slot headers' if `headers`) as native uint64s, as
    the copy and checksum calls take them (no int object made per block)."""
    return bytes(_native.block_offsets(blocks, headers))


def invalidate_slot_headers(base: int, slots: list[int], count: int) -> None:
    """Void the header of each slot of a segment whose `count` headers start at `base` (its magic
    zeroed: a recovery finds no block there). Every slot is checked against `count` first."""
    _native.invalidate_slot_headers(base, slots, count)


def parse_slot_header(data: Any, offset: int) -> SlotHeaderFields | None:
    """The fields of the slot header at ``data[offset:]`` (any buffer, e.g. an mmap), or None if
    none is valid there (never written, torn, invalidated). ValueError past the buffer's end."""
    fields: SlotHeaderFields | None = _native.parse_slot_header(data, offset)
    return fields


# The index's block record (csrc/block.cpp): kvstore_service.index.Block subclasses it and declares its
# fields (key, namespace, segment, slot, offset, header, state, pins, checksum, shards_in,
# shards_copying, tail, promoted): offset and header plain uint64s, the others object slots.
if TYPE_CHECKING:
    class BlockRecord:  # (no __slots__ here: mypy would then refuse the fields the subclass declares)
        pass

    _Record = TypeVar("_Record", bound=BlockRecord)

    class LruList(Generic[_Record]):
        """Blocks, least recently used first; a block is on one list at most (intrusive links)."""

        def append(self, blocks: list[_Record]) -> None:
            """Each block to the end (most recent), from wherever it was (this list, another, none)."""

        def touch(self, blocks: list[_Record]) -> None:
            """Those of the blocks on this list to its end; the others stay where they are."""

        def remove(self, blocks: list[_Record]) -> None:
            """Those of the blocks on this list off it."""

        def victims(self, n: int, committed: object, evictable: Callable[[_Record], bool]) -> list[_Record]:
            """Up to n blocks from the oldest, each unpinned in state `committed` (checked natively)
            or one for which evictable(block) is true (asked of the others only; it must only read)."""
            return []

        def __len__(self) -> int:
            return 0

        def __iter__(self) -> Iterator[_Record]:
            """Over a snapshot, oldest first."""
            return iter([])
else:
    BlockRecord, LruList = _native.BlockRecord, _native.LruList
    _Record = TypeVar("_Record")


def make_blocks(cls: type[_Record], keys: list[bytes], namespace: object, segment: int, slots: list[int],
                payload_base: int, payload_stride: int, header_base: int, header_stride: int,
                state: object) -> list[_Record]:
    """A block of `cls` in `state` for each key, in the slot beside it (of one segment): payload at
    payload_base + slot * payload_stride, header at header_base + slot * header_stride; no pins, no
    checksum, no shards, neither tail nor promoted. One C call for a store's thousands of blocks."""
    return list(_native.make_blocks(cls, keys, namespace, segment, slots, payload_base, payload_stride,
                                    header_base, header_stride, state))


def coalesce_runs(src_offsets: U64Array, dst_offsets: U64Array,
                  sizes: U64Array) -> list[tuple[int, int, int]]:
    """The merged ``(src_offset, dst_offset, size)`` runs a copy of these blocks executes."""
    return list(_native.coalesce_runs(_as_u64(src_offsets), _as_u64(dst_offsets), _as_u64(sizes)))


def populate(base: int, size: int, threads: int) -> int:
    """Fault the pages of [base, base + size) in for writing on `threads` threads (csrc/populate.cpp): 0,
    or the errno of the first failure (EINVAL on kernels before 5.14)."""
    return int(_native.populate(base, size, threads))


def interleave(base: int, size: int, nodes: list[int]) -> int:
    """Spread the pages of [base, base + size) faulted in from now on over these NUMA nodes (0..63;
    csrc/populate.cpp): 0, or the errno."""
    return int(_native.interleave(base, size, sum(1 << n for n in set(nodes))))


def guard_memory(base: int, size: int) -> int:
    """Guard a mapping of memory its owner can shrink (csrc/guard.cpp): a copy that faults there (SIGBUS)
    goes on over anonymous memory instead of ending the daemon, and guard_faulted says so. Returns its id."""
    return int(_native.guard_memory(base, size))


def guard_faulted(guard: int) -> bool:
    """Whether the guarded mapping faulted (its owner shrank the memory): copies through it are void."""
    return bool(_native.guard_faulted(guard))


def unguard_memory(guard: int) -> None:
    _native.unguard_memory(guard)


# Disk tier records (csrc/disk_io.cpp defines the record header; kvstore_service/tiers/disk/format.py the files;
# both described in docs/formats.md).
DISK_RECORD_ALIGN: Final[int] = _native.DISK_RECORD_ALIGN  # header block size and payload padding (4 KiB)
DISK_MAX_KEY: Final[int] = _native.DISK_MAX_KEY
DISK_RECORD_MAGIC: Final[int] = _native.DISK_RECORD_MAGIC
DISK_RECORD_VERSION: Final[int] = _native.DISK_RECORD_VERSION
# disk_read results above 0: the record is not the one expected (corrupt, torn or overwritten).
DISK_CORRUPT_HEADER: Final[int] = _native.DISK_CORRUPT_HEADER
DISK_CORRUPT_PAYLOAD: Final[int] = _native.DISK_CORRUPT_PAYLOAD
DISK_SHORT_READ: Final[int] = _native.DISK_SHORT_READ
DISK_MODE_DIRECT: Final = 0  # payload pages straight from/into memory where aligned enough, else staged
DISK_MODE_STAGED: Final = 1  # every record through an aligned buffer (one memcpy of the payload)

# (kind, segment, offset, payload_len, payload_crc, scope, key) of a record header.
DiskHeaderFields = tuple[int, int, int, int, int, bytes, bytes]


def disk_write(fds: U64Array, file_offsets: U64Array, segments: U64Array, base: int, offsets: U64Array, length: int,
               crcs: U64Array, scope: bytes, keys: bytes, key_size: int, threads: int = 1,
               mode: int = DISK_MODE_STAGED, mem_align: int = DISK_RECORD_ALIGN) -> list[int]:
    """Write record i (a header, then the ``length`` bytes at ``base + offsets[i]`` whose CRC32C is
    ``crcs[i]``) to file ``fds[i]`` at ``file_offsets[i]`` (4 KiB aligned), for segment ``segments[i]``,
    on ``threads`` threads with the GIL released. ``keys``: packed, ``key_size`` bytes each;
    ``mem_align``: the file system's O_DIRECT memory alignment. Each record's result: 0, or -errno."""
    out = array("q")
    out.frombytes(_native.disk_write(_as_u64(fds), _as_u64(file_offsets), _as_u64(segments), base, _as_u64(offsets),
                                     length, _as_u64(crcs), scope, keys, key_size, threads, mode, mem_align))
    return out.tolist()


def disk_read(fds: U64Array, file_offsets: U64Array, segments: U64Array, base: int, offsets: U64Array, length: int,
              crcs: U64Array, scope: bytes, keys: bytes, key_size: int, threads: int = 1,
              mode: int = DISK_MODE_STAGED, mem_align: int = DISK_RECORD_ALIGN) -> list[int]:
    """Read record i into ``base + offsets[i]`` and verify it: its header must be the one disk_write
    wrote for these arguments, and its payload's CRC32C ``crcs[i]``. Each record's result: 0 verified,
    DISK_CORRUPT_HEADER / DISK_CORRUPT_PAYLOAD / DISK_SHORT_READ, or -errno. The bytes at the
    destination are undefined unless 0."""
    out = array("q")
    out.frombytes(_native.disk_read(_as_u64(fds), _as_u64(file_offsets), _as_u64(segments), base, _as_u64(offsets),
                                    length, _as_u64(crcs), scope, keys, key_size, threads, mode, mem_align))
    return out.tolist()


def disk_raw_io(fd: int, offset: int, count: int, size: int, write: bool, threads: int = 1) -> None:
    """``count`` sequential requests of ``size`` bytes (pwrite, or pread) at ``offset + i * size`` with the
    disk functions' threading and aligned buffers but no records: the file's own speed (benchmarks)."""
    _native.disk_raw_io(fd, offset, count, size, write, threads)


def disk_parse_header(data: Any, offset: int = 0) -> DiskHeaderFields | None:
    """The fields of the record header at ``data[offset:]``, or None if no valid one is there."""
    fields: DiskHeaderFields | None = _native.disk_parse_header(data, offset)
    return fields


def features() -> dict[str, Any]:
    """What the engine can do here: CRC implementation, CUDA/Ascend compiled in and available."""
    return dict(_native.features())


# Device paths (see csrc/cuda_copy.cpp and csrc/acl_copy.cpp): RuntimeError without a driver/device.

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
        sums = _native.cuda_copy_blocks(src_base, dst_base, _as_u64(src_offsets), _as_u64(dst_offsets),
                                        _as_u64(sizes), direction, device, stream, allow_batch, checksum_base,
                                        None if checksum_offsets is None else _as_u64(checksum_offsets),
                                        checksum_size)
    return _u64_list(sums)


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
        sums = _native.acl_copy_blocks(src_base, dst_base, _as_u64(src_offsets), _as_u64(dst_offsets),
                                       _as_u64(sizes), direction, device, stream, allow_batch, checksum_base,
                                       None if checksum_offsets is None else _as_u64(checksum_offsets),
                                       checksum_size)
    return _u64_list(sums)


def acl_host_register(addr: int, size: int, device: int = 0) -> int:
    """aclrtHostRegister(MAPPED); returns the device-side address of the host range."""
    with _sticky_acl_errors(device):
        return int(_native.acl_host_register(addr, size, device))


def acl_host_unregister(addr: int, device: int = 0) -> None:
    _native.acl_host_unregister(addr, device)


def _as_u64(values: U64Array) -> Any:
    """Pass buffers through to the extension (it validates them); pack int sequences as array('Q')."""
    if isinstance(values, (array, bytes, bytearray, memoryview)):
        return values
    try:
        memoryview(values)  # type: ignore[arg-type]  # numpy arrays and other buffer exporters
        return values
    except TypeError:
        return array("Q", values)
