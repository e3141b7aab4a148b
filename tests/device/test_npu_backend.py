"""The Ascend (NPU) path in every part that runs without an NPU or CANN.

* pure functions: the kernel check for pool registration, 4 KiB rounding, the bounds decision and
  the ACL range query (with a fake), the logical -> physical NPU mapping and npu-smi parsing;
* csrc/acl_copy.cpp compiled with KVSTORE_WITH_ACL against a small fake acl/acl.h and run against
  a fake libascendcl.so (host memory standing in for device memory), to check which ACL calls it
  makes: the batch fallback, d2d never batched, aclrtHostRegisterV2 vs the legacy call, and no
  aclInit from features().

The fakes follow the declarations of CANN's acl_rt.h; none of this says the real runtime behaves
so. Nothing here ran on Ascend hardware.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstore_client.protocol.npu_identity import (
    npu_identity,
    npu_smi_card_chip,
    parse_npu_smi_map,
    physical_npu,
)
from kvstore_service import native, native_device
from kvstore_service.backends.base import ChecksumSample, Mapping, TransferPlan, pool_pieces
from kvstore_service.backends.npu import (
    ACL_NOT_SUPPORTED,
    acl_address_range,
    check_npu_bounds,
    host_register_size,
    kernel_allows_host_register,
)

ROOT = Path(__file__).resolve().parents[2]
MIB2 = 2 << 20

# -- pool registration ------------------------------------------------------------------------------


@pytest.mark.parametrize(("release", "allowed"), [
    ("5.10.0-60.18.0.50.oe2203.aarch64", False),  # openEuler 22.03
    ("5.10.0", False),
    ("4.19.90-2107.6.0.0100.oe1.bclinux.aarch64", False),
    ("4.19.90", False),
    ("3.10.0-1160.el7.x86_64", False),
    ("5.11.0", True),
    ("5.15.0-91-generic", True),
    ("6.6.0", True),
    ("6.6.0-28.0.0.34.oe2403.aarch64", True),
    ("10.0.1", True),
    ("", False),
    ("weird", False),
    ("6", False),
])
def test_kernel_allows_host_register(release: str, allowed: bool) -> None:
    assert kernel_allows_host_register(release) is allowed


def test_host_register_size_rounds_up_to_4k() -> None:
    assert host_register_size(1) == 4096
    assert host_register_size(4096) == 4096
    assert host_register_size(4097) == 8192
    assert host_register_size((64 << 30) + 12) == (64 << 30) + 4096
    with pytest.raises(ValueError):
        host_register_size(0)


# -- bounds -------------------------------------------------------------------------------------------


def test_bounds_capped_at_the_page_rounded_allocation() -> None:
    base = 0x1240_0000_0000
    assert check_npu_bounds(base, MIB2, (base, MIB2)) is True
    # The allocation is reported as 3 MiB; the 2 MiB page it ends in is mapped too.
    assert check_npu_bounds(base + MIB2, MIB2, (base, 3 << 20)) is True
    with pytest.raises(ValueError, match="not inside the shared allocation"):
        check_npu_bounds(base + MIB2, MIB2 + 1, (base, 3 << 20))
    with pytest.raises(ValueError, match="not inside the shared allocation"):
        check_npu_bounds(base - 4096, 4096, (base, MIB2))
    with pytest.raises(ValueError, match="empty allocation"):
        check_npu_bounds(base, 1, (base, 0))


def test_bounds_without_a_range_query_trust_the_handle() -> None:
    assert check_npu_bounds(0x1000, 1 << 40, None) is False


class FakeLib:
    def __init__(self, rc: int, base: int = 0, size: int = 0) -> None:
        self.rc, self.base, self.size = rc, base, size
        self.calls: list[int] = []

    def aclrtMemGetAddressRange(self, ptr, pbase, psize) -> int:  # noqa: N802 - the ACL name
        self.calls.append(ptr.value)
        pbase.contents.value = self.base
        psize.contents.value = self.size
        return self.rc


def test_acl_address_range() -> None:
    lib = FakeLib(0, 0x4000_0000, 8 << 20)
    assert acl_address_range(0x4010_0000, lib) == (0x4000_0000, 8 << 20)
    assert lib.calls == [0x4010_0000]
    for rc in sorted(ACL_NOT_SUPPORTED):
        assert acl_address_range(0x4010_0000, FakeLib(rc)) is None
    with pytest.raises(ValueError, match=r"aclrtMemGetAddressRange failed .*aclError 107000"):
        acl_address_range(0x4010_0000, FakeLib(107000))
    assert acl_address_range(0x4010_0000, object()) is None  # CANN without the call


# -- identity -----------------------------------------------------------------------------------------


def test_physical_npu() -> None:
    assert physical_npu(0, {}) == 0
    assert physical_npu(5, {"ASCEND_RT_VISIBLE_DEVICES": ""}) == 5
    assert physical_npu(0, {"ASCEND_RT_VISIBLE_DEVICES": "3"}) == 3
    assert physical_npu(1, {"ASCEND_RT_VISIBLE_DEVICES": "4, 6 ,7"}) == 6
    assert physical_npu(2, {"ASCEND_RT_VISIBLE_DEVICES": "4,6,7"}) == 7
    with pytest.raises(ValueError, match="not visible"):
        physical_npu(3, {"ASCEND_RT_VISIBLE_DEVICES": "4,6,7"})
    with pytest.raises(ValueError, match="comma-separated"):
        physical_npu(0, {"ASCEND_RT_VISIBLE_DEVICES": "npu0"})
    with pytest.raises(ValueError, match="negative"):
        physical_npu(0, {"ASCEND_RT_VISIBLE_DEVICES": "-1"})
    with pytest.raises(ValueError, match="negative"):
        physical_npu(-1, {})


SMI_MAP_A2 = """\
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        1                              0                              0                              Ascend 910B3
        1                              1                              -                              Mcu
        2                              0                              1                              Ascend 910B3
        2                              1                              -                              Mcu
