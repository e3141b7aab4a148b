"""Tenants on a shared node: a second uid can neither see, nor read, nor clear the first's blocks;
admins see every tenant; over TCP a session belongs to its client certificate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
from support import child_env
from support.blocks import key_of
from support.daemon import wait_for
from support.engine import Engine, store_blocks
from support.pki import make_pki, tls_client
from support.ports import free_port

from kvstore_client import KVStoreClient, PermissionDenied, ResourceExhausted
from kvstore_client.protocol import kvstore_pb2 as pb

OTHER_UID = 54321  # no such user on a CI runner
VICTIM_NS = "model=org/victim-model;dtype=float16;salt=victims-secret-salt"
BLOCKS = 16

# As OTHER_UID (after looking the socket up from its directory as root): everything an attacker
# who knows the victim's namespace string tries. Prints one JSON object.
_ATTACKER = r"""
import json, os, sys
from kvstore_client import KVStoreClient, KVStoreError  # imported as root: the interpreter may be private
from support.blocks import key_of
from support.engine import Engine
workdir, socket_name, uid, ns, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
os.chdir(workdir)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)

target = "unix:" + socket_name
client = KVStoreClient(target)
keys = [key_of(ns, i) for i in range(blocks)]
out = {}

def attempt(name, fn):
    try:
        out[name] = fn()
    except KVStoreError as e:
        out[name] = f"{type(e).__name__}: {e}"

def load():
    engine = Engine(target, ns, blocks, 64 * 1024)
    job = engine.session.load(keys, list(range(blocks)))
    engine.session.wait([job])
    leaked = blocks - engine.verify(keys, list(range(blocks)))
    engine.close()
    return leaked

stats = client.stats()
out["namespaces"] = [n.namespace for n in stats.namespaces]
out["stats"] = str(stats)
attempt("lookup", lambda: client.lookup(ns, keys))
attempt("leaked", load)
attempt("clear", lambda: client.clear(ns))
attempt("clear_all", lambda: client.clear())
attempt("clear_other_tenant", lambda: client.clear("", "a"))
print(json.dumps(out))
"""


def attack(daemon, namespace: str = VICTIM_NS) -> dict:
    os.chmod(daemon.workdir, 0o755)  # the other uid looks the socket up from there, whatever the umask
    out = subprocess.run([sys.executable, "-c", _ATTACKER, str(daemon.workdir), os.path.basename(daemon.socket),
                          str(OTHER_UID), namespace, str(BLOCKS)], capture_output=True, text=True, timeout=120,
                         env=child_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def victim_loads(daemon) -> int:
    """Blocks the victim's own engine loads byte-exact."""
    engine = Engine(daemon.socket, VICTIM_NS, BLOCKS, 64 * 1024)
    try:
        keys = [key_of(VICTIM_NS, i) for i in range(BLOCKS)]
        job = engine.session.load(keys, list(range(BLOCKS)))
        engine.session.wait([job])
        return BLOCKS - engine.verify(keys, list(range(BLOCKS)))
    finally:
        engine.close()


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second uid")


@needs_root
def test_a_second_tenant_can_neither_see_nor_load_nor_clear_the_first_ones_blocks(daemon_factory) -> None:
    tenants = json.dumps({"a": {"uids": [os.getuid()]}, "b": {"uids": [OTHER_UID]}})
    port = free_port()
    daemon = daemon_factory("--socket-mode", "0666", "--tenants", tenants, "--metrics-port", str(port)).start()
    store_blocks(daemon.socket, VICTIM_NS, BLOCKS)
    seen = attack(daemon)
    print(f"attacker of another tenant: {seen['leaked']}/{BLOCKS} blocks leaked, lookup {seen['lookup']}")
    assert seen["namespaces"] == [] and "victims-secret-salt" not in seen["stats"]
    assert seen["lookup"] == 0  # the same namespace string names the attacker's own (empty) namespace
    assert seen["leaked"] == 0
    assert seen["clear"] == 0 and seen["clear_all"] == 0
    assert seen["clear_other_tenant"].startswith("PermissionDenied") and "admins" in seen["clear_other_tenant"]
    # The victim's blocks are untouched; the victim sees its namespace as it named it.
    assert victim_loads(daemon) == BLOCKS
    stats = daemon.client().stats()
    assert [(n.namespace, n.tenant, n.blocks) for n in stats.namespaces] == [(VICTIM_NS, "a", BLOCKS)]
    # /metrics, which anyone reaching the port reads: tenant and model, never the salt.
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'kvstore_blocks{model="org/victim-model",namespace_id="' in metrics and 'tenant="a"} 16' in metrics
    assert "victims-secret-salt" not in metrics


