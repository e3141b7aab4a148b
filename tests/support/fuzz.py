"""Fuzzing of every RPC of the daemon with hypothesis: strategies, oracles and the target.

Each case is one RPC (Register, Attach, Unregister, Lookup, ReleaseLease, Store, Load, Poll, Stats,
Clear, or raw bytes sent to any of them; Store and Load also as frames on `<socket>.jobs`, and raw
bytes there), or one exchange on the `<socket>.cred` handshake socket that
hands the daemon an engine's memory (memfds, by SCM_RIGHTS), against one real daemon process. A
Register case first does the handshake with adversarial descriptors: none, too many, unsealed or
too small memfds, a write-sealed one, a /dev/shm file, the daemon's own pool file, a pipe, a
directory, /dev/zero, a socket; and stale, reused or missing tokens. Properties:

* every call ends OK or with a well-defined status (INVALID_ARGUMENT, NOT_FOUND, ...), never
  UNKNOWN, INTERNAL, DEADLINE_EXCEEDED (a hang) or UNAVAILABLE (a crash), and, where the request
  says which, with the status the contract implies;
* the daemon process stays alive; jobs it accepts finish and report one result per block;
* a victim engine's blocks (leased, so neither Clear nor eviction may drop them) always hit and load
  byte-exact, into the fuzzing engine's differently laid out memory too, and once more at the end;
* a refused registration leaves nothing behind (no namespace), and memory that is not a sealed memfd
  (which its owner could shrink under the daemon's mapping: SIGBUS) is never accepted.

tests/process/test_fuzz.py runs a small sample of these strategies in CI; benchmarks/fuzz.py runs the long
version. Importable without pytest: `Target`, `run_case`, `final_check` and the strategies (`CASES`,
`any_case`).
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import text_format
from hypothesis import strategies as st

from kvstore_client.protocol import OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION, memfd
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_client.protocol.completion import HEADER, MAGIC, VERSION, channel_bytes
from kvstore_client.protocol.jobs_framing import LOAD, STORE, SUFFIX, TURNED_AWAY, frame
from support.blocks import content_of, key_of
from support.shm_engine import ShmEngine

SERVICE = "/kvstore.v1.KVStore/"
METHODS = ("Register", "Attach", "Unregister", "Lookup", "ReleaseLease", "Store", "Load", "Poll", "Stats",
           "Clear")
Code = grpc.StatusCode
WELL_DEFINED = {Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS, Code.FAILED_PRECONDITION,
                Code.RESOURCE_EXHAUSTED, Code.PERMISSION_DENIED, Code.OUT_OF_RANGE}
U64 = 2**64 - 1
U32 = 2**32 - 1
MAX_LEASE_TTL_MS = 600_000  # the daemon's default --max-lease-ttl-s
MAX_NAMESPACE_BYTES = 1024  # its default --max-namespace-bytes

VICTIM_NS = "fuzz-victim"
VICTIM_BLOCKS = 16
BLOCK = 4096  # the namespace's block size; the fuzzing engine splits it in two regions
ENGINE_BLOCKS = 32
ENGINE_REGIONS = ((0, 2048, 2048), (ENGINE_BLOCKS * 2048 + 512, 2048, 2048))
ENGINE_SLOTS = 64
KV_FILE_BYTES = 64 * 1024  # the KV memory Register cases hand over
VICTIM_KEYS = tuple(key_of("victim", i) for i in range(VICTIM_BLOCKS))
KV_ROLES = ("kv", "kv-unsealed", "kv-small", "kv-write-sealed", "shm-file", "pool", "pipe", "dir", "dev-zero",
            "socket", "channel")
CHANNEL_ROLES = ("channel", "channel-unsealed", "channel-small", "channel-bad-header", "kv", "pipe", "dev-zero",
                 "shm-file")
ALL_FDS = tuple(sorted(set(KV_ROLES + CHANNEL_ROLES)))


# -- references the target resolves -------------------------------------------------------------


@dataclass(frozen=True)
class Session:
    """A session id by role: engine (live, with KV memory), lookup (live, lookup-only), registered (one
    a Register case got; may have ended since), empty, or raw bytes (unknown to the daemon)."""

    role: str
    raw: bytes = b""
    index: int = 0


@dataclass(frozen=True)
class Lease:
    role: str  # issued (one a Lookup case got) or raw
    raw: bytes = b""
    index: int = 0


@dataclass(frozen=True)
class Case:
    method: str
    fields: dict = field(default_factory=dict, hash=False)
    raw: bytes | None = None  # set: send these bytes as the serialized request


# -- strategies -----------------------------------------------------------------------------------

sessions = st.one_of(
    st.sampled_from(["engine", "lookup", "empty"]).map(Session),
    st.integers(0, 15).map(lambda i: Session("registered", index=i)),
    st.binary(min_size=0, max_size=40).map(lambda b: Session("raw", raw=b)),
    st.binary(min_size=16, max_size=16).map(lambda b: Session("raw", raw=b)),
)
u64 = st.one_of(st.integers(0, 64), st.sampled_from([2**32, 2**63 - 1, 2**63, U64 - 1, U64, U64 - 4095]),
                st.integers(0, U64))
u32 = st.one_of(st.integers(0, 64), st.sampled_from([0, 1, U32 - 1, U32, 2**31]), st.integers(0, U32))
namespaces = st.one_of(st.sampled_from(["", VICTIM_NS, "fuzz-a", "fuzz-b", " ", "\x00", "ns/../x"]),
                       st.text(max_size=40))
fd_lists = st.one_of(
    st.tuples(st.sampled_from(CHANNEL_ROLES), st.sampled_from(KV_ROLES)).map(list),
    st.lists(st.sampled_from(ALL_FDS), max_size=3),
)
tokens = st.sampled_from(["fresh", "none", "random", "reused", "short"])


@st.composite
def packed_keys(draw) -> tuple[bytes, int]:
    """(keys, key_size): sizes 0..200 and the edges, odd lengths, duplicates, the victim's keys."""
    key_size = draw(st.one_of(st.sampled_from([16, 32, 32, 64]), st.integers(0, 200),
                              st.sampled_from([0, 15, 65, U32])))
    size = key_size if key_size <= 200 else draw(st.integers(0, 64))
    keys: list[bytes] = []
    for _ in range(draw(st.integers(0, 12))):
        choice = draw(st.integers(0, 3))
        if choice == 0 and size == 32:
            keys.append(draw(st.sampled_from(VICTIM_KEYS)))
        elif choice == 1 and keys:
            keys.append(draw(st.sampled_from(keys)))  # a duplicate
        else:
            keys.append(draw(st.binary(min_size=size, max_size=size)))
    packed = b"".join(keys)
    if draw(st.integers(0, 9)) == 0:
        packed += draw(st.binary(min_size=1, max_size=max(1, size - 1)))  # not a multiple of key_size
    return packed, key_size