"""

SMI_MAP_A3 = """\
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        0                              0                              0                              Ascend 910
        0                              1                              1                              Ascend 910
        0                              2                              -                              Mcu
        1                              0                              2                              Ascend 910
        1                              1                              3                              Ascend 910
"""


def test_parse_npu_smi_map() -> None:
    assert parse_npu_smi_map(SMI_MAP_A2) == {0: (1, 0), 1: (2, 0)}
    assert parse_npu_smi_map(SMI_MAP_A3) == {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1)}
    assert parse_npu_smi_map("| 4 | 0 | 0 | Ascend910B |") == {0: (4, 0)}
    assert parse_npu_smi_map("") == {}
    assert parse_npu_smi_map("dcmi module initialize failed. ret is -8005") == {}


def test_npu_smi_card_chip() -> None:
    # The engine sees one NPU with ASCEND_RT_VISIBLE_DEVICES=3: npu-smi must be asked about card 1 chip 1
    # on A3, not about "-i 0".
    a3 = parse_npu_smi_map(SMI_MAP_A3)
    assert npu_smi_card_chip(physical_npu(0, {"ASCEND_RT_VISIBLE_DEVICES": "3"}), a3) == (1, 1)
    assert npu_smi_card_chip(1, parse_npu_smi_map(SMI_MAP_A2)) == (2, 0)
    # Without npu-smi's map: A3 is card * 2 + chip, elsewhere one chip per card.
    assert npu_smi_card_chip(3, {}, a3=True) == (1, 1)
    assert npu_smi_card_chip(6, {}, a3=True) == (3, 0)
    assert npu_smi_card_chip(3, {}) == (3, 0)


def test_npu_identity() -> None:
    """What the engine and the daemon both call an NPU: torch_npu's uuid, else npu-smi's answer about
    the physical chip behind the logical index, else nothing."""
    asked: list[tuple[str, ...]] = []
    board = "NPU ID : 1\nChip ID : 1\nPCIe Bus Info : 0000:C1:00.0\nVDie ID : 1A2B 00FF\n"

    def npu_smi(*args: str) -> str:
        asked.append(args)
        return SMI_MAP_A3 if args == ("-m",) else board if args[:2] == ("-t", "board") else ""

    a3 = SimpleNamespace(name="Ascend910_9382")
    env = {"ASCEND_RT_VISIBLE_DEVICES": "3"}
    assert npu_identity(a3, 0, env, npu_smi) == "vdie-1a2b00ff"
    assert asked == [("-m",), ("-t", "board", "-i", "1", "-c", "1")]  # logical 0 is chip 1 of card 1
    assert npu_identity(SimpleNamespace(uuid=" GPU-AB:CD "), 0, env, npu_smi) == "ab:cd"  # torch_npu's, first
    assert len(asked) == 2
    assert npu_identity(SimpleNamespace(uuid="a b", name="Ascend910B3"), 0, env, npu_smi) == "vdie-1a2b00ff"
    assert npu_identity(a3, 1, env, npu_smi) == ""  # not visible: no guess
    assert npu_identity(a3, 0, env, lambda *args: "") == ""  # no npu-smi


# -- acl_copy.cpp against a fake CANN -----------------------------------------------------------------

FAKE_ACL_H = r"""
#pragma once
// Minimal stand-in for CANN's acl/acl.h: only what csrc/acl_copy.cpp uses, declared as acl_base.h /
// acl_rt.h declare it.
#include <cstddef>
#include <cstdint>
typedef int aclError;
static const int ACL_SUCCESS = 0;
typedef void* aclrtStream;
typedef void* aclrtContext;
typedef enum aclrtMemcpyKind {
  ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE,
} aclrtMemcpyKind;
typedef enum aclrtMemLocationType {
  ACL_MEM_LOCATION_TYPE_HOST = 0, ACL_MEM_LOCATION_TYPE_DEVICE,
} aclrtMemLocationType;
typedef struct aclrtMemLocation { uint32_t id; aclrtMemLocationType type; } aclrtMemLocation;
"""

FAKE_LIB = r"""
// Fake libascendcl.so: "device" memory is host memory; every call is counted.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include "acl/acl.h"
struct Attr { aclrtMemLocation dst, src; uint8_t rsv[16]; };
static std::map<std::string, long> g;
static long knob(const char* name) { const char* v = getenv(name); return v ? atol(v) : 0; }
extern "C" {
__attribute__((visibility("default"))) long fake_get(const char* k) { return g[k]; }
aclError aclInit(const char*) { g["init"]++; return g["init"] > 1 ? 100002 : 0; }
aclError aclrtGetDeviceCount(uint32_t* n) { *n = 2; return 0; }
aclError aclrtSetDevice(int32_t) { g["set_device"]++; return 0; }
aclError aclrtGetCurrentContext(aclrtContext* c) { *c = reinterpret_cast<void*>(0x1); return 0; }
aclError aclrtSetCurrentContext(aclrtContext) { return 0; }
aclError aclrtCreateStream(aclrtStream* s) { *s = reinterpret_cast<void*>(0x2); return 0; }
aclError aclrtSynchronizeStream(aclrtStream) { g["sync"]++; return 0; }
aclError aclrtMemcpyAsync(void* d, size_t, const void* s, size_t n, aclrtMemcpyKind k, aclrtStream) {
  g["memcpy"]++; g["memcpy_kind"] = k; memcpy(d, s, n); return 0;
}
#ifndef FAKE_NO_V2
aclError aclrtMemcpyBatchAsync(void** d, size_t* dmax, void** s, size_t* n, size_t count, Attr* a, size_t* ai,
                               size_t na, size_t* fail, aclrtStream) {
  g["batch"]++;
  long rc = knob("FAKE_BATCH_RC");
  if (rc) { *fail = SIZE_MAX; return (aclError)rc; }
  if (na != 1 || ai[0] != 0 || a[0].src.type == a[0].dst.type) { *fail = 0; return 107000; }
  for (size_t i = 0; i < count; ++i) { if (dmax[i] < n[i]) return 107000; memcpy(d[i], s[i], n[i]); }
  g["batch_runs"] += (long)count;
  return 0;
}
aclError aclrtHostRegisterV2(void*, uint64_t size, uint32_t flags) {
  g["v2"]++; g["v2_size"] = (long)size; g["v2_flags"] = flags;
  return (aclError)knob("FAKE_V2_RC");
}
aclError aclrtHostGetDevicePointer(void* p, void** d, uint32_t) { *d = (char*)p + 1; return 0; }
#endif
aclError aclrtHostRegister(void* p, uint64_t size, int type, void** d) {
  g["legacy"]++; g["legacy_size"] = (long)size; g["legacy_type"] = type; *d = (char*)p + 2; return 0;
}
aclError aclrtHostUnregister(void*) { g["unregister"]++; return 0; }
const char* aclGetRecentErrMsg() { return "fake"; }
}
"""

SCENARIO = r"""
import ctypes, importlib.util, json, mmap, os, sys
from array import array
spec = importlib.util.spec_from_file_location("_native", sys.argv[1])
nat = importlib.util.module_from_spec(spec); spec.loader.exec_module(nat)
out = {}
feats = nat.features()
out["features"] = {k: v for k, v in feats.items() if k.startswith("acl")}
lib = ctypes.CDLL(os.path.join(sys.argv[2], "libascendcl.so"))
lib.fake_get.restype = ctypes.c_long
get = lambda k: lib.fake_get(k.encode())
out["init_after_features"] = get("init")
n, bs = 64, 4096
src = mmap.mmap(-1, n * bs); dst = mmap.mmap(-1, n * bs)
for i in range(n):
    src[i * bs:(i + 1) * bs] = bytes([i % 251 + 1]) * bs
