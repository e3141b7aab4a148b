"""Operator surface: CLI, configuration sources, metrics, health, graceful shutdown."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from support.blocks import key_of
from support.daemon import wait_for
from support.engine import Engine, kvstore, store_blocks
from support.ports import free_port

from kvstore_client import InvalidArgument
from kvstore_service import native
from kvstore_service.config import Config, ConfigError
from kvstore_service.stats import namespace_id

KB64 = 64 * 1024


def test_cli_stats_lookup_clear_health(daemon) -> None:
    keys = store_blocks(daemon.socket, "cli-ns", 5)
    out = kvstore("stats", "--json", "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)
    for key in ("capacity_bytes", "used_bytes", "blocks", "hits", "misses", "stored_blocks", "loaded_blocks",
                "evictions", "engines"):
        assert key in stats
    assert stats["blocks"] == 5 and stats["stored_blocks"] == 5 and stats["used_bytes"] == 5 * KB64
    table = kvstore("stats", env={"KVSTORE_SOCKET": daemon.socket, "COLUMNS": "160"})  # the env var selects the daemon
    assert table.returncode == 0 and "cli-ns" in table.stdout and "lookup hits" in table.stdout
    out = kvstore("lookup", "--socket", daemon.socket, "-n", "cli-ns", *(k.hex() for k in keys[:3]), "00" * 32)
    assert out.returncode == 0 and "3 of 4" in out.stdout
    out = kvstore("lookup", "--socket", daemon.socket, "-n", "cli-ns", "00")  # refused: the daemon's reason
    assert out.returncode == 1 and "Error:" in out.stderr and "Traceback" not in out.stderr
    assert "SERVING" in kvstore("health", "--socket", daemon.socket).stdout
    out = kvstore("clear", "--socket", daemon.socket, "-n", "cli-ns")
    assert out.returncode == 0 and "cleared 5 blocks" in out.stdout


def test_cli_unreachable_daemon(tmp_path) -> None:
    for command in (["stats"], ["health"], ["clear", "--all"]):
        out = kvstore(*command, "--socket", str(tmp_path / "none.sock"))
        assert out.returncode == 3
        assert "cannot reach the daemon" in out.stderr and "kvstore serve" in out.stderr


def test_clear_needs_a_namespace_or_all(daemon) -> None:
    store_blocks(daemon.socket, "kept", 3)
    out = kvstore("clear", "--socket", daemon.socket)
    assert out.returncode == 2 and "-n NAMESPACE for one namespace, or --all for every namespace" in out.stderr
    out = kvstore("clear", "--socket", daemon.socket, "-n", "kept", "--all")
    assert out.returncode == 2 and "-n and --all exclude each other" in out.stderr
    assert daemon.client().lookup("kept", [key_of("kept", i) for i in range(3)]) == 3  # nothing was dropped
    out = kvstore("clear", "--all", "--socket", daemon.socket)
    assert out.returncode == 0 and "cleared 3 blocks" in out.stdout
    assert daemon.client().lookup("kept", [key_of("kept", 0)]) == 0


def test_serve_help_types_every_option() -> None:
    out = kvstore("serve", "--help", env={"COLUMNS": "200"})
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip().startswith("--")}
    flat = " ".join(out.stdout.split())
    assert "--pool-size SIZE" in lines["--pool-size"] and "KVSTORE_POOL_SIZE; default 1GiB]" in flat
    assert "KVSTORE_MAX_SESSION_MEMORY; default 256GiB]" in flat and str(1 << 30) not in flat
    assert "--copy-threads INTEGER RANGE" in lines["--copy-threads"] and "default 2] [1<=x<=64]" in flat
    assert "--verify-loads FLOAT RANGE" in lines["--verify-loads"]
    assert "--lease-ttl-s FLOAT RANGE" in lines["--lease-ttl-s"]
    assert "--log-level [DEBUG|INFO|WARNING|ERROR]" in lines["--log-level"]
    assert "--tenants YAML" in lines["--tenants"] and "--allowed-uids INTEGER" in lines["--allowed-uids"]
    texts = [flag for flag, line in lines.items() if f"{flag} TEXT" in line]
    assert set(texts) == {"--config", "--socket", "--socket-mode", "--socket-group", "--admin-tls-names", "--tcp",
                          "--tls-cert", "--tls-key", "--tls-client-ca", "--pool-path", "--pool-numa", "--devices",
                          "--disk-path", "--event-journal",
                          "--remote", "--remote-password-file", "--remote-tls-ca",
                          "--remote-secret-file", "--metrics-host"} - {"--config"}


def test_serve_help_documents_every_setting() -> None:
    out = kvstore("serve", "--help")
    assert out.returncode == 0
    for name in Config.model_fields:
        assert "--" + name.replace("_", "-") in out.stdout
        assert f"KVSTORE_{name.upper()}" in out.stdout.replace("\n", "").replace(" ", "")


def test_the_configuration_page_documents_every_setting() -> None:
    readme = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for name in Config.model_fields:
        assert "--" + name.replace("_", "-") in readme, name


def test_config_precedence(tmp_path, monkeypatch) -> None:
    path = tmp_path / "kvstore.yaml"
    path.write_text("pool_size: 2GiB\ncopy_threads: 3\nlease-ttl-s: 5\n")
    monkeypatch.setenv("KVSTORE_COPY_THREADS", "4")
    config = Config.load(str(path), lease_ttl_s=7)
    assert config.pool_size == 2 << 30  # from the file
    assert config.copy_threads == 4  # env beats the file
    assert config.lease_ttl_s == 7  # a flag beats both
    with pytest.raises(ConfigError, match="^--pool-size: "):
        Config.load(None, pool_size="-1GiB")


def _error_line(out: subprocess.CompletedProcess[str]) -> str:
    """The one line that says what is wrong (after click's usage lines)."""
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1 and "Traceback" not in out.stderr and "pydantic" not in out.stderr, out.stderr
    return errors[0]


def test_bad_config_names_the_flag_the_variable_or_the_file_key(tmp_path) -> None:
    sock = str(tmp_path / "s.sock")
    assert _error_line(kvstore("serve", "--pool-size", "lots", "--socket", sock)) == (
        "Error: Invalid value for '--pool-size': 'lots' is not a size (e.g. 4GiB, 512MiB, 65536)")
    assert _error_line(kvstore("serve", "--pool-size", "0", "--socket", sock)) == (
        "Error: --pool-size: must be positive (given: 0)")
    assert "'--copy-threads': 0 is not in the range 1<=x<=64" in _error_line(
        kvstore("serve", "--copy-threads", "0", "--socket", sock))
    assert _error_line(kvstore("serve", "--socket", sock, env={"KVSTORE_VERIFY_LOADS": "2"})) == (
        "Error: KVSTORE_VERIFY_LOADS: Input should be less than or equal to 1 (given: '2')")
    assert _error_line(kvstore("serve", "--socket", sock, env={"KVSTORE_ALLOWED_UIDS": "uid 1000"})).startswith(
        "Error: KVSTORE_ALLOWED_UIDS: not valid JSON")
    path = tmp_path / "kvstore.yaml"
    path.write_text("segment-size: 1 byte\n")
    assert _error_line(kvstore("serve", "--config", str(path), "--socket", sock)) == (
        f"Error: --config {path}, key segment-size: could not interpret byte unit: byte (given: '1 byte')")
    path.write_text("pool_sise: 1GiB\n")
    assert _error_line(kvstore("serve", "--config", str(path), "--socket", sock)) == (
        f"Error: --config {path}, key pool_sise: not a setting (see kvstore serve --help)")
    path.write_text("pool_size: [1GiB\n")
    assert _error_line(kvstore("serve", "--config", str(path), "--socket", sock)).startswith(
        f"Error: --config {path}: not valid YAML at line 2")


def test_prometheus_metrics(daemon_factory) -> None:
    port = free_port()
    daemon = daemon_factory("--metrics-port", str(port)).start()
    store_blocks(daemon.socket, "metrics-ns", 4)
    client = daemon.client()
    assert client.lookup("metrics-ns", [key_of("metrics-ns", 0), key_of("x", 1)]) == 1
    with pytest.raises(InvalidArgument):
        client.lookup("metrics-ns", [b"short"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = f'model="",namespace_id="{namespace_id("metrics-ns")}",tenant=""'  # never the namespace string
    expected = [
        f'kvstore_blocks{{{labels}}} 4.0',
        f'kvstore_stored_blocks_total{{{labels}}} 4.0',
        f'kvstore_lookup_hits_total{{{labels}}} 1.0',
        f'kvstore_lookup_misses_total{{{labels}}} 1.0',
        'kvstore_job_duration_seconds_count{kind="store"} 1.0',
        f'kvstore_copied_bytes_total{{kind="store"}} {4.0 * KB64}',
        'kvstore_rpc_errors_total{code="INVALID_ARGUMENT"} 1.0',
        "kvstore_pool_used_bytes 262144.0",
        "kvstore_engines 0.0",
        "kvstore_hit_ratio 0.5",
    ]
    for line in expected:
        assert line in text, line
    assert _get(f"http://127.0.0.1:{port}/healthz") == (200, "SERVING")
    daemon.stop()
    with pytest.raises(urllib.error.URLError):  # gone with the daemon
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10)


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read().decode().strip()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode().strip()


def test_healthz_answers_what_the_grpc_health_service_answers(tmp_path) -> None:
    """The daemon's states, played on a real gRPC health service: NOT_SERVING (pool setup), SERVING,
    graceful shutdown, gone. /healthz asks it each time."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from kvstore_service.metrics import HttpServer

    sock = str(tmp_path / "health.sock")
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    port = free_port()
    http = HttpServer(port, sock)
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert _get(f"http://127.0.0.1:{port}/healthz") == (503, "NOT_SERVING")
        assert _get(f"http://127.0.0.1:{port}/metrics")[0] == 503  # no figures before the pool is up
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _get(f"http://127.0.0.1:{port}/healthz") == (200, "SERVING")
        servicer.enter_graceful_shutdown()
        assert _get(f"http://127.0.0.1:{port}/healthz") == (503, "NOT_SERVING")
        server.stop(0).wait()
        assert _get(f"http://127.0.0.1:{port}/healthz") == (503, "UNREACHABLE (UNAVAILABLE)")
    finally:
        http.close()
        server.stop(0)


def test_the_metrics_server_bounds_its_connections_and_closes_silent_ones(daemon_factory) -> None:
    """Connections that send half a request (or nothing) hold at most --metrics-max-connections threads,
    each closed after --metrics-request-timeout-s; the others are closed at once; then /healthz answers."""
    import socket

    port = free_port()
    daemon = daemon_factory("--metrics-port", str(port), "--metrics-max-connections", "4",
                            "--metrics-request-timeout-s", "1").start()
    assert _get(f"http://127.0.0.1:{port}/healthz") == (200, "SERVING")
    time.sleep(0.2)

    def threads() -> int:
        status = Path(f"/proc/{daemon.pid}/status").read_text()
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))

    before = threads()
    silent = []
    for i in range(40):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 2:
            s.sendall(b"GET /metr")
        silent.append(s)
    time.sleep(0.5)
    assert threads() <= before + 4
    closed = 0
    for s in silent:
        s.settimeout(0.01)
        try:
            closed += s.recv(1) == b""
        except TimeoutError:
            pass
    assert closed >= len(silent) - 4  # closed at once, but the served ones
    t = time.monotonic()

    def healthy() -> bool:
        try:
            return _get(f"http://127.0.0.1:{port}/healthz") == (200, "SERVING")
        except OSError:
            return False

    assert wait_for(healthy, timeout=10) and time.monotonic() - t < 5  # the silent ones timed out
    for s in silent:
        s.close()
    assert daemon.alive()


def test_sigterm_is_graceful(daemon) -> None:
    engine = Engine(daemon.socket, "term", 16, KB64)
    keys = [key_of("term", i) for i in range(8)]
    engine.fill(keys, list(range(8)))
    assert engine.session.wait([engine.session.store(keys, list(range(8)))])
    proc = daemon.proc
    daemon.stop()  # SIGTERM
    assert proc.returncode == 0
    assert not os.path.exists(daemon.socket)
    assert "shutting down" in daemon.log.read_text()
    # The engine notices, and its later jobs fail fast instead of hanging.
    deadline = time.monotonic() + 10
    while engine.session.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.session.connected
    job = engine.session.load(keys, list(range(8)))
    assert engine.session.wait([job], timeout=5)[job].blocks_failed == 8
    engine.close()


def test_bench_reports_every_figure(tmp_path) -> None:
    # A tiny run: the benchmark works end to end and reports what it promises (no timing asserted).
    out = kvstore("bench", "--blocks", "32", "--block-size", "64KiB", "--rounds", "1",
                  "--json", str(tmp_path / "b.json"))
    assert out.returncode == 0, out.stderr
    results = json.loads((tmp_path / "b.json").read_text())
    for key in ("store_gbps", "store_sustained_gbps", "load_gbps", "memcpy_gbps", "copy_engine_gbps",
                "store_vs_copy_engine", "load_vs_copy_engine", "grpc_empty_p50_us",
                "lookup_1k_p50_us", "poll_p50_us", "poll_p99_us", "submit_p50_us", "blocks", "block_bytes"):
        assert results[key] > 0, key
    assert results["blocks"] == 32 and results["block_bytes"] == 64 * 1024
    # The paired figures (issue 38): each round's ratio to the limit measured right before it, their median,
    # the sustained bursts likewise, and a vLLM-sized 16-block load's overhead over its own copy ...
    for name in ("store", "load", "store_sustained"):
        rounds = results[f"{name}_vs_copy_engine_rounds"]
        assert len(rounds) == 1 and all(0 < r < 100 for r in rounds), (name, rounds)
        assert 0 < results[f"{name}_vs_copy_engine"] < 100, name
    assert 0 < results["copy_engine_gbps_median"] <= results["copy_engine_gbps"]
    # Each job against its own runs copied without the daemon, and those copies against the limit.
    for name in ("store_vs_same_runs", "load_vs_same_runs", "same_runs_vs_copy_engine"):
        assert 0 < results[name] < 100, name
    assert results["store_sustained_evicted_blocks"] == 3 * 32  # into a full pool: each block stored evicts one
    # ... and a 2048-token hit's (128 blocks of 16 tokens), likewise.
    for name, blocks in (("small_load", 16), ("hit_2048", 128)):
        assert (results[f"{name}_blocks"], results[f"{name}_regions"]) == (blocks, 64)
        assert results[f"{name}_bytes"] == blocks * 64 * (32 << 10)
        assert results[f"{name}_p50_us"] > 0 and results[f"{name}_copy_p50_us"] > 0
        assert 0 < results[f"{name}_vs_copy"] < 1000
        assert isinstance(results[f"{name}_overhead_p50_us"], float)


def test_bench_on_a_device_this_machine_lacks_is_refused_in_one_line() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is usable here: the refusal is for machines without one")
    out = kvstore("bench", "--backend", "cuda", "--blocks", "4", "--rounds", "1")
    assert out.returncode == 1
    assert out.stderr.strip() == (f"Error: --backend cuda: no CUDA device is usable here (torch {torch.__version__} "
                                  "sees none)")


def test_devices_are_set_up_at_start_or_the_start_is_refused(daemon_factory) -> None:
    """--devices opens a device backend (runtime, pool pinning) before the daemon serves; one that is not
    usable here refuses the start with one clear line, exit 2, and leaves no socket behind."""
    daemon = daemon_factory("--devices", "cpu").start()
    assert daemon.client().health() == "SERVING"
    daemon.stop()
    refused = daemon_factory("--devices", "cuda")
    if native.features()["cuda_available"]:
        assert refused.start().client().health() == "SERVING"
        return
    proc = subprocess.run([sys.executable, "-m", "kvstore_service", "serve", *refused.args, "--devices", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--devices cuda: backend 'cuda' is not usable here" in proc.stderr
    assert not os.path.exists(refused.socket) and not os.path.exists(refused.socket + ".cred")
    unknown = kvstore("serve", *refused.args, "--devices", "tpu")
    assert unknown.returncode != 0 and "unknown device backend(s) ['tpu']" in unknown.stdout + unknown.stderr


def test_every_query_of_the_dashboard_reads_a_metric_the_daemon_exports(daemon_factory, server, tmp_path) -> None:
    """helm/kvstore/dashboards/kvstore.json (the chart's Grafana dashboard): each metric its queries name
    is one a live daemon with both tiers exports, after it stored, loaded and refused something."""
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "helm/kvstore/dashboards/kvstore.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    named = {m for e in exprs for m in re.findall(r"\bkvstore_[a-z0-9_]+", e)}
    assert len(exprs) >= 20 and len(named) >= 25
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(48))
    secret.chmod(0o600)
    port = free_port()
    daemon = daemon_factory("--metrics-port", str(port), "--disk-path", str(tmp_path / "disk"), "--disk-size", "32MiB",
                            "--disk-segment-size", "4MiB", "--remote", f"redis://{server.address}",
                            "--remote-secret-file", str(secret)).start()
    store_blocks(daemon.socket, "dashboard-ns", 4)
    with pytest.raises(InvalidArgument):
        daemon.client().lookup("dashboard-ns", [b"short"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert sorted(named - exported) == [], "the dashboard names metrics the daemon does not export"
