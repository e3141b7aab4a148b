"""`<socket>.jobs`: an engine's store and load requests over a plain unix socket, beside gRPC's.

A gRPC call between two Python processes costs 0.7-1 ms on our machines (most of a small hit's
time from submit to completion); a frame on a unix socket ~0.1 ms
(benchmarks/results/cpu-jobs-socket-2026-11-27.log). The client's submit thread sends here when it
can, and over gRPC otherwise. Both run the same checks (Servicer.submit): a refusal here is the one
the RPC would give, counted alike.

Frames, both ways: a 4-byte little-endian length, then the body. A request: one byte (1 store,
2 load) and a TransferRequest (proto/kvstore.proto). A reply: one byte, 0 and a TransferResponse,
or the refusal's gRPC status code and its message (UTF-8). One reply per request, in order.

Who may hold a connection, checked before anything is read (a connection costs the daemon only its
socket until then):
- the peer's uid (SO_PEERCRED at accept) is one the `<socket>.cred` handshake accepts, and holds
  fewer than --max-sessions-per-uid connections (a client's session keeps one); --max-sessions in all;
- its first frame arrives within --handshake-timeout-s and names a live session of that uid: the
  connection then serves that session only, and is closed when the session ends;
- a frame is at most --max-job-request-bytes (the client sends larger requests by gRPC), its body
  arrives within --handshake-timeout-s of its length, and frames being received hold at most
  --max-jobs-buffer-bytes-per-uid of one uid and --max-jobs-buffer-bytes in all.
A connection that breaks a rule is closed after a reply TURNED_AWAY (then its status code and message):
the client sends this job, and the next ones for a while, by gRPC. The daemon keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol.jobs_framing import LOAD, STORE, TURNED_AWAY, frame
from kvstore_service.config import Config
from kvstore_service.errors import KVError, invalid
from kvstore_service.peercred import peer_cred
from kvstore_service.servicer import Servicer, check_keys
from kvstore_service.sessions import Session

log = logging.getLogger(__name__)


class UnixPeer:
    """What Servicer.submit asks of a gRPC context: the caller came over the unix socket."""

    @staticmethod
    def peer() -> str:
        return "unix:"


@dataclass(eq=False)
class Connection:
    uid: int
    writer: asyncio.StreamWriter
    since: float  # accepted (monotonic)
    session: Session | None = None  # bound by its first valid frame
    receiving: float = 0.0  # since when a frame's body is awaited (0: none)
    reserved: int = 0  # that frame's bytes, counted against the buffer limits


class TurnAway(Exception):
    """The connection breaks a rule of the socket: answered TURNED_AWAY and closed."""

    def __init__(self, error: KVError) -> None:
        super().__init__(error.message)
        self.error = error


class SubmitSocket:
    def __init__(self, path: str, servicer: Servicer, config: Config, allowed_uids: set[int]) -> None:
        self.path = path
        self.servicer = servicer
        self.allowed_uids = allowed_uids  # empty: any
        self.max_frame = int(config.max_job_request_bytes)
        self.timeout_s = config.handshake_timeout_s
        self.max_per_uid = config.max_sessions_per_uid
        self.max_connections = config.max_sessions
        self.max_buffered = int(config.max_jobs_buffer_bytes)
        self.max_buffered_per_uid = int(config.max_jobs_buffer_bytes_per_uid)
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[Connection] = set()
        self._per_uid: Counter[int] = Counter()
        self._buffered: Counter[int] = Counter()

    async def start(self, mode: int, gid: int | None) -> None:
        """Listen, with the gRPC socket's file mode and group (who may talk to the daemon at all)."""
        if os.path.exists(self.path):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, mode)
        if gid is not None:
            os.chown(self.path, -1, gid)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self._connections):
                conn.writer.close()
            await self._server.wait_closed()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def expire(self) -> None:
        """Housekeeping: close connections past a deadline (no first frame; a frame's body late) and
        those whose session ended."""
        now = time.monotonic()
        for conn in list(self._connections):
            if conn.session is None and now - conn.since > self.timeout_s:
                self._turn_away(conn, KVError("DEADLINE_EXCEEDED", "no request within --handshake-timeout-s"))
            elif conn.receiving and now - conn.receiving > self.timeout_s:
                self._turn_away(conn, KVError("DEADLINE_EXCEEDED", "a request's body did not arrive within "
                                              "--handshake-timeout-s"))
            elif conn.session is not None and conn.session.closed:
                conn.writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        uid = peer_cred(writer.get_extra_info("socket")).uid
        conn = Connection(uid, writer, time.monotonic())
        try:
            self._admit(uid)
        except TurnAway as e:
            self._turn_away(conn, e.error)
            return
        self._connections.add(conn)
        self._per_uid[uid] += 1
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                self._reserve(conn, size)
                body = await reader.readexactly(size)
                self._release(conn)
                writer.write(self._answer(conn, body))
                await writer.drain()
        except TurnAway as e:
            self._turn_away(conn, e.error)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client left (or expire() closed the connection)
        finally:
            self._release(conn)
            if conn in self._connections:
                self._connections.discard(conn)
                self._per_uid[uid] -= 1
            writer.close()

    def _admit(self, uid: int) -> None:
        if self.allowed_uids and uid not in self.allowed_uids:
            raise TurnAway(KVError("PERMISSION_DENIED", f"uid {uid} may not use this daemon"))
        if self._per_uid[uid] >= self.max_per_uid:
            raise TurnAway(KVError("RESOURCE_EXHAUSTED", f"uid {uid} holds {self._per_uid[uid]} connections to "
                                   f"{self.path} (--max-sessions-per-uid {self.max_per_uid})"))
        if len(self._connections) >= self.max_connections:
            raise TurnAway(KVError("RESOURCE_EXHAUSTED", f"{len(self._connections)} connections to {self.path} "
                                   f"are open (--max-sessions {self.max_connections})"))

    def _reserve(self, conn: Connection, size: int) -> None:
        if not 1 <= size <= self.max_frame:
            raise TurnAway(invalid(f"a request frame of {size} bytes (at most --max-job-request-bytes "
                                   f"{self.max_frame}; larger requests go by gRPC)"))
        if self._buffered[conn.uid] + size > self.max_buffered_per_uid:
            raise TurnAway(KVError("RESOURCE_EXHAUSTED", f"uid {conn.uid}'s requests being received hold "
                                   f"{self._buffered[conn.uid]} bytes (--max-jobs-buffer-bytes-per-uid "
                                   f"{self.max_buffered_per_uid})"))
        total = sum(self._buffered.values())
        if total + size > self.max_buffered:
            raise TurnAway(KVError("RESOURCE_EXHAUSTED", f"requests being received hold {total} bytes "
                                   f"(--max-jobs-buffer-bytes {self.max_buffered})"))
        conn.reserved, conn.receiving = size, time.monotonic()
        self._buffered[conn.uid] += size

    def _release(self, conn: Connection) -> None:
        if conn.reserved:
            self._buffered[conn.uid] -= conn.reserved
            conn.reserved, conn.receiving = 0, 0.0

    def _answer(self, conn: Connection, body: bytes) -> bytes:
        """The reply to one request; raises TurnAway where the connection must close."""
        kind = body[0]
        if kind not in (STORE, LOAD):
            raise TurnAway(invalid(f"unknown request kind {kind} (1 store, 2 load)"))
        try:
            request = pb.TransferRequest.FromString(body[1:])
        except DecodeError:
            raise TurnAway(invalid("the request is not a valid TransferRequest message")) from None
        try:
            if conn.session is None or conn.session.session_id != request.session_id:
                check_keys(request.keys, request.key_size)  # (first, as the RPC does)
                self._bind(conn, request.session_id)
            response = self.servicer.submit(request, UnixPeer(), kind == STORE)
        except TurnAway:
            raise
        except KVError as e:
            if conn.session is None:  # (no first valid frame)
                raise TurnAway(e) from None
            return self._refusal(e)
        except Exception as e:  # a bug: still answer, keep serving
            log.error("internal error in a submit on %s", self.path, exc_info=e)
            return self._refusal(KVError("INTERNAL", f"internal error: {e}"))
        return frame(0, response.SerializeToString())

    def _bind(self, conn: Connection, session_id: bytes) -> None:
        """A connection serves one live session of its peer's uid (the one its first frame names)."""
        if conn.session is not None:
            raise TurnAway(KVError("PERMISSION_DENIED", "this connection serves another session"))
        try:
            session = self.servicer.daemon.session(session_id)
        except KVError as e:
            raise TurnAway(e) from None
        if session.peer is not None and session.peer.uid != conn.uid:
            raise TurnAway(KVError("PERMISSION_DENIED", "this session belongs to another caller"))
        conn.session = session

    def _refusal(self, error: KVError) -> bytes:
        self.servicer.daemon.count_error(error.code)  # (listening only once the daemon serves)
        return frame(getattr(grpc.StatusCode, error.code).value[0], error.message.encode())

    def _turn_away(self, conn: Connection, error: KVError) -> None:
        self.servicer.daemon.count_error(error.code)
        try:
            conn.writer.write(frame(TURNED_AWAY, bytes([getattr(grpc.StatusCode, error.code).value[0]])
                                    + error.message.encode()))
        except (ConnectionError, RuntimeError):
            pass
        conn.writer.close()
