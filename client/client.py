"""Sync client: operator calls (stats, lookup, clear, health) and engine sessions.

A `Session` is what an engine holds: it registers the engine's KV memory, keeps the Attach stream
open (the daemon ends the session when it closes), submits store/load jobs without blocking the
caller (a sender thread makes the RPCs), and learns completions from shared memory, with no RPC.
When the daemon restarts, the session registers again on its own; jobs that were in flight are
reported failed.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore_client.errors import (
    FailedPrecondition,
    KVStoreError,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
    error_of,
    from_rpc_error,
)
from kvstore_client.protocol import PROTOCOL_VERSION, default_socket, pack_block_ids
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_client.protocol.completion import POLL_S, Completion, CompletionChannel
from kvstore_client.protocol.jobs_framing import LOAD, MAX_REQUEST_BYTES, STORE, SUFFIX, TURNED_AWAY, frame

log = logging.getLogger(__name__)

_Reply = TypeVar("_Reply")
MAX_MESSAGE = 64 << 20
# wait(): the longest sleep between checks for completions. The daemon's posts wake a waiter, and so
# do the jobs the client fails itself (CompletionChannel.wake); where nothing can wake it, it polls
# (POLL_S). A 1 ms slice woke a client waiting for a 512 MiB load ~25 times, ~1 ms of CPU per load
# taken from the copy threads' cores (2-vCPU VM: loads 0.75 -> 0.83 of the copy engine at 50 ms).
WAIT_SLICE_S = 0.05
# A job given up on (`give_up_s`) expires this much earlier in the daemon: a chunk's copy that started
# just before its expiry is not interrupted (a chunk copies in milliseconds).
COPY_MARGIN_S = 0.5
TURNED_AWAY_S = 30.0  # the daemon's <socket>.jobs turned this client away: gRPC for this long
# A session's retries: a daemon away is back within seconds; a refusal (a limit, a setting, another PID
# namespace) rarely changes by itself, and each retry of a device engine exports its KV memory again.
RETRY_MAX_S = 5.0
REFUSED_RETRY_MAX_S = 300.0


def next_retry_s(last: float, refused: bool) -> float:
    """The wait before a session's next registration attempt, after one of `last` seconds."""
    return min(last * 2, REFUSED_RETRY_MAX_S if refused else RETRY_MAX_S)


def target_for(socket: str | None) -> str:
    """A unix socket path, or an explicit gRPC target such as `dns:host:port`."""
    socket = socket or default_socket()
    if socket.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return socket
    return f"unix://{os.path.abspath(socket)}"


# The daemon's answers to a handshake over a limit of handshakes in progress (kvstore_service.peercred).
_BUSY = {b"\x03": "--max-handshakes-per-uid: of this uid", b"\x04": "--max-handshakes: of all uids"}


def peer_handshake(target: str, fds: Sequence[int] = (), timeout: float = 5.0) -> bytes:
    """Tell the daemon who we are (it reads SO_PEERCRED on `<socket>.cred`) and hand it our shared
    memory (`fds`, by SCM_RIGHTS); returns the token to name in Register/Clear, or b"" for a daemon
    reached over TCP."""
    if not target.startswith("unix:"):
        return b""
    token = secrets.token_bytes(16)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(target.removeprefix("unix://").removeprefix("unix:") + ".cred")
            try:
                socket.send_fds(sock, [token], list(fds))
            except (BrokenPipeError, ConnectionResetError):
                pass  # a daemon over a handshake limit answers and closes at once, maybe before our send
            reply = sock.recv(1)
        except OSError as e:
            raise Unavailable(f"UNAVAILABLE: cannot reach the daemon's handshake socket: {e}") from None
    if not reply:
        raise Unavailable("UNAVAILABLE: the daemon closed the handshake socket without an answer")
    if reply == b"\x01":
        raise PermissionDenied(f"PERMISSION_DENIED: the daemon does not allow uid {os.getuid()}")
    if reply in _BUSY:
        raise ResourceExhausted(f"RESOURCE_EXHAUSTED: the daemon has too many handshakes in progress "
                                f"({_BUSY[reply]}); retry shortly")
    if reply != b"\x00":
        raise ResourceExhausted(f"RESOURCE_EXHAUSTED: the daemon refused the handshake: a short token, or "
                                f"descriptors lost in transit (sent {len(fds)})")
    return token


