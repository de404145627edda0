"""Store summaries: the facts `birdzarr info` prints and `--json` emits."""

from __future__ import annotations

import os
from typing import Any

from birdzarr.format import _v2
from birdzarr.format._spec import GIMU, DeviceReport, report_totals
from birdzarr.store._handle import Store

_WINDOW_BYTES = 20 * 4 * 4  # a window as float32
_APPENDS_LISTED = 5  # appends listed one a line by `info` (the latest)


def stored_bytes(store: Store, name: str = GIMU) -> int:
    """Bytes of one array's chunk files (listing the array's directory once)."""
    if store.location.is_local:  # fsspec's du costs 150 us a file here: 0.09 s for 610 chunks
        return _local_bytes(store.location.join(name))
    fs = store.location.fs
    try:
        sizes = fs.du(store.location.join(name), total=False)
    except FileNotFoundError:
        return 0
    return int(sum(size for path, size in sizes.items() if not path.endswith("zarr.json")))


def _local_bytes(directory: str) -> int:
    """Bytes of the files under ``directory`` but its ``zarr.json`` files (0 where it is missing)."""
    total, folders = 0, [directory]
    while folders:
        try:
            entries = os.scandir(folders.pop())
        except FileNotFoundError:
            continue
        with entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                elif entry.name != "zarr.json":
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def window_arrays(store: Store) -> tuple[str, ...]:
    """The arrays that hold the windows' values: ``gimu`` (format 1); the codes, gps_speed,
    rows and dictionaries (format 2)."""
    return _v2.ARRAYS if store.format_version >= 2 else (GIMU,)


def summary(store: Store) -> dict[str, Any]:
    # the root attributes alone where they hold the report's totals (a format-2 store): the
    # device table (~750 bytes of JSON a device) is read only for a store without them
    meta = store.root
    report = meta.get("report", {})
    totals = report.get("totals")
    if totals is None:
        meta = store.meta
        report = meta.get("report", {})
        totals = report_totals(DeviceReport.from_json(r) for r in report.get("devices", {}).values())
    raw = len(store) * _WINDOW_BYTES
    arrays = {name: stored_bytes(store, name) for name in window_arrays(store)}
    stored = sum(arrays.values())
    appends = report.get("appends") or []
    return {
        "url": store.url,
        "format_version": store.format_version,
        "converter": meta.get("converter"),
        "windows": len(store),
        "devices": store.n_devices,
        "bytes_raw": raw,
        "bytes_stored": stored,
        "ratio": round(raw / stored, 3) if stored else None,
        "bytes_arrays": arrays,  # the stored bytes of each array counted in bytes_stored
        "layout": meta.get("layout"),
        "source_kind": meta.get("source_kind"),
        "curation": meta.get("curation"),
        "window_rule": meta.get("window_rule"),
        "mixed_label_policy": meta.get("mixed_label_policy"),
        "committed": meta.get("committed"),
        # the totals cover every commit; the times and CPU figures are the first conversion's,
        # of its ``windows`` (each append has its own, in ``appends``)
        "report": {"windows": int(appends[0]["first_window"]) if appends else len(store),
                   **totals, "seconds": report.get("seconds"),
                   "cpu_seconds": report.get("cpu_seconds"), "cores_used": report.get("cores_used"),
                   "workers": report.get("workers"),
                   "pass_seconds": (report.get("shuffle") or {}).get("pass_seconds")},
        "appends": [_append_summary(a) for a in appends],
        "subset": meta.get("subset"),  # written by birdzarr.subset: its source and selection
    }


def _append_summary(record: dict[str, Any]) -> dict[str, Any]:
    """One append of the report, its per-device file lists counted (the store's root
    attributes keep them: ``report.appends[i].files``)."""
    files = record.get("files") or {}
    found = {k: v for k, v in record.items() if k != "files"}
    found["devices_appended"] = len(files)
    found["files_appended"] = sum(len(names) for names in files.values())
    return found


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def codec_name(format_version: int, layout: dict[str, Any] | None) -> str:
    """How the windows are coded, for `info` and the store's summary: version 1's codec from the
    layout attribute (dict16, gdict16, standard); version 2 has one layout."""
    if format_version >= 2:
        return "uint16 codes + dictionaries (core Zarr v3 codecs)"
    return str((layout or {}).get("codec"))


