"""Prometheus metrics (pool, blocks served and stored, lookups, copies, job latency, evictions,
errors, engines) and a health check over HTTP, both on --metrics-host:--metrics-port.

Neither asks who calls: they listen on loopback unless told otherwise (the Helm chart gives the pod
IP). Per-namespace series name each namespace's tenant and model (never the namespace string); with
--no-metrics-namespaces there are none, only daemon-wide figures.

Counters the core already keeps are read at scrape time (a snapshot taken on the event loop, which
owns them); only job latencies and gRPC errors are recorded as they happen.

`GET /healthz` answers what the gRPC health service on the daemon's socket answers, by asking it:
200 "SERVING", else 503 with the status (NOT_SERVING while the pool is set up and while the daemon
shuts down; UNREACHABLE when gRPC does not answer, e.g. a stuck event loop). Probes need no
interpreter for it (Kubernetes httpGet).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvstore_service.stats import DiskStats, NamespaceStats, RemoteStats, Stats

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
        yield GaugeMetricFamily("kvstore_pool_capacity_bytes", "Pool capacity.", value=s.capacity_bytes)
        yield GaugeMetricFamily("kvstore_pool_used_bytes", "Pool bytes holding blocks.", value=s.used_bytes)
        yield GaugeMetricFamily("kvstore_engines", "Engines connected.", value=s.engines)
        yield GaugeMetricFamily("kvstore_leases", "Lookup leases held.", value=s.leases)
        yield GaugeMetricFamily("kvstore_jobs_in_flight", "Copy jobs not finished.", value=s.jobs_in_flight)
        yield GaugeMetricFamily("kvstore_unsealed_blocks", "Stored blocks waiting for their checksum.",
                                value=s.unsealed_blocks)
        yield GaugeMetricFamily("kvstore_hit_ratio", "Lookup hits / blocks looked up, since start: asked, not "
                                "served (hits include blocks engines held themselves; served: kvstore_loaded_*).",
                                value=s.hit_rate)
        yield CounterMetricFamily("kvstore_failed_blocks", "Blocks whose job failed.", value=s.failed_blocks)
        yield CounterMetricFamily("kvstore_failed_load_blocks", "Blocks whose load failed (engines recompute them).",
                                  value=s.failed_load_blocks)
        yield CounterMetricFamily("kvstore_store_failures_pool_full", "Stores refused because no slot could be freed.",
                                  value=s.store_failures_pool_full)
        yield CounterMetricFamily("kvstore_lease_expiries", "Leases that expired before release.",
                                  value=s.lease_expiries)
        yield CounterMetricFamily("kvstore_corrupt_blocks", "Blocks dropped after a checksum mismatch (at a load, "
                                  "or when verifying recovered blocks after a restart).", value=s.corrupt_blocks)
        yield GaugeMetricFamily("kvstore_unverified_blocks", "Blocks recovered from the pool after a restart, not "
                                "yet checked against their checksums (lookups miss them until then).",
                                value=s.unverified_blocks)
        per_ns: list[tuple[GaugeMetricFamily | CounterMetricFamily, Callable[[NamespaceStats], int]]] = [
            (GaugeMetricFamily("kvstore_blocks", "Blocks in the pool.", labels=NAMESPACE_LABELS),
             lambda ns: ns.blocks),
            (GaugeMetricFamily("kvstore_namespace_used_bytes", "Pool bytes per namespace.", labels=NAMESPACE_LABELS),
             lambda ns: ns.used_bytes),
            (CounterMetricFamily("kvstore_lookup_hits", "Looked-up blocks found (asked, not served: see "
                                 "kvstore_loaded_blocks).", labels=NAMESPACE_LABELS),
             lambda ns: ns.hits),
            (CounterMetricFamily("kvstore_lookup_misses", "Looked-up blocks missing.", labels=NAMESPACE_LABELS),
             lambda ns: ns.misses),
            (CounterMetricFamily("kvstore_stored_blocks", "Blocks stored.", labels=NAMESPACE_LABELS),
             lambda ns: ns.stored_blocks),
            (CounterMetricFamily("kvstore_loaded_blocks", "Served: block loads into engines (TP: one per shard's "
                                 "part).", labels=NAMESPACE_LABELS),
             lambda ns: ns.loaded_blocks),
            (CounterMetricFamily("kvstore_namespace_loaded_bytes", "Served: bytes loaded into engines.",
                                 labels=NAMESPACE_LABELS),
             lambda ns: ns.loaded_bytes),
            (CounterMetricFamily("kvstore_namespace_loaded_tokens", "Served: tokens loaded into engines (0 when the "
                                 "namespace names no block size in tokens).", labels=NAMESPACE_LABELS),
             lambda ns: ns.loaded_tokens),
            (CounterMetricFamily("kvstore_evictions", "Blocks evicted (LRU).", labels=NAMESPACE_LABELS),
             lambda ns: ns.evictions),
        ]
        if self.per_namespace:
            for ns in s.namespaces:
                labels = [ns.tenant, model_of(ns.namespace), ns.short_id]
                for family, value in per_ns:
                    family.add_metric(labels, value(ns))
            yield from (family for family, _ in per_ns)
        yield CounterMetricFamily("kvstore_stored_bytes", "Bytes stored.", value=s.stored_bytes)
        yield CounterMetricFamily("kvstore_loaded_bytes", "Served: bytes loaded into engines.", value=s.loaded_bytes)
        yield CounterMetricFamily("kvstore_loaded_tokens", "Served: tokens loaded into engines, of the namespaces "
                                  "that name their block size in tokens.", value=s.loaded_tokens)
        yield CounterMetricFamily("kvstore_events_sent", "Block events streamed to engines (routers' KV events).",
                                  value=s.events.sent)
        yield CounterMetricFamily("kvstore_events_resyncs", "Engines' event streams reset after falling "
                                  "--max-event-queue events behind.", value=s.events.resyncs)
        yield CounterMetricFamily("kvstore_events_dropped", "Block descriptions not kept (over --max-event-bytes "
                                  "or --max-event-description-bytes).", value=s.events.dropped)
        yield GaugeMetricFamily("kvstore_event_bytes", "Bytes of block descriptions held.", value=s.events.bytes)
        if s.remote.url:
            yield from _remote_metrics(s.remote)
        if s.disk.capacity_bytes:
            yield from _disk_metrics(s.disk)


def _disk_metrics(d: DiskStats) -> Iterator[Metric]:
    yield GaugeMetricFamily("kvstore_disk_healthy", "0 once an I/O error, a full disk or a missing directory "
                            "disabled the disk tier (the pool keeps serving).", value=float(d.healthy))
    yield GaugeMetricFamily("kvstore_disk_blocks", "Blocks on disk.", value=d.blocks)
    yield GaugeMetricFamily("kvstore_disk_used_bytes", "Disk space the segment files take.", value=d.bytes)
    yield GaugeMetricFamily("kvstore_disk_capacity_bytes", "--disk-size, in whole segments.", value=d.capacity_bytes)
    for name, doc, value in (
            ("hits", "Looked-up blocks found on disk.", d.hits),
            ("read_blocks", "Blocks read back into the pool and verified.", d.read_blocks),
            ("read_bytes", "Bytes read back into the pool.", d.read_bytes),
            ("written_blocks", "Blocks written to disk.", d.written),
            ("write_bytes", "Bytes written to disk.", d.write_bytes),
            ("write_dropped_blocks", "Blocks not written: queue full, no space, tier disabled, evicted before their "
             "seal.", d.write_dropped),
            ("corrupt_blocks", "Records that failed verification at a read (dropped).", d.corrupt),
            ("errors", "Failed disk I/O calls.", d.errors)):
        yield CounterMetricFamily(f"kvstore_disk_{name}", doc, value=value)


def _remote_metrics(r: RemoteStats) -> Iterator[Metric]:
    yield GaugeMetricFamily("kvstore_remote_breaker_open", "1 while the remote store is not asked (failing).",
                            value=float(r.breaker != "closed"))
    yield GaugeMetricFamily("kvstore_remote_queued_bytes", "Bytes waiting for their upload.", value=r.queued_bytes)
    yield GaugeMetricFamily("kvstore_remote_queued_blocks", "Blocks waiting for their upload.", value=r.queued_blocks)
    for name, doc, value in (
            ("hits", "Blocks fetched from the remote store and verified.", r.hits),
            ("misses", "Blocks asked of the remote store and not found (or failed).", r.misses),
            ("uploaded_blocks", "Blocks uploaded.", r.uploaded),
            ("bytes_up", "Bytes uploaded.", r.bytes_up),
            ("bytes_down", "Bytes fetched.", r.bytes_down),
            ("dropped_blocks", "Blocks not uploaded: queue full, store failing, or the daemon stopping.",
             r.dropped_full + r.dropped_unhealthy + r.dropped_closed),
            ("errors", "Keys whose call to the remote store failed (timeouts included).", r.errors),
            ("corrupt_blocks", "Fetched values that failed verification (deleted).", r.corrupt)):
        yield CounterMetricFamily(f"kvstore_remote_{name}", doc, value=value)
    yield SummaryMetricFamily("kvstore_remote_fetch_seconds", "Time of the lookups' fetches from the remote store.",
                              count_value=r.fetch_seconds_count, sum_value=r.fetch_seconds_sum)
