"""Stats as one typed object: in step with the .proto, through the wire and back, and `kvstore stats`
in an 80-column terminal (compact namespaces), with --wide and --json. What was served is what was
loaded into engines, never the lookup hits."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import typing
import urllib.request

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from support.engine import Engine, kvstore, store_blocks
from support.ports import free_port

from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_service.stats import (
    DiskStats,
    EventStats,
    NamespaceStats,
    RemoteStats,
    Stats,
    block_tokens,
    from_dict,
    from_proto,
    namespace_id,
    to_json_dict,
    to_proto,
)

KB64 = 64 * 1024
LONG_NAMESPACE = ("model=meta-llama/Llama-3.1-8B-Instruct;dtype=bfloat16;block=16;layers=32;kv_heads=8;head=128;"
                  "hash=sha256;page=NHC;kv_shards=4;salt=tenant-secret-4f1c")
OTHER_NAMESPACE = "an-engine-that-names-its-namespaces-with-one-very-long-string-and-no-key-value-pairs-0123"

# proto scalar type -> the annotation the dataclass field must carry
_SCALARS = {FD.TYPE_UINT64: int, FD.TYPE_UINT32: int, FD.TYPE_INT64: int, FD.TYPE_INT32: int, FD.TYPE_BOOL: bool,
            FD.TYPE_STRING: str, FD.TYPE_DOUBLE: float, FD.TYPE_FLOAT: float}


@pytest.mark.parametrize("cls, message", [(NamespaceStats, pb.NamespaceStats), (RemoteStats, pb.RemoteStats),
                                          (DiskStats, pb.DiskStats), (EventStats, pb.EventStats),
                                          (Stats, pb.StatsResponse)])
def test_dataclass_fields_are_the_proto_fields(cls: type, message: type) -> None:
    # A field added to the .proto (or to the dataclass) alone fails here.
    fields = dataclasses.fields(cls)
    descriptors = message.DESCRIPTOR.fields
    assert [f.name for f in fields] == [d.name for d in descriptors]
    hints = typing.get_type_hints(cls)
    for d in descriptors:
        if d.message_type is not None:
            nested = {"kvstore.v1.NamespaceStats": NamespaceStats, "kvstore.v1.RemoteStats": RemoteStats,
                      "kvstore.v1.DiskStats": DiskStats, "kvstore.v1.EventStats": EventStats}[d.message_type.full_name]
            assert hints[d.name] == (list[nested] if d.is_repeated else nested), d.name
        else:
            assert not d.is_repeated, d.name
            assert hints[d.name] is _SCALARS[d.type], d.name


def _sample(**overrides: typing.Any) -> Stats:
    """Every field a distinct value, so that a field read into the wrong place shows."""
    counter = iter(range(1, 1000))

    def fill(cls: type, **values: typing.Any) -> typing.Any:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name not in values:
                kind = hints[f.name]
                values[f.name] = (next(counter) * 1000 + 7 if kind is int else next(counter) + 0.5 if kind is float
                                  else next(counter) % 2 == 1 if kind is bool else f"{f.name}-{next(counter)}")
        return cls(**values)

    namespaces = [fill(NamespaceStats, namespace=LONG_NAMESPACE), fill(NamespaceStats, namespace="plain"),
                  fill(NamespaceStats, namespace="(recovered 0123456789ab)")]
    return fill(Stats, namespaces=namespaces, remote=fill(RemoteStats), disk=fill(DiskStats), events=fill(EventStats),
                **overrides)


def test_round_trip_through_the_proto() -> None:
    stats = _sample()
    msg = to_proto(stats)
    assert isinstance(msg, pb.StatsResponse)
    assert msg.namespaces[0].namespace == LONG_NAMESPACE and msg.daemon_version == stats.daemon_version
    assert from_proto(msg) == stats
    assert from_proto(pb.StatsResponse.FromString(msg.SerializeToString())) == stats
    assert from_proto(pb.StatsResponse()) == Stats(**{f.name: [] if f.name == "namespaces" else
                                                      "" if f.name == "daemon_version" else
                                                      RemoteStats() if f.name == "remote" else
                                                      DiskStats() if f.name == "disk" else
                                                      EventStats() if f.name == "events" else 0
                                                      for f in dataclasses.fields(Stats)})
    assert from_dict(json.loads(json.dumps(to_json_dict(stats)))) == stats


def test_derived_figures() -> None:
    stats = _sample(hits=3, misses=1, used_bytes=25, capacity_bytes=100)
    assert stats.hit_rate == 0.75 and stats.used_fraction == 0.25
    assert stats.stored_bytes == sum(ns.stored_blocks * ns.block_bytes for ns in stats.namespaces)
    # Tokens: whole blocks' bytes loaded x the block size the namespace names (block=16), else unknown (0).
    named, plain = stats.namespaces[0], stats.namespaces[1]
    assert named.block_tokens == 16 and named.loaded_tokens == named.loaded_bytes // named.block_bytes * 16
    assert plain.block_tokens == 0 and plain.loaded_tokens == 0 and stats.tokens_unknown
    assert not dataclasses.replace(stats, namespaces=[named]).tokens_unknown
    assert block_tokens("model=x;block=32;kv_shards=2") == 32 and block_tokens("model=x;block=;x") == 0
    row = to_json_dict(stats)["namespaces"][0]
    assert (row["block_tokens"], row["loaded_tokens"]) == (16, named.loaded_tokens)
    assert _sample(hits=0, misses=0, capacity_bytes=0).hit_rate == 0.0
    assert _sample(capacity_bytes=0).used_fraction == 0.0
    ns = stats.namespaces[0]
    assert ns.hit_rate == ns.hits / (ns.hits + ns.misses)
    assert ns.short_id == namespace_id(LONG_NAMESPACE) and len(ns.short_id) == 8
    one, two = "model=x;kv_shards=1", "model=x;kv_shards=2"
    assert namespace_id(one) == namespace_id(one) != namespace_id(two)
    assert to_json_dict(stats)["hit_rate"] == 0.75
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 1  # type: ignore[misc]


def text_of(stats: Stats, wide: bool = False) -> str:
    from rich.console import Console

    from kvstore_service.stats_view import render_stats

    console = Console(width=1 << 14 if wide else 80, record=True, file=io.StringIO())
    console.print(render_stats(stats, console.width, wide))
    return console.export_text()


def summary_of(text: str) -> list[str]:
    """The summary box's lines (the namespace table starts at its title)."""
    lines = text.splitlines()
    return lines[:next(i for i, line in enumerate(lines) if line.startswith("namespaces"))]


