"""Device (CUDA / NPU) backends: everything that does not need the device runs here for real (the
handle codec, device mapping by UUID, the KV region math, the refusal of a daemon without the
device); the end-to-end CUDA test at the bottom runs only where torch sees a GPU."""

from __future__ import annotations

import base64
import json
import mmap
import re
from dataclasses import replace

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.blocks import key_of
from support.daemon import sealed_blocks, wait_for

from kvstore_client.client import peer_handshake
from kvstore_client.device import (
    export_kv_memory,
    order_before_copies,
    synchronize_before_store,
    unsupported_allocator,
)
from kvstore_client.protocol import PROTOCOL_VERSION
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_client.protocol.completion import CompletionChannel
from kvstore_client.protocol.handle import (
    MAX_HANDLE_BYTES,
    MAX_IPC_HANDLE_BYTES,
    MAX_ORDER_EVENTS,
    DeviceHandle,
    check_inside_allocation,
    decode_handle,
    device_index_for_uuid,
    encode_handle,
    handle_from_share,
    resolve_handle,
)
from kvstore_client.protocol.npu_identity import parse_npu_smi_board
from kvstore_service import native
from kvstore_service.backends import make_backend

UUID_A = "0b7e1c2a-5d3f-4e6a-9b8c-1d2e3f4a5b6c"
UUID_B = "f00dcafe-0000-4111-8222-333344445555"


def sample(**changes) -> DeviceHandle:
    handle = DeviceHandle(kind="cuda", device=1, device_uuid=UUID_A, ipc_handle=bytes(range(66)),
                          storage_bytes=3 << 30, storage_offset=2 << 20, ref_counter="/torch_4242_123456789_7",
                          ref_counter_offset=17, event_handle=b"\x07" * 64, event_sync=True)
    return replace(handle, **changes)


def doc_of(handle: DeviceHandle) -> dict:
    return json.loads(encode_handle(handle))


def raw(doc: dict) -> bytes:
    return json.dumps(doc).encode()


EVENT = bytes(range(100, 164))  # a cudaIpcEventHandle_t's 64 bytes
# sample() as a version-1 client encoded it, before handles carried an ordering event.
V1_DOC = {"format": "kvstore-device-handle", "version": 1, "kind": "cuda", "device": 1, "device_uuid": UUID_A,
          "ipc_handle": base64.b64encode(bytes(range(66))).decode(), "storage_bytes": 3 << 30,
          "storage_offset": 2 << 20, "ref_counter": "/torch_4242_123456789_7", "ref_counter_offset": 17,
          "event_handle": base64.b64encode(b"\x07" * 64).decode(), "event_sync": True}


# -- handle codec ---------------------------------------------------------------------------------


@pytest.mark.parametrize("handle", [sample(), sample(kind="npu", device_uuid="", event_sync=False, event_handle=b""),
                                    sample(kind="npu", device_uuid="vdie-0a1b2c"), sample(order_event=EVENT)])
def test_handle_round_trip(handle: DeviceHandle) -> None:
    data = encode_handle(handle)
    assert len(data) <= MAX_HANDLE_BYTES
    assert decode_handle(data) == handle
    assert decode_handle(data, handle.kind) == handle
    assert b"pickle" not in data and data.startswith(b"{")  # JSON, readable


def test_handle_from_share_gives_back_the_exact_torch_arguments() -> None:
    """What `_share_cuda_()` returns comes back, field for field and type for type, as the
    arguments of `_new_shared_cuda` with only the device replaced by the daemon's index."""
    share = (1, b"\x01c" + bytes(range(64)), 1 << 30, 4 << 20, b"/torch_99_1234_0", 5, bytes(64), True)
    handle = handle_from_share("cuda", share, "GPU-" + UUID_A.upper())
    assert handle.device_uuid == UUID_A  # nvidia-smi style normalised
    decoded = decode_handle(encode_handle(handle), "cuda")
    args = decoded.share_args(3)
    assert args == (3, *share[1:])
    assert [type(a) for a in args] == [type(a) for a in share]
    with pytest.raises(ValueError, match="no IPC handle"):
        handle_from_share("cuda", (0, None, 0, 0, None, 0, None, None), UUID_A)
    with pytest.raises(ValueError, match="7 fields"):
        handle_from_share("cuda", share[:7], UUID_A)


