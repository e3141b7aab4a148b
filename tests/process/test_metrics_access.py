"""Who can read /metrics: it asks no credentials, so it listens on loopback unless --metrics-host says
otherwise (the Helm chart gives the pod IP), and its per-namespace series, which name tenants and
models, can be turned off."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest
from support.engine import store_blocks
from support.ports import free_port


def listening_on(pid: int, port: int) -> list[str]:
    """The local addresses (IPv4, as a.b.c.d) process `pid`'s sockets listen on at `port`."""
    found = []
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in list(f)[1:]:
            local, state = line.split()[1], line.split()[3]
            address, local_port = local.split(":")
            if state == "0A" and int(local_port, 16) == port:  # LISTEN
                found.append(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


@pytest.mark.parametrize(("flags", "address"), [((), "127.0.0.1"), (("--metrics-host", "0.0.0.0"), "0.0.0.0")],
                         ids=["default", "every-address"])
def test_metrics_listen_on_loopback_unless_told(daemon_factory, flags: tuple[str, ...], address: str) -> None:
    """It used to listen on 0.0.0.0, whatever the operator wanted."""
    port = free_port()
    daemon = daemon_factory("--metrics-port", str(port), *flags).start()
    assert listening_on(daemon.pid, port) == [address]
    assert "kvstore_pool_capacity_bytes" in scrape(port)


def test_per_namespace_series_can_be_turned_off(daemon_factory) -> None:
    """Off, /metrics names no tenant, model or namespace: daemon-wide figures only."""
    tenants = json.dumps({"team-a": {"uids": [os.getuid()]}})
    namespace = "model=org/secret-model;dtype=float16"
    port = free_port()
    daemon = daemon_factory("--tenants", tenants, "--metrics-port", str(port)).start()
    store_blocks(daemon.socket, namespace, 4)
    text = scrape(port)
    assert 'tenant="team-a"' in text and "org/secret-model" in text  # on by default
    daemon.stop()
    daemon.start("--no-metrics-namespaces")
    store_blocks(daemon.socket, namespace, 4)
    text = scrape(port)
    assert "team-a" not in text and "secret-model" not in text and "namespace_id" not in text
    assert "kvstore_pool_used_bytes" in text and "kvstore_stored_bytes_total" in text