def test_wide_keeps_the_summary_within_80_columns() -> None:
    sample = _sample()
    stats = dataclasses.replace(sample, disk=dataclasses.replace(sample.disk, error="a long reason " * 12))
    wide = text_of(stats, wide=True)
    assert max(len(line.rstrip()) for line in summary_of(wide)) <= 80
    assert LONG_NAMESPACE in wide and max(len(line) for line in wide.splitlines()) > 80  # the table is wide
    assert summary_of(wide) == summary_of(text_of(stats))  # the same box as in an 80-column terminal


def test_served_comes_first_and_lookups_are_labelled_as_asked() -> None:
    text = text_of(_sample(loaded_blocks=12, loaded_bytes=3 << 20, loaded_tokens=192, hits=70, misses=30))
    lines = summary_of(text)
    served = next(i for i, line in enumerate(lines) if "served: loaded into engines" in line)
    asked = next(i for i, line in enumerate(lines) if "asked: lookup hits / misses" in line)
    assert served < asked
    assert "12 blocks, 3.0 MiB, 192 tokens" in lines[served]
    assert "70 / 30 blocks (70.0% of lookups" in lines[asked]
    assert "hit rate" not in text


def test_compact_table_fits_any_namespace_in_80_columns() -> None:
    admin_view = _sample()  # several tenants: a tenant column
    tenant_view = dataclasses.replace(admin_view, namespaces=[dataclasses.replace(ns, tenant="")
                                                              for ns in admin_view.namespaces])
    for text in (text_of(tenant_view), text_of(admin_view)):
        assert max(len(line) for line in text.splitlines()) <= 80
        assert " 4 " in text and namespace_id(LONG_NAMESPACE) in text
        assert "tenant-secret" not in text
    assert "Llama-3.1-8B-Instruct" in text_of(tenant_view) and "(recovered" in text_of(tenant_view)
    assert " tenant " not in text_of(tenant_view)
    assert " tenant " in text_of(admin_view) and "tenant-10" in text_of(admin_view)