addr = lambda m: ctypes.addressof(ctypes.c_char.from_buffer(m))
# every other block, so runs do not coalesce
offs = array("Q", [i * bs for i in range(0, n, 2)]); sizes = array("Q", [bs] * len(offs))
err, codes = {}, {}
for direction in sys.argv[3].split(","):
    try:
        nat.acl_copy_blocks(addr(src), addr(dst), offs, offs, sizes, direction, 0)
    except RuntimeError as e:
        err[direction], codes[direction] = str(e), getattr(e, "acl_error", None)
    out[direction] = {k: get(k) for k in ("batch", "batch_runs", "memcpy", "memcpy_kind", "sync")}
out["errors"], out["codes"] = err, codes
out["bytes_ok"] = all(dst[o:o + bs] == src[o:o + bs] for o in offs) and dst[bs:2 * bs] == bytes(bs)
if "h2d" in sys.argv[3] and not err:  # a load's checksum sample, taken while the copy runs
    sums = nat.acl_copy_blocks(addr(src), addr(dst), offs, offs, sizes, "h2d", 0, None, True, addr(src),
                               offs[:3], bs)
    out["sums_ok"] = sums == nat.checksum_blocks(addr(src), offs[:3], bs) and len(sums) == 24
    out["sums_sync"] = get("sync")
    # A chunk's Runs, as the daemon copies them (acl_transfer): pool -> engine, the pool's sample checksummed.
    back = mmap.mmap(-1, n * bs)
    runs = nat.Runs(offs, array("Q", [addr(back) + o for o in offs]), sizes)
    sums = nat.acl_transfer(addr(src), runs, True, 0, offs[:3], bs)
    out["transfer_ok"] = (sums == nat.checksum_blocks(addr(src), offs[:3], bs)
                          and all(back[o:o + bs] == src[o:o + bs] for o in offs) and back[bs:2 * bs] == bytes(bs))
    out["transfer_batches"] = get("batch") - out["h2d"]["batch"]
