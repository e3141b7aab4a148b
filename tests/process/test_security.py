"""Who may talk to the daemon: socket permissions, SO_PEERCRED uid checks, TLS and mTLS on TCP."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from support.daemon import wait_for
from support.engine import store_blocks
from support.pki import make_pki, tls_client
from support.ports import free_port

from kvstore_client import KVStoreClient, PermissionDenied, ResourceExhausted, Unavailable
from kvstore_client.protocol import PROTOCOL_VERSION
from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_client.protocol import kvstore_pb2_grpc as pb_grpc


def test_socket_mode_and_group(daemon_factory) -> None:
    daemon = daemon_factory("--socket-group", str(os.getgid())).start()
    for path in (daemon.socket, daemon.socket + ".cred"):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == os.getgid()


def test_peer_credentials_are_read_from_the_kernel(daemon) -> None:
    session = daemon.client().session("who")
    session.close()
    assert f"(pid {os.getpid()}, uid {os.getuid()})" in daemon.log.read_text()


def test_uid_not_allowed_is_refused(daemon_factory) -> None:
    daemon = daemon_factory("--allowed-uids", str(os.getuid() + 1)).start()
    client = daemon.client()
    with pytest.raises(PermissionDenied, match="does not allow uid"):
        client.session("n")
    with pytest.raises(PermissionDenied):
        client.clear()
    # Skipping the handshake does not help.
    stub = pb_grpc.KVStoreStub(grpc.insecure_channel(f"unix://{daemon.socket}"))
    with pytest.raises(grpc.RpcError) as info:
        stub.Register(pb.RegisterRequest(protocol_version=PROTOCOL_VERSION, namespace="n"), timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "peer_token" in info.value.details()
    assert client.health() == "SERVING"  # read-only calls still answer


def test_allowed_uid_is_served(daemon_factory) -> None:
    daemon = daemon_factory("--allowed-uids", str(os.getuid())).start()
    client = daemon.client()
    client.session("n").close()
    assert client.clear() == 0


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, bytes | str]:
    return make_pki(tmp_path)


def test_mtls(daemon_factory, pki) -> None:
    port = free_port()
    daemon = daemon_factory("--tcp", f"127.0.0.1:{port}", "--tls-cert", pki["server_path"], "--tls-key",
                            pki["server_key_path"], "--tls-client-ca", pki["ca_path"]).start()
    assert tls_client(port, pki, "client").stats().capacity_bytes > 0
    for cert in ("rogue", None):  # a certificate from another CA, or none: refused
        with pytest.raises(Unavailable):
            tls_client(port, pki, cert).stats()
    assert daemon.client().health() == "SERVING"


def test_tcp_needs_tls_or_insecure(daemon_factory, tmp_path) -> None:
    port = free_port()
    out = subprocess.run([sys.executable, "-m", "kvstore_service", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--pool-path", f"/dev/shm/kvstore-test-tcp-{port}", "--pool-size", "16MiB",
                          "--segment-size", "4MiB", "--tcp", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--insecure" in out.stderr
    daemon = daemon_factory("--tcp", f"127.0.0.1:{port}", "--insecure").start()
    assert KVStoreClient(f"dns:127.0.0.1:{port}", timeout=5).stats().capacity_bytes > 0
    assert "plaintext TCP" in daemon.log.read_text()


def _serve_refused(daemon, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvstore_service", "serve", *daemon.args, *extra],
                          capture_output=True, text=True, timeout=120)


def test_a_symlink_planted_at_the_pool_path_is_refused(daemon_factory, tmp_path: Path) -> None:
    """/dev/shm is world-writable: a symlink there must never make the daemon truncate its target."""
    daemon = daemon_factory()
    victim = tmp_path / "precious"
    victim.write_bytes(b"not a pool" * 1000)
    os.symlink(victim, daemon.pool_path)
    try:
        proc = _serve_refused(daemon)
        assert proc.returncode == 2, proc.stderr
        assert "symbolic link" in proc.stderr and daemon.pool_path in proc.stderr
        assert victim.read_bytes() == b"not a pool" * 1000
        assert not os.path.exists(daemon.socket) and not os.path.exists(daemon.socket + ".cred")
    finally:
        os.unlink(daemon.pool_path)


@pytest.mark.parametrize("owner,mode,words", [(12345, 0o600, "belongs to uid 12345"),
                                               (None, 0o666, "may be written by others (mode 666)")])
def test_a_pool_file_others_could_write_is_not_reattached(daemon_factory, owner: int | None, mode: int,
                                                          words: str) -> None:
    """A pool another uid owns, or anyone may write, could carry forged blocks: refused, not served."""
    daemon = daemon_factory().start()
    session = daemon.client().session("victim")  # lookup-only: nothing to copy, the file exists
    session.close()
    daemon.stop()
    os.chmod(daemon.pool_path, mode)
    if owner is not None:
        os.chown(daemon.pool_path, owner, owner)
    proc = _serve_refused(daemon)
    assert proc.returncode == 2, proc.stderr
    assert words in proc.stderr
    assert not os.path.exists(daemon.socket)


def _rss_shmem_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    raise AssertionError("no RssShmem")


def test_a_sparse_memfd_commits_only_what_the_layout_addresses(daemon_factory) -> None:
    """A client's 3 GiB sparse memfd: the daemon maps and prefaults only the 1 MiB its layout addresses
    (it used to commit all 3 GiB of shared memory), refuses a layout beyond --max-session-memory, and a
    session that addresses much ends at once without stalling other calls."""
    from kvstore_client import ResourceExhausted
    from kvstore_client.client import MemorySpec
    from kvstore_client.protocol import memfd

    daemon = daemon_factory("--max-session-memory", "1GiB", pool_size="64MiB").start()
    client = daemon.client()
    fd = memfd.create("sparse", 3 << 30)
    try:
        before = _rss_shmem_kib(daemon.pid)
        small = MemorySpec.cpu(fd, 3 << 30, 16, [(0, 64 << 10, 64 << 10)])
        session = client.session("sparse", small)
        time.sleep(0.5)  # the prefault runs in the background
        grown = _rss_shmem_kib(daemon.pid) - before
        assert grown < 16 << 10, f"the daemon committed {grown} KiB for a 1 MiB layout"
        session.close()
        with pytest.raises(ResourceExhausted, match="more than --max-session-memory 1073741824"):
            client.session("sparse", MemorySpec.cpu(fd, 3 << 30, 3 << 14, [(0, 64 << 10, 64 << 10)]))
        big = client.session("sparse", MemorySpec.cpu(fd, 3 << 30, 1 << 14, [(0, 64 << 10, 64 << 10)]))
        started = time.monotonic()
        big.close()  # while its 1 GiB is still being prefaulted
        slowest = max(_timed(client.health) for _ in range(20))
        assert time.monotonic() - started < 5 and slowest < 0.5
    finally:
        os.close(fd)


def _timed(call) -> float:
    t0 = time.monotonic()
    call()
    return time.monotonic() - t0


def test_a_pool_that_does_not_fit_refuses_the_start_cleanly(daemon_factory) -> None:
    """A start refused because the pool does not fit the mount exits 2 with one line (it sometimes
    died by SIGSEGV) and leaves no socket files behind."""
    daemon = daemon_factory()
    proc = _serve_refused(daemon, "--pool-size", "64TiB")
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "lower --pool-size or grow the shared-memory mount" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not os.path.exists(daemon.socket) and not os.path.exists(daemon.socket + ".cred")


def _register_at_once(daemon, count: int, spec) -> tuple[list, list[str]]:
    """`count` engine registrations of this uid, all at once (one thread each): the sessions, the refusals."""
    from concurrent.futures import ThreadPoolExecutor

    def register(_: int):
        try:
            return daemon.client().session("many", spec)
        except ResourceExhausted as e:
            return str(e)

    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(register, range(count)))
    return [r for r in results if not isinstance(r, str)], [r for r in results if isinstance(r, str)]


@pytest.mark.parametrize("limit", ["--max-sessions-per-uid", "--max-memory-per-uid"])
def test_concurrent_registrations_of_one_uid_stay_within_its_limits(daemon_factory, limit: str) -> None:
    """24 registrations of one uid at once, each mapping 64 MiB: the limit holds (with a cap of 4
    sessions it used to let 5-6 through, counting only the registrations that had finished), and the
    memory registered per uid, across sessions, has a limit of its own."""
    from kvstore_client.client import MemorySpec
    from kvstore_client.protocol import memfd

    cap = "4" if limit == "--max-sessions-per-uid" else str(4 * 64 << 20)
    daemon = daemon_factory(limit, cap).start()
    fd = memfd.create("many", 64 << 20)
    try:
        spec = MemorySpec.cpu(fd, 64 << 20, 1024, [(0, 64 << 10, 64 << 10)])  # 64 MiB addressed
        sessions, refusals = _register_at_once(daemon, 24, spec)
        assert len(sessions) == 4 and daemon.client().stats().engines == 4, refusals
        assert len(refusals) == 20 and all(limit in r for r in refusals), refusals
        for session in sessions:
            session.close()
        assert wait_for(lambda: daemon.client().stats().engines == 0)
        sessions, _ = _register_at_once(daemon, 6, spec)  # the slots were given back
        assert len(sessions) == 4
        for session in sessions:
            session.close()
    finally:
        os.close(fd)


def test_leases_of_one_uid_are_limited_across_its_sessions(daemon_factory) -> None:
    """One uid used to hold 20,001 leases over 5 sessions (4096 per session)."""
    daemon = daemon_factory("--max-leases-per-uid", "3").start()
    keys = store_blocks(daemon.socket, "leased", 4)
    client = daemon.client()
    first, second = client.session("leased"), client.session("leased")
    leases = [first.lookup(keys, lease=True)[1], first.lookup(keys, lease=True)[1], second.lookup(keys, lease=True)[1]]
    with pytest.raises(ResourceExhausted, match=r"holds? 3 leases \(--max-leases-per-uid 3\)"):
        second.lookup(keys, lease=True)
    first.release_lease(leases[0], wait=True)
    assert second.lookup(keys, lease=True)[0] == 4
    assert client.stats().leases == 3
    first.close()
    second.close()
