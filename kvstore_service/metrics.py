"""Prometheus metrics (pool, blocks served and stored, lookups, copies, job latency, evictions,
errors, engines) and a health check over HTTP, both on --metrics-host:--metrics-port.

Neither asks who calls: they listen on loopback unless told otherwise (the Helm chart gives the pod
IP). Per-namespace series name each namespace's tenant and model (never the namespace string); with
--no-metrics-namespaces there are none, only daemon-wide figures.

Counters the core already keeps are read at scrape time (a snapshot taken on the event loop, which
owns them); only job latencies and gRPC errors are recorded as they happen. The figures read at scrape
time are the fields of the typed stats (stats.py) that declare a metric, plus the few below that no
single field holds.

`GET /healthz` answers what the gRPC health service on the daemon's socket answers, by asking it:
200 "SERVING", else 503 with the status (NOT_SERVING while the pool is set up and while the daemon
shuts down; UNREACHABLE when gRPC does not answer, e.g. a stuck event loop). Probes need no
interpreter for it (Kubernetes httpGet).
"""

from __future__ import annotations

import asyncio
import operator
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvstore_service.stats import DiskStats, EventStats, MetricSpec, NamespaceStats, RemoteStats, Stats, metrics_of

# Per-namespace series: the tenant, the model and a short hash of the namespace, never the namespace
# itself (it may carry a tenant's salt), whoever scrapes /metrics.
NAMESPACE_LABELS = ["tenant", "model", "namespace_id"]
# /healthz waits this long for the gRPC health answer (below a probe's usual 1 s timeout).
HEALTHZ_TIMEOUT_S = 0.8
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def model_of(namespace: str) -> str:
    """The `model=` part of a connector's namespace ("" for other names)."""
    for part in namespace.split(";"):
        if part.startswith("model="):
            return part.removeprefix("model=")
    return ""


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.job_seconds = Histogram("kvstore_job_duration_seconds", "Job latency from submit to done.",
                                     ["kind"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.copied_bytes = Counter("kvstore_copied_bytes", "Bytes copied by jobs.", ["kind"],
                                    registry=self.registry)
        self.copy_seconds = Counter("kvstore_copy_seconds", "Time spent copying (throughput = "
                                    "rate(kvstore_copied_bytes_total) / rate(kvstore_copy_seconds_total)).",
                                    ["kind"], registry=self.registry)
        self.errors = Counter("kvstore_rpc_errors", "Requests refused, by gRPC status code.", ["code"],
                              registry=self.registry)

    def observe_job(self, is_store: bool, seconds: float, copy_seconds: float, nbytes: int) -> None:
        kind = "store" if is_store else "load"
        self.job_seconds.labels(kind).observe(seconds)
        self.copy_seconds.labels(kind).inc(copy_seconds)
        self.copied_bytes.labels(kind).inc(nbytes)

    def publish(self, http: HttpServer, stats: Callable[[], Stats], loop: asyncio.AbstractEventLoop,
                per_namespace: bool = True) -> None:
        """Serve these metrics at `http`; each scrape calls `stats` on `loop` (which owns the counters).
        `per_namespace` False: no per-namespace series (no tenant or model named)."""
        self.registry.register(_StatsCollector(stats, loop, per_namespace))
        http.registry = self.registry


class HttpServer:
    """/healthz and /metrics (any other path) on `host`:`port`, in threads of their own. Started before
    the pool is set up, so /healthz answers 503 meanwhile; /metrics answers 503 until `Metrics.publish`."""

    def __init__(self, port: int, grpc_socket: str, host: str = "127.0.0.1", max_connections: int = 16,
                 timeout_s: float = 5.0) -> None:
        self.registry: CollectorRegistry | None = None
        self._channel = grpc.insecure_channel(f"unix://{grpc_socket}")
        self._health = health_pb2_grpc.HealthStub(self._channel)
        server = _BoundedServer6 if ":" in host else _BoundedServer  # (an IPv6 pod IP)
        handler = type("Handler", (_QuietHandler,), {"timeout": timeout_s})  # a request's socket deadline
        self._httpd = make_server(host, port, self._app, server, handler_class=handler)
        self._httpd.slots = threading.BoundedSemaphore(max_connections)
        threading.Thread(target=self._httpd.serve_forever, name="kvstore-http", daemon=True).start()

    def health(self) -> str:
        """The gRPC health status of the daemon (service ""), as its name."""
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(), timeout=HEALTHZ_TIMEOUT_S)
        except grpc.RpcError as e:
            return f"UNREACHABLE ({e.code().name})"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        registry = self.registry
        if environ.get("PATH_INFO") == "/healthz":
            status = self.health()
            code = "200 OK" if status == "SERVING" else "503 Service Unavailable"
        elif registry is None:
            status, code = "starting: no metrics before the pool is set up", "503 Service Unavailable"
        else:
            return make_wsgi_app(registry)(environ, start_response)
        start_response(code, [("Content-Type", "text/plain; charset=utf-8")])
        return [status.encode() + b"\n"]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._channel.close()


class _BoundedServer(ThreadingWSGIServer):
    """A thread per connection, at most `slots` at once: one more is closed at once (probes and scrapes
    retry); each is read with the handler's timeout, so a silent connection frees its slot."""

    slots: threading.BoundedSemaphore

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _BoundedServer6(_BoundedServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # (probes and scrapes: no line each)
        pass


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], Stats], loop: asyncio.AbstractEventLoop, per_namespace: bool) -> None:
        self.stats = stats
        self.loop = loop
        self.per_namespace = per_namespace

    def collect(self) -> Iterator[Metric]:
        async def take() -> Stats:
            return self.stats()

        s = asyncio.run_coroutine_threadsafe(take(), self.loop).result(timeout=5)
        yield from _families(_DAEMON, [((), s)])
        yield from _families(_EVENTS, [((), s.events)])
        if self.per_namespace:
            rows = [((ns.tenant, model_of(ns.namespace), ns.short_id), ns) for ns in s.namespaces]
            yield from _families(_NAMESPACE, rows, NAMESPACE_LABELS)
        if s.remote.url:
            yield from _families(_REMOTE, [((), s.remote)])
            # (a summary: two fields, count and sum, make one family)
            yield SummaryMetricFamily("kvstore_remote_fetch_seconds", "Time of the lookups' fetches from the remote "
                                      "store.", count_value=s.remote.fetch_seconds_count,
                                      sum_value=s.remote.fetch_seconds_sum)
        if s.disk.capacity_bytes:
            yield from _families(_DISK, [((), s.disk)])