out["features_after"] = {k: v for k, v in nat.features().items() if k.startswith("acl")}
try:  # run by run, one run 8 bytes off a 64-byte boundary
    nat.acl_copy_blocks(addr(src), addr(dst), array("Q", [0, 8 + bs]), array("Q", [0, 8 + bs]),
                        array("Q", [64, 64]), "h2d", 0, None, False)
except RuntimeError as e:
    out["unaligned"] = str(e)
pool = mmap.mmap(-1, 3 * 4096)
try:
    out["register"] = nat.acl_host_register(addr(pool), 2 * 4096 + 5, 1) - addr(pool)
    out["pinned"] = nat.features()["acl_host_pinned"]
    nat.acl_host_unregister(addr(pool), 1)
except RuntimeError as e:
    out["register_error"] = str(e)
out["reg"] = {k: get(k) for k in ("v2", "v2_size", "v2_flags", "legacy", "legacy_size", "legacy_type", "init")}
out["unregister"] = get("unregister")
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fake_acl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    tmp = tmp_path_factory.mktemp("fake_acl")
    (tmp / "include" / "acl").mkdir(parents=True)
    (tmp / "include" / "acl" / "acl.h").write_text(textwrap.dedent(FAKE_ACL_H))
    (tmp / "fake.cpp").write_text(FAKE_LIB)
    libs = {}
    for variant, flags in (("full", []), ("legacy", ["-DFAKE_NO_V2"])):
        d = tmp / variant
        d.mkdir()
        subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-O0", f"-I{tmp / 'include'}", *flags,
                        str(tmp / "fake.cpp"), "-o", str(d / "libascendcl.so")], check=True)
        libs[variant] = d
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    module = tmp / f"_native{ext}"
    sources = [str(path) for path in sorted((ROOT / "csrc").glob("*.cpp"))]  # (the extension: every file)
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-O0", "-pthread", "-fvisibility=hidden",
                    "-DKVSTORE_WITH_ACL=1", f"-I{ROOT / 'csrc'}", f"-I{tmp / 'include'}",
                    f"-I{sysconfig.get_paths()['include']}", *sources, "-o", str(module), "-ldl"], check=True)
    return {"module": module, **libs}


