"""The backend interface: map engine memory, register the pool, copy blocks."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the interface itself needs no native engine)
    from kvstore_service.native import Runs

PAGE = 4096  # pieces of the pool are pinned page-aligned (aclrtHostRegister requires it; CUDA is happy)


@dataclass
class Mapping:
    """Engine KV memory mapped into the daemon: `size` bytes at address `base`."""

    base: int
    size: int
    device: int = 0
    handle: object = None  # whatever the backend must keep alive and release in unmap()


@dataclass(frozen=True, slots=True)
class ProgressWord:
    """Where a whole load's copy posts its progress: `word | k` stored at `address` (a completion
    channel's progress word) once k regions landed, by the copy itself (native.transfer)."""

    address: int
    word: int


@dataclass
class TransferPlan:
    """A chunk's byte runs (`runs`, held natively: native.plan_transfer's, every run bounds-checked against
    the pool and its mapping), between the pool and the session's mappings (a block's regions may lie in
    several)."""

    runs: Runs
    # Set for a whole load (at most Backend.whole_load_bytes): its runs are `regions` equal parts in
    # layout order, and the copy posts at `progress` once each part landed (the engine reads a layer as
    # soon as its part is in).
    regions: int = 1
    progress: ProgressWord | None = None

    @property
    def total_bytes(self) -> int:
        return self.runs.total_bytes


@dataclass(frozen=True, slots=True)
class ChecksumSample:
    """A load's blocks to verify: block `positions[i]` of the plan (runs are
    region-major, `blocks` per region) is `size` bytes at pool offset `offsets[i]` whose CRC32C must
    be `expected[i]` (native.UNKNOWN_CHECKSUM: not known yet, not checked)."""

    positions: array
    offsets: array
    size: int
    expected: array

    def corrupt(self, sums: Sequence[int]) -> list[int]:
        """The positions whose checksum in `sums` (one per sampled block) is not the one expected."""
        from kvstore_service.native import UNKNOWN_CHECKSUM  # (the interface itself needs no native engine)

        return [k for k, want, got in zip(self.positions, self.expected, sums, strict=True)
                if want not in (UNKNOWN_CHECKSUM, got)]


def without(plan: TransferPlan, skip: Sequence[int]) -> TransferPlan:
    """The plan minus the runs of the blocks at these positions."""
    return replace(plan, runs=plan.runs.without(array("Q", skip)))


def pool_pieces(base: int, data_offset: int, segment_size: int, segments: int) -> list[tuple[int, int]]:
    """(address, size) of the pieces the pool is pinned in: its segments, starting `data_offset` bytes
    after `base`. A piece is whole segments, so no copy crosses two (a block never crosses a segment,
    and slot headers open each segment, so coalesced runs do not either); as few per piece as keep
    every piece start on a 4 KiB page (one for the usual power-of-two segment sizes). The pool's
    header, before the first segment, is never copied to or from a device and is left out."""
    per_piece = PAGE // math.gcd(segment_size, PAGE)
    start = base + data_offset
    return [(start + first * segment_size, min(per_piece, segments - first) * segment_size)
            for first in range(0, segments, per_piece)]


class Backend(ABC):
    name: str
    # A load of at most this many bytes (and CHUNK_BLOCKS blocks) is copied whole by one copy thread (a
    # plan with `progress` set), not in chunks spread over the copy threads, and its copy reports its
    # progress region by region (TransferPlan.progress).
    whole_load_bytes = 0
    # The backend's copy call checksums host blocks while its DMA runs (load_checksummed).
    checksums_while_copying = False
    # Its copies are made by the host's cores (memcpy), not a device's DMA engines: they run on the
    # shared copy threads, and seals yield to them (seals.py).
    copies_on_host = False

    def register_pool(self, pieces: Sequence[tuple[int, int]],  # noqa: B027 - optional hook
                      device: int | None = None) -> None:
        """Make the pool usable for device DMA: pin its pieces ((address, size), see pool_pieces), on
        `device`'s context now, or with None on the device of the first mapping. No-op on CPU."""

    def unregister_pool(self) -> None:  # noqa: B027 - optional hook
        """Undo register_pool, piece by piece."""

    @abstractmethod
    def map(self, handle: bytes, size: int, device: int, fd: int | None) -> Mapping:
        """Map the engine memory named by `handle` (or passed as the descriptor `fd`, which the caller
        closes); ValueError with a clear message if impossible."""

    @abstractmethod
    def unmap(self, mapping: Mapping) -> None:
        """Release the mapping. Called only when no copy uses it any more."""

    def order_pending(self, mapping: Mapping, seq: int = 0) -> list[int]:
        """When a job of the session whose first mapping is `mapping` arrives (event loop; never
        blocks): the engine's ordering records the job must follow that are not done yet. `seq`: the
        job's own record (the engine's 1-based count of records on the device, made just before the
        job; TransferRequest.order_seq); 0 (none given): every record not done yet. The job's copies
        start once order_waiting returns [] for them. []: nothing to wait for (CPU)."""
        return []

    def order_waiting(self, mapping: Mapping, pending: list[int]) -> list[int]:
        """Of `pending` (from order_pending), those still not done (event loop; never blocks)."""
        return []

    @abstractmethod
    def copy(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        """Copy the plan's runs (pool -> engine if to_engine) between the pool and the session's
        engine memory, and return when every byte landed. `mapping` is the session's first mapping:
        its device is the device of all of them. The job's order_pending records are done by now.
        Runs in one of the daemon's copy threads of the mapping's device; raises on any failure."""

    def transfer(self, mapping: Mapping, pool_base: int, plan: TransferPlan, to_engine: bool,
                 check: ChecksumSample | None = None) -> list[int]:
        """One chunk of a job: copy it and verify the `check` sample in the pool. Returns the positions
        of the corrupt ones, which the job reports failed. This default checksums first, then calls
        copy() for the blocks that passed; a load not copied whole goes to load_checksummed where the
        backend has it. (The engine reads none of such a load's blocks before the job's completion, so a
        corrupt block may land there, failed.) The cpu backend does both in one native call, and
        checksums the sample of a load not copied whole as it copies it, reading its bytes once."""
        if check is not None and to_engine and plan.progress is None and self.checksums_while_copying:
            return check.corrupt(self.load_checksummed(mapping, pool_base, plan, check))
        corrupt: list[int] = []
        if check is not None:
            from kvstore_service import native  # (the interface itself needs no native engine)

            corrupt = check.corrupt(native.checksum_blocks(pool_base, check.offsets, check.size))
        if corrupt:
            plan = without(plan, corrupt)
        self.copy(mapping, pool_base, plan, to_engine)
        return corrupt

    def load_checksummed(self, mapping: Mapping, pool_base: int, plan: TransferPlan,
                         check: ChecksumSample) -> list[int]:
        """Where checksums_while_copying: copy the plan's runs pool -> engine, and return the CRC32C of
        the `check` sample's blocks in the pool, taken on this thread while the DMA runs."""
        raise NotImplementedError