def identity_token(target: str) -> bytes:
    """A handshake token that says who we are, or b"" where the daemon does not accept our uid."""
    try:
        return peer_handshake(target)
    except PermissionDenied:
        return b""


def registration(target: str, engine_id: str, namespace: str, memory: MemorySpec | None,
                 channel: CompletionChannel | None) -> pb.RegisterRequest:
    """A RegisterRequest, after the handshake that hands the daemon our shared memory."""
    fds = []
    if memory is not None:
        assert channel is not None
        fds = [channel.fd, *memory.fds]
    token = peer_handshake(target, fds)
    request = pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, engine_id=engine_id, namespace=namespace,
                                 peer_token=token)
    if memory is not None and channel is not None:
        if not token:
            raise FailedPrecondition("FAILED_PRECONDITION: KV memory can only be registered over the daemon's "
                                     "unix socket (on the same host)")
        request.layout.CopyFrom(memory.layout())
        request.memories.extend(pb.MemoryHandle(backend=memory.backend, handle=handle, size=size, device=memory.device)
                                for handle, size in zip(memory.handles, memory.sizes, strict=True))
        request.completion_slots = channel.slots
    return request


def pack_keys(keys: Sequence[bytes]) -> tuple[bytes, int]:
    """Keys travel packed back to back; they must all have one length."""
    if not keys:
        return b"", 32
    lengths = set(map(len, keys))
    if len(lengths) != 1:
        raise ValueError("all keys of one request must have the same length")
    return b"".join(keys), lengths.pop()


@dataclass(frozen=True)
class MemorySpec:
    """What Register needs to map an engine's KV memory: one or more allocations ("memories") and
    where each block's bytes lie in them. A region is (offset, block_stride, block_bytes) in memory 0,
    or (offset, block_stride, block_bytes, memory)."""

    backend: str  # cpu | cuda | npu
    handles: tuple[bytes, ...]  # one per memory (cpu: empty, the memfds travel in `fds`)
    sizes: tuple[int, ...]  # bytes of each memory
    num_blocks: int
    regions: Sequence[tuple[int, ...]]
    device: int = 0
    fds: tuple[int, ...] = ()  # cpu: the sealed memfds holding the memories
    # Tensor parallelism: the namespace's blocks are `shards` equal parts; this engine moves `shard`.
    shards: int = 1
    shard: int = 0
    # Device memory: exports the allocations again and returns new handles. The IPC reference
    # counter torch hands out with each export (`_share_cuda_()`) is given back once by the daemon
    # that opened it, so a handle must be sent once: every registration after the first sends a
    # fresh export (see Session._register). None: the handles can be sent again as they are (cpu).
    reexport: Callable[[], tuple[bytes, ...]] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def cpu(cls, fd: int, size: int, num_blocks: int, regions: Sequence[tuple[int, ...]]) -> MemorySpec:
        """One CPU memory: a sealed memfd of `size` bytes."""
        return cls("cpu", (b"",), (size,), num_blocks, tuple(regions), fds=(fd,))

    def for_reregistration(self) -> MemorySpec:
        """The spec to send on a registration after the first: with freshly exported handles."""
        if self.reexport is None:
            return self
        return replace(self, handles=self.reexport())

    def layout(self) -> pb.KVLayout:
        regions = [pb.Region(offset=r[0], block_stride=r[1], block_bytes=r[2], memory=r[3] if len(r) > 3 else 0)
                   for r in self.regions]
        return pb.KVLayout(num_blocks=self.num_blocks, regions=regions, shards=self.shards, shard=self.shard)


