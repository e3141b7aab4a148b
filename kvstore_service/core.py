"""The daemon core: sessions, leases and copy jobs around the pool and its index.

Plain asyncio Python, no gRPC: every public method validates its input and raises `KVError` with a
gRPC-style status name. All state is owned by the event loop thread; only the byte copies (and
checksums) run in worker threads, on runs that were bounds-checked here first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import threading
import time
from array import array
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore_client.protocol.completion import CompletionChannel
from kvstore_service import native
from kvstore_service.backends import Backend, Mapping, TransferPlan, make_backend
from kvstore_service.config import Config
from kvstore_service.index import Block, BlockIndex, Namespace
from kvstore_service.metrics import Metrics
from kvstore_service.peercred import PeerCred, close_fds
from kvstore_service.pool import COMMITTED, SEALED, STORED, Pool

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
MIN_KEY, MAX_KEY = 16, 64
MAX_COMPLETION_SLOTS = 1 << 16
MAX_JOB_ID = (1 << 64) - 1  # the completion word holds job_id + 1
FINISHED_KEPT = 4096  # per session, for the Poll RPC; the shared-memory channel is the main path
# A job is copied in chunks (see KVStore._transfer) of at most this many bytes and blocks. Every chunk
# costs a hand-off to a copy thread and back (~0.5 ms on a busy 2-vCPU VM); the block cap bounds the
# time the event loop spends reserving one chunk (~1-2 ms).
CHUNK_BYTES = 128 << 20
CHUNK_BLOCKS = 1024


def _lower_priority() -> None:
    """Copy threads run at nice 10: when the event loop has work (planning the next chunk, serving
    an RPC) it gets a core at once, while the copies, bound by memory bandwidth, lose little."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:  # not allowed here: run at normal priority
        pass


