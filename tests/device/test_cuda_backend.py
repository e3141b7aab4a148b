"""CUDA backend decisions that need no GPU: bounds fail closed, the pool is pinned on the first
mapped device (or at start) in segment-sized pieces, sticky driver errors are told apart, the
batch-copy switch, the build against pre-12.2 headers, a fresh IPC export per registration, and the
copies' ordering on the engine's IPC event. The last two parts run the real native engine against a
fake libcuda.so.1 that logs every driver call (host memory stands in for device memory): they show
which calls are made and in which order, not how a real driver answers. The driver itself is
covered by the GPU tests in tests/device/test_device_backends.py and tests/unit/test_native_copy.py."""

from __future__ import annotations

import contextlib
import json
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
from kvstore_service import native, native_device
from kvstore_service.backends import cuda as cuda_backend
from kvstore_service.backends.base import Mapping, TransferPlan, pool_pieces
from kvstore_service.backends.cuda import CudaBackend, Held, StickyDeviceError, check_ipc_bounds
from kvstore_service.errors import KVError

ROOT = Path(__file__).resolve().parents[2]
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
    monkeypatch.setattr(cuda_backend, "require_cuda", lambda: torch)
    monkeypatch.setattr(cuda_backend, "local_cuda_uuids", lambda: [UUID_B, UUID_A])
    backend = CudaBackend()
    monkeypatch.setattr(backend, "_allocation_range", lambda ptr: (range_rc, BASE, 1 << 20))
    monkeypatch.setattr(cuda_backend.native_device, "cuda_host_register",
                        lambda addr, size, device=0: calls.append(("register", (addr, size, device))))
    monkeypatch.setattr(cuda_backend.native_device, "cuda_host_unregister",
                        lambda addr, device=0: calls.append(("unregister", (addr, device))))
    return backend, calls


def cuda_handle(uuid: str = UUID_A, nbytes: int = 1 << 20) -> bytes:
    return encode_handle(DeviceHandle(kind="cuda", device=0, device_uuid=uuid, ipc_handle=bytes(66),
                                      storage_bytes=nbytes, storage_offset=0, ref_counter="/torch_1_2_3",
                                      ref_counter_offset=0, event_handle=bytes(64), event_sync=True))


POOL_PIECES = pool_pieces(0x1000_0000, 2 << 20, 64 << 20, 3)  # 3 segments of 64 MiB after a 2 MiB header


def test_map_refuses_when_the_driver_cannot_confirm_the_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, calls = fake_backend(monkeypatch, range_rc=1)
    backend.register_pool(POOL_PIECES)
    with pytest.raises(ValueError, match="cuMemGetAddressRange failed"):
        backend.map(cuda_handle(), 1 << 20, device=0)
    assert calls == []  # a refused mapping pins nothing


