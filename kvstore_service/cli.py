"""The `kvstore` command: serve, stats, lookup, health, clear, bench."""

from __future__ import annotations

import json
import sys
import time
import typing
from typing import Any

import click
from google.protobuf.json_format import MessageToDict
from pydantic import ValidationError

from kvstore_client import KVStoreClient, KVStoreError, Unavailable
from kvstore_client.client import default_socket
from kvstore_service.config import Config

EXIT_UNREACHABLE = 3

socket_option = click.option(
    "--socket", envvar="KVSTORE_SOCKET", default=default_socket,
    show_default="$KVSTORE_SOCKET or /tmp/kvstore/kvstore.sock",
    help="Daemon socket path (or a gRPC target such as dns:host:port).")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """kvstore: a per-node sidecar that keeps LLM KV-cache blocks in a shared CPU memory pool."""


def _config_options(func: Any) -> Any:
    """One flag per Config field; unset flags fall back to KVSTORE_* env vars, then --config."""
    hints = typing.get_type_hints(Config)
    for name, field in reversed(list(Config.model_fields.items())):
        flag = "--" + name.replace("_", "-")
        default = field.get_default(call_default_factory=True)
        help_text = f"{field.description} [env KVSTORE_{name.upper()}; default {default}]"
        hint = hints[name]
        if hint is bool:
            func = click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)(func)
        elif typing.get_origin(hint) is list:
            func = click.option(flag, name, multiple=True, type=int, help=help_text)(func)
        else:
            func = click.option(flag, name, default=None, help=help_text)(func)
    return func


@main.command()
@click.option("--config", "config_file", envvar="KVSTORE_CONFIG", type=click.Path(exists=True, dir_okay=False),
              help="YAML file with any of the settings below (snake_case keys).")
@_config_options
def serve(config_file: str | None, **flags: Any) -> None:
    """Run the daemon (flags > KVSTORE_* environment > --config YAML > defaults)."""
    overrides = {k: v for k, v in flags.items() if v is not None and v != ()}
    try:
        config = Config.load(config_file, **overrides)
    except (ValidationError, ValueError) as e:
        raise click.UsageError(f"bad configuration: {e}") from None
    from kvstore_service.server import run

    run(config)


def _client(socket: str) -> KVStoreClient:
    return KVStoreClient(socket, timeout=5.0)


def _fail_unreachable(socket: str, error: Exception) -> None:
    click.echo(f"kvstore: cannot reach the daemon at {socket}: {error}\n"
               "Is `kvstore serve` running? Set --socket or KVSTORE_SOCKET.", err=True)
    sys.exit(EXIT_UNREACHABLE)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def stats_dict(client: KVStoreClient) -> dict[str, Any]:
    reply = client.stats()
    data = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for key, value in list(data.items()):  # uint64 fields arrive as strings in proto JSON
        if isinstance(value, str) and value.isdigit():
            data[key] = int(value)
    for ns in data.get("namespaces", []):
        for key, value in list(ns.items()):
            if isinstance(value, str) and value.isdigit():
                ns[key] = int(value)
    lookups = data["hits"] + data["misses"]
    data["hit_rate"] = data["hits"] / lookups if lookups else 0.0
    return data