def run_scenario(fake_acl: dict[str, Path], variant: str, directions: str, **env: str) -> dict:
    lib_dir = fake_acl[variant]
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(fake_acl["module"]), str(lib_dir), directions],
                          env={**os.environ, "LD_LIBRARY_PATH": str(lib_dir), **env},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_fake_acl_batch_used_and_features_do_not_init(fake_acl: dict[str, Path]) -> None:
    out = run_scenario(fake_acl, "full", "h2d")
    assert out["init_after_features"] == 0  # features() must not call aclInit before torch_npu
    assert out["features"]["acl_available"] is True
    assert out["features"]["acl_batch_memcpy"] is True
    assert out["features"]["acl_host_register_v2"] is True
    assert out["features"]["acl_host_pinned"] is None
    assert out["h2d"]["batch"] == 1 and out["h2d"]["batch_runs"] == 32 and out["h2d"]["memcpy"] == 0
    assert out["errors"] == {} and out["bytes_ok"]
    # With a checksum sample: the same copy (one more wait for the stream) and the sample's CRC32C.
    assert out["sums_ok"] and out["sums_sync"] == out["h2d"]["sync"] + 1
    assert out["transfer_ok"] and out["transfer_batches"] == 2  # (the sample's copy, then the Runs' one)


def test_fake_acl_unaligned_run_by_run_copies_are_refused_saying_why(fake_acl: dict[str, Path]) -> None:
    out = run_scenario(fake_acl, "full", "h2d")
    assert "aclrtMemcpyAsync needs 64-byte-aligned addresses (CANN 8.0): run 1" in out["unaligned"]


