"""Who is on the other end of the unix socket: SO_PEERCRED through a one-shot handshake.

gRPC hides its sockets, so a client first connects to `<socket>.cred`, a plain unix socket, and
sends a random token; the daemon reads the kernel's record of the peer (pid, uid, gid), answers,
and remembers token -> credentials for a short while. The client then names the token in
Register (or Clear), and the daemon knows the engine's real pid and uid — not a self-reported one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

TOKEN_BYTES = 16
TOKEN_TTL_S = 30.0
_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


class PeerCredServer:
    def __init__(self, path: str, allowed_uids: list[int]) -> None:
        self.path = path
        self.allowed_uids = set(allowed_uids)
        self._tokens: dict[bytes, tuple[PeerCred, float]] = {}
        self._server: asyncio.AbstractServer | None = None

    async def start(self, mode: int, gid: int | None) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._handle, path=self.path)
        os.chmod(self.path, mode)
        if gid is not None:
            os.chown(self.path, -1, gid)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            token = await asyncio.wait_for(reader.readexactly(TOKEN_BYTES), 5.0)
            sock: socket.socket = writer.get_extra_info("socket")
            cred = PeerCred(*_UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)))
            if self.allowed_uids and cred.uid not in self.allowed_uids:
                log.warning("refusing uid %d (pid %d): not in --allowed-uids", cred.uid, cred.pid)
                writer.write(b"\x01")
            else:
                self._expire()
                self._tokens[token] = (cred, time.monotonic() + TOKEN_TTL_S)
                writer.write(b"\x00")
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            writer.close()

    def _expire(self) -> None:
        now = time.monotonic()
        for token in [t for t, (_, expires) in self._tokens.items() if expires < now]:
            del self._tokens[token]

    def take(self, token: bytes) -> PeerCred | None:
        """The credentials behind a token, once."""
        entry = self._tokens.pop(token, None)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

