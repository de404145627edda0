"""Format 2's device table: out of the root attributes, one group per commit, read only when used.

A version-1 store keeps every device's entry, report and unfinished CSV burst in the root
``zarr.json`` (~750 bytes a device: 75 MB at 100K devices, parsed at every open by every rank and
worker). A version-2 store keeps them in the group ``device_table/<generation>``:

- the uint8 array ``details``: the UTF-8 JSON object of ``devices`` (the entries, as version 1's
  root attribute), ``report_devices`` (each device's conversion report) and, for CSV stores in
  device order, ``csv_tails``, compressed with zstd (~400 bytes of JSON a device, ~10x smaller
  stored); read the first time a reader needs an entry, never at open. The group's attributes
  say so (``{"birdzarr": {"details": "details"}}``); a store written before the array existed
  holds the object itself as the attributes (``birdzarr``), which readers accept;
- core-codec int64 arrays, an index of the entries for readers that need only these columns:
  ``device_id``, ``n_windows``, ``first_time``, ``last_time`` (one a device, ascending id) and
  ``range_device``, ``range_start``, ``range_stop`` (one a run of windows ``[start, stop)`` of
  device ``range_device``, by start; none in a shuffled store);
- the check columns (``CHECKS``), int64 beside the index, so that ``verify`` reads the
  recorded checksums without the details' JSON: ``range_checksum`` (each range's CRC-32C,
  0..2**32-1, aligned with ``range_start``) where every range's checksum is 8 hex digits, and
  ``scattered_digest`` (each device's order-free digest, its uint64 bits as two's complement,
  aligned with ``device_id``) where the table has devices and every one has a digest (a shuffled
  store). A table written before them, or whose entries these cannot hold, has them not.

The root attribute ``committed.device_table`` names the committed generation's group, so a commit
writes the new group first and the root last: a run killed in between leaves the previous
generation in force (and its new group is a leftover that the next writer removes). A commit keeps
the group it replaced until the next one (birdzarr/store/_tail.py ``kept_tables``): readers read
the table lazily, after the root, and one that opened just before a commit still finds it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from json.encoder import encode_basestring_ascii as _string
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from birdzarr.format._device_columns import DeviceColumns
from birdzarr.format._spec import DeviceEntry, DeviceReport

GROUP = "device_table"
COLUMNS = ("device_id", "n_windows", "first_time", "last_time")
RANGES = ("range_device", "range_start", "range_stop")
CHECKS = ("range_checksum", "scattered_digest")  # the recorded checks (module doc), where written
_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}},
           {"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3, "shuffle": "shuffle",
                                               "typesize": 8, "blocksize": 0}},
           {"name": "crc32c"}]
CHUNK = 2**20  # entries a chunk: one chunk up to a million devices


def path(generation: int) -> str:
    """The group of one generation's table, relative to the store root."""
    return f"{GROUP}/{generation}"


def columns(entries: list[DeviceEntry], runs: Sequence[DeviceColumns] = ()) -> dict[str, np.ndarray]:
    """The index arrays of ``entries`` and of the devices of ``runs`` (ascending device id); the
    ranges by (start, stop, device); and the check columns (``CHECKS``), each where the entries
    can hold it (module doc)."""
    entries = sorted(entries, key=lambda e: e.device_id)
    n = len(entries)
    out = {
        "device_id": np.fromiter((e.device_id for e in entries), np.int64, n),
        "n_windows": np.fromiter((e.n_windows for e in entries), np.int64, n),
        "first_time": np.fromiter((e.first_time for e in entries), np.int64, n),
        "last_time": np.fromiter((e.last_time for e in entries), np.int64, n),
    }
    device = np.array([e.device_id for e in entries for _ in e.ranges], np.int64)
    start = np.array([r.start for e in entries for r in e.ranges], np.int64)
    stop = np.array([r.stop for e in entries for r in e.ranges], np.int64)
    checksum = hex_values([r.checksum for e in entries for r in e.ranges], 8)
    digest = hex_values([e.scattered_digest for e in entries], 16)
    if runs:
        parts = [(out["device_id"], out["n_windows"], out["first_time"], out["last_time"])]
        parts += [(r.device_ids, r.counts, r.first_times, r.last_times) for r in runs]
        joined = [np.concatenate(column).astype(np.int64) for column in zip(*parts, strict=True)]
        by_id = np.argsort(joined[0], kind="stable")
        out = {name: column[by_id] for name, column in zip(COLUMNS, joined, strict=True)}
        ranged = [r for r in runs if not r.scattered]  # scattered devices have no range
        held = [r.counts > 0 for r in ranged]
        device = np.concatenate([device, *(r.device_ids[h] for r, h in zip(ranged, held, strict=True))])
        start = np.concatenate([start, *(r.starts[h] for r, h in zip(ranged, held, strict=True))])
        stop = np.concatenate([stop, *(r.starts[h] + r.counts[h] for r, h in zip(ranged, held, strict=True))])
        if checksum is not None:
            checksum = np.concatenate([checksum, *(r.checksums[h]
                                                   for r, h in zip(ranged, held, strict=True))])
        if digest is not None and not ranged:  # every device scattered
            digest = np.concatenate([digest, *(r.digests.view(np.int64) for r in runs
                                               if r.digests is not None)])[by_id]
        else:
            digest = None
    order = np.lexsort((device, stop, start))  # the last key first: start, then stop, then device
    out["range_device"], out["range_start"], out["range_stop"] = device[order], start[order], stop[order]
    if checksum is not None:
        out["range_checksum"] = checksum.astype(np.int64)[order]
    if digest is not None and len(out["device_id"]):
        out["scattered_digest"] = digest.astype(np.int64)
    return out