def test_the_daemon_loads_only_the_protocol_of_the_client_and_no_torch() -> None:
    # `kvstore serve` (cli -> serve -> server -> daemon -> sessions, jobs, backends) imports only
    # kvstore_client.protocol of the client package, and no torch: the bench and test harness live outside the daemon.
    code = ("import sys, kvstore_service.cli, kvstore_service.serve, kvstore_service.backends.cpu; "
            "print(' '.join(m for m in sys.modules if m.startswith(('kvstore_client', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = out.stdout.split()
    assert "kvstore_client.protocol" in loaded
    assert [m for m in loaded if m != "kvstore_client" and not m.startswith("kvstore_client.protocol")] == []


def test_cli_stats_fits_80_columns(daemon: typing.Any) -> None:
    store_blocks(daemon.socket, LONG_NAMESPACE, 3)
    store_blocks(daemon.socket, OTHER_NAMESPACE, 2)
    out = kvstore("stats", "--socket", daemon.socket, env={"COLUMNS": "80"})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, out.stdout
    assert "served: loaded into engines" in out.stdout and "lookup hits" in out.stdout
    row = next(line for line in lines if namespace_id(LONG_NAMESPACE) in line)
    assert "Llama-3.1-8B-Instruct" in row and " 4 " in row and "tenant-secret" not in out.stdout
    row = next(line for line in lines if namespace_id(OTHER_NAMESPACE) in line)
    assert OTHER_NAMESPACE[:10] in row and "…" in row and OTHER_NAMESPACE not in row

    wide = kvstore("stats", "--wide", "--socket", daemon.socket, env={"COLUMNS": "80"})
    assert wide.returncode == 0, wide.stderr
    assert LONG_NAMESPACE in wide.stdout and OTHER_NAMESPACE in wide.stdout
    assert "evictions" in wide.stdout and "engines" in wide.stdout
    assert max(len(line.rstrip()) for line in summary_of(wide.stdout)) <= 80, wide.stdout

    out = kvstore("stats", "--json", "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    stats = from_dict(data)
    assert {ns.namespace for ns in stats.namespaces} == {LONG_NAMESPACE, OTHER_NAMESPACE}
    assert stats.blocks == 5 and stats.stored_blocks == 5 and data["hit_rate"] == stats.hit_rate


SERVED_NAMESPACE = "model=org/served;dtype=bfloat16;block=16;kv_shards=1"


def _served_figures(daemon: typing.Any, port: int) -> list[tuple[int, int, int]]:
    """(loaded blocks, bytes, tokens) of SERVED_NAMESPACE and in total, as the Stats RPC, `kvstore stats
    --json` and /metrics each report them."""
    rpc = from_proto(daemon.client().stats())
    out = kvstore("stats", "--json", "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    cli = from_dict(json.loads(out.stdout))
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = f'model="org/served",namespace_id="{namespace_id(SERVED_NAMESPACE)}",tenant=""'

    def metric(line: str) -> int:
        return int(float(next(x for x in text.splitlines() if x.startswith(line + " ")).split()[-1]))

    figures = []
    for stats in (rpc, cli):
        ns = next(n for n in stats.namespaces if n.namespace == SERVED_NAMESPACE)
        figures += [(ns.loaded_blocks, ns.loaded_bytes, ns.loaded_tokens),
                    (stats.loaded_blocks, stats.loaded_bytes, stats.loaded_tokens)]
    figures += [(metric(f"kvstore_loaded_blocks_total{{{labels}}}"),
                 metric(f"kvstore_namespace_loaded_bytes_total{{{labels}}}"),
                 metric(f"kvstore_namespace_loaded_tokens_total{{{labels}}}")),
                (rpc.loaded_blocks, metric("kvstore_loaded_bytes_total"), metric("kvstore_loaded_tokens_total"))]
    return figures


def _line(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if label in line)


def test_served_is_what_engines_loaded_not_what_lookups_found(daemon_factory: typing.Any) -> None:
    port = free_port()
    daemon = daemon_factory("--metrics-port", str(port)).start()
    keys = store_blocks(daemon.socket, SERVED_NAMESPACE, 6)
    client = daemon.client()
    # A lookup that finds every block (an engine holding them itself would stop here): nothing served.
    assert client.lookup(SERVED_NAMESPACE, keys) == 6
    assert _served_figures(daemon, port) == [(0, 0, 0)] * 6
    out = kvstore("stats", "--socket", daemon.socket, env={"COLUMNS": "80"})
    assert "0 blocks, 0 B, 0 tokens" in _line(out.stdout, "served: loaded into engines"), out.stdout
    assert "6 / 0 blocks (100.0% of lookups" in _line(out.stdout, "asked: lookup hits / misses")

    engine = Engine(daemon.socket, SERVED_NAMESPACE, 16, KB64)
    job = engine.session.load(keys[:4], [0, 1, 2, 3])
    assert engine.session.wait([job])[job].ok
    assert engine.verify(keys[:4], [0, 1, 2, 3]) == 0  # (blocks that differ)
    engine.close()
    assert _served_figures(daemon, port) == [(4, 4 * KB64, 4 * 16)] * 6
    out = kvstore("stats", "--socket", daemon.socket, env={"COLUMNS": "80"})
    assert "4 blocks, 256.0 KiB, 64 tokens" in _line(out.stdout, "served: loaded into engines"), out.stdout


def test_blocks_of_a_namespace_without_a_block_size_are_served_in_blocks_and_bytes(daemon: typing.Any) -> None:
    keys = store_blocks(daemon.socket, "no-block-size", 2)
    engine = Engine(daemon.socket, "no-block-size", 16, KB64)
    job = engine.session.load(keys, [5, 6])
    assert engine.session.wait([job])[job].ok
    engine.close()
    out = kvstore("stats", "--socket", daemon.socket, env={"COLUMNS": "80"})
    served = _line(out.stdout, "served: loaded into engines")
    assert "2 blocks, 128.0 KiB, tokens unknown" in served and "block=N)" in out.stdout, out.stdout
    stats = from_dict(json.loads(kvstore("stats", "--json", "--socket", daemon.socket).stdout))
    assert (stats.loaded_blocks, stats.loaded_bytes, stats.loaded_tokens) == (2, 2 * KB64, 0)
