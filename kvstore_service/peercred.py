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

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
MAX_FDS = 2
TOKEN_TTL_S = 10.0
# Handshakes waiting for their Register hold descriptors: bound them (oldest out first), so no
# client can fill the daemon's descriptor table and lock other engines out.
MAX_PENDING = 256
MAX_PENDING_PER_UID = 32
ACCEPTED, NOT_ALLOWED, REFUSED = b"\x00", b"\x01", b"\x02"
_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


@dataclass
class Handshake:
    cred: PeerCred
    fds: list[int] = field(default_factory=list)
    expires: float = 0.0


class PeerCredServer:
    def __init__(self, path: str, allowed_uids: list[int]) -> None:
        self.path = path
        self.allowed_uids = set(allowed_uids)
        self._pending: dict[bytes, Handshake] = {}
        self._listener: socket.socket | None = None
        self._task: asyncio.Task[None] | None = None
        # The handshakes being served: the loop keeps only weak references to tasks, so an unreferenced
        # one could be collected mid-handshake (descriptors received and never closed, client unanswered).
        self._handlers: set[asyncio.Task[None]] = set()

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

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            handler = loop.create_task(self._handle(conn))
            self._handlers.add(handler)
            handler.add_done_callback(self._handlers.discard)

    async def _handle(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            conn.settimeout(5.0)  # a blocking receive, in a thread: asyncio has no recvmsg with fds
            token, fds, flags, _ = await loop.run_in_executor(None, socket.recv_fds, conn, TOKEN_BYTES, MAX_FDS)
            cred = PeerCred(*_UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))
            self.expire()
            if len(token) != TOKEN_BYTES or flags & socket.MSG_CTRUNC:
                close_fds(fds)  # a short token, or descriptors lost in transit: refuse, never half-accept
                await loop.sock_sendall(conn, REFUSED)
            elif self.allowed_uids and cred.uid not in self.allowed_uids:
                log.warning("refusing uid %d (pid %d): not in --allowed-uids", cred.uid, cred.pid)
                close_fds(fds)
                await loop.sock_sendall(conn, NOT_ALLOWED)
            else:
                self._make_room(cred.uid)
                self._pending[token] = Handshake(cred, list(fds), time.monotonic() + TOKEN_TTL_S)
                await loop.sock_sendall(conn, ACCEPTED)
        except OSError:
            pass
        finally:
            conn.close()

    def _make_room(self, uid: int) -> None:
        """Over a limit, the oldest parked handshake (of this uid, else of anyone) goes: a flood only
        pushes out the flooder's own, and an engine registers right after its handshake."""
        mine = [t for t, h in self._pending.items() if h.cred.uid == uid]
        if len(mine) >= MAX_PENDING_PER_UID:
            close_fds(self._pending.pop(mine[0]).fds)
        if len(self._pending) >= MAX_PENDING:
            close_fds(self._pending.pop(next(iter(self._pending))).fds)

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


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
