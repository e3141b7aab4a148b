"""Shared fixtures: a real daemon process on a unix socket in a temp dir.

Shared helpers live in the `support` package (tests/support/); tests import them as `support.<module>`.
pytest puts tests/ on sys.path when it loads this file (tests/ has no __init__.py: "prepend" import
mode), so no test touches sys.path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.daemon import DaemonProcess as Daemon
from support.ports import free_ports
from support.redis import RedisCluster, RedisServer, require_redis_server

if os.environ.get("KVSTORE_TEST_INSTALLED"):  # .ci/run: test the installed wheel, never the source tree
    import kvstore_client
    import kvstore_service

    for _pkg, _src in ((kvstore_service, "kvstore_service"), (kvstore_client, "client")):
        if Path(str(_pkg.__file__)).resolve().is_relative_to(Path(__file__).resolve().parents[1] / _src):
            raise pytest.UsageError(f"KVSTORE_TEST_INSTALLED: {_pkg.__name__} was imported from the source tree "
                                    f"({_pkg.__file__}), not the installed wheel")
    if not os.environ.get("PYTHONSAFEPATH"):  # else `python -m ...` children started in the repo import the tree
        raise pytest.UsageError("KVSTORE_TEST_INSTALLED needs PYTHONSAFEPATH=1")


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


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of its own on a loopback port (tests/support/redis.py)."""
    require_redis_server()
    s = RedisServer(tmp_path / "redis", free_ports(1)[0]).start()
    yield s
    s.kill()


@pytest.fixture
def fresh_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A 3-master Redis cluster of its own, for tests that kill or hang its nodes."""
    require_redis_server()
    c = RedisCluster(tmp_path / "cluster").start()
    yield c
    c.stop()