# 32-byte keys, often the victim's (present, leased) or ones stored before
good_keys = st.lists(st.one_of(st.sampled_from(VICTIM_KEYS), st.binary(min_size=32, max_size=32),
                               st.sampled_from([bytes([i]) * 32 for i in range(8)])),
                     min_size=1, max_size=8, unique=True)
block_id_lists = st.one_of(
    st.lists(st.integers(0, ENGINE_BLOCKS + 1), max_size=10),  # out of range by one, duplicates
    st.lists(u64, max_size=10),  # 2^63, 2^64 - 1, ...
)


def _mutate(draw, fields: dict, mutations: dict[str, st.SearchStrategy]) -> dict:
    """A valid request with 0..3 of its fields replaced by adversarial values."""
    for name in draw(st.lists(st.sampled_from(sorted(mutations)), max_size=3)):
        fields[name] = draw(mutations[name])
    return fields


@st.composite
def transfer_cases(draw, method: str) -> Case:
    keys = draw(good_keys)
    fields = {"session_id": Session("engine"), "job_id": draw(u64), "keys": b"".join(keys), "key_size": 32,
              "block_ids": draw(st.lists(st.integers(0, ENGINE_BLOCKS - 1), min_size=len(keys), max_size=len(keys),
                                         unique=True)),
              "via": draw(st.sampled_from(["grpc", "jobs"])),  # the RPC, or a frame on <socket>.jobs
              # block ids as protocol 3's block_id_bytes or 2's block_ids, both at once, or bytes not whole uint64s
              "ids_as": draw(st.sampled_from(["bytes", "repeated", "both", "ragged"]))}
    fields = _mutate(draw, fields, {"session_id": sessions, "job_id": u64, "block_ids": block_id_lists,
                                    "keys": packed_keys(), "key_size": u32})
    if isinstance(fields["keys"], tuple):  # packed_keys() draws the key size with the keys
        fields["keys"], fields["key_size"] = fields["keys"]
    return Case(method, fields)


@st.composite
def lookup_cases(draw) -> Case:
    fields = {"session_id": draw(st.sampled_from([Session("engine"), Session("lookup"), Session("empty")])),
              "namespace": VICTIM_NS, "keys": b"".join(draw(good_keys)), "key_size": 32,
              "lease": draw(st.booleans()), "lease_ttl_ms": draw(st.sampled_from([0, 1, 100, 5000, U32]))}
    if fields["session_id"].role == "empty":
        fields["lease"] = False
    fields = _mutate(draw, fields, {"session_id": sessions, "namespace": namespaces, "keys": packed_keys(),
                                    "key_size": u32, "lease": st.booleans(), "lease_ttl_ms": u32})
    if isinstance(fields["keys"], tuple):
        fields["keys"], fields["key_size"] = fields["keys"]
    return Case("Lookup", fields)


regions = st.one_of(
    st.builds(lambda o, s, b: (o, s, b), st.sampled_from([0, 2048, 4096]), st.sampled_from([1024, 2048, 4096]),
              st.sampled_from([512, 1024, 2048])),
    st.builds(lambda o, s, b: (o, s, b), u64, u64, u64),
)
# Zero sizes, overlaps, no regions, regions ending past 2^64 (offset near 2^64, stride * num_blocks
# beyond 2^64), many regions.
bad_layouts = st.one_of(
    st.none(),  # lookup-only
    st.builds(lambda n, r: {"num_blocks": n, "regions": r}, u64, st.lists(regions, max_size=6)),
    st.builds(lambda n, o: {"num_blocks": n, "regions": [(o, 2**63, 4096)]}, st.sampled_from([2, 3, U64]), u64),
    st.builds(lambda o: {"num_blocks": 1, "regions": [(o, 4096, 4096)]}, st.sampled_from([U64 - 4095, U64, 2**63])),
)


