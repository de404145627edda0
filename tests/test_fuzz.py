"""Hostile input: whatever the files hold or are called, convert ends in exactly one of two ways.

Either a committed store (that verifies) plus its report, or a :class:`BirdzarrError` with a
message, and then no committed store at the destination. Never another exception type, never a
partial store that opens as committed, never a file written outside the destination.

CI runs a fixed (derandomised) set of examples, bounded to keep the suite fast. For a longer,
random fuzzing session: ``BIRDZARR_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py``.
"""

from __future__ import annotations

import os
import pathlib
import re
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import birdzarr
from birdzarr._errors import BadInputError, BirdzarrError
from birdzarr.convert._csv import parse_csv
from birdzarr.maintenance._verify import verify

pytestmark = pytest.mark.slow

_SCALE = int(os.environ.get("BIRDZARR_FUZZ_EXAMPLES", "0"))
CASES_RUN: dict[str, int] = {}  # cases run per fuzz test, filled while that test runs
OUTCOMES: dict[str, set[str]] = {}  # the outcomes seen per fuzz test ("store", "error", ...)


def fuzz_settings(examples: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=_SCALE or examples, deadline=None, derandomize=not _SCALE, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def _count(name: str) -> None:
    CASES_RUN[name] = CASES_RUN.get(name, 0) + 1


def _outcome(name: str, outcome: str) -> None:
    OUTCOMES.setdefault(name, set()).add(outcome)


def run_counted(name: str, cases: Callable[[], None], examples: int, outcomes: set[str]) -> None:
    """Run a hypothesis test and check that it really ran: the number of cases, and every
    outcome expected (a fuzz test whose inputs all fail early would prove nothing)."""
    CASES_RUN.pop(name, None)
    OUTCOMES.pop(name, None)
    cases()
    wanted = _SCALE or examples
    assert CASES_RUN.get(name, 0) >= wanted, (name, CASES_RUN.get(name), wanted)
    assert OUTCOMES.get(name, set()) >= outcomes, (name, OUTCOMES.get(name))


def convert_outcome(source: pathlib.Path, dest: pathlib.Path, **options: Any) -> str:
    """Convert and check the only two outcomes allowed; returns "store" or "error"."""
    root = dest.parent
    before = {p for p in root.rglob("*")} - {p for p in dest.rglob("*")} - {dest}
    try:
        store = birdzarr.convert(source, dest, chunk_windows=64, progress=False, **options)
    except BirdzarrError as exc:
        message = str(exc)
        assert len(message) > 20, message
        with pytest.raises(BirdzarrError):
            birdzarr.open_store(dest)  # nothing that looks committed
        outcome = "error"
    else:
        assert store.meta["committed"]["n_windows"] == len(store)
        assert set(store.report) == {e.device_id for e in store.device_table}
        result = verify(store.url)
        assert result.ok, result.format()
        outcome = "store"
    after = {p for p in root.rglob("*")} - {p for p in dest.rglob("*")} - {dest}
    assert after == before, f"files appeared outside the destination: {sorted(after - before)}"
    return outcome


# -- CSV ---------------------------------------------------------------------------------------

_GOOD_ROW = "298,2014-06-01 10:00:00,{i},-1,0.125,-0.5,0.98,1.5"
_HOSTILE_FIELDS = st.sampled_from([
    "", " ", "1e400", "-1e400", "1e308", "-99999999999999999999", "99999999999999999999999", "nan",
    "NaN", "inf", "-inf", "0x10", "１２", "٣", "2014-06-01 10:00:00", "2014-13-45 25:61:61",
    "9999-12-31 23:59:59", "0001-01-01 00:00:00", "\u00e9", "\u202e298", "\x00", '"', '"2,3"', "298",
    "-1", "30", "29.9999", "-0", "1_000", "\ufeff298",
])


@st.composite
def hostile_csv(draw: st.DrawFn) -> bytes:
    n_rows = draw(st.integers(0, 70))
    rows = [_GOOD_ROW.format(i=i % 20).split(",") for i in range(n_rows)]
    for _ in range(draw(st.integers(0, 6))):
        if not rows:
            break
        row = draw(st.integers(0, len(rows) - 1))
        action = draw(st.sampled_from(["field", "drop_field", "extra_field", "blank", "text"]))
        if action == "field" and rows[row]:
            rows[row][draw(st.integers(0, len(rows[row]) - 1))] = draw(_HOSTILE_FIELDS)
        elif action == "drop_field" and rows[row]:
            rows[row].pop()
        elif action == "extra_field":
            rows[row].append(draw(_HOSTILE_FIELDS))
        elif action == "blank":
            rows[row] = []
        else:
            rows[row] = [draw(st.text(max_size=30))]
    newline = draw(st.sampled_from(["\n", "\r\n"]))
    data = newline.join(",".join(r) for r in rows).encode("utf-8", "surrogatepass")
    if draw(st.booleans()):
        data += newline.encode()
    if data and draw(st.integers(0, 4)) == 0:
        data = data[: draw(st.integers(0, len(data)))]  # truncated export
    return data


@fuzz_settings(150)
@given(data=st.one_of(st.binary(max_size=300), hostile_csv()), skip=st.booleans())
def _csv_parser_cases(data: bytes, skip: bool) -> None:
    _count("csv parser")
    try:
        rows = parse_csv(data, "fuzz_0.csv", on_bad_rows="skip" if skip else "error")
    except BadInputError as exc:
        assert "fuzz_0.csv" in str(exc)
        _outcome("csv parser", "error")
        return
    assert len(rows.device) == len(rows.time) == len(rows.values) == len(rows.bad)
    _outcome("csv parser", "rows" if len(rows.device) else "empty")


def test_csv_parser_never_raises_anything_else() -> None:
    run_counted("csv parser", _csv_parser_cases, 150, {"rows", "error"})


def _convert_files(files: dict[str, bytes], skip: bool, test: str) -> None:
    """Write ``files`` into a fresh source directory and convert it (see ``convert_outcome``)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "src").mkdir()
        for name, data in files.items():
            (root / "src" / name).write_bytes(data)
        outcome = convert_outcome(root / "src", root / "out.zarr", on_bad_rows="skip" if skip else "error")
        _outcome(test, outcome)


@fuzz_settings(30)
@given(files=st.lists(hostile_csv(), min_size=1, max_size=2), skip=st.booleans())
def _csv_convert_cases(files: list[bytes], skip: bool) -> None:
    _count("csv convert")
    _convert_files({f"298_{part}.csv": data for part, data in enumerate(files)}, skip, "csv convert")


def test_csv_convert_store_or_clear_error() -> None:
    run_counted("csv convert", _csv_convert_cases, 30, {"store", "error"})


# -- Parquet -----------------------------------------------------------------------------------

def _column(kind: str, rows: int, rng: np.random.Generator) -> pa.Array:
    values = rng.normal(size=rows * 80).astype(np.float32)
    offsets80 = pa.array(np.arange(0, rows * 80 + 1, 80, dtype=np.int32))
    if kind == "list<float32>":
        return pa.ListArray.from_arrays(offsets80, pa.array(values))
    if kind == "list<double>":
        return pa.ListArray.from_arrays(offsets80, pa.array(values.astype(np.float64)))
    if kind == "large_list<float32>":
        return pa.LargeListArray.from_arrays(pa.array(np.arange(0, rows * 80 + 1, 80, dtype=np.int64)),
                                             pa.array(values))
    if kind == "fixed_size_list<float32, 79>":
        return pa.FixedSizeListArray.from_arrays(pa.array(values[: rows * 79]), 79)
    if kind == "fixed_size_list<float32, 80>":
        return pa.FixedSizeListArray.from_arrays(pa.array(values), 80)
    if kind == "ragged list<float32>":
        lengths = rng.choice([0, 79, 80, 81, 160], size=rows)
        offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
        flat = rng.normal(size=int(offsets[-1])).astype(np.float32)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    if kind == "list<float32> with null rows":
        column = _column("list<float32>", rows, rng).to_pylist()
        holed = [None if i % 3 == 1 else v for i, v in enumerate(column)]
        return pa.array(holed, type=pa.list_(pa.float32()))
    if kind == "list<float32> with NaN and inf":
        values[:: max(1, len(values) // 5)] = np.nan
        values[1:: max(1, len(values) // 7)] = np.inf
        return pa.ListArray.from_arrays(offsets80, pa.array(values))
    if kind == "float32":
        return pa.array(values[:rows])
    if kind == "string":
        return pa.array([str(v) for v in values[:rows]])
    if kind == "list<string>":
        return pa.array([["1.0"] * 80 for _ in range(rows)])
    raise AssertionError(kind)


_KINDS = ["list<float32>", "list<double>", "large_list<float32>", "fixed_size_list<float32, 79>",
          "fixed_size_list<float32, 80>", "ragged list<float32>", "list<float32> with null rows",
          "list<float32> with NaN and inf", "float32", "string", "list<string>"]


@st.composite
def hostile_parquet(draw: st.DrawFn) -> bytes:
    rows = draw(st.integers(0, 40))
    kind = draw(st.sampled_from(_KINDS))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    name = draw(st.sampled_from(["gimu", "gimu", "GIMU", "values"]))
    columns: dict[str, pa.Array] = {name: _column(kind, rows, rng)}
    for extra in range(draw(st.integers(0, 2))):
        columns[f"extra{extra}"] = pa.array(rng.integers(0, 9, rows))
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink, row_group_size=draw(st.sampled_from([7, 1000])))
    data = sink.getvalue().to_pybytes()
    damage = draw(st.sampled_from(["none", "none", "truncate", "flip", "random"]))
    if damage == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "flip":
        position = draw(st.integers(0, len(data) - 1))
        data = data[:position] + bytes([data[position] ^ 0xFF]) + data[position + 1:]
    elif damage == "random":
        data = draw(st.binary(max_size=200))
    return data


@fuzz_settings(40)
@given(files=st.lists(hostile_parquet(), min_size=1, max_size=2), skip=st.booleans())
def _parquet_convert_cases(files: list[bytes], skip: bool) -> None:
    _count("parquet convert")
    _convert_files({f"{100 + device}.parquet": data for device, data in enumerate(files)}, skip,
                   "parquet convert")


def test_parquet_convert_store_or_clear_error() -> None:
    run_counted("parquet convert", _parquet_convert_cases, 40, {"store", "error"})


# -- file names --------------------------------------------------------------------------------

_NAME_PARTS = st.sampled_from(["..", ".", "298", "0", "-1", "_", "1e3", "00298", "２９８", "\u00e9",
                               " ", "~", "$HOME", "%2e%2e", "999999999999", "\\..\\", "a", "csv", "parquet"])


@fuzz_settings(25)
@given(names=st.lists(st.lists(_NAME_PARTS, min_size=1, max_size=4).map("".join), min_size=1, max_size=3),
       suffix=st.sampled_from([".csv", ".parquet"]))
def _hostile_file_name_cases(names: list[str], suffix: str) -> None:
    _count("file names")
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        (root / "src").mkdir()
        for name in set(names):
            path = root / "src" / (name + suffix)
            if path.name in (".csv", ".parquet") or path.parent != root / "src":
                continue
            if suffix == ".csv":
                path.write_text("\n".join(_GOOD_ROW.format(i=i) for i in range(20)) + "\n")
            else:
                birdzarr.demo._synthetic.write_parquet(np.zeros((3, 20, 4), np.float32), path)
        if not any((root / "src").iterdir()):
            return
        _outcome("file names", convert_outcome(root / "src", root / "out.zarr"))


def test_hostile_file_names() -> None:
    run_counted("file names", _hostile_file_name_cases, 25, {"error"})


# -- fixed hostile cases -----------------------------------------------------------------------

@pytest.mark.parametrize(("names", "message"), [
    (("12.parquet", "012.parquet"), "'012.parquet' and '12.parquet' both hold device 12; keep one file"),
    (("298_0.csv", "0298_0.csv"), "'0298_0.csv' and '298_0.csv' both name the same device and part (0) 298"),
])
def test_one_device_from_two_inputs_is_refused(tmp_path: pathlib.Path, names: tuple[str, str],
                                               message: str) -> None:
    (tmp_path / "src").mkdir()
    for name in names:
        path = tmp_path / "src" / name
        if name.endswith(".csv"):
            path.write_text("\n".join(_GOOD_ROW.format(i=i) for i in range(20)) + "\n")
        else:
            birdzarr.demo._synthetic.write_parquet(np.zeros((3, 20, 4), np.float32), path)
    with pytest.raises(BadInputError, match=re.escape(message)):
        birdzarr.convert(tmp_path / "src", tmp_path / "out.zarr", progress=False)
    assert not (tmp_path / "out.zarr").exists()


@pytest.mark.parametrize("skip", [False, True])
def test_a_parquet_footer_with_a_non_utf8_column_name(tmp_path: pathlib.Path, skip: bool) -> None:
    """Found by the fuzzer: pyarrow raised UnicodeDecodeError, not a BirdzarrError."""
    (tmp_path / "src").mkdir()
    path = tmp_path / "src" / "12.parquet"
    birdzarr.demo._synthetic.write_parquet(np.zeros((3, 20, 4), np.float32), path)
    path.write_bytes(path.read_bytes().replace(b"gimu", b"\x9aimu"))
    if skip:  # the only file skipped: no window at all, which is an error, not an empty store
        with pytest.raises(BadInputError, match=r"gives no windows \(0 rows read.* 1 unreadable file"):
            birdzarr.convert(tmp_path / "src", tmp_path / "out.zarr", on_bad_rows="skip", progress=False)
        assert not (tmp_path / "out.zarr").exists()
    else:
        with pytest.raises(BadInputError, match="12.parquet: not a readable Parquet file"):
            birdzarr.convert(tmp_path / "src", tmp_path / "out.zarr", progress=False)


def test_a_csv_holding_another_device_is_refused(tmp_path: pathlib.Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "298_0.csv").write_text("\n".join(_GOOD_ROW.format(i=i) for i in range(20)) + "\n")
    (tmp_path / "src" / "5_0.csv").write_text("\n".join(_GOOD_ROW.format(i=i) for i in range(20)) + "\n")
    with pytest.raises(BadInputError, match="device_id 298 in a file of device 5"):
        birdzarr.convert(tmp_path / "src", tmp_path / "out.zarr", progress=False)
