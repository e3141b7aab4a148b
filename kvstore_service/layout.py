"""Where an engine's KV blocks live in the memory it registered: the layout every copy is planned from."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore_service.errors import invalid


@dataclass(frozen=True, slots=True)
class Region:
    """Block b of this region is `block_bytes` bytes at `offset + b * block_stride` of the memory."""

    offset: int
    block_stride: int
    block_bytes: int


@dataclass(frozen=True, slots=True)
class Layout:
    num_blocks: int
    regions: tuple[Region, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in the pool: its regions' runs, back to back."""
        return sum(r.block_bytes for r in self.regions)

    @property
    def extent(self) -> int:
        """Bytes of the memory the layout addresses, from its start: all the daemon maps of it."""
        return max(r.offset + (self.num_blocks - 1) * r.block_stride + r.block_bytes for r in self.regions)

    def check(self, memory_size: int) -> None:
        """Every block of every region lies inside the registered memory, without overlaps."""
        if self.num_blocks <= 0:
            raise invalid("layout: num_blocks must be positive")
        if not self.regions:
            raise invalid("layout: at least one region is needed")
        for i, r in enumerate(self.regions):
            if r.block_bytes <= 0:
                raise invalid(f"layout: region {i} has block_bytes 0")
            if r.block_stride < r.block_bytes and self.num_blocks > 1:
                raise invalid(f"layout: region {i} blocks overlap (stride {r.block_stride} < {r.block_bytes})")
            end = r.offset + (self.num_blocks - 1) * r.block_stride + r.block_bytes
            if end > memory_size:
                raise invalid(f"layout: region {i} ends at byte {end}, beyond the {memory_size}-byte memory")
