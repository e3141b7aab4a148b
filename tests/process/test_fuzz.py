"""Property-based fuzzing of every RPC against one real daemon process (strategies, oracles and the
victim engine live in support.fuzz; benchmarks/fuzz.py runs the long version).

Each example is one RPC with malformed or adversarial fields (a Register first hands over
adversarial descriptors on the <socket>.cred handshake; a Store or Load goes by gRPC or as a frame on
<socket>.jobs), raw bytes as the serialized request or on <socket>.jobs, or junk on the handshake
socket. Every call must end OK or with a well-defined status that the contract
implies, the daemon must stay alive, and a victim engine's blocks must still load byte-exact at the
end. The sample is small for CI: KVSTORE_FUZZ_EXAMPLES (default 240) is the total across the tests.

The tests after the fuzzing ones pin down, one by one, the daemon bugs the fuzzing found.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from support import fuzz
from support.blocks import content_of, key_of
from support.daemon import DaemonProcess as Daemon
from support.fuzz import U64, VICTIM_KEYS, Case, Session
from support.shm_engine import ShmEngine

from kvstore_client.protocol import PROTOCOL_VERSION, memfd
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_client.protocol.completion import HEADER, MAGIC, VERSION, channel_bytes

TOTAL = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "240"))
WEIGHTS = {"Register": 4, "Lookup": 3, "Store": 3, "Load": 3, "raw": 5, "Handshake": 2, "Attach": 1,
           "Unregister": 1, "ReleaseLease": 1, "Poll": 1, "Stats": 1, "Clear": 1, "Jobs": 2}


def examples(name: str) -> int:
    return max(2, TOTAL * WEIGHTS[name] // sum(WEIGHTS.values()))


def fuzz_settings(name: str):
    return settings(max_examples=examples(name), deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Iterator[fuzz.Target]:
    tmp = tmp_path_factory.mktemp("fuzz")
    daemon = Daemon(tmp, "64MiB", "1MiB").start()
    t = fuzz.Target(daemon.socket, daemon.pool_path, lambda: daemon.proc is not None and daemon.proc.poll() is None,
                    str(tmp))
    yield t
    t.close()
    daemon.cleanup()


def _check(t: fuzz.Target, case: Case) -> None:
    problems = fuzz.run_case(t, case)
    assert not problems, "\n".join(problems)


def _register(**changes) -> Case:
    fields = {"protocol_version": 1, "engine_id": "fuzz", "namespace": "fuzz-a",
              "layout": {"num_blocks": 8, "regions": [(0, 1024, 1024)]}, "backend": "cpu", "handle": b"",
              "size": fuzz.KV_FILE_BYTES, "device": 0, "memory": True, "completion_slots": 8, "token": "fresh",
              "fds": ["channel", "kv"]}
    return Case("Register", {**fields, **changes})


def _transfer(method: str, **changes) -> Case:
    fields = {"session_id": Session("engine"), "job_id": 5, "keys": b"".join(VICTIM_KEYS[:2]), "key_size": 32,
              "block_ids": [3, 4], "via": "grpc"}
    return Case(method, {**fields, **changes})


@fuzz_settings("Register")
@given(case=fuzz.CASES["Register"])
@example(case=_register())
@example(case=_register(fds=["channel", "pool"]))  # the daemon's own pool file as KV memory
@example(case=_register(fds=["channel", "shm-file"]))  # a /dev/shm file: its owner may shrink it
@example(case=_register(fds=["channel", "kv-unsealed"]))
@example(case=_register(fds=["channel", "kv-write-sealed"]))
@example(case=_register(fds=["channel-bad-header", "kv"]))
@example(case=_register(fds=["channel", "dir"]))
@example(case=_register(fds=["kv", "channel"]))  # swapped
@example(case=_register(fds=["channel", "kv", "kv"]))  # one too many
@example(case=_register(token="reused"))
@example(case=_register(token="none"))
@example(case=_register(namespace="fuzz-refused", fds=["channel", "kv-small"]))  # must leave no namespace
@example(case=_register(size=fuzz.KV_FILE_BYTES + 1))  # more memory than the memfd has
@example(case=_register(layout={"num_blocks": 2, "regions": [(U64 - 4095, 4096, 4096)]}))  # offset near 2^64
@example(case=_register(layout={"num_blocks": U64, "regions": [(0, 2**63, 4096)]}))  # stride * blocks > 2^64
@example(case=_register(completion_slots=0))
@example(case=_register(completion_slots=2**32 - 1))
@example(case=_register(protocol_version=2))
def test_register(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Handshake")
@given(case=fuzz.CASES["Handshake"])
@example(case=Case("Handshake", {"data": b"", "fds": [], "close_early": False}))
@example(case=Case("Handshake", {"data": b"t" * 16, "fds": ["kv", "kv", "kv", "kv"], "close_early": False}))
@example(case=Case("Handshake", {"data": b"t" * 40, "fds": ["channel"], "close_early": True}))
def test_handshake(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Attach")
@given(case=fuzz.CASES["Attach"])
def test_attach(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Unregister")
@given(case=fuzz.CASES["Unregister"])
def test_unregister(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Lookup")
@given(case=fuzz.CASES["Lookup"])
def test_lookup(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("ReleaseLease")
@given(case=fuzz.CASES["ReleaseLease"])
def test_release_lease(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Store")
@given(case=fuzz.CASES["Store"])
@example(case=_transfer("Store", block_ids=[U64, 0]))
@example(case=_transfer("Store", job_id=U64))
@example(case=_transfer("Store", keys=VICTIM_KEYS[0] * 2))  # duplicate keys
@example(case=_transfer("Store", block_ids=[U64, 0], via="jobs"))
@example(case=_transfer("Store", job_id=U64, via="jobs"))
def test_store(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Load")
@given(case=fuzz.CASES["Load"])
@example(case=_transfer("Load", block_ids=[7, 7]))
@example(case=_transfer("Load", key_size=0))
@example(case=_transfer("Load", block_ids=[7, 7], via="jobs"))
@example(case=_transfer("Load", session_id=Session("lookup"), via="jobs"))
def test_load(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Poll")
@given(case=fuzz.CASES["Poll"])
@example(case=Case("Poll", {"session_id": Session("raw", raw=b"x" * 16), "wait_ms": 2**32 - 1}))
def test_poll(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Stats")
@given(case=fuzz.CASES["Stats"])
def test_stats(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Clear")
@given(case=fuzz.CASES["Clear"])
@example(case=Case("Clear", {"namespace": ""}))  # everything: the victim's leased blocks stay
def test_clear(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("raw")
@given(case=fuzz.CASES["raw"])
def test_raw_bytes(target, case: Case) -> None:
    _check(target, case)


@fuzz_settings("Jobs")
@given(case=fuzz.CASES["Jobs"])
@example(case=Case("Jobs", {"framed": False, "kind": 0}, raw=b"\x00\x00\x00\x00"))  # an empty frame
@example(case=Case("Jobs", {"framed": False, "kind": 0}, raw=b"\xff\xff\xff\xff"))  # 4 GiB announced
@example(case=Case("Jobs", {"framed": False, "kind": 0}, raw=b"\x00\x10\x00\x00\x01"))  # 1 MiB announced, 1 sent
@example(case=Case("Jobs", {"framed": True, "kind": 255}, raw=b""))
@example(case=Case("Jobs", {"framed": True, "kind": fuzz.LOAD}, raw=b""))  # an empty TransferRequest
def test_jobs_socket_bytes(target, case: Case) -> None:
    _check(target, case)


def test_victim_intact_after_fuzzing(target) -> None:
    """Runs after the fuzzing tests: whatever they did, the victim's blocks load byte-exact."""
    problems = fuzz.final_check(target)
    assert not problems, "\n".join(problems)


