"""Reader of the raw tracker CSV exports (``{device}_{part}.csv``, no header, 8 columns).

Fast path: pyarrow's multi-threaded CSV parser. A file it rejects, or whose values fail
validation, is parsed again line by line so the error names the exact line and reason (and, with
``on_bad_rows="skip"``, so each bad line can be skipped and counted without shifting windows).
"""

from __future__ import annotations

import base64
import calendar
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from birdzarr._errors import BadInputError
from birdzarr.convert._blocks import WindowBlock
from birdzarr.convert._curation import curate_windows, window_labels, window_rows
from birdzarr.convert._input import read_bytes
from birdzarr.format._spec import N_CHANNELS, WINDOW_LENGTH, Curation, DeviceReport
from birdzarr.storage._location import Location

COLUMNS = ("device_id", "date_time", "index", "label", "imu_x", "imu_y", "imu_z", "gps_speed")
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"
_TIME_CHARS = 19
_TIME_SEPARATORS = [4, 7, 10, 13, 16]
_SEPARATORS = np.frombuffer(b"-- ::", np.uint8)
_TIME_DIGITS = [i for i in range(_TIME_CHARS) if i not in _TIME_SEPARATORS]
_INT_LIMIT = 2**31


@dataclass
class _Rows:
    """Parsed rows of one file (or carried over from the previous part)."""

    device: np.ndarray  # int64
    time: np.ndarray  # int64 unix seconds
    label: np.ndarray  # int64
    values: np.ndarray  # float64 (n, 4)
    bad: np.ndarray  # bool: row skipped as malformed (kept as a placeholder)
    bad_lines: int = 0
    problems: list[str] = field(default_factory=list)  # messages of skipped lines

    def __len__(self) -> int:
        return len(self.device)

    def take(self, index: np.ndarray | slice) -> _Rows:
        return _Rows(
            self.device[index], self.time[index], self.label[index], self.values[index], self.bad[index]
        )

    @staticmethod
    def concat(parts: list[_Rows]) -> _Rows:
        return _Rows(
            np.concatenate([p.device for p in parts]),
            np.concatenate([p.time for p in parts]),
            np.concatenate([p.label for p in parts]),
            np.concatenate([p.values for p in parts]),
            np.concatenate([p.bad for p in parts]),
            sum(p.bad_lines for p in parts),
        )


def _empty_rows() -> _Rows:
    return _Rows(
        np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64),
        np.empty((0, N_CHANNELS)), np.empty(0, bool),
    )


def _bad(source: str, line: int, reason: str) -> BadInputError:
    return BadInputError(
        f"{source}, line {line}: {reason}. Fix or remove that line, or pass "
        "--on-bad-rows skip (Python: on_bad_rows='skip') to skip bad lines and count them in "
        "the report."
    )


def _unix_seconds(text: pa.Array) -> np.ndarray | None:
    """Seconds since 1970 of "YYYY-mm-dd HH:MM:SS" strings; None unless every one has that shape
    (then the line-by-line parser decides). Raises ArrowInvalid for an impossible date."""
    if text.null_count or not len(text):
        return None if text.null_count else np.empty(0, np.int64)
    offsets = np.frombuffer(text.buffers()[1], np.int32, len(text) + 1, text.offset * 4)
    if (np.diff(offsets) != _TIME_CHARS).any():
        return None
    chars = np.frombuffer(text.buffers()[2], np.uint8)[offsets[0] : offsets[-1]].reshape(-1, _TIME_CHARS)
    digits = chars[:, _TIME_DIGITS]
    if (digits < ord("0")).any() or (digits > ord("9")).any():
        return None
    if (chars[:, _TIME_SEPARATORS] != _SEPARATORS).any():
        return None
    return np.asarray(pc.cast(text, pa.timestamp("s")).cast(pa.int64()).to_numpy(zero_copy_only=False))


