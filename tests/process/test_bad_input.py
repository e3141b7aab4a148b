"""Every bad request gets the right status and a message naming the problem; the daemon keeps
serving and the pool's other blocks are untouched."""

from __future__ import annotations

import os
import socket
import struct
import time

import grpc
import pytest
from support.blocks import key_of
from support.engine import Engine

from kvstore_client.client import peer_handshake
from kvstore_client.protocol import PROTOCOL_VERSION, memfd
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_client.protocol.completion import CompletionChannel
from kvstore_client.protocol.jobs_framing import LOAD, STORE, SUFFIX, TURNED_AWAY, frame
from kvstore_client.shm import block_cache

KB64 = 64 * 1024
NUM_BLOCKS = 32


@pytest.fixture
def setup(daemon):
    engine = Engine(daemon.socket, "bad-input", NUM_BLOCKS, KB64)
    keys = [key_of("good", i) for i in range(8)]
    engine.fill(keys, list(range(8)))
    job = engine.session.store(keys, list(range(8)))
    assert engine.session.wait([job])[job].ok
    channel = grpc.insecure_channel(f"unix://{daemon.socket}")
    yield daemon, engine, keys, pb_grpc.KVStoreStub(channel)
    # Afterwards the daemon still serves, and the good blocks load byte-exact.
    engine.blocks.zero_()
    job = engine.session.load(keys, list(range(10, 18)))
    assert engine.session.wait([job])[job].blocks_ok == 8
    assert engine.verify(keys, list(range(10, 18))) == 0
    assert daemon.proc.poll() is None
    engine.close()


def expect(code: grpc.StatusCode, words: str, call, request) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    assert info.value.code() == code, info.value.details()
    assert words in info.value.details(), info.value.details()


def transfer(engine, keys, block_ids, key_size=32, job_id=1000, session_id=None) -> pb.TransferRequest:
    return pb.TransferRequest(session_id=engine.session.session_id if session_id is None else session_id,
                              job_id=job_id, keys=b"".join(keys), key_size=key_size, block_ids=block_ids)


def test_unknown_session(setup) -> None:
    _, engine, keys, stub = setup
    expect(grpc.StatusCode.NOT_FOUND, "unknown or ended session", stub.Store,
           transfer(engine, keys[:1], [0], session_id=os.urandom(16)))
    expect(grpc.StatusCode.NOT_FOUND, "unknown or ended session", stub.Poll, pb.PollRequest(session_id=b""))


def test_block_id_outside_cache(setup) -> None:
    _, engine, keys, stub = setup
    expect(grpc.StatusCode.INVALID_ARGUMENT, f"block id {NUM_BLOCKS} is outside", stub.Load,
           transfer(engine, keys[:1], [NUM_BLOCKS]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "outside the registered cache", stub.Store,
           transfer(engine, [key_of("x", 1)], [2**63]))


def test_keys_of_wrong_length(setup) -> None:
    _, engine, _, stub = setup
    expect(grpc.StatusCode.INVALID_ARGUMENT, "key_size 8 is outside", stub.Store,
           transfer(engine, [b"k" * 8], [0], key_size=8))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "key_size 65 is outside", stub.Store,
           transfer(engine, [b"k" * 65], [0], key_size=65))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "not a multiple of key_size", stub.Store,
           pb.TransferRequest(session_id=engine.session.session_id, job_id=5, keys=b"k" * 40, key_size=32,
                              block_ids=[0]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "key_size 0", stub.Lookup,
           pb.LookupRequest(namespace="bad-input", keys=b"", key_size=0))


