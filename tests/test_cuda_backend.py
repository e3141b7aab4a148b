"""CUDA backend decisions that need no GPU: bounds fail closed, the pool is pinned on the first
mapped device, sticky driver errors are told apart, the batch-copy switch, the build against
pre-12.2 headers, and a fresh IPC export per registration. The driver calls themselves are covered
by the GPU tests in tests/test_device_backends.py and tests/test_native_copy.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvstore_client import client as client_module
from kvstore_client.client import MemorySpec, Session
from kvstore_client.errors import FailedPrecondition
from kvstore_client.protocol.handle import DeviceHandle, encode_handle
from kvstore_service import native
from kvstore_service.backends import cuda as cuda_backend
from kvstore_service.backends.base import TransferPlan
from kvstore_service.backends.cuda import CudaBackend, StickyDeviceError, check_ipc_bounds

ROOT = Path(__file__).resolve().parent.parent
UUID_A = "0b7e1c2a-5d3f-4e6a-9b8c-1d2e3f4a5b6c"
UUID_B = "f00dcafe-0000-4111-8222-333344445555"
BASE = 0x7F00_0000_0000


# -- bounds: fail closed ----------------------------------------------------------------------------


def test_bounds_inside_the_allocation_pass() -> None:
    check_ipc_bounds(BASE + 4096, 1 << 20, lambda ptr: (0, BASE, 2 << 20))


def test_bounds_outside_the_allocation_are_refused() -> None:
    with pytest.raises(ValueError, match="is not inside the shared allocation"):
        check_ipc_bounds(BASE + 4096, 2 << 20, lambda ptr: (0, BASE, 2 << 20))


@pytest.mark.parametrize("rc", [1, 201, 700])
def test_a_failed_range_query_refuses_the_registration(rc: int) -> None:
    with pytest.raises(ValueError, match=rf"cuMemGetAddressRange failed .*CUDA error {rc}.*refusing the registration"):
        check_ipc_bounds(BASE, 4096, lambda ptr: (rc, 0, 0))


@pytest.mark.parametrize("error", [OSError("libcuda.so.1: cannot open shared object file"),
                                   AttributeError("cuMemGetAddressRange_v2")])
def test_an_unavailable_range_query_refuses_the_registration(error: Exception) -> None:
    def query(ptr: int) -> tuple[int, int, int]:
        raise error

    with pytest.raises(ValueError, match="cuMemGetAddressRange is not callable.*refusing the registration"):
        check_ipc_bounds(BASE, 4096, query)


# -- map() with a fake torch: bounds and pool pinning ---------------------------------------------


class FakeStorage:
    def __init__(self, base: int, nbytes: int) -> None:
        self.base, self.size = base, nbytes

    def data_ptr(self) -> int:
        return self.base

    def nbytes(self) -> int:
        return self.size


def fake_backend(monkeypatch: pytest.MonkeyPatch, range_rc: int = 0) -> tuple[CudaBackend, list[tuple[str, Any]]]:
    """A CudaBackend whose torch opens every handle as a 1 MiB storage at BASE, whose driver range
    query answers (range_rc, BASE, 1 MiB), and whose pinning calls are recorded."""
    calls: list[tuple[str, Any]] = []
    opened: list[int] = []

    def new_shared_cuda(device: int, *rest: Any) -> FakeStorage:
        opened.append(device)
        return FakeStorage(BASE, 1 << 20)

    torch = SimpleNamespace(cuda=SimpleNamespace(device=lambda index: contextlib.nullcontext()),
                            UntypedStorage=SimpleNamespace(_new_shared_cuda=new_shared_cuda))
    backend = CudaBackend.__new__(CudaBackend)
    backend.torch = torch  # type: ignore[assignment]
    backend.uuids = [UUID_B, UUID_A]
    backend.pool = None
    backend.pinned = backend.pinned_on = None
    backend._pin_lock = __import__("threading").Lock()
    backend._cuda = None
    monkeypatch.setattr(backend, "_allocation_range", lambda ptr: (range_rc, BASE, 1 << 20))
    monkeypatch.setattr(cuda_backend.native, "cuda_host_register",
                        lambda addr, size, device=0: calls.append(("register", (addr, size, device))))
    monkeypatch.setattr(cuda_backend.native, "cuda_host_unregister",
                        lambda addr, device=0: calls.append(("unregister", (addr, device))))
    return backend, calls


def cuda_handle(uuid: str = UUID_A, nbytes: int = 1 << 20) -> bytes:
    return encode_handle(DeviceHandle(kind="cuda", device=0, device_uuid=uuid, ipc_handle=bytes(66),
                                      storage_bytes=nbytes, storage_offset=0, ref_counter="/torch_1_2_3",
                                      ref_counter_offset=0, event_handle=bytes(64), event_sync=True))


def test_map_refuses_when_the_driver_cannot_confirm_the_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, calls = fake_backend(monkeypatch, range_rc=1)
    backend.register_pool(0x1000_0000, 64 << 20)
    with pytest.raises(ValueError, match="cuMemGetAddressRange failed"):
        backend.map(cuda_handle(), 1 << 20, device=0)
    assert calls == []  # a refused mapping pins nothing


def test_pool_is_pinned_on_the_first_mapped_device_not_gpu0(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, calls = fake_backend(monkeypatch)
    pool = (0x1000_0000, 64 << 20)
    backend.register_pool(*pool)
    assert calls == []  # no context is created before an engine maps memory
    mapping = backend.map(cuda_handle(UUID_A), 1 << 20, device=0)
    assert mapping.device == 1  # UUID_A is the daemon's GPU 1
    assert calls == [("register", (*pool, 1))]
    backend.map(cuda_handle(UUID_B), 1 << 20, device=0)
    assert calls == [("register", (*pool, 1))]  # once: portable pinning serves every GPU
    backend.unmap(mapping)
    backend.unregister_pool(pool[0])
    assert calls[-1] == ("unregister", (pool[0], 1))


def test_a_failed_pinning_is_not_fatal_and_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _ = fake_backend(monkeypatch)
    attempts: list[int] = []

    def fail(addr: int, size: int, device: int = 0) -> None:
        attempts.append(device)
        raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY (2)")

    monkeypatch.setattr(cuda_backend.native, "cuda_host_register", fail)
    backend.register_pool(0x1000_0000, 64 << 20)
    backend.map(cuda_handle(), 1 << 20, device=0)
    backend.map(cuda_handle(), 1 << 20, device=0)
    assert attempts == [1] and backend.pinned is None


# -- sticky errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [700, 719, 702, 714, 715, 716, 717, 718, 226, 721, 810, 911])
def test_sticky_codes(code: int) -> None:
    assert native.is_sticky_cuda_error(code)


@pytest.mark.parametrize("code", [None, 0, 1, 2, 100, 201, 400, 701, 720, 801, 999])
def test_recoverable_codes(code: int | None) -> None:
    assert not native.is_sticky_cuda_error(code)


def raising(code: int | None) -> Any:
    def call(*args: Any) -> None:
        e = RuntimeError(f"cuMemcpyAsync failed at run 0: CUDA_ERROR_X ({code})")
        if code is not None:
            e.cuda_error = code  # type: ignore[attr-defined]  # what csrc/cuda_copy.cpp attaches
        raise e

    return call


def test_a_sticky_copy_error_raises_sticky_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_native", SimpleNamespace(cuda_copy_blocks=raising(700)))
    with pytest.raises(StickyDeviceError, match=r"\(700\).*sticky") as info:
        native.cuda_copy_blocks(0, 0, [0], [0], [1], "h2d", 3)
    assert (info.value.code, info.value.device) == (700, 3)
    assert isinstance(info.value, RuntimeError)  # callers catching RuntimeError still do


@pytest.mark.parametrize("code", [None, 0, 1, 801])
def test_other_copy_errors_stay_runtime_errors(monkeypatch: pytest.MonkeyPatch, code: int | None) -> None:
    monkeypatch.setattr(native, "_native", SimpleNamespace(cuda_copy_blocks=raising(code)))
    with pytest.raises(RuntimeError) as info:
        native.cuda_copy_blocks(0, 0, [0], [0], [1], "h2d", 0)
    assert not isinstance(info.value, StickyDeviceError)


def test_backend_copy_propagates_sticky_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_native", SimpleNamespace(cuda_copy_blocks=raising(719)))
    from array import array

    backend = CudaBackend.__new__(CudaBackend)
    plan = TransferPlan(array("Q", [0]), array("Q", [0]), array("Q", [4096]))
    with pytest.raises(StickyDeviceError) as info:
        backend.copy(2, 0x1000, plan, to_engine=True)
    assert info.value.code == 719 and info.value.device == 2


@pytest.mark.skipif(native.features()["cuda_available"], reason="checks the error without a driver")
def test_the_native_error_carries_the_driver_code() -> None:
    """Without a driver the failure is not a driver call's: code 0, not sticky."""
    with pytest.raises(RuntimeError, match="CUDA driver not available") as info:
        native.cuda_copy_blocks(BASE, 0x1000, [0], [0], [4096], "h2d", 0)
    assert getattr(info.value, "cuda_error", None) == 0
    assert not isinstance(info.value, StickyDeviceError)