def _parse_fast(data: bytes) -> _Rows | None:
    """Parse with pyarrow; None if anything needs the line-by-line path (errors, NaN, nulls)."""
    # date_time is read as text, checked to be exactly "YYYY-mm-dd HH:MM:SS" and converted by
    # Arrow's ISO 8601 cast: measured 1.6x faster than a strptime timestamp parser, same values.
    types = {
        "device_id": pa.int64(), "date_time": pa.string(), "index": pa.int64(),
        "label": pa.int64(), **{c: pa.float64() for c in COLUMNS[4:]},
    }
    try:
        table = pacsv.read_csv(
            pa.BufferReader(data),
            # one thread a part: the parallelism is the engine's, a part a task (_pipeline.py)
            read_options=pacsv.ReadOptions(column_names=list(COLUMNS), use_threads=False),
            # a blank line becomes a row of empty fields, which fail conversion: the line-by-line
            # parser then reports it with its exact line number (no recount of the lines here)
            parse_options=pacsv.ParseOptions(newlines_in_values=False, ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(
                column_types=types, strings_can_be_null=False, quoted_strings_can_be_null=False,
            ),
        )
        times = _unix_seconds(table["date_time"].combine_chunks())
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return None
    if times is None:
        return None
    if any(col.null_count for col in table.columns):
        return None
    device = table["device_id"].to_numpy()
    values = np.stack([table[c].to_numpy() for c in COLUMNS[4:]], axis=1)
    if not np.isfinite(values[:, :3]).all():
        return None
    if (device < 0).any() or (device >= _INT_LIMIT).any():
        return None
    label = table["label"].to_numpy()
    if (np.abs(label) >= _INT_LIMIT).any():
        return None
    return _Rows(
        device=device,
        time=times,
        label=label,
        values=values,
        bad=np.zeros(len(device), dtype=bool),
    )


def _parse_line(fields: list[str]) -> tuple[int, int, int, list[float]]:
    if len(fields) != len(COLUMNS):
        raise ValueError(f"expected {len(COLUMNS)} comma-separated fields, found {len(fields)}")
    try:
        device = int(fields[0])
    except ValueError:
        raise ValueError(f"device_id {fields[0]!r} is not an integer") from None
    if not 0 <= device < _INT_LIMIT:
        raise ValueError(f"device_id {device} is outside 0..{_INT_LIMIT - 1}")
    try:
        moment = calendar.timegm(time.strptime(fields[1].strip(), _TIME_FORMAT))
    except ValueError:
        raise ValueError(f"date_time {fields[1]!r} is not 'YYYY-mm-dd HH:MM:SS'") from None
    try:
        int(fields[2])
        label = int(fields[3])
    except ValueError:
        raise ValueError(f"index/label {fields[2]!r}/{fields[3]!r} are not integers") from None
    if not -_INT_LIMIT < label < _INT_LIMIT:
        raise ValueError(f"label {label} is out of range")
    values: list[float] = []
    for name, text in zip(COLUMNS[4:], fields[4:], strict=True):
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"{name} {text!r} is not a number") from None
        if name != "gps_speed" and not math.isfinite(value):
            raise ValueError(f"{name} is {text.strip()!r}, not a finite number")
        values.append(value)
    return device, moment, label, values


def _parse_slow(data: bytes, source: str, on_bad_rows: str) -> _Rows:
    """Line-by-line parse that locates every bad line; skipped lines stay as placeholders."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_number = data[: exc.start].count(b"\n") + 1
        if on_bad_rows != "skip":
            raise _bad(source, line_number, "the bytes are not UTF-8 text (is this a CSV export?)") from None
        text = data.decode("utf-8", errors="replace")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    n = len(lines)
    rows = _Rows(
        np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64),
        np.full((n, N_CHANNELS), np.nan), np.zeros(n, bool),
    )
    keep_line = np.ones(n, dtype=bool)
    for i, line in enumerate(lines):
        try:
            device, moment, label, values = _parse_line(line.rstrip("\r").split(","))
        except ValueError as exc:
            if on_bad_rows != "skip":
                raise _bad(source, i + 1, str(exc)) from None
            rows.bad_lines += 1
            rows.problems.append(f"{source}, line {i + 1}: {exc} (skipped)")
            rows.bad[i] = True
            if i == 0 or not keep_line[i - 1]:
                keep_line[i] = False  # no neighbour to borrow a burst key from: drop the line
            else:
                # A placeholder in the previous row's burst keeps later windows aligned; its window
                # is dropped as "bad_rows" by curation.
                rows.device[i], rows.time[i] = rows.device[i - 1], rows.time[i - 1]
            continue
        rows.device[i], rows.time[i], rows.label[i] = device, moment, label
        rows.values[i] = values
    if keep_line.all():
        return rows
    kept = rows.take(keep_line)
    kept.bad_lines, kept.problems = rows.bad_lines, rows.problems
    return kept


def _decimals(field: bytes) -> int:
    """Digits after the decimal point of a number's text (0 without one)."""
    point = field.find(b".")
    if point < 0:
        return 0
    digits = field[point + 1 :]
    for stop, char in enumerate(digits):
        if not 48 <= char <= 57:  # an exponent ("e-05") ends the decimals
            return stop
    return len(digits)