def test_group_spans_that_do_not_fit_the_keys(setup) -> None:
    _, _, _, stub = setup
    keys = b"k" * 32 * 3
    expect(grpc.StatusCode.INVALID_ARGUMENT, "not whole blocks of 2 groups", stub.Lookup,
           pb.LookupRequest(namespace="bad-input", keys=keys, key_size=32, group_spans=[0, 1]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "group spans must be in", stub.Lookup,
           pb.LookupRequest(namespace="bad-input", keys=keys, key_size=32, group_spans=[0, 1 << 30, 1]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "at most 64", stub.Lookup,
           pb.LookupRequest(namespace="bad-input", keys=keys, key_size=32, group_spans=[0] * 65))
    assert stub.Lookup(pb.LookupRequest(namespace="bad-input", keys=keys, key_size=32, group_spans=[0, 1, 2])).hits == 0


def test_a_lookup_over_max_lookup_keys_is_refused_naming_the_flag(daemon_factory) -> None:
    daemon = daemon_factory("--max-lookup-keys", "64").start()
    stub = daemon.client().stub
    keys = b"".join(os.urandom(32) for _ in range(66))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "a lookup of 66 keys, more than --max-lookup-keys 64", stub.Lookup,
           pb.LookupRequest(namespace="many", keys=keys, key_size=32, group_spans=[0, 4]))
    assert stub.Lookup(pb.LookupRequest(namespace="many", keys=keys[:64 * 32], key_size=32,
                                        group_spans=[0, 4])).hits == 0


def test_duplicate_keys_and_count_mismatch(setup) -> None:
    _, engine, keys, stub = setup
    k = key_of("dup", 0)
    expect(grpc.StatusCode.INVALID_ARGUMENT, "duplicate keys", stub.Store, transfer(engine, [k, k], [0, 1]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "2 keys but 3 block ids", stub.Load,
           transfer(engine, keys[:2], [0, 1, 2]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "duplicate block ids", stub.Load,
           transfer(engine, keys[:2], [4, 4]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "at least one block", stub.Load, transfer(engine, [], []))


def test_block_ids_as_bytes_or_as_a_repeated_field(setup) -> None:
    """Clients of protocol 3 send block ids packed (block_id_bytes), of 2 as block_ids: both are
    served; both at once, or bytes that are not whole uint64s, are refused by name."""
    _, engine, keys, stub = setup

    def load(ids: list[int], packed: bytes, job_id: int = 1000) -> pb.TransferRequest:
        return pb.TransferRequest(session_id=engine.session.session_id, job_id=job_id, keys=b"".join(keys[:2]),
                                  key_size=32, block_ids=ids, block_id_bytes=packed)

    packed = struct.pack("<2Q", 20, 21)
    expect(grpc.StatusCode.INVALID_ARGUMENT, "both set", stub.Load, load([20, 21], packed))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "holds 15 bytes, not whole", stub.Load, load([], packed[:-1]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "2 keys but 1 block ids", stub.Load, load([], packed[:8]))
    expect(grpc.StatusCode.INVALID_ARGUMENT, f"block id {NUM_BLOCKS} is outside", stub.Load,
           load([], struct.pack("<2Q", 20, NUM_BLOCKS)))
    engine.blocks.zero_()
    stub.Load(load([], packed, job_id=1001), timeout=10)
    stub.Load(load([22, 23], b"", job_id=1002), timeout=10)  # (an older client's)
    done: dict[int, bool] = {}  # (the setup's store is reported too)
    deadline = time.monotonic() + 10
    while not {1001, 1002} <= done.keys() and time.monotonic() < deadline:
        reply = stub.Poll(pb.PollRequest(session_id=engine.session.session_id, wait_ms=1000), timeout=10)
        done.update((job.job_id, all(job.block_ok)) for job in reply.jobs)
    assert done[1001] and done[1002]
    assert engine.verify(keys[:2], [20, 21]) == 0 and engine.verify(keys[:2], [22, 23]) == 0


def test_oversized_request(daemon_factory) -> None:
    daemon = daemon_factory("--max-request-bytes", "1MiB").start()
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(f"unix://{daemon.socket}"))
    expect(grpc.StatusCode.RESOURCE_EXHAUSTED, "", stub.Lookup,
           pb.LookupRequest(namespace="n", keys=b"k" * 32 * 40000, key_size=32))
    assert daemon.client().health() == "SERVING"
    # 10k blocks in one request are fine under the default limit.
    big = daemon_factory().start()
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(f"unix://{big.socket}"))
    keys = b"".join(key_of("big", i) for i in range(10_000))
    assert stub.Lookup(pb.LookupRequest(namespace="n", keys=keys, key_size=32)).hits == 0


def test_register_errors(setup, tmp_path) -> None:
    daemon, engine, _, stub = setup
    target = f"unix://{daemon.socket}"
    memory, spec = block_cache(4, KB64 * 2)  # another block size than the namespace's
    channel = CompletionChannel.create(8)
    try:
        def register(fds: list[int] | None = None, **fields) -> pb.RegisterRequest:
            token = peer_handshake(target, [channel.fd, memory.fd] if fds is None else fds)
            request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, engine_id="e", namespace="other",
                                         completion_slots=8, peer_token=token)
            request.layout.CopyFrom(spec.layout())
            request.memories.add(backend="cpu", size=spec.sizes[0])
            for name, value in fields.items():
                setattr(request, name, value)
            return request

        expect(grpc.StatusCode.FAILED_PRECONDITION, f"protocol 7, this daemon speaks 2 to {PROTOCOL_VERSION}",
               stub.Register, register(protocol_version=7))
        expect(grpc.StatusCode.FAILED_PRECONDITION, f"protocol 1, this daemon speaks 2 to {PROTOCOL_VERSION}",
               stub.Register, register(protocol_version=1))
        expect(grpc.StatusCode.FAILED_PRECONDITION, "layout mismatch", stub.Register, register(namespace="bad-input"))
        bad = register()
        bad.layout.regions[0].block_stride = KB64 * 4  # runs past the end of the memory
        expect(grpc.StatusCode.INVALID_ARGUMENT, "beyond the", stub.Register, bad)
        bad = register()
        bad.memories[0].backend = "tpu"
        expect(grpc.StatusCode.INVALID_ARGUMENT, "unknown backend 'tpu'", stub.Register, bad)
        expect(grpc.StatusCode.INVALID_ARGUMENT, "namespace is empty", stub.Register, register(namespace=""))
        expect(grpc.StatusCode.INVALID_ARGUMENT, "needs 2 shared-memory descriptor(s)", stub.Register,
               register(fds=[]))
        expect(grpc.StatusCode.PERMISSION_DENIED, "peer_token", stub.Register, register(peer_token=b""))
        # Memory that is no memfd is refused, and a completion channel that could shrink under the
        # daemon's mapping (KV memory in an unsealed memfd is read as a file: test_unsealed_memory).
        plain = os.open(tmp_path / "plain", os.O_RDWR | os.O_CREAT)
        os.ftruncate(plain, spec.sizes[0])
        unsealed = os.memfd_create("unsealed")
        os.ftruncate(unsealed, spec.sizes[0])
        small = memfd.create("small", 4096)
        try:
            expect(grpc.StatusCode.INVALID_ARGUMENT, "not a memfd", stub.Register, register([channel.fd, plain]))
            expect(grpc.StatusCode.INVALID_ARGUMENT, "has 4096 bytes", stub.Register, register([channel.fd, small]))
            expect(grpc.StatusCode.INVALID_ARGUMENT, "completion channel", stub.Register,
                   register([unsealed, memory.fd]))
        finally:
            for fd in (plain, unsealed, small):
                os.close(fd)
    finally:
        channel.close()
        memory.close()


def test_lookup_only_session_cannot_transfer(setup) -> None:
    daemon, engine, keys, stub = setup
    from kvstore_client import KVStoreClient

    scheduler = KVStoreClient(daemon.socket).session("bad-input")
    expect(grpc.StatusCode.FAILED_PRECONDITION, "lookup-only", stub.Store,
           transfer(engine, keys[:1], [0], session_id=scheduler.session_id))
    expect(grpc.StatusCode.PERMISSION_DENIED, "its own namespace", stub.Lookup,
           pb.LookupRequest(session_id=scheduler.session_id, namespace="other", keys=keys[0], key_size=32))
    expect(grpc.StatusCode.INVALID_ARGUMENT, "a lease needs a session", stub.Lookup,
           pb.LookupRequest(namespace="bad-input", keys=keys[0], key_size=32, lease=True))
    expect(grpc.StatusCode.NOT_FOUND, "unknown or expired lease", stub.ReleaseLease,
           pb.ReleaseLeaseRequest(session_id=scheduler.session_id, lease_id=b"nope"))
    assert scheduler.lookup(keys) == (8, b"")
    scheduler.close()


def test_jobs_beyond_completion_slots_fail_without_blocking(daemon) -> None:
    from kvstore_client import KVStoreClient

    memory, spec = block_cache(8, KB64)
    session = KVStoreClient(daemon.socket).session("slots", spec, completion_slots=2)
    keys = [key_of("slot", i) for i in range(3)]
    first, second = session.store(keys[:1], [0]), session.store(keys[1:2], [1])
    third = session.store(keys[2:], [2])  # both slots are taken until their completions are polled
    done = session.wait([first, second, third])
    assert done[first].ok and done[second].ok
    assert (done[third].blocks_ok, done[third].blocks_failed) == (0, 1)
    session.close()
    memory.close()


def test_jobs_over_max_inflight_jobs_are_refused_naming_the_flag(daemon_factory) -> None:
    """It used to say "1 jobs in flight (max)"."""
    daemon = daemon_factory("--max-inflight-jobs", "1", pool_size="256MiB").start()
    engine = Engine(daemon.socket, "inflight", 256, KB64)
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(f"unix://{daemon.socket}"))
    refusals: list[str] = []
    for attempt in range(10):  # 8 stores of 16 MiB at once: one runs while the others arrive
        calls = [stub.Store.future(transfer(engine, [key_of(f"j{attempt}-{n}", i) for i in range(256)],
                                            list(range(256)), job_id=n), timeout=10) for n in range(8)]
        for call in calls:
            try:
                call.result()
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
                refusals.append(e.details())
        if refusals:
            break
        engine.session.wait([])
    assert refusals and all("1 jobs in flight (--max-inflight-jobs 1)" in r for r in refusals), refusals
    engine.close()


