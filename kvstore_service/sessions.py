"""Sessions and leases: who is connected, what memory they registered, which blocks they pin.

Two shapes of session. A lookup session (vLLM's scheduler) names a namespace and looks blocks up,
pinning hits with leases. An engine session (a vLLM worker) also registered its KV memory: it has a
layout, a mapping of that memory made by a device backend, and a completion channel, and it runs
store and load jobs (jobs.py, which keeps their state). A session lives while its client keeps the Attach
stream open.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from array import array
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore_client.protocol import MAX_COMPLETION_SLOTS, OLDEST_PROTOCOL_VERSION, PROTOCOL_VERSION
from kvstore_client.protocol.completion import CompletionChannel
from kvstore_service.backends import Backend, Mapping, make_backend
from kvstore_service.backends.base import pool_pieces
from kvstore_service.config import Config
from kvstore_service.errors import KVError, invalid
from kvstore_service.index import Block, BlockIndex, Namespace
from kvstore_service.peercred import PeerCred, close_fds
from kvstore_service.pool import Pool
from kvstore_service.registered_layout import Layout
from kvstore_service.tenants import UNIX, check_namespace, scoped, split

log = logging.getLogger(__name__)
# Runs a blocking call in a thread and awaits it (Jobs.device_call): device calls never block the loop.
OffLoop = Callable[..., Awaitable[Any]]


def open_backend(name: str, pool: Pool, pin_now: bool = True) -> Backend:
    """Blocking (a thread, or the daemon's start): load a device runtime, pin the pool for it in
    segment-sized pieces. `pin_now` (the daemon's start, --devices): on the daemon's device 0 right
    away, so that no Register waits for it; else (opened for a Register) on that engine's device,
    with its mapping (no context on a device no engine uses)."""
    try:
        backend = make_backend(name)
    except ValueError as e:
        raise invalid(str(e)) from None
    except (ImportError, RuntimeError) as e:
        raise KVError("FAILED_PRECONDITION", f"backend {name!r} is not usable here: {e}") from None
    pieces = pool_pieces(pool.base, pool.data_offset, pool.segment_size, len(pool.segments))
    try:
        backend.register_pool(pieces, device=0 if pin_now else None)
    except RuntimeError as e:  # a sticky device error (a failed pinning only warns, see pin_pool_on): unusable
        raise KVError("FAILED_PRECONDITION", f"backend {name!r} is not usable here: {e}") from None
    return backend


def _take(counter: Counter[str], key: str, n: int) -> None:
    """Count n less for key; a count of 0 goes (owners come and go)."""
    counter[key] -= n
    if not counter[key]:
        del counter[key]


@dataclass(eq=False)
class Lease:
    lease_id: bytes
    blocks: list[Block]
    expires: float


@dataclass(eq=False, kw_only=True)
class Session:
    """A lookup session: a namespace, the leases it holds."""

    session_id: bytes
    engine_id: str
    tenant: str
    namespace_name: str  # the index's name: the tenant's (tenants.scoped)
    namespace: Namespace | None  # None until some engine registers memory in it
    owner: str  # the caller that registered it (tenants.Caller.principal); only it may use the session
    peer: PeerCred | None  # pid/uid from SO_PEERCRED when the client did the handshake
    attached: bool = False
    closed: bool = False
    created: float = field(default_factory=time.monotonic)
    leases: dict[bytes, Lease] = field(default_factory=dict)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when the session is over


@dataclass(eq=False, kw_only=True)
class EngineSession(Session):
    """A session with registered KV memory: it runs store and load jobs."""

    namespace: Namespace
    layout: Layout
    backend: Backend
    mappings: list[Mapping]  # one per KV memory, in the layout's memory order
    memory_bytes: int  # what the layout addresses (mapped): counts against --max-memory-per-uid
    channel: CompletionChannel
    # Where the layout's regions lie in the mapped memories, as native.plan_transfer takes them (five
    # values each: the address of its block 0, its stride, its block bytes, its mapping's [lo, hi)):
    # made once, not for each chunk (64 regions, ~20 us).
    regions: array[int] = field(init=False)

    def __post_init__(self) -> None:
        self.regions = array("Q")
        for r in self.layout.regions:
            mapping = self.mappings[r.memory]
            self.regions.extend((mapping.base + r.offset, r.block_stride, r.block_bytes, mapping.base,
                                 mapping.base + mapping.size))


@dataclass(frozen=True)
class Registration:
    """What a Register request asks for; `layout` None: a lookup session."""

    protocol_version: int
    engine_id: str
    namespace: str  # the client's name (the tenant's namespace)
    layout: Layout | None = None
    backend: str = "cpu"
    handles: tuple[bytes, ...] = ()  # one per KV memory (cpu: empty handles, the memfds come by handshake)
    memory_sizes: tuple[int, ...] = ()
    device: int = 0
    completion_slots: int = 0
    tenant: str = ""
    owner: str = UNIX  # the caller (tenants.Caller.principal)


class Sessions:
    """The registry of sessions, and the leases they hold on the index's blocks."""

    def __init__(self, config: Config, pool: Pool, index: BlockIndex, device_call: OffLoop,
                 backends: dict[str, Backend] | None = None, *,
                 settle: Callable[[EngineSession], Awaitable[None]]) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.device_call = device_call
        self.settle = settle  # waits for an ending session's jobs (Jobs.settle): they use its memory
        self.by_id: dict[bytes, Session] = {}
        self.lease_expiries = 0
        self._registering = 0  # registrations waiting for a device call: they count against max_sessions
        # Per owner, the registrations in progress and the memory they will map: counted from before their
        # first await, so that concurrent registrations cannot all pass a per-owner limit.
        self._registering_by_owner: Counter[str] = Counter()
        self._registering_memory: Counter[str] = Counter()
        self.leases_by_owner: Counter[str] = Counter()
        # Per tenant, the blocks its leases pin (a block leased twice counted once) and their bytes.
        self._leased: dict[str, dict[Block, int]] = {}
        self._leased_bytes: Counter[str] = Counter()
        self._lease_blocks: Counter[str] = Counter()  # blocks named by each owner's leases (their memory)
        # --max-lease-share: with tenants only (a lone tenant starves no one).
        self.max_leased_bytes = int(pool.capacity * config.max_lease_share) if config.tenants else pool.capacity
        # By name; others are made on first use, once (concurrent registrations wait for the same one).
        self._backends: dict[str, asyncio.Future[Backend] | Backend] = dict(backends or {})

    # -- registration ----------------------------------------------------------------------------

    async def register(self, request: Registration, peer: PeerCred | None = None,
                       fds: list[int] | None = None) -> Session:
        """`fds` come from the handshake: the completion channel, then (cpu) the KV memory. They are
        closed here, whatever happens; the mappings keep what they need. Device work (making the
        backend, pinning the pool, opening the engine's memory) runs off the event loop. A caller
        that gives up (its RPC cancelled) does not cut a registration short: it completes, and the
        session, never attached, is reaped like any other."""
        return await asyncio.shield(self._register(request, peer, list(fds or [])))

    async def _register(self, request: Registration, peer: PeerCred | None, fds: list[int]) -> Session:
        owner = request.owner
        counted = False
        try:
            if not OLDEST_PROTOCOL_VERSION <= request.protocol_version <= PROTOCOL_VERSION:
                raise KVError("FAILED_PRECONDITION",
                              f"client speaks protocol {request.protocol_version}, this daemon speaks "
                              f"{OLDEST_PROTOCOL_VERSION} to {PROTOCOL_VERSION}; upgrade the client or the daemon")
            check_namespace(request.namespace, self.config.max_namespace_bytes)
            engine_id_bytes = len(request.engine_id.encode())
            if engine_id_bytes > self.config.max_engine_id_bytes:
                raise invalid(f"engine_id is {engine_id_bytes} bytes, more than --max-engine-id-bytes "
                              f"{self.config.max_engine_id_bytes}")
            mine = sum(1 for x in self.by_id.values() if x.owner == owner) + self._registering_by_owner[owner]
            if mine >= self.config.max_sessions_per_uid:
                raise KVError("RESOURCE_EXHAUSTED", f"{owner} already has {mine} sessions (--max-sessions-per-uid "
                              f"{self.config.max_sessions_per_uid}), registrations in progress included")
            if len(self.by_id) + self._registering >= self.config.max_sessions:
                raise KVError("RESOURCE_EXHAUSTED",
                              f"the daemon already has {len(self.by_id) + self._registering} sessions "
                              f"(--max-sessions {self.config.max_sessions})")
            if request.layout is None:
                name = scoped(request.tenant, request.namespace)
                session = Session(session_id=secrets.token_bytes(16), engine_id=request.engine_id,
                                  tenant=request.tenant, namespace_name=name, owner=request.owner, peer=peer,
                                  namespace=self.index.find_namespace(name))
            else:
                memory = self._check_memory(request, request.layout)
                host = memory if request.backend == "cpu" else 0
                self._registering += 1
                self._registering_by_owner[owner] += 1
                self._registering_memory[owner] += host
                counted = True
                session = await self._register_engine(request, request.layout, peer, fds, memory)
        finally:
            close_fds(fds)
            if counted:  # (the session, if any, counts from the same step on)
                self._registering -= 1
                _take(self._registering_by_owner, owner, 1)
                _take(self._registering_memory, owner, host)
        self.by_id[session.session_id] = session
        log.info("session %s registered: engine %r (pid %s, uid %s) namespace %r", session.session_id.hex()[:8],
                 request.engine_id, peer.pid if peer else "?", peer.uid if peer else "?", request.namespace)
        return session

    def _check_memory(self, request: Registration, layout: Layout) -> int:
        """The bytes an engine registration's layout addresses (what the daemon will map). Host memory
        (cpu) is checked against the limits per session and per owner (its sessions and registrations in
        progress); device memory maps no host memory, and has its limit per device (_check_device)."""
        memories = len(request.memory_sizes)
        if not memories or len(request.handles) != memories:
            raise invalid("an engine registration needs at least one KV memory")
        if layout.shards > self.config.max_shards:
            raise invalid(f"layout: {layout.shards} TP shards, more than --max-shards {self.config.max_shards}")
        layout.check(list(request.memory_sizes))
        memory = sum(layout.extents(memories))
        if request.backend != "cpu":
            return memory
        if memory > self.config.max_session_memory:
            raise KVError("RESOURCE_EXHAUSTED", f"the layout addresses {memory} bytes, more than "
                          f"--max-session-memory {int(self.config.max_session_memory)}")
        owner = request.owner
        mapped = sum(x.memory_bytes for x in self.by_id.values()
                     if isinstance(x, EngineSession) and x.owner == owner and x.backend.name == "cpu")
        mapped += self._registering_memory[owner]
        if mapped + memory > self.config.max_memory_per_uid:
            raise KVError("RESOURCE_EXHAUSTED", f"{owner}'s sessions address {mapped} bytes already, with this "
                          f"layout's {memory} more than --max-memory-per-uid {int(self.config.max_memory_per_uid)}")
        return memory

    async def _register_engine(self, request: Registration, layout: Layout, peer: PeerCred | None,
                               fds: list[int], memory: int) -> EngineSession:
        memories = len(request.memory_sizes)
        extents = layout.extents(memories)
        if not 0 < request.completion_slots <= MAX_COMPLETION_SLOTS:
            raise invalid(f"completion_slots must be 1..{MAX_COMPLETION_SLOTS}")
        if request.backend == "cuda" and peer is not None and peer.in_my_pid_namespace() is False:
            raise KVError("FAILED_PRECONDITION", "the engine runs in another PID namespace than the daemon, where "
                          "CUDA IPC handles do not open: run both in one (Kubernetes: hostPID: true on the daemon's "
                          "and the engines' pods, as the chart sets)")
        backend = await self._backend(request.backend)
        wanted = 1 + memories if request.backend == "cpu" else 1
        if len(fds) != wanted:
            raise invalid(f"registering {memories} {request.backend} KV memories needs {wanted} shared-memory "
                          f"descriptor(s) from the <socket>.cred handshake, got {len(fds)}")
        name = scoped(request.tenant, request.namespace)
        self._check_block_size(name, layout)
        if self.pool.slots_per_segment(layout.slot_bytes) < 1:
            raise KVError("FAILED_PRECONDITION",
                          f"a {layout.slot_bytes}-byte block is larger than a pool segment "
                          f"({self.pool.segment_size} bytes); raise --segment-size")
        try:
            channel = CompletionChannel.attach(os.dup(fds[0]), request.completion_slots)
        except (ValueError, OSError) as e:
            raise invalid(f"cannot map the completion channel: {e}") from None
        mappings: list[Mapping] = []
        try:
            for i in range(memories):
                # Only what the layout addresses is mapped (and prefaulted), whatever the memory's size.
                fd = fds[1 + i] if request.backend == "cpu" else None
                mappings.append(await self.device_call(backend.map, request.handles[i], extents[i], request.device, fd))
            if request.backend != "cpu":
                self._check_device(backend, mappings[0].device, memory)
            # Only a registration that got this far creates the namespace (another one may have
            # created it meanwhile, with other blocks).
            self._check_block_size(name, layout)
            namespace = self.index.namespace(name, layout.slot_bytes, layout.shards)
        except BaseException as e:
            channel.close()
            for mapping in mappings:
                await self.device_call(backend.unmap, mapping)
            if isinstance(e, (ValueError, OSError)):
                raise invalid(str(e)) from None
            raise
        return EngineSession(session_id=secrets.token_bytes(16), engine_id=request.engine_id, tenant=request.tenant,
                             namespace_name=name, owner=request.owner, peer=peer, namespace=namespace,
                             layout=layout, backend=backend, mappings=mappings, channel=channel,
                             memory_bytes=memory)

    def _check_device(self, backend: Backend, device: int, memory: int) -> None:
        """A device registration's memory, with the sessions' already on that device (the daemon's
        numbering: engines each see theirs as device 0), against --max-device-memory."""
        held = sum(x.memory_bytes for x in self.by_id.values() if isinstance(x, EngineSession)
                   and x.backend is backend and x.mappings[0].device == device)
        if held + memory > self.config.max_device_memory:
            raise KVError("RESOURCE_EXHAUSTED", f"{backend.name} device {device}'s sessions address {held} bytes "
                          f"already, with this layout's {memory} more than --max-device-memory "
                          f"{int(self.config.max_device_memory)}")

    def _check_block_size(self, name: str, layout: Layout) -> None:
        existing = self.index.find_namespace(name)
        if existing is None:
            return
        namespace = split(name)[1]
        if existing.block_bytes != layout.slot_bytes:
            raise KVError("FAILED_PRECONDITION",
                          f"layout mismatch: namespace {namespace!r} holds {existing.block_bytes}-byte "
                          f"blocks, this layout has {layout.slot_bytes}-byte blocks ({layout.shards} x "
                          f"{layout.block_bytes})")
        if existing.shards and existing.shards != layout.shards:
            raise KVError("FAILED_PRECONDITION", f"layout mismatch: namespace {namespace!r} has "
                          f"{existing.shards} TP shards, this layout has {layout.shards}")

    async def _backend(self, name: str) -> Backend:
        """The backend of this name, made (device runtime loaded, pool pinned) off the loop once."""
        known = self._backends.get(name)
        if isinstance(known, Backend):
            return known
        if known is None:
            known = self._backends[name] = asyncio.ensure_future(self.device_call(open_backend, name, self.pool, False))
        try:
            backend = await asyncio.shield(known)
        except Exception:
            self._backends.pop(name, None)  # the next registration tries again
            raise
        self._backends[name] = backend
        return backend

    def get(self, session_id: bytes) -> Session:
        session = self.by_id.get(session_id)
        if session is None or session.closed:
            raise KVError("NOT_FOUND", f"unknown or ended session {session_id.hex() or '(empty)'}; register again")
        return session

    @staticmethod
    def engine(session: Session) -> EngineSession:
        if not isinstance(session, EngineSession):
            raise KVError("FAILED_PRECONDITION", "this session registered no KV memory (lookup-only)")
        return session

    @staticmethod
    def attach(session: Session) -> Session:
        if session.attached:
            raise KVError("ALREADY_EXISTS", "the session already has an Attach stream")
        session.attached = True
        return session

    async def end(self, session: Session) -> None:
        """Drop a session: its leases, then (engine) its mapping once its copies finished. Blocks it
        stored stay in the pool. A caller that gives up (an Unregister RPC cancelled) does not cut
        it short: a session marked closed is never ended again, so it must be ended whole."""
        await asyncio.shield(self._end(session))

    async def _end(self, session: Session) -> None:
        if session.closed:
            return
        session.closed = True
        for lease in list(session.leases.values()):
            self._drop_lease(session, lease)
        if isinstance(session, EngineSession):
            # Copies in flight still use the mapping, and the engine takes the session's end as its
            # jobs' end: both wait until they finish.
            await self.settle(session)
            session.channel.close()
            for mapping in session.mappings:  # device calls may sync the device
                await self.device_call(session.backend.unmap, mapping)
        session.ended.set()
        self.by_id.pop(session.session_id, None)
        log.info("session %s ended", session.session_id.hex()[:8])

    async def end_all(self) -> None:
        for session in list(self.by_id.values()):
            await self.end(session)
        for backend in self._backends.values():
            if isinstance(backend, Backend):
                await self.device_call(backend.unregister_pool)

    async def reap_unattached(self) -> None:
        """A client that registered but never attached its stream (it died in between)."""
        now = time.monotonic()
        for session in list(self.by_id.values()):
            if not session.attached and now - session.created > self.config.attach_timeout_s:
                log.warning("session %s never attached; dropping it", session.session_id.hex()[:8])
                await self.end(session)

    # -- lookups and leases ----------------------------------------------------------------------

    def lookup(self, session: Session | None, namespace: str, keys: bytes, key_size: int, lease: bool,
               ttl_ms: int, spans: Sequence[int] = ()) -> tuple[int, bytes]:
        """How many of the leading keys (packed, `key_size` bytes each) are in the pool: in the session's
        namespace, or without one in `namespace` (the index's name); with `lease` (a session's), those
        blocks are pinned until the lease is released or expires. With group `spans`: how many blocks
        every group serves, leasing the blocks that needs (kvstore_client.protocol.groups)."""
        if session is not None:
            if session.closed:  # (it ended while this lookup waited for a lower tier)
                raise KVError("NOT_FOUND", "the session ended; register again")
            if namespace and namespace != session.namespace_name:
                raise KVError("PERMISSION_DENIED", "a session can only look up its own namespace")
            if session.namespace is None:
                session.namespace = self.index.find_namespace(session.namespace_name)
            ns = session.namespace
        elif lease:
            raise invalid("a lease needs a session")
        else:
            ns = self.index.find_namespace(namespace)
        if lease:
            self._check_lease(session, ttl_ms)
        found: list[Block] = []
        if ns is None:
            hits = 0
        elif spans:
            hits, found = self.index.lookup_groups(ns, keys, key_size, spans)
        else:
            found = self.index.lookup(ns, keys, key_size)
            hits = len(found)
        if not (lease and found and session is not None):
            return hits, b""
        return hits, self._lease(session, found, ttl_ms)

    def _lease(self, session: Session, found: list[Block], ttl_ms: int) -> bytes:
        """Pin these blocks for the session until released or expired: its lease's id."""
        found = list(dict.fromkeys(found))  # a block named twice is leased once
        leased = self._leased.setdefault(session.tenant, {})
        added = sum(1 for b in found if b not in leased) * found[0].namespace.block_bytes
        if self._lease_blocks[session.owner] + len(found) > self.config.max_lease_blocks_per_uid:
            raise KVError("RESOURCE_EXHAUSTED", f"{session.owner}'s leases name {self._lease_blocks[session.owner]} "
                          f"blocks; {len(found)} more would pass --max-lease-blocks-per-uid "
                          f"{self.config.max_lease_blocks_per_uid}; release some")
        if self._leased_bytes[session.tenant] + added > self.max_leased_bytes:
            raise KVError("RESOURCE_EXHAUSTED", f"the tenant's leases pin {self._leased_bytes[session.tenant]} "
                          f"bytes of the pool; {added} more would pass --max-lease-share "
                          f"{self.config.max_lease_share:g} ({self.max_leased_bytes} bytes); release some")
        lease_id = secrets.token_bytes(16)
        self.index.pin(found)
        for block in found:
            leased[block] = leased.get(block, 0) + 1
        self._leased_bytes[session.tenant] += added
        self._lease_blocks[session.owner] += len(found)
        self.leases_by_owner[session.owner] += 1
        ttl = ttl_ms / 1000 if ttl_ms else self.config.lease_ttl_s
        session.leases[lease_id] = Lease(lease_id, found, time.monotonic() + ttl)
        return lease_id

    def _check_lease(self, session: Session | None, ttl_ms: int) -> None:
        if ttl_ms / 1000 > self.config.max_lease_ttl_s:
            raise invalid(f"lease_ttl_ms {ttl_ms} is longer than --max-lease-ttl-s {self.config.max_lease_ttl_s:g}")
        if session is None:
            return
        if len(session.leases) >= self.config.max_leases_per_session:
            raise KVError("RESOURCE_EXHAUSTED", f"the session holds {len(session.leases)} leases "
                          f"(--max-leases-per-session {self.config.max_leases_per_session}); release some")
        if self.leases_by_owner[session.owner] >= self.config.max_leases_per_uid:
            raise KVError("RESOURCE_EXHAUSTED", f"{session.owner}'s sessions hold "
                          f"{self.leases_by_owner[session.owner]} leases (--max-leases-per-uid "
                          f"{self.config.max_leases_per_uid}); release some")

    def release_lease(self, session: Session, lease_id: bytes) -> None:
        lease = session.leases.get(lease_id)
        if lease is None:
            raise KVError("NOT_FOUND", f"unknown or expired lease {lease_id.hex() or '(empty)'}")
        self._drop_lease(session, lease)

    def _drop_lease(self, session: Session, lease: Lease) -> None:
        del session.leases[lease.lease_id]
        self.index.unpin(lease.blocks)
        _take(self.leases_by_owner, session.owner, 1)
        _take(self._lease_blocks, session.owner, len(lease.blocks))
        leased = self._leased[session.tenant]
        for block in lease.blocks:
            if leased[block] > 1:
                leased[block] -= 1
            else:
                del leased[block]
                self._leased_bytes[session.tenant] -= block.namespace.block_bytes

    def expire_leases(self) -> int:
        now = time.monotonic()
        expired = [(s, lease) for s in self.by_id.values() for lease in s.leases.values() if lease.expires <= now]
        for session, lease in expired:
            self._drop_lease(session, lease)
        self.lease_expiries += len(expired)
        return len(expired)
