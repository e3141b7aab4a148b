"""The daemon: its verbs, and the parts they are made of, put together.

    Pool (pool.py)        the shared-memory file, carved into slots; bytes and offsets only
    BlockIndex (index.py) the only writer of block and namespace state; no locks (the loop owns it)
    Sessions              who is connected, their mapped memory and their leases (sessions.py)
    Jobs                  store/load pipelines: plan, copy, complete, publish (jobs.py; chunks.py), then
                          the seal, when idle (Seals, seals.py: Jobs owns it)
    Tiers                 disk and remote store under the pool: written behind, promoted from (tiers/)
    Threads               every thread the daemon hands work to (threads.py); jobs and tiers use them

The verbs (register, attach, end, lookup, submit, poll, stats, clear, ...) are what the gRPC front
end (servicer.py) calls; the process around it all, sockets and signals, is serve.py.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import secrets
import time
from array import array
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvstore_service import __version__
from kvstore_service.backends import Backend
from kvstore_service.config import Config
from kvstore_service.errors import KVError, invalid
from kvstore_service.event_journal import journal_of
from kvstore_service.events import Batch, BlockEvents
from kvstore_service.index import BlockIndex, namespace_hash
from kvstore_service.jobs import JobResult, Jobs
from kvstore_service.keys import PackedKeys, unpack_keys
from kvstore_service.metrics import Metrics
from kvstore_service.native_device import StickyDeviceError
from kvstore_service.peercred import PeerCred
from kvstore_service.pool import Pool
from kvstore_service.sessions import EngineSession, Registration, Session, Sessions, open_backend
from kvstore_service.stats import DiskStats, NamespaceStats, RemoteStats, Stats
from kvstore_service.tenants import Caller, scoped, split
from kvstore_service.threads import Threads
from kvstore_service.tiers import Tiers
from kvstore_service.tiers.base import Scope
from kvstore_service.tiers.disk import DiskTier
from kvstore_service.tiers.remote import RemoteTier

log = logging.getLogger(__name__)
REMOTE_DRAIN_S = 2.0  # a stopping daemon waits this long for queued uploads
MAX_POLL_WAIT_MS = 60_000
EVENT_BATCH = 512  # block events per WatchBlocks message
GROW_STEP_BYTES = 256 << 20  # a new pool grows by about this much at a time while the daemon serves


@dataclass(frozen=True)
class Registered:
    """What a registration tells the client."""

    session_id: bytes
    block_bytes: int  # 0: a lookup session
    max_inflight_jobs: int
    boot_id: bytes
    progress_load_bytes: int  # loads up to this size report each region's arrival; 0: a lookup session


class Daemon:
    """Everything the gRPC handlers serve, owned by the event loop: its verbs."""

    def __init__(self, config: Config, fatal: Callable[[StickyDeviceError], None], threads: Threads,
                 backends: Mapping[str, Backend] | None = None) -> None:
        """Blocking (`open` runs it off the loop): the pool set up or re-attached, --devices opened
        (`backends`: device backends made already, beside them: the in-process tests' fake one)."""
        self.config = config
        self.boot_id = secrets.token_bytes(16)
        self.started = time.monotonic()
        self.threads = threads
        self.pool = Pool(config.pool_path, int(config.pool_size), int(config.segment_size), fresh=config.fresh,
                         populate_threads=config.populate_threads or len(os.sched_getaffinity(0)),
                         numa_nodes=config.numa_nodes(), populate_first=int(config.populate_first))
        self._growing: asyncio.Task[None] | None = None
        self.index = BlockIndex(self.pool)
        self.events = self.index.events = BlockEvents(int(config.max_event_bytes),
                                                      int(config.max_event_description_bytes), config.max_event_queue,
                                                      self.index.is_committed, journal_of(config))
        self._watching: Counter[bytes | str] = Counter()  # WatchBlocks streams by session id and by owner
        self.recovered = self.index.recover() if self.pool.reattached else 0
        self.metrics = Metrics()
        self.jobs = Jobs(config, self.pool, self.index, self.metrics, fatal, threads)
        backends = dict(backends or {})
        for name in config.devices:  # (this runs off the loop, before the daemon serves)
            try:
                backends[name] = open_backend(name, self.pool)
            except KVError as e:
                raise ValueError(f"--devices {name}: {e.message}") from None
        self.sessions = Sessions(config, self.pool, self.index, self.jobs.device_call, backends,
                                 settle=self.jobs.settle)
        self.tiers: Tiers | None = None  # made on the event loop: `open_tiers`
        if self.recovered:
            log.info("re-attached pool %s: %d blocks recovered", config.pool_path, self.recovered)

    @classmethod
    async def open(cls, config: Config, fatal: Callable[[StickyDeviceError], None]) -> Daemon:
        """The daemon, made off the event loop (setting up a large pool and pinning it take seconds)."""
        threads = Threads(config.copy_threads)
        try:
            return await threads.device_call(cls, config, fatal, threads)
        except BaseException:
            threads.close()
            raise

    # -- sessions --------------------------------------------------------------------------------

    async def register(self, registration: Registration, peer: PeerCred | None, fds: list[int]) -> Registered:
        """A new session (`fds` from the handshake: closed here, whatever happens)."""
        session = await self.sessions.register(registration, peer, fds)
        return Registered(session.session_id, registration.layout.slot_bytes if registration.layout else 0,
                          self.config.max_inflight_jobs, self.boot_id,
                          session.backend.whole_load_bytes if isinstance(session, EngineSession) else 0)

    def session(self, session_id: bytes) -> Session:
        """A live session (NOT_FOUND if unknown or ended)."""
        return self.sessions.get(session_id)

    def attach(self, session: Session) -> Session:
        """The session's stream is open: it lives until `end` (ALREADY_EXISTS for a second one)."""
        return self.sessions.attach(session)

    async def end(self, session: Session) -> None:
        """Its leases dropped, then (engine) its memory unmapped once its copies finished."""
        await self.sessions.end(session)

    # -- lookups and leases ----------------------------------------------------------------------

    async def lookup(self, session: Session | None, caller: Caller | None, namespace: str, keys: bytes,
                     key_size: int, lease: bool = False, ttl_ms: int = 0,
                     spans: Sequence[int] = ()) -> tuple[int, bytes]:
        """How many of the leading keys (packed) are in the pool, with `lease` pinned for the session:
        in the session's namespace, or without one in the caller's tenant's `namespace`; with group `spans`,
        how many blocks every group serves. The blocks the best hit needs that the pool lacks are brought in
        from the tiers below first (Tiers.promote). Returns (hits, lease id)."""
        if session is not None:
            name = scoped(session.tenant, namespace) if namespace else ""
        elif caller is not None:
            name = scoped(caller.member("look up blocks"), namespace)
        else:
            raise invalid("lookup needs a session or a namespace")
        if self.tiers is not None:
            ns = self.index.find_namespace(session.namespace_name if session is not None else name)
            if ns is not None:
                # Shielded: a promotion cut short would leave its reserved slots WRITING for good.
                await asyncio.shield(self.tiers.promote(ns, list(unpack_keys(keys, key_size)), spans))
        return self.sessions.lookup(session, name, keys, key_size, lease, ttl_ms, spans)

    def release_lease(self, session: Session, lease_id: bytes) -> None:
        self.sessions.release_lease(session, lease_id)

    # -- jobs ------------------------------------------------------------------------------------

    def submit(self, session: Session, job_id: int, keys: bytes, key_size: int, block_ids: array[int],
               is_store: bool, partial_tail: bool = False, order_seq: int = 0, expires_ns: int = 0) -> int:
        """Start a store or load job of an engine session (keys packed); its completion is posted to the
        session's channel. `order_seq`: the engine's ordering record the job follows (0: every record
        pending at its arrival; see Backend.order_pending); `expires_ns`: when the client gives it up
        (Job.expires_ns). Returns the job's id."""
        engine = self.sessions.engine(session)
        job = self.jobs.submit(engine, job_id, PackedKeys(keys, key_size), block_ids, is_store,
                               is_store and partial_tail, order_seq, expires_ns)
        return job.job_id

    async def poll(self, session: Session, wait_ms: int) -> list[JobResult]:
        """The session's jobs finished since its last poll, waiting up to `wait_ms` for one."""
        if not isinstance(session, EngineSession):
            return []  # a lookup session runs no jobs
        return await self.jobs.poll(session, min(wait_ms, MAX_POLL_WAIT_MS))

    # -- routers' events ------------------------------------------------------------------------

    def describe_blocks(self, session: Session, keys: bytes, key_size: int, descriptions: Sequence[bytes]) -> None:
        """What routers' events need of blocks the session's engine stores (events.py)."""
        if len(descriptions) * key_size != len(keys):
            raise invalid(f"{len(keys) // key_size} keys and {len(descriptions)} descriptions")
        self.events.describe(namespace_hash(session.namespace_name), unpack_keys(keys, key_size), descriptions)

    async def watch_blocks(self, session: Session) -> AsyncIterator[Batch]:
        """The session's namespace's block events until the session ends (events.py): at most
        --max-watches-per-session streams of a session, --max-watches-per-uid of its owner."""
        watching, config = self._watching, self.config
        if watching[session.session_id] >= config.max_watches_per_session:
            raise KVError("RESOURCE_EXHAUSTED", f"this session watches {watching[session.session_id]} streams "
                          f"(--max-watches-per-session {config.max_watches_per_session})")
        if watching[session.owner] >= config.max_watches_per_uid:
            raise KVError("RESOURCE_EXHAUSTED", f"{session.owner} watches {watching[session.owner]} streams "
                          f"(--max-watches-per-uid {config.max_watches_per_uid})")
        watching[session.session_id] += 1
        watching[session.owner] += 1
        try:
            async for batch in self.events.watch(namespace_hash(session.namespace_name), EVENT_BATCH,
                                                 lambda: session.closed):
                yield batch
        finally:
            for who in (session.session_id, session.owner):
                watching[who] -= 1
                if not watching[who]:
                    del watching[who]

    # -- the daemon ------------------------------------------------------------------------------

    def stats(self, caller: Caller | None = None) -> Stats:
        """The daemon-wide figures, and the namespaces `caller` may see (None: all of them). A
        namespace recovered from the pool whose name no engine has given yet is shown to admins only."""
        engines = [s for s in self.sessions.by_id.values() if isinstance(s, EngineSession)]
        namespaces = []
        for ns in self.index.namespaces.values():
            tenant, name = split(ns.name) if ns.name else ("", f"(recovered {ns.ns_hash.hex()[:12]})")
            c = ns.counters
            namespaces.append(NamespaceStats(
                namespace=name, blocks=ns.blocks, used_bytes=ns.blocks * ns.block_bytes, block_bytes=ns.block_bytes,
                hits=c.hits, misses=c.misses, stored_blocks=c.stored_blocks, loaded_blocks=c.loaded_blocks,
                evictions=c.evictions, engines=sum(1 for s in engines if s.namespace is ns), tenant=tenant,
                loaded_bytes=c.loaded_bytes))
        visible = [n for n, ns in zip(namespaces, self.index.namespaces.values(), strict=True)
                   if caller is None or caller.admin or (ns.name and n.tenant == caller.tenant)]
        tiers = self.tiers.stats() if self.tiers is not None else (DiskStats(), RemoteStats())
        return Stats(
            capacity_bytes=self.pool.capacity, ready_bytes=self.pool.ready_bytes,
            used_bytes=sum(n.used_bytes for n in namespaces),
            blocks=self.index.count, hits=sum(n.hits for n in namespaces), misses=sum(n.misses for n in namespaces),
            stored_blocks=sum(n.stored_blocks for n in namespaces),
            loaded_blocks=sum(n.loaded_blocks for n in namespaces), evictions=self.index.evictions,
            engines=len(engines), leases=sum(len(s.leases) for s in self.sessions.by_id.values()),
            jobs_in_flight=self.jobs.in_flight, failed_blocks=self.jobs.failed_blocks,
            store_failures_pool_full=self.jobs.store_failures_pool_full,
            lease_expiries=self.sessions.lease_expiries, corrupt_blocks=self.jobs.corrupt_blocks,
            uptime_s=int(time.monotonic() - self.started), namespaces=visible, daemon_version=__version__,
            unsealed_blocks=self.jobs.unsealed_blocks, failed_load_blocks=self.jobs.failed_load_blocks,
            unverified_blocks=self.index.unverified_blocks,
            disk=tiers[0], remote=tiers[1],
            loaded_bytes=sum(n.loaded_bytes for n in namespaces),
            loaded_tokens=sum(n.loaded_tokens for n in namespaces),
            events=replace(self.events.stats),
        )

    async def clear(self, caller: Caller, tenant: str, namespace: str) -> int:
        """Drop the blocks of a tenant's namespace, of all its namespaces (`namespace` empty), or (an
        admin naming no tenant nor namespace) of every namespace: the pool's unpinned ones, and the disk
        tier's for good (a restart does not bring them back; answered once that is written down).
        Others than admins clear their own tenant's only. Returns how many blocks were dropped, a block
        in both tiers once."""
        return await self._clear(_clear_scope(caller, tenant, namespace), namespace)

    async def _clear(self, tenant: str | None, namespace: str) -> int:
        scopes: list[bytes] | None = None  # every namespace's
        if namespace:
            assert tenant is not None
            scopes = [namespace_hash(scoped(tenant, namespace))]  # (on disk, maybe unknown to the pool)
        elif tenant is not None:
            names = {h: ns.name for h, ns in self.index.namespaces.items() if ns.name}
            names.update(self.tiers.names() if self.tiers is not None else {})  # (after a restart, maybe only on disk)
            scopes = [h for h, name in names.items() if split(name)[0] == tenant]
        cleared, saved = self.tiers.forget(scopes) if self.tiers is not None else (0, None)
        if scopes is None:
            cleared += self.index.clear()
        else:
            cleared += sum(self.index.clear(ns) for h in scopes if (ns := self.index.namespaces.get(h)) is not None)
        if saved is not None:
            await asyncio.shield(saved)  # (a Clear cut short still gets written down)
        return cleared

    async def open_tiers(self) -> None:
        """On the event loop: the tiers under the pool (--disk-path, opened on the disk threads;
        --remote), fed by the seals, asked by lookups. A refused one is a ValueError naming its flag."""
        config = self.config
        disk = None
        if config.disk_path:
            try:
                disk = await Threads.run(self.threads.disk, open_disk, config, self.threads)
            except ValueError as e:
                raise ValueError(f"--disk-path: {e}") from None
        try:
            self._open_tiers(disk)
        except ValueError as e:
            raise ValueError(f"--remote: {e}") from None
        if disk is not None:
            self.events.disk_holds = lambda ns_hash, keys: disk.holds(Scope(ns_hash, "", 0), keys)
        if restored := self.events.restore():  # (after the disk's: its blocks are announced at once)
            log.info("%d block descriptions read back for routers' events", restored)

    def _open_tiers(self, disk: DiskTier | None) -> None:
        config = self.config
        remote = None
        if config.remote:
            remote = RemoteTier.from_url(config.remote, executor=self.threads.remote,
                                         password_file=config.remote_password_file or None,
                                         tls_ca_file=config.remote_tls_ca or None, timeout_s=config.remote_timeout_s,
                                         secret_file=config.remote_secret_file or None, encrypt=config.remote_encrypt,
                                         queue_bytes=int(config.remote_queue_bytes),
                                         breaker_s=config.remote_breaker_s)
            log.info("remote tier %s", remote.url)
        if disk is None and remote is None:
            return
        self.tiers = Tiers(self.pool, self.index, self.jobs.queue_seal,
                           int(config.remote_fetch_bytes), disk=disk, remote=remote)
        self.jobs.on_sealed = self.tiers.sealed

    def start_verifying(self) -> None:
        """Once serving: the blocks recovered from the pool after a restart are verified, and a new pool's
        segments not faulted in yet are, in the background."""
        self.jobs.verify_recovered()
        if self.pool.unready:
            self._growing = asyncio.get_running_loop().create_task(self._grow())

    async def _grow(self) -> None:
        """The pool's capacity grows a step at a time as its pages are faulted in (on the populate thread)."""
        started, step = time.monotonic(), max(1, GROW_STEP_BYTES // self.pool.segment_size)
        while self.pool.unready:
            try:
                self.pool.add_ready(await Threads.run(self.threads.populate, self.pool.populate_next, step))
            except OSError as e:
                log.error("%s: the pool stays at %d of its %d bytes", e.strerror, self.pool.ready_bytes,
                          self.pool.capacity)
                return
        log.info("pool %s: all %d bytes ready (%.1f s while serving)", self.config.pool_path, self.pool.capacity,
                 time.monotonic() - started)

    def count_error(self, code: str) -> None:
        """A request failed with this status code (for the metrics)."""
        self.metrics.errors.labels(code).inc()

    async def housekeeping(self) -> None:
        """Once a second: expired leases, stale block descriptions and never-attached sessions dropped,
        empty namespaces forgotten."""
        self.sessions.expire_leases()
        if self.tiers is not None:
            self.events.disk_changed(self.tiers.take_changes())
        if not self.index.unverified_blocks:  # (descriptions read back wait for their blocks' verification)
            self.events.expire()
            await self.events.rewrite_journal(functools.partial(self.threads.run, self.threads.journal))
        await self.sessions.reap_unattached()
        self.index.forget_empty({s.namespace for s in self.sessions.by_id.values() if s.namespace})
        # The index holds an object per block (millions in a large pool). A full collection
        # would walk them all (tens of ms per 10k blocks, stalling every RPC), though they form
        # no garbage cycles: collect what is young, then move the survivors out of the
        # collector's sight. Garbage among them is still freed by reference counting.
        gc.collect()
        gc.freeze()

    async def drain(self) -> bool:
        """Stopping: the jobs drained (Jobs.drain), then every session ended, which tells its engine.
        False (nothing told) if copies still run after --drain-timeout-s."""
        if not await self.jobs.drain(self.config.drain_timeout_s):
            return False
        await self.sessions.end_all()
        return True

    async def shutdown(self) -> None:
        """Drop mappings (engines register again with the next daemon), seal what is queued, close."""
        if self._growing is not None:
            self._growing.cancel()  # (the step under way ends on its thread; the threads' close waits for it)
        await self.sessions.end_all()
        await self.jobs.shutdown()
        if self.tiers is not None:
            await self.tiers.close(drain_s=REMOTE_DRAIN_S)
        self.threads.close()
        self.pool.close()
        if self.events.journal is not None:
            self.events.journal.close()


def open_disk(config: Config, threads: Threads) -> DiskTier:
    """Blocking: the disk tier's directory checked, its segments' index loaded or scanned; its I/O then
    runs on the daemon's disk threads."""
    disk = DiskTier.open(config.disk_path, int(config.disk_size), executor=threads.disk,
                         segment_bytes=int(config.disk_segment_size), queue_bytes=int(config.disk_queue_bytes))
    s = disk.stats()
    log.info("disk tier %s: %d blocks in %d segments (%s)", config.disk_path, s.blocks, s.segments,
             "healthy" if s.healthy else f"disabled: {s.error}")
    return disk


def _clear_scope(caller: Caller, tenant: str, namespace: str) -> str | None:
    """Whose blocks a Clear reaches: the tenant named (admins only; None: every tenant's), else the
    caller's own tenant."""
    if not caller.admin:
        if tenant and tenant != caller.tenant:
            raise KVError("PERMISSION_DENIED", f"only admins (--admin-uids) may clear tenant {tenant!r}'s blocks")
        return caller.member("clear blocks")
    if not tenant and namespace:
        if caller.tenant is None:
            raise invalid("name the tenant whose namespace to clear")
        return caller.tenant
    return tenant or None