@pytest.mark.parametrize("rc", sorted(ACL_NOT_SUPPORTED))
def test_fake_acl_batch_not_supported_falls_back_and_remembers(fake_acl: dict[str, Path], rc: int) -> None:
    out = run_scenario(fake_acl, "full", "h2d,d2h", FAKE_BATCH_RC=str(rc))
    assert out["errors"] == {} and out["bytes_ok"]
    assert out["h2d"]["batch"] == 1 and out["h2d"]["memcpy"] == 32
    assert out["d2h"]["batch"] == 1, "the not-supported answer is remembered: no second batch attempt"
    assert out["d2h"]["memcpy"] == 64 and out["d2h"]["memcpy_kind"] == 2  # ACL_MEMCPY_DEVICE_TO_HOST
    assert out["features_after"]["acl_batch_memcpy"] is False


def test_fake_acl_batch_other_error_is_an_error(fake_acl: dict[str, Path]) -> None:
    out = run_scenario(fake_acl, "full", "h2d", FAKE_BATCH_RC="507899")
    assert "aclrtMemcpyBatchAsync failed" in out["errors"]["h2d"] and "507899" in out["errors"]["h2d"]
    assert out["codes"] == {"h2d": 507899}  # the failed call's aclError, for the sticky check
    assert out["h2d"]["memcpy"] == 0 and out["h2d"]["sync"] == 1  # still waited for the stream


def raising_acl(code: int | None):  # type: ignore[no-untyped-def]
    def call(*args: object, **kwargs: object) -> None:
        e = RuntimeError(f"aclrtMemcpyAsync failed at run 0: aclError {code}")
        if code is not None:
            e.acl_error = code  # type: ignore[attr-defined]  # what csrc/acl_copy.cpp attaches
        raise e

    return call