def test_pool_is_pinned_on_the_first_mapped_device_not_gpu0(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, calls = fake_backend(monkeypatch)
    backend.register_pool(POOL_PIECES)
    assert calls == []  # no context is created before an engine maps memory
    mapping = backend.map(cuda_handle(UUID_A), 1 << 20, device=0)
    assert mapping.device == 1  # UUID_A is the daemon's GPU 1
    pinned = [("register", (addr, size, 1)) for addr, size in POOL_PIECES]
    assert calls == pinned  # piece by piece, on GPU 1
    backend.map(cuda_handle(UUID_B), 1 << 20, device=0)
    assert calls == pinned  # once: portable pinning serves every GPU
    backend.unmap(mapping)
    backend.unregister_pool()
    assert calls[len(pinned):] == [("unregister", (addr, 1)) for addr, _ in POOL_PIECES]
    backend.unregister_pool()
    assert len(calls) == 2 * len(pinned)  # nothing is unpinned twice


def test_pool_pinned_at_start_on_the_given_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """--devices cuda: the pool is pinned when the backend is opened, before any engine registers."""
    backend, calls = fake_backend(monkeypatch)
    backend.register_pool(POOL_PIECES, device=0)
    assert calls == [("register", (addr, size, 0)) for addr, size in POOL_PIECES]
    backend.map(cuda_handle(UUID_A), 1 << 20, device=0)
    assert len(calls) == len(POOL_PIECES)  # the first mapping does not pin again


def test_pool_pieces_are_whole_segments_covering_the_pool() -> None:
    base, header, segment, segments = 0x7000_0000, 2 << 20, 64 << 20, 5
    pieces = pool_pieces(base, header, segment, segments)
    assert pieces == [(base + header + i * segment, segment) for i in range(segments)]
    # A segment size that is not a multiple of the 4 KiB page: pieces of whole segments, page-aligned.
    segment = (1 << 20) + 256
    pieces = pool_pieces(base, header, segment, 37)
    assert all(addr % 4096 == 0 and (addr - base - header) % segment == 0 for addr, _ in pieces)
    assert all(size % 4096 == 0 for _, size in pieces[:-1])
    ends = [base + header] + [addr + size for addr, size in pieces]
    assert [addr for addr, _ in pieces] == ends[:-1]  # contiguous, no overlap
    assert ends[-1] == base + header + 37 * segment  # the last segment's end


def test_a_failed_pinning_unpins_its_pieces_is_not_fatal_and_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, calls = fake_backend(monkeypatch)
    attempts: list[int] = []

    def fail_third(addr: int, size: int, device: int = 0) -> None:
        attempts.append(addr)
        if len(attempts) == 3:
            raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY (2)")

    monkeypatch.setattr(cuda_backend.native_device, "cuda_host_register", fail_third)
    pieces = pool_pieces(0x1000_0000, 2 << 20, 64 << 20, 4)
    backend.register_pool(pieces)
    backend.map(cuda_handle(), 1 << 20, device=0)
    backend.map(cuda_handle(), 1 << 20, device=0)
    assert attempts == [addr for addr, _ in pieces[:3]]  # stopped at the failure, never retried
    assert calls == [("unregister", (addr, 1)) for addr, _ in pieces[:2]]  # all or none
    assert backend.pinned == [] and backend.pinned_on is None
    backend.unregister_pool()
    assert len(calls) == 2


def test_a_failed_pinning_refuses_every_mapping_when_the_copy_kernel_reads_the_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """KVSTORE_CUDA_COPY_KERNEL: the kernel dereferences the pool's mapped addresses; unpinned, it would
    fault the GPU (a sticky error: the daemon exits), so the engines are refused, saying why."""
    backend, calls = fake_backend(monkeypatch)
    monkeypatch.setattr(cuda_backend.native, "features", lambda: {"cuda_copy_kernel": True})

    def fail(addr: int, size: int, device: int = 0) -> None:
        calls.append(("register", addr))
        raise RuntimeError("cuMemHostRegister failed: CUDA_ERROR_OUT_OF_MEMORY (2)")

    monkeypatch.setattr(cuda_backend.native_device, "cuda_host_register", fail)
    backend.register_pool(POOL_PIECES)
    for _ in range(2):
        with pytest.raises(KVError, match="KVSTORE_CUDA_COPY_KERNEL is set, but the pool could not be pinned .*"
                                          "piece 1 of 3: cuMemHostRegister failed") as refused:
            backend.map(cuda_handle(), 1 << 20, device=0)
        assert refused.value.code == "FAILED_PRECONDITION"
    assert calls == [("register", POOL_PIECES[0][0])]  # tried once


def test_a_sticky_error_while_pinning_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    backend, _ = fake_backend(monkeypatch)

    def sticky(addr: int, size: int, device: int = 0) -> None:
        raise StickyDeviceError("cuMemHostRegister failed (700)", 700, device)

    monkeypatch.setattr(cuda_backend.native_device, "cuda_host_register", sticky)
    with pytest.raises(StickyDeviceError):
        backend.register_pool(POOL_PIECES, device=0)


def test_open_backend_turns_a_sticky_pinning_error_into_a_refusal(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """At the daemon's start (--devices cuda) a device that fails stickily while pinning is unusable."""
    from kvstore_service import sessions
    from kvstore_service.errors import KVError
    from kvstore_service.pool import Pool

    class Broken(CudaBackend):
        def __init__(self) -> None:
            self.seen: list[Any] = []

        def register_pool(self, pieces: Any, device: int | None = None) -> None:
            self.seen.append((list(pieces), device))
            if device is not None:
                raise StickyDeviceError("cuMemHostRegister failed (700)", 700, device)

    made: list[Broken] = []
    monkeypatch.setattr(sessions, "make_backend", lambda name: made.append(Broken()) or made[-1])
    pool = Pool(str(tmp_path / "pool"), 4 << 20, 1 << 20, fresh=True)
    with pytest.raises(KVError, match="backend 'cuda' is not usable here.*700"):
        sessions.open_backend("cuda", pool)
    lazy = sessions.open_backend("cuda", pool, pin_now=False)
    pieces = pool_pieces(pool.base, pool.data_offset, pool.segment_size, len(pool.segments))
    assert [b.seen for b in made] == [[(pieces, 0)], [(pieces, None)]] and lazy is made[1]


# -- sticky errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [700, 719, 702, 714, 715, 716, 717, 718, 226, 721, 810, 911])
def test_sticky_codes(code: int) -> None:
    assert native_device.is_sticky_cuda_error(code)


@pytest.mark.parametrize("code", [None, 0, 1, 2, 100, 201, 400, 701, 720, 801, 999])
def test_recoverable_codes(code: int | None) -> None:
    assert not native_device.is_sticky_cuda_error(code)


def raising(code: int | None) -> Any:
    def call(*args: Any, **kwargs: Any) -> None:
        e = RuntimeError(f"cuMemcpyAsync failed at run 0: CUDA_ERROR_X ({code})")
        if code is not None:
            e.cuda_error = code  # type: ignore[attr-defined]  # what csrc/cuda_copy.cpp attaches
        raise e

    return call


def test_a_sticky_copy_error_raises_sticky_device_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_device, "_native", SimpleNamespace(cuda_copy_blocks=raising(700)))
    with pytest.raises(StickyDeviceError, match=r"\(700\).*sticky") as info:
        native_device.cuda_copy_blocks(0, 0, [0], [0], [1], "h2d", 3)
    assert (info.value.code, info.value.device) == (700, 3)
    assert isinstance(info.value, RuntimeError)  # callers catching RuntimeError still do


@pytest.mark.parametrize("code", [None, 0, 1, 801])
def test_other_copy_errors_stay_runtime_errors(monkeypatch: pytest.MonkeyPatch, code: int | None) -> None:
    monkeypatch.setattr(native_device, "_native", SimpleNamespace(cuda_copy_blocks=raising(code)))
    with pytest.raises(RuntimeError) as info:
        native_device.cuda_copy_blocks(0, 0, [0], [0], [1], "h2d", 0)
    assert not isinstance(info.value, StickyDeviceError)


def test_backend_copy_propagates_sticky_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_device, "_native", SimpleNamespace(cuda_transfer=raising(719)))
    backend = CudaBackend.__new__(CudaBackend)
    plan = TransferPlan(native.runs_of([0], [0], [4096]))
    with pytest.raises(StickyDeviceError) as info:
        backend.copy(Mapping(BASE, 4096, device=2, handle=Held(None, 0, None)), 0x1000, plan, to_engine=True)
    assert info.value.code == 719 and info.value.device == 2


@pytest.mark.skipif(native.features()["cuda_available"], reason="checks the error without a driver")
def test_the_native_error_carries_the_driver_code() -> None:
    """Without a driver the failure is not a driver call's: code 0, not sticky."""
    with pytest.raises(RuntimeError, match="CUDA driver not available") as info:
        native_device.cuda_copy_blocks(BASE, 0x1000, [0], [0], [4096], "h2d", 0)
    assert getattr(info.value, "cuda_error", None) == 0
    assert not isinstance(info.value, StickyDeviceError)


# -- KVSTORE_CUDA_BATCH_MEMCPY ----------------------------------------------------------------------