def test_an_engine_id_over_max_engine_id_bytes_is_refused(setup) -> None:
    """It used to be accepted, 20 MiB of it written to the log per registration."""
    daemon, _, _, stub = setup
    before = daemon.log.stat().st_size
    expect(grpc.StatusCode.INVALID_ARGUMENT, f"engine_id is {20 << 20} bytes, more than --max-engine-id-bytes 256",
           stub.Register, pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, namespace="big-id",
                                             engine_id="e" * (20 << 20),
                                             peer_token=peer_handshake(f"unix://{daemon.socket}")))
    assert daemon.log.stat().st_size - before < 4096


def test_too_many_sessions(daemon_factory) -> None:
    daemon = daemon_factory("--max-sessions", "2").start()
    from kvstore_client import KVStoreClient, ResourceExhausted

    client = KVStoreClient(daemon.socket)
    sessions = [client.session("n"), client.session("n")]
    with pytest.raises(ResourceExhausted, match=r"already has 2 sessions \(--max-sessions 2\)"):
        client.session("n")
    sessions[0].close()
    client.session("n").close()
    sessions[1].close()
    # <socket>.jobs keeps at most --max-sessions connections open: one more is refused and closed.
    open_ = [jobs_socket(daemon), jobs_socket(daemon)]
    time.sleep(0.2)  # (accepted)
    third = jobs_socket(daemon)
    code, message = turned_away(third)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "(--max-sessions 2)" in message, message
    open_[0].close()
    time.sleep(0.2)
    again = jobs_socket(daemon)  # a place came free: this one is served
    again.sendall(frame(LOAD, pb.TransferRequest(session_id=os.urandom(16), job_id=1, keys=b"k" * 32, key_size=32,
                                                 block_ids=[0]).SerializeToString()))
    assert turned_away(again)[0] == grpc.StatusCode.NOT_FOUND.value[0]  # (a first frame names a live session)
    for s in (open_[1], third, again):
        s.close()


