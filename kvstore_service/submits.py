"""`<socket>.jobs`: an engine's store and load requests over a plain unix socket, beside gRPC's.

A gRPC call between two Python processes costs 0.7-1 ms on our machines (most of a small hit's
time from submit to completion); a frame on a unix socket ~0.1 ms
(benchmarks/results/cpu-jobs-socket-2026-11-27.log). The client's submit thread sends here when it
can, and over gRPC otherwise. Both run the same checks (Servicer.submit): a refusal here is the one
the RPC would give, counted alike.

Frames, both ways: a 4-byte little-endian length, then the body. A request: one byte (1 store,
2 load) and a TransferRequest (proto/kvstore.proto). A reply: one byte, 0 and a TransferResponse,
or the refusal's gRPC status code and its message (UTF-8). One reply per request, in order. A frame
over --max-request-bytes, of an unknown kind or that does not parse is refused and the connection
closed; the daemon keeps serving. At most --max-sessions connections are open (a client's session
keeps one): one more is refused (RESOURCE_EXHAUSTED) and closed.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
from google.protobuf.message import DecodeError

from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol.submits import LOAD, STORE, frame
from kvstore_service.errors import KVError, invalid
from kvstore_service.server import Servicer

log = logging.getLogger(__name__)


class UnixPeer:
    """What Servicer.submit asks of a gRPC context: the caller came over the unix socket."""

    @staticmethod
    def peer() -> str:
        return "unix:"


class SubmitSocket:
    def __init__(self, path: str, servicer: Servicer, max_request_bytes: int, max_connections: int) -> None:
        self.path = path
        self.servicer = servicer
        self.max_request_bytes = max_request_bytes
        self.max_connections = max_connections
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.StreamWriter] = set()

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
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections:
            writer.write(self._refusal(KVError("RESOURCE_EXHAUSTED", f"{len(self._connections)} connections to "
                                               f"{self.path} are open (--max-sessions {self.max_connections})")))
            writer.close()
            return
        self._connections.add(writer)
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(4), "little")
                if not 1 <= size <= self.max_request_bytes + 1:
                    writer.write(self._refusal(invalid(f"a request frame of {size} bytes (at most "
                                                       f"--max-request-bytes {self.max_request_bytes} + 1)")))
                    break
                reply, keep = self._answer(await reader.readexactly(size))
                writer.write(reply)
                await writer.drain()
                if not keep:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client left
        finally:
            self._connections.discard(writer)
            writer.close()

    def _answer(self, body: bytes) -> tuple[bytes, bool]:
        """The reply to one request, and whether the connection stays open."""
        kind = body[0]
        if kind not in (STORE, LOAD):
            return self._refusal(invalid(f"unknown request kind {kind} (1 store, 2 load)")), False
        try:
            request = pb.TransferRequest.FromString(body[1:])
        except DecodeError:
            return self._refusal(invalid("the request is not a valid TransferRequest message")), False
        try:
            response = self.servicer.submit(request, UnixPeer(), kind == STORE)
        except KVError as e:
            return self._refusal(e), True
        except Exception as e:  # a bug: still answer, keep serving
            log.error("internal error in a submit on %s", self.path, exc_info=e)
            return self._refusal(KVError("INTERNAL", f"internal error: {e}")), True
        return frame(0, response.SerializeToString()), True

    def _refusal(self, error: KVError) -> bytes:
        self.servicer.daemon.count_error(error.code)  # (listening only once the daemon serves)
        return frame(getattr(grpc.StatusCode, error.code).value[0], error.message.encode())