def _cut_last_line(data: bytes) -> tuple[int, str] | None:
    """(line number, reason) when the file ends inside its last line, else None.

    A last line without its newline is where a cut-off copy ends. Real exports often end
    without a newline after a complete line, so such a line is judged against the line before
    it, whose fields have the export's fixed number of decimals: a cut line has fewer fields,
    or fewer decimals in its last field (``1.910000`` cut to ``1.``), than that line.
    """
    if data.endswith(b"\n"):
        return None
    start = data.rfind(b"\n") + 1
    if start == 0:
        return None  # a file of one line: nothing to judge it by (the parser checks its fields)
    previous = data[data.rfind(b"\n", 0, start - 1) + 1 : start - 1].rstrip(b"\r").split(b",")
    last = data[start:].rstrip(b"\r").split(b",")
    if len(previous) != len(COLUMNS):
        return None  # the line before is itself malformed: the parser reports it
    if len(last) < len(COLUMNS):
        found = f"it has {len(last)} of the {len(COLUMNS)} fields"
    else:
        want, have = _decimals(previous[-1].strip()), _decimals(last[-1].strip())
        if have >= want and not last[-1].strip().endswith((b".", b"-", b"+", b"e", b"E")):
            return None
        text = last[-1].strip().decode("utf-8", "replace")
        found = f"its {COLUMNS[-1]} {text!r} has {have} decimals where the line before has {want}"
    line = data.count(b"\n", 0, start) + 1
    return line, (f"the file ends inside this line: no newline follows it and {found}, so the file "
                  "looks cut off (copy it again from its origin; if the line is complete, end the "
                  "file with a newline)")


def _skip_last_line(rows: _Rows, message: str) -> _Rows:
    """``rows`` and a skipped last line: a placeholder in the last row's burst, so the window it
    would complete is dropped as "bad_rows" (as ``_parse_slow`` does for any bad line)."""
    if len(rows):
        placeholder = _Rows(
            rows.device[-1:], rows.time[-1:], np.zeros(1, np.int64),
            np.full((1, N_CHANNELS), np.nan), np.ones(1, bool),
        )
        joined = _Rows.concat([rows, placeholder])
    else:
        joined = rows  # no row before it: the line is dropped, and counted
    joined.bad_lines = rows.bad_lines + 1
    joined.problems = [*rows.problems, message]
    return joined


def parse_csv(data: bytes, source: str, *, on_bad_rows: str = "error") -> _Rows:
    """Parse one file's bytes into rows (see module docstring for the two paths); a file cut
    off inside its last line (``_cut_last_line``) is an error, or that line a skipped one."""
    if not data or data.isspace():  # not data.strip(): that copies the whole file
        if on_bad_rows != "skip":
            raise BadInputError(
                f"{source}: the file is empty. Remove it, or pass --on-bad-rows skip to ignore it."
            )
        return _empty_rows()
    cut = _cut_last_line(data)
    if cut is not None:
        line, reason = cut
        if on_bad_rows != "skip":
            raise _bad(source, line, reason)
        body = data[: data.rfind(b"\n") + 1]
        rows = _parse_fast(body)
        if rows is None:
            rows = _parse_slow(body, source, on_bad_rows)
        return _skip_last_line(rows, f"{source}, line {line}: {reason} (skipped)")
    rows = _parse_fast(data)
    return rows if rows is not None else _parse_slow(data, source, on_bad_rows)