def format_summary(info: dict[str, Any]) -> str:
    layout = info["layout"] or {}
    curation = info["curation"] or {}
    report = info["report"]
    lines = [
        f"store        {info['url']}",
        f"format       birdzarr v{info['format_version']} (Zarr v3), written by "
        f"birdzarr {(info['converter'] or {}).get('version')}",
        f"windows      {info['windows']:,} from {info['devices']:,} devices (source: {info['source_kind']})",
        f"bytes        {_size(info['bytes_raw'])} raw float32, {_size(info['bytes_stored'])} stored "
        f"(ratio {info['ratio']}x)",
        f"chunking     {layout.get('chunk_windows')} windows a chunk, "
        f"codec {codec_name(info['format_version'], layout)}, "
        f"shuffled {layout.get('shuffled')}"
        + (f" (seed {layout.get('shuffle_seed')})" if layout.get("shuffled") else ""),
    ]
    if info["format_version"] >= 2:
        lines.append("arrays       " + ", ".join(
            f"{name} {_size(size)}" for name, size in (info.get("bytes_arrays") or {}).items()))
    if curation.get("applied_by") == "birdzarr":
        lines.append(
            f"curation     speed < {curation['speed_limit']} m/s per window, imu clipped to "
            f"{curation['clip']}, gps_speed / {curation['gps_scale']}"
        )
    else:
        lines.append("curation     done before conversion (Parquet source), values copied exactly")
    if info.get("subset"):  # no input rows were read: the windows came from another store
        lines.append(_subset_line(info["subset"], report.get("seconds")))
        return "\n".join(lines)
    dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(report["dropped"].items())) or "none"
    lines.append(
        f"report       {report['rows_read']:,} rows read, dropped: {dropped}; bad lines "
        f"{report['bad_lines']:,}, bad files {report.get('bad_files', 0):,}; mixed-label windows "
        f"{report['mixed_label_windows']:,}"
    )
    appends = info.get("appends") or []
    if report.get("seconds"):
        windows = report.get("windows", info["windows"])
        rate = windows * _WINDOW_BYTES / report["seconds"] / 1e6
        of = f" for its {windows:,} windows" if appends else ""
        lines.append(f"conversion   {report['seconds']:.1f} s{of} ({rate:.0f} MB/s of float32 windows)")
        if report.get("cpu_seconds") is not None:
            workers = report.get("workers")
            lines[-1] += (f", {report['cpu_seconds']:.1f} CPU s on {report.get('cores_used', 0):.1f} cores "
                          f"({workers} worker{'' if workers == 1 else 's'})")
        if report.get("pass_seconds"):  # a shuffle: read and spill, then load and write
            first, second = report["pass_seconds"]
            lines[-1] += f"; shuffle pass 1 {first:.1f} s, pass 2 {second:.1f} s"
    shown = appends[-_APPENDS_LISTED:]
    if len(appends) > len(shown):
        lines.append(f"appends      {len(appends)}, the last {len(shown)}:")
    for number, record in enumerate(shown, start=len(appends) - len(shown) + 1):
        line = (f"append {number:<6d}+{record.get('windows', 0):,} windows ({record['devices_appended']} "
                f"device(s), {record['files_appended']} file(s))")
        if record.get("seconds") is not None:
            line += f" in {record['seconds']:.1f} s"
        if record.get("finished_at"):
            line += f", {record['finished_at']}"
        if record.get("source"):
            line += f", from {record['source']}"
        lines.append(line)
    return "\n".join(lines)


def _subset_line(record: dict[str, Any], seconds: float | None) -> str:
    """Where a subset store's windows came from: the source, and the selection's options that
    were set (a split with its rule)."""
    selection = record.get("selection") or {}
    rule = ("split_by", "val_fraction", "split_seed")
    chosen = [f"{k}={v!r}" for k, v in selection.items()
              if v is not None and v is not False and (k not in rule or selection.get("split") is not None)]
    line = (f"subset       {record.get('windows', 0):,} of the {record.get('source_n_windows', 0):,} windows "
            f"of {record.get('source')} ({', '.join(chosen) or 'every window'})")
    return line + (f", written in {seconds:.1f} s" if seconds else "")
