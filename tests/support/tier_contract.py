"""The tiers' contract (kvstore_service/tiers/base.py) as the tests drive a tier, the way `Tiers` does:
blocks written behind from memory (waited for until the tier released every one of them), fetches
collected a batch at a time into the slots handed out, every block fetched checked against the CRC32C
the tier verified."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
from collections.abc import Sequence

from kvstore_service import native
from kvstore_service.index import namespace_hash
from kvstore_service.tenants import scoped
from kvstore_service.tiers.base import Memory, Scope, Tier


def scope_of(tenant: str, namespace: str, block_bytes: int) -> Scope:
    """A tenant's namespace of `block_bytes`-byte blocks, as the tiers know it."""
    name = scoped(tenant, namespace)
    return Scope(namespace_hash(name), name, block_bytes)


class Slots:
    """Memory as the tiers see the pool's (`base.Memory`): `count` slots of `size` bytes of their own, at
    a real address (the disk tier's I/O goes there by address, the remote tier's through views)."""

    def __init__(self, count: int, size: int) -> None:
        self.size = size
        self.buf = mmap.mmap(-1, max(1, count * size))
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.offsets = [i * size for i in range(count)]

    @classmethod
    def holding(cls, payloads: Sequence[bytes]) -> Slots:
        """Slots holding these payloads (all of one size), in order."""
        size = len(payloads[0]) if payloads else 1
        slots = cls(len(payloads), size)
        for offset, payload in zip(slots.offsets, payloads, strict=True):
            assert len(payload) == size, "payloads of one size: a namespace's block size"
            slots.buf[offset:offset + size] = payload
        return slots

    def view(self, offset: int, length: int) -> memoryview:
        return memoryview(self.buf)[offset:offset + length]

    def get(self, offset: int) -> bytes:
        return bytes(self.view(offset, self.size))

    def checksums(self) -> list[int]:
        """Each slot's CRC32C (what the pool's seal computes)."""
        return native.checksum_blocks(self.base, self.offsets, self.size) if self.offsets else []


class Released:
    """A `write_behind`'s `release`: the blocks the tier let go of, in the order it did; `wait` until each of
    the `count` blocks was."""

    def __init__(self, count: int) -> None:
        self.order: list[int] = []
        self._count = count
        self._all = asyncio.Event()
        if not count:
            self._all.set()

    def __call__(self, i: int) -> None:
        self.order.append(i)
        if len(self.order) >= self._count:
            self._all.set()

    async def wait(self) -> None:
        await self._all.wait()


def write_behind(tier: Tier, memory: Memory, scope: Scope, keys: Sequence[bytes], offsets: Sequence[int],
                 checksums: Sequence[int]) -> tuple[int, Released]:
    """`tier.write_behind` with a `Released` for its release: (how many blocks the tier took, the release).
    Call it on the loop; it never waits."""
    released = Released(len(keys))
    return tier.write_behind(memory, scope, keys, offsets, checksums, released), released


async def write(tier: Tier, memory: Memory, scope: Scope, keys: Sequence[bytes], offsets: Sequence[int],
                checksums: Sequence[int]) -> int:
    """`write_behind`, waited for: every block released (written, dropped or skipped). How many the tier took."""
    taken, released = write_behind(tier, memory, scope, keys, offsets, checksums)
    await released.wait()
    return taken


async def fetch(tier: Tier, memory: Memory, scope: Scope, keys: Sequence[bytes], offsets: Sequence[int]) -> list[int]:
    """`tier.fetch_verified` of `keys`, its `place` handing out `offsets` in order, as many as asked while they
    last (fewer: the pool is full). Returns the CRC32Cs of the blocks fetched (the leading run, in order),
    each checked against the bytes in its slot."""
    handed = 0

    def place(first: int, count: int) -> Sequence[int]:
        nonlocal handed
        assert first == handed, "batches come in order, each from where the last one ended"
        given = offsets[first:first + count]
        handed = first + len(given)
        return given

    crcs: list[int] = []
    async with contextlib.aclosing(tier.fetch_verified(memory, scope, keys, place)) as batches:
        async for batch in batches:
            crcs += batch
    assert len(crcs) <= handed
    for offset, crc in zip(offsets, crcs, strict=False):
        assert native.crc32c(bytes(memory.view(offset, scope.block_bytes))) == crc
    return crcs


async def write_payloads(tier: Tier, tenant: str, namespace: str, keys: Sequence[bytes],
                         payloads: Sequence[bytes]) -> int:
    """`write` of these payloads (of one size: the namespace's blocks) from slots of their own, waited for
    until the tier released every one. How many it took."""
    slots = Slots.holding(payloads)
    return await write(tier, slots, scope_of(tenant, namespace, slots.size), keys, slots.offsets, slots.checksums())


async def fetch_payloads(tier: Tier, tenant: str, namespace: str, keys: Sequence[bytes], size: int,
                         room: int | None = None) -> list[bytes]:
    """The payloads of the leading run of `keys` the tier holds, `fetch`ed into `room` slots (as many as it
    needs: None) of `size` bytes: the bytes that landed there, each checked against its verified CRC32C."""
    slots = Slots(len(keys) if room is None else room, size)
    crcs = await fetch(tier, slots, scope_of(tenant, namespace, size), keys, slots.offsets)
    return [slots.get(offset) for offset in slots.offsets[:len(crcs)]]