def _render_stats(data: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table

    summary = Table(title="kvstore", show_header=False)
    used = data["used_bytes"] / data["capacity_bytes"] if data["capacity_bytes"] else 0
    rows = [
        ("pool", f"{_human(data['used_bytes'])} / {_human(data['capacity_bytes'])} ({used:.0%})"),
        ("blocks", str(data["blocks"])),
        ("hits / misses", f"{data['hits']} / {data['misses']} ({data['hit_rate']:.1%} hit rate)"),
        ("stored / loaded blocks", f"{data['stored_blocks']} / {data['loaded_blocks']}"),
        ("evictions", str(data["evictions"])),
        ("engines / leases / jobs in flight", f"{data['engines']} / {data['leases']} / {data['jobs_in_flight']}"),
        ("failed blocks / corrupt", f"{data['failed_blocks']} / {data['corrupt_blocks']}"),
        ("uptime", f"{data['uptime_s']} s (daemon {data['daemon_version']})"),
    ]
    for k, v in rows:
        summary.add_row(k, v)
    per_ns = Table(title="namespaces")
    for column in ("namespace", "blocks", "used", "block size", "hits", "misses", "stored", "loaded",
                   "evictions", "engines"):
        per_ns.add_column(column, justify="left" if column == "namespace" else "right",
                          no_wrap=column == "namespace")
    for ns in data.get("namespaces", []):
        per_ns.add_row(ns["namespace"], str(ns["blocks"]), _human(ns["used_bytes"]), _human(ns["block_bytes"]),
                       str(ns["hits"]), str(ns["misses"]), str(ns["stored_blocks"]), str(ns["loaded_blocks"]),
                       str(ns["evictions"]), str(ns["engines"]))
    return Group(summary, per_ns)


@main.command()
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Refresh every SECONDS.")
def stats(socket: str, as_json: bool, watch: float | None) -> None:
    """Pool use, hits, stores and loads: total and per namespace."""
    client = _client(socket)
    try:
        if watch is None:
            data = stats_dict(client)
            if as_json:
                click.echo(json.dumps(data))
            else:
                from rich.console import Console

                Console().print(_render_stats(data))
            return
        from rich.live import Live

        with Live(_render_stats(stats_dict(client)), refresh_per_second=4) as live:
            while True:
                time.sleep(watch)
                data = stats_dict(client)
                if as_json:
                    click.echo(json.dumps(data))
                else:
                    live.update(_render_stats(data))
    except Unavailable as e:
        _fail_unreachable(socket, e)
    except KeyboardInterrupt:
        pass


@main.command()
@socket_option
@click.option("--namespace", "-n", required=True, help="Namespace to look in.")
@click.argument("keys", nargs=-1, required=True)
def lookup(socket: str, namespace: str, keys: tuple[str, ...]) -> None:
    """How many of KEYS (hex, in order) are present as a leading run."""
    try:
        raw = [bytes.fromhex(k) for k in keys]
    except ValueError as e:
        raise click.BadParameter(f"keys must be hex: {e}") from None
    try:
        hits = _client(socket).lookup(namespace, raw)
    except Unavailable as e:
        _fail_unreachable(socket, e)
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{hits} of {len(raw)} leading keys present")


@main.command()
@socket_option
def health(socket: str) -> None:
    """Exit 0 when the daemon is SERVING (for probes); non-zero otherwise."""
    try:
        status = _client(socket).health()
    except Unavailable as e:
        _fail_unreachable(socket, e)
    click.echo(status)
    if status != "SERVING":
        sys.exit(1)


@main.command()
@socket_option
@click.option("--namespace", "-n", default="", help="Only this namespace (default: all).")
def clear(socket: str, namespace: str) -> None:
    """Drop the cached blocks (pinned blocks stay)."""
    try:
        n = _client(socket).clear(namespace)
    except Unavailable as e:
        _fail_unreachable(socket, e)
    click.echo(f"cleared {n} blocks")


@main.command()
@socket_option
@click.option("--blocks", default=2048, show_default=True, help="Blocks per job.")
@click.option("--block-size", default="256KiB", show_default=True, help="Bytes per block.")
@click.option("--rounds", default=5, show_default=True, help="Store and load rounds (best is reported).")
@click.option("--backend", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True)
@click.option("--spawn/--no-spawn", default=True, show_default=True,
              help="Start a private daemon for the run (else use the one at --socket).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Also write the results here.")
def bench(socket: str, blocks: int, block_size: str, rounds: int, backend: str, spawn: bool,
          json_file: str | None) -> None:
    """Measure store/load GB/s against one contiguous memcpy, RPC floor, lookup, poll and submit costs."""
    from pydantic import ByteSize, TypeAdapter

    from kvstore_client.bench import run_bench

    size = int(TypeAdapter(ByteSize).validate_python(block_size))
    results = run_bench(socket=None if spawn else socket, blocks=blocks, block_bytes=size, rounds=rounds,
                        backend=backend)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvstore bench ({blocks} blocks x {_human(size)}, backend {backend})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in results.items():
        table.add_row(k, f"{v:.2f}" if isinstance(v, float) else str(v))
    Console().print(table)
    if json_file:
        with open(json_file, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