class KVError(Exception):
    """A request the daemon refuses; `code` is a grpc.StatusCode name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _invalid(message: str) -> KVError:
    return KVError("INVALID_ARGUMENT", message)


@dataclass(frozen=True)
class Region:
    offset: int
    block_stride: int
    block_bytes: int


@dataclass(frozen=True)
class Layout:
    num_blocks: int
    regions: tuple[Region, ...]

    @property
    def block_bytes(self) -> int:
        return sum(r.block_bytes for r in self.regions)

    def check(self, memory_size: int) -> None:
        if self.num_blocks <= 0:
            raise _invalid("layout: num_blocks must be positive")
        if not self.regions:
            raise _invalid("layout: at least one region is needed")
        for i, r in enumerate(self.regions):
            if r.block_bytes <= 0:
                raise _invalid(f"layout: region {i} has block_bytes 0")
            if r.block_stride < r.block_bytes and self.num_blocks > 1:
                raise _invalid(f"layout: region {i} blocks overlap (stride {r.block_stride} < {r.block_bytes})")
            end = r.offset + (self.num_blocks - 1) * r.block_stride + r.block_bytes
            if end > memory_size:
                raise _invalid(f"layout: region {i} ends at byte {end}, beyond the {memory_size}-byte memory")


@dataclass(eq=False)
class Lease:
    lease_id: bytes
    session: Session
    blocks: list[Block]
    expires: float


@dataclass(eq=False)
class Job:
    job_id: int
    is_store: bool
    session: Session
    keys: list[bytes]
    block_ids: list[int]
    blocks: list[Block | None]  # per key: the block copied, or None (failed or deduplicated)
    ok: list[bool]
    # store: keys another job is writing; this job is done when those are (dedupe without lying)
    waits: list[tuple[int, asyncio.Future]] = field(default_factory=list)
    error: str = ""
    submitted: float = field(default_factory=time.monotonic)
    copy_seconds: float = 0.0
    copied_bytes: int = 0


@dataclass(eq=False)
class Chunk:
    """Part of a job, planned on the event loop: its copy thread only makes native calls."""

    indexes: list[int]  # into the job's keys
    plan: TransferPlan
    headers: array = field(default_factory=lambda: array("Q"))  # store: slot header offsets
    keys: bytes = b""  # store: the blocks' keys, packed
    generation: int = 0
    checked: list[int] = field(default_factory=list)  # load: indexes verified before the copy
    checked_offsets: array = field(default_factory=lambda: array("Q"))


@dataclass(eq=False)
class Session:
    session_id: bytes
    engine_id: str
    namespace_name: str
    layout: Layout | None
    backend: Backend | None
    mapping: Mapping | None
    channel: CompletionChannel | None
    attached: bool = False
    closed: bool = False
    created: float = field(default_factory=time.monotonic)
    jobs: dict[int, Job] = field(default_factory=dict)  # completion slot -> unfinished job
    tasks: set[asyncio.Task] = field(default_factory=set)
    leases: dict[bytes, Lease] = field(default_factory=dict)
    finished: deque = field(default_factory=lambda: deque(maxlen=FINISHED_KEPT))
    finished_event: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set when the session is over
    namespace: Namespace | None = None
    peer: PeerCred | None = None  # pid/uid from SO_PEERCRED when the client did the handshake


@dataclass
class Counters:
    failed_blocks: int = 0
    store_failures_pool_full: int = 0
    lease_expiries: int = 0
    corrupt_blocks: int = 0


class KVStore:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.boot_id = secrets.token_bytes(16)
        self.started = time.monotonic()
        self.pool = Pool(config.pool_path, int(config.pool_size), int(config.segment_size), fresh=config.fresh)
        self.index = BlockIndex(self.pool)
        self.recovered = self.index.recover() if self.pool.reattached else 0
        self.sessions: dict[bytes, Session] = {}
        self.counters = Counters()
        self.metrics = Metrics()
        self.executor = ThreadPoolExecutor(max_workers=config.copy_threads, thread_name_prefix="kvstore-copy",
                                           initializer=_lower_priority)
        self._backends: dict[str, Backend] = {}
        self._store_waiters: dict[Block, list[asyncio.Future]] = {}
        if self.recovered:
            log.info("re-attached pool %s: %d blocks recovered", config.pool_path, self.recovered)

    # -- sessions --------------------------------------------------------------------------------

    def backend(self, name: str) -> Backend:
        backend = self._backends.get(name)
        if backend is None:
            try:
                backend = make_backend(name)
            except ValueError as e:
                raise _invalid(str(e)) from None
            except (ImportError, RuntimeError) as e:
                raise KVError("FAILED_PRECONDITION", f"backend {name!r} is not usable here: {e}") from None
            backend.register_pool(self.pool.base, self.pool.size)
            self._backends[name] = backend
        return backend

    def register(
        self,
        *,
        protocol_version: int,
        engine_id: str,
        namespace: str,
        layout: Layout | None,
        backend: str,
        handle: bytes,
        memory_size: int,
        device: int,
        completion_slots: int,
        peer: PeerCred | None = None,
        fds: list[int] | None = None,
    ) -> Session:
        """`fds` come from the handshake: the completion channel, then (cpu) the KV memory. They are
        closed here, whatever happens; the mappings keep what they need."""
        fds = list(fds or [])
        try:
            return self._register(protocol_version, engine_id, namespace, layout, backend, handle, memory_size,
                                  device, completion_slots, peer, fds)
        finally:
            close_fds(fds)

    def _register(self, protocol_version: int, engine_id: str, namespace: str, layout: Layout | None, backend: str,
                  handle: bytes, memory_size: int, device: int, completion_slots: int, peer: PeerCred | None,
                  fds: list[int]) -> Session:
        if protocol_version != PROTOCOL_VERSION:
            raise KVError("FAILED_PRECONDITION",
                          f"client speaks protocol {protocol_version}, this daemon speaks {PROTOCOL_VERSION}; "
                          "upgrade the client or the daemon so both match")
        if not namespace:
            raise _invalid("namespace is empty")
        if len(self.sessions) >= self.config.max_sessions:
            raise KVError("RESOURCE_EXHAUSTED", f"the daemon already has {len(self.sessions)} sessions (max)")
        session = Session(secrets.token_bytes(16), engine_id, namespace, layout, None, None, None, peer=peer)
        try:
            if layout is not None:
                layout.check(memory_size)
                if not 0 < completion_slots <= MAX_COMPLETION_SLOTS:
                    raise _invalid(f"completion_slots must be 1..{MAX_COMPLETION_SLOTS}")
                session.backend = self.backend(backend)
                wanted = 2 if backend == "cpu" else 1
                if len(fds) != wanted:
                    raise _invalid(f"registering {backend} KV memory needs {wanted} shared-memory descriptor(s) "
                                   f"from the <socket>.cred handshake, got {len(fds)}")
                existing = self.index.find_namespace(namespace)
                if existing is not None and existing.block_bytes != layout.block_bytes:
                    raise KVError("FAILED_PRECONDITION",
                                  f"layout mismatch: namespace {namespace!r} holds {existing.block_bytes}-byte "
                                  f"blocks, this layout has {layout.block_bytes}-byte blocks")
                if self.pool.slots_per_segment(layout.block_bytes) < 1:
                    raise KVError("FAILED_PRECONDITION",
                                  f"a {layout.block_bytes}-byte block is larger than a pool segment "
                                  f"({self.pool.segment_size} bytes); raise --segment-size")
                try:
                    session.channel = CompletionChannel.attach(os.dup(fds[0]), completion_slots)
                except (ValueError, OSError) as e:
                    raise _invalid(f"cannot map the completion channel: {e}") from None
                try:
                    session.mapping = session.backend.map(handle, memory_size, device, fds[1] if wanted == 2 else None)
                except (ValueError, OSError) as e:
                    raise _invalid(str(e)) from None
                # Only a registration that got this far creates the namespace.
                session.namespace = self.index.namespace(namespace, layout.block_bytes)
            else:
                session.namespace = self.index.find_namespace(namespace)
        except BaseException:
            self._release_resources(session)
            raise
        self.sessions[session.session_id] = session
        log.info("session %s registered: engine %r (pid %s, uid %s) namespace %r", session.session_id.hex()[:8],
                 engine_id, peer.pid if peer else "?", peer.uid if peer else "?", namespace)
        return session

    def session(self, session_id: bytes) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise KVError("NOT_FOUND", f"unknown or ended session {session_id.hex() or '(empty)'}; register again")
        return session

    def attach(self, session_id: bytes) -> Session:
        session = self.session(session_id)
        if session.attached:
            raise KVError("ALREADY_EXISTS", "the session already has an Attach stream")
        session.attached = True
        return session

    async def end_session(self, session: Session) -> None:
        """Drop a session: its leases, queued jobs and mapping. Blocks it stored stay in the pool."""
        if session.closed:
            return
        session.closed = True
        session.ended.set()
        for lease in list(session.leases.values()):
            self._drop_lease(lease)
        if session.tasks:  # copies in flight still use the mapping: let them finish first
            await asyncio.gather(*session.tasks, return_exceptions=True)
        self._release_resources(session)
        self.sessions.pop(session.session_id, None)
        log.info("session %s ended", session.session_id.hex()[:8])

    def _release_resources(self, session: Session) -> None:
        if session.mapping is not None and session.backend is not None:
            session.backend.unmap(session.mapping)
            session.mapping = None
        if session.channel is not None:
            session.channel.close()
            session.channel = None

    async def reap_unattached(self) -> None:
        """A client that registered but never attached its stream (it died in between)."""
        now = time.monotonic()
        for session in list(self.sessions.values()):
            if not session.attached and now - session.created > self.config.attach_timeout_s:
                log.warning("session %s never attached; dropping it", session.session_id.hex()[:8])
                await self.end_session(session)

    # -- lookups and leases ----------------------------------------------------------------------

    def lookup(self, session_id: bytes, namespace: str, keys: bytes, key_size: int, lease: bool,
               ttl_ms: int) -> tuple[int, bytes]:
        """How many of the leading keys (packed, `key_size` bytes each) are in the pool; with `lease`,
        those blocks are pinned until the lease is released or expires."""
        if session_id:
            session = self.session(session_id)
            if namespace and namespace != session.namespace_name:
                raise KVError("PERMISSION_DENIED", "a session can only look up its own namespace")
            if session.namespace is None:
                session.namespace = self.index.find_namespace(session.namespace_name)
            ns = session.namespace
        else:
            if lease:
                raise _invalid("a lease needs a session")
            if not namespace:
                raise _invalid("lookup needs a session or a namespace")
            session, ns = None, self.index.find_namespace(namespace)
        found = self.index.prefix(ns, keys, key_size) if ns is not None else []
        if ns is not None:
            ns.stats.hits += len(found)
            ns.stats.misses += len(keys) // key_size - len(found)
        lease_id = b""
        if lease and found and session is not None:
            ttl = ttl_ms / 1000 if ttl_ms else self.config.lease_ttl_s
            lease_id = secrets.token_bytes(16)
            for block in found:
                self.index.pin(block)
                self.index.touch(block)
            session.leases[lease_id] = Lease(lease_id, session, found, time.monotonic() + ttl)
        return len(found), lease_id

    def release_lease(self, session_id: bytes, lease_id: bytes) -> None:
        session = self.session(session_id)
        lease = session.leases.get(lease_id)
        if lease is None:
            raise KVError("NOT_FOUND", f"unknown or expired lease {lease_id.hex() or '(empty)'}")
        self._drop_lease(lease)

    def _drop_lease(self, lease: Lease) -> None:
        del lease.session.leases[lease.lease_id]
        for block in lease.blocks:
            self.index.unpin(block)

    def expire_leases(self) -> int:
        now = time.monotonic()
        expired = [lease for s in self.sessions.values() for lease in s.leases.values() if lease.expires <= now]
        for lease in expired:
            self._drop_lease(lease)
        self.counters.lease_expiries += len(expired)
        return len(expired)

    # -- jobs ------------------------------------------------------------------------------------

    def submit(self, session_id: bytes, job_id: int, keys: Sequence[bytes], block_ids: Sequence[int],
               is_store: bool) -> Job:
        session = self.session(session_id)
        if session.layout is None or session.mapping is None or session.namespace is None:
            raise KVError("FAILED_PRECONDITION", "this session registered no KV memory (lookup-only)")
        keys, block_ids = list(keys), list(block_ids)  # (block_ids may be a protobuf container: slow to index)
        if len(keys) != len(block_ids):
            raise _invalid(f"{len(keys)} keys but {len(block_ids)} block ids")
        if not keys:
            raise _invalid("a job needs at least one block")
        num_blocks = session.layout.num_blocks
        if min(block_ids) < 0 or max(block_ids) >= num_blocks:
            bad = next(b for b in block_ids if not 0 <= b < num_blocks)
            raise _invalid(f"block id {bad} is outside the registered cache (0..{num_blocks - 1})")
        if len(set(keys)) != len(keys):
            raise _invalid("duplicate keys in one request")
        # (A store may read one engine block under two keys; a load must not write one twice.)
        if not is_store and len(set(block_ids)) != len(block_ids):
            raise _invalid("duplicate block ids in one load: two blocks would land in the same place")
        if job_id >= MAX_JOB_ID:
            raise _invalid(f"job id {job_id} is too large (max {MAX_JOB_ID - 1})")
        assert session.channel is not None
        slot = job_id % session.channel.slots
        if slot in session.jobs:
            raise KVError("RESOURCE_EXHAUSTED",
                          f"job {job_id}: completion slot busy ({len(session.jobs)} jobs in flight, "
                          f"{session.channel.slots} slots); wait for completions")
        if len(session.jobs) >= self.config.max_inflight_jobs:
            raise KVError("RESOURCE_EXHAUSTED", f"{len(session.jobs)} jobs in flight (max)")

        job = Job(job_id, is_store, session, keys, block_ids, [None] * len(keys), [False] * len(keys))
        session.jobs[slot] = job
        task = asyncio.get_running_loop().create_task(self._run(job))
        session.tasks.add(task)
        task.add_done_callback(session.tasks.discard)
        return job

    def _chunks(self, job: Job) -> list[range]:
        """A job's blocks in chunks of at most CHUNK_BYTES and CHUNK_BLOCKS, at least one per copy thread."""
        n = len(job.keys)
        block_bytes = job.session.layout.block_bytes  # type: ignore[union-attr]
        per_chunk = max(1, min(CHUNK_BYTES // block_bytes, CHUNK_BLOCKS, -(-n // self.config.copy_threads)))
        return [range(start, min(n, start + per_chunk)) for start in range(0, n, per_chunk)]

    async def _run(self, job: Job) -> None:
        try:
            await self._transfer(job)
        except Exception as e:  # a bug: still tell the engine, never leave the job pending forever
            log.exception("job %d failed", job.job_id)
            if job.session.channel is not None and job.session.jobs.get(job.job_id % job.session.channel.slots) is job:
                job.error = f"internal error: {e}"
                job.ok = [False] * len(job.ok)
                self._publish(job)

    async def _transfer(self, job: Job) -> None:
        """Plan and copy chunk by chunk: the copy threads move one chunk while this loop prepares
        the next one and finishes the previous one, so the per-block bookkeeping hides behind the
        copies instead of adding to them."""
        loop = asyncio.get_running_loop()
        copies = []
        for part in self._chunks(job):
            indexes = self._reserve(job, part) if job.is_store else self._pin(job, part)
            if indexes:
                chunk = self._plan(job, indexes)
                copies.append((chunk, loop.run_in_executor(self.executor, self._copy, job, chunk)))
            await asyncio.sleep(0)  # serve other requests between chunks of a large job
        stored: list[Block] = []
        for chunk, copying in copies:
            started = time.monotonic()
            try:
                corrupt = await copying
            except Exception as e:  # every block of the chunk failed; never report it as success
                log.exception("job %d copy failed", job.job_id)
                job.error = f"copy failed: {e}"
                corrupt = None
            job.copy_seconds += time.monotonic() - started
            if corrupt is not None:
                job.copied_bytes += sum(chunk.plan.sizes)
            if job.is_store:
                stored += self._commit(job, chunk.indexes, ok=corrupt is not None)
            else:
                self._unpin(job, chunk.indexes, corrupt)
        if job.is_store:
            for i, waiter in job.waits:
                job.ok[i] = await waiter
        self._publish(job)
        if stored:
            await self._seal(stored)

    def _reserve(self, job: Job, chunk: range) -> list[int]:
        """Store: a WRITING slot for each new key of the chunk; the indexes to copy."""
        ns = job.session.namespace
        assert ns is not None
        new = []
        for i in chunk:
            key = job.keys[i]
            if key in ns.entries:  # dedupe: no copy
                job.ok[i] = True
            elif key in ns.writing:
                job.waits.append((i, self._when_stored(ns.writing[key])))
            else:
                new.append(i)
        blocks = self.index.begin_stores(ns, [job.keys[i] for i in new])
        if len(blocks) < len(new):
            self.counters.store_failures_pool_full += len(new) - len(blocks)
            job.error = "pool full: every block is pinned or being copied"
        for i, block in zip(new, blocks, strict=False):
            job.blocks[i] = block
        return new[:len(blocks)]

    def _pin(self, job: Job, chunk: range) -> list[int]:
        """Load: pin each present block of the chunk; the indexes to copy."""
        ns = job.session.namespace
        assert ns is not None
        indexes = []
        for i in chunk:
            block = self.index.get(ns, job.keys[i])
            if block is None:
                job.error = "block not in the pool"
                continue
            self.index.pin(block)
            self.index.touch(block)
            job.blocks[i] = block
            indexes.append(i)
        return indexes

    def _plan(self, job: Job, indexes: list[int]) -> Chunk:
        regions = job.session.layout.regions  # type: ignore[union-attr]
        blocks = [job.blocks[i] for i in indexes]
        pool_offsets, engine_offsets, sizes = array("Q"), array("Q"), array("Q")
        before = 0
        for r in regions:  # region by region: the native copy coalesces adjacent runs itself
            pool_offsets.extend([b.offset + before for b in blocks])  # type: ignore[union-attr]
            engine_offsets.extend([r.offset + job.block_ids[i] * r.block_stride for i in indexes])
            sizes.extend([r.block_bytes] * len(indexes))
            before += r.block_bytes
        chunk = Chunk(indexes, TransferPlan(pool_offsets, engine_offsets, sizes))
        if job.is_store:
            chunk.headers = array("Q", [b.header for b in blocks])  # type: ignore[union-attr]
            chunk.keys = b"".join([job.keys[i] for i in indexes])
            chunk.generation = self.pool.next_generation()
        elif self.config.verify_loads > 0:
            verify = self.config.verify_loads
            chunk.checked = [i for i in indexes if verify >= 1 or random.random() < verify]
            chunk.checked_offsets = array("Q", [job.blocks[i].offset for i in chunk.checked])  # type: ignore[union-attr]
        return chunk

    def _commit(self, job: Job, indexes: list[int], ok: bool) -> list[Block]:
        """Store: every byte of these blocks is in the pool and their STORED headers make them
        survive a daemon crash (if ok). They become visible and the engine may reuse its memory.
        Returns the blocks committed."""
        blocks: list[Block] = [job.blocks[i] for i in indexes]  # type: ignore[misc]
        if ok:
            committed = self.index.commit(blocks)
        else:
            committed = []
            for block in blocks:
                self.index.abort(block)
        for block in committed:
            self.index.pin(block)  # until its checksum is sealed (_seal)
        if committed:
            committed[0].namespace.stats.stored_blocks += len(committed)
        for i, block in zip(indexes, blocks, strict=True):
            job.ok[i] = block.state == COMMITTED
        if self._store_waiters:
            for i, block in zip(indexes, blocks, strict=True):
                for waiter in self._store_waiters.pop(block, ()):
                    waiter.set_result(job.ok[i])
        return committed

    def _unpin(self, job: Job, indexes: list[int], corrupt: set[int] | None) -> None:
        """Load: the chunk landed (corrupt is None: its copy failed)."""
        for i in indexes:
            block = job.blocks[i]
            assert block is not None
            if corrupt is not None and i in corrupt:
                self.counters.corrupt_blocks += 1
                self.index.discard(block)
            elif corrupt is not None:
                job.ok[i] = True
                block.namespace.stats.loaded_blocks += 1
            self.index.unpin(block)

    async def _seal(self, blocks: list[Block]) -> None:
        """Checksum committed blocks in the pool and seal the checksum into their slot headers: from
        then on a restarted daemon can verify them. The caller pinned the blocks (a slot must not be
        reused while its header is written); they are unpinned here."""
        ns = blocks[0].namespace
        offsets = array("Q", (b.offset for b in blocks))
        headers = array("Q", (b.header for b in blocks))
        keys = b"".join(b.key for b in blocks)
        generation = self.pool.next_generation()

        def checksum_and_seal() -> list[int]:
            sums = native.checksum_blocks(self.pool.base, offsets, ns.block_bytes, self.config.copy_threads)
            self.pool.write_headers(headers, SEALED, ns.block_bytes, generation, ns.ns_hash, keys, len(blocks[0].key),
                                    sums)
            return sums

        checksums: list[int] = []
        try:
            checksums = await asyncio.get_running_loop().run_in_executor(self.executor, checksum_and_seal)
        except Exception:
            log.exception("checksum failed; %d blocks will not survive a restart", len(blocks))
        for n, block in enumerate(blocks):
            if not self.index.present(block):
                self.pool.invalidate(block.ref)  # dropped meanwhile: its slot is still ours (pinned)
            elif checksums:
                block.checksum = checksums[n]
            self.index.unpin(block)

    def _when_stored(self, block: Block) -> asyncio.Future:
        """A future that tells whether a block being written got all its bytes."""
        future = asyncio.get_running_loop().create_future()
        self._store_waiters.setdefault(block, []).append(future)
        return future

    def _copy(self, job: Job, chunk: Chunk) -> set[int]:
        """Worker thread: move one chunk's bytes. A store then writes the blocks' slot headers; a
        load first verifies (a sample of) the pool's checksums and skips blocks that fail: it
        returns their indexes. Little Python here: the event loop holds the GIL while it plans."""
        session, plan = job.session, chunk.plan
        assert session.mapping is not None and session.backend is not None and session.namespace is not None
        ns = session.namespace
        corrupt: set[int] = set()
        if chunk.checked:
            sums = native.checksum_blocks(self.pool.base, chunk.checked_offsets, ns.block_bytes)
            # A block stored a moment ago may not have its checksum yet (None): nothing to check.
            corrupt = {i for i, value in zip(chunk.checked, sums, strict=True)
                       if job.blocks[i].checksum not in (None, value)}  # type: ignore[union-attr]
        if corrupt:
            regions = len(session.layout.regions)  # type: ignore[union-attr]
            n = len(chunk.indexes)
            keep = [k for k, i in enumerate(chunk.indexes) if i not in corrupt]
            plan = TransferPlan(*(array("Q", (a[r * n + k] for r in range(regions) for k in keep))
                                  for a in (plan.pool_offsets, plan.engine_offsets, plan.sizes)))
            job.error = f"{len(corrupt)} block(s) failed their checksum and were dropped"
        session.backend.copy(session.mapping, self.pool.base, plan, to_engine=not job.is_store)
        if job.is_store:
            self.pool.write_headers(chunk.headers, STORED, ns.block_bytes, chunk.generation, ns.ns_hash, chunk.keys,
                                    len(job.keys[0]))
        return corrupt

    def _publish(self, job: Job) -> None:
        """Event loop: the job is done for the engine; write its completion."""
        session = job.session
        failed = job.ok.count(False)
        self.counters.failed_blocks += failed
        assert session.channel is not None
        self.metrics.observe_job(job.is_store, time.monotonic() - job.submitted, job.copy_seconds,
                                 job.copied_bytes)
        session.jobs.pop(job.job_id % session.channel.slots, None)
        session.channel.post(job.job_id, len(job.ok) - failed, failed)
        session.finished.append(job)
        session.finished_event.set()

    async def poll(self, session_id: bytes, wait_ms: int) -> list[Job]:
        session = self.session(session_id)
        if not session.finished and wait_ms > 0:
            session.finished_event.clear()
            try:
                await asyncio.wait_for(session.finished_event.wait(), wait_ms / 1000)
            except TimeoutError:
                pass
        jobs = list(session.finished)
        session.finished.clear()
        return jobs

    # -- operator calls --------------------------------------------------------------------------

    def clear(self, namespace: str) -> int:
        if not namespace:
            return self.index.clear()
        ns = self.index.find_namespace(namespace)
        return self.index.clear(ns) if ns is not None else 0

    def stats(self) -> dict:
        used = sum(ns.blocks * ns.block_bytes for ns in self.index.namespaces.values())
        namespaces = []
        for ns in self.index.namespaces.values():
            engines = sum(1 for s in self.sessions.values() if s.namespace is ns and s.layout is not None)
            namespaces.append({
                "namespace": ns.name or f"(recovered {ns.ns_hash.hex()[:12]})",
                "blocks": ns.blocks, "used_bytes": ns.blocks * ns.block_bytes, "block_bytes": ns.block_bytes,
                "hits": ns.stats.hits, "misses": ns.stats.misses, "stored_blocks": ns.stats.stored_blocks,
                "loaded_blocks": ns.stats.loaded_blocks, "evictions": ns.stats.evictions, "engines": engines,
            })
        return {
            "capacity_bytes": self.pool.capacity,
            "used_bytes": used,
            "blocks": self.index.count,
            "hits": sum(n["hits"] for n in namespaces),
            "misses": sum(n["misses"] for n in namespaces),
            "stored_blocks": sum(n["stored_blocks"] for n in namespaces),
            "loaded_blocks": sum(n["loaded_blocks"] for n in namespaces),
            "evictions": self.index.evictions,
            "engines": sum(1 for s in self.sessions.values() if s.layout is not None),
            "leases": sum(len(s.leases) for s in self.sessions.values()),
            "jobs_in_flight": sum(len(s.jobs) for s in self.sessions.values()),
            "failed_blocks": self.counters.failed_blocks,
            "store_failures_pool_full": self.counters.store_failures_pool_full,
            "lease_expiries": self.counters.lease_expiries,
            "corrupt_blocks": self.counters.corrupt_blocks,
            "uptime_s": int(time.monotonic() - self.started),
            "namespaces": namespaces,
        }

    async def seal_recovered(self, batch: int = 1024) -> None:
        """Blocks recovered without a checksum (the daemon died before taking it): take it now, a
        batch of one namespace's blocks at a time."""
        for ns in list(self.index.namespaces.values()):
            unchecked = [b for b in ns.entries.values() if b.checksum is None]
            for start in range(0, len(unchecked), batch):
                blocks = [b for b in unchecked[start:start + batch] if self.index.present(b)]
                for block in blocks:
                    self.index.pin(block)
                if blocks:
                    await self._seal(blocks)

    async def shutdown(self) -> None:
        """Daemon exit: let copies finish, drop mappings (engines register again with the next daemon)."""
        for session in list(self.sessions.values()):
            await self.end_session(session)
        for backend in self._backends.values():
            backend.unregister_pool(self.pool.base)
        self.executor.shutdown(wait=True)
