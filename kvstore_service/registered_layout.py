"""Where an engine's KV blocks live in the memory it registered: the layout every copy is planned from."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore_service.errors import invalid


@dataclass(frozen=True, slots=True)
class Region:
    """Block b of this region is `block_bytes` bytes at `offset + b * block_stride` of memory `memory`."""

    offset: int
    block_stride: int
    block_bytes: int
    memory: int = 0

    def end(self, num_blocks: int) -> int:
        return self.offset + (num_blocks - 1) * self.block_stride + self.block_bytes


@dataclass(frozen=True, slots=True)
class Layout:
    num_blocks: int
    regions: tuple[Region, ...]
    # TP: the namespace's blocks have `shards` equal parts; this engine moves part `shard`.
    shards: int = 1
    shard: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of this engine's part of a block in the pool: its regions' runs, back to back."""
        return sum(r.block_bytes for r in self.regions)

    @property
    def slot_bytes(self) -> int:
        """Bytes of a whole block in the pool: every shard's part."""
        return self.shards * self.block_bytes

    def extents(self, memories: int) -> list[int]:
        """Bytes of each memory the layout addresses, from its start: all the daemon maps of it."""
        out = [0] * memories
        for r in self.regions:
            out[r.memory] = max(out[r.memory], r.end(self.num_blocks))
        return out

    def check(self, memory_sizes: list[int]) -> None:
        """Every block of every region lies inside its own memory, without overlaps; every memory is used."""
        if self.num_blocks <= 0:
            raise invalid("layout: num_blocks must be positive")
        if not self.regions:
            raise invalid("layout: at least one region is needed")
        if not 0 <= self.shard < self.shards:
            raise invalid(f"layout: shard {self.shard} is not one of the namespace's {self.shards} shards")
        used = set()
        for i, r in enumerate(self.regions):
            if r.block_bytes <= 0:
                raise invalid(f"layout: region {i} has block_bytes 0")
            if r.block_stride < r.block_bytes and self.num_blocks > 1:
                raise invalid(f"layout: region {i} blocks overlap (stride {r.block_stride} < {r.block_bytes})")
            if r.memory >= len(memory_sizes):
                raise invalid(f"layout: region {i} names memory {r.memory}, but {len(memory_sizes)} were registered")
            end = r.end(self.num_blocks)
            if end > memory_sizes[r.memory]:
                raise invalid(f"layout: region {i} ends at byte {end}, beyond the {memory_sizes[r.memory]}-byte "
                              f"memory {r.memory}")
            used.add(r.memory)
        if len(used) < len(memory_sizes):
            unused = sorted(set(range(len(memory_sizes))) - used)
            raise invalid(f"layout: memories {unused} are registered but no region addresses them")
