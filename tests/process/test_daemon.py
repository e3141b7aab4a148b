"""The daemon end to end: real daemon process, real engine processes, bytes verified."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from support import child_env
from support.blocks import key_of
from support.daemon import sealed_blocks, wait_for
from support.engine import Engine, content_tensor

from kvstore_client import KVStoreClient
from kvstore_client.protocol.jobs_framing import SUFFIX

ENGINE = [sys.executable, "-m", "support.engine"]  # run with env=child_env()
KB64 = 64 * 1024


def run_engine(daemon, *args: str, timeout: float = 120) -> dict:
    out = subprocess.run([*ENGINE, "--socket", daemon.socket, *args], capture_output=True,
                         text=True, timeout=timeout, check=True, env=child_env())
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_engine_processes_store_and_load_byte_exact(daemon) -> None:
    a = run_engine(daemon, "--seed", "a", "--count", "40", "store")
    b = run_engine(daemon, "--seed", "b", "--count", "40", "store")
    assert a["completion"] == 40 and b["completion"] == 40
    # Each engine loads the other's blocks into fresh memory at other block ids.
    la = run_engine(daemon, "--seed", "b", "--count", "40", "load")
    lb = run_engine(daemon, "--seed", "a", "--count", "40", "load")
    assert (la["hits"], la["loaded"], la["corrupt"]) == (40, 40, 0)
    assert (lb["hits"], lb["loaded"], lb["corrupt"]) == (40, 40, 0)
    stats = daemon.client().stats()
    assert stats.blocks == 80 and stats.stored_blocks == 80 and stats.loaded_blocks == 80


def test_restarted_engine_finds_its_blocks(daemon) -> None:
    engine = Engine(daemon.socket, "restart-ns", 64, KB64)
    keys = [key_of("r", i) for i in range(20)]
    engine.fill(keys, list(range(20)))
    job = engine.session.store(keys, list(range(20)))
    assert engine.session.wait([job])[job].ok
    engine.close()  # the engine goes away; its blocks stay

    again = Engine(daemon.socket, "restart-ns", 64, KB64)  # new process memory, new session
    assert again.session.lookup(keys) == (20, b"")
    ids = list(range(40, 60))
    job = again.session.load(keys, ids)
    assert again.session.wait([job])[job].blocks_ok == 20
    assert again.verify(keys, ids) == 0
    again.close()


def test_engine_killed_mid_job_releases_session(daemon) -> None:
    client = daemon.client()
    proc = subprocess.Popen([*ENGINE, "--socket", daemon.socket, "--seed", "k", "--count", "100",
                             "--num-blocks", "128", "--hang", "store"], stdout=subprocess.PIPE, text=True,
                            env=child_env())
    assert "submitted" in json.loads(proc.stdout.readline())
    maps = f"/proc/{daemon.proc.pid}/maps"
    assert "memfd:kvstore-kv" in open(maps).read()  # the daemon maps the engine's KV memory
    stats = client.stats()
    assert stats.engines == 1
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_for(lambda: client.stats().engines == 0, timeout=10)
    stats = client.stats()
    assert stats.jobs_in_flight == 0 and stats.leases == 0
    # The daemon let go of its memory (and nothing is left in /dev/shm: memfds die with their users).
    assert wait_for(lambda: "memfd:kvstore" not in open(maps).read(), timeout=10)
    # The daemon keeps serving: another engine stores and loads.
    assert run_engine(daemon, "--seed", "after", "--count", "10", "store")["completion"] == 10
    assert run_engine(daemon, "--seed", "after", "--count", "10", "load")["corrupt"] == 0


def test_lease_released_when_owner_dies(daemon) -> None:
    run_engine(daemon, "--seed", "l", "--count", "8", "store")
    code = (
        "import time\n"
        "from support.blocks import key_of\n"
        "from kvstore_client import KVStoreClient\n"
        f"s = KVStoreClient({daemon.socket!r}).session('test-ns')\n"
        "print(s.lookup([key_of('l', i) for i in range(8)], lease=True)[0], flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=child_env())
    assert proc.stdout.readline().strip() == "8"
    client = daemon.client()
    assert client.stats().leases == 1
    proc.kill()
    proc.wait()
    assert wait_for(lambda: client.stats().leases == 0, timeout=10)


def _small_pool(daemon_factory):
    # 4 segments of 1 MiB, 15 slots of 64 KiB each: 60 blocks.
    return daemon_factory(pool_size="4MiB", segment_size="1MiB").start()


def test_lru_eviction_skips_leased_blocks(daemon_factory) -> None:
    daemon = _small_pool(daemon_factory)
    engine = Engine(daemon.socket, "lru", 64, KB64)
    s = engine.session
    keys = [key_of("lru", i) for i in range(70)]
    engine.fill(keys[:60], list(range(60)))
    for start in range(0, 60, 20):
        job = s.store(keys[start:start + 20], list(range(start, start + 20)))
        assert s.wait([job])[job].blocks_ok == 20
    client = daemon.client()
    assert client.stats().blocks == 60
    # (a block is pinned while its seal reads it, and eviction passes over pinned blocks)
    assert wait_for(lambda: client.stats().unsealed_blocks == 0, timeout=20)
    hits, lease = s.lookup(keys[:5], lease=True)  # pins the 5 oldest
    assert hits == 5 and lease
    hits, recent = s.lookup([keys[10]], lease=True)  # a leased lookup marks it recently used
    assert hits == 1
    s.release_lease(recent, wait=True)
    engine.fill(keys[60:70], list(range(10)))
    job = s.store(keys[60:70], list(range(10)))
    assert s.wait([job])[job].blocks_ok == 10
    present = {i for i in range(70) if s.lookup([keys[i]])[0]}
    evicted = set(range(70)) - present
    assert evicted == {5, 6, 7, 8, 9, 11, 12, 13, 14, 15}
    stats = client.stats()
    assert stats.evictions == 10 and stats.blocks == 60
    s.release_lease(lease, wait=True)
    client.close()
    engine.close()


def test_dedupe_and_pool_full(daemon_factory) -> None:
    daemon = _small_pool(daemon_factory)
    engine = Engine(daemon.socket, "full", 64, KB64)
    s = engine.session
    keys = [key_of("full", i) for i in range(64)]
    engine.fill(keys[:60], list(range(60)))
    job = s.store(keys[:60], list(range(60)))
    assert s.wait([job])[job].blocks_ok == 60
    # Storing present keys again is a no-op that succeeds.
    job = s.store(keys[:60], list(range(60)))
    assert s.wait([job])[job].blocks_ok == 60
    stats = daemon.client().stats()
    assert stats.blocks == 60 and stats.stored_blocks == 60
    # Everything leased: a new block has nowhere to go, and fails alone.
    _, lease = s.lookup(keys[:60], lease=True)
    job = s.store(keys[60:64], [60, 61, 62, 63])
    done = s.wait([job])[job]
    assert (done.blocks_ok, done.blocks_failed) == (0, 4)
    assert daemon.client().stats().store_failures_pool_full == 4
    (result,) = [j for j in s.results().jobs if j.job_id == job]
    assert list(result.block_ok) == [False] * 4 and "pool full" in result.error
    # The leased blocks are intact and load byte-exact.
    engine.blocks.zero_()
    job = s.load(keys[:60], list(range(60)))
    assert s.wait([job])[job].blocks_ok == 60
    assert engine.verify(keys[:60], list(range(60))) == 0
    s.release_lease(lease, wait=True)
    job = s.store(keys[60:64], [60, 61, 62, 63])
    assert s.wait([job])[job].blocks_ok == 4
    engine.close()


def test_load_of_missing_block_fails_that_block_only(daemon) -> None:
    engine = Engine(daemon.socket, "miss", 16, KB64)
    s = engine.session
    present = key_of("m", 0)
    engine.fill([present], [0])
    s.wait([s.store([present], [0])])
    engine.blocks.zero_()
    job = s.load([present, key_of("m", 1)], [1, 2])
    done = s.wait([job])[job]
    assert (done.blocks_ok, done.blocks_failed) == (1, 1)
    assert engine.verify([present], [1]) == 0
    assert int(engine.blocks[2].count_nonzero()) == 0  # the missing block wrote nothing
    engine.close()


def test_concurrent_engine_processes_hammer(daemon) -> None:
    procs = [subprocess.Popen([*ENGINE, "--socket", daemon.socket, "--seed", "shared",
                               "--count", "48", "--rounds", "25", "hammer"], stdout=subprocess.PIPE, text=True,
                              env=child_env())
             for _ in range(4)]
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["corrupt"] == 0 for r in results)
    assert sum(r["loaded"] for r in results) > 0 and sum(r["stored"] for r in results) > 0
    stats = daemon.client().stats()
    assert stats.engines == 0 and stats.jobs_in_flight == 0 and stats.failed_blocks == 0


def test_stats_and_clear(daemon) -> None:
    run_engine(daemon, "--namespace", "one", "--seed", "x", "--count", "6", "store")
    run_engine(daemon, "--namespace", "two", "--seed", "x", "--count", "4", "store")
    client = daemon.client()
    assert wait_for(lambda: client.stats().unsealed_blocks == 0, timeout=10)  # (a clear leaves what a seal holds)
    names = {ns.namespace: ns.blocks for ns in client.stats().namespaces}
    assert names == {"one": 6, "two": 4}
    # Namespaces never mix: the same keys are absent in another namespace.
    assert client.lookup("one", [key_of("x", i) for i in range(6)]) == 6
    assert client.lookup("three", [key_of("x", i) for i in range(6)]) == 0
    assert client.clear("one") == 6
    assert client.lookup("one", [key_of("x", 0)]) == 0
    assert client.lookup("two", [key_of("x", 0)]) == 1
    assert client.clear() == 4 and client.stats().blocks == 0


def test_content_helper_is_deterministic() -> None:
    assert torch.equal(content_tensor(b"k" * 32, 1000), content_tensor(b"k" * 32, 1000))
    assert not torch.equal(content_tensor(b"k" * 32, 1000), content_tensor(b"j" * 32, 1000))


def test_client_reports_unreachable_daemon(tmp_path) -> None:
    from kvstore_client import Unavailable

    with pytest.raises(Unavailable):
        KVStoreClient(str(tmp_path / "nobody.sock"), timeout=1).stats()
    assert not os.path.exists(tmp_path / "nobody.sock")


def _sealed(daemon, count: int) -> list:
    assert wait_for(lambda: len(list(sealed_blocks(daemon.pool_path))) >= count, timeout=10)
    return list(sealed_blocks(daemon.pool_path))


def test_corrupt_block_fails_its_load_and_is_dropped(daemon_factory) -> None:
    import mmap

    daemon = daemon_factory("--verify-loads", "1").start()

    engine = Engine(daemon.socket, "corrupt", 16, KB64)
    s = engine.session
    keys = [key_of("c", i) for i in range(4)]
    engine.fill(keys, [0, 1, 2, 3])
    s.wait([s.store(keys, [0, 1, 2, 3])])
    victim = next((h, off) for h, off in _sealed(daemon, 4) if h.key == keys[2])
    with open(daemon.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
        data[victim[1] + 100] ^= 0xFF  # one flipped byte
    hits, lease = s.lookup(keys, lease=True)  # a lease pins it: dropped from the index all the same
    assert hits == 4
    engine.blocks.zero_()
    job = s.load(keys, [4, 5, 6, 7])
    done = s.wait([job])[job]
    assert (done.blocks_ok, done.blocks_failed) == (3, 1)
    assert engine.verify([keys[0], keys[1], keys[3]], [4, 5, 7]) == 0
    assert int(engine.blocks[6].count_nonzero()) == 0  # (copied whole: verified first) the bad bytes never landed
    stats = daemon.client().stats()
    assert stats.corrupt_blocks == 1 and stats.blocks == 3
    assert s.lookup(keys) == (2, b"")
    s.release_lease(lease, wait=True)
    # Stored again, it is good again.
    engine.fill(keys[2:3], [2])
    s.wait([s.store(keys[2:3], [2])])
    assert s.lookup(keys) == (4, b"")
    engine.close()


def test_a_bulk_load_checks_its_blocks_as_it_copies_and_fails_a_corrupt_one(daemon_factory) -> None:
    """Over PLAIN_LOAD_BYTES a load is copied in chunks, its checksums taken as it copies: a corrupt
    block fails its load (the engine recomputes it), the others land whole, the block is dropped."""
    import mmap

    from kvstore_service.backends.cpu import PLAIN_LOAD_BYTES

    block = 4 << 20
    n = PLAIN_LOAD_BYTES // block + 2
    daemon = daemon_factory("--verify-loads", "1", pool_size=f"{2 * n * block >> 20}MiB",
                            segment_size="16MiB").start()
    engine = Engine(daemon.socket, "bulk-corrupt", 2 * n, block)
    s = engine.session
    keys = [key_of("b", i) for i in range(n)]
    engine.fill(keys, list(range(n)))
    s.wait([s.store(keys, list(range(n)))])
    victim = next(off for h, off in _sealed(daemon, n) if h.key == keys[5])
    with open(daemon.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
        data[victim + block - 1] ^= 0xFF  # its last byte
    job = s.load(keys, list(range(n, 2 * n)))
    done = s.wait([job])[job]
    assert (done.blocks_ok, done.blocks_failed) == (n - 1, 1)
    good = [i for i in range(n) if i != 5]
    assert engine.verify([keys[i] for i in good], [n + i for i in good]) == 0
    stats = daemon.client().stats()
    assert stats.corrupt_blocks == 1 and stats.blocks == n - 1
    assert s.lookup(keys) == (5, b"")
    engine.close()


def test_daemon_restart_keeps_blocks(daemon) -> None:
    engine = Engine(daemon.socket, "persist", 32, KB64)
    keys = [key_of("p", i) for i in range(10)]
    engine.fill(keys, list(range(10)))
    engine.session.wait([engine.session.store(keys, list(range(10)))])
    _sealed(daemon, 10)
    daemon.kill()  # SIGKILL: no chance to clean up
    daemon.start()
    # The engine's session re-registers on its own and finds its blocks.
    assert wait_for(lambda: engine.session.connected and engine.session.registrations == 2, timeout=20)
    assert engine.session.lookup(keys) == (10, b"")
    engine.blocks.zero_()
    job = engine.session.load(keys, list(range(10, 20)))
    assert engine.session.wait([job])[job].blocks_ok == 10
    assert engine.verify(keys, list(range(10, 20))) == 0
    stats = daemon.client().stats()
    assert stats.blocks == 10 and stats.namespaces[0].namespace == "persist"
    engine.close()


def _jobs_connections(path: str) -> int:
    """Accepted connections of the unix socket bound at `path` (/proc/net/unix lists them under its path)."""
    with open("/proc/net/unix") as f:
        return sum(1 for line in f if line.split()[-1] == path and line.split()[5] == "03")


def test_stores_and_loads_go_over_the_jobs_socket_and_over_grpc_without_it(daemon) -> None:
    jobs = daemon.socket + SUFFIX
    engine = Engine(daemon.socket, "jobs-socket", 16, 64 * 1024)
    keys = [key_of("jobs-socket", i) for i in range(8)]
    engine.fill(keys, list(range(8)))
    job = engine.session.store(keys, list(range(8)))
    assert engine.session.wait([job])[job].ok
    assert _jobs_connections(jobs) == 1  # the engine's submit thread, connected at its first job
    # Without the socket (an older daemon), the same jobs go by gRPC.
    os.unlink(jobs)
    other = Engine(daemon.socket, "jobs-socket", 16, 64 * 1024)
    job = other.session.load(keys, list(range(8, 16)))
    assert other.session.wait([job])[job].ok
    assert other.verify(keys, list(range(8, 16))) == 0
    engine.close()
    other.close()


def test_a_partly_refused_burst_of_jobs_on_the_jobs_socket_comes_out_as_the_daemon_decided(daemon_factory) -> None:
    """With one job in flight allowed, a burst of stores from an engine's session is partly refused on
    <socket>.jobs: each refused job fails and stores nothing, each taken one is stored whole."""
    daemon = daemon_factory("--max-inflight-jobs", "1", pool_size="512MiB").start()
    engine = Engine(daemon.socket, "burst", 64, 4096)
    outcomes: set[bool] = set()
    for attempt in range(5):
        keysets = [[key_of(f"burst{attempt}-{n}", i) for i in range(blocks)]
                   for n, blocks in enumerate((16, 16384, 16, 16, 16384, 16))]
        jobs = [engine.session.store(keys, [i % 64 for i in range(len(keys))]) for keys in keysets]
        done = engine.session.wait(jobs)
        for keys, job in zip(keysets, jobs, strict=True):
            assert done[job].blocks_ok in (0, len(keys))
            assert engine.session.lookup(keys)[0] == done[job].blocks_ok
        outcomes |= {done[job].ok for job in jobs}
        if outcomes == {True, False}:
            break
    assert outcomes == {True, False}
    assert _jobs_connections(daemon.socket + SUFFIX) == 1  # (not by gRPC)
    engine.close()


def pool_policy(daemon) -> str:
    """The NUMA policy of the daemon's pool mapping, as /proc/PID/numa_maps shows it ("default",
    "interleave:0-1", ...)."""
    with open(f"/proc/{daemon.pid}/numa_maps") as f:
        return next(line.split()[1] for line in f if f"file={daemon.pool_path}" in line)


@pytest.mark.skipif(not os.path.exists("/proc/self/numa_maps"), reason="a kernel without NUMA")
def test_a_new_pool_is_spread_over_the_numa_nodes_asked(daemon_factory) -> None:
    """--pool-numa: a node list is an interleave policy on the pool's pages, set before they are faulted in;
    a node the machine lacks is a warning, not a refusal (pages go where first touched); 'interleave' (the
    default) spreads over every node the daemon may use, when there are several."""
    with open("/proc/self/status") as f:
        allowed = next(line.split(":")[1].strip() for line in f if line.startswith("Mems_allowed_list"))
    first = allowed.split(",")[0].split("-")[0]
    asked = daemon_factory("--pool-numa", first).start()
    assert pool_policy(asked) == f"interleave:{first}"
    missing = daemon_factory("--pool-numa", "63").start()
    assert pool_policy(missing) == "default" and "not spread over NUMA nodes [63]" in missing.log.read_text()
    default = daemon_factory().start()
    assert pool_policy(default) == ("default" if allowed == first else f"interleave:{allowed}")


def test_a_new_pool_serves_before_it_is_all_set_up_and_grows_to_its_capacity(daemon_factory) -> None:
    """--populate-first: the daemon serves once that much of a new pool is faulted in, stores meanwhile
    take what is ready, and the rest is added while it serves (stats' ready_bytes)."""
    daemon = daemon_factory("--populate-first", "16MiB", pool_size="1GiB", segment_size="8MiB").start()
    client = daemon.client()
    assert client.stats().ready_bytes >= 16 << 20
    engine = Engine(daemon.socket, "grow", 16, KB64)
    keys = [key_of("g", i) for i in range(16)]
    engine.fill(keys, list(range(16)))
    assert engine.session.wait([job := engine.session.store(keys, list(range(16)))])[job].ok
    assert wait_for(lambda: client.stats().ready_bytes == client.stats().capacity_bytes == 1 << 30, timeout=60)
    log = daemon.log.read_text()
    assert 0 < log.index(" serving on ") < log.index("all 1073741824 bytes ready")  # (served first)
    assert engine.session.lookup(keys) == (16, b"")
    engine.close()
