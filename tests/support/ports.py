"""Free loopback ports for the servers the tests start (Redis, daemons on TCP, metrics, vllm serve).

Ports come from below the kernel's ephemeral range (ip_local_port_range), not from binding port 0:
a port 0 gives an ephemeral port, and between our check and the server's bind any outgoing connection
(redis-cli, a cluster bus link, gRPC) may take that same port ("Address already in use"). Also a
killed Redis node restarts on its port later, and a cluster node needs port + 10000 for its bus, so
both must lie where no outgoing connection lands.
"""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"
LOWEST = 10000  # above the well-known and most registered services' ports
BUS_OFFSET = 10000  # a Redis cluster node's bus port: its port + 10000


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 when /proc does not say)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_ports(count: int, bus: bool = False) -> list[int]:
    """`count` distinct free loopback ports below the ephemeral range; with `bus`, port + 10000 (a
    cluster node's bus) is free and below that range too."""
    top = ephemeral_start() - (BUS_OFFSET if bus else 0)
    if top - LOWEST < 100 * count:
        raise RuntimeError(f"too few ports below the ephemeral range (it starts at {ephemeral_start()})")
    rng = random.SystemRandom()  # separate test processes must not draw the same sequence
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(LOWEST, top)
        if port in ports or not _bindable(port) or (bus and not _bindable(port + BUS_OFFSET)):
            continue
        ports.append(port)
    return ports


def free_port() -> int:
    return free_ports(1)[0]
