"""`<socket>.jobs` under hostile clients: a uid that holds silent connections, half-sent frames or
announces huge ones cannot keep honest engines' stores and loads out (kvstore_service/jobs_socket.py
says the rules); a client turned away sends by gRPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from support.blocks import key_of
from support.shm_engine import ShmEngine

HOSTILE_UID = 54321  # no such user on a CI runner
PER_UID = 64  # --max-sessions-per-uid's default
TURNED_AWAY = "ff"

# Run as root in the socket's directory, become HOSTILE_UID, then open connections to <socket>.jobs:
# `silent` that send nothing, `partial` that announce a 4 MiB frame and send one byte of it. Reports
# (a JSON line each) what the daemon answered at once, then when it closed the others.
_HOSTILE = r"""
import json, os, select, socket, sys, time
path, uid, silent, partial = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.chdir(os.path.dirname(path))
os.setgroups([])
os.setgid(uid)
os.setuid(uid)

def connect(first=b""):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(os.path.basename(path))
    try:
        if first:
            s.send(first)
    except OSError:  # turned away at accept: the daemon's answer still waits to be read
        pass
    return s, time.monotonic()

def reply(s, timeout):
    r, _, _ = select.select([s], [], [], timeout)
    if not r:
        return None
    try:
        head = s.recv(7)
    except OSError as e:
        return type(e).__name__
    return head[4:6].hex() if len(head) >= 6 else "closed"  # the turn-away byte and the status code

conns = [connect((4 << 20).to_bytes(4, "little") + b"\x01") for _ in range(partial)]
conns += [connect() for _ in range(silent)]
time.sleep(0.5)
answers = [reply(s, 0) for s, _ in conns]
print(json.dumps({"open": answers.count(None), "answers": [a for a in answers if a is not None]}), flush=True)
closed = []
deadline = time.monotonic() + 15.0
for (s, t0), answer in zip(conns, answers):
    if answer is None:
        got = reply(s, max(0.0, deadline - time.monotonic()))
        closed.append(None if got is None else [round(time.monotonic() - t0, 2), got])
print(json.dumps({"closed": closed}), flush=True)
"""


def _hostile(daemon, silent: int, partial: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _HOSTILE, daemon.socket + ".jobs", str(HOSTILE_UID), str(silent),
                             str(partial)], stdout=subprocess.PIPE, text=True)


def _honest_jobs(daemon) -> float:
    """Seconds an honest engine takes to store 8 jobs and load them back (each job one block)."""
    engine = ShmEngine.contiguous(daemon.socket, "honest", 16, 64 * 1024)
    try:
        t0 = time.monotonic()
        keys = [key_of("honest", i) for i in range(8)]
        for i, key in enumerate(keys):
            assert engine.store([key], [i], timeout=10).ok
        for i, key in enumerate(keys):
            assert engine.load([key], [8 + i], timeout=10).ok
        assert engine.corrupt_blocks(keys, list(range(8, 16))) == 0
        return time.monotonic() - t0
    finally:
        engine.close()


def test_a_hostile_uid_cannot_keep_engines_off_the_jobs_socket(daemon_factory) -> None:
    daemon = daemon_factory().start()
    os.chmod(daemon.socket + ".jobs", 0o666)  # (the tests' daemon socket is root's: let the hostile uid in)
    hostile = _hostile(daemon, silent=300, partial=8)
    assert hostile.stdout is not None
    first = json.loads(hostile.stdout.readline())
    # At most --max-sessions-per-uid connections held; the rest turned away at once, saying why; of the
    # partial frames, those past --max-jobs-buffer-bytes-per-uid (16 MiB: 4 frames of 4 MiB) too.
    assert first["open"] <= PER_UID, first
    assert all(a == TURNED_AWAY + "08" for a in first["answers"]), first  # RESOURCE_EXHAUSTED
    assert _honest_jobs(daemon) < 10
    closed = json.loads(hostile.stdout.readline())["closed"]
    hostile.wait(30)
    # The held ones are closed at --handshake-timeout-s (2 s; the housekeeping runs every second).
    assert closed and all(c is not None and c[0] < 4.5 and c[1] == TURNED_AWAY + "04" for c in closed), closed
    assert daemon.alive()


def test_a_uid_the_daemon_does_not_serve_is_turned_away_at_once(daemon_factory) -> None:
    daemon = daemon_factory("--allowed-uids", "0").start()
    os.chmod(daemon.socket + ".jobs", 0o666)
    hostile = _hostile(daemon, silent=20, partial=0)
    assert hostile.stdout is not None
    first = json.loads(hostile.stdout.readline())
    hostile.wait(30)
    assert first["open"] == 0 and first["answers"] == [TURNED_AWAY + "07"] * 20, first  # PERMISSION_DENIED
    assert _honest_jobs(daemon) < 10


def test_a_client_turned_away_sends_its_jobs_by_grpc(daemon_factory, caplog) -> None:
    daemon = daemon_factory("--max-job-request-bytes", "256").start()
    engine = ShmEngine.contiguous(daemon.socket, "fallback", 32, 64 * 1024)
    try:
        keys = [key_of("fallback", i) for i in range(16)]  # 16 keys of 32 bytes: a frame over 256 bytes
        assert engine.store(keys, list(range(16)), timeout=10).ok
        assert engine.load(keys, list(range(16, 32)), timeout=10).ok
        assert engine.corrupt_blocks(keys, list(range(16, 32))) == 0
        assert "turned this client away" in caplog.text and "--max-job-request-bytes 256" in caplog.text
    finally:
        engine.close()
