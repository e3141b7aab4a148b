"""gRPC front end: thin handlers that translate messages to calls on the daemon, and back."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore_client.protocol import MAX_KEY, MIN_KEY
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc
from kvstore_service import __version__
from kvstore_service.config import Config
from kvstore_service.errors import KVError, invalid
from kvstore_service.index import Block, Namespace, unpack_keys
from kvstore_service.layout import Layout, Region
from kvstore_service.peercred import Handshake, PeerCredServer, close_fds
from kvstore_service.sessions import EngineSession, Registration, Session
from kvstore_service.stats import to_proto
from kvstore_service.tenants import Caller, Tenancy, check_namespace, scoped

if TYPE_CHECKING:
    from kvstore_service.daemon import Daemon

log = logging.getLogger(__name__)
SERVICE = "kvstore.v1.KVStore"


def check_keys(keys: bytes, key_size: int) -> None:
    if not MIN_KEY <= key_size <= MAX_KEY:
        raise invalid(f"key_size {key_size} is outside {MIN_KEY}..{MAX_KEY} bytes")
    if len(keys) % key_size:
        raise invalid(f"{len(keys)} key bytes are not a multiple of key_size {key_size}")


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
    def __init__(self, stopping: asyncio.Event, creds: PeerCredServer, tenancy: Tenancy) -> None:
        self._daemon: Daemon | None = None  # None while the pool is set up
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

    def _session(self, session_id: bytes, context: Any) -> Session:
        session = self.daemon.sessions.get(session_id)
        self.tenancy.check_session(session.owner, context)
        return session

    async def Register(self, request: pb.RegisterRequest, context: Any) -> pb.RegisterResponse:
        caller, handshake = self._identify(request.peer_token, context, required=True)
        config = self.daemon.config
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
        session = await self.daemon.sessions.register(registration, handshake.cred if handshake else None,
                                                handshake.fds if handshake else [])
        return pb.RegisterResponse(session_id=session.session_id,
                                   block_bytes=registration.layout.slot_bytes if registration.layout else 0,
                                   max_inflight_jobs=self.daemon.config.max_inflight_jobs,
                                   daemon_version=__version__, daemon_boot_id=self.daemon.boot_id,
                                   progress_load_bytes=session.backend.whole_load_bytes
                                   if isinstance(session, EngineSession) else 0)

    async def Attach(self, request: pb.AttachRequest, context: Any) -> AsyncIterator[pb.SessionEvent]:
        sessions = self.daemon.sessions
        session = sessions.attach(self._session(request.session_id, context))
        try:
            yield pb.SessionEvent(attached=pb.Attached(daemon_boot_id=self.daemon.boot_id))
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
                task = asyncio.get_running_loop().create_task(sessions.end(session))
                self._cleanups.add(task)
                task.add_done_callback(self._cleanups.discard)

    async def Unregister(self, request: pb.UnregisterRequest, context: Any) -> pb.UnregisterResponse:
        sessions = self.daemon.sessions
        await sessions.end(self._session(request.session_id, context))
        return pb.UnregisterResponse()

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        check_keys(request.keys, request.key_size)  # kept packed: the lookup slices only what it walks
        session: Session | None = None
        name = ""
        if request.session_id:
            session = self._session(request.session_id, context)
            if request.namespace:
                name = scoped(session.tenant, request.namespace)
        else:
            if request.lease:
                raise invalid("a lease needs a session")
            if not request.namespace:
                raise invalid("lookup needs a session or a namespace")
            check_namespace(request.namespace, self.daemon.config.max_namespace_bytes)
            caller, handshake = self._identify(request.peer_token, context)
            if handshake is not None:
                close_fds(handshake.fds)
            name = scoped(caller.member("look up blocks"), request.namespace)
        if self.daemon.tiers is not None:  # the pool's misses are brought in from the tiers below first
            ns = self.daemon.index.find_namespace(session.namespace_name if session is not None else name)
            if ns is not None:
                # Shielded: a promotion cut short would leave its reserved slots WRITING for good.
                await asyncio.shield(self._promote(ns, list(unpack_keys(request.keys, request.key_size))))
        hits, lease_id = self.daemon.sessions.lookup(session, name, request.keys, request.key_size,
                                                     request.lease, request.lease_ttl_ms)
        return pb.LookupResponse(hits=hits, lease_id=lease_id)

    async def _promote(self, ns: Namespace, keys: list[bytes]) -> None:
        """Bring a lookup's misses in from the tiers, a run at a time (a promotion stops at a block the
        pool holds), as far as the pool can hold them and --remote-fetch-bytes allows. The lookup's
        blocks in the pool are pinned meanwhile: the promotion's evictions must not take them."""
        tiers, index = self.daemon.tiers, self.daemon.index
        assert tiers is not None
        budget = max(1, int(self.daemon.config.remote_fetch_bytes) // ns.block_bytes)
        held: list[Block] = []
        try:
            while budget > 0:
                index.unpin(held)
                held = index.pin_present(ns, keys)
                start = index.leading(ns, keys)
                if start == len(keys):
                    break
                promoted = await tiers.promote(ns, keys[:start + budget])
                if not promoted:
                    break
                budget -= promoted
        finally:
            index.unpin(held)

    async def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: Any) -> pb.ReleaseLeaseResponse:
        self.daemon.sessions.release_lease(self._session(request.session_id, context), request.lease_id)
        return pb.ReleaseLeaseResponse()

    async def Store(self, request: pb.TransferRequest, context: Any) -> pb.TransferResponse:
        return self._submit(request, context, is_store=True)

    async def Load(self, request: pb.TransferRequest, context: Any) -> pb.TransferResponse:
        return self._submit(request, context, is_store=False)

    def _submit(self, request: pb.TransferRequest, context: Any, is_store: bool) -> pb.TransferResponse:
        check_keys(request.keys, request.key_size)
        session = self.daemon.sessions.engine(self._session(request.session_id, context))
        keys = list(unpack_keys(request.keys, request.key_size))
        job = self.daemon.jobs.submit(session, request.job_id, keys, request.block_ids, is_store,
                                      is_store and request.partial_tail)
        return pb.TransferResponse(job_id=job.job_id)

    async def Poll(self, request: pb.PollRequest, context: Any) -> pb.PollResponse:
        session = self._session(request.session_id, context)
        if not isinstance(session, EngineSession):
            return pb.PollResponse()  # a lookup session runs no jobs
        results = await self.daemon.jobs.poll(session, min(request.wait_ms, 60_000))
        jobs = []
        for r in results:
            ok = [True] * r.blocks
            for i in r.failed:
                ok[i] = False
            jobs.append(pb.JobResult(job_id=r.job_id, is_store=r.is_store, block_ok=ok, error=r.error))
        return pb.PollResponse(jobs=jobs)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        # Anyone may ask for the daemon-wide figures; the namespaces shown depend on who asks.
        handshake = self.creds.take(request.peer_token) if request.peer_token else None
        if handshake is not None:
            close_fds(handshake.fds)
        return to_proto(self.daemon.stats(self.tenancy.identify(handshake.cred if handshake else None, context)))

    async def Clear(self, request: pb.ClearRequest, context: Any) -> pb.ClearResponse:
        caller, handshake = self._identify(request.peer_token, context)
        if handshake is not None:
            close_fds(handshake.fds)
        tenant: str | None = request.tenant  # None: every tenant's
        if not caller.admin:
            if tenant and tenant != caller.tenant:
                raise KVError("PERMISSION_DENIED", f"only admins (--admin-uids) may clear tenant {tenant!r}'s blocks")
            tenant = caller.member("clear blocks")
        elif not tenant and request.namespace:
            if caller.tenant is None:
                raise invalid("name the tenant whose namespace to clear")
            tenant = caller.tenant
        elif not tenant:
            tenant = None
        return pb.ClearResponse(cleared_blocks=await self.daemon.clear(tenant, request.namespace))


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
            self.daemon.metrics.errors.labels(code).inc()
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
        self.servicer = Servicer(stopping, creds, tenancy)
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
