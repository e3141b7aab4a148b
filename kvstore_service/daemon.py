"""The daemon put together: pool, index, sessions and jobs; the sockets, signals and housekeeping.

    Pool (pool.py)        the shared-memory file, carved into slots; bytes and offsets only
    BlockIndex (index.py) the only writer of block and namespace state; no locks (the loop owns it)
    Sessions              who is connected, their mapped memory and their leases (sessions.py)
    Jobs                  store/load pipelines; the only code that hands work to threads (jobs.py)
    gRPC handlers         server.py: messages in, calls to the above, messages out
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import grp
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable

import grpc

from kvstore_service import __version__
from kvstore_service.config import Config
from kvstore_service.errors import KVError
from kvstore_service.index import BlockIndex, namespace_hash
from kvstore_service.jobs import Jobs
from kvstore_service.metrics import HttpServer, Metrics
from kvstore_service.native import StickyDeviceError
from kvstore_service.peercred import PeerCredServer
from kvstore_service.pool import Pool, PoolFullError
from kvstore_service.server import GrpcServer
from kvstore_service.sessions import EngineSession, Sessions, open_backend
from kvstore_service.stats import DiskStats, NamespaceStats, RemoteStats, Stats
from kvstore_service.tenants import Caller, Tenancy, scoped, split
from kvstore_service.tiers import Tiers
from kvstore_service.tiers.disk import DiskTier
from kvstore_service.tiers.remote import RemoteTier

log = logging.getLogger(__name__)
# A copy thread needs the GIL briefly between native copies while the event loop plans the next
# chunk; with the default 5 ms switch interval it would idle that long each time.
SWITCH_INTERVAL_S = 0.0002
EXIT_DEVICE_FAILED = 75  # EX_TEMPFAIL: a sticky device error; restart the daemon
# A store creates an object per block: at the default 700 allocations a young collection would run
# several times per chunk planned (store 0.70-0.72 vs 0.75-0.76 of the copy engine). Housekeeping
# collects what is young once a second anyway.
GC_YOUNG_THRESHOLD = 200_000
REMOTE_DRAIN_S = 2.0  # a stopping daemon waits this long for queued uploads


class Daemon:
    """Everything the gRPC handlers serve, owned by the event loop."""

    def __init__(self, config: Config, fatal: Callable[[StickyDeviceError], None]) -> None:
        self.config = config
        self.boot_id = secrets.token_bytes(16)
        self.started = time.monotonic()
        self.pool = Pool(config.pool_path, int(config.pool_size), int(config.segment_size), fresh=config.fresh)
        self.index = BlockIndex(self.pool)
        self.recovered = self.index.recover() if self.pool.reattached else 0
        self.metrics = Metrics()
        self.jobs = Jobs(config, self.pool, self.index, self.metrics, fatal)
        backends = {}
        for name in config.devices:  # (this runs off the loop, before the daemon serves)
            try:
                backends[name] = open_backend(name, self.pool)
            except KVError as e:
                raise ValueError(f"--devices {name}: {e.message}") from None
        self.sessions = Sessions(config, self.pool, self.index, self.jobs.off_loop, backends)
        self.tiers: Tiers | None = None  # made on the event loop: `open_tiers`
        if self.recovered:
            log.info("re-attached pool %s: %d blocks recovered", config.pool_path, self.recovered)

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
        return Stats(
            capacity_bytes=self.pool.capacity, used_bytes=sum(n.used_bytes for n in namespaces),
            blocks=self.index.count, hits=sum(n.hits for n in namespaces), misses=sum(n.misses for n in namespaces),
            stored_blocks=sum(n.stored_blocks for n in namespaces),
            loaded_blocks=sum(n.loaded_blocks for n in namespaces), evictions=self.index.evictions,
            engines=len(engines), leases=sum(len(s.leases) for s in self.sessions.by_id.values()),
            jobs_in_flight=sum(len(s.jobs) for s in engines), failed_blocks=self.jobs.failed_blocks,
            store_failures_pool_full=self.jobs.store_failures_pool_full,
            lease_expiries=self.sessions.lease_expiries, corrupt_blocks=self.jobs.corrupt_blocks,
            uptime_s=int(time.monotonic() - self.started), namespaces=visible, daemon_version=__version__,
            unsealed_blocks=self.jobs.unsealed_blocks, failed_load_blocks=self.jobs.failed_load_blocks,
            unverified_blocks=self.index.unverified_blocks,
            remote=self.tiers.remote.stats() if self.tiers and self.tiers.remote else RemoteStats(),
            disk=disk_stats(self.tiers.disk) if self.tiers and self.tiers.disk else DiskStats(),
            loaded_bytes=sum(n.loaded_bytes for n in namespaces),
            loaded_tokens=sum(n.loaded_tokens for n in namespaces),
        )

    async def clear(self, tenant: str | None, namespace: str) -> int:
        """Drop the blocks of a tenant's namespace, of all its namespaces (`namespace` empty), or of every
        namespace (`tenant` None): the pool's unpinned ones, and the disk tier's for good (a restart does
        not bring them back; answered once that is written down). Returns how many blocks were dropped, a
        block in both tiers once."""
        disk = self.tiers.disk if self.tiers is not None else None
        scopes: list[bytes] | None = None  # every namespace's
        if namespace:
            assert tenant is not None
            scopes = [namespace_hash(scoped(tenant, namespace))]  # (on disk, maybe unknown to the pool)
        elif tenant is not None:
            names = {h: ns.name for h, ns in self.index.namespaces.items() if ns.name}
            names.update(disk.names() if disk is not None else {})  # (after a restart, maybe only on disk)
            scopes = [h for h, name in names.items() if split(name)[0] == tenant]
        cleared, saved = self.tiers.clear_disk(scopes) if self.tiers is not None and disk is not None else (0, None)
        if scopes is None:
            cleared += self.index.clear()
        else:
            cleared += sum(self.index.clear(ns) for h in scopes if (ns := self.index.namespaces.get(h)) is not None)
        if saved is not None:
            await asyncio.shield(saved)  # (a Clear cut short still gets written down)
        return cleared

    def open_tiers(self, disk: DiskTier | None) -> None:
        """On the event loop: the tiers under the pool (--disk-path, opened off the loop; --remote), fed
        by the seals, asked by lookups."""
        config = self.config
        remote = None
        if config.remote:
            remote = RemoteTier.from_url(config.remote, password_file=config.remote_password_file or None,
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

    async def housekeeping(self, creds: PeerCredServer) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.sessions.expire_leases()
            creds.expire()
            await self.sessions.reap_unattached()
            self.index.forget_empty({s.namespace for s in self.sessions.by_id.values() if s.namespace})
            # The index holds an object per block (millions in a large pool). A full collection
            # would walk them all (tens of ms per 10k blocks, stalling every RPC), though they form
            # no garbage cycles: collect what is young, then move the survivors out of the
            # collector's sight. Garbage among them is still freed by reference counting.
            gc.collect()
            gc.freeze()

    async def shutdown(self) -> None:
        """Let copies finish, drop mappings (engines register again with the next daemon)."""
        await self.sessions.end_all()
        await self.jobs.shutdown()
        if self.tiers is not None:
            await self.tiers.close(drain_s=REMOTE_DRAIN_S)
        self.pool.close()


def open_disk(config: Config) -> DiskTier:
    """Blocking: the disk tier's directory checked, its segments' index loaded or scanned."""
    disk = DiskTier.open(config.disk_path, int(config.disk_size), segment_bytes=int(config.disk_segment_size),
                         queue_bytes=int(config.disk_queue_bytes))
    s = disk.stats()
    log.info("disk tier %s: %d blocks in %d segments (%s)", config.disk_path, s.blocks, s.segments,
             "healthy" if s.healthy else f"disabled: {s.error}")
    return disk


def disk_stats(disk: DiskTier) -> DiskStats:
    return DiskStats(**dataclasses.asdict(disk.stats()))


# -- sockets ---------------------------------------------------------------------------------------


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


# -- the serve loop --------------------------------------------------------------------------------


async def serve(config: Config, ready: asyncio.Event | None = None) -> None:
    stopping = asyncio.Event()
    failed: list[StickyDeviceError] = []

    def fatal(error: StickyDeviceError) -> None:
        if not failed:
            log.critical("device %d failed for good (%s): exiting so that the supervisor restarts the daemon "
                         "on its pool", error.device, error)
        failed.append(error)
        stopping.set()
    tenancy = Tenancy(config)
    creds = PeerCredServer(config.socket + ".cred", sorted(tenancy.handshake_uids()), config.handshake_timeout_s,
                           config.max_handshakes_per_uid, config.max_handshakes)
    server = GrpcServer(config, stopping, creds, tenancy)
    _prepare_socket(config.socket)
    server.listen(f"unix://{config.socket}")
    if config.tcp:
        server.listen(config.tcp, _tcp_credentials(config))
    await server.start()
    # /healthz from now on
    http = HttpServer(config.metrics_port, config.socket, config.metrics_host) if config.metrics_port else None
    gid = _secure_socket(config.socket, config)
    await creds.start(int(config.socket_mode, 8), gid)
    # The pool is set up (and recovered), and --devices opened, while health says NOT_SERVING.
    try:
        daemon = await asyncio.to_thread(Daemon, config, fatal)
    except BaseException:  # a refused start leaves no socket behind
        await server.stop(grace=0)
        await creds.close()
        _remove(config.socket)
        raise

    loop = asyncio.get_running_loop()
    if http is not None:
        daemon.metrics.publish(http, daemon.stats, loop, per_namespace=config.metrics_namespaces)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    what = "--disk-path"
    try:
        disk = await asyncio.to_thread(open_disk, config) if config.disk_path else None
        what = "--remote"
        daemon.open_tiers(disk)
    except ValueError as e:  # (a refused start leaves no socket behind)
        await server.stop(grace=0)
        await creds.close()
        _remove(config.socket)
        raise ValueError(f"{what}: {e}") from None
    chores = loop.create_task(daemon.housekeeping(creds))
    daemon.jobs.verify_recovered()
    await server.serve(daemon)
    log.info("kvstore %s serving on %s (pool %s, %d bytes, %d blocks recovered)", __version__, config.socket,
             config.pool_path, daemon.pool.capacity, daemon.recovered)
    if ready is not None:
        ready.set()
    await stopping.wait()

    if failed:  # no device call can succeed any more: leave without them, the pool stays on its file
        await server.stop(grace=0)
        _remove(config.socket)
        _remove(config.socket + ".cred")
        logging.shutdown()
        os._exit(EXIT_DEVICE_FAILED)
    log.info("shutting down")
    chores.cancel()
    await server.stop(grace=2.0)
    await creds.close()
    await daemon.shutdown()
    _remove(config.socket)
    if http is not None:
        http.close()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def run(config: Config) -> None:
    logging.basicConfig(level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvloop

    sys.setswitchinterval(SWITCH_INTERVAL_S)
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    try:
        uvloop.run(serve(config))
    except (PoolFullError, ValueError, OSError) as e:
        log.error("cannot start: %s", e)
        raise SystemExit(2) from None
