"""SGLang runs in a venv of its own (torch 2.14.1; .ci/sglang-venv makes it): tests here run its python
on tests/sglang/hicache_driver.py against a daemon of this venv. KVSTORE_TEST_SGLANG_PYTHON names it;
.ci/run sets it, so CI never skips these."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

DRIVER = Path(__file__).with_name("hicache_driver.py")


class Driver:
    def __init__(self, python: str, home: Path) -> None:
        self.python = python
        self.home = home
        self.last_stderr = ""  # what the last run() said on stderr (SGLang's log and ours)

    def start(self, mode: str, socket: str, *args: str, stderr: int | None = None) -> subprocess.Popen:
        env = dict(os.environ, HOME=str(self.home), TORCH_EXTENSIONS_DIR=str(self.home / "torch_extensions"))
        return subprocess.Popen([self.python, str(DRIVER), mode, "--socket", socket, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)

    def run(self, mode: str, socket: str, *args: str) -> dict:
        proc = self.start(mode, socket, *args, stderr=subprocess.PIPE)
        out, self.last_stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"the driver exited with {proc.returncode}:\n{self.last_stderr[-3000:]}"
        return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def sglang(tmp_path_factory) -> Driver:
    python = os.environ.get("KVSTORE_TEST_SGLANG_PYTHON")
    if not python:
        pytest.skip("SGLang's own venv is needed: .ci/sglang-venv, then KVSTORE_TEST_SGLANG_PYTHON=<its python>")
    return Driver(python, tmp_path_factory.mktemp("sglang-home"))