def _cases() -> list[tuple[str, bytes, str]]:
    good = doc_of(sample())
    cases: list[tuple[str, bytes, str]] = [
        ("empty", b"", "empty"),
        ("not utf-8", b"\xff\xfe{", "not JSON"),
        ("not json", b"/tmp/kvstore-kv-1", "not JSON"),
        ("json array", b"[1, 2]", "not a kvstore device handle"),
        ("json null", b"null", "not a kvstore device handle"),
        ("no format", raw({k: v for k, v in good.items() if k != "format"}), "not a kvstore device handle"),
        ("other format", raw({**good, "format": "pickle"}), "not a kvstore device handle"),
        ("deep nesting", b"[" * 4000, "nested too deeply|not JSON"),
        ("oversized", encode_handle(sample()) + b" " * MAX_HANDLE_BYTES, f"more than the {MAX_HANDLE_BYTES} allowed"),
        ("NaN", raw(good).replace(b'"storage_offset": 2097152', b'"storage_offset": NaN'), "NaN is not allowed"),
        ("duplicate field", raw(good)[:-1] + b', "device": 0}', "'device' appears twice"),
        ("unknown field", raw({**good, "extra": 1}), "unknown field"),
        ("kind", raw({**good, "kind": "tpu"}), "kind 'tpu'"),
        ("device range", raw({**good, "device": 128}), "device 128 is outside"),
        ("negative", raw({**good, "storage_offset": -1}), "storage_offset -1 is out of range"),
        ("too big", raw({**good, "storage_bytes": 1 << 63}), "out of range"),
        ("sum too big", raw({**good, "storage_bytes": (1 << 62), "storage_offset": (1 << 62)}), "out of range"),
        ("zero bytes", raw({**good, "storage_bytes": 0}), "out of range"),
        ("bool as int", raw({**good, "device": True}), "device must be an integer"),
        ("float as int", raw({**good, "ref_counter_offset": 1.0}), "must be an integer"),
        ("str as int", raw({**good, "storage_bytes": "1024"}), "must be an integer"),
        ("int as bool", raw({**good, "event_sync": 1}), "event_sync must be true or false"),
        ("int as str", raw({**good, "device_uuid": 5}), "device_uuid must be a string"),
        ("bad base64", raw({**good, "ipc_handle": "!!notbase64!!"}), "ipc_handle is not valid base64"),
        ("unpadded base64", raw({**good, "ipc_handle": "AAA"}), "not valid base64"),
        ("empty ipc handle", raw({**good, "ipc_handle": ""}), "ipc_handle has 0 bytes"),
        ("long ipc handle", raw({**good, "ipc_handle": base64.b64encode(bytes(MAX_IPC_HANDLE_BYTES + 1)).decode()}),
         f"too long|{MAX_IPC_HANDLE_BYTES + 1}"),
        ("long event", raw({**good, "event_handle": base64.b64encode(bytes(300)).decode()}), "event_handle has 300"),
        ("ref counter path", raw({**good, "ref_counter": "/etc/passwd"}), "not a torch IPC reference counter"),
        ("ref counter pool", raw({**good, "ref_counter": "/kvstore-pool"}), "not a torch IPC reference counter"),
        ("ref counter dots", raw({**good, "ref_counter": "/torch_1_2_3/../x"}), "not a torch IPC reference counter"),
        ("ref counter slot", raw({**good, "ref_counter_offset": 10000}), "ref_counter_offset 10000 is outside"),
        ("uuid chars", raw({**good, "device_uuid": "a b"}), "device_uuid must be"),
        ("uuid length", raw({**good, "device_uuid": "a" * 129}), "device_uuid must be"),
        ("cuda without uuid", raw({**good, "device_uuid": ""}), "needs the GPU's device_uuid"),
    ]
    for version in (0, 3, "1", True, 1.0, None):
        cases.append((f"version {version!r}", raw({**good, "version": version}), "is not supported"))
    for name in sorted(good):
        if name not in ("format", "version"):
            cases.append((f"missing {name}", raw({k: v for k, v in good.items() if k != name}), f"missing .*{name}"))
    v2 = doc_of(sample(order_event=EVENT))
    cases += [
        ("v2 missing order_event", raw({k: v for k, v in v2.items() if k != "order_event"}), "missing .*order_event"),
        ("v2 empty order_event", raw({**v2, "order_event": ""}), "version 2 handle carries an order_event"),
        ("v2 short order_event", raw({**v2, "order_event": base64.b64encode(bytes(63)).decode()}),
         "order_event has 63 bytes"),
        ("v2 npu order_event", raw({**v2, "kind": "npu"}), "only a cuda handle carries them"),
        ("v2 order_event of 1.5 events", raw({**v2, "order_event": base64.b64encode(bytes(96)).decode()}),
         "order_event has 96 bytes.*1..16 events of 64 bytes"),
        ("v2 ring too long", raw({**v2, "order_event": base64.b64encode(bytes(64 * 17)).decode()}),
         "order_event has 1088 bytes"),
        ("v2 order_event not base64", raw({**v2, "order_event": "!"}), "order_event is not valid base64"),
        ("v1 with order_event", raw({**good, "order_event": v2["order_event"]}), "unknown field.*order_event"),
    ]
    return cases