def features_with(value: str | None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_CUDA_BATCH_MEMCPY"}
    if value is not None:
        env["KVSTORE_CUDA_BATCH_MEMCPY"] = value
    code = ("import json; from kvstore_service import native, native_device; f = native.features(); "
            "print(json.dumps([f['cuda_batch_memcpy_allowed'], f['cuda_batch_memcpy'], f['cuda_available'], "
            "native_device.cuda_batch_memcpy_allowed()]))")
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
typedef enum cudaError_enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_READY = 600, CUDA_ERROR_NOT_SUPPORTED = 801 } CUresult;
typedef enum CUstream_flags_enum { CU_STREAM_DEFAULT = 0x0, CU_STREAM_NON_BLOCKING = 0x1 } CUstream_flags;
typedef enum CUevent_flags_enum { CU_EVENT_DEFAULT = 0x0, CU_EVENT_BLOCKING_SYNC = 0x1,
                                  CU_EVENT_DISABLE_TIMING = 0x2, CU_EVENT_INTERPROCESS = 0x4 } CUevent_flags;
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x02
typedef enum CUdevice_attribute_enum {
  CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91
} CUdevice_attribute;
#define CU_IPC_HANDLE_SIZE 64
typedef struct CUipcEventHandle_st { char reserved[CU_IPC_HANDLE_SIZE]; } CUipcEventHandle_v1;
typedef CUipcEventHandle_v1 CUipcEventHandle;
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
        return SimpleNamespace(session_id=os.urandom(16), block_bytes=4096, daemon_boot_id=b"boot",
                               progress_load_bytes=0)

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
    monkeypatch.setattr(device_module, "cuda_order_event_handle", lambda index: b"\x0e" * 64)
    regions = [(0, 4096, 4096, 0), (0, 4096, 4096, 1)]
    spec = device_module.export_kv_memory([k, v], 2, regions)  # type: ignore[list-item]
    assert shares == [BASE, BASE + (1 << 21)] and spec.reexport is not None
    assert len(spec.handles) == 2 and spec.sizes == (8192, 8192)
    again = spec.for_reregistration()
    assert len(shares) == 4 and set(again.handles).isdisjoint(spec.handles)
    # Every handle, first and re-exported, carries the one ordering event of the device.
    from kvstore_client.protocol.handle import decode_handle

    assert {decode_handle(h).order_event for h in spec.handles + again.handles} == {b"\x0e" * 64}
    assert (again.sizes, again.num_blocks, again.regions, again.device) == (spec.sizes, spec.num_blocks,
                                                                            spec.regions, spec.device)


# -- engine side: record, do not synchronize --------------------------------------------------------


def test_order_before_copies_records_the_event_without_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    from kvstore_client import device as device_module

    recorded: list[tuple[int, object]] = []

    class Event:
        def __init__(self, index: int) -> None:
            self.index = index

        def record(self, stream: object) -> None:
            recorded.append((self.index, stream))

    def no_sync(*args: Any) -> None:
        raise AssertionError("a host-side synchronize on the engine's critical path")

    made = iter(range(100))
    monkeypatch.setattr(torch.cuda, "Event", lambda interprocess: Event(next(made)) if interprocess else None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: f"stream-{index}")
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    monkeypatch.setattr(device_module, "_order_events", {})
    ring = device_module.order_events(1)
    assert len(ring) == device_module.ORDER_EVENTS and len(set(map(id, ring))) == len(ring)
    for _ in range(device_module.ORDER_EVENTS + 2):
        device_module.order_before_copies("cuda:1")
    device_module.order_before_copies("cpu")  # nothing to order
    # Round robin over the device's ring, every record on the current stream, no host wait.
    assert [e for e, _ in recorded] == [e.index for e in ring] + [ring[0].index, ring[1].index]
    assert {stream for _, stream in recorded} == {"stream-1"}


