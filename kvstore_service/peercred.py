"""The handshake on `<socket>.cred`, a plain unix socket next to the gRPC one.

gRPC hides its sockets, so a client first connects here and sends a random token and, by
SCM_RIGHTS, the sealed memfds of its completion channel and (CPU) KV memory. The daemon reads the
kernel's record of the peer (SO_PEERCRED: pid, uid, gid), answers, and keeps token -> (credentials,
descriptors) for a short while; the client names the token in Register (or Clear). So the daemon
knows the engine's real pid and uid, and gets its memory without any file name to trust.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field

from kvstore_client.protocol import MAX_MEMORIES

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
MAX_FDS = 1 + MAX_MEMORIES  # the completion channel, then the KV memories (cpu)
TOKEN_TTL_S = 10.0
# Handshakes waiting for their Register hold descriptors: bound them (oldest out first), so no
# client can fill the daemon's descriptor table and lock other engines out.
MAX_PENDING = 256
MAX_PENDING_PER_UID = 32
MAX_PENDING_FDS = 4096
MAX_PENDING_FDS_PER_UID = 1024
# Handshakes in progress (connected, token not yet read) cost a socket and a small task each, never a
# thread: bound them per uid and in total, and give each a deadline, so silent connections (a
# slow-loris) cannot crowd out honest engines. Defaults of --handshake-timeout-s,
# --max-handshakes-per-uid and --max-handshakes.
HANDSHAKE_TIMEOUT_S = 2.0
MAX_HANDSHAKES_PER_UID = 16
MAX_HANDSHAKES = 256
_REFUSAL_LOG_INTERVAL_S = 10.0
# The one-byte answers. REFUSED: a short token or descriptors lost in transit; BUSY_UID / BUSY: over
# --max-handshakes-per-uid / --max-handshakes (the client names the flag).
ACCEPTED, NOT_ALLOWED, REFUSED, BUSY_UID, BUSY = b"\x00", b"\x01", b"\x02", b"\x03", b"\x04"
_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


    def in_my_pid_namespace(self) -> bool | None:
        """Whether the peer runs in the daemon's PID namespace: False where the kernel could not name its
        pid here (SO_PEERCRED gives 0 for a process of a namespace this one does not contain) or its
        namespace differs; None where that cannot be read (another user's /proc entry)."""
        if self.pid <= 0:
            return False
        try:
            return os.readlink(f"/proc/{self.pid}/ns/pid") == os.readlink("/proc/self/ns/pid")
        except OSError:
            return None


@dataclass
class Handshake:
    cred: PeerCred
    fds: list[int] = field(default_factory=list)
    expires: float = 0.0


_Message = tuple[bytes, list[int], int]  # token, descriptors, recvmsg flags


class PeerCredServer:
    def __init__(self, path: str, allowed_uids: list[int], handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_handshakes_per_uid: int = MAX_HANDSHAKES_PER_UID, max_handshakes: int = MAX_HANDSHAKES) -> None:
        self.path = path
        self.allowed_uids = set(allowed_uids)
        self.handshake_timeout_s = handshake_timeout_s
        self.max_handshakes_per_uid = max_handshakes_per_uid
        self.max_handshakes = max_handshakes
        self._pending: dict[bytes, Handshake] = {}
        self._listener: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        # The handshakes being served: the loop keeps only weak references to tasks, so an unreferenced
        # one could be collected mid-handshake (descriptors received and never closed, client unanswered).
        self._handlers: set[asyncio.Task[None]] = set()
        self._in_progress: dict[int, int] = {}  # uid -> handshakes connected and not yet answered
        self._last_refusal_log: dict[int, float] = {}
        self.refused_handshakes = 0  # over --max-handshakes(-per-uid): refused at accept
        self.timed_out_handshakes = 0  # closed at --handshake-timeout-s without a token

    async def start(self, mode: int, gid: int | None) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        os.chmod(self.path, mode)
        if gid is not None:
            os.chown(self.path, -1, gid)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._task = asyncio.get_running_loop().create_task(self._serve())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for handler in self._handlers:
            handler.cancel()
        if self._listener is not None:
            self._listener.close()
        for handshake in self._pending.values():
            close_fds(handshake.fds)
        self._pending.clear()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    @property
    def handshakes_in_progress(self) -> int:
        return sum(self._in_progress.values())

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as e:  # EMFILE and the like: keep serving once descriptors are free again
                log.warning("accepting a handshake failed: %s", e)
                await asyncio.sleep(0.1)
                continue
            try:
                conn.setblocking(False)
                # The kernel's record of the peer is there right after accept: limits apply per uid
                # before a byte is read.
                cred = peer_cred(conn)
            except OSError:
                conn.close()
                continue
            busy = self._over_limit(cred)
            if busy is not None:
                self._refuse_now(conn, cred, busy)
                continue
            self._in_progress[cred.uid] = self._in_progress.get(cred.uid, 0) + 1
            handler = loop.create_task(self._handle(conn, cred))
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)

    def _over_limit(self, cred: PeerCred) -> bytes | None:
        """The answer to a connection over a limit of handshakes in progress (None: admitted)."""
        if self._in_progress.get(cred.uid, 0) >= self.max_handshakes_per_uid:
            return BUSY_UID
        return BUSY if self.handshakes_in_progress >= self.max_handshakes else None

    def _refuse_now(self, conn: socket.socket, cred: PeerCred, answer: bytes) -> None:
        """Over a limit: answer which one if the socket takes it, close, count. Whatever the client has
        sent already (descriptors included) is read and closed, so the answer is not lost to a reset."""
        self.refused_handshakes += 1
        now = time.monotonic()
        if now - self._last_refusal_log.get(cred.uid, -_REFUSAL_LOG_INTERVAL_S) >= _REFUSAL_LOG_INTERVAL_S:
            self._last_refusal_log[cred.uid] = now
            log.warning("refusing a handshake of uid %d (pid %d): %d in progress for this uid, %d in all "
                        "(--max-handshakes-per-uid %d, --max-handshakes %d); %d refused so far",
                        cred.uid, cred.pid, self._in_progress.get(cred.uid, 0), self.handshakes_in_progress,
                        self.max_handshakes_per_uid, self.max_handshakes, self.refused_handshakes)
        try:
            try:
                _, fds, _, _ = socket.recv_fds(conn, TOKEN_BYTES, MAX_FDS, socket.MSG_DONTWAIT | _CLOEXEC)
                close_fds(fds)
            except OSError:
                pass
            conn.send(answer)
        except OSError:
            pass
        finally:
            conn.close()

    async def _handle(self, conn: socket.socket, cred: PeerCred) -> None:
        try:
            try:
                async with asyncio.timeout(self.handshake_timeout_s):
                    token, fds, flags = await _receive(conn)
            except TimeoutError:
                self.timed_out_handshakes += 1
                log.debug("handshake of uid %d (pid %d) sent no token within %.1f s: closed",
                          cred.uid, cred.pid, self.handshake_timeout_s)
                return
            self.expire()
            if len(token) != TOKEN_BYTES or flags & socket.MSG_CTRUNC:
                close_fds(fds)  # a short token, or descriptors lost in transit: refuse, never half-accept
                conn.send(REFUSED)
            elif self.allowed_uids and cred.uid not in self.allowed_uids:
                log.warning("refusing uid %d (pid %d): not in --allowed-uids", cred.uid, cred.pid)
                close_fds(fds)
                conn.send(NOT_ALLOWED)
            else:
                self._make_room(cred.uid, len(fds))
                self._pending[token] = Handshake(cred, list(fds), time.monotonic() + TOKEN_TTL_S)
                conn.send(ACCEPTED)  # one byte into a fresh socket's empty buffer: never blocks
        except OSError:
            pass
        finally:
            conn.close()
            left = self._in_progress.get(cred.uid, 0) - 1
            if left > 0:
                self._in_progress[cred.uid] = left
            else:
                self._in_progress.pop(cred.uid, None)

    def _make_room(self, uid: int, fds: int) -> None:
        """Over a limit (handshakes, or descriptors they hold), the oldest parked handshakes (of this
        uid, else of anyone) go: a flood only pushes out the flooder's own, and an engine registers
        right after its handshake."""
        mine = [t for t, h in self._pending.items() if h.cred.uid == uid]
        held = sum(len(self._pending[t].fds) for t in mine)
        while mine and (len(mine) >= MAX_PENDING_PER_UID or held + fds > MAX_PENDING_FDS_PER_UID):
            held -= len(self._pending[mine[0]].fds)
            close_fds(self._pending.pop(mine.pop(0)).fds)
        held = sum(len(h.fds) for h in self._pending.values())
        while self._pending and (len(self._pending) >= MAX_PENDING or held + fds > MAX_PENDING_FDS):
            oldest = self._pending.pop(next(iter(self._pending)))
            held -= len(oldest.fds)
            close_fds(oldest.fds)

    def expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, h in self._pending.items() if h.expires < now]:
            close_fds(self._pending.pop(token).fds)

    def take(self, token: bytes) -> Handshake | None:
        """The credentials and descriptors behind a token, once; the caller owns the descriptors."""
        handshake = self._pending.pop(token, None)
        if handshake is not None and handshake.expires < time.monotonic():
            close_fds(handshake.fds)
            return None
        return handshake


_CLOEXEC = getattr(socket, "MSG_CMSG_CLOEXEC", 0)


def peer_cred(conn: socket.socket) -> PeerCred:
    return PeerCred(*_UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))


async def _receive(conn: socket.socket) -> _Message:
    """The client's one message (token and descriptors), read on the event loop once the socket is
    readable: a silent client costs no thread. A caller cancelled (its deadline) right after the read
    still gets the descriptors closed."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[_Message] = loop.create_future()

    def readable() -> None:
        if received.done():
            return
        try:
            token, fds, flags, _ = socket.recv_fds(conn, TOKEN_BYTES, MAX_FDS, _CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            received.set_exception(e)
        else:
            received.set_result((token, fds, flags))

    fd = conn.fileno()
    loop.add_reader(fd, readable)
    try:
        return await received
    except BaseException:
        if received.done() and not received.cancelled() and received.exception() is None:
            close_fds(received.result()[1])
        raise
    finally:
        loop.remove_reader(fd)


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
