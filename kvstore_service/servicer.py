"""gRPC front end: each handler decodes its request (and who sends it), calls one verb of the daemon,
and encodes the reply; failures become status codes in one place (ErrorInterceptor)."""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore_client.protocol import MAX_KEY, MIN_KEY, unpack_block_ids
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_client.protocol.groups import check_spans
from kvstore_service import __version__
from kvstore_service.config import Config
from kvstore_service.daemon import Daemon
from kvstore_service.errors import KVError, invalid
from kvstore_service.events import Batch
from kvstore_service.peercred import Handshake, PeerCredServer, close_fds
from kvstore_service.registered_layout import Layout, Region
from kvstore_service.sessions import Registration, Session
from kvstore_service.stats import to_proto
from kvstore_service.tenants import Caller, Tenancy, check_namespace

log = logging.getLogger(__name__)
SERVICE = "kvstore.v1.KVStore"


def check_keys(keys: bytes, key_size: int) -> None:
    if not MIN_KEY <= key_size <= MAX_KEY:
        raise invalid(f"key_size {key_size} is outside {MIN_KEY}..{MAX_KEY} bytes")
    if len(keys) % key_size:
        raise invalid(f"{len(keys)} key bytes are not a multiple of key_size {key_size}")


def block_ids_of(request: pb.TransferRequest) -> array[int]:
    """A job's engine block ids: block_id_bytes (protocol 3) or block_ids (2)."""
    packed = request.block_id_bytes
    if not packed:
        return array("Q", request.block_ids)
    if request.block_ids:
        raise invalid("block_ids and block_id_bytes are both set; send one")
    if len(packed) % 8:
        raise invalid(f"block_id_bytes holds {len(packed)} bytes, not whole little-endian uint64s")
    return unpack_block_ids(packed)


def layout_of(message: pb.KVLayout) -> Layout:
    return Layout(message.num_blocks,
                  tuple(Region(r.offset, r.block_stride, r.block_bytes, r.memory) for r in message.regions),
                  max(1, message.shards), message.shard)


def registration_of(request: pb.RegisterRequest, caller: Caller) -> Registration:
    memories = request.memories
    backends = {m.backend or "cpu" for m in memories}
    devices = {m.device for m in memories}
    if len(backends) > 1 or len(devices) > 1:
        raise invalid(f"the KV memories are of several backends {sorted(backends)} or devices {sorted(devices)}; "
                      "one session registers the memory of one device")
    return Registration(
        protocol_version=request.protocol_version, engine_id=request.engine_id, namespace=request.namespace,
        tenant=caller.member("register"), owner=caller.principal,
        layout=layout_of(request.layout) if request.HasField("layout") else None,
        backend=backends.pop() if backends else "cpu", handles=tuple(m.handle for m in memories),
        memory_sizes=tuple(m.size for m in memories), device=devices.pop() if devices else 0,
        completion_slots=request.completion_slots)