@pytest.mark.parametrize("name,data,words", _cases(), ids=[c[0] for c in _cases()])
def test_malformed_handles_are_refused_clearly(name: str, data: bytes, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        decode_handle(data, "cuda")


def test_newer_version_is_reported_as_a_version_problem() -> None:
    """A v3 handle with other fields must say 'version', not complain about its fields."""
    with pytest.raises(ValueError, match="version 3 is not supported.*versions 1..2.*upgrade"):
        decode_handle(raw({"format": "kvstore-device-handle", "version": 3, "new_field": "x"}))


def test_handle_with_an_order_event_is_version_2_and_round_trips() -> None:
    handle = sample(order_event=EVENT)
    doc = doc_of(handle)
    assert doc["version"] == 2 and base64.b64decode(doc["order_event"]) == EVENT
    assert decode_handle(encode_handle(handle), "cuda") == handle
    assert decode_handle(encode_handle(handle)).order_event == EVENT


def test_handle_without_an_order_event_stays_version_1() -> None:
    """What an older daemon reads: the version-1 fields exactly, no order_event."""
    for handle in (sample(), sample(kind="npu", device_uuid="vdie-0a1b2c")):
        doc = doc_of(handle)
        assert doc["version"] == 1 and "order_event" not in doc
        assert set(doc) == set(V1_DOC)


def test_an_old_version_1_handle_still_parses_without_an_event() -> None:
    """A handle exactly as a client from before version 2 wrote it (fields and values spelled out)."""
    handle = decode_handle(raw(V1_DOC), "cuda")
    assert handle.order_event == b"" and handle.event_handle == b"\x07" * 64
    assert handle == sample()


def test_handle_from_share_carries_the_order_event() -> None:
    share = (1, b"\x01c" + bytes(range(64)), 1 << 30, 4 << 20, b"/torch_99_1234_0", 5, bytes(64), True)
    handle = handle_from_share("cuda", share, UUID_A, EVENT)
    assert handle.order_event == EVENT and decode_handle(encode_handle(handle)) == handle
    with pytest.raises(ValueError, match="only a cuda handle carries them"):
        handle_from_share("npu", share, "vdie-1", EVENT)


def test_every_truncation_is_refused() -> None:
    for data in (encode_handle(sample()), encode_handle(sample(order_event=EVENT))):
        for n in range(len(data)):
            with pytest.raises(ValueError):
                decode_handle(data[:n])


def test_wrong_kind_for_the_backend() -> None:
    with pytest.raises(ValueError, match="a npu handle was sent for the cuda backend"):
        decode_handle(encode_handle(sample(kind="npu")), "cuda")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_handles_never_escape_as_other_errors(data: st.DataObject) -> None:
    """Random byte edits: either a ValueError or a handle that passes every check, nothing else."""
    buf = bytearray(encode_handle(data.draw(st.sampled_from([sample(), sample(order_event=EVENT)]))))
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(buf) - 1))
        buf[i] = data.draw(st.integers(0, 255))
    try:
        handle = decode_handle(bytes(buf))
    except ValueError:
        return
    assert decode_handle(encode_handle(handle)) == handle