def test_layout_with_too_many_regions_is_refused_before_it_is_built(setup) -> None:
    daemon, _, _, stub = setup
    target = f"unix://{daemon.socket}"
    layout = pb.KVLayout(num_blocks=1, regions=[pb.Region(offset=i, block_stride=1, block_bytes=1)
                                                for i in range(4097)])
    expect(grpc.StatusCode.INVALID_ARGUMENT, "the layout has 4097 regions, more than --max-layout-regions 4096",
           stub.Register, pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, namespace="many", layout=layout,
                                             completion_slots=8, peer_token=peer_handshake(target),
                                             memories=[pb.MemoryHandle(backend="cpu", size=1 << 20)]))
    too_many = [pb.MemoryHandle(backend="cuda", size=1 << 20)] * 253
    expect(grpc.StatusCode.INVALID_ARGUMENT, "253 KV memories, more than --max-session-memories 252",
           stub.Register, pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, namespace="many",
                                             layout=pb.KVLayout(num_blocks=1, regions=[pb.Region(block_bytes=1)]),
                                             completion_slots=8, memories=too_many,
                                             peer_token=peer_handshake(target)))
    assert stub.Stats(pb.StatsRequest(), timeout=10).engines == 1  # only the fixture's engine


# -- <socket>.jobs: the same requests framed on a plain unix socket (kvstore_service/jobs_socket.py) ---------------