def test_poll_with_huge_wait_returns_when_a_job_finishes(target) -> None:
    """wait_ms = 2^32 - 1 is capped; the call still returns as soon as a job finished."""
    engine = target.engine
    stub = target.stub
    timer = threading.Timer(0.3, lambda: stub.Store(pb.TransferRequest(
        session_id=engine.session.session_id, job_id=77, keys=VICTIM_KEYS[0], key_size=32, block_ids=[1])))
    timer.start()
    reply = stub.Poll(pb.PollRequest(session_id=engine.session.session_id, wait_ms=2**32 - 1), timeout=30)
    timer.join()
    assert [j.job_id for j in reply.jobs] == [77]


# -- the bugs the fuzzing found, one test each ---------------------------------------------------


@pytest.fixture(scope="module")
def bugs_daemon(tmp_path_factory) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("bugs")).start()
    yield daemon
    daemon.cleanup()


@pytest.fixture
def daemon(bugs_daemon) -> Daemon:
    """One daemon for the tests below (this module's own, not conftest's per-test one)."""
    if bugs_daemon.proc is None or bugs_daemon.proc.poll() is not None:
        bugs_daemon.start()
    return bugs_daemon


@pytest.fixture
def stub(daemon) -> Iterator[pb_grpc.KVStoreStub]:
    channel = grpc.insecure_channel(f"unix://{daemon.socket}")
    yield pb_grpc.KVStoreStub(channel)
    channel.close()


def _code(call, request) -> grpc.StatusCode:
    try:
        call(request, timeout=10)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("method", ["Lookup", "Store", "Stats"])