# -- devices by UUID, bounds ----------------------------------------------------------------------


def test_device_found_by_uuid_whatever_the_visible_order() -> None:
    # The engine saw UUID_A as its device 0; the daemon sees the GPUs in the other order.
    assert device_index_for_uuid(UUID_A, [UUID_B, UUID_A]) == 1
    assert device_index_for_uuid(UUID_A, [UUID_A, UUID_B]) == 0
    assert device_index_for_uuid("GPU-" + UUID_A.upper(), [UUID_B, UUID_A]) == 1  # nvidia-smi spelling
    with pytest.raises(ValueError, match=f"device {UUID_A} is not visible to the daemon.*1 device"):
        device_index_for_uuid(UUID_A, [UUID_B])
    with pytest.raises(ValueError, match="sees 0 device"):
        device_index_for_uuid(UUID_A, [])
    with pytest.raises(ValueError, match="matches several"):
        device_index_for_uuid(UUID_A, [UUID_A, "gpu-" + UUID_A])
    with pytest.raises(ValueError, match="no device UUID"):
        device_index_for_uuid(" ", [UUID_A])


def test_resolve_handle_checks_size_device_and_kind() -> None:
    data = encode_handle(sample(storage_bytes=1 << 20))
    assert resolve_handle(data, 1 << 20, "cuda", [UUID_B, UUID_A], device=1)[0] == 1
    with pytest.raises(ValueError, match="needs 1048577 bytes but the exported cuda storage has 1048576"):
        resolve_handle(data, (1 << 20) + 1, "cuda", [UUID_A])
    with pytest.raises(ValueError, match="memory.device 0 does not match device 1"):
        resolve_handle(data, 4096, "cuda", [UUID_A], device=0)
    with pytest.raises(ValueError, match="not visible"):
        resolve_handle(data, 4096, "cuda", [UUID_B])
    with pytest.raises(ValueError, match="a cuda handle was sent for the npu backend"):
        resolve_handle(data, 4096, "npu", [UUID_A])
    # NPU without an identity is refused, not guessed by index: an import on another NPU would
    # succeed and then fail every copy.
    npu = encode_handle(sample(kind="npu", device_uuid="", device=1))
    with pytest.raises(ValueError, match="could not identify its npu device 1.*refusing to guess it by index"):
        resolve_handle(npu, 4096, "npu", ["", ""])
    npu = encode_handle(sample(kind="npu", device_uuid="vdie-0a1b2c", device=1))
    assert resolve_handle(npu, 4096, "npu", ["vdie-ffff", "vdie-0a1b2c"])[0] == 1


def test_inside_allocation() -> None:
    check_inside_allocation(0x1000_2000, 4096, 0x1000_0000, 0x10_0000)
    check_inside_allocation(0x1000_0000, 0x10_0000, 0x1000_0000, 0x10_0000)
    with pytest.raises(ValueError, match="not inside the shared allocation"):
        check_inside_allocation(0x1000_0000, 0x10_0001, 0x1000_0000, 0x10_0000)
    with pytest.raises(ValueError, match="not inside"):
        check_inside_allocation(0x0FFF_F000, 4096, 0x1000_0000, 0x10_0000)