def jobs_socket(daemon) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(daemon.socket + SUFFIX)
    return s


def answer(s: socket.socket) -> tuple[int, bytes]:
    """(status code, payload) of the daemon's next reply frame."""
    def read(n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = s.recv(n - len(data))
            assert more, "the daemon closed the connection before its reply"
            data += more
        return data
    body = read(int.from_bytes(read(4), "little"))
    return body[0], body[1:]


def turned_away(s: socket.socket) -> tuple[int, str]:
    """The status code and message of a reply that turns the connection away; the connection is closed."""
    head, payload = answer(s)
    assert head == TURNED_AWAY, (head, payload)
    assert s.recv(1) == b""  # closed
    return payload[0], payload[1:].decode()


def test_the_jobs_socket_refuses_a_bad_frame_naming_it_and_closes_the_connection(setup) -> None:
    daemon = setup[0]
    for data, words in ((frame(9, b""), "unknown request kind 9"),
                        (frame(LOAD, b"\xff\xff\xff"), "not a valid TransferRequest"),
                        ((1 << 31).to_bytes(4, "little"), "a request frame of 2147483648 bytes")):
        s = jobs_socket(daemon)
        s.sendall(data)
        code, message = turned_away(s)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and words in message, message
        s.close()


def test_the_jobs_socket_answers_as_the_rpc_does_and_stays_open(setup) -> None:
    daemon, engine, keys, _ = setup
    s = jobs_socket(daemon)
    s.sendall(frame(LOAD, transfer(engine, keys[:1], [NUM_BLOCKS + 5], job_id=2000).SerializeToString()))
    code, message = answer(s)
    assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"outside the registered cache" in message
    s.sendall(frame(LOAD, transfer(engine, keys[:2], [20, 21], job_id=2001).SerializeToString()))
    code, body = answer(s)
    assert code == 0 and pb.TransferResponse.FromString(body).job_id == 2001
    # The connection serves the session its first frame named, only.
    s.sendall(frame(STORE, transfer(engine, keys[:1], [0], session_id=os.urandom(16)).SerializeToString()))
    assert turned_away(s) == (grpc.StatusCode.PERMISSION_DENIED.value[0], "this connection serves another session")
    s.close()
    s = jobs_socket(daemon)  # a first frame must name a live session
    s.sendall(frame(STORE, transfer(engine, keys[:1], [0], session_id=os.urandom(16)).SerializeToString()))
    code, message = turned_away(s)
    assert code == grpc.StatusCode.NOT_FOUND.value[0] and "unknown or ended session" in message
    s.close()