# -- KVSTORE_CUDA_BATCH_MEMCPY ----------------------------------------------------------------------


def features_with(value: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_CUDA_BATCH_MEMCPY"}
    if value is not None:
        env["KVSTORE_CUDA_BATCH_MEMCPY"] = value
    code = ("import json; from kvstore_service import native; f = native.features(); "
            "print(json.dumps([f['cuda_batch_memcpy_allowed'], f['cuda_batch_memcpy'], f['cuda_available'], "
            "native.cuda_batch_memcpy_allowed()]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    allowed, batch, available, helper = __import__("json").loads(out.stdout)
    assert helper == allowed
    return {"allowed": allowed, "batch": batch, "available": available}


@pytest.mark.parametrize("value", ["0", "false", "OFF", "No"])
def test_batch_memcpy_switched_off(value: str) -> None:
    f = features_with(value)
    assert f["allowed"] is False and f["batch"] is False  # with or without a GPU


@pytest.mark.parametrize("value", [None, "1", "", "on", "yes"])
def test_batch_memcpy_on_by_default(value: str | None) -> None:
    f = features_with(value)
    assert f["allowed"] is True
    if not f["available"]:
        assert f["batch"] is False  # no driver, no batch copies; with one, its version decides


# -- build: the ABI check compiles against CUDA 12.0/12.1 headers ------------------------------------

# What cuda_copy.cpp may use from a CUDA 12.0/12.1 cuda.h outside its CUDA_VERSION guards, with the
# values of the real header. CU_MEM_LOCATION_TYPE_HOST (12.2) and the batch-copy types (12.8) are
# absent, as they are there.
CUDA_12_1_HEADER = """
#pragma once
#define CUDA_VERSION 12010
typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef enum cudaError_enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_SUPPORTED = 801 } CUresult;
typedef enum CUstream_flags_enum { CU_STREAM_DEFAULT = 0x0, CU_STREAM_NON_BLOCKING = 0x1 } CUstream_flags;
typedef enum CUevent_flags_enum { CU_EVENT_DEFAULT = 0x0, CU_EVENT_BLOCKING_SYNC = 0x1,
                                  CU_EVENT_DISABLE_TIMING = 0x2, CU_EVENT_INTERPROCESS = 0x4 } CUevent_flags;
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
typedef enum CUmemLocationType_enum { CU_MEM_LOCATION_TYPE_INVALID = 0x0, CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
                                      CU_MEM_LOCATION_TYPE_MAX = 0x7FFFFFFF } CUmemLocationType;
"""


def compile_cuda_copy(include: Path) -> subprocess.CompletedProcess[str]:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    return subprocess.run([cxx, "-std=c++17", "-fsyntax-only", "-DKVSTORE_CUDA_ABI_CHECK=1",
                           f"-I{ROOT / 'csrc'}", f"-I{include}", f"-I{sysconfig.get_paths()['include']}",
                           str(ROOT / "csrc" / "cuda_copy.cpp")], capture_output=True, text=True)


def test_abi_check_compiles_with_cuda_12_1_headers(tmp_path: Path) -> None:
    (tmp_path / "cuda.h").write_text(CUDA_12_1_HEADER)
    result = compile_cuda_copy(tmp_path)
    assert result.returncode == 0, result.stderr


def test_a_header_that_disagrees_with_our_driver_types_fails_the_build(tmp_path: Path) -> None:
    """The ABI check exists to stop a mismatched build: a wrong value is a compile error (and setup.py
    no longer retries without the check)."""
    (tmp_path / "cuda.h").write_text(CUDA_12_1_HEADER.replace("CU_STREAM_NON_BLOCKING = 0x1",
                                                              "CU_STREAM_NON_BLOCKING = 0x2"))
    result = compile_cuda_copy(tmp_path)
    assert result.returncode != 0 and "static assert" in result.stderr.replace("static_assert", "static assert")


def test_abi_check_passes_against_a_real_cuda_header() -> None:
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    include = next((Path(h) / "include" for h in homes if h and (Path(h) / "include" / "cuda.h").is_file()), None)
    if include is None:
        pytest.skip("no CUDA toolkit headers here")
    result = compile_cuda_copy(include)
    assert result.returncode == 0, result.stderr


# -- a fresh IPC export per registration --------------------------------------------------------------


def test_memory_spec_reexport() -> None:
    exports = iter([(b"second",), (b"third",)])
    spec = MemorySpec("cuda", (b"first",), (4096,), 1, ((0, 4096, 4096),), reexport=lambda: next(exports))
    assert spec.for_reregistration().handles == (b"second",)
    assert spec.for_reregistration().handles == (b"third",)
    assert spec.handles == (b"first",)  # frozen; the first handle is the one export_kv_memory made
    cpu = MemorySpec.cpu(3, 4096, 1, ((0, 4096, 4096),))
    assert cpu.for_reregistration() is cpu


class FakeChannel:
    slots = 8

    def close(self) -> None:
        pass


def registering_session(monkeypatch: pytest.MonkeyPatch, spec: MemorySpec,
                        fail_first_call: bool = False) -> tuple[Session, list[bytes]]:
    """A Session whose Register calls only record the handle they carry."""
    sent: list[bytes] = []
    failures = [fail_first_call]

    def registration(target: str, engine_id: str, namespace: str, memory: MemorySpec | None,
                     channel: object) -> object:
        assert memory is not None
        sent.append(b"+".join(memory.handles))
        return memory

    def call(method: object, request: object) -> object:
        if failures.pop() if failures else False:
            raise client_module.Unavailable("UNAVAILABLE: the daemon went away mid-call")
        return SimpleNamespace(session_id=os.urandom(16), block_bytes=4096, daemon_boot_id=b"boot")

    monkeypatch.setattr(client_module, "registration", registration)
    monkeypatch.setattr(client_module.CompletionChannel, "create", staticmethod(lambda slots: FakeChannel()))
    session = Session.__new__(Session)
    session.client = SimpleNamespace(target="unix:///nowhere", call=call,  # type: ignore[assignment]
                                     stub=SimpleNamespace(Register=None))
    session.namespace, session.memory, session.engine_id, session.slots = "ns", spec, "engine", 8
    session.channel, session.registrations, session._handle_sent = None, 0, False
    return session, sent


def test_every_reregistration_sends_a_fresh_export(monkeypatch: pytest.MonkeyPatch) -> None:
    exports: list[bytes] = []

    def export() -> tuple[bytes, ...]:
        exports.append(f"export-{len(exports) + 2}".encode())
        return (exports[-1],)

    spec = MemorySpec("cuda", (b"export-1",), (4096,), 1, ((0, 4096, 4096),), reexport=export)
    session, sent = registering_session(monkeypatch, spec)
    session._register()  # first registration: the handle export_kv_memory made
    session._register()  # the daemon restarted
    session._register()  # and again
    assert sent == [b"export-1", b"export-2", b"export-3"]
    assert len(set(sent)) == 3 and session.registrations == 3


def test_a_handle_that_may_have_reached_a_daemon_is_not_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    exports = iter([(b"export-2",)])
    spec = MemorySpec("cuda", (b"export-1",), (4096,), 1, ((0, 4096, 4096),), reexport=lambda: next(exports))
    session, sent = registering_session(monkeypatch, spec, fail_first_call=True)
    with pytest.raises(client_module.Unavailable):
        session._register()  # the Register call went out, the reply did not come back
    session._register()
    assert sent == [b"export-1", b"export-2"]


def test_a_failed_reexport_is_a_failed_registration_not_a_dead_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> tuple[bytes, ...]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    spec = MemorySpec("cuda", (b"export-1",), (4096,), 1, ((0, 4096, 4096),), reexport=broken)
    session, sent = registering_session(monkeypatch, spec)
    session._register()
    with pytest.raises(FailedPrecondition, match="cannot export the KV memory again"):
        session._register()
    assert sent == [b"export-1"]


def test_export_kv_memory_hooks_a_fresh_share_per_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    """export_kv_memory exports every allocation (here a K and a V tensor), and its reexport calls
    `_share_cuda_()` again for each (a new torch ref counter each time)."""
    torch = pytest.importorskip("torch")
    from kvstore_client import device as device_module

    shares: list[int] = []

    class Storage:
        def __init__(self, base: int) -> None:
            self.base = base

        def data_ptr(self) -> int:
            return self.base

        def nbytes(self) -> int:
            return 8192

        def _share_cuda_(self) -> tuple[Any, ...]:
            shares.append(self.base)
            return (0, b"\x01" * 66, 8192, 0, f"/torch_1_2_{len(shares)}".encode(), len(shares), bytes(64), True)

    storages = [Storage(BASE), Storage(BASE + (1 << 21))]
    k, v = (SimpleNamespace(device=torch.device("cuda", 0), untyped_storage=lambda s=s: s) for s in storages)
    monkeypatch.setattr(device_module, "synchronize_before_store", lambda device: None)
    monkeypatch.setattr(device_module, "cuda_device_uuid", lambda index: UUID_A)
    regions = [(0, 4096, 4096, 0), (0, 4096, 4096, 1)]
    spec = device_module.export_kv_memory([k, v], 2, regions)  # type: ignore[list-item]
    assert shares == [BASE, BASE + (1 << 21)] and spec.reexport is not None
    assert len(spec.handles) == 2 and spec.sizes == (8192, 8192)
    again = spec.for_reregistration()
    assert len(shares) == 4 and set(again.handles).isdisjoint(spec.handles)
    assert (again.sizes, again.num_blocks, again.regions, again.device) == (spec.sizes, spec.num_blocks,
                                                                            spec.regions, spec.device)
