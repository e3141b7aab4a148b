"""Sealed memfds: shared memory that the daemon maps and that nobody can shrink.

The engine's KV memory and its completion channel are anonymous memory files (memfd_create),
sealed against shrinking and growing, and handed to the daemon as file descriptors over the
`<socket>.cred` handshake (SCM_RIGHTS). Sealing is what makes mapping client memory safe: a file
the client could truncate would make the daemon fault (SIGBUS) on its next copy. (KV memory that
others made without seals, SGLang's shared host pool, the daemon maps guarded: csrc/guard.cpp.) And
nothing is left in /dev/shm when an engine dies: the memory goes with the last descriptor.
"""

from __future__ import annotations

import fcntl
import os

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create(name: str, size: int) -> int:
    """A new sealed memfd of `size` bytes (zeros)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sealed(fd: int, what: str) -> bool:
    """Whether a memfd is sealed against shrinking; ValueError if `fd` is not a memfd (a file, the
    daemon's pool among them, or a /dev/shm file, which others can open by name)."""
    try:
        is_memfd = os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS) if is_memfd else 0
    except OSError:
        is_memfd = False
    if not is_memfd:
        raise ValueError(f"{what} is not a memfd (shared memory made by memfd_create is required)")
    return bool(seals & fcntl.F_SEAL_SHRINK)


def check_size(fd: int, size: int, what: str) -> None:
    """Daemon side: refuse memory smaller than what will be mapped of it."""
    actual = os.fstat(fd).st_size
    if actual < size:
        raise ValueError(f"{what} has {actual} bytes, {size} are needed")


def check_sealed(fd: int, size: int, what: str) -> None:
    """Daemon side: refuse memory that could shrink under a mapping, or is too small."""
    if not sealed(fd, what):
        raise ValueError(f"{what} is not sealed against shrinking (F_SEAL_SHRINK)")
    check_size(fd, size, what)