def test_undecodable_request_is_invalid_argument(daemon, method: str) -> None:
    """Bytes that do not parse as the request message (here a truncated length-delimited field)
    are a client error. Today gRPC's own deserializer raises before the ErrorInterceptor runs and
    the call ends UNKNOWN ("Unexpected <class 'DecodeError'>")."""
    channel = grpc.insecure_channel(f"unix://{daemon.socket}")
    call = channel.unary_unary(f"/kvstore.v1.KVStore/{method}")
    try:
        call(b"\x0a", timeout=10)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
    channel.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.proc.poll() is None


def test_job_id_u64_max_completes_or_is_refused(daemon, stub) -> None:
    """job_id 2^64 - 1 is accepted, but its completion (seq = job_id + 1) does not fit the channel's
    u64: CompletionChannel.post raises struct.error inside KVStore._finish, so the job is never
    published, neither in shared memory nor to Poll, and the engine waits forever."""
    engine = ShmEngine.contiguous(daemon.socket, "jobid", 4, 4096)
    try:
        key = key_of("jobid", 0)
        engine.fill([key], [0])
        code = _code(stub.Store, pb.TransferRequest(session_id=engine.session.session_id, job_id=U64, keys=key,
                                                    key_size=32, block_ids=[0]))
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return  # refusing an id the completion channel cannot carry is fine too
        assert code == grpc.StatusCode.OK
        deadline = time.monotonic() + 3  # a one-block job takes milliseconds
        jobs: list[int] = []
        while U64 not in jobs and time.monotonic() < deadline:
            jobs += [j.job_id for j in engine.session.results(wait_ms=100).jobs]
        assert U64 in jobs, "the accepted job never reported a result"
    finally:
        engine.close()


def _handshake(daemon: Daemon, fds: list[int]) -> bytes:
    token = os.urandom(16)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(daemon.socket + ".cred")
        socket.send_fds(sock, [token], fds)
        assert sock.recv(1) == b"\x00"
    return token


def _memfd(size: int, seals: int = memfd.SEALS, header: bytes = b"") -> int:
    fd = os.memfd_create("kvstore-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, header, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _register_with(daemon: Daemon, stub, namespace: str, kv_fd: int, block: int = 4096) -> grpc.StatusCode:
    channel = _memfd(channel_bytes(8), header=HEADER.pack(MAGIC, VERSION, 8))
    try:
        token = _handshake(daemon, [channel, kv_fd])
    finally:
        os.close(channel)
    return _code(stub.Register, pb.RegisterRequest(
        protocol_version=PROTOCOL_VERSION, engine_id="e", namespace=namespace, completion_slots=8, peer_token=token,
        layout=pb.KVLayout(num_blocks=1, regions=[pb.Region(block_stride=block, block_bytes=block)]),
        memories=[pb.MemoryHandle(backend="cpu", size=block)]))


def test_refused_registration_leaves_no_namespace_behind(daemon, stub) -> None:
    """A Register that fails (here: its KV memory is smaller than it says) creates no namespace: were it
    created before the memory is mapped, the right engine would then be refused with "layout mismatch",
    and every refused registration with a new name would leave a namespace in the index for good."""
    small = _memfd(256)
    try:
        assert _register_with(daemon, stub, "poisoned", small, block=512) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        os.close(small)
    assert "poisoned" not in {ns.namespace for ns in daemon.client().stats().namespaces}
    engine = ShmEngine.contiguous(daemon.socket, "poisoned", 4, 4096)  # raises FailedPrecondition today
    engine.close()


@pytest.mark.parametrize("kind", ["pool", "shm-file"])
def test_memory_that_is_no_memfd_is_refused(daemon, stub, kind: str) -> None:
    """KV memory must be a memfd: a file (the daemon's own pool included) could be opened by others by
    name. (A memfd not sealed against shrinking is read as a file, never mapped: a mapping would
    fault, SIGBUS, once it shrank; tests/process/test_unsealed_memory.py.)"""
    if kind == "pool":
        fd = os.open(daemon.pool_path, os.O_RDWR)
    else:
        path = f"/dev/shm/kvstore-fuzz-{os.getpid()}-file"
        with open(path, "wb") as f:
            f.truncate(4096)
        fd = os.open(path, os.O_RDWR)
        os.unlink(path)
    try:
        assert _register_with(daemon, stub, f"shrinkable-{kind}", fd) == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        os.close(fd)
    assert os.path.exists(daemon.pool_path)


def test_content_matches_engine_helper() -> None:
    """The torch-free engines verify the same bytes the torch engine (support.engine) writes."""
    from support.engine import content_tensor

    key = key_of("same", 1)
    assert bytes(content_tensor(key, 1000).numpy()) == content_of(key, 1000)