@dataclass
class CsvDeviceReader:
    """Turns the ordered parts of one device into curated ``WindowBlock`` s."""

    device_id: int
    parts: list[Location]
    curation: Curation = field(default_factory=Curation)
    on_bad_rows: str = "error"
    carry: _Rows | None = None  # an unfinished burst the first part may continue (an append's)

    def blocks(self) -> Iterator[WindowBlock]:
        """Every part read, parsed and curated in order, in this thread (see ``read_part``
        and ``Stitcher`` for the same work spread over several processes)."""
        stitcher = Stitcher(self.curation, self.carry)
        for part in self.parts:
            yield from stitcher.add(self.part(part))
        yield stitcher.finish()

    def part(self, part: Location) -> PartPieces:
        """One part read, parsed, checked and curated as far as it can be without its neighbours."""
        data = read_bytes(part)  # decompressed: .csv, .csv.gz, .csv.zst (convert/_input.py)
        empty = not data or data.isspace()
        rows = parse_csv(data, part.display, on_bad_rows=self.on_bad_rows)
        del data
        self._check_device(rows, part.display)
        report = DeviceReport(
            rows_read=len(rows) + rows.bad_lines - int(rows.bad.sum()), bad_lines=rows.bad_lines
        )
        if empty:  # parse_csv raised unless skipping
            report.bad_files += 1
            report.note(f"{part.display}: the file is empty (skipped)")
        for message in rows.problems:
            report.note(message)
        return _split(rows, self.curation, report)

    def _check_device(self, rows: _Rows, source: str) -> None:
        if len(rows) == 0:
            return
        ids = np.unique(rows.device[~rows.bad]) if (~rows.bad).any() else np.unique(rows.device)
        expected = self.device_id
        others = ids[ids != expected]
        if len(others):
            line = int(np.flatnonzero(rows.device == others[0])[0]) + 1
            raise BadInputError(
                f"{source}, line {line}: device_id {int(others[0])} in a file of device {expected}. "
                "Each CSV file must hold one device; split the file per device "
                "({device}_{part}.csv)."
            )

def _burst_ids(rows: _Rows) -> np.ndarray:
    """A run id per row: it changes wherever (device, time) changes."""
    if len(rows) == 0:
        return np.empty(0, dtype=np.int64)
    change = (rows.device[1:] != rows.device[:-1]) | (rows.time[1:] != rows.time[:-1])
    return np.concatenate(([0], np.cumsum(change)))


def _curate(rows: _Rows, curation: Curation, report: DeviceReport) -> WindowBlock:
    """Curate rows that form whole windows (a multiple of 20, window by window)."""
    n = len(rows) // WINDOW_LENGTH
    values = rows.values.reshape(n, WINDOW_LENGTH, N_CHANNELS)
    bad = rows.bad.reshape(n, WINDOW_LENGTH)
    windows, keep = curate_windows(values, bad, curation, report)
    labels = window_labels(rows.label.reshape(n, WINDOW_LENGTH)[keep], report)
    timestamps = rows.time.reshape(n, WINDOW_LENGTH)[keep, 0]
    report.windows_written += len(windows)
    return WindowBlock(windows, timestamps.astype(np.int64), labels, report)


@dataclass
class PartPieces:
    """One CSV part, curated as far as it can be alone.

    Only the part's first burst can continue the previous part's unfinished burst, and only the
    unfinished remainder of its last burst can continue into the next part; every burst in
    between is windowed and curated here. ``Stitcher`` joins the pieces in part order, and
    the windows are exactly those of reading all parts as one sequence of rows.
    """

    report: DeviceReport  # the part's rows read, bad lines and files, notes, drops of ``body``
    head: _Rows  # the rows of the part's first burst
    body: WindowBlock | None  # the curated windows of the later bursts (None: one burst only)
    tail: _Rows  # the unfinished remainder (< 20 rows) of the last burst, when it is not the first


def _split(rows: _Rows, curation: Curation, report: DeviceReport) -> PartPieces:
    burst_ids = _burst_ids(rows)
    first = int(np.searchsorted(burst_ids, burst_ids[0], side="right")) if len(rows) else 0
    if first == len(rows):  # one burst (or none): all of it may continue either neighbour
        return PartPieces(report, rows, None, _empty_rows())
    later = rows.take(slice(first, None))
    index, trailing = window_rows(burst_ids[first:])
    report.drop("remainder_rows", int(len(later) - len(index) - trailing))
    body = _curate(later.take(index), curation, report)
    body.report = DeviceReport()  # counted in the part's report, which the head block carries
    tail = later.take(slice(len(later) - trailing, None))
    return PartPieces(report, rows.take(slice(0, first)), body, tail)