def test_a_ring_of_order_events_round_trips() -> None:
    ring = bytes(range(256)) * (MAX_ORDER_EVENTS // 4)  # 16 handles of 64 bytes
    assert decode_handle(encode_handle(sample(order_event=ring))).order_event == ring
    assert decode_handle(encode_handle(sample(order_event=EVENT))).order_event == EVENT  # a ring of one


def test_npu_expandable_segment_handles_fit() -> None:
    """torch_npu's share of an expandable segment: a header plus 8 bytes per 20 MiB physical handle. A
    100 GiB tensor (5120 handles, 40 KiB) round-trips; past the limit is refused clearly."""
    big = bytes(range(256)) * 160 + bytes(24)
    handle = sample(kind="npu", device_uuid="vdie-0a1b2c", ipc_handle=big, storage_bytes=100 << 30)
    assert decode_handle(encode_handle(handle), "npu") == handle
    with pytest.raises(ValueError, match=f"ipc_handle has {MAX_IPC_HANDLE_BYTES + 1} bytes"):
        encode_handle(replace(handle, ipc_handle=bytes(MAX_IPC_HANDLE_BYTES + 1)))


def test_npu_smi_identity() -> None:
    board = ("NPU ID : 0\nChip ID : 0\nPCIe Bus Info : 0000:C1:00.0\nVDie ID : 1A2B3C4D 00000000 DEADBEEF\n")
    assert parse_npu_smi_board(board) == "vdie-1a2b3c4d00000000deadbeef"
    assert parse_npu_smi_board(board.replace("1A2B3C4D 00000000 DEADBEEF", "00000000 00000000")) == "pci-0000:c1:00.0"
    assert parse_npu_smi_board("npu-smi: device not found") == ""


# -- engine side ---------------------------------------------------------------------------------


def test_export_of_cpu_tensors_points_to_shared_memory() -> None:
    with pytest.raises(ValueError, match="move_to_shared_memory"):
        export_kv_memory([torch.zeros(4, 8)], 4, [(0, 8, 8)])


class Config:
    def __init__(self, **model: object) -> None:
        self.model_config = type("ModelConfig", (), model)()


def test_sleep_mode_and_the_cumem_allocator_leave_the_connector_off() -> None:
    """vLLM's sleep mode (CuMemAllocator on CUDA, CaMem on vllm-ascend) and the cumem allocator put
    the KV cache where device IPC cannot export it and sleep() would unmap it under the daemon."""
    assert unsupported_allocator(Config(enable_sleep_mode=False, enable_cumem_allocator=False)) == ""
    assert unsupported_allocator(Config()) == "" and unsupported_allocator(object()) == ""
    assert "sleep mode" in unsupported_allocator(Config(enable_sleep_mode=True, enable_cumem_allocator=True))
    assert "CaMem" in unsupported_allocator(Config(enable_sleep_mode=True))
    assert "cumem allocator" in unsupported_allocator(Config(enable_cumem_allocator=True))


def test_sleep_mode_is_detected_on_vllms_own_config() -> None:
    vllm_config = pytest.importorskip("vllm.config")
    model = vllm_config.ModelConfig.__new__(vllm_config.ModelConfig)  # no model files: the fields only
    model.enable_sleep_mode, model.enable_cumem_allocator = True, True  # what __post_init__ sets on CUDA
    assert "sleep mode" in unsupported_allocator(type("C", (), {"model_config": model})())


def test_synchronize_before_store_on_cpu_is_a_no_op() -> None:
    synchronize_before_store("cpu")
    synchronize_before_store(torch.device("cpu"))
    with pytest.raises(ValueError, match="no store ordering rule for meta"):
        synchronize_before_store("meta")


# -- the daemon without the device ------------------------------------------------------------------


@pytest.mark.skipif(native.features().get("cuda_available", False), reason="this machine has a usable GPU")
def test_make_cuda_backend_fails_clearly_without_a_gpu() -> None:
    with pytest.raises(RuntimeError, match="no CUDA device"):
        make_backend("cuda")


@pytest.mark.skipif(native.features().get("acl_available", False), reason="this machine has a usable NPU")
def test_make_npu_backend_fails_clearly_without_an_npu() -> None:
    with pytest.raises(RuntimeError, match=r"no NPU \(Ascend\) device"):
        make_backend("npu")


def device_register(backend: str, handle: bytes, size: int, namespace: str) -> pb.RegisterRequest:
    request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, engine_id="device-test", namespace=namespace,
                                 completion_slots=8)
    request.layout.CopyFrom(pb.KVLayout(num_blocks=4, regions=[pb.Region(offset=0, block_stride=4096,
                                                                         block_bytes=4096)]))
    request.memories.add(backend=backend, handle=handle, size=size, device=1)
    return request


