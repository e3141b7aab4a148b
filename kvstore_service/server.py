"""gRPC front end: thin handlers that translate messages to KVStore calls, plus the serve loop."""

from __future__ import annotations

import asyncio
import gc
import grp
import logging
import os
import signal
import socket
import sys

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_service import __version__
from kvstore_service.config import Config
from kvstore_service.core import MAX_KEY, MIN_KEY, KVError, KVStore, Layout, Region
from kvstore_service.index import unpack_keys
from kvstore_service.peercred import Handshake, PeerCredServer, close_fds

log = logging.getLogger(__name__)
SWITCH_INTERVAL_S = 0.0002
SERVICE = "kvstore.v1.KVStore"


def check_keys(keys: bytes, key_size: int) -> None:
    if not MIN_KEY <= key_size <= MAX_KEY:
        raise KVError("INVALID_ARGUMENT", f"key_size {key_size} is outside {MIN_KEY}..{MAX_KEY} bytes")
    if len(keys) % key_size:
        raise KVError("INVALID_ARGUMENT", f"{len(keys)} key bytes are not a multiple of key_size {key_size}")


def split_keys(keys: bytes, key_size: int) -> list[bytes]:
    check_keys(keys, key_size)
    return list(unpack_keys(keys, key_size))


class Servicer(pb_grpc.KVStoreServicer):
    def __init__(self, stopping: asyncio.Event, creds: PeerCredServer) -> None:
        self._core: KVStore | None = None  # None while the pool is set up
        self.stopping = stopping
        self.creds = creds
        self._cleanups: set[asyncio.Task] = set()

    @property
    def core(self) -> KVStore:
        if self._core is None:
            raise KVError("UNAVAILABLE", "the daemon is starting (setting up the pool); retry shortly")
        return self._core

    def _authorize(self, token: bytes, context: grpc.aio.ServicerContext) -> Handshake | None:
        """Unix-socket callers of Register/Clear are known by SO_PEERCRED; with --allowed-uids they must
        be. TCP callers are authenticated by TLS instead."""
        handshake = self.creds.take(token) if token else None
        if handshake is None and self.creds.allowed_uids and context.peer().startswith("unix:"):
            raise KVError("PERMISSION_DENIED", "this daemon serves only --allowed-uids, and the caller's "
                          "credentials were not verified (missing or expired peer_token)")
        return handshake

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        handshake = self._authorize(request.peer_token, context)
        layout = None
        if request.HasField("layout"):
            regions = tuple(Region(r.offset, r.block_stride, r.block_bytes) for r in request.layout.regions)
            layout = Layout(request.layout.num_blocks, regions)
        mem = request.memory
        session = self.core.register(
            protocol_version=request.protocol_version, engine_id=request.engine_id, namespace=request.namespace,
            layout=layout, backend=mem.backend or "cpu", handle=mem.handle, memory_size=mem.size,
            device=mem.device, completion_slots=request.completion_slots,
            peer=handshake.cred if handshake else None, fds=handshake.fds if handshake else [],
        )
        block_bytes = layout.block_bytes if layout else 0
        return pb.RegisterResponse(session_id=session.session_id, block_bytes=block_bytes,
                                   max_inflight_jobs=self.core.config.max_inflight_jobs,
                                   daemon_version=__version__, daemon_boot_id=self.core.boot_id)

    async def Attach(self, request: pb.AttachRequest, context: grpc.aio.ServicerContext):  # type: ignore[override]
        session = self.core.attach(request.session_id)
        try:
            yield pb.SessionEvent(attached=pb.Attached(daemon_boot_id=self.core.boot_id))
            stopping = asyncio.ensure_future(self.stopping.wait())
            ended = asyncio.ensure_future(session.ended.wait())
            await asyncio.wait([stopping, ended], return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            ended.cancel()
            reason = "session ended" if session.ended.is_set() else "daemon shutting down"
            yield pb.SessionEvent(shutdown=pb.Shutdown(reason=reason))
        finally:
            # The stream closed: the client went away (or unregistered). Clean up off this task,
            # which may be cancelled.
            if not self.stopping.is_set():
                task = asyncio.get_running_loop().create_task(self.core.end_session(session))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def Unregister(self, request: pb.UnregisterRequest, context) -> pb.UnregisterResponse:
        await self.core.end_session(self.core.session(request.session_id))
        return pb.UnregisterResponse()

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        check_keys(request.keys, request.key_size)  # kept packed: the lookup slices only what it walks
        hits, lease_id = self.core.lookup(request.session_id, request.namespace, request.keys, request.key_size,
                                          request.lease, request.lease_ttl_ms)
        return pb.LookupResponse(hits=hits, lease_id=lease_id)

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context) -> pb.ReleaseLeaseResponse:
        self.core.release_lease(request.session_id, request.lease_id)
        return pb.ReleaseLeaseResponse()

    async def Store(self, request: pb.TransferRequest, context) -> pb.TransferResponse:
        return self._submit(request, is_store=True)

    async def Load(self, request: pb.TransferRequest, context) -> pb.TransferResponse:
        return self._submit(request, is_store=False)

    def _submit(self, request: pb.TransferRequest, is_store: bool) -> pb.TransferResponse:
        keys = split_keys(request.keys, request.key_size)
        job = self.core.submit(request.session_id, request.job_id, keys, request.block_ids, is_store)
        return pb.TransferResponse(job_id=job.job_id)

    async def Poll(self, request: pb.PollRequest, context) -> pb.PollResponse:
        jobs = await self.core.poll(request.session_id, min(request.wait_ms, 60_000))
        return pb.PollResponse(jobs=[pb.JobResult(job_id=j.job_id, is_store=j.is_store, block_ok=j.ok,
                                                  error=j.error) for j in jobs])

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = self.core.stats()
        namespaces = [pb.NamespaceStats(**ns) for ns in stats.pop("namespaces")]
        return pb.StatsResponse(namespaces=namespaces, daemon_version=__version__, **stats)

    async def Clear(self, request: pb.ClearRequest, context) -> pb.ClearResponse:
        handshake = self._authorize(request.peer_token, context)
        if handshake is not None:
            close_fds(handshake.fds)
        return pb.ClearResponse(cleared_blocks=self.core.clear(request.namespace))


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Every failure gets a clear status and the daemon keeps serving: undecodable bytes are
    INVALID_ARGUMENT, a KVError its own code, anything else INTERNAL (logged)."""

    def __init__(self) -> None:
        self.core: KVStore | None = None  # set once the pool is up; counts errors in its metrics

    def count(self, code: str) -> None:
        if self.core is not None:
            self.core.metrics.errors.labels(code).inc()

    async def _fail(self, context, method: str, error: Exception) -> None:
        if isinstance(error, DecodeError):
            code, message = "INVALID_ARGUMENT", f"the request is not a valid {method.rsplit('/', 1)[-1]} message"
        elif isinstance(error, KVError):
            code, message = error.code, error.message
        else:
            log.error("internal error in %s", method, exc_info=error)
            code, message = "INTERNAL", f"internal error: {error}"
        self.count(code)
        await context.abort(getattr(grpc.StatusCode, code), message)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        # Decode the request here, not in gRPC, so that bad bytes get a status of ours.
        decode = handler.request_deserializer

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(raw: bytes, context):
                try:
                    return await inner(decode(raw), context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as e:
                    await self._fail(context, method, e)

            return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            async def stream(raw: bytes, context):
                try:
                    async for event in inner_stream(decode(raw), context):
                        yield event
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as e:
                    await self._fail(context, method, e)

            return grpc.unary_stream_rpc_method_handler(stream, response_serializer=handler.response_serializer)
        return handler


def _prepare_socket(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(path)
            raise SystemExit(f"another daemon is already listening on {path}")
        except OSError:
            os.unlink(path)  # stale socket of a dead daemon
        finally:
            probe.close()


def _secure_socket(path: str, config: Config) -> int | None:
    """Socket file mode and group: who may talk to the daemon at all."""
    os.chmod(path, int(config.socket_mode, 8))
    if not config.socket_group:
        return None
    gid = int(config.socket_group) if config.socket_group.isdigit() else grp.getgrnam(config.socket_group).gr_gid
    os.chown(path, -1, gid)
    return gid


def _tcp_credentials(config: Config) -> grpc.ServerCredentials | None:
    if config.tls_cert:
        with open(config.tls_cert, "rb") as f:
            cert = f.read()
        with open(config.tls_key, "rb") as f:
            key = f.read()
        ca = None
        if config.tls_client_ca:
            with open(config.tls_client_ca, "rb") as f:
                ca = f.read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)
    if not config.insecure:
        raise SystemExit("--tcp needs --tls-cert/--tls-key, or --insecure for plaintext")
    log.warning("listening on plaintext TCP %s: anyone who reaches it can read and write the cache", config.tcp)
    return None


async def serve(config: Config, ready: asyncio.Event | None = None) -> None:
    stopping = asyncio.Event()
    options = [("grpc.max_receive_message_length", int(config.max_request_bytes)),
               ("grpc.max_send_message_length", int(config.max_request_bytes)),
               ("grpc.so_reuseport", 0)]
    errors = ErrorInterceptor()
    server = grpc.aio.server(interceptors=[errors], options=options)
    health_servicer = health.aio.HealthServicer()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)

    peer_creds = PeerCredServer(config.socket + ".cred", config.allowed_uids)
    servicer = Servicer(stopping, peer_creds)
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    _prepare_socket(config.socket)
    server.add_insecure_port(f"unix://{config.socket}")
    if config.tcp:
        creds = _tcp_credentials(config)
        if creds is None:
            server.add_insecure_port(config.tcp)
        else:
            server.add_secure_port(config.tcp, creds)

    await server.start()
    gid = _secure_socket(config.socket, config)
    await peer_creds.start(int(config.socket_mode, 8), gid)
    # The pool is set up (and recovered) while health says NOT_SERVING.
    core = await asyncio.to_thread(KVStore, config)
    servicer._core = errors.core = core

    loop = asyncio.get_running_loop()
    if config.metrics_port:
        core.metrics.serve(config.metrics_port, core.stats, loop)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    async def housekeeping() -> None:
        while True:
            await asyncio.sleep(1.0)
            core.expire_leases()
            peer_creds.expire()
            await core.reap_unattached()
            # The index holds an object per block (millions in a large pool). A full collection
            # would walk them all (tens of ms per 10k blocks, stalling every RPC), though they form
            # no garbage cycles: collect what is young, then move the survivors out of the
            # collector's sight. Garbage among them is still freed by reference counting.
            gc.collect()
            gc.freeze()

    chores = loop.create_task(housekeeping())
    sealing = loop.create_task(core.seal_recovered())
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("kvstore %s serving on %s (pool %s, %d bytes, %d blocks recovered)", __version__, config.socket,
             config.pool_path, core.pool.capacity, core.recovered)
    if ready is not None:
        ready.set()
    await stopping.wait()

    log.info("shutting down")
    await health_servicer.enter_graceful_shutdown()
    chores.cancel()
    sealing.cancel()
    await server.stop(grace=2.0)
    await peer_creds.close()
    await core.shutdown()
    core.pool.close()
    try:
        os.unlink(config.socket)
    except OSError:
        pass


def run(config: Config) -> None:
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    from kvstore_service.pool import PoolFullError

    # A copy thread needs the GIL briefly between native copies while the event loop plans the next
    # chunk; with the default 5 ms switch interval it would idle that long each time.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        uvloop.run(serve(config))
    except (PoolFullError, ValueError, OSError) as e:
        log.error("cannot start: %s", e)
        raise SystemExit(2) from None
