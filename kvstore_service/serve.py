"""`kvstore serve`: the process around the daemon: its sockets, signals and exit, and the gRPC server
put in front of it.

    serve.py        this: sockets (unix, TCP, <socket>.cred, <socket>.jobs), health, signals, housekeeping's
                    clock, exit codes
    servicer.py     gRPC: requests decoded, one verb of the daemon called, replies encoded
    jobs_socket.py  <socket>.jobs: stores and loads framed on a plain unix socket, answered as servicer.py does
    daemon.py       the daemon's verbs over its parts (pool, index, sessions, jobs, tiers)
"""

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

from kvstore_client.protocol.jobs_framing import SUFFIX
from kvstore_service import __version__
from kvstore_service.config import Config
from kvstore_service.daemon import Daemon
from kvstore_service.jobs_socket import SubmitSocket
from kvstore_service.metrics import HttpServer
from kvstore_service.native_device import StickyDeviceError
from kvstore_service.peercred import PeerCredServer
from kvstore_service.pool import PoolFullError
from kvstore_service.servicer import GrpcServer
from kvstore_service.tenants import Tenancy

log = logging.getLogger(__name__)
# A copy thread needs the GIL briefly between native copies while the event loop plans the next
# chunk; with the default 5 ms switch interval it would idle that long each time.
SWITCH_INTERVAL_S = 0.0002
EXIT_DEVICE_FAILED = 75  # EX_TEMPFAIL: a sticky device error; restart the daemon
# A store creates an object per block: at the default 700 allocations a young collection would run
# several times per chunk planned (store 0.70-0.72 vs 0.75-0.76 of the copy engine). Housekeeping
# collects what is young once a second anyway. So a job must leave no reference cycle: one (a copy's
# callback holding its job) kept a second of stores' blocks and plans alive, and the loop spent
# most of each store faulting in fresh pages for new ones, on a memory bus the copies saturate
# (2048 x 256 KiB stores: the loop's CPU 8-15 ms a store, against 2-3 ms once freed as they end).
GC_YOUNG_THRESHOLD = 200_000
HOUSEKEEPING_S = 1.0


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
    http = HttpServer(config.metrics_port, config.socket, config.metrics_host, config.metrics_max_connections,
                      config.metrics_request_timeout_s) if config.metrics_port else None
    gid = _secure_socket(config.socket, config)
    await creds.start(int(config.socket_mode, 8), gid)
    loop = asyncio.get_running_loop()
    try:  # a refused start leaves no socket behind
        # The pool is set up (and recovered), and --devices opened, while health says NOT_SERVING.
        daemon = await Daemon.open(config, fatal)
        if http is not None:
            daemon.metrics.publish(http, daemon.stats, loop, per_namespace=config.metrics_namespaces)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        await daemon.open_tiers()
    except BaseException:
        await server.stop(grace=0)
        await creds.close()
        _remove(config.socket)
        raise
    submits = SubmitSocket(config.socket + SUFFIX, server.servicer, config, tenancy.handshake_uids())
    chores = loop.create_task(_housekeeping(daemon, creds, submits))
    daemon.start_verifying()
    await server.serve(daemon)
    await submits.start(int(config.socket_mode, 8), gid)
    log.info("kvstore %s serving on %s (pool %s, %d bytes, %d blocks recovered)", __version__, config.socket,
             config.pool_path, daemon.pool.capacity, daemon.recovered)
    if ready is not None:
        ready.set()
    await stopping.wait()

    if failed:  # no device call can succeed any more: leave without them, the pool stays on its file
        await server.stop(grace=0)
        _remove(config.socket)
        _remove(config.socket + ".cred")
        _remove(config.socket + SUFFIX)
        logging.shutdown()
        os._exit(EXIT_DEVICE_FAILED)
    log.info("shutting down")
    chores.cancel()
    await submits.close()
    # No engine may learn that its jobs ended while a copy can still touch its memory: drained first.
    if not await daemon.drain():
        log.error("copies still running after --drain-timeout-s %g s: exiting without telling the engines "
                  "(they learn it from this process's end, when no copy can run)", config.drain_timeout_s)
        logging.shutdown()
        os._exit(1)
    await server.stop(grace=2.0)
    await creds.close()
    await daemon.shutdown()
    _remove(config.socket)
    if http is not None:
        http.close()


async def _housekeeping(daemon: Daemon, creds: PeerCredServer, submits: SubmitSocket) -> None:
    while True:
        await asyncio.sleep(HOUSEKEEPING_S)
        creds.expire()
        submits.expire()
        await daemon.housekeeping()


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
