"""The disk tier's directory: trusted only if it is the daemon's own (not a symbolic link, not writable by
others), held by one daemon at a time (an flock on ``lock``), and probed for O_DIRECT."""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
from typing import Final

from kvstore_service.tiers.disk.format import ALIGN

log = logging.getLogger(__name__)

LOCK_FILE: Final = "lock"
PROBE_FILE: Final = "probe.tmp"


class DiskDirectoryError(ValueError):
    """The disk tier's directory cannot be trusted or is in use: the daemon refuses to start."""



def _directory_problem(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.geteuid():
        return f"belongs to uid {st.st_uid}, not to the daemon's uid {os.geteuid()}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def open_directory(path: str) -> int:
    """The directory (created 0700 if absent) as an fd, if it is safe to keep blocks in: a planted
    symbolic link or a directory others can write could feed us forged files or redirect our writes."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(path)
    problem = _directory_problem(st)
    if problem:
        raise DiskDirectoryError(f"disk tier directory {path} {problem}: fix it (it must be a directory of the "
                                 "daemon's own, writable by it alone) or choose another --disk-path")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise DiskDirectoryError(f"disk tier directory {path} was replaced while it was opened")
    return fd



def take_lock(dir_fd: int, path: str) -> int:
    """The lock file's fd, flocked: DiskDirectoryError if another daemon holds it."""
    fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskDirectoryError(f"disk tier directory {path} is in use by another kvstore daemon: "
                                 "give each daemon its own --disk-path") from None
    return fd


def probe_direct_io(dir_fd: int, path: str) -> tuple[int, int]:
    """(os.O_DIRECT or 0, the memory alignment it needs): whether the file system takes O_DIRECT, and the
    smallest alignment of 256..4096 that works; without O_DIRECT the tier runs with buffered I/O (logged)."""
    try:
        fd = os.open(PROBE_FILE, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECT,
                     0o600, dir_fd=dir_fd)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        log.warning("disk tier %s: the file system does not support O_DIRECT; using buffered I/O (the page "
                    "cache will hold copies of the blocks)", path)
        return 0, 1
    buf = mmap.mmap(-1, 2 * ALIGN)
    try:
        for align in (256, 512, 1024, 2048, ALIGN):
            with memoryview(buf) as view:
                try:
                    os.pwrite(fd, view[align:align + ALIGN], 0)
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    continue
            return os.O_DIRECT, align
        log.warning("disk tier %s: O_DIRECT writes fail here; using buffered I/O", path)
        return 0, 1
    finally:
        buf.close()
        os.close(fd)
        os.unlink(PROBE_FILE, dir_fd=dir_fd)
