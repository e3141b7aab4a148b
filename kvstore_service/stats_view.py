"""What `kvstore stats` prints: the summary (served, stored, the pool, the tiers, what was asked) and a
table per namespace, sized to the terminal (rich, imported when drawn: the daemon loads the CLI too)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import RenderableType
    from rich.table import Table

    from kvstore_service.stats import NamespaceStats, Stats


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _count(n: int) -> str:
    """At most 6 characters: 9999, 12.3k, 4.6M, 7.9G, 1.2T."""
    if n < 10_000:
        return str(n)
    value = float(n)
    for unit in ("k", "M", "G", "T"):
        value /= 1000
        if value < 999.95 or unit == "T":
            return f"{value:.1f}{unit}" if value < 99.95 else f"{value:.0f}{unit}"
    return str(n)


def _percent(ns: NamespaceStats | Stats) -> str:
    return f"{ns.hit_rate:.1%}" if ns.hits + ns.misses else "-"


def _tokens(ns: NamespaceStats) -> str:
    return _count(ns.loaded_tokens) if ns.block_tokens else "-"


def _compact_namespace(name: str) -> tuple[str, str]:
    """(what to show for it, TP shards) of a namespace string, never its salt. The vLLM connector's
    `model=ORG/NAME;dtype=...;kv_shards=N[;salt=...]`: (NAME, N); other `key=value;...` strings:
    their parts but the salt; any other string: itself (the table cuts it short with an ellipsis)."""
    fields: dict[str, str] = {}
    for part in name.split(";"):
        key, sep, value = part.partition("=")
        if not sep or not key:
            return name, "-"
        fields[key] = value
    model = fields.get("model", "").rstrip("/")
    if model:
        return model.rsplit("/", 1)[-1], fields.get("kv_shards", "-")
    return ";".join(f"{k}={v}" for k, v in fields.items() if k != "salt"), fields.get("kv_shards", "-")


def _namespace_table(stats: Stats, width: int | None) -> Table:
    """One row per namespace, what it was served first. In `width` columns: short id, model, TP shards
    and the main figures; width None (--wide): the full namespace string and every figure in full."""
    from rich.table import Table

    if width is None:
        headers: tuple[str, ...] = ("id", "namespace", "loaded blocks", "loaded bytes", "loaded tokens", "stored",
                                    "blocks", "used bytes", "block bytes", "block tokens", "lookup hits",
                                    "lookup misses", "lookup hit%", "evictions", "engines")
        rows = [(ns.short_id, ns.namespace, str(ns.loaded_blocks), str(ns.loaded_bytes),
                 str(ns.loaded_tokens) if ns.block_tokens else "-",
                 *map(str, (ns.stored_blocks, ns.blocks, ns.used_bytes, ns.block_bytes, ns.block_tokens or "-",
                            ns.hits, ns.misses)),
                 _percent(ns), str(ns.evictions), str(ns.engines)) for ns in stats.namespaces]
        left, room, caption = 2, None, None
    else:
        headers = ("id", "namespace", "tp", "loaded", "tokens", "stored", "used", "hit%")
        rows = [(ns.short_id, *_compact_namespace(ns.namespace), _count(ns.loaded_blocks), _tokens(ns),
                 _count(ns.stored_blocks), human_bytes(ns.used_bytes), _percent(ns)) for ns in stats.namespaces]
        widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
        # No box: two spaces between columns; the namespace column gets what the others leave.
        room = max(len(headers[1]), width - (sum(widths) - widths[1]) - 2 * (len(headers) - 1))
        left, caption = 3, ("loaded, tokens: served; hit%: of lookups (asked); tp: TP shards\n"
                            "full namespace strings: kvstore stats --wide")
    name_col = 1
    if any(ns.tenant for ns in stats.namespaces):  # (an admin's view of several tenants)
        headers = (headers[0], "tenant", *headers[1:])
        rows = [(row[0], ns.tenant, *row[1:]) for row, ns in zip(rows, stats.namespaces, strict=True)]
        left, name_col = left + 1, 2
        if room is not None:
            room = max(len(headers[2]), room - 2 - max(len(r[1]) for r in [headers, *rows]))
    table = Table(title="namespaces", caption=caption, box=None, pad_edge=False, title_justify="left",
                  caption_justify="left", header_style="bold underline")
    for i, header in enumerate(headers):
        table.add_column(header, no_wrap=True, justify="left" if i < left else "right",
                         overflow="ellipsis", max_width=room if i == name_col else None)
    for row in rows:
        table.add_row(*row)
    return table


SUMMARY_WIDTH = 80  # the summary box never grows past this, whatever the namespace table's width


def _served(stats: Stats) -> str:
    """Blocks, bytes and (where the namespaces name their block size) tokens loaded into engines."""
    text = f"{stats.loaded_blocks} blocks, {human_bytes(stats.loaded_bytes)}"
    if stats.loaded_tokens or not stats.tokens_unknown:
        text += f", {stats.loaded_tokens} tokens"
    if stats.tokens_unknown:
        text += " (some tokens unknown: no block=N)" if stats.loaded_tokens else ", tokens unknown (no block=N)"
    return text


def _summary_rows(stats: Stats) -> list[tuple[str, str]]:
    rows = [
        ("served: loaded into engines", _served(stats)),
        ("stored by engines", f"{stats.stored_blocks} blocks"),
        ("pool", f"{human_bytes(stats.used_bytes)} / {human_bytes(stats.capacity_bytes)} ({stats.used_fraction:.0%}), "
                 f"{stats.blocks} blocks" + (f"; {human_bytes(stats.ready_bytes)} set up so far"
                                             if stats.ready_bytes < stats.capacity_bytes else "")),
        ("asked: lookup hits / misses", f"{stats.hits} / {stats.misses} blocks" + (
            f" ({stats.hit_rate:.1%} of lookups; hits include blocks engines held themselves)"
            if stats.hits + stats.misses else "")),
        ("evictions", str(stats.evictions)),
        ("engines / leases / jobs in flight", f"{stats.engines} / {stats.leases} / {stats.jobs_in_flight}"),
        ("failed blocks (loads) / corrupt",
         f"{stats.failed_blocks} ({stats.failed_load_blocks}) / {stats.corrupt_blocks}"),
        ("waiting for a seal / unverified", f"{stats.unsealed_blocks} / {stats.unverified_blocks} blocks"),
        ("uptime", f"{stats.uptime_s} s (daemon {stats.daemon_version})"),
    ]
    r = stats.remote
    if r.url:
        rows.append(("remote hits / misses / uploaded", f"{r.hits} / {r.misses} / {r.uploaded} ({r.breaker})"))
        rows.append(("remote queue / dropped / errors",
                     f"{human_bytes(r.queued_bytes)} / {r.dropped_full + r.dropped_unhealthy + r.dropped_closed} / "
                     f"{r.errors + r.corrupt}"))
    d = stats.disk
    if d.capacity_bytes:
        rows.append(("disk blocks / used / hits / written",
                     f"{d.blocks} / {human_bytes(d.bytes)} of {human_bytes(d.capacity_bytes)} / {d.hits} / {d.written}"
                     + ("" if d.healthy else f" (disabled: {d.error})")))
    return rows


def render_stats(stats: Stats, width: int, wide: bool = False) -> RenderableType:
    """The summary (what was served first, then what was asked), at most SUMMARY_WIDTH columns wide,
    then the namespaces (compact in `width` columns, or --wide: in full)."""
    from rich.console import Group
    from rich.constrain import Constrain
    from rich.table import Table

    summary = Table(title="kvstore", show_header=False)
    summary.add_column(no_wrap=True)
    summary.add_column(overflow="fold")
    for k, v in _summary_rows(stats):
        summary.add_row(k, v)
    box = Constrain(summary, min(width, SUMMARY_WIDTH))
    if not stats.namespaces:
        return box
    return Group(box, _namespace_table(stats, None if wide else width))