@pytest.mark.parametrize("backend,feature,words", [("cuda", "cuda_available", "no CUDA device"),
                                                   ("npu", "acl_available", r"no NPU \(Ascend\) device")])
def test_daemon_refuses_a_device_session_without_the_device(daemon, backend: str, feature: str, words: str) -> None:
    if native.features().get(feature, False):
        pytest.skip(f"this machine has a usable {backend} device")
    handle = encode_handle(sample(kind=backend, storage_bytes=1 << 20))
    with grpc.insecure_channel(f"unix://{daemon.socket}") as channel:
        stub = pb_grpc.KVStoreStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            request = device_register(backend, handle, 4 * 4096, f"dev-{backend}")
            request.peer_token = peer_handshake(f"unix://{daemon.socket}")
            stub.Register(request, timeout=30)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert f"backend '{backend}' is not usable here" in info.value.details()
        assert re.search(words, info.value.details()), info.value.details()
        assert stub.Stats(pb.StatsRequest(), timeout=10).engines == 0
    assert daemon.proc.poll() is None
    client = daemon.client()
    assert client.health() == "SERVING"
    client.close()


# -- on a GPU machine -------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run on a GPU machine (docs/devices.md)")
@pytest.mark.parametrize("interleaved", [False, True])
def test_cuda_store_and_load_byte_exact(daemon, interleaved: bool) -> None:
    """An engine (this process) with a vLLM-shaped CUDA KV cache stores random blocks through the
    daemon (another process, CUDA IPC + DMA) and loads them back into other block ids."""
    from kvstore_client.shm import block_cache

    layers, num_blocks, block_shape = 4, 64, (16, 4, 64)  # 8 KiB of bf16 per layer and block
    layer_bytes = 16 * 4 * 64 * 2

    def layer_views(flat: torch.Tensor) -> list[torch.Tensor]:
        grid = flat.view(num_blocks, layers, layer_bytes) if interleaved else flat.view(layers, num_blocks, layer_bytes)
        return [(grid[:, i] if interleaved else grid[i]).view(torch.bfloat16).view(num_blocks, *block_shape)
                for i in range(layers)]

    def bits(t: torch.Tensor) -> torch.Tensor:  # compare bit patterns: random bytes include bf16 NaNs
        return t.view(torch.int16)

    torch.manual_seed(0)
    buf = torch.randint(-128, 128, (layers * num_blocks * layer_bytes,), dtype=torch.int8, device="cuda")
    views = layer_views(buf)
    original = buf.clone()
    regions = ([(0, layers * layer_bytes, layers * layer_bytes)] if interleaved
               else [(i * num_blocks * layer_bytes, layer_bytes, layer_bytes) for i in range(layers)])
    spec = export_kv_memory([buf], num_blocks, regions)
    assert spec.backend == "cuda" and spec.num_blocks == num_blocks and spec.sizes == (buf.numel(),)

    client = daemon.client()
    namespace = f"gpu-{interleaved}"
    session = client.session(namespace, spec)
    keys = [key_of("gpu", i) for i in range(16)]
    src, dst = list(range(16)), list(range(40, 56))
    try:
        order_before_copies(buf.device)  # records the IPC event the daemon's copy stream waits on
        job = session.store(keys, src)
        done = session.wait([job])[job]
        assert done.ok and done.blocks_ok == 16, done
        expected = [v[src].clone() for v in views]
        for v in views:
            v[dst] = 0
        order_before_copies(buf.device)  # the load lands after the zeroing, without a host sync
        job = session.load(keys, dst)
        done = session.wait([job])[job]
        assert done.ok and done.blocks_ok == 16, done
        for layer, v in enumerate(views):
            assert torch.equal(bits(v[dst]), bits(expected[layer])), f"layer {layer} differs after the round trip"
        untouched = [b for b in range(num_blocks) if b not in dst]
        for v, before in zip(views, layer_views(original), strict=True):
            assert torch.equal(bits(v[untouched]), bits(before[untouched])), "a load wrote outside its blocks"

        # The pool slot is the concatenation of the layers: a CPU engine of the same namespace reads it.
        memory, cpu_spec = block_cache(16, layers * layer_bytes)
        cpu = client.session(namespace, cpu_spec)
        try:
            job = cpu.load(keys, list(range(16)))
            assert cpu.wait([job])[job].blocks_ok == 16
            slots = memory.tensor.view(16, layers * layer_bytes)
            for i, b in enumerate(src):
                want = torch.cat([e[i].reshape(-1).view(torch.int8).cpu() for e in expected])
                assert torch.equal(slots[i].view(torch.int8), want), f"pool slot {i} (block {b}) differs"
        finally:
            cpu.close()
            memory.close()

        # A handle naming a GPU the daemon does not have is refused with the reason.
        bad = json.loads(spec.handles[0])
        bad["device_uuid"] = "00000000-0000-0000-0000-000000000000"
        target = f"unix://{daemon.socket}"
        completions = CompletionChannel.create(8)
        with grpc.insecure_channel(target) as channel:
            request = device_register("cuda", json.dumps(bad).encode(), spec.sizes[0], namespace)
            request.layout.CopyFrom(spec.layout())
            request.memories[0].device = spec.device
            request.peer_token = peer_handshake(target, [completions.fd])  # as a real engine does
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.KVStoreStub(channel).Register(request, timeout=30)
            completions.close()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is not visible to the daemon" in info.value.details()
    finally:
        session.close()
        client.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run on a GPU machine (docs/devices.md)")
