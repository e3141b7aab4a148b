"""Builds the optional native copy engine, kvstore_service._native.

pyproject.toml holds all package metadata; this file only adds the C++ extension and a build step
that tolerates failure: if the extension cannot be compiled (no compiler, no Python headers, ...)
the install still succeeds, a notice is printed, and kvstore_service.native uses its pure-Python
fallback. No torch, pybind11 or CUDA is needed to build.

Optional device support:
  * CUDA is always compiled in: the driver is dlopen'ed at runtime (see csrc/cuda_copy.cpp). When
    cuda.h is found ($CUDA_HOME, $CUDA_PATH or /usr/local/cuda), it is used only for compile-time
    ABI checks of the hand-declared driver types.
  * Ascend is compiled in when the CANN headers are found ($ASCEND_TOOLKIT_HOME, $ASCEND_HOME_PATH
    or /usr/local/Ascend/ascend-toolkit/latest): defines KVSTORE_WITH_ACL.
If a build with those headers fails, it is retried without them before giving up.

Environment switches:
  KVSTORE_NO_NATIVE=1       do not build the extension at all
  KVSTORE_REQUIRE_NATIVE=1  fail the install if the extension cannot be built (for CI)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
CSRC = "csrc"


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _first_dir_with(candidates: list[str | None], relative: str) -> str | None:
    for base in candidates:
        if base and (Path(base) / relative).is_file():
            return str(Path(base))
    return None


def _cuda_include() -> str | None:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    return _first_dir_with([h and os.path.join(h, "include") for h in homes], "cuda.h")


def _acl_include() -> str | None:
    homes = [
        os.environ.get("ASCEND_TOOLKIT_HOME"),
        os.environ.get("ASCEND_HOME_PATH"),
        "/usr/local/Ascend/ascend-toolkit/latest",
    ]
    return _first_dir_with([h and os.path.join(h, "include") for h in homes], "acl/acl.h")


def _native_extension() -> Extension:
    macros: list[tuple[str, str | None]] = []
    includes: list[str] = []
    cuda_inc = _cuda_include()
    if cuda_inc:
        macros.append(("KVSTORE_CUDA_ABI_CHECK", "1"))
        includes.append(cuda_inc)
    acl_inc = _acl_include()
    if acl_inc:
        macros.append(("KVSTORE_WITH_ACL", "1"))
        includes.append(acl_inc)
    return Extension(
        "kvstore_service._native",
        sources=[f"{CSRC}/{name}.cpp" for name in ("copy_engine", "crc32c", "cuda_copy", "acl_copy")],
        depends=[f"{CSRC}/kvstore_native.h", f"{CSRC}/crc32c.h", f"{CSRC}/crc32c_3way.inc"],
        include_dirs=[CSRC, *includes],
        define_macros=macros,
        language="c++",
        # No -march: instruction sets are chosen at runtime (see csrc/crc32c.cpp), so the binary
        # runs on any CPU of the target architecture, not just the build machine's.
        extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-pthread"],
        extra_link_args=["-pthread"],
        libraries=["dl"],
    )


class OptionalBuildExt(build_ext):
    """build_ext that retries without optional device headers, then gives up politely."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # e.g. no compiler found at all
            self._give_up(exc)

    def build_extensions(self) -> None:
        built = [ext for ext in self.extensions if self._build_optional(ext)]
        # Forget the ones that failed, so later steps (in-place copy, editable wheel) skip them.
        self.extensions[:] = built

    def _build_optional(self, ext: Extension) -> bool:
        try:
            self.build_extension(ext)
            return True
        except Exception as exc:
            if not ext.define_macros:
                self._give_up(exc)
                return False
            self._notice(f"native build with {ext.define_macros} failed ({exc}); retrying without them")
        ext.define_macros = []
        ext.include_dirs = [CSRC]
        self.force = True
        try:
            self.build_extension(ext)
            return True
        except Exception as exc:
            self._give_up(exc)
            return False

    def _give_up(self, exc: Exception) -> None:
        if _flag("KVSTORE_REQUIRE_NATIVE"):
            raise exc
        self._notice(
            f"could not build the native copy engine ({type(exc).__name__}: {exc}). kvstore will use its "
            "slower pure-Python fallback (kvstore_service.native.NATIVE is False). Install a C++17 compiler "
            "and the Python headers, then reinstall, to get it."
        )

    @staticmethod
    def _notice(message: str) -> None:
        print(f"\n*** kvstore: {message}\n", file=sys.stderr, flush=True)


def _packages() -> list[str]:
    """Every subpackage, found rather than listed: a hand-kept list once shipped a wheel without
    kvstore_service.backends. The client package lives in client/ and installs as kvstore_client."""
    service = find_packages(include=["kvstore_service", "kvstore_service.*"])
    client = ["kvstore_client" + name[len("client"):] for name in find_packages(include=["client", "client.*"])]
    return service + client


setup(
    packages=_packages(),
    package_dir={"kvstore_client": "client"},
    ext_modules=[] if _flag("KVSTORE_NO_NATIVE") else [_native_extension()],
    cmdclass={"build_ext": OptionalBuildExt},
)
