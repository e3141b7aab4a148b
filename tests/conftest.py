"""Shared fixtures: a real daemon process on a unix socket in a temp dir."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore_client import KVStoreClient, Unavailable

REPO = Path(__file__).resolve().parent.parent


class Daemon:
    """A `kvstore serve` process; restartable on the same pool file."""

    def __init__(self, tmp: Path, pool_size: str = "64MiB", segment_size: str = "4MiB", *extra: str) -> None:
        self.socket = str(tmp / "kvstore.sock")
        self.pool_path = f"/dev/shm/kvstore-test-{secrets.token_hex(4)}"
        self.log = tmp / "daemon.log"
        self.args = ["--socket", self.socket, "--pool-path", self.pool_path, "--pool-size", pool_size,
                     "--segment-size", segment_size, "--attach-timeout-s", "3", *extra]
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> Daemon:
        log = open(self.log, "a")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen([sys.executable, "-m", "kvstore_service", "serve", *self.args, *extra],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=self.log.parent)
        client = KVStoreClient(self.socket, timeout=1.0)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if client.health() == "SERVING":
                    break
            except Unavailable:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not become healthy:\n{self.log.read_text()}")
            time.sleep(0.05)
        client.close()
        return self

    def client(self, timeout: float = 10.0) -> KVStoreClient:
        return KVStoreClient(self.socket, timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def cleanup(self) -> None:
        self.stop()
        if os.path.exists(self.pool_path):
            os.unlink(self.pool_path)


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator:
    daemons: list[Daemon] = []

    def make(*extra: str, pool_size: str = "64MiB", segment_size: str = "4MiB") -> Daemon:
        d = Daemon(tmp_path / f"d{len(daemons)}", pool_size, segment_size, *extra)
        (tmp_path / f"d{len(daemons)}").mkdir()
        daemons.append(d)
        return d

    yield make
    for d in daemons:
        d.cleanup()


@pytest.fixture
def daemon(daemon_factory) -> Daemon:
    return daemon_factory().start()