@needs_root
def test_a_uid_in_no_tenant_is_refused_and_sees_no_namespace(daemon_factory) -> None:
    daemon = daemon_factory("--socket-mode", "0666", "--tenants", json.dumps({"a": {"uids": [os.getuid()]}})).start()
    store_blocks(daemon.socket, VICTIM_NS, BLOCKS)
    seen = attack(daemon)
    assert seen["namespaces"] == [] and "\nblocks: 16\n" in seen["stats"]  # daemon-wide figures only
    for what in ("lookup", "leaked", "clear"):
        assert seen[what].startswith("PermissionDenied"), (what, seen[what])
    assert victim_loads(daemon) == BLOCKS


def test_admins_see_every_tenant_and_clear_any(daemon_factory) -> None:
    me = os.getuid()
    daemon = daemon_factory("--tenants", json.dumps({"a": {"uids": [me]}, "b": {"uids": [me + 1]}}),
                            "--admin-uids", str(me)).start()
    store_blocks(daemon.socket, VICTIM_NS, BLOCKS)
    client = daemon.client()
    # (a clear leaves blocks the seal holds at that moment: let the seal finish first)
    assert wait_for(lambda: client.stats().unsealed_blocks == 0, timeout=20)
    assert [(n.tenant, n.namespace) for n in client.stats().namespaces] == [("a", VICTIM_NS)]
    assert client.clear("", "b") == 0
    assert client.clear(VICTIM_NS, "a") == BLOCKS
    assert client.stats().blocks == 0


def test_without_rules_one_tenant_serves_everyone(daemon) -> None:
    store_blocks(daemon.socket, VICTIM_NS, 2)
    (ns,) = daemon.client().stats().namespaces
    assert (ns.namespace, ns.tenant) == (VICTIM_NS, "")
    assert daemon.client().lookup(VICTIM_NS, [bytes(32)]) == 0


def test_namespaces_with_control_characters_are_refused(daemon) -> None:
    with pytest.raises(Exception, match="control character"):
        daemon.client().session("a\x1fb")


@pytest.mark.parametrize("rule", [("--allowed-uids", "0"), ("--tenants", '{"a": {"uids": [0]}}'),
                                  ("--admin-uids", "0")])
