"""Host memory calls of the native extension, typed: faulting a mapping in (csrc/populate.cpp) and guarding
one its owner can shrink (csrc/guard.cpp)."""

from __future__ import annotations

from kvstore_service.native import _native


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
