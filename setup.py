"""Builds the native copy engine, kvstore_service._native, which the daemon (kvstore-sidecar) requires.

pyproject.toml holds all package metadata; this file only adds the C++ extension (needs a C++17
compiler and the Python headers; no torch, pybind11 or CUDA). If it cannot be built, the install
fails with a message saying so: there is no pure-Python fallback.

Optional device support:
  * CUDA is always compiled in: the driver is dlopen'ed at runtime (see csrc/cuda_copy.cpp). When
    cuda.h is found ($CUDA_HOME, $CUDA_PATH or /usr/local/cuda), static_asserts check the
    hand-declared driver types against it; a failing check fails the build.
  * Ascend is compiled in when the CANN headers are found ($ASCEND_TOOLKIT_HOME, $ASCEND_HOME_PATH
    or /usr/local/Ascend/ascend-toolkit/latest). If the build with them fails, a notice is printed
    and the engine is built without Ascend support.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

CSRC = "csrc"
ACL_MACRO = ("KVSTORE_WITH_ACL", "1")


def _include_dir(homes: list[str | None], header: str) -> str | None:
    for home in homes:
        if home and (Path(home) / "include" / header).is_file():
            return str(Path(home) / "include")
    return None


CUDA_INCLUDE = _include_dir([os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"], "cuda.h")
ACL_INCLUDE = _include_dir([os.environ.get("ASCEND_TOOLKIT_HOME"), os.environ.get("ASCEND_HOME_PATH"),
                            "/usr/local/Ascend/ascend-toolkit/latest"], "acl/acl.h")


def _native_extension() -> Extension:
    macros: list[tuple[str, str | None]] = []
    includes = [CSRC]
    if CUDA_INCLUDE:
        macros.append(("KVSTORE_CUDA_ABI_CHECK", "1"))
        includes.append(CUDA_INCLUDE)
    if ACL_INCLUDE:
        macros.append(ACL_MACRO)
        includes.append(ACL_INCLUDE)
    return Extension(
        "kvstore_service._native",
        sources=[f"{CSRC}/{name}.cpp" for name in ("module", "buffers", "copy", "checksums", "plan", "transfer",
                                                   "slot_headers", "device_args", "block", "crc32c", "cuda_copy",
                                                   "acl_copy", "disk_io", "guard", "populate")],
        depends=[f"{CSRC}/{name}" for name in ("kvstore_native.h", "crc32c.h", "crc32c_3way.inc", "copy_kernel_ptx.h")],
        include_dirs=includes,
        define_macros=macros,
        language="c++",
        # No -march: instruction sets are chosen at runtime (see csrc/crc32c.cpp), so the binary
        # runs on any CPU of the target architecture, not just the build machine's.
        extra_compile_args=["-O3", "-std=c++17", "-fvisibility=hidden", "-pthread"],
        extra_link_args=["-pthread"],
        libraries=["dl"],
    )


def _notice(message: str) -> None:
    print(f"\n*** kvstore: {message}\n", file=sys.stderr, flush=True)


class BuildNative(build_ext):
    """build_ext that fails loudly; only Ascend support is dropped (with a notice) if it breaks the build."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler, no Python headers, a compile error, a failed CUDA ABI check
            cuda = (f" A failed static_assert in csrc/cuda_copy.cpp means the driver types declared there do "
                    f"not match {CUDA_INCLUDE}/cuda.h: fix them, or set CUDA_HOME to another toolkit."
                    if CUDA_INCLUDE else "")
            _notice(f"cannot build the native copy engine kvstore_service._native ({type(exc).__name__}: {exc}). "
                    "kvstore requires it: install a C++17 compiler (g++ or clang++) and the Python development "
                    f"headers (e.g. python3-dev), fix any compiler error above, then reinstall.{cuda}")
            raise

    def build_extension(self, ext: Extension) -> None:
        if ACL_MACRO not in ext.define_macros:
            super().build_extension(ext)
            return
        try:
            super().build_extension(ext)
        except Exception as exc:
            _notice(f"the build with the Ascend headers in {ACL_INCLUDE} failed ({exc}); building without "
                    "Ascend (NPU) support")
            ext.define_macros = [m for m in ext.define_macros if m != ACL_MACRO]
            ext.include_dirs = [d for d in ext.include_dirs if d != ACL_INCLUDE]
            self.force = True
            super().build_extension(ext)


def _packages() -> list[str]:
    """Every subpackage, found rather than listed: a hand-kept list once shipped a wheel without
    kvstore_service.backends. The client, kvstore_client, is its own distribution (client/pyproject.toml)."""
    return find_packages(include=["kvstore_service", "kvstore_service.*"])


setup(
    packages=_packages(),
    ext_modules=[_native_extension()],
    cmdclass={"build_ext": BuildNative},
)