@st.composite
def register_cases(draw) -> Case:
    """A valid registration (handshake with a sealed completion channel and KV memfd) with 0..3 of
    its parts replaced by adversarial ones."""
    namespace, block = draw(st.sampled_from([("fuzz-a", 1024), ("fuzz-b", 8192), (VICTIM_NS, BLOCK)]))
    fields: dict = {
        "protocol_version": PROTOCOL_VERSION, "engine_id": "fuzz", "namespace": namespace,
        "layout": {"num_blocks": draw(st.integers(1, KV_FILE_BYTES // block)), "regions": [(0, block, block)]},
        "backend": "cpu", "handle": b"", "size": KV_FILE_BYTES, "device": 0, "memory": True,
        "completion_slots": 8, "token": "fresh", "fds": ["channel", "kv"],
    }
    fields = _mutate(draw, fields, {
        "protocol_version": u32, "engine_id": st.text(max_size=20), "namespace": namespaces, "layout": bad_layouts,
        "backend": st.one_of(st.sampled_from(["", "cuda", "npu", "tpu", "CPU", "cpu\x00"]), st.text(max_size=8)),
        "handle": st.binary(max_size=60), "size": st.one_of(st.sampled_from([0, 1, KV_FILE_BYTES + 1, 64 << 20]), u64),
        "device": u32, "memory": st.just(False),
        "completion_slots": st.one_of(st.sampled_from([1, 65536, 0, 65537, U32]), u32),
        "token": tokens, "fds": fd_lists,
    })
    return Case("Register", fields)


handshake_cases = st.builds(
    lambda data, fds, close_early: Case("Handshake", {"data": data, "fds": fds, "close_early": close_early}),
    st.one_of(st.binary(max_size=40), st.binary(min_size=16, max_size=16)),
    st.lists(st.sampled_from(ALL_FDS), max_size=4),
    st.booleans())


simple_cases = {
    "Attach": st.builds(lambda s: Case("Attach", {"session_id": s}), sessions),
    "Unregister": st.builds(lambda s: Case("Unregister", {"session_id": s}),
                            sessions.filter(lambda s: s.role not in ("engine", "lookup"))),
    "ReleaseLease": st.builds(
        lambda s, lease: Case("ReleaseLease", {"session_id": s, "lease_id": lease}),
        st.one_of(st.just(Session("lease-owner")), sessions),
        st.one_of(st.integers(0, 7).map(lambda i: Lease("issued", index=i)),
                  st.binary(max_size=20).map(lambda b: Lease("raw", raw=b)))),
    "Stats": st.just(Case("Stats")),
    "Clear": st.builds(lambda ns: Case("Clear", {"namespace": ns}), namespaces),
}


@st.composite
def poll_cases(draw) -> Case:
    session = draw(sessions)
    # A live session with nothing finished waits wait_ms (capped at 60 s): keep those short.
    wait = draw(st.integers(0, 30)) if session.role in ("engine", "lookup", "registered") else draw(u32)
    return Case("Poll", {"session_id": session, "wait_ms": wait})


def _samples() -> list[bytes]:
    layout = pb.KVLayout(num_blocks=4, regions=[pb.Region(offset=0, block_stride=BLOCK, block_bytes=BLOCK)])
    return [
        pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, engine_id="e", namespace=VICTIM_NS, layout=layout,
                           memories=[pb.MemoryHandle(backend="cpu", handle=b"/dev/shm/x", size=BLOCK * 4)],
                           completion_slots=8, peer_token=b"t" * 16).SerializeToString(),
        pb.TransferRequest(session_id=b"s" * 16, job_id=7, keys=VICTIM_KEYS[0], key_size=32,
                           block_ids=[1, 2]).SerializeToString(),
        pb.LookupRequest(namespace=VICTIM_NS, keys=VICTIM_KEYS[0], key_size=32, lease=True).SerializeToString(),
        pb.PollRequest(session_id=b"s" * 16, wait_ms=5).SerializeToString(),
    ]


@st.composite
def raw_bytes(draw) -> bytes:
    """Random bytes, or a valid serialization truncated, bit-flipped or with bytes spliced in."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=80))
    data = bytearray(draw(st.sampled_from(_samples())))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 2))
        at = draw(st.integers(0, len(data)))
        if op == 0:
            del data[at:]
        elif op == 1 and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
    return bytes(data)


raw_cases = st.builds(lambda m, b: Case(m, raw=b), st.sampled_from(METHODS), raw_bytes())
# Bytes on <socket>.jobs: as they come, or framed (a length that fits) behind a request kind byte.
jobs_raw_cases = st.builds(lambda framed, kind, b: Case("Jobs", {"framed": framed, "kind": kind}, raw=b),
                           st.booleans(), st.sampled_from([STORE, LOAD, 0, 3, 255]), raw_bytes())

CASES: dict[str, st.SearchStrategy[Case]] = {
    "Register": register_cases(),
    "Lookup": lookup_cases(),
    "Store": transfer_cases("Store"),
    "Load": transfer_cases("Load"),
    "Poll": poll_cases(),
    "Handshake": handshake_cases,
    **simple_cases,
    "raw": raw_cases,
    "Jobs": jobs_raw_cases,
}
any_case = st.one_of(*CASES.values())


# -- the target ----------------------------------------------------------------------------------


class Target:
    """A running daemon, a victim engine whose blocks must survive, a fuzzing engine and lookup-only
    session (both live), descriptors to hand over in handshakes, and the state cases share."""

    def __init__(self, socket: str, pool_path: str, alive: Callable[[], bool], workdir: str,
                 timeout: float = 10.0, job_timeout: float = 3.0) -> None:
        self.socket, self.pool_path, self.alive, self.timeout = socket, pool_path, alive, timeout
        self.job_timeout = job_timeout  # a job of a few 4 KiB blocks takes milliseconds
        self.workdir = workdir
        self.channel = grpc.insecure_channel(f"unix://{socket}", options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.raw_unary = {m: self.channel.unary_unary(SERVICE + m) for m in METHODS if m != "Attach"}
        self.raw_attach = self.channel.unary_stream(SERVICE + "Attach")
        self.statuses: Counter[tuple[str, str]] = Counter()
        self.registered: list[bytes] = []
        self.leases: list[tuple[str, bytes, bytes]] = []  # (session role, session id, lease id)
        self.cases = 0
        self.used_tokens: list[bytes] = []
        self.shm_file = f"/dev/shm/kvstore-fuzz-{secrets.token_hex(4)}"
        with open(self.shm_file, "wb") as f:
            f.truncate(KV_FILE_BYTES)
        self.victim = ShmEngine.contiguous(socket, VICTIM_NS, VICTIM_BLOCKS, BLOCK)
        done = self.victim.store(list(VICTIM_KEYS), list(range(VICTIM_BLOCKS)))
        assert done.ok, done
        hits, self.victim_lease = self.victim.session.lookup(list(VICTIM_KEYS), lease=True,
                                                             lease_ttl_ms=MAX_LEASE_TTL_MS)
        assert hits == VICTIM_BLOCKS and self.victim_lease
        self.engine = ShmEngine(socket, VICTIM_NS, ENGINE_BLOCKS, ENGINE_REGIONS, completion_slots=ENGINE_SLOTS)
        self.lookup = self.victim.client.session(VICTIM_NS)
        self.boot_id = self.engine.session.boot_id
        # The cases' connections to <socket>.jobs, one per session named: a connection serves one session.
        self.jobs: dict[bytes, socket.socket] = {}

    # -- the handshake -------------------------------------------------------------------------

    def descriptor(self, role: str, slots: int) -> int:
        """A new descriptor of the kind `role` names; the caller closes it."""
        if role.startswith("channel"):
            good = slots if 0 < slots <= 65536 else 8
            size = 64 if role == "channel-small" else channel_bytes(good)
            fd = os.memfd_create("kvstore-fuzz-done", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, size)
            os.pwrite(fd, HEADER.pack(b"NOTDONE!" if role == "channel-bad-header" else MAGIC, VERSION, good), 0)
            if role != "channel-unsealed":
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memfd.SEALS)
            return fd
        if role.startswith("kv"):
            fd = os.memfd_create("kvstore-fuzz-kv", os.MFD_ALLOW_SEALING)
            os.ftruncate(fd, 4096 if role == "kv-small" else KV_FILE_BYTES)
            if role == "kv-write-sealed":
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memfd.SEALS | fcntl.F_SEAL_WRITE)
            elif role != "kv-unsealed":
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, memfd.SEALS)
            return fd
        if role == "shm-file":
            return os.open(self.shm_file, os.O_RDWR)
        if role == "pool":  # the daemon's own pool: shared memory, but a file anyone may shrink
            return os.open(self.pool_path, os.O_RDWR)
        if role == "pipe":
            r, w = os.pipe()
            os.close(w)
            return r
        if role == "dir":
            return os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY)
        if role == "dev-zero":
            return os.open("/dev/zero", os.O_RDWR)
        if role == "socket":
            a, b = socket.socketpair()
            b.close()
            return a.detach()
        raise ValueError(role)

    def handshake(self, data: bytes, roles: list[str], slots: int = 8, close_early: bool = False) -> bytes | None:
        """Send `data` and descriptors of `roles` on <socket>.cred; the daemon's answer (b"" if it
        just closed), or None when we hang up first."""
        fds = [self.descriptor(r, slots) for r in roles]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(self.timeout)
                sock.connect(self.socket + ".cred")
                if data or fds:
                    socket.send_fds(sock, [data], fds)
                if close_early:
                    return None
                sock.shutdown(socket.SHUT_WR)
                return sock.recv(1)
        finally:
            for fd in fds:
                os.close(fd)

    def token(self, role: str, fds: list[str], slots: int) -> bytes:
        """A peer token: after a handshake that hands over `fds` (fresh, short), or not."""
        if role == "none":
            return b""
        if role == "random":
            return secrets.token_bytes(16)
        if role == "reused" and self.used_tokens:
            return self.used_tokens[-1]
        token = secrets.token_bytes(16)
        reply = self.handshake(token[:8] if role == "short" else token, fds, slots)
        if role != "short" and reply != b"\x00":
            raise AssertionError(f"the handshake was refused: {reply!r}")
        self.used_tokens = [*self.used_tokens[-7:], token]
        return token

    # -- sessions --------------------------------------------------------------------------------

    def session(self, ref: Session) -> tuple[bytes, str]:
        """(session id, what the daemon knows of it: live, lookup, unknown, or maybe)."""
        if ref.role == "engine":
            return self.engine.session.session_id, "live"
        if ref.role == "lookup":
            return self.lookup.session_id, "lookup"
        if ref.role == "registered" and self.registered:
            return self.registered[ref.index % len(self.registered)], "maybe"
        raw = ref.raw if ref.role == "raw" else b""
        known = {self.engine.session.session_id, self.lookup.session_id, self.victim.session.session_id,
                 *self.registered}
        return raw, "maybe" if raw in known else "unknown"

    def lease(self, ref: Lease, state: str, session_id: bytes) -> tuple[bytes, bool]:
        """(lease id, whether this session took it and did not release it yet)."""
        if ref.role == "issued" and self.leases:
            owner_role, owner, lease_id = self.leases[ref.index % len(self.leases)]
            return lease_id, owner == session_id and owner_role in ("live", "lookup")
        return ref.raw, False

    # -- calls -----------------------------------------------------------------------------------

    def jobs_call(self, method: str, request: pb.TransferRequest) -> tuple[Code, object]:
        """Store or Load as a frame on <socket>.jobs: the reply's status, and its TransferResponse (or
        the refusal's message). A connection the daemon closed is opened again for the next case."""
        jobs = self.jobs.get(request.session_id)
        try:
            if jobs is None:
                jobs = self.jobs[request.session_id] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                jobs.settimeout(self.timeout)
                jobs.connect(self.socket + SUFFIX)
            jobs.sendall(frame(STORE if method == "Store" else LOAD, request.SerializeToString()))
            body = _read_frame(jobs)
        except OSError:
            body = None
        if not body or body[0] == TURNED_AWAY:  # (closed)
            jobs = self.jobs.pop(request.session_id, None)
            if jobs is not None:
                jobs.close()
        if body is None:
            code, reply = Code.UNAVAILABLE, None
        else:
            code, message = _reply_status(body)
            reply = pb.TransferResponse.FromString(message) if code == Code.OK else message.decode(errors="replace")
        self.statuses[(f"{method} on {SUFFIX}", code.name)] += 1
        return code, reply

    def raw_jobs(self, data: bytes) -> list[int]:
        """Send these bytes on a new connection to <socket>.jobs and stop writing: the status bytes of
        every reply frame until the daemon closes it. OSError (TimeoutError: it neither answered nor
        closed) otherwise."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            s.connect(self.socket + SUFFIX)
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            codes = []
            while (body := _read_frame(s)) is not None:
                codes.append(_reply_status(body)[0].value[0] if body else -1)
            return codes

    def call(self, method: str, request, count: bool = True) -> tuple[Code, object]:
        try:
            reply = getattr(self.stub, method)(request, timeout=self.timeout)
            code = Code.OK
        except grpc.RpcError as e:
            reply, code = e, e.code()  # type: ignore[attr-defined]
        if count:
            self.statuses[(method, code.name)] += 1
        return code, reply

    def close(self) -> None:
        for jobs in self.jobs.values():
            jobs.close()
        for closer in (self.lookup.close, self.engine.close, self.victim.close, self.channel.close):
            try:
                closer()
            except Exception:  # noqa: BLE001 - best effort teardown
                pass
        os.unlink(self.shm_file)


# -- one case --------------------------------------------------------------------------------------


def _brief(message) -> str:
    return text_format.MessageToString(message, as_one_line=True)[:400]


def _split_ok(keys: bytes, key_size: int) -> list[bytes] | None:
    if not 16 <= key_size <= 64 or len(keys) % key_size:
        return None
    return [keys[i: i + key_size] for i in range(0, len(keys), key_size)]


def _expect(code: Code, allowed: set[Code], what: str) -> list[str]:
    return [] if code in allowed else [f"{what} | got {code.name}, expected {sorted(c.name for c in allowed)}"]


def run_case(t: Target, case: Case) -> list[str]:
    """Run one case; returns the property violations (empty: all held)."""
    t.cases += 1
    if case.raw is not None:
        problems = _raw(t, case)
    else:
        problems = globals()[f"_{case.method.lower()}"](t, case.fields)
    if not t.alive():
        problems.append("daemon | the daemon process died")
    return problems


def _status(number: int) -> Code:
    return next((c for c in Code if c.value[0] == number), Code.UNKNOWN)


def _reply_status(body: bytes) -> tuple[Code, bytes]:
    """A <socket>.jobs reply's status and the rest: a TransferResponse, or a refusal's message (also
    of a reply that turns the connection away)."""
    if body[0] == TURNED_AWAY and len(body) > 1:
        return _status(body[1]), body[2:]
    return _status(body[0]), body[1:]


def _read_frame(s: socket.socket) -> bytes | None:
    """The body of the next frame; None at the end of the stream."""
    def read(n: int) -> bytes | None:
        data = b""
        while len(data) < n:
            more = s.recv(n - len(data))
            if not more:
                return None if not data else data
            data += more
        return data
    head = read(4)
    if head is None or len(head) < 4:
        return None
    return read(int.from_bytes(head, "little")) or b""


def _jobs_raw(t: Target, case: Case) -> list[str]:
    raw = case.raw or b""
    data = frame(case.fields["kind"], raw) if case.fields["framed"] else raw
    what = f"bytes {data[:60]!r} ({len(data)}) on {SUFFIX}"
    try:
        codes = t.raw_jobs(data)
    except OSError as e:
        return [f"{what} | neither answered nor closed: {e}"]
    statuses = [_status(c) for c in codes]
    t.statuses[(f"raw {SUFFIX}", ",".join(s.name for s in statuses) or "closed")] += 1
    return [f"{what} | reply status {s.name}" for s in statuses if s not in WELL_DEFINED]


def _raw(t: Target, case: Case) -> list[str]:
    if case.method == "Jobs":
        return _jobs_raw(t, case)
    if case.method == "Attach":
        call = t.raw_attach(case.raw, timeout=t.timeout)
        try:
            next(call)
            code = Code.OK
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
        except StopIteration:
            code = Code.OK
        call.cancel()
    else:
        try:
            t.raw_unary[case.method](case.raw, timeout=t.timeout)
            code = Code.OK
        except grpc.RpcError as e:
            code = e.code()  # type: ignore[attr-defined]
    t.statuses[(f"raw {case.method}", code.name)] += 1
    return _expect(code, WELL_DEFINED, f"raw bytes {case.raw!r} to {case.method}")


def _register_allowed(f: dict, size: int, good: bool) -> set[Code]:
    """The order of the daemon's checks decides which status a request with several faults gets."""
    layout, slots = f["layout"], f["completion_slots"]
    if f["token"] != "fresh":  # Register on the unix socket needs the caller's handshake
        return {Code.PERMISSION_DENIED}
    if not OLDEST_PROTOCOL_VERSION <= f["protocol_version"] <= PROTOCOL_VERSION:
        return {Code.FAILED_PRECONDITION}
    if not f["namespace"] or _CONTROL.search(f["namespace"]):
        return {Code.INVALID_ARGUMENT}
    if layout is None:
        return {Code.OK, Code.RESOURCE_EXHAUSTED}
    if not _layout_fits(layout, size) or not 0 < slots <= 65536:
        return {Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED}
    if f["backend"] in ("", "cpu") and not good:
        return {Code.INVALID_ARGUMENT, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED}
    return WELL_DEFINED


def _register(t: Target, f: dict) -> list[str]:
    slots = f["completion_slots"]
    token = t.token(f["token"], f["fds"], slots)
    request = pb.RegisterRequest(protocol_version=f["protocol_version"], engine_id=f["engine_id"],
                                 namespace=f["namespace"], completion_slots=slots, peer_token=token)
    layout = f["layout"]
    if layout is not None:
        request.layout.CopyFrom(pb.KVLayout(num_blocks=layout["num_blocks"], regions=[
            pb.Region(offset=o, block_stride=s, block_bytes=b) for o, s, b in layout["regions"]]))
    size = f["size"] if f["memory"] else 0
    if f["memory"]:
        request.memories.append(pb.MemoryHandle(backend=f["backend"], handle=f["handle"], size=size,
                                                device=f["device"]))
    namespaces_before = _namespaces(t)
    code, reply = t.call("Register", request)
    what = f"Register {_brief(request)} token={f['token']} fds={f['fds']}"
    # The daemon takes the completion channel, then one descriptor per KV memory (here: one).
    handed = f["fds"] if f["token"] == "fresh" else []
    good = handed == ["channel", "kv"]
    problems = _expect(code, _register_allowed(f, size, good), what)
    if code == Code.OK and layout is not None and f["backend"] in ("", "cpu") and not good:
        problems.append(f"{what} | accepted without a sealed completion channel and KV memfd")
    if code == Code.OK:
        assert isinstance(reply, pb.RegisterResponse)
        block_bytes = sum(r[2] for r in layout["regions"]) if layout else 0
        if len(reply.session_id) != 16 or reply.block_bytes != block_bytes or reply.daemon_boot_id != t.boot_id:
            problems.append(f"{what} | bad reply {reply}")
        t.registered = [*t.registered[-15:], reply.session_id]
    elif f["namespace"] not in namespaces_before and f["namespace"] in _namespaces(t):
        problems.append(f"{what} | the refused registration created its namespace: {f['namespace']!r}")
    return problems


def _namespaces(t: Target) -> set[str]:
    code, reply = t.call("Stats", pb.StatsRequest(), False)
    return {ns.namespace for ns in reply.namespaces} if code == Code.OK else set()  # type: ignore[union-attr]


def _handshake(t: Target, f: dict) -> list[str]:
    """Whatever comes on the handshake socket, the daemon lives and goes on accepting handshakes."""
    try:
        reply = t.handshake(f["data"], f["fds"], close_early=f["close_early"])
    except OSError as e:
        return [f"Handshake {f} | {type(e).__name__}"]
    t.statuses[("Handshake", "none" if reply is None else repr(reply))] += 1
    problems = []
    # A 16-byte token with at most MAX_FDS descriptors (more than the fuzzer sends) is accepted.
    if reply is not None and len(f["data"]) == 16 and reply != b"\x00":
        problems.append(f"Handshake {f} | a 16-byte token was not accepted: {reply!r}")
    if t.handshake(secrets.token_bytes(16), []) != b"\x00":
        problems.append(f"Handshake {f} | the next handshake was not accepted")
    return problems


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # refused in namespaces (tenants.py)


def _layout_fits(layout: dict, memory_size: int) -> bool:
    n, regs = layout["num_blocks"], layout["regions"]
    if n <= 0 or not regs:
        return False
    for offset, stride, size in regs:
        if size <= 0 or (stride < size and n > 1) or offset + (n - 1) * stride + size > memory_size:
            return False
    return True


def _attach(t: Target, f: dict) -> list[str]:
    session_id, state = t.session(f["session_id"])
    call = t.stub.Attach(pb.AttachRequest(session_id=session_id), timeout=t.timeout)
    event = None
    try:
        event = next(call)
        code = Code.OK
    except grpc.RpcError as e:
        code = e.code()  # type: ignore[attr-defined]
    except StopIteration:
        code = Code.OK
    call.cancel()  # the stream closes: the daemon ends that session
    t.statuses[("Attach", code.name)] += 1
    allowed = {"unknown": {Code.NOT_FOUND}, "live": {Code.ALREADY_EXISTS}, "lookup": {Code.ALREADY_EXISTS},
               "maybe": {Code.OK, Code.NOT_FOUND, Code.ALREADY_EXISTS}}[state]
    problems = _expect(code, allowed, f"Attach {session_id!r} ({state})")
    if code == Code.OK and (event is None or event.attached.daemon_boot_id != t.boot_id):
        problems.append(f"Attach {session_id!r} | first event is not Attached: {event}")
    return problems


def _unregister(t: Target, f: dict) -> list[str]:
    session_id, state = t.session(f["session_id"])
    code, _ = t.call("Unregister", pb.UnregisterRequest(session_id=session_id))
    allowed = {Code.NOT_FOUND} if state == "unknown" else {Code.OK, Code.NOT_FOUND}
    return _expect(code, allowed, f"Unregister {session_id!r} ({state})")


def _lookup_allowed(f: dict, session_id: bytes, state: str, keys: list[bytes] | None) -> set[Code]:
    ns = f["namespace"]
    if keys is None:
        return {Code.INVALID_ARGUMENT}
    if session_id:
        if state == "unknown":
            return {Code.NOT_FOUND}
        if state == "maybe":
            return WELL_DEFINED
        if ns and ns != VICTIM_NS:
            return {Code.PERMISSION_DENIED}
        if f["lease"] and f["lease_ttl_ms"] > MAX_LEASE_TTL_MS:
            return {Code.INVALID_ARGUMENT}
        return {Code.OK}
    if f["lease"] or not ns or len(ns.encode()) > MAX_NAMESPACE_BYTES or _CONTROL.search(ns):
        return {Code.INVALID_ARGUMENT}
    return {Code.OK}


def _lookup(t: Target, f: dict) -> list[str]:
    session_id, state = t.session(f["session_id"])
    request = pb.LookupRequest(session_id=session_id, namespace=f["namespace"], keys=f["keys"],
                               key_size=f["key_size"], lease=f["lease"], lease_ttl_ms=f["lease_ttl_ms"])
    code, reply = t.call("Lookup", request)
    what = f"Lookup {_brief(request)}"
    keys = _split_ok(f["keys"], f["key_size"])
    ns = f["namespace"]
    allowed = _lookup_allowed(f, session_id, state, keys)
    problems = _expect(code, allowed, what)
    if code != Code.OK or keys is None:
        return problems
    assert isinstance(reply, pb.LookupResponse)
    in_victim_ns = (ns == VICTIM_NS) if not session_id else state in ("live", "lookup")
    leading = next((i for i, k in enumerate(keys) if k not in VICTIM_KEYS), len(keys))
    if reply.hits > len(keys) or (in_victim_ns and reply.hits < leading):
        problems.append(f"{what} | {reply.hits} hits, but the {leading} leading keys are the victim's (always present)")
    if reply.lease_id and (not f["lease"] or not session_id or reply.hits == 0):
        problems.append(f"{what} | unexpected lease {reply.lease_id!r}")
    if f["lease"] and session_id and reply.hits and len(reply.lease_id) != 16:
        problems.append(f"{what} | no lease for {reply.hits} hits")
    if reply.lease_id:
        t.leases = [*t.leases[-7:], (state, session_id, reply.lease_id)]
    return problems


def _releaselease(t: Target, f: dict) -> list[str]:
    lease: Lease = f["lease_id"]
    if f["session_id"].role == "lease-owner" and lease.role == "issued" and t.leases:
        state, session_id, _ = t.leases[lease.index % len(t.leases)]
    else:
        session_id, state = t.session(f["session_id"])
    lease_id, owned = t.lease(lease, state, session_id)
    code, _ = t.call("ReleaseLease", pb.ReleaseLeaseRequest(session_id=session_id, lease_id=lease_id))
    if state == "unknown":
        allowed = {Code.NOT_FOUND}
    elif state == "maybe" or owned:
        allowed = {Code.OK, Code.NOT_FOUND}  # an owned lease may have expired
    else:
        allowed = {Code.NOT_FOUND}
    if code == Code.OK:
        t.leases = [x for x in t.leases if x[2] != lease_id]
    return _expect(code, allowed, f"ReleaseLease {session_id!r} ({state}) lease {lease_id!r}")


def _store(t: Target, f: dict) -> list[str]:
    return _transfer(t, f, True)


def _load(t: Target, f: dict) -> list[str]:
    return _transfer(t, f, False)


def _transfer_allowed(f: dict, state: str, is_store: bool) -> set[Code]:
    keys = _split_ok(f["keys"], f["key_size"])
    ids = f["block_ids"]
    if keys is None:
        return {Code.INVALID_ARGUMENT}
    if state == "unknown":
        return {Code.NOT_FOUND}
    if state == "maybe":
        return WELL_DEFINED
    if f.get("ids_as") == "ragged" or (f.get("ids_as") == "both" and ids):
        return {Code.INVALID_ARGUMENT}
    if state == "lookup":
        return {Code.FAILED_PRECONDITION}
    if (len(keys) != len(ids) or not keys or any(b >= ENGINE_BLOCKS for b in ids) or len(set(keys)) != len(keys)
            or (not is_store and len(set(ids)) != len(ids))):
        return {Code.INVALID_ARGUMENT}
    if f["job_id"] == U64:  # its completion sequence number (job_id + 1) would not fit 64 bits
        return {Code.OK, Code.INVALID_ARGUMENT}
    return {Code.OK}  # every earlier job of the engine finished: its completion slots are free


def _transfer_request(session_id: bytes, f: dict) -> pb.TransferRequest:
    """The case's request, its block ids in the form it drew (`ids_as`)."""
    request = pb.TransferRequest(session_id=session_id, job_id=f["job_id"], keys=f["keys"], key_size=f["key_size"])
    ids, form = f["block_ids"], f.get("ids_as", "repeated")
    if form != "bytes":
        request.block_ids.extend(ids)
    if form != "repeated":
        request.block_id_bytes = struct.pack(f"<{len(ids)}Q", *ids) + (b"\0" if form == "ragged" else b"")
    return request


def _transfer(t: Target, f: dict, is_store: bool) -> list[str]:
    method = "Store" if is_store else "Load"
    session_id, state = t.session(f["session_id"])
    allowed = _transfer_allowed(f, state, is_store)
    keys = _split_ok(f["keys"], f["key_size"]) or []
    ids = f["block_ids"]
    engine = t.engine
    if allowed == {Code.OK}:  # the engine's own valid job: known bytes in, known bytes expected out
        if is_store:
            engine.fill(keys, ids)
        else:
            engine.zero(ids)
    request = _transfer_request(session_id, f)
    code, reply = t.jobs_call(method, request) if f.get("via") == "jobs" else t.call(method, request)
    what = f"{method} job {f['job_id']} ({state}, {len(keys)} keys, blocks {ids[:16]}, via {f.get('via', 'grpc')})"
    problems = _expect(code, allowed, what)
    if code != Code.OK or state != "live":
        return problems
    assert isinstance(reply, pb.TransferResponse)
    if reply.job_id != f["job_id"]:
        problems.append(f"{what} | reply names job {reply.job_id}")
    result = _wait_job(t, f["job_id"])
    if result is None:
        return [*problems, f"{what} | accepted, but never reported a result"]
    if result.is_store != is_store or len(result.block_ok) != len(keys):
        return [*problems, f"{what} | result does not match the request: {result}"]
    for key, block, ok in zip(keys, ids, result.block_ok, strict=True):
        if key in VICTIM_KEYS and not ok:
            problems.append(f"{what} | a victim's block failed: {result.error!r}")
        if not is_store:
            data = engine.read(block)
            if key in VICTIM_KEYS and ok and data != content_of(key, BLOCK):
                problems.append(f"{what} | a victim's block loaded wrong bytes")
            if not ok and data != bytes(BLOCK):
                problems.append(f"{what} | a failed block was written to (engine block {block})")
    return problems


def _wait_job(t: Target, job_id: int) -> pb.JobResult | None:
    """The job's result from Poll; None if the daemon has no job in flight any more and never
    reported this one, or after job_timeout."""
    deadline = time.monotonic() + t.job_timeout
    idle = False
    while time.monotonic() < deadline:
        code, reply = t.call("Poll", pb.PollRequest(session_id=t.engine.session.session_id, wait_ms=0 if idle else 50),
                             False)
        if code != Code.OK:
            return None
        assert isinstance(reply, pb.PollResponse)
        for job in reply.jobs:
            if job.job_id == job_id:
                return job
        if idle:
            return None
        code, stats = t.call("Stats", pb.StatsRequest(), False)
        idle = code == Code.OK and stats.jobs_in_flight == 0  # type: ignore[union-attr]
    return None


def _poll(t: Target, f: dict) -> list[str]:
    session_id, state = t.session(f["session_id"])
    code, _ = t.call("Poll", pb.PollRequest(session_id=session_id, wait_ms=f["wait_ms"]))
    allowed = {"unknown": {Code.NOT_FOUND}, "live": {Code.OK}, "lookup": {Code.OK},
               "maybe": {Code.OK, Code.NOT_FOUND}}[state]
    return _expect(code, allowed, f"Poll {session_id!r} ({state}) wait_ms {f['wait_ms']}")


def _stats(t: Target, f: dict) -> list[str]:
    code, reply = t.call("Stats", pb.StatsRequest())
    problems = _expect(code, {Code.OK}, "Stats")
    if code == Code.OK:
        assert isinstance(reply, pb.StatsResponse)
        if reply.engines < 2 or reply.leases < 1 or reply.used_bytes > reply.capacity_bytes:
            problems.append(f"Stats | implausible: {reply}")
        if reply.blocks != sum(ns.blocks for ns in reply.namespaces):
            problems.append(f"Stats | blocks differ from the namespaces' sum: {reply}")
    return problems


def _clear(t: Target, f: dict) -> list[str]:
    code, _ = t.call("Clear", pb.ClearRequest(namespace=f["namespace"]))
    problems = _expect(code, {Code.OK}, f"Clear {f['namespace']!r}")
    code, reply = t.call("Lookup", pb.LookupRequest(namespace=VICTIM_NS, keys=b"".join(VICTIM_KEYS), key_size=32),
                         False)
    if code != Code.OK or reply.hits != VICTIM_BLOCKS:  # type: ignore[union-attr]
        problems.append(f"Clear {f['namespace']!r} | leased blocks of the victim are gone ({code.name})")
    return problems


# -- the end --------------------------------------------------------------------------------------


def final_check(t: Target) -> list[str]:
    """After fuzzing: the daemon lives, the victim's blocks load byte-exact, a new engine can still
    register, store and load, and no job is left in flight."""
    problems = [] if t.alive() else ["the daemon process died"]
    if problems:
        return problems
    # Sessions that Register cases left unattached end after the attach timeout (3 s in the tests),
    # and the daemon unlinks their files then: wait for that before looking at the files.
    deadline = time.monotonic() + 15
    while t.victim.client.stats().engines > 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ids = list(range(VICTIM_BLOCKS))
    done = t.victim.load(list(VICTIM_KEYS), ids)
    if done.blocks_ok != VICTIM_BLOCKS:
        problems.append(f"the victim's blocks no longer load: {done}")
    corrupt = t.victim.corrupt_blocks(list(VICTIM_KEYS), ids)
    if corrupt:
        problems.append(f"{corrupt} of the victim's blocks load wrong bytes")
    if not os.path.exists(t.pool_path):
        problems.append(f"{t.pool_path} was unlinked")
    try:
        newcomer = ShmEngine.contiguous(t.socket, "fuzz-newcomer", 2, BLOCK, timeout=t.timeout)
        key = key_of("newcomer", 0)
        if not newcomer.store([key], [0]).ok or newcomer.load([key], [1]).blocks_ok != 1 \
                or newcomer.corrupt_blocks([key], [1]):
            problems.append("a new engine cannot store and load")
        newcomer.close()
    except Exception as e:  # noqa: BLE001 - any failure to register is the finding
        problems.append(f"a new engine cannot register: {e}")
    deadline = time.monotonic() + 10
    while (stats := t.victim.client.stats()).jobs_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    if stats.jobs_in_flight:
        problems.append(f"{stats.jobs_in_flight} jobs still in flight")
    return problems