_T = TypeVar("_T")
# A metric and how to read its value from a stats object.
_Row = tuple[MetricSpec, Callable[[_T], float]]


def _declared(cls: type[_T]) -> list[_Row[_T]]:
    """The metrics the fields of `cls` declare (stats.py), each read from its field."""
    return [(spec, operator.attrgetter(name)) for name, spec in metrics_of(cls)]


def _families(table: list[_Row[_T]], rows: Sequence[tuple[Sequence[str], _T]],
              labels: Sequence[str] = ()) -> Iterator[Metric]:
    """A family per metric of `table`, with a sample per row (its label values, the object it reads)."""
    for spec, value in table:
        family: GaugeMetricFamily | CounterMetricFamily
        if spec.kind == "gauge":
            family = GaugeMetricFamily(spec.name, spec.doc, labels=labels)
        else:
            family = CounterMetricFamily(spec.name, spec.doc, labels=labels)
        for label_values, obj in rows:
            family.add_metric(label_values, value(obj))
        yield family


# What no single field holds (properties, a field's meaning, a sum) is declared here.
_DAEMON: list[_Row[Stats]] = [
    *_declared(Stats),
    (MetricSpec("gauge", "kvstore_hit_ratio", "Lookup hits / blocks looked up, since start: asked, not served "
                "(hits include blocks engines held themselves; served: kvstore_loaded_*)."), lambda s: s.hit_rate),
    (MetricSpec("counter", "kvstore_stored_bytes", "Bytes stored."), lambda s: s.stored_bytes),
]
_EVENTS: list[_Row[EventStats]] = _declared(EventStats)
_NAMESPACE: list[_Row[NamespaceStats]] = [
    *_declared(NamespaceStats),
    (MetricSpec("counter", "kvstore_namespace_loaded_tokens", "Served: tokens loaded into engines (0 when the "
                "namespace names no block size in tokens)."), lambda ns: ns.loaded_tokens),
]
_REMOTE: list[_Row[RemoteStats]] = [
    *_declared(RemoteStats),
    (MetricSpec("gauge", "kvstore_remote_breaker_open", "1 while the remote store is not asked (failing)."),
     lambda r: r.breaker != "closed"),
    (MetricSpec("counter", "kvstore_remote_dropped_blocks", "Blocks not uploaded: queue full, store failing, or the "
                "daemon stopping."), lambda r: r.dropped_full + r.dropped_unhealthy + r.dropped_closed),
]
_DISK: list[_Row[DiskStats]] = _declared(DiskStats)
