"""The backend interface: map engine memory, register the pool, copy blocks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from dataclasses import dataclass


@dataclass
class Mapping:
    """Engine KV memory mapped into the daemon: `size` bytes at address `base`."""

    base: int
    size: int
    device: int = 0
    handle: object = None  # whatever the backend must keep alive and release in unmap()


@dataclass
class TransferPlan:
    """Byte runs to copy: run i is `sizes[i]` bytes at pool offset `pool_offsets[i]` and at
    `engine_addresses[i]`, an address in one of the session's mappings (a block's regions may lie in
    several). Every run was bounds-checked against the pool and its mapping."""

    pool_offsets: array
    engine_addresses: array
    sizes: array

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)


class Backend(ABC):
    name: str

    def register_pool(self, base: int, size: int) -> None:  # noqa: B027 - optional hook
        """Make the pool usable for device DMA (pinning); no-op on CPU."""

    def unregister_pool(self, base: int) -> None:  # noqa: B027 - optional hook
        """Undo register_pool."""

    @abstractmethod
    def map(self, handle: bytes, size: int, device: int, fd: int | None) -> Mapping:
        """Map the engine memory named by `handle` (or passed as the descriptor `fd`, which the caller
        closes); ValueError with a clear message if impossible."""

    @abstractmethod
    def unmap(self, mapping: Mapping) -> None:
        """Release the mapping. Called only when no copy uses it any more."""

    @abstractmethod
    def copy(self, device: int, pool_base: int, plan: TransferPlan, to_engine: bool) -> None:
        """Copy the plan's runs (pool -> engine if to_engine) between the pool and the engine memory
        mapped on `device` (the mappings' device), and return when every byte landed.
        Runs in one of the daemon's copy threads, beside the others; raises on any failure."""