def test_uid_rules_over_plain_tcp_refuse_the_start(daemon_factory, rule: tuple[str, str]) -> None:
    daemon = daemon_factory("--tcp", f"127.0.0.1:{free_port()}", "--insecure", *rule)
    out = subprocess.run([sys.executable, "-m", "kvstore_service", "serve", *daemon.args], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "needs --tls-client-ca" in out.stderr, out.stderr
    assert not os.path.exists(daemon.socket)


@pytest.fixture
def pki(tmp_path) -> dict:
    return make_pki(tmp_path, clients=("engine-a", "engine-b"))


def test_over_mtls_a_session_belongs_to_its_client_certificate(daemon_factory, pki: dict) -> None:
    port = free_port()
    tenants = json.dumps({"a": {"tls_names": ["engine-a"]}, "b": {"tls_names": ["engine-b"]}})
    daemon = daemon_factory("--tcp", f"127.0.0.1:{port}", "--tls-cert", pki["server_path"], "--tls-key",
                            pki["server_key_path"], "--tls-client-ca", pki["ca_path"], "--tenants", tenants,
                            "--admin-uids", str(os.getuid())).start()
    a, b = tls_client(port, pki, "engine-a"), tls_client(port, pki, "engine-b")
    session = a.session(VICTIM_NS)
    assert session.lookup([bytes(32)]) == (0, b"")
    request = pb.LookupRequest(session_id=session.session_id, keys=bytes(32), key_size=32, lease=True)
    for thief in (b, KVStoreClient(daemon.socket)):  # another certificate; the unix socket
        with pytest.raises(PermissionDenied, match="belongs to another caller"):
            thief.call(thief.stub.Lookup, request)
    assert a.call(a.stub.Lookup, request).hits == 0  # its owner still uses it
    session.close()
    assert daemon.client().health() == "SERVING"


def test_admins_alone_lock_no_engine_out(daemon_factory) -> None:
    daemon = daemon_factory("--admin-uids", str(os.getuid() + 1)).start()
    store_blocks(daemon.socket, VICTIM_NS, 2)  # a uid that is no admin still registers and stores
    assert [n.namespace for n in daemon.client().stats().namespaces] == [VICTIM_NS]


# As OTHER_UID: an engine of tenant b stores 256 blocks of 64 KiB; prints how many went in.
_STORER = r"""
import os, sys
from support.blocks import key_of  # imported as root: the interpreter may be private
from support.engine import Engine
workdir, socket_name, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.chdir(workdir)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
engine = Engine("unix:" + socket_name, "b-model", 256, 64 * 1024)
keys = [key_of("b", i) for i in range(256)]
engine.fill(keys, list(range(256)))
job = engine.session.store(keys, list(range(256)))
print(engine.session.wait([job])[job].blocks_ok)
engine.close()
"""


@needs_root
def test_one_tenants_leases_leave_the_pool_to_the_other_tenants_stores(daemon_factory) -> None:
    """Tenant a fills the pool (1008 blocks of 64 KiB) and leases all it can for 600 s, the longest
    lease: its leases pin at most --max-lease-share (0.5) of the pool, so tenant b's engine then stores
    its 256 blocks (it used to store 0 of 256, every block of the pool leased by a)."""
    tenants = json.dumps({"a": {"uids": [os.getuid()]}, "b": {"uids": [OTHER_UID]}})
    daemon = daemon_factory("--socket-mode", "0666", "--tenants", tenants).start()
    engine = Engine(daemon.socket, "a-model", 1008, 64 * 1024)
    keys = [key_of("a", i) for i in range(1008)]
    engine.fill(keys, list(range(1008)))
    job = engine.session.store(keys, list(range(1008)))
    assert engine.session.wait([job])[job].blocks_ok == 1008
    leased, refusals = 0, []
    for first in range(0, 1008, 126):
        try:
            leased += engine.session.lookup(keys[first:first + 126], lease=True, lease_ttl_ms=600_000)[0]
        except ResourceExhausted as e:
            refusals.append(str(e))
    assert leased == 504 and len(refusals) == 4, refusals  # 512 blocks' bytes: half of the 64 MiB pool
    assert all("--max-lease-share 0.5" in r for r in refusals), refusals
    os.chmod(daemon.workdir, 0o755)  # the other uid looks the socket up from there, whatever the umask
    out = subprocess.run([sys.executable, "-c", _STORER, str(daemon.workdir), os.path.basename(daemon.socket),
                          str(OTHER_UID)], capture_output=True, text=True, timeout=120, env=child_env())
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == 256
    assert engine.session.lookup(keys[:504])[0] == 504  # a's leased blocks stayed
    engine.close()


def test_a_lease_naming_a_block_twice_counts_it_once(daemon_factory) -> None:
    """A leased lookup that names a block twice pinned it twice and counted its bytes twice against
    --max-lease-share but gave them back once: after some rounds every lease of the tenant was refused,
    with none held."""
    tenants = json.dumps({"a": {"uids": [os.getuid()]}})
    daemon = daemon_factory("--tenants", tenants).start()
    engine = Engine(daemon.socket, "a-model", 4, 1 << 20)
    key = key_of("twice", 0)
    engine.fill([key], [0])
    job = engine.session.store([key], [0])
    assert engine.session.wait([job])[job].ok
    for _ in range(64):  # 64 MiB pool, a share of 32 MiB: the leak refused the 32nd
        hits, lease = engine.session.lookup([key, key], lease=True)
        assert hits == 2
        engine.session.release_lease(lease, wait=True)
    assert daemon.client().stats().leases == 0
    engine.close()


def test_the_blocks_a_callers_leases_name_are_bounded(daemon_factory) -> None:
    daemon = daemon_factory("--max-lease-blocks-per-uid", "10").start()
    engine = Engine(daemon.socket, "lease-refs", 8, 64 * 1024)
    keys = [key_of("refs", i) for i in range(4)]
    engine.fill(keys, list(range(4)))
    job = engine.session.store(keys, list(range(4)))
    assert engine.session.wait([job])[job].ok
    leases = [engine.session.lookup(keys, lease=True)[1] for _ in range(2)]  # 8 blocks named
    with pytest.raises(ResourceExhausted, match=r"--max-lease-blocks-per-uid 10"):
        engine.session.lookup(keys, lease=True)
    assert engine.session.lookup(keys[:2], lease=True)[0] == 2  # 10: at the bound
    engine.session.release_lease(leases[0], wait=True)
    assert engine.session.lookup(keys, lease=True)[0] == 4
    engine.close()
