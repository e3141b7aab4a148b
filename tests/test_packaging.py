"""The wheel users install ships every package and module of the source tree, under its import name.

Checks the wheel CI built and installed (KVSTORE_TEST_WHEEL, set by .ci/run), or else builds one from
this tree with the same command (.ci/build-wheel: the native engine is compiled, ~20 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Source directory -> import name of the top-level package it installs as.
PACKAGES = {"kvstore_service": "kvstore_service", "client": "kvstore_client"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("KVSTORE_TEST_WHEEL")
    if given:
        return Path(given)
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(["bash", str(REPO / ".ci" / "build-wheel"), str(out)], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert build.returncode == 0, f"building the wheel failed:\n{build.stdout}\n{build.stderr}"
    return Path(build.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def in_wheel(path: Path) -> str:
    """Where a file under one of the package directories lies in the wheel."""
    for src, name in PACKAGES.items():
        if path.is_relative_to(REPO / src):
            return "/".join([name, *path.relative_to(REPO / src).parts])
    raise ValueError(path)


def source_files(*suffixes: str) -> list[Path]:
    return [path for src in PACKAGES for path in (REPO / src).rglob("*")
            if path.suffix in suffixes and "__pycache__" not in path.parts]


def test_every_package_directory_is_in_the_wheel(names: set[str]) -> None:
    inits = [in_wheel(path) for path in source_files(".py") if path.name == "__init__.py"]
    assert {"kvstore_service/backends/__init__.py", "kvstore_client/protocol/__init__.py"} <= set(inits)
    missing = sorted(init.rsplit("/", 1)[0] for init in inits if init not in names)
    assert not missing, f"packages missing from the wheel: {missing}"


def test_every_module_and_stub_is_in_the_wheel(names: set[str]) -> None:
    """Also a module in a directory without __init__.py (not a package, so never installed)."""
    missing = sorted(in_wheel(path) for path in source_files(".py", ".pyi") if in_wheel(path) not in names)
    assert not missing, f"source files missing from the wheel: {missing}"


def test_the_wheel_has_the_native_engine_and_nothing_else_at_the_top(names: set[str], wheel: Path) -> None:
    assert any(n.startswith("kvstore_service/_native.") and n.endswith(".so") for n in names), \
        "the native copy engine kvstore_service._native is missing"
    top = {n.split("/", 1)[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == set(PACKAGES.values()), f"unexpected top-level entries: {sorted(top)}"
    with zipfile.ZipFile(wheel) as zf:
        entry_points = zf.read(f"{dist_info.pop()}/entry_points.txt").decode()
    assert "kvstore = kvstore_service.cli:main" in entry_points