_HEX_VALUE = np.full(256, 255, np.uint8)
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def hex_values(texts: Sequence[str | None] | np.ndarray, width: int) -> np.ndarray | None:
    """The check columns' values (``CHECKS``) of the entries' text: texts of ``width`` lowercase
    hex digits (str, or a numpy bytes array) as integers (int64: a 16-digit value's uint64 bits as
    two's complement); None where one is None, of another length or holds another character."""
    if isinstance(texts, np.ndarray):  # bytes: a shorter one ends with NULs, which are no digits
        if len(texts) and texts.dtype != np.dtype(f"S{width}"):
            return None
        spelled = texts.astype(f"S{width}").tobytes()
    elif all(text is not None and len(text) == width for text in texts):
        spelled = "".join([text or "" for text in texts]).encode("latin-1", "replace")
    else:
        return None
    digits = _HEX_VALUE[np.frombuffer(spelled, np.uint8)]
    if (digits > 15).any():
        return None
    shifts = np.arange(4 * (width - 1), -1, -4, dtype=np.uint64)
    values = (digits.reshape(-1, width).astype(np.uint64) << shifts).sum(axis=1, dtype=np.uint64)
    return values.view(np.int64)


# The details' JSON, spelled out a device at a time: the text ``json.dumps(details,
# separators=(",", ":"), allow_nan=False)`` gives for the ``to_json`` dicts of the entries and
# reports, byte for byte, without building those dicts (~1 s and most of the garbage collector's
# work at 100K devices). Strings are escaped by json's own encoder (ASCII, as json.dumps); the
# integer fields are ints (``%d`` and ``:d`` spell them as json.dumps does).
_ENTRY = ('{"device_id":%d,"n_windows":%d,"ranges":[%s],"first_time":%d,"last_time":%d,"sources":[%s],'
          '"label_counts":{%s},"scattered_checksum":%s,"scattered_digest":%s}')
_REPORT = ('"%d":{"rows_read":%d,"windows_written":%d,"dropped":{%s},"mixed_label_windows":%d,'
           '"bad_lines":%d,"bad_files":%d,"problems":[%s]}')


def _entry_json(e: DeviceEntry) -> str:
    # one range, one label and one source (most devices) without a list and a join each
    ranges = e.ranges
    if len(ranges) == 1:
        r = ranges[0]
        spans = f"[{r.start:d},{r.stop:d},{_string(r.checksum)}]"
    else:
        spans = ",".join([f"[{r.start:d},{r.stop:d},{_string(r.checksum)}]" for r in ranges])
    counts = e.label_counts
    if len(counts) == 1:
        ((label, count),) = counts.items()
        labels = f'"{label:d}":{count:d}'
    else:
        labels = ",".join([f'"{label:d}":{count:d}' for label, count in sorted(counts.items())])
    sources = e.sources
    files = _string(sources[0]) if len(sources) == 1 else ",".join([_string(s) for s in sources])
    checksum, digest = e.scattered_checksum, e.scattered_digest
    return _ENTRY % (e.device_id, e.n_windows, spans, e.first_time, e.last_time, files, labels,
                     "null" if checksum is None else _string(checksum),
                     "null" if digest is None else _string(digest))


def _report_json(device_id: int, r: DeviceReport) -> str:
    dropped = ",".join([f"{_string(k)}:{v:d}" for k, v in r.dropped.items()]) if r.dropped else ""
    problems = ",".join([_string(p) for p in r.problems]) if r.problems else ""
    return _REPORT % (device_id, r.rows_read, r.windows_written, dropped, r.mixed_label_windows,
                      r.bad_lines, r.bad_files, problems)