class JobsSocket:
    """The daemon's <socket>.jobs (kvstore_client.protocol.jobs_framing) for one session's submit thread:
    connected at the first job, and again once the session re-registered (a restarted daemon). Not
    usable over TCP, or where it cannot be reached (an older daemon: gRPC then, retried a second later)."""

    def __init__(self, target: str, timeout: float) -> None:
        self.path = target.removeprefix("unix://").removeprefix("unix:") + SUFFIX if target.startswith("unix:") else ""
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.registration = 0  # the session's registration the connection was made in
        self.retry_at = 0.0

    def usable(self, registration: int) -> bool:
        if self.sock is not None and self.registration != registration:
            self.close()
        if self.sock is None and self.path and time.monotonic() >= self.retry_at:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(self.path)
            except OSError:
                sock.close()
                self.retry_at = time.monotonic() + 1.0
            else:
                self.sock, self.registration = sock, registration
        return self.sock is not None

    def submit(self, is_store: bool, request: pb.TransferRequest) -> bool:
        """True once the daemon took the job; False where this socket does not take it (too large, or the
        daemon turned the connection away: gRPC for a while). Raises its refusal (KVStoreError), or
        Unavailable when the connection failed (whether the daemon took the job is then unknown)."""
        assert self.sock is not None
        payload = request.SerializeToString()
        if len(payload) + 1 > MAX_REQUEST_BYTES:
            return False
        try:
            self.sock.sendall(frame(STORE if is_store else LOAD, payload))
            body = self._read(int.from_bytes(self._read(4), "little"))
        except OSError as e:
            self.close()
            raise Unavailable(f"UNAVAILABLE: the daemon's {SUFFIX} socket failed: {e}") from None
        if body[:1] == bytes([TURNED_AWAY]):
            log.warning("kvstore: the daemon's %s socket turned this client away (%s); using gRPC",
                        SUFFIX, body[2:].decode(errors="replace"))
            self.close()
            self.retry_at = time.monotonic() + TURNED_AWAY_S
            return False
        if not body or body[0] != 0:
            raise error_of(body[0] if body else 2, body[1:].decode(errors="replace"))
        return True

    def _read(self, n: int) -> bytes:
        assert self.sock is not None
        data = b""
        while len(data) < n:
            more = self.sock.recv(n - len(data))
            if not more:
                raise ConnectionResetError("the daemon closed the connection")
            data += more
        return data

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class KVStoreClient:
    def __init__(self, socket: str | None = None, timeout: float = 10.0,
                 credentials: grpc.ChannelCredentials | None = None) -> None:
        self.target = target_for(socket)
        self.timeout = timeout
        options = [("grpc.max_receive_message_length", MAX_MESSAGE),
                   ("grpc.max_send_message_length", MAX_MESSAGE)]
        if credentials is not None:
            self.channel = grpc.secure_channel(self.target, credentials, options=options)
        else:
            self.channel = grpc.insecure_channel(self.target, options=options)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def call(self, method: Callable[..., _Reply], request: Message, timeout: float | None = None) -> _Reply:
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def health(self, service: str = "") -> str:
        """SERVING, NOT_SERVING, ...; raises Unavailable when the daemon cannot be reached."""
        reply = self.call(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def stats(self) -> pb.StatsResponse:
        """Daemon-wide figures, and the namespaces of our tenant (every tenant's for admins)."""
        return self.call(self.stub.Stats, pb.StatsRequest(peer_token=identity_token(self.target)))

    def clear(self, namespace: str = "", tenant: str = "") -> int:
        """Drop the unpinned blocks of one of our tenant's namespaces (all of them: namespace "");
        admins may name another tenant, or none to clear every tenant's blocks."""
        request = pb.ClearRequest(namespace=namespace, tenant=tenant, peer_token=peer_handshake(self.target))
        return self.call(self.stub.Clear, request).cleared_blocks

    def lookup(self, namespace: str, keys: Sequence[bytes]) -> int:
        packed, size = pack_keys(keys)
        request = pb.LookupRequest(namespace=namespace, keys=packed, key_size=size,
                                   peer_token=peer_handshake(self.target))
        return self.call(self.stub.Lookup, request).hits

    def session(self, namespace: str, memory: MemorySpec | None = None, engine_id: str = "",
                completion_slots: int = 1024, wait: bool = True, says: int = logging.WARNING) -> Session:
        """Register (and keep registered) an engine. With wait=False a daemon that is not up yet
        is not an error: the session connects in the background and jobs fail until it does. `says`:
        the level at which the session logs the daemon going away and coming back (one session of an
        engine says it; its others log at DEBUG)."""
        return Session(self, namespace, memory, engine_id or f"engine-{os.getpid()}", completion_slots, wait, says)

    def close(self) -> None:
        self.channel.close()


# A call for the session's background thread: function and arguments.
_Call = tuple[Callable[..., Any], tuple[Any, ...]]


@dataclass
class _Submit:
    job_id: int
    is_store: bool
    keys: bytes
    key_size: int
    block_ids: bytes  # packed (pack_block_ids)
    blocks: int
    partial_tail: bool = False
    order_seq: int = 0
    expires_ns: int = 0


class Session:
    """One registered engine (or a lookup-only scheduler when `memory` is None)."""

    def __init__(self, client: KVStoreClient, namespace: str, memory: MemorySpec | None, engine_id: str,
                 completion_slots: int, wait: bool = True, says: int = logging.WARNING) -> None:
        self.client = client
        self.says = says
        self.namespace = namespace
        self.memory = memory
        self.engine_id = engine_id
        self.slots = completion_slots
        self.session_id = b""
        self.block_bytes = 0
        self.boot_id = b""
        self.progress_load_bytes = 0  # loads up to this size report their progress (progress())
        self.registrations = 0
        self._handle_sent = False  # the spec's first handle went out in a Register call
        self.channel: CompletionChannel | None = None
        self._channel_path = ""
        self._job_ids = itertools.count(1)
        self._pending: dict[int, bytes] = {}  # job id -> session id it was submitted under
        # Jobs sent without the daemon's word that it took them: job id -> when they are surely over
        # (their expiry in the daemon, and a chunk's copy after it).
        self._unconfirmed: dict[int, int] = {}
        self._done: list[Completion] = []  # finished, not yet returned by poll()
        self._lock = threading.Lock()  # guards _pending/_done between the caller and the threads
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._closing = False  # close() began: nothing more is queued for the background thread
        self._submits: queue.SimpleQueue[_Submit | None] = queue.SimpleQueue()
        self._stream: grpc.Call | None = None
        # Lookups and lease releases run on one background thread, in order: starting a gRPC call
        # costs the caller ~1 ms. The hand-off is a SimpleQueue put (a ThreadPoolExecutor's costs 3x).
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._background = threading.Thread(target=self._background_loop, name="kvstore-rpc", daemon=True)
        self._background.start()
        self._refusal = ""  # the daemon's last refusal of this registration, logged once
        try:
            self._register()
        except Unavailable:
            if wait:
                raise
            log.log(says, "kvstore: the daemon at %s is unavailable: lookups miss until it is back "
                    "(connecting in the background)", client.target)
        except KVStoreError as e:  # refused (a limit, a backend the daemon cannot use, a bad layout)
            if wait:
                raise
            self._refused(e)  # retried in the background: a daemon restarted with other settings may take it
        self._attach_thread = threading.Thread(target=self._attach_loop, name="kvstore-attach", daemon=True)
        self._attach_thread.start()
        self._sender = threading.Thread(target=self._send_loop, name="kvstore-submit", daemon=True)
        self._sender.start()
        # Registered: the session is usable once its stream is open (milliseconds), also with
        # wait=False, so that the first requests do not find it "unavailable".
        if self.session_id and not self._connected.wait(client.timeout) and wait:
            self.close()
            raise Unavailable("the daemon accepted the registration but the session stream did not open")

    # -- registration and liveness ---------------------------------------------------------------

    def _register(self) -> None:
        memory = self.memory
        if memory is not None and self._handle_sent:
            # A handle that reached a daemon once is not sent again: that daemon (or its successor,
            # which never opened it) would give the engine's IPC reference back twice.
            try:
                memory = memory.for_reregistration()
            except Exception as e:  # torch's export failed: keep the attach loop alive, retry later
                raise FailedPrecondition(f"FAILED_PRECONDITION: cannot export the KV memory again: {e}") from e
        channel = CompletionChannel.create(self.slots) if memory is not None else None
        try:
            request = registration(self.client.target, self.engine_id, self.namespace, memory, channel)
            self._handle_sent = True  # from here the daemon may have opened it, even if the call fails
            reply = self.client.call(self.client.stub.Register, request)
        except BaseException:
            if channel is not None:
                channel.close()
            raise
        old = self.channel
        self.channel, self.session_id = channel, reply.session_id
        self.block_bytes, self.boot_id = reply.block_bytes, reply.daemon_boot_id
        self.progress_load_bytes = reply.progress_load_bytes
        self.registrations += 1
        if old is not None:
            old.close()

    def _attach_loop(self) -> None:
        backoff = 0.2
        while not self._closed.is_set():
            refused = False
            try:
                if not self.session_id:
                    self._register()
                    log.log(self.says, "kvstore: the daemon at %s is back (session %s)", self.client.target,
                            self.session_id.hex()[:8])
                stream = self._stream = self.client.stub.Attach(pb.AttachRequest(session_id=self.session_id))
                for event in stream:
                    if event.HasField("attached"):
                        self._connected.set()
                        backoff = 0.2
                    elif event.HasField("shutdown"):
                        break
            except grpc.RpcError as e:
                if self._closed.is_set():
                    return
                log.debug("kvstore: session stream: %s", e)
            except KVStoreError as e:
                if self._closed.is_set():
                    return
                if isinstance(e, Unavailable):
                    log.debug("kvstore: re-register failed: %s", e)
                else:
                    refused = True
                    self._refused(e)
            if self._closed.is_set():
                return
            self._disconnected()
            self._closed.wait(backoff)
            backoff = next_retry_s(backoff, refused)

    def _refused(self, e: KVStoreError) -> None:
        """The daemon refused the registration: said once per reason, not at every retry."""
        if str(e) != self._refusal:
            self._refusal = str(e)
            log.error("kvstore: the daemon refuses this session (retrying in the background, backing off to every "
                      "%.0f s): %s", REFUSED_RETRY_MAX_S, e)

    def _disconnected(self) -> None:
        """The daemon ended the session (once its copies did) or its process is gone: every job is
        over. Those it posted keep their outcome; the others failed."""
        if self._connected.is_set():
            log.log(self.says, "kvstore: lost the daemon at %s: jobs in flight fail and lookups miss until it "
                    "is back (reconnecting in the background)", self.client.target)
        self._connected.clear()
        self.session_id = b""
        with self._lock:
            channel = self.channel
            for job_id in self._pending:
                posted = channel.check(job_id) if channel is not None else None
                self._done.append(posted or Completion(job_id, 0, 1))
            self._pending.clear()
            self._unconfirmed.clear()
        self._wake_waiters()

    @property
    def connected(self) -> bool:
        return self._connected.is_set() and bool(self.session_id)

    # -- jobs ------------------------------------------------------------------------------------

    def store(self, keys: Sequence[bytes], block_ids: Sequence[int], partial_tail: bool = False,
              order_seq: int = 0, give_up_s: float = 0.0) -> int:
        """Queue a copy engine -> pool; returns the job id at once. `partial_tail`: the last key is a
        prompt's partial last block, which the pool evicts before full blocks. `order_seq`: what
        kvstore_client.device.order_before_copies returned just before (device memory): the daemon
        copies once that record of the engine's stream is done; 0: after every record pending then.
        `give_up_s`: the caller takes the job as failed if not finished this long after now, and may
        reuse its blocks: the daemon then no longer touches them (0: the caller waits for its end)."""
        return self._submit(True, keys, block_ids, partial_tail, order_seq, give_up_s)

    def load(self, keys: Sequence[bytes], block_ids: Sequence[int], order_seq: int = 0,
             give_up_s: float = 0.0) -> int:
        """Queue a copy pool -> engine; returns the job id at once. `order_seq`, `give_up_s`: as for store."""
        return self._submit(False, keys, block_ids, order_seq=order_seq, give_up_s=give_up_s)

    def _submit(self, is_store: bool, keys: Sequence[bytes], block_ids: Sequence[int],
                partial_tail: bool = False, order_seq: int = 0, give_up_s: float = 0.0) -> int:
        if self.memory is None:
            raise FailedPrecondition("this session registered no KV memory")
        job_id = next(self._job_ids)
        # (Before the caller's clock starts; less a chunk's copy, which the daemon does not interrupt.)
        expires_ns = time.monotonic_ns() + int((give_up_s - COPY_MARGIN_S) * 1e9) if give_up_s else 0
        packed, size = pack_keys(keys)
        ids = pack_block_ids(block_ids)
        with self._lock:
            if not self.connected or len(self._pending) >= self.slots:
                self._done.append(Completion(job_id, 0, max(len(keys), 1)))
                return job_id
            self._pending[job_id] = self.session_id
        self._submits.put(_Submit(job_id, is_store, packed, size, ids, len(block_ids), partial_tail, order_seq,
                                  expires_ns))
        return job_id

    def _send_loop(self) -> None:
        """Sends the queued stores and loads: over the daemon's <socket>.jobs where it can (a tenth of
        a gRPC call's time), else by gRPC; a refused or lost one fails here, as the daemon never ran it."""
        stub = self.client.stub
        jobs = JobsSocket(self.client.target, self.client.timeout)
        while True:
            item = self._submits.get()
            if item is None:
                jobs.close()
                return
            with self._lock:
                session_id = self._pending.get(item.job_id)
            if session_id is None:
                continue  # failed already (disconnect)
            request = pb.TransferRequest(session_id=session_id, job_id=item.job_id, keys=item.keys,
                                         key_size=item.key_size, block_id_bytes=item.block_ids,
                                         partial_tail=item.partial_tail, order_seq=item.order_seq,
                                         expires_ns=item.expires_ns)
            try:
                if not (jobs.usable(self.registrations) and jobs.submit(item.is_store, request)):
                    (stub.Store if item.is_store else stub.Load)(request, timeout=self.client.timeout)
                continue
            except grpc.RpcError as e:
                error = from_rpc_error(e)
            except KVStoreError as e:
                error = e
            what = "store" if item.is_store else "load"
            if isinstance(error, Unavailable):
                # Whether the daemon took the job is unknown: it stays pending until its completion is
                # posted, its expiry passed (poll) or the session ended (_disconnected), as the daemon
                # may still run it.
                log.warning("kvstore: %s job %d not confirmed: %s", what, item.job_id, error)
                if item.expires_ns:
                    with self._lock:
                        self._unconfirmed[item.job_id] = item.expires_ns + int(COPY_MARGIN_S * 1e9)
                continue
            log.warning("kvstore: %s job %d refused: %s", what, item.job_id, error)
            with self._lock:
                if self._pending.pop(item.job_id, None) is not None:
                    self._done.append(Completion(item.job_id, 0, max(item.blocks, 1)))
            self._wake_waiters()

    def poll(self) -> list[Completion]:
        """Jobs finished since the last poll, read from shared memory (no RPC)."""
        with self._lock:
            done = self._done
            self._done = []
            channel = self.channel
            if channel is not None:
                for job_id in list(self._pending):
                    completion = channel.check(job_id)
                    if completion is not None:
                        del self._pending[job_id]
                        self._unconfirmed.pop(job_id, None)
                        done.append(completion)
            if self._unconfirmed:
                now = time.monotonic_ns()
                for job_id, over in list(self._unconfirmed.items()):
                    if now >= over:
                        del self._unconfirmed[job_id]
                        if self._pending.pop(job_id, None) is not None:
                            done.append(Completion(job_id, 0, 1))
        return done

    def progress(self, job_id: int) -> int:
        """Regions of an unfinished load that have landed (a load of at most `progress_load_bytes`
        reports them as it copies, in the layout's region order); 0 before any did or when unknown.
        Its completion still comes through poll()."""
        channel = self.channel
        return channel.progress(job_id) if channel is not None else 0

    def finished(self, job_id: int) -> bool:
        """Whether a job has finished (its completion is seen or waiting to be returned by poll())."""
        if job_id not in self._pending:
            return True
        channel = self.channel
        return channel is not None and channel.check(job_id) is not None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def wait(self, job_ids: Sequence[int], timeout: float = 30.0) -> dict[int, Completion]:
        """Block until these jobs finished (tests, tools; an engine uses poll())."""
        wanted = set(job_ids)
        found: dict[int, Completion] = {}
        others: list[Completion] = []
        start = time.monotonic()
        while wanted - found.keys():
            channel = self.channel
            seen = channel.posts() if channel is not None else 0  # before the check: a post after it wakes us
            for c in self.poll():
                if c.job_id in wanted:
                    found[c.job_id] = c
                else:
                    others.append(c)
            if wanted - found.keys():
                now = time.monotonic()
                if now > start + timeout:
                    self._keep(others)
                    raise TimeoutError(f"jobs {sorted(wanted - found.keys())} not finished after {timeout}s")
                # Asleep in the kernel until the daemon posts (polling took cores from the copies);
                # the slice bounds the wait where no wake comes (an older daemon, completions by RPC).
                if channel is not None:
                    channel.wait_posted(seen, WAIT_SLICE_S)
                else:
                    time.sleep(POLL_S)
        self._keep(others)
        return {j: found[j] for j in wanted}

    def _wake_waiters(self) -> None:
        """Jobs failed here, not posted by the daemon: wake a wait() asleep on the channel."""
        channel = self.channel
        if channel is not None:
            channel.wake()

    def _keep(self, completions: list[Completion]) -> None:
        """Completions wait() saw for other jobs: the next poll() returns them."""
        with self._lock:
            self._done[:0] = completions

    def results(self, wait_ms: int = 0) -> pb.PollResponse:
        """Per-block results of finished jobs, through the Poll RPC."""
        return self.client.call(self.client.stub.Poll, pb.PollRequest(session_id=self.session_id, wait_ms=wait_ms),
                                timeout=self.client.timeout + wait_ms / 1000)

    # -- lookups ---------------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], lease: bool = False, lease_ttl_ms: int = 0,
               group_spans: Sequence[int] = ()) -> tuple[int, bytes]:
        """(hits, lease id): how many leading keys the pool holds; with `group_spans` (several KV cache
        groups, kvstore_client.protocol.groups) how many blocks every group serves."""
        packed, size = pack_keys(keys)
        reply = self.client.call(self.client.stub.Lookup, pb.LookupRequest(
            session_id=self.session_id, keys=packed, key_size=size, lease=lease, lease_ttl_ms=lease_ttl_ms,
            group_spans=group_spans))
        return reply.hits, reply.lease_id

    def run_in_background(self, fn: Callable[..., object], *args: Any) -> bool:
        """Run fn(*args) on the session's background thread, after the calls queued before it (lookups,
        lease releases); the caller's cost is a queue put. fn reports its result itself; its errors are
        only logged. False if the session is closed: nothing queued (close() drops queued calls)."""
        return self._queue((fn, args))

    def _queue(self, call: _Call) -> bool:
        if self._closing:
            return False
        self._calls.put(call)
        if self._closing:  # closed meanwhile (another thread): never left pending
            self._drop_queued()
        return True

    def release_lease(self, lease_id: bytes, wait: bool = False) -> None:
        """Release a lease. By default it is queued on the background thread (after the lookups
        queued before it) and the caller neither waits nor starts an RPC; errors are only logged."""
        if wait:
            self.client.call(self.client.stub.ReleaseLease,
                             pb.ReleaseLeaseRequest(session_id=self.session_id, lease_id=lease_id))
            return
        # Closed: nothing queued, the daemon drops a session's leases when the session ends.
        self._queue((self._release_quietly, (lease_id,)))

    def describe_blocks(self, keys: Sequence[bytes], descriptions: Sequence[bytes]) -> None:
        """Tell the daemon what routers need of blocks this engine stores (client/vllm/events.py); call it
        on the background thread (run_in_background): errors are only logged."""
        if not self.connected or not keys:
            return
        packed, size = pack_keys(keys)
        try:
            self.client.call(self.client.stub.DescribeBlocks, pb.DescribeBlocksRequest(
                session_id=self.session_id, keys=packed, key_size=size, descriptions=descriptions))
        except KVStoreError as e:
            log.debug("kvstore: describing %d blocks failed: %s", len(keys), e)

    def watch_blocks(self, stop: threading.Event) -> Iterator[tuple[bool, list[tuple[bool, bytes, bytes, bool]]]]:
        """The namespace's block events, (reset, [(removed, key, description, on_disk)]) batches, until the
        stream ends (the session or the daemon does) or `stop` is set (checked between batches; close() ends
        the stream too). on_disk: the event is of the disk tier's copy, else of the pool's."""
        stream = self.client.stub.WatchBlocks(pb.WatchBlocksRequest(session_id=self.session_id))
        try:
            for batch in stream:
                if stop.is_set() or self._closing:
                    return
                yield batch.reset, [(e.removed, e.key, e.description, e.medium == pb.MEDIUM_DISK)
                                    for e in batch.events]
        except grpc.RpcError as e:
            if not self._closing:  # (closing cancels the stream: the end)
                raise from_rpc_error(e) from None
        finally:
            stream.cancel()

    def _release_quietly(self, lease_id: bytes) -> None:
        if not self.connected:
            return  # the lease ended with the daemon's session
        try:
            self.release_lease(lease_id, wait=True)
        except KVStoreError as e:
            log.debug("kvstore: lease release failed: %s", e)

    def _background_loop(self) -> None:
        """Runs the queued calls in order until close(); what close() finds still queued is dropped."""
        while (item := self._calls.get()) is not None:
            if self._closing:
                continue
            fn, args = item
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - the thread serves the calls after this one
                log.debug("kvstore: background call failed: %s", e)
        self._drop_queued()

    def _drop_queued(self) -> None:
        """Take every queued call off without running it."""
        stop = False
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is None:
                stop = True
        if stop:
            self._calls.put(None)  # not ours to take: the background thread's stop

    # -- end -------------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closing = True
        self._closed.set()
        self._submits.put(None)
        self._drop_queued()  # the call running now finishes; the background thread then ends
        self._calls.put(None)
        if self.session_id:
            try:
                self.client.call(self.client.stub.Unregister, pb.UnregisterRequest(session_id=self.session_id))
            except KVStoreError:
                pass
        if self._stream is not None:
            self._stream.cancel()
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
