"""A pool on huge pages: the operator mounts hugetlbfs (Kubernetes: an emptyDir of medium HugePages-2Mi,
mounted without a size) and points --pool-path there. The daemon serves from it, its pages are huge pages,
and a pool larger than the pages reserved is refused at start with a message naming vm.nr_hugepages.
Needs root (to reserve pages and mount); CI runs as root."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.daemon import DaemonProcess
from support.engine import lookup_and_load, store_blocks

NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
PAGES = 64  # 128 MiB of 2 MiB pages
NS = "model=org/huge;dtype=float16"


def free_pages() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("HugePages_Free:"):
            return int(line.split()[1])
    return 0


@pytest.fixture
def hugetlbfs(tmp_path: Path) -> Iterator[Path]:
    """A hugetlbfs mount (no size, as kubelet mounts it) with PAGES more 2 MiB pages reserved."""
    if os.geteuid() != 0 or not NR_HUGEPAGES.exists():
        pytest.skip("reserving huge pages and mounting hugetlbfs needs root")
    before = int(NR_HUGEPAGES.read_text())
    mount = tmp_path / "huge"
    mount.mkdir()
    try:
        NR_HUGEPAGES.write_text(str(before + PAGES))
        if free_pages() < PAGES:
            pytest.skip(f"the kernel granted {free_pages()} of {PAGES} huge pages")
        subprocess.run(["mount", "-t", "hugetlbfs", "-o", "pagesize=2M", "none", str(mount)], check=True)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False, capture_output=True)
        NR_HUGEPAGES.write_text(str(before))


def test_a_pool_on_hugetlbfs_serves_from_huge_pages(hugetlbfs: Path, tmp_path: Path) -> None:
    free = free_pages()
    daemon = DaemonProcess(tmp_path / "d", "96MiB", "8MiB", pool_path=str(hugetlbfs / "pool")).start()
    try:
        assert free - free_pages() >= 96 // 2  # the pool's pages are huge pages, faulted in at start
        keys = store_blocks(daemon.socket, NS, 16)
        assert lookup_and_load(daemon.socket, NS, keys, 64 * 1024) == (16, 0)
        daemon.stop()
        daemon.start()  # a restart finds the pool's blocks in its huge pages
        assert lookup_and_load(daemon.socket, NS, keys, 64 * 1024) == (16, 0)
    finally:
        daemon.cleanup()


def test_a_pool_larger_than_the_huge_pages_is_refused_naming_them(hugetlbfs: Path, tmp_path: Path) -> None:
    daemon = DaemonProcess(tmp_path / "d", f"{free_pages() * 2 + 64}MiB", "8MiB", pool_path=str(hugetlbfs / "pool"))
    with pytest.raises(RuntimeError, match="daemon exited"):
        daemon.start()
    assert "reserve more huge pages (vm.nr_hugepages)" in daemon.log_tail()
    daemon.cleanup()
