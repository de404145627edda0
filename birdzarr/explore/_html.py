"""What a store looks like when displayed: the text repr, the Jupyter HTML summary, the device table.

Everything here comes from the root attributes already in memory: displaying a store must never
read chunks or list directories (on S3 each would be a request, and Jupyter displays often).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from birdzarr.format._device_table import COLUMNS
from birdzarr.format._spec import LABEL_UNLABELLED, TIMESTAMP_UNKNOWN, DeviceEntry
from birdzarr.store._summary import codec_name

if TYPE_CHECKING:
    from birdzarr.explore._protocol import ReadableStore as Store

_DEVICES_INLINE = 8  # devices named in the text repr before "..."
_DEVICES_HTML = 25  # rows of the device table shown in the HTML summary
# above this many devices the HTML summary's rows come from the device table's index columns
# (device, windows, times), so that displaying a store never parses ~750 bytes of JSON for
# each of 100K devices (3.7 s at 100,000); labels and sources are in ``store.devices``
_DEVICES_WITH_DETAILS = 1000
_NUMERIC_COLUMNS = {"device", "windows", "labelled", "classes"}  # right-aligned in tables


@dataclass(frozen=True)
class Overview:
    """The facts a summary shows, gathered once from the store's attributes."""

    url: str
    n_windows: int
    n_devices: int
    format_version: int
    generation: int | None
    committed_at: str | None
    codec: str | None
    chunk_windows: int
    shuffled: bool
    source_kind: str | None
    curation: str
    first_time: int
    last_time: int
    labelled: int
    classes: int

    @classmethod
    def of(cls, store: Store) -> Overview:
        # the root attributes and the device table's index columns: a format-2 store's summary
        # parses no per-device JSON, whatever its device count
        root = store.root
        committed = root.get("committed") or {}
        layout = root.get("layout", {})
        columns = store.device_columns
        times = np.concatenate([columns["first_time"], columns["last_time"]])
        times = times[times != TIMESTAMP_UNKNOWN]
        recorded = committed.get("label_counts")
        label_totals = ({int(k): int(v) for k, v in recorded.items()} if recorded is not None
                        else label_counts(store.device_table))
        labelled = sum(n for label, n in label_totals.items() if label != LABEL_UNLABELLED)
        return cls(
            url=store.url,
            n_windows=len(store),
            n_devices=store.n_devices,
            format_version=store.format_version,
            generation=committed.get("generation"),
            committed_at=committed.get("committed_at"),
            codec=codec_name(store.format_version, layout),
            chunk_windows=store.chunk_windows,
            shuffled=store.shuffled,
            source_kind=root.get("source_kind"),
            curation=describe_curation(root.get("curation") or {}),
            first_time=int(times.min()) if len(times) else TIMESTAMP_UNKNOWN,
            last_time=int(times.max()) if len(times) else TIMESTAMP_UNKNOWN,
            labelled=labelled,
            classes=sum(1 for label in label_totals if label != LABEL_UNLABELLED),
        )

    @property
    def n_chunks(self) -> int:
        return -(-self.n_windows // self.chunk_windows) if self.chunk_windows else 0

    @property
    def time_span(self) -> str:
        if self.first_time == TIMESTAMP_UNKNOWN:
            return "unknown (the source has no timestamps)"
        return f"{format_time(self.first_time)} .. {format_time(self.last_time)} UTC"

    @property
    def labels(self) -> str:
        unlabelled = self.n_windows - self.labelled
        if not self.labelled:
            return f"none ({unlabelled:,} windows unlabelled)"
        return f"{self.labelled:,} windows labelled ({self.classes} classes), {unlabelled:,} unlabelled"

    @property
    def layout(self) -> str:
        order = "pre-shuffled" if self.shuffled else "in device order"
        chunks = "1 chunk" if self.n_chunks == 1 else f"{self.n_chunks:,} chunks"
        return f"{chunks} of {self.chunk_windows:,} windows, codec {self.codec}, {order}"

    @property
    def version(self) -> str:
        return (f"birdzarr format v{self.format_version}, generation {self.generation}, "
                f"committed {self.committed_at}")


def format_time(seconds: int) -> str:
    """UTC unix seconds as ``YYYY-mm-dd HH:MM:SS``; ``unknown`` for the unknown-time value."""
    if seconds == TIMESTAMP_UNKNOWN:
        return "unknown"
    return str(np.datetime64(seconds, "s")).replace("T", " ")


def label_counts(entries: list[DeviceEntry]) -> dict[int, int]:
    totals: dict[int, int] = {}
    for entry in entries:
        for label, count in entry.label_counts.items():
            totals[label] = totals.get(label, 0) + count
    return dict(sorted(totals.items()))


def describe_curation(curation: dict[str, Any]) -> str:
    if curation.get("applied_by") == "birdzarr":
        low, high = curation["clip"]
        return (
            f"by birdzarr: gps_speed >= {curation['speed_limit']:g} m/s dropped, "
            f"imu clipped to [{low:g}, {high:g}] g, gps_speed / {curation['gps_scale']:g}"
        )
    return "done before conversion (values copied exactly)"


def describe_sources(sources: list[str]) -> str:
    """A device's source files in a table cell: all of them when few, else first, last and count."""
    if len(sources) <= 3:
        return ", ".join(sources)
    return f"{sources[0]} .. {sources[-1]} ({len(sources)} files)"


def _devices_inline(store: Store) -> str:
    columns = store.device_columns
    shown = [f"{d} ({n:,})" for d, n in zip(columns["device_id"][:_DEVICES_INLINE].tolist(),
                                             columns["n_windows"][:_DEVICES_INLINE].tolist(), strict=True)]
    more = store.n_devices - _DEVICES_INLINE
    return ", ".join(shown) + (f", ... {more} more" if more > 0 else "")


def text_repr(store: Store) -> str:
    """The plain-text summary shown by ``repr(store)`` outside Jupyter."""
    o = Overview.of(store)
    return "\n".join([
        f"<birdzarr.Store {o.url}: {o.n_windows:,} windows, {o.n_devices} devices>",
        f"  format   {o.version}",
        f"  layout   {o.layout}",
        f"  source   {o.source_kind}",
        f"  curation {o.curation}",
        f"  time     {o.time_span}",
        f"  labels   {o.labels}",
        f"  devices  {_devices_inline(store)}",
    ])


def device_rows(store: Store) -> list[dict[str, str]]:
    """The device table as strings, one dict per device (for the HTML summary and the CLI)."""
    rows = []
    for e in store.device_table:
        labelled = sum(n for label, n in e.label_counts.items() if label != LABEL_UNLABELLED)
        rows.append({
            "device": str(e.device_id),
            "windows": f"{e.n_windows:,}",
            "first time": format_time(e.first_time),
            "last time": format_time(e.last_time),
            "labelled": f"{labelled:,}",
            "classes": str(sum(1 for label in e.label_counts if label != LABEL_UNLABELLED)),
            "sources": describe_sources(e.sources),
        })
    return rows


def _index_rows(store: Store, limit: int) -> list[dict[str, str]]:
    """The first ``limit`` devices' rows from the device table's index columns alone."""
    columns = store.device_columns
    return [{"device": str(d), "windows": f"{n:,}", "first time": format_time(a), "last time": format_time(b)}
            for d, n, a, b in zip(*(columns[k][:limit].tolist() for k in COLUMNS), strict=True)]


def device_records(store: Store) -> list[dict[str, Any]]:
    """The device table as JSON-ready records (``birdzarr info --devices --json``)."""
    def when(seconds: int) -> str | None:
        return None if seconds == TIMESTAMP_UNKNOWN else format_time(seconds).replace(" ", "T") + "Z"

    return [
        {"device_id": e.device_id, "n_windows": e.n_windows,
         "first_time": when(e.first_time), "last_time": when(e.last_time),
         "label_counts": {str(k): v for k, v in sorted(e.label_counts.items())},
         "ranges": [[r.start, r.stop] for r in e.ranges], "sources": list(e.sources)}
        for e in store.device_table
    ]


def device_table_text(store: Store) -> str:
    """The device table as aligned text columns (``birdzarr info --devices``)."""
    rows = device_rows(store)
    if not rows:
        return "no devices"
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}

    def line(cells: dict[str, str]) -> str:
        return "  ".join(
            cells[c].rjust(widths[c]) if c in _NUMERIC_COLUMNS else cells[c].ljust(widths[c]) for c in columns
        ).rstrip()

    return "\n".join([line({c: c for c in columns}), *(line(r) for r in rows)])