def test_order_before_copies_numbers_its_records_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The number a job carries (order_seq) counts the records on its device from 1, each device on
    its own; the daemon finds the record's event as (seq - 1) % ring length. CPU: 0."""
    torch = pytest.importorskip("torch")
    from kvstore_client import device as device_module

    recorded: list[tuple[int, int]] = []  # (device, ring position)

    class Event:
        def __init__(self, device: int, position: int) -> None:
            self.where = (device, position)

        def record(self, stream: object) -> None:
            recorded.append(self.where)

    n = device_module.ORDER_EVENTS
    made = iter(range(100))  # rings made in the order below: device 0's events, then device 1's
    monkeypatch.setattr(torch.cuda, "Event", lambda interprocess: Event(*divmod(next(made), n)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: f"stream-{index}")
    monkeypatch.setattr(device_module, "_order_events", {})
    monkeypatch.setattr(device_module, "_order_count", {})
    device_module.order_events(0), device_module.order_events(1)
    on_1 = [device_module.order_before_copies("cuda:1") for _ in range(n + 2)]
    on_0 = [device_module.order_before_copies(torch.device("cuda", 0)) for _ in range(3)]
    assert on_1 == list(range(1, n + 3)) and on_0 == [1, 2, 3]
    assert device_module.order_before_copies("cpu") == 0  # (NPU: a host sync, then 0 too)
    # Each record is on the event its number names.
    assert recorded == [(1, (seq - 1) % n) for seq in on_1] + [(0, (seq - 1) % n) for seq in on_0]


# -- the native engine against a fake driver: ordering on the engine's event, pinning in pieces ------

FAKE_LIBCUDA = r"""
// Fake libcuda.so.1: "device" memory is host memory; every call the copy path makes is logged.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long U;
struct CUipcEventHandle { char reserved[64]; };
static std::string g_log;
static long g_streams = 0, g_events = 0, g_registers = 0, g_opens = 0;
static void* g_ctx = nullptr;
static long knob(const char* name) { const char* v = getenv(name); return v ? atol(v) : 0; }
static void note(const char* fmt, U a = 0, U b = 0, U c = 0, U d = 0) {
  char line[200];
  snprintf(line, sizeof line, fmt, a, b, c, d);
  g_log += line;
  g_log += "\n";
}
#define P(x) ((U)(uintptr_t)(x))
static CUresult device_count(int* n) { *n = 2; return 0; }
static CUresult device_get(int* d, int i) { *d = i; return 0; }
static CUresult retain(void** c, int d) { *c = (void*)(uintptr_t)(0x10 + d); return 0; }
static CUresult ctx_get(void** c) { *c = g_ctx; return 0; }
static CUresult ctx_set(void* c) { g_ctx = c; return 0; }
static CUresult stream_create(void** s, unsigned) { *s = (void*)(uintptr_t)(0x100 + ++g_streams); return 0; }
static CUresult event_create(void** e, unsigned) { *e = (void*)(uintptr_t)(0x200 + ++g_events); return 0; }
static CUresult event_record(void* e, void* s) { note("record %#llx %#llx", P(e), P(s)); return 0; }
static CUresult event_sync(void* e) { note("sync %#llx", P(e)); return 0; }
static CUresult event_destroy(void* e) { note("destroy %#llx ctx=%#llx", P(e), P(g_ctx)); return 0; }
static CUresult ipc_open(void** e, CUipcEventHandle h) {
  *e = (void*)(uintptr_t)(0x300 + (unsigned char)h.reserved[0]);
  note("open %#llx ctx=%#llx", P(*e), P(g_ctx));
  if (++g_opens == knob("FAKE_OPEN_FAIL_AT")) return 201;
  return (CUresult)knob("FAKE_OPEN_RC");
}
static CUresult event_query(void* e) {  // FAKE_QUERY_RC: 0 done, 600 not ready, other: an error
  note("query %#llx ctx=%#llx", P(e), P(g_ctx));
  const char* later = getenv("FAKE_PENDING_EVENT");  // this event (e.g. 0x31a) is not ready, whatever the rc
  if (later && P(e) == strtoull(later, nullptr, 0)) return 600;
  return (CUresult)knob("FAKE_QUERY_RC");
}
static CUresult memcpy_async(CUdeviceptr d, CUdeviceptr s, size_t n, void* st) {
  memcpy((void*)d, (const void*)s, n);
  note("copy %#llx", P(st));
  return 0;
}
static CUresult batch(CUdeviceptr* d, CUdeviceptr* s, size_t* n, size_t count, void*, size_t*, size_t, size_t*,
                      void* st) {
  for (size_t i = 0; i < count; ++i) memcpy((void*)d[i], (const void*)s[i], n[i]);
  note("copy %#llx", P(st));
  return 0;
}
static CUresult host_register(void* p, size_t n, unsigned flags) {
  note("register %#llx %llu flags=%llu ctx=%#llx", P(p), n, flags, P(g_ctx));
  return ++g_registers == knob("FAKE_REGISTER_FAIL_AT") ? 2 : 0;
}
static CUresult host_unregister(void* p) { note("unregister %#llx", P(p)); return 0; }
// The copy kernel's calls (KVSTORE_CUDA_COPY_KERNEL): a launch runs the table's copies on the host.
static CUresult attribute(int* v, int attr, int dev) {
  note("attribute %llu device=%llu", (U)attr, (U)dev);
  *v = attr == 91 && !knob("FAKE_NO_HOST_POINTERS");
  return 0;
}
static long g_modules = 0;
static CUresult module_load(void** m, const void* image) {
  bool ours = strstr((const char*)image, ".entry kvstore_copy_runs") != nullptr;
  note("module ours=%llu ctx=%#llx", (U)ours, P(g_ctx));
  *m = (void*)0x400;
  if (++g_modules <= knob("FAKE_MODULE_OOM_TIMES")) return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  return (CUresult)knob("FAKE_MODULE_RC");
}
static CUresult module_function(void** f, void* m, const char* name) {
  *f = (void*)0x500;
  note("function %#llx", P(m));
  if (knob("FAKE_FUNCTION_RC")) return (CUresult)knob("FAKE_FUNCTION_RC");
  return strcmp(name, "kvstore_copy_runs") == 0 ? 0 : 500;
}
static CUresult module_unload(void* m) { note("unload %#llx", P(m)); return 0; }
static CUresult mem_alloc(CUdeviceptr* p, size_t n) { *p = P(malloc(n)); note("alloc %llu", n); return 0; }
static CUresult mem_free(CUdeviceptr p) { free((void*)p); note("free"); return 0; }
static CUresult htod(CUdeviceptr d, const void* s, size_t n, void* st) {
  memcpy((void*)d, s, n);
  note("htod %llu %#llx", n, P(st));
  return 0;
}
static CUresult launch(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared, void* st, void** params, void** extra) {
  const U* runs = (const U*)*(CUdeviceptr*)params[0];
  U n = *(U*)params[1];
  for (U r = 0; r < n; ++r) memcpy((void*)runs[3 * r + 1], (const void*)runs[3 * r], runs[3 * r + 2]);
  note("launch %#llx blocks=%llu threads=%llu runs=%llu", P(st), (U)gx, (U)bx, n);
  return f == (void*)0x500 && gy == 1 && gz == 1 && by == 1 && bz == 1 && shared == 0 && extra == nullptr ? 0 : 1;
}
extern "C" {
__attribute__((visibility("default"))) const char* fake_log() { return g_log.c_str(); }
CUresult cuInit(unsigned) { return 0; }
CUresult cuDriverGetVersion(int* v) {
  *v = knob("FAKE_CUDA_VERSION") ? (int)knob("FAKE_CUDA_VERSION") : 12040;
  return 0;
}
CUresult cuGetErrorName(CUresult, const char** s) { *s = "CUDA_ERROR_FAKE"; return 0; }
CUresult cuGetErrorString(CUresult, const char** s) { *s = "fake"; return 0; }
CUresult cuGetProcAddress_v2(const char* name, void** fn, int, unsigned long long, int* status) {
  struct { const char* name; void* fn; } table[] = {
      {"cuDeviceGetCount", (void*)device_count}, {"cuDeviceGet", (void*)device_get},
      {"cuDevicePrimaryCtxRetain", (void*)retain}, {"cuCtxGetCurrent", (void*)ctx_get},
      {"cuCtxSetCurrent", (void*)ctx_set}, {"cuStreamCreate", (void*)stream_create},
      {"cuEventCreate", (void*)event_create}, {"cuEventRecord", (void*)event_record},
      {"cuEventSynchronize", (void*)event_sync}, {"cuEventDestroy", (void*)event_destroy},
      {"cuIpcOpenEventHandle", (void*)ipc_open}, {"cuEventQuery", (void*)event_query},
      {"cuMemcpyAsync", (void*)memcpy_async}, {"cuMemcpyBatchAsync", (void*)batch},
      {"cuMemHostRegister", (void*)host_register}, {"cuMemHostUnregister", (void*)host_unregister},
      {"cuDeviceGetAttribute", (void*)attribute}, {"cuModuleLoadData", (void*)module_load},
      {"cuModuleGetFunction", (void*)module_function}, {"cuModuleUnload", (void*)module_unload},
      {"cuLaunchKernel", (void*)launch},
      {"cuMemAlloc", (void*)mem_alloc}, {"cuMemFree", (void*)mem_free}, {"cuMemcpyHtoDAsync", (void*)htod},
  };
  for (auto& t : table) {
    if (strcmp(t.name, name) == 0) { *fn = t.fn; *status = 0; return 0; }
  }
  *fn = nullptr;
  *status = 1;
  return 500;
}
}
"""

# Runs in a child process (the driver is loaded once per process) with the fake first on the library
# path. A daemon-side CudaBackend (torch faked: each engine's "GPU memory" is a host buffer) opens the
# pool at start (--devices cuda), maps three sessions' memory, copies, unmaps and closes; every step
# reports the driver calls it made.
SCENARIO = r"""
import contextlib, ctypes, json, sys
from array import array
from types import SimpleNamespace
from kvstore_client.protocol.handle import DeviceHandle, encode_handle
from kvstore_service import native, sessions
from kvstore_service.backends import cuda
from kvstore_service.backends.base import ChecksumSample, TransferPlan
from kvstore_service.pool import Pool

lib = ctypes.CDLL("libcuda.so.1")
lib.fake_log.restype = ctypes.c_char_p
seen = [0]
def calls():
    lines = lib.fake_log().decode().splitlines()
    new, seen[0] = lines[seen[0]:], len(lines)
    return new

BLOCK = 4096
engines = {n: ctypes.create_string_buffer(bytes([n]) * 8 * BLOCK) for n in (1, 2, 3)}
engines[1] = ctypes.create_string_buffer(bytes([1]) * 80 * BLOCK)  # (mapped: its first 8 blocks; "store long")

class Storage:
    def __init__(self, buf):
        self.buf = buf
    def data_ptr(self):
        return ctypes.addressof(self.buf)
    def nbytes(self):
        return len(self.buf)

def new_shared_cuda(device, ipc, *rest):
    return Storage(engines[ipc[0]])

torch = SimpleNamespace(cuda=SimpleNamespace(device=lambda i: contextlib.nullcontext()),
                        UntypedStorage=SimpleNamespace(_new_shared_cuda=new_shared_cuda))
cuda.require_cuda = lambda: torch
cuda.local_cuda_uuids = lambda: ["uuid-b", "uuid-a"]  # the engine's GPU is the daemon's GPU 1

def handle(engine, event):
    return encode_handle(DeviceHandle(kind="cuda", device=0, device_uuid="uuid-a", ipc_handle=bytes([engine]) * 66,
                                      storage_bytes=8 * BLOCK, storage_offset=0, ref_counter="/torch_1_2_3",
                                      ref_counter_offset=0, event_handle=bytes(64), event_sync=True,
                                      order_event=event))

out, steps = {}, []
def step(name, fn, *args):
    try:
        result = fn(*args)
        error = None
    except Exception as e:
        result, error = None, f"{type(e).__name__}: {e}"
    steps.append({"step": name, "calls": calls(), "error": error})
    return result

pool = Pool(sys.argv[1], 4 << 20, 1 << 20, fresh=True)
out["pool"] = [pool.base, pool.data_offset, pool.size]
backend = step("open", sessions.open_backend, "cuda", pool)  # pinned now, on GPU 0
backend._allocation_range = lambda ptr: (0, ptr, 8 * BLOCK)
out["pinned"] = backend.pinned
RING_A = b"\x0a" * 64 + b"\x1a" * 64  # engine a's ring of two events
a1 = step("map a1", backend.map, handle(1, RING_A), 8 * BLOCK, 0)
a2 = step("map a2", backend.map, handle(1, RING_A), 8 * BLOCK, 0)  # the same engine again
b = step("map b", backend.map, handle(2, b"\x0b" * 64), 8 * BLOCK, 0)
c = step("map c", backend.map, handle(3, b""), 8 * BLOCK, 0)  # version 1: an older client
slot = pool.data_offset + 1024
slots = array("Q", [slot, slot + 2 * BLOCK])
def at(mapping, blocks):
    return TransferPlan(native.runs_of(slots, [mapping.base + i * BLOCK for i in blocks], [BLOCK, BLOCK]))
if a1 is not None:
    out["pending"] = step("pending a", backend.order_pending, a1)
    out["waiting"] = step("waiting a", backend.order_waiting, a1, out["pending"] or [])
    for seq in (1, 2, 3):  # jobs naming their own record: event (seq - 1) % 2 of a's ring
        out[f"pending a seq {seq}"] = step(f"pending a seq {seq}", backend.order_pending, a1, seq)
    step("store a", backend.copy, a1, pool.base, at(a1, [0, 2]), False)
if a1 is not None:  # 16 MiB of runs: spread over several streams
    wide = TransferPlan(native.runs_of([slot] * 4096, [a1.base] * 4096, [BLOCK] * 4096))
    step("store wide", backend.copy, a1, pool.base, wide, False)
    long = TransferPlan(native.runs_of([slot], [a1.base], [80 * BLOCK]))  # one 320 KiB run
    step("store long", backend.copy, a1, pool.base, long, False)
    out["stored long"] = ctypes.string_at(pool.base + slot, 80 * BLOCK) == bytes([1]) * 80 * BLOCK
if b is not None:
    step("load b", backend.copy, b, pool.base, at(b, [5, 7]), True)
    out["loaded"] = [engines[2].raw[i * BLOCK:(i + 1) * BLOCK] == bytes([1]) * BLOCK for i in range(8)]
    # A load's checksum sample, taken as it copies: its second block's expected sum is wrong.
    good = native.crc32c(bytes([1]) * BLOCK)
    check = ChecksumSample(array("Q", [0, 1]), slots, BLOCK, array("Q", [good, good ^ 1]))
    out["corrupt"] = step("load b checked", backend.transfer, b, pool.base, at(b, [4, 6]), True, check)
    out["loaded checked"] = [engines[2].raw[i * BLOCK:(i + 1) * BLOCK] == bytes([1]) * BLOCK for i in range(8)]
if c is not None:
    out["pending c"] = step("pending c", backend.order_pending, c)
    out["pending c seq 1"] = step("pending c seq 1", backend.order_pending, c, 1)
    step("store c", backend.copy, c, pool.base, at(c, [1, 3]), False)
for name, mapping in (("unmap a1", a1), ("unmap a2", a2), ("unmap b", b), ("unmap c", c)):
    if mapping is not None:
        step(name, backend.unmap, mapping)
out["events_left"] = len(backend.events)
step("close", backend.unregister_pool)
out["steps"] = steps
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    d = tmp_path_factory.mktemp("fake_libcuda")
    (d / "fake.cpp").write_text(FAKE_LIBCUDA)
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-O0", str(d / "fake.cpp"), "-o", str(d / "libcuda.so.1")],
                   check=True)
    return d


def run_scenario(lib_dir: Path, tmp_path: Path, **env: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path / "pool")],
                          env={**os.environ, "LD_LIBRARY_PATH": str(lib_dir), **env},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    out["by_step"] = {s["step"]: s for s in out["steps"]}
    out["stderr"] = proc.stderr
    return out


def words(lines: list[str]) -> list[list[str]]:
    return [line.split() for line in lines]


@pytest.mark.parametrize("version", ["12040", "12080"])  # cuMemcpyAsync per run; cuMemcpyBatchAsync
def test_copies_never_wait_on_the_engines_event_on_the_gpu(fake_libcuda: Path, tmp_path: Path, version: str) -> None:
    """The copy itself touches no engine event (no daemon stream may wait on one: it would never end if
    the engine died); it enqueues the runs on its own stream and waits for them on its own event."""
    out = run_scenario(fake_libcuda, tmp_path, FAKE_CUDA_VERSION=version)
    steps = out["by_step"]
    assert all(s["error"] is None for s in out["steps"]), out["steps"]
    for name in ("store a", "load b", "store c"):  # d2h and h2d, with and without events
        calls = words(steps[name]["calls"])
        assert {c[0] for c in calls} == {"copy", "record", "sync"}, calls
        stream = calls[0][1]
        assert [c[0] for c in calls[-2:]] == ["record", "sync"] and calls[-2][2] == stream
    assert out["loaded"] == [False] * 5 + [True, False, True]  # the load moved a's bytes into b's blocks 5 and 7


def test_a_loads_checksum_sample_is_taken_while_it_copies(fake_libcuda: Path, tmp_path: Path) -> None:
    """A chunk of a load with a checksum sample is one copy (copies enqueued, then the wait on its
    own event): the sample is checksummed in between, the corrupt block named; its bytes land all
    the same (the engine reads none before the job's completion, which fails that block)."""
    out = run_scenario(fake_libcuda, tmp_path)
    step = out["by_step"]["load b checked"]
    assert step["error"] is None
    assert [c[0] for c in words(step["calls"])][-2:] == ["record", "sync"]
    assert {c[0] for c in words(step["calls"])} == {"copy", "record", "sync"}
    assert out["corrupt"] == [1]
    assert out["loaded checked"] == [False] * 4 + [True, True, True, True]


@pytest.mark.parametrize("rc,pending", [("0", []), ("600", ["0x30a", "0x31a"])])
def test_the_engines_records_are_queried_from_the_host(fake_libcuda: Path, tmp_path: Path, rc: str,
                                                      pending: list[str]) -> None:
    """order_pending asks every event of the session's ring (cuEventQuery, in the copies' context of
    GPU 1) and returns those not done; order_waiting asks again about those only."""
    out = run_scenario(fake_libcuda, tmp_path, FAKE_QUERY_RC=rc)
    steps = out["by_step"]
    assert steps["pending a"]["calls"] == ["query 0x30a ctx=0x11", "query 0x31a ctx=0x11"]
    assert [hex(e) for e in out["pending"]] == pending
    assert steps["waiting a"]["calls"] == [f"query {e} ctx=0x11" for e in pending]
    assert [hex(e) for e in out["waiting"]] == pending
    # A version-1 handle (an older client) has no event: nothing to ask, nothing pending.
    assert steps["pending c"]["calls"] == [] and out["pending c"] == []


def test_a_job_with_its_sequence_number_waits_for_its_own_record_only(fake_libcuda: Path, tmp_path: Path) -> None:
    """Engine a's ring has two events; its second (0x31a, record 2: the next step's, made after the job)
    is still running. A job naming record 1 asks about event 0 only and copies at once; a job
    naming record 2 waits for it; record 3 reuses event 0. A job without a number (0, an older
    client) waits for every pending event, the later record included."""
    out = run_scenario(fake_libcuda, tmp_path, FAKE_PENDING_EVENT="0x31a")
    steps = out["by_step"]
    assert all(s["error"] is None for s in out["steps"]), out["steps"]
    assert steps["pending a seq 1"]["calls"] == ["query 0x30a ctx=0x11"] and out["pending a seq 1"] == []
    assert steps["pending a seq 2"]["calls"] == ["query 0x31a ctx=0x11"]
    assert [hex(e) for e in out["pending a seq 2"]] == ["0x31a"]
    assert steps["pending a seq 3"]["calls"] == ["query 0x30a ctx=0x11"] and out["pending a seq 3"] == []
    assert [hex(e) for e in out["pending"]] == ["0x31a"]  # seq 0: every pending one, as before
    # A version-1 handle has no ring: nothing to wait for, whatever the job says.
    assert steps["pending c seq 1"]["calls"] == [] and out["pending c seq 1"] == []


@pytest.mark.parametrize("rc,error", [("400", "RuntimeError"), ("700", "StickyDeviceError")])
def test_a_failed_query_is_an_error_with_the_drivers_code(fake_libcuda: Path, tmp_path: Path, rc: str,
                                                         error: str) -> None:
    out = run_scenario(fake_libcuda, tmp_path, FAKE_QUERY_RC=rc)
    failed = out["by_step"]["pending a"]["error"]
    assert failed.startswith(f"{error}: cuEventQuery on the engine's event failed") and f"({rc})" in failed


@pytest.mark.parametrize("version", ["12040", "12080"])
@pytest.mark.parametrize("streams", [None, "4"])  # the default (2), KVSTORE_CUDA_COPY_STREAMS
def test_a_large_copy_is_spread_over_streams(fake_libcuda: Path, tmp_path: Path, version: str,
                                             streams: str | None) -> None:
    env = {"FAKE_CUDA_VERSION": version, **({"KVSTORE_CUDA_COPY_STREAMS": streams} if streams else {})}
    calls = words(run_scenario(fake_libcuda, tmp_path, **env)["by_step"]["store wide"]["calls"])
    n = int(streams or 2)
    ends = calls[-2 * n:]
    used = [c[2] for c in ends[::2]]
    assert [c[0] for c in ends] == ["record", "sync"] * n and len(set(used)) == n
    copies = [c[1] for c in calls if c[0] == "copy"]
    assert set(copies) == set(used) and len(copies) + 2 * n == len(calls)
    if version == "12040":  # one cuMemcpyAsync per run: the 4096 runs shared evenly
        assert [copies.count(s) for s in used] == [4096 // n] * n


def test_the_copy_kernel_makes_each_copy_in_one_launch_on_one_stream(fake_libcuda: Path, tmp_path: Path) -> None:
    """KVSTORE_CUDA_COPY_KERNEL=1: the pool is registered mapped too; GPU 1's context loads our module once,
    after asking whether a kernel may use registered host addresses; each copy sends its runs to its
    lane's table, launches once on that one stream and waits on its event. The bytes land as the
    copy engines land them (the fake runs the table's copies), the checksum sample still taken."""
    out = run_scenario(fake_libcuda, tmp_path, KVSTORE_CUDA_COPY_KERNEL="1")
    steps = out["by_step"]
    assert all(s["error"] is None for s in out["steps"]), out["steps"]
    assert [c[3] for c in words(steps["open"]["calls"])] == ["flags=3"] * 4  # portable and mapped
    assert words(steps["store a"]["calls"])[:3] == [["attribute", "91", "device=1"], ["module", "ours=1", "ctx=0x11"],
                                                    ["function", "0x400"]]
    for name, runs in (("store a", 2), ("store wide", 4096), ("load b", 2), ("load b checked", 2), ("store c", 2)):
        calls = [c for c in words(steps[name]["calls"]) if c[0] not in ("attribute", "module", "function", "alloc",
                                                                          "free")]
        stream, event = calls[0][2], calls[2][1]
        assert calls == [["htod", str(24 * runs), stream],
                         ["launch", stream, f"blocks={min(runs, 1024)}", "threads=256", f"runs={runs}"],
                         ["record", event, stream], ["sync", event]], (name, calls)
    assert [c[0] for c in words(steps["store wide"]["calls"])][:2] == ["free", "alloc"]  # the table grew
    # A run longer than a piece (256 KiB) is cut, so that long coalesced runs still spread over the SMs.
    calls = words(steps["store long"]["calls"])
    assert calls[0] == ["htod", str(24 * 2), calls[0][2]] and calls[1][3:] == ["threads=256", "runs=2"], calls
    assert out["stored long"]
    assert not any(c[0] in ("module", "alloc") for c in words(steps["load b"]["calls"]))  # both kept
    assert out["loaded"] == [False] * 5 + [True, False, True]
    assert out["corrupt"] == [1] and out["loaded checked"] == [False] * 4 + [True] * 4


@pytest.mark.parametrize("value,on", [(None, False), ("0", False), ("off", False), ("1", True), ("ON", True)])
def test_the_copy_kernel_is_off_unless_asked_for(value: str | None, on: bool) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVSTORE_CUDA_COPY_KERNEL"}
    if value is not None:
        env["KVSTORE_CUDA_COPY_KERNEL"] = value
    code = "from kvstore_service import native; print(native.features()['cuda_copy_kernel'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(on)


@pytest.mark.parametrize("env,why", [({"FAKE_NO_HOST_POINTERS": "1"}, "cannot use the pool's host addresses"),
                                     ({"FAKE_MODULE_RC": "218"}, "the driver refused the copy kernel"),
                                     ({"FAKE_FUNCTION_RC": "500"}, "the driver refused the copy kernel")])
def test_a_copy_kernel_that_cannot_run_here_leaves_the_copies_to_the_copy_engines(fake_libcuda: Path, tmp_path: Path,
                                                                                 env: dict[str, str], why: str) -> None:
    """Every copy is made, by the copy engines; the daemon's log says why once per GPU."""
    out = run_scenario(fake_libcuda, tmp_path, KVSTORE_CUDA_COPY_KERNEL="1", **env)
    steps = out["by_step"]
    assert all(s["error"] is None for s in out["steps"]), out["steps"]
    for name in ("store a", "load b"):
        calls = [c[0] for c in words(steps[name]["calls"])]
        assert "launch" not in calls and "copy" in calls, calls
    said = [line for line in out["stderr"].splitlines() if "KVSTORE_CUDA_COPY_KERNEL is set, but" in line]
    assert said and all(why in line and "copying with the copy engines" in line for line in said)
    assert len(said) == len(set(said))  # (once per GPU)
    asked = {"attribute", "module", "function"}
    assert not asked & {c[0] for c in words(steps["load b"]["calls"])}  # asked once per GPU: the answer is kept
    if "FAKE_FUNCTION_RC" in env:  # the module loaded, its function refused: the module is unloaded
        assert [c[0] for c in words(steps["store a"]["calls"])][:4] == ["attribute", "module", "function", "unload"]


def test_a_copy_kernel_that_ran_out_of_memory_is_loaded_again_at_the_next_copy(fake_libcuda: Path,
                                                                              tmp_path: Path) -> None:
    """Out of memory in the driver's JIT may pass (the engine frees memory): that copy goes to the copy
    engines, and the next one loads the module again and copies with it."""
    out = run_scenario(fake_libcuda, tmp_path, KVSTORE_CUDA_COPY_KERNEL="1", FAKE_MODULE_OOM_TIMES="1")
    steps = out["by_step"]
    assert steps["store a"]["error"] is None
    first = [c[0] for c in words(steps["store a"]["calls"])]
    assert "launch" not in first and "copy" in first
    assert "the driver refused the copy kernel" in out["stderr"] and "the kernel is tried again" in out["stderr"]
    calls = [c[0] for c in words(steps["store wide"]["calls"])]  # the next copy
    assert steps["store wide"]["error"] is None and calls[:3] == ["attribute", "module", "function"]
    assert "launch" in calls


# On a GPU (a child process: the driver reads KVSTORE_CUDA_COPY_KERNEL once per process): host -> GPU ->
# host through 32 KiB runs at scattered places, and runs of odd sizes and addresses (the byte path).
KERNEL_ROUND_TRIP = r"""
import ctypes, random
from kvstore_service import native_device
cuda = ctypes.CDLL("libcuda.so.1")
ctx, dev = ctypes.c_void_p(), ctypes.c_uint64()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
block, count = 32 << 10, 512
assert cuda.cuMemAlloc_v2(ctypes.byref(dev), ctypes.c_size_t(2 * count * block)) == 0
host = (ctypes.c_ubyte * (count * block)).from_buffer_copy(random.Random(5).randbytes(count * block))
back = (ctypes.c_ubyte * (count * block))()
base, back_base = ctypes.addressof(host), ctypes.addressof(back)
native_device.cuda_host_register(base, count * block)
native_device.cuda_host_register(back_base, count * block)
ids = random.Random(6).sample(range(2 * count), count)
host_offs, dev_offs = [i * block for i in range(count)], [i * block for i in ids]
sizes = [block] * count
sizes[3], host_offs[7], dev_offs[9] = block - 5, host_offs[7] + 3, dev_offs[9] + 1  # odd: byte by byte
sizes[7] = sizes[9] = block - 3
native_device.cuda_copy_blocks(base, dev.value, host_offs, dev_offs, sizes, "h2d", 0)
native_device.cuda_copy_blocks(dev.value, back_base, dev_offs, host_offs, sizes, "d2h", 0)
for h, n in zip(host_offs, sizes):
    assert bytes(back[h:h + n]) == bytes(host[h:h + n]), h
native_device.cuda_host_unregister(base)
native_device.cuda_host_unregister(back_base)
cuda.cuMemFree_v2(dev)
print("ok")
"""


def test_the_copy_kernel_round_trips_on_a_gpu() -> None:
    """Unverified on hardware until a GPU session runs it (benchmarks/gpu_checks.sh runs tests/device)."""
    if not native.features()["cuda_available"]:
        pytest.skip("no CUDA device")
    proc = subprocess.run([sys.executable, "-c", KERNEL_ROUND_TRIP], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVSTORE_CUDA_COPY_KERNEL": "1"}, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_the_committed_copy_kernel_is_nvccs_and_assembles_for_turing_to_hopper(tmp_path: Path) -> None:
    """csrc/copy_kernel_ptx.h is what csrc/generate_ptx.py makes of copy_kernel.cu, and ptxas takes it
    (declared PTX ISA 7.0, older than nvcc writes: the kernel must use nothing newer)."""
    if shutil.which("nvcc") is None or shutil.which("ptxas") is None:
        pytest.skip("no CUDA toolkit (nvcc, ptxas) on this machine")
    sys.path.insert(0, str(ROOT / "csrc"))
    try:
        import generate_ptx
    finally:
        sys.path.pop(0)
    header = (ROOT / "csrc" / "copy_kernel_ptx.h").read_text()
    assert header == generate_ptx.header(), "csrc/copy_kernel_ptx.h is stale: run csrc/generate_ptx.py"
    (tmp_path / "k.ptx").write_text(header.split('R"ptx(')[1].split(')ptx"')[0])
    for arch in ("sm_75", "sm_80", "sm_90"):
        subprocess.run(["ptxas", f"-arch={arch}", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")], check=True)


def test_the_engine_events_are_opened_once_and_destroyed_with_their_last_mapping(fake_libcuda: Path,
                                                                                tmp_path: Path) -> None:
    steps = run_scenario(fake_libcuda, tmp_path)["by_step"]
    assert steps["map a1"]["calls"] == ["open 0x30a ctx=0x11", "open 0x31a ctx=0x11"]  # GPU 1's context
    assert steps["map a2"]["calls"] == []  # the same engine's ring: shared
    assert steps["map b"]["calls"] == ["open 0x30b ctx=0x11"]
    assert steps["map c"]["calls"] == []
    assert steps["unmap a1"]["calls"] == []  # a2 still uses them
    assert steps["unmap a2"]["calls"] == ["destroy 0x30a ctx=0x11", "destroy 0x31a ctx=0x11"]
    assert steps["unmap b"]["calls"] == ["destroy 0x30b ctx=0x11"]
    assert steps["unmap c"]["calls"] == []


@pytest.mark.parametrize("env", [{"FAKE_OPEN_RC": "201"}, {"FAKE_OPEN_FAIL_AT": "2"}])
def test_an_event_that_cannot_be_opened_refuses_the_mapping(fake_libcuda: Path, tmp_path: Path,
                                                           env: dict[str, str]) -> None:
    out = run_scenario(fake_libcuda, tmp_path, **env)
    steps = out["by_step"]
    assert "cannot open the engine's IPC event on GPU 1" in steps["map a1"]["error"]
    assert "copies could not be ordered" in steps["map a1"]["error"]
    if "FAKE_OPEN_FAIL_AT" in env:  # the ring's first event opened, its second failed: the first is closed
        assert steps["map a1"]["calls"] == ["open 0x30a ctx=0x11", "open 0x31a ctx=0x11", "destroy 0x30a ctx=0x11"]
    assert steps["map c"]["error"] is None  # a handle without an event does not open one
    assert out["events_left"] == 0


def test_pool_pinned_at_start_in_segment_pieces_and_unpinned_piece_by_piece(fake_libcuda: Path,
                                                                            tmp_path: Path) -> None:
    out = run_scenario(fake_libcuda, tmp_path)
    base, data_offset, size = out["pool"]
    pinned = words(out["by_step"]["open"]["calls"])
    assert len(pinned) == 4  # one piece per 1 MiB segment
    for i, call in enumerate(pinned):  # portable, on GPU 0's context, before any engine came
        assert call == ["register", hex(base + data_offset + i * (1 << 20)), str(1 << 20), "flags=1", "ctx=0x10"]
    assert base + data_offset + 4 * (1 << 20) == base + size  # together: every segment of the pool
    assert all(s["calls"] == [] or "register" not in s["calls"][0] for s in out["steps"][1:-1])
    assert words(out["by_step"]["close"]["calls"]) == [["unregister", c[1]] for c in pinned]


def test_a_failed_piece_unpins_the_pieces_before_it(fake_libcuda: Path, tmp_path: Path) -> None:
    out = run_scenario(fake_libcuda, tmp_path, FAKE_REGISTER_FAIL_AT="3")
    calls = words(out["by_step"]["open"]["calls"])
    assert [c[0] for c in calls] == ["register"] * 3 + ["unregister"] * 2
    assert [c[1] for c in calls[3:]] == [c[1] for c in calls[:2]]
    assert out["pinned"] == [] and out["by_step"]["close"]["calls"] == []
    assert all(s["error"] is None for s in out["steps"])  # copies still work, unpinned