class Stitcher:
    """Joins the ``PartPieces`` of one device's parts, in part order, into curated blocks.

    ``carry`` is an unfinished burst the first part may continue: the ``DeviceEnd.unfinished`` rows of the
    device's earlier parts, which a store records so that an append continues it exactly as
    one conversion of all the parts would (``birdzarr/convert/_append.py``).
    """

    def __init__(self, curation: Curation, carry: _Rows | None = None) -> None:
        self.curation = curation
        self.carry = _empty_rows() if carry is None else carry

    def add(self, pieces: PartPieces) -> Iterator[WindowBlock]:
        rows = _Rows.concat([self.carry, pieces.head])
        index, trailing = window_rows(_burst_ids(rows))
        if pieces.body is None:  # the part was one burst: its remainder may continue further
            pieces.report.drop("remainder_rows", int(len(rows) - len(index) - trailing))
            self.carry = rows.take(slice(len(rows) - trailing, None))
        else:  # the head burst ended inside the part: its remainder is dropped
            pieces.report.drop("remainder_rows", int(len(rows) - len(index)))
            self.carry = pieces.tail
        yield _curate(rows.take(index), self.curation, pieces.report)
        if pieces.body is not None and len(pieces.body):
            yield pieces.body

    def finish(self) -> DeviceEnd:
        """The end of the device: an unfinished burst left over forms no window (it is counted
        as ``remainder_rows``, and handed on as the block's ``unfinished``)."""
        report = DeviceReport()
        report.drop("remainder_rows", len(self.carry))
        tail, self.carry = self.carry, _empty_rows()
        no_windows = np.empty((0, WINDOW_LENGTH, N_CHANNELS), np.float32)
        return DeviceEnd(no_windows, np.empty(0, np.int64), np.empty(0, np.int32), report,
                         unfinished=tail)


@dataclass
class DeviceEnd(WindowBlock):
    """The last block of a CSV device: no windows; ``unfinished`` holds the rows of its
    unfinished last burst (fewer than 20, maybe none), which a later part may continue."""

    unfinished: _Rows | None = None


# -- the unfinished last burst of each device, as a store records it (``csv_tails``) ------------


def tail_to_json(rows: _Rows) -> dict[str, Any] | None:
    """An unfinished burst as JSON, exactly: its time, each row's label, the rows' float64
    values (little-endian, base64: NaN and the exact bits survive) and which rows are
    placeholders of skipped lines. None for no rows."""
    if not len(rows):
        return None
    if len(rows) >= WINDOW_LENGTH or (rows.time != rows.time[0]).any():
        raise ValueError(f"not an unfinished burst: {len(rows)} rows, times {np.unique(rows.time)}")
    return {
        "time": int(rows.time[0]),
        "labels": [int(x) for x in rows.label],
        "values": base64.b64encode(np.ascontiguousarray(rows.values, dtype="<f8").tobytes()).decode("ascii"),
        "bad_rows": [int(i) for i in np.flatnonzero(rows.bad)],
    }


def tail_from_json(device_id: int, raw: Any) -> _Rows:
    """The rows ``tail_to_json`` wrote; ValueError when the record is not one it writes."""
    try:
        labels = np.array(raw["labels"], dtype=np.int64)
        values = np.frombuffer(base64.b64decode(raw["values"], validate=True), dtype="<f8")
        n = len(labels)
        if not 0 < n < WINDOW_LENGTH or values.size != n * N_CHANNELS or labels.ndim != 1:
            raise ValueError(f"{n} labels and {values.size} values")
        bad = np.zeros(n, dtype=bool)
        bad[np.array(raw["bad_rows"], dtype=np.int64)] = True
        return _Rows(
            np.full(n, device_id, np.int64), np.full(n, int(raw["time"]), np.int64), labels,
            values.reshape(n, N_CHANNELS).astype(np.float64), bad,
        )
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as exc:
        raise ValueError(f"device {device_id}'s unfinished burst cannot be read back ({exc})") from None


def read_part(device_id: int, part: Location, curation: Curation, on_bad_rows: str) -> PartPieces:
    """``CsvDeviceReader.part`` as a plain function (what a worker process runs)."""
    return CsvDeviceReader(device_id, [part], curation, on_bad_rows).part(part)
