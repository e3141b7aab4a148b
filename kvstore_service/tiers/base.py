"""The contract both tiers under the pool implement (the disk: tiers/disk/, the remote store:
tiers/remote/), in the shape of vLLM's offload handlers: blocks go down written behind, come up as
verified batches. It is each tier's whole face: besides building one (`DiskTier.open`,
`RemoteTier.from_url`), nothing else of a tier is for its callers.

    accepted = tier.write_behind(memory, scope, keys, offsets, checksums, release)  # loop; never waits
    async for checksums in tier.fetch_verified(memory, scope, keys, place): ...     # leading run, verified
    held = tier.holds(scope, keys)                                                   # loop; a hint, or None
    tier.unwritten(scope, keys)                                                      # loop; never written
    forgotten = tier.forget(scopes)                                                  # loop; a Clear
    names = tier.names()                                                             # loop; for a Clear
    changes = tier.take_changes()                                                    # loop; for routers
    tier.stats()                                                                     # loop
    await tier.aclose(drain_s)                                                       # the end

A tier sees no index state: a namespace is a `Scope`, blocks are keys and payload offsets in the pool's
`Memory`. Every failure below is a miss (fetch) or a dropped write (write behind), counted in the
tier's stats; none reaches the caller (malformed arguments, a caller's bug, are ValueErrors). What was
written behind is in once its `release` came; `aclose` waits for what is under way. In the daemon
only `Tiers` (tiers/__init__.py) calls these, and only it meets the index; the tests drive a tier the
same way (tests/support/tier_contract.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeAlias

from kvstore_service.stats import DiskStats, RemoteStats


@dataclass(frozen=True, slots=True)
class Scope:
    """A namespace as the tiers know it."""

    ns_hash: bytes  # 16 bytes (index.namespace_hash): the disk's scope
    name: str  # "tenant/namespace" (tenants.scoped); "" for one known by hash only (the remote store keys by name)
    block_bytes: int


class Memory(Protocol):
    """The pool's memory as the tiers use it (`Pool`)."""

    @property
    def base(self) -> int: ...

    def view(self, offset: int, length: int) -> memoryview: ...


# Where a fetch lands its blocks: called on the loop with (first, count), keys[first:first + count] of a batch
# that arrived; returns the pool offsets of slots for as many leading ones as it has room for (fewer: the
# batch, and the fetch, end there).
Place: TypeAlias = Callable[[int, int], Sequence[int]]


class Forgotten(NamedTuple):
    """What a `forget` dropped: keys by scope, and the task that makes it last (await it before
    answering the Clear), if any."""

    keys: Mapping[bytes, Collection[bytes]]
    saved: asyncio.Task[None] | None


class Tier(Protocol):
    def write_behind(self, memory: Memory, scope: Scope, keys: Sequence[bytes], offsets: Sequence[int],
                     checksums: Sequence[int], release: Callable[[int], None]) -> int:
        """Take these sealed blocks (their CRC32C `checksums`) to be written behind; never waits. The tier
        reads block i's slot until it calls `release(i)`: once per block, when written, dropped (counted)
        or skipped, maybe before this returns. Returns how many it took (the others: held or queued
        already, or dropped)."""
        ...

    def fetch_verified(self, memory: Memory, scope: Scope, keys: Sequence[bytes],
                       place: Place) -> AsyncGenerator[list[int]]:
        """The leading run of `keys` the tier holds, a batch at a time: each batch's blocks copied into
        the slots `place` gives and verified, yielded as their CRC32Cs (a prefix of the places; the
        fetch ends at the first block absent, corrupt or failed)."""
        ...

    def holds(self, scope: Scope, keys: Sequence[bytes]) -> Collection[bytes] | None:
        """Which of `keys` the tier holds, where it can tell without I/O (in memory, brief; nothing counted),
        or None where only a fetch can tell. A hint: a fetch of a key held may still miss (corrupt, failed)."""
        ...

    def unwritten(self, scope: Scope, keys: Sequence[bytes]) -> None:
        """Blocks that will never be written behind (evicted from the pool before their seal: no checksum
        yet): dropped writes, counted where the tier counts such (the disk: those it does not hold already;
        the remote store counts its drops by cause, and this is none of its)."""
        ...

    def forget(self, scopes: Sequence[bytes] | None) -> Forgotten:
        """Drop these namespaces' blocks (None: every namespace's): fetches miss them from now on."""
        ...

    def names(self) -> Mapping[bytes, str]:
        """The names ("tenant/namespace") of the namespaces the tier holds blocks of, by scope (ns_hash),
        where it knows them: a Clear by tenant finds there the namespaces the pool does not know (after a
        restart). A tier that cannot list its namespaces (the remote store): none."""
        ...

    def take_changes(self) -> list[tuple[bytes, bytes, bool]]:
        """The blocks the tier wrote (True) and dropped (False) since the last call, in order, for routers'
        events: (scope, key, written); a key b"" stands for every block of the scope, a scope b"" for every
        scope. A tier shared by nodes (the remote store) is not this node's to announce: []."""
        ...

    def stats(self) -> DiskStats | RemoteStats: ...

    async def aclose(self, drain_s: float) -> None:
        """Finish or drop what is written behind (waiting up to `drain_s` where the tier can), then close."""
        ...