@pytest.mark.parametrize("code", sorted(native_device.STICKY_ACL_ERRORS))
def test_a_device_fatal_acl_error_is_sticky(monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """The NPU or its memory failed (UCE, ECC, lost heartbeat, ...): the daemon must restart, as on a
    sticky CUDA error (jobs.py and daemon.py exit 75 on StickyDeviceError)."""
    monkeypatch.setattr(native_device, "_native", SimpleNamespace(acl_copy_blocks=raising_acl(code),
                                                                  acl_host_register=raising_acl(code)))
    with pytest.raises(native_device.StickyDeviceError, match=native_device.STICKY_ACL_ERRORS[code]) as info:
        native_device.acl_copy_blocks(0, 0, [0], [0], [1], "h2d", 3)
    assert (info.value.code, info.value.device) == (code, 3)
    with pytest.raises(native_device.StickyDeviceError):
        native_device.acl_host_register(0, 4096, 1)


@pytest.mark.parametrize("code", [None, 0, 107000, 207000, 507011])
def test_other_acl_errors_stay_runtime_errors(monkeypatch: pytest.MonkeyPatch, code: int | None) -> None:
    monkeypatch.setattr(native_device, "_native", SimpleNamespace(acl_copy_blocks=raising_acl(code)))
    with pytest.raises(RuntimeError) as info:
        native_device.acl_copy_blocks(0, 0, [0], [0], [1], "h2d", 0)
    assert not isinstance(info.value, native_device.StickyDeviceError)


def test_fake_acl_d2d_never_batches(fake_acl: dict[str, Path]) -> None:
    out = run_scenario(fake_acl, "full", "d2d")
    assert out["errors"] == {} and out["bytes_ok"]
    assert out["d2d"]["batch"] == 0 and out["d2d"]["memcpy"] == 32 and out["d2d"]["memcpy_kind"] == 3


def test_fake_acl_register_v2_pins_rounded(fake_acl: dict[str, Path]) -> None:
    out = run_scenario(fake_acl, "full", "h2d")
    assert out["reg"]["v2"] == 1 and out["reg"]["legacy"] == 0
    assert out["reg"]["v2_flags"] == 0x10000002  # ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED
    assert out["reg"]["v2_size"] == 3 * 4096  # 2 pages + 5 bytes, rounded up to 4 KiB
    assert out["register"] == 1  # aclrtHostGetDevicePointer's answer
    assert out["pinned"] is True and out["unregister"] == 1
    assert out["reg"]["init"] == 1


def test_fake_acl_register_v2_not_supported_uses_legacy(fake_acl: dict[str, Path]) -> None:
    out = run_scenario(fake_acl, "full", "h2d", FAKE_V2_RC="207000")
    assert out["reg"]["v2"] == 1 and out["reg"]["legacy"] == 1
    assert out["reg"]["legacy_size"] == 3 * 4096 and out["reg"]["legacy_type"] == 0
    assert out["pinned"] is False


def test_fake_acl_register_v2_other_error_is_an_error(fake_acl: dict[str, Path]) -> None:
    out = run_scenario(fake_acl, "full", "h2d", FAKE_V2_RC="107000")
    assert "aclrtHostRegisterV2 failed" in out["register_error"] and "107000" in out["register_error"]
    assert out["reg"]["legacy"] == 0


def test_fake_acl_old_cann_legacy_only(fake_acl: dict[str, Path]) -> None:
    out = run_scenario(fake_acl, "legacy", "h2d")
    assert out["features"]["acl_batch_memcpy"] is False and out["features"]["acl_host_register_v2"] is False
    assert out["h2d"]["batch"] == 0 and out["h2d"]["memcpy"] == 32 and out["bytes_ok"]
    assert out["reg"]["legacy"] == 1 and out["reg"]["legacy_size"] == 3 * 4096
    assert out["register"] == 2 and out["pinned"] is False



# -- NpuBackend's pool registration, with the native engine stubbed ------------------------------------


class StubNative:
    def __init__(self, pinned: bool | None, fail_at: int = 0) -> None:
        self.pinned, self.fail_at = pinned, fail_at  # fail_at: the n-th registration fails (0: none)
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[tuple[int, int]] = []
        self.attempts = 0

    def acl_host_register(self, addr: int, size: int, device: int = 0) -> int:
        self.attempts += 1
        if self.attempts == self.fail_at:
            raise RuntimeError("aclrtHostRegisterV2 failed: aclError 107000")
        self.registered.append((addr, size, device))
        return 0

    def acl_host_unregister(self, addr: int, device: int = 0) -> None:
        self.unregistered.append((addr, device))

    def features(self) -> dict:
        return {"acl_host_pinned": self.pinned}


def bare_backend(monkeypatch: pytest.MonkeyPatch, stub: StubNative, release: str):
    from kvstore_service.backends import npu

    monkeypatch.setattr(npu, "native", stub)
    monkeypatch.setattr(npu, "native_device", stub)
    monkeypatch.setattr(npu.os, "uname", lambda: os.uname_result(("Linux", "n", release, "#1", "aarch64")))
    backend = object.__new__(npu.NpuBackend)  # no torch_npu here: skip __init__
    backend.pieces, backend.registered, backend.registered_on = [], [], None
    return backend


# A pool of 40 segments of 1 MiB + 256 bytes (not a multiple of 4 KiB) after a 2 MiB header: pieces of
# 16, 16 and 8 segments, the last one's size not a multiple of 4 KiB either.
SEGMENT = (1 << 20) + 256
PIECES = pool_pieces(0x7000_0000, 2 << 20, SEGMENT, 40)


def test_pool_registered_on_first_mapping_device_in_rounded_pieces(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    stub = StubNative(pinned=True)
    backend = bare_backend(monkeypatch, stub, "6.6.0")
    backend.register_pool(PIECES)
    assert stub.registered == []
    backend._register_pool_on(3)
    backend._register_pool_on(5)
    assert stub.registered == [(addr, host_register_size(size), 3) for addr, size in PIECES]
    assert all(addr % 4096 == 0 and size % 4096 == 0 for addr, size, _ in stub.registered)
    # together they cover every segment: from the first segment's start to past the last one's end
    assert stub.registered[0][0] == 0x7000_0000 + (2 << 20)
    assert len(PIECES) == 3 and PIECES[-1][1] % 4096 != 0
    assert stub.registered[-1][0] + stub.registered[-1][1] >= 0x7000_0000 + (2 << 20) + 40 * SEGMENT
    assert backend.registered_on == 3 and "synchronous" not in caplog.text
    backend.unregister_pool()
    assert stub.unregistered == [(addr, 3) for addr, _ in PIECES]
    backend.unregister_pool()
    assert len(stub.unregistered) == len(PIECES)


def test_pool_registered_at_start_on_the_given_device(monkeypatch: pytest.MonkeyPatch) -> None:
    stub = StubNative(pinned=True)
    backend = bare_backend(monkeypatch, stub, "6.6.0")
    backend.register_pool(PIECES, device=0)
    assert [d for _, _, d in stub.registered] == [0] * len(PIECES) and backend.registered_on == 0
    backend._register_pool_on(2)  # a first mapping on another device registers nothing more
    assert len(stub.registered) == len(PIECES)


def test_pool_legacy_registration_warns_synchronous(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    backend = bare_backend(monkeypatch, StubNative(pinned=False), "6.6.0")
    backend.register_pool(PIECES)
    backend._register_pool_on(0)
    assert "legacy aclrtHostRegister" in caplog.text and "synchronous" in caplog.text


def test_pool_not_registered_on_old_kernel(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    stub = StubNative(pinned=True)
    backend = bare_backend(monkeypatch, stub, "5.10.0-60.18.0.50.oe2203.aarch64")
    backend.register_pool(PIECES, device=0)
    backend._register_pool_on(0)
    assert stub.registered == [] and backend.registered_on is None
    assert "5.10 or older" in caplog.text


def test_pool_registration_failure_unregisters_its_pieces_and_only_warns_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    stub = StubNative(pinned=None, fail_at=3)
    backend = bare_backend(monkeypatch, stub, "6.6.0")
    backend.register_pool(PIECES)
    backend._register_pool_on(0)
    backend._register_pool_on(0)
    assert stub.attempts == 3  # stopped at the failing piece, not retried
    assert stub.unregistered == [(addr, 0) for addr, _, _ in stub.registered] and len(stub.registered) == 2
    assert caplog.text.count("NPU copies will be slower") == 1 and backend.registered_on is None
    backend.unregister_pool()
    assert len(stub.unregistered) == 2


def test_a_loads_checksum_sample_goes_with_its_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunked load's sample is checksummed by the copy call itself, while its DMA runs: one
    acl_transfer, whose sums name the corrupt block."""
    calls: list[dict] = []

    class CopyStub(StubNative):
        def acl_transfer(self, *args: object) -> list[int]:
            calls.append({"args": args})
            return [11, 99]  # the second block's sum is not the one expected

    backend = bare_backend(monkeypatch, CopyStub(pinned=True), "6.6.0")
    runs = native.runs_of([0x1000, 0x3000], [0x9000, 0xA000], [4096, 4096])
    check = ChecksumSample(array("Q", [0, 1]), array("Q", [0x1000, 0x3000]), 4096, array("Q", [11, 22]))
    mapping = Mapping(0x9000, 8192, device=2)
    assert backend.transfer(mapping, 0x7000_0000, TransferPlan(runs), True, check) == [1]
    (call,) = calls
    pool_base, copied, to_engine, device, offsets, size = call["args"]
    assert (pool_base, copied, to_engine, device, size) == (0x7000_0000, runs, True, 2, 4096)
    assert list(offsets) == [0x1000, 0x3000]