_STYLE = (
    "<style>.bz-store table{border-collapse:collapse;font-size:12px}"
    ".bz-store th,.bz-store td{text-align:left;padding:2px 10px 2px 0;vertical-align:top}"
    ".bz-store .num{text-align:right}.bz-store summary{cursor:pointer}</style>"
)


def _cell(tag: str, column: str, text: str) -> str:
    align = " class='num'" if column in _NUMERIC_COLUMNS else ""
    return f"<{tag}{align}>{html.escape(text)}</{tag}>"


def html_repr(store: Store) -> str:
    """The rich summary Jupyter shows for a store (``Store._repr_html_``)."""
    o = Overview.of(store)
    esc = html.escape
    facts = [
        ("windows", f"{o.n_windows:,} from {o.n_devices} devices"),
        ("format", o.version),
        ("layout", o.layout),
        ("source", o.source_kind or "unknown"),
        ("curation", o.curation),
        ("time", o.time_span),
        ("labels", o.labels),
    ]
    fact_rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts)
    rows = (device_rows(store) if o.n_devices <= _DEVICES_WITH_DETAILS
            else _index_rows(store, _DEVICES_HTML))
    header = "".join(_cell("th", c, c) for c in (rows[0] if rows else []))
    body = "".join(
        "<tr>" + "".join(_cell("td", c, v) for c, v in row.items()) + "</tr>" for row in rows[:_DEVICES_HTML]
    )
    more = o.n_devices - _DEVICES_HTML
    note = f"<p>... {more} more devices: <code>store.devices</code> has them all.</p>" if more > 0 else ""
    if o.n_devices > _DEVICES_WITH_DETAILS:
        note += "<p>Labels and sources of each device: <code>store.devices</code>.</p>"
    return (
        f"{_STYLE}<div class='bz-store'><strong>birdzarr.Store</strong> <code>{esc(o.url)}</code>"
        f"<table>{fact_rows}</table>"
        f"<details><summary>{o.n_devices} devices</summary><table><tr>{header}</tr>{body}</table>{note}"
        "</details></div>"
    )