# A device of ``DeviceColumns`` (one range or none, or scattered: no range and its digest; no
# scattered checksum; its report its windows read and written and its notes): the text
# ``_ENTRY`` and ``_REPORT`` give for its ``objects()``, and the comma that follows it in the
# details, put together by Arrow's string kernels a column at a time (``%`` a device cost ~5 us
# a device: half a second at 100,000 devices)
_RUN_ENTRY = ('{"device_id":', ',"n_windows":', ',"ranges":[', '],"first_time":', ',"last_time":',
              ',"sources":[', '],"label_counts":{', '},"scattered_checksum":null,"scattered_digest":', '},')
_RUN_REPORT = ('"', '":{"rows_read":', ',"windows_written":', ',"dropped":{},"mixed_label_windows":0,'
               '"bad_lines":0,"bad_files":0,"problems":[', ']},')
_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def _text(value: str) -> pa.Scalar:
    return pa.scalar(value, pa.large_string())


def _decimal(values: np.ndarray) -> pa.Array:
    """Integers as JSON spells them."""
    return pc.cast(pa.array(np.asarray(values, np.int64)), pa.large_string())


def _hex8(values: np.ndarray) -> pa.Array:
    """uint32 values as 8 lowercase hex digits (``f"{v:08x}"``)."""
    digits = _HEX[(np.asarray(values, np.uint32)[:, None] >> np.arange(28, -1, -4, dtype=np.uint32)) & 0xF]
    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(8), len(values),
                                                 [None, pa.py_buffer(digits.tobytes())])
    return fixed.cast(pa.large_binary()).cast(pa.large_string())


def _hex16(values: np.ndarray) -> pa.Array:
    """uint64 values as 16 lowercase hex digits (``digest_hex``)."""
    digits = _HEX[(np.asarray(values, np.uint64)[:, None] >> np.arange(60, -1, -4, dtype=np.uint64))
                  & np.uint64(0xF)]
    fixed = pa.FixedSizeBinaryArray.from_buffers(pa.binary(16), len(values),
                                                 [None, pa.py_buffer(digits.tobytes())])
    return fixed.cast(pa.large_binary()).cast(pa.large_string())


def _joined(values: pa.Array, offsets: np.ndarray, separator: str = ",") -> pa.Array:
    """``separator.join(values[offsets[k]:offsets[k + 1]])`` for each ``k``."""
    lists = pa.LargeListArray.from_arrays(pa.array(np.asarray(offsets, np.int64)), values)
    return pc.binary_join(lists, _text(separator))


def _concat(*parts: pa.Array | pa.Scalar) -> pa.Array:
    return pc.binary_join_element_wise(*parts, _text(""))


def _run_json(runs: DeviceColumns) -> tuple[pa.Array, pa.Array]:
    """Each device's entry and report JSON, each followed by a comma, spelled from the columns
    of ``runs``."""
    n = len(runs)
    ids, counts = _decimal(runs.device_ids), _decimal(runs.counts)
    held = runs.counts > 0
    spans: pa.Array | pa.Scalar = _text("")
    digests: pa.Array | pa.Scalar = _text("null")
    if runs.digests is not None:  # scattered: no range, each device's digest
        digests = _concat(_text('"'), _hex16(runs.digests), _text('"'))
    else:
        starts = runs.starts.astype(np.int64)
        spans = _concat(_text("["), _decimal(starts), _text(","), _decimal(starts + runs.counts), _text(',"'),
                        _hex8(runs.checksums), _text('"]'))
        spans = pc.if_else(pa.array(held), spans, _text(""))
    names = pa.array([_string(name) for name in runs.names], pa.large_string())
    sources = _joined(names.take(pa.array(runs.name_at)), runs.name_bounds)
    pairs = _concat(_text('"'), _decimal(runs.label_value), _text('":'), _decimal(runs.label_count))
    per_device = np.bincount(np.asarray(runs.label_device, np.int64), minlength=n)
    labels = _joined(pairs, np.concatenate(([0], np.cumsum(per_device))))
    e = [_text(t) for t in _RUN_ENTRY]
    entries = _concat(e[0], ids, e[1], counts, e[2], spans, e[3], _decimal(runs.first_times), e[4],
                      _decimal(runs.last_times), e[5], sources, e[6], labels, e[7], digests, e[8])
    notes: pa.Array | pa.Scalar = _text("")
    if runs.problems:
        spelled = [""] * n
        for k, problems in runs.problems.items():
            spelled[k] = ",".join([_string(p) for p in problems])
        notes = pa.array(spelled, pa.large_string())
    r = [_text(t) for t in _RUN_REPORT]
    reports = _concat(r[0], ids, r[1], counts, r[2], counts, r[3], notes, r[4])
    return entries, reports


