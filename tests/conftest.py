"""Shared fixtures: a real daemon process on a unix socket in a temp dir."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore_client.process import DaemonProcess as Daemon

__all__ = ["Daemon"]


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator:
    daemons: list[Daemon] = []

    def make(*extra: str, pool_size: str = "64MiB", segment_size: str = "4MiB") -> Daemon:
        d = Daemon(tmp_path / f"d{len(daemons)}", pool_size, segment_size, *extra)
        daemons.append(d)
        return d

    yield make
    for d in daemons:
        d.cleanup()


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    return daemon_factory().start()