class Servicer(pb_grpc.KVStoreServicer):
    def __init__(self, config: Config, stopping: asyncio.Event, creds: PeerCredServer, tenancy: Tenancy) -> None:
        self._daemon: Daemon | None = None  # None while the pool is set up
        self.config = config
        self.stopping = stopping
        self.creds = creds
        self.tenancy = tenancy
        self._cleanups: set[asyncio.Task[None]] = set()

    @property
    def daemon(self) -> Daemon:
        if self._daemon is None:
            raise KVError("UNAVAILABLE", "the daemon is starting (setting up the pool); retry shortly")
        return self._daemon

    def _identify(self, token: bytes, context: Any, required: bool = False) -> tuple[Caller, Handshake | None]:
        """Who calls: on the unix socket the handshake named by `token` (SO_PEERCRED), over TCP the
        client certificate (tenants.py). `required`: a unix caller must have done the handshake."""
        handshake = self.creds.take(token) if token else None
        if handshake is None and context.peer().startswith("unix:") and (required or self.tenancy.restricted):
            raise KVError("PERMISSION_DENIED", "the caller's credentials were not verified (missing or expired "
                          "peer_token: do the <socket>.cred handshake first)")
        return self.tenancy.identify(handshake.cred if handshake else None, context), handshake

    def _caller(self, token: bytes, context: Any) -> Caller:
        """Who calls, for a request that brings no memory (a handshake's descriptors are closed)."""
        caller, handshake = self._identify(token, context)
        if handshake is not None:
            close_fds(handshake.fds)
        return caller

    def _session(self, session_id: bytes, context: Any) -> Session:
        session = self.daemon.session(session_id)
        self.tenancy.check_session(session.owner, context)
        return session

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        caller, handshake = self._identify(request.peer_token, context, required=True)
        config = self.config
        try:  # limits first, before building anything from the request
            if len(request.layout.regions) > config.max_layout_regions:
                raise invalid(f"the layout has {len(request.layout.regions)} regions, more than "
                              f"--max-layout-regions {config.max_layout_regions}")
            if len(request.memories) > config.max_session_memories:
                raise invalid(f"{len(request.memories)} KV memories, more than --max-session-memories "
                              f"{config.max_session_memories}")
            registration = registration_of(request, caller)
        except KVError:
            if handshake is not None:
                close_fds(handshake.fds)
            raise
        done = await self.daemon.register(registration, handshake.cred if handshake else None,
                                          handshake.fds if handshake else [])
        return pb.RegisterResponse(session_id=done.session_id, block_bytes=done.block_bytes,
                                   max_inflight_jobs=done.max_inflight_jobs, daemon_version=__version__,
                                   daemon_boot_id=done.boot_id, progress_load_bytes=done.progress_load_bytes)

    async def Attach(self, request: pb.AttachRequest, context: Any) -> AsyncIterator[pb.SessionEvent]:
        daemon = self.daemon
        session = daemon.attach(self._session(request.session_id, context))
        try:
            yield pb.SessionEvent(attached=pb.Attached(daemon_boot_id=daemon.boot_id))
            # Ended once its copies are (also when the daemon stops: Daemon.drain): the client then
            # takes every job not posted as failed.
            await session.ended.wait()
            reason = "daemon shutting down" if self.stopping.is_set() else "session ended"
            yield pb.SessionEvent(shutdown=pb.Shutdown(reason=reason))
        finally:
            # The stream closed: the client went away (or unregistered). Clean up off this task,
            # which may be cancelled.
            if not self.stopping.is_set():
                task = asyncio.get_running_loop().create_task(daemon.end(session))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def Unregister(self, request: pb.UnregisterRequest, context: Any) -> pb.UnregisterResponse:
        await self.daemon.end(self._session(request.session_id, context))
        return pb.UnregisterResponse()

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        check_keys(request.keys, request.key_size)  # kept packed: the lookup slices only what it walks
        if (n := len(request.keys) // request.key_size) > self.config.max_lookup_keys:
            raise invalid(f"a lookup of {n} keys, more than --max-lookup-keys {self.config.max_lookup_keys}")
        if request.group_spans and (why := check_spans(request.group_spans, len(request.keys) // request.key_size)):
            raise invalid(why)
        session: Session | None = None
        caller: Caller | None = None
        if request.session_id:
            session = self._session(request.session_id, context)
        else:
            if request.lease:
                raise invalid("a lease needs a session")
            if not request.namespace:
                raise invalid("lookup needs a session or a namespace")
            check_namespace(request.namespace, self.config.max_namespace_bytes)
            caller = self._caller(request.peer_token, context)
        hits, lease_id = await self.daemon.lookup(session, caller, request.namespace, request.keys, request.key_size,
                                                  request.lease, request.lease_ttl_ms, request.group_spans)
        return pb.LookupResponse(hits=hits, lease_id=lease_id)

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Any) -> pb.ReleaseLeaseResponse:
        self.daemon.release_lease(self._session(request.session_id, context), request.lease_id)
        return pb.ReleaseLeaseResponse()

    async def Store(self, request: pb.TransferRequest, context: Any) -> pb.TransferResponse:
        return self.submit(request, context, is_store=True)

    async def Load(self, request: pb.TransferRequest, context: Any) -> pb.TransferResponse:
        return self.submit(request, context, is_store=False)

    def submit(self, request: pb.TransferRequest, context: Any, is_store: bool) -> pb.TransferResponse:
        """Store and Load, here and on <socket>.jobs (jobs_socket.py)."""
        check_keys(request.keys, request.key_size)
        session = self._session(request.session_id, context)
        job_id = self.daemon.submit(session, request.job_id, request.keys, request.key_size, block_ids_of(request),
                                    is_store, request.partial_tail, request.order_seq, request.expires_ns)
        return pb.TransferResponse(job_id=job_id)

    async def Poll(self, request: pb.PollRequest, context: Any) -> pb.PollResponse:
        results = await self.daemon.poll(self._session(request.session_id, context), request.wait_ms)
        jobs = []
        for r in results:
            ok = [True] * r.blocks
            for i in r.failed:
                ok[i] = False
            jobs.append(pb.JobResult(job_id=r.job_id, is_store=r.is_store, block_ok=ok, error=r.error))
        return pb.PollResponse(jobs=jobs)

    async def DescribeBlocks(self, request: pb.DescribeBlocksRequest, context: Any) -> pb.DescribeBlocksResponse:
        check_keys(request.keys, request.key_size)
        self.daemon.describe_blocks(self._session(request.session_id, context), request.keys, request.key_size,
                                    request.descriptions)
        return pb.DescribeBlocksResponse()

    async def WatchBlocks(self, request: pb.WatchBlocksRequest, context: Any) -> AsyncIterator[pb.BlockEvents]:
        async for batch in self.daemon.watch_blocks(self._session(request.session_id, context)):
            yield block_events(batch)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        # Anyone may ask for the daemon-wide figures; the namespaces shown depend on who asks.
        handshake = self.creds.take(request.peer_token) if request.peer_token else None
        if handshake is not None:
            close_fds(handshake.fds)
        return to_proto(self.daemon.stats(self.tenancy.identify(handshake.cred if handshake else None, context)))

    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        caller = self._caller(request.peer_token, context)
        return pb.ClearResponse(cleared_blocks=await self.daemon.clear(caller, request.tenant, request.namespace))


def block_events(batch: Batch) -> pb.BlockEvents:
    """A batch of block events as the message, made once for every stream that sends it (events.Batch)."""
    if batch.encoded is None:
        batch.encoded = pb.BlockEvents(reset=batch.reset, events=[
            pb.BlockEvent(removed=e.removed, key=e.key, description=e.description,
                          medium=pb.MEDIUM_DISK if e.disk else pb.MEDIUM_POOL) for e in batch.events])
    return batch.encoded


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Every failure gets a clear status and the daemon keeps serving: undecodable bytes are
    INVALID_ARGUMENT, a KVError its own code, anything else INTERNAL (logged)."""

    def __init__(self) -> None:
        self.daemon: Daemon | None = None  # set once the pool is up; counts errors in its metrics

    async def _fail(self, context: Any, method: str, error: Exception) -> None:
        if isinstance(error, DecodeError):
            code, message = "INVALID_ARGUMENT", f"the request is not a valid {method.rsplit('/', 1)[-1]} message"
        elif isinstance(error, KVError):
            code, message = error.code, error.message
        else:
            log.error("internal error in %s", method, exc_info=error)
            code, message = "INTERNAL", f"internal error: {error}"
        if self.daemon is not None:
            self.daemon.count_error(code)
        await context.abort(getattr(grpc.StatusCode, code), message)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method: str = handler_call_details.method
        # Decode the request here, not in gRPC, so that bad bytes get a status of ours.
        decode: Callable[[bytes], Any] = handler.request_deserializer  # type: ignore[assignment]
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(raw: bytes, context: Any) -> Any:
                try:
                    return await inner(decode(raw), context)
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as e:
                    await self._fail(context, method, e)

            return grpc.unary_unary_rpc_method_handler(unary, response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream: Callable[..., AsyncIterator[Any]] = handler.unary_stream  # type: ignore[assignment]

            async def stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
                try:
                    async for event in inner_stream(decode(raw), context):
                        yield event
                except (grpc.aio.AbortError, asyncio.CancelledError):
                    raise
                except Exception as e:
                    await self._fail(context, method, e)

            return grpc.unary_stream_rpc_method_handler(stream, response_serializer=handler.response_serializer)
        return handler


class GrpcServer:
    """The gRPC server with the KVStore and health services; answers UNAVAILABLE until `serve`."""

    def __init__(self, config: Config, stopping: asyncio.Event, creds: PeerCredServer, tenancy: Tenancy) -> None:
        options = [("grpc.max_receive_message_length", int(config.max_request_bytes)),
                   ("grpc.max_send_message_length", int(config.max_request_bytes)),
                   ("grpc.so_reuseport", 0)]
        self.errors = ErrorInterceptor()
        self.server = grpc.aio.server(interceptors=[self.errors], options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.servicer = Servicer(config, stopping, creds, tenancy)
        pb_grpc.add_KVStoreServicer_to_server(self.servicer, self.server)

    def listen(self, target: str, credentials: grpc.ServerCredentials | None = None) -> None:
        if credentials is None:
            self.server.add_insecure_port(target)
        else:
            self.server.add_secure_port(target, credentials)

    async def start(self) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def serve(self, daemon: Daemon) -> None:
        """The pool is up: answer requests, and say so to health checks."""
        self.servicer._daemon = self.errors.daemon = daemon
        for name in ("", SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace=grace)