def _in_order(ids: list[np.ndarray], texts: list[pa.Array]) -> memoryview:
    """The texts (each ending with a comma) one after another in ascending order of their ids,
    without the last comma: the bytes of the array that holds them in that order (no copy of
    them joined: ~37 MB at 100,000 devices)."""
    held = [text for text in texts if len(text)]
    if not held:
        return memoryview(b"")
    every = held[0] if len(held) == 1 else pa.concat_arrays(held)
    joined = np.concatenate(ids)
    if len(joined) > 1 and not bool((joined[1:] > joined[:-1]).all()):  # in order already: most often
        every = every.take(pa.array(np.argsort(joined, kind="stable")))
    every = every.cast(pa.large_string())  # int64 offsets (no copy: they are already)
    offsets = np.frombuffer(every.buffers()[1], np.int64)[every.offset : every.offset + len(every) + 1]
    return memoryview(every.buffers()[2])[int(offsets[0]) : int(offsets[-1]) - 1]


def details_json(entries: Iterable[DeviceEntry], reports: Iterable[tuple[int, DeviceReport]],
                 csv_tails: dict[str, Any] | None, runs: Sequence[DeviceColumns] = ()) -> bytes:
    """The UTF-8 JSON of the ``details`` array: ``{"devices": [entry.to_json(), ...],
    "report_devices": {str(id): report.to_json(), ...}, "csv_tails": csv_tails}``, compact, in
    the order given (the writer gives ascending device ids), the devices of ``runs`` among them
    by ascending device id (spelled from their columns: ``_run_json``)."""
    tails = json.dumps(csv_tails, separators=(",", ":"), allow_nan=False, check_circular=False).encode()
    if runs:
        entries, reports = list(entries), list(reports)
        # one spelling of each kind (runs, scattered): Arrow's calls a run add up
        kinds = [kind for kind in ([r for r in runs if not r.scattered], [r for r in runs if r.scattered])
                 if kind]
        spelled = [_run_json(DeviceColumns.joined(kind)) for kind in kinds]
        entry_ids = [np.fromiter((e.device_id for e in entries), np.int64, len(entries))]
        report_ids = [np.fromiter((d for d, _ in reports), np.int64, len(reports))]
        for kind in kinds:
            entry_ids.append(np.concatenate([r.device_ids for r in kind]))
            report_ids.append(entry_ids[-1])
        objects = (pa.array([_entry_json(e) + "," for e in entries], pa.large_string()),
                   pa.array([_report_json(d, r) + "," for d, r in reports], pa.large_string()))
        devices: bytes | memoryview = _in_order(entry_ids, [objects[0], *(s[0] for s in spelled)])
        report_devices: bytes | memoryview = _in_order(report_ids, [objects[1], *(s[1] for s in spelled)])
    else:
        devices = ",".join([_entry_json(e) for e in entries]).encode()
        report_devices = ",".join([_report_json(d, r) for d, r in reports]).encode()
    return b"".join([b'{"devices":[', devices, b'],"report_devices":{', report_devices,
                     b'},"csv_tails":', tails, b"}"])


def array_metadata(length: int) -> dict[str, Any]:
    """The zarr.json of one index array of ``length`` entries."""
    return {
        "zarr_format": 3, "node_type": "array", "shape": [length], "data_type": "int64",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [max(1, min(length, CHUNK))]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0, "codecs": _CODECS, "attributes": {}, "dimension_names": ["device"],
    }


DETAILS = "details"  # the array of the details' JSON
DETAILS_CHUNK = 2**22  # bytes a chunk of it
_DETAILS_CODECS = [{"name": "bytes"},
                   {"name": "blosc", "configuration": {"cname": "zstd", "clevel": 3, "shuffle": "noshuffle",
                                                       "typesize": 1, "blocksize": 0}},
                   {"name": "crc32c"}]


def group_metadata() -> dict[str, Any]:
    """The group's zarr.json: its attributes name the array holding the details."""
    return {"zarr_format": 3, "node_type": "group", "attributes": {"birdzarr": {"details": DETAILS}}}


def details_metadata(length: int) -> dict[str, Any]:
    """The zarr.json of the ``details`` array of ``length`` bytes."""
    return {
        "zarr_format": 3, "node_type": "array", "shape": [length], "data_type": "uint8",
        "chunk_grid": {"name": "regular",
                       "configuration": {"chunk_shape": [max(1, min(length, DETAILS_CHUNK))]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0, "codecs": _DETAILS_CODECS, "attributes": {}, "dimension_names": ["byte"],
    }