def test_cuda_load_checks_its_blocks_as_it_copies_and_fails_a_corrupt_one(daemon_factory) -> None:
    """--verify-loads 1: each block of a CUDA load is checksummed while its DMA runs. A block
    corrupted in the pool fails its load (vLLM recomputes it) and is dropped; the others land exact."""
    daemon = daemon_factory("--verify-loads", "1").start()
    block, n = 64 << 10, 16
    buf = torch.randint(-128, 128, (2 * n * block,), dtype=torch.int8, device="cuda")
    grid = buf.view(2 * n, block)
    spec = export_kv_memory([buf], 2 * n, [(0, block, block)])
    client = daemon.client()
    session = client.session("gpu-corrupt", spec)
    keys = [key_of("gpu-corrupt", i) for i in range(n)]
    try:
        order_before_copies(buf.device)
        job = session.store(keys, list(range(n)))
        assert session.wait([job])[job].blocks_ok == n
        assert wait_for(lambda: len(list(sealed_blocks(daemon.pool_path))) >= n, timeout=10)
        victim = next(off for h, off in sealed_blocks(daemon.pool_path) if h.key == keys[5])
        with open(daemon.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
            data[victim + block - 1] ^= 0xFF  # its last byte
        order_before_copies(buf.device)
        job = session.load(keys, list(range(n, 2 * n)))
        done = session.wait([job])[job]
        assert (done.blocks_ok, done.blocks_failed) == (n - 1, 1)
        good = [i for i in range(n) if i != 5]
        assert torch.equal(grid[[n + i for i in good]], grid[good])
        stats = client.stats()
        assert stats.corrupt_blocks == 1 and stats.blocks == n - 1
        assert session.lookup(keys) == (5, b"")
    finally:
        session.close()
        client.close()
