"""Stats as one typed object: in step with the .proto, through the wire and back, and `kvstore stats`
in an 80-column terminal (compact namespaces), with --wide and --json."""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import typing

import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from support.engine import kvstore, store_blocks

from kvstore_client.protocol import kvstore_pb2 as pb
from kvstore_service.stats import (
    DiskStats,
    NamespaceStats,
    RemoteStats,
    Stats,
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
                                          (DiskStats, pb.DiskStats), (Stats, pb.StatsResponse)])
def test_dataclass_fields_are_the_proto_fields(cls: type, message: type) -> None:
    # A field added to the .proto (or to the dataclass) alone fails here.
    fields = dataclasses.fields(cls)
    descriptors = message.DESCRIPTOR.fields
    assert [f.name for f in fields] == [d.name for d in descriptors]
    hints = typing.get_type_hints(cls)
    for d in descriptors:
        if d.message_type is not None:
            nested = {"kvstore.v1.NamespaceStats": NamespaceStats, "kvstore.v1.RemoteStats": RemoteStats,
                      "kvstore.v1.DiskStats": DiskStats}[d.message_type.full_name]
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
    return fill(Stats, namespaces=namespaces, remote=fill(RemoteStats), disk=fill(DiskStats), **overrides)


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
                                                      DiskStats() if f.name == "disk" else 0
                                                      for f in dataclasses.fields(Stats)})
    assert from_dict(json.loads(json.dumps(to_json_dict(stats)))) == stats


def test_derived_figures() -> None:
    stats = _sample(hits=3, misses=1, used_bytes=25, capacity_bytes=100)
    assert stats.hit_rate == 0.75 and stats.used_fraction == 0.25
    assert stats.stored_bytes == sum(ns.stored_blocks * ns.block_bytes for ns in stats.namespaces)
    assert stats.loaded_bytes == sum(ns.loaded_blocks * ns.block_bytes for ns in stats.namespaces)
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


def text_of(stats: Stats) -> str:
    from rich.console import Console

    from kvstore_service.cli import _render_stats

    console = Console(width=80, record=True, file=io.StringIO())
    console.print(_render_stats(stats, console.width))
    return console.export_text()


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
    # `kvstore serve` (cli -> daemon -> server, sessions, jobs, backends) imports only kvstore_client.protocol
    # of the client package, and no torch: the bench and test harness live outside the daemon.
    code = ("import sys, kvstore_service.cli, kvstore_service.daemon, kvstore_service.backends.cpu; "
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
    assert "hit rate" in out.stdout
    row = next(line for line in lines if namespace_id(LONG_NAMESPACE) in line)
    assert "Llama-3.1-8B-Instruct" in row and " 4 " in row and "tenant-secret" not in out.stdout
    row = next(line for line in lines if namespace_id(OTHER_NAMESPACE) in line)
    assert OTHER_NAMESPACE[:10] in row and "…" in row and OTHER_NAMESPACE not in row

    wide = kvstore("stats", "--wide", "--socket", daemon.socket, env={"COLUMNS": "80"})
    assert wide.returncode == 0, wide.stderr
    assert LONG_NAMESPACE in wide.stdout and OTHER_NAMESPACE in wide.stdout
    assert "evictions" in wide.stdout and "engines" in wide.stdout

    out = kvstore("stats", "--json", "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    stats = from_dict(data)
    assert {ns.namespace for ns in stats.namespaces} == {LONG_NAMESPACE, OTHER_NAMESPACE}
    assert stats.blocks == 5 and stats.stored_blocks == 5 and data["hit_rate"] == stats.hit_rate
