"""The `kvstore` command: serve, stats, lookup, health, clear, bench.

The daemon process loads this module (`kvstore serve`), so of the client package it imports only
`kvstore_client.protocol` at module level; the client commands load the client library in `_daemon`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import typing
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import annotated_types
import click
from pydantic import ByteSize, TypeAdapter, ValidationError

from kvstore_client.protocol import default_socket
from kvstore_service.config import Config, ConfigError
from kvstore_service.stats_view import human_bytes, render_stats

if TYPE_CHECKING:
    from rich.console import Console

    from kvstore_client import KVStoreClient
    from kvstore_service.stats import Stats

EXIT_UNREACHABLE = 3

socket_option = click.option(
    "--socket", envvar="KVSTORE_SOCKET", default=default_socket,
    show_default="$KVSTORE_SOCKET or /tmp/kvstore/kvstore.sock",
    help="Daemon socket path (or a gRPC target such as dns:host:port).")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """kvstore: a per-node sidecar that keeps LLM KV-cache blocks in a shared CPU memory pool."""


class SizeType(click.ParamType):
    """A size in bytes: 4GiB, 512MiB, 1000000 (pydantic's ByteSize)."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return int(TypeAdapter(ByteSize).validate_python(value))
        except ValidationError:
            self.fail(f"{value!r} is not a size (e.g. 4GiB, 512MiB, 65536)", param, ctx)


SIZE = SizeType()


def size_text(n: int) -> str:
    """A size as its largest whole binary unit: 1GiB, 64MiB, 1000 (bytes)."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _number_type(hint: type, metadata: list[Any]) -> click.ParamType:
    """INTEGER or FLOAT, a range when the field has bounds (ge/gt/le/lt)."""
    bounds: dict[str, Any] = {}
    for rule in metadata:
        if isinstance(rule, annotated_types.Ge):
            bounds["min"] = rule.ge
        elif isinstance(rule, annotated_types.Gt):
            bounds.update(min=rule.gt, min_open=True)
        elif isinstance(rule, annotated_types.Le):
            bounds["max"] = rule.le
        elif isinstance(rule, annotated_types.Lt):
            bounds.update(max=rule.lt, max_open=True)
    if hint is int:
        return click.IntRange(**bounds) if bounds else click.INT
    return click.FloatRange(**bounds) if bounds else click.FLOAT


def _option_type(hint: Any, metadata: list[Any]) -> click.ParamType | None:
    if hint is ByteSize:
        return SIZE
    if hint in (int, float):
        return _number_type(hint, metadata)
    if typing.get_origin(hint) is typing.Literal:
        return click.Choice(typing.get_args(hint))
    return None  # TEXT


def _default_text(hint: Any, default: Any) -> str:
    if hint is ByteSize:
        return size_text(int(default))
    return "none" if default in ("", [], {}) else str(default)


def _config_options(func: Any) -> Any:
    """One typed flag per Config field; unset flags fall back to KVSTORE_* env vars, then --config."""
    hints = typing.get_type_hints(Config)
    for name, field in reversed(list(Config.model_fields.items())):
        flag = "--" + name.replace("_", "-")
        hint = hints[name]
        default = _default_text(hint, field.get_default(call_default_factory=True))
        help_text = f"{field.description} [env KVSTORE_{name.upper()}; default {default}]"
        if hint is bool:
            func = click.option(f"{flag}/--no-{flag[2:]}", name, default=None, help=help_text)(func)
        elif typing.get_origin(hint) is dict:
            func = click.option(flag, name, default=None, type=_json_or_yaml, metavar="YAML", help=help_text)(func)
        elif typing.get_origin(hint) is list:
            func = click.option(flag, name, multiple=True, type=typing.get_args(hint)[0], help=help_text)(func)
        else:
            func = click.option(flag, name, default=None, type=_option_type(hint, field.metadata),
                                help=help_text)(func)
    return func


def _json_or_yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)  # (JSON is YAML)
    except yaml.YAMLError as e:
        raise click.BadParameter(f"not valid YAML or JSON: {getattr(e, 'problem', e)}") from None


@main.command()
@click.option("--config", "config_file", envvar="KVSTORE_CONFIG", type=click.Path(exists=True, dir_okay=False),
              help="YAML file with any of the settings below (snake_case keys).")
@_config_options
def serve(config_file: str | None, **flags: Any) -> None:
    """Run the daemon (flags > KVSTORE_* environment > --config YAML > defaults). Sizes take units
    (4GiB, 512MiB); in the environment, lists and mappings are JSON. A bad value is refused naming its
    flag, variable or file key (exit 2)."""
    overrides = {k: v for k, v in flags.items() if v is not None and v != ()}
    try:
        config = Config.load(config_file, **overrides)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    from kvstore_service.serve import run

    run(config)


@contextlib.contextmanager
def _daemon(socket: str) -> Iterator[KVStoreClient]:
    """A client of the daemon at `socket`, for one command. Cannot reach it: say so and exit 3;
    a request refused: a usage-style error (exit 1) with the daemon's reason."""
    from kvstore_client import KVStoreClient, KVStoreError, Unavailable

    client = KVStoreClient(socket, timeout=5.0)
    try:
        yield client
    except Unavailable as e:
        click.echo(f"kvstore: cannot reach the daemon at {socket}: {e}\n"
                   "Is `kvstore serve` running? Set --socket or KVSTORE_SOCKET.", err=True)
        sys.exit(EXIT_UNREACHABLE)
    except KVStoreError as e:
        raise click.ClickException(str(e)) from None
    finally:
        client.close()


def fetch_stats(client: KVStoreClient) -> Stats:
    from kvstore_service.stats import from_proto

    return from_proto(client.stats())


def _console(wide: bool) -> Console:
    from rich.console import Console

    # --wide: lines as long as the full namespace strings make them, not cut to the terminal.
    return Console(width=1 << 14) if wide else Console()


@main.command()
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (one a line with --watch).")
@click.option("--wide", is_flag=True, help="Full namespace strings and every per-namespace figure (the summary "
              "stays within 80 columns).")
@click.option("--watch", type=float, default=None, metavar="SECONDS", help="Refresh every SECONDS.")
def stats(socket: str, as_json: bool, wide: bool, watch: float | None) -> None:
    """What was served (blocks, bytes and tokens loaded into engines), stored, the pool, then what was
    asked (lookup hits and misses: not served, hits include blocks the engines held themselves); in
    total and per namespace (by model, TP shards and a short id; --wide for their full strings).
    Tokens: whole blocks loaded x the block size the namespace names (block=N); unknown otherwise."""
    from kvstore_service.stats import to_json_dict

    with _daemon(socket) as client:
        try:
            if as_json:
                while True:
                    click.echo(json.dumps(to_json_dict(fetch_stats(client))))
                    if watch is None:
                        return
                    time.sleep(watch)
            console = _console(wide)
            if watch is None:
                console.print(render_stats(fetch_stats(client), console.width, wide))
                return
            from rich.live import Live

            with Live(render_stats(fetch_stats(client), console.width, wide), console=console,
                      refresh_per_second=4) as live:
                while True:
                    time.sleep(watch)
                    live.update(render_stats(fetch_stats(client), console.width, wide))
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
    with _daemon(socket) as client:
        hits = client.lookup(namespace, raw)
    click.echo(f"{hits} of {len(raw)} leading keys present")


@main.command()
@socket_option
def health(socket: str) -> None:
    """Exit 0 when the daemon is SERVING (for probes); non-zero otherwise."""
    with _daemon(socket) as client:
        status = client.health()
    click.echo(status)
    if status != "SERVING":
        sys.exit(1)


@main.command()
@socket_option
@click.option("--namespace", "-n", default="", help="The namespace to clear.")
@click.option("--all", "everything", is_flag=True, help="Every namespace (needed to clear without -n).")
@click.option("--tenant", default="", help="Admins: the tenant to clear in (default with --all: every tenant; "
              "with --namespace: the admin's own).")
def clear(socket: str, namespace: str, everything: bool, tenant: str) -> None:
    """Drop your tenant's cached blocks of one namespace (-n NS), or of all of them (--all), from this
    node's pool and disk tier; pinned blocks stay. The shared remote store is not cleared: this node and
    every other one can still fetch its values. Without -n or --all nothing is cleared (exit 2)."""
    if not namespace and not everything:
        raise click.UsageError("name what to clear: -n NAMESPACE for one namespace, or --all for every namespace")
    if namespace and everything:
        raise click.UsageError("-n and --all exclude each other: -n clears one namespace, --all every one")
    with _daemon(socket) as client:
        n = client.clear(namespace, tenant)
    click.echo(f"cleared {n} blocks")


@main.command()
@socket_option
@click.option("--blocks", default=2048, show_default=True, help="Blocks per job.")
@click.option("--block-size", default="256KiB", show_default=True, help="Bytes per block.")
@click.option("--rounds", default=5, show_default=True,
              help="Rounds of each measure, each paired with the limit copied around it: the medians of the "
                   "paired ratios are reported.")
@click.option("--backend", type=click.Choice(["cpu", "cuda", "npu"]), default="cpu", show_default=True)
@click.option("--spawn/--no-spawn", default=True, show_default=True,
              help="Start a private daemon for the run (else use the one at --socket).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Also write the results here.")
def bench(socket: str, blocks: int, block_size: str, rounds: int, backend: str, spawn: bool,
          json_file: str | None) -> None:
    """Measure store/load GB/s against one contiguous copy, a small and a 2048-token hit against their copies,
    the RPC floor, lookup, poll and submit costs."""
    from pydantic import ByteSize, TypeAdapter

    from kvstore_service.bench import DeviceUnavailable, run_bench

    size = int(TypeAdapter(ByteSize).validate_python(block_size))
    try:
        results = run_bench(socket=None if spawn else socket, blocks=blocks, block_bytes=size, rounds=rounds,
                            backend=backend)
    except DeviceUnavailable as e:
        raise click.ClickException(str(e)) from None
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvstore bench ({blocks} blocks x {human_bytes(size)}, backend {backend})")
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
