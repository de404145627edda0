"""Bad input, refused destinations, unreadable stores: each error says what, where and what to do."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import birdzarr
from birdzarr import (
    BadInputError,
    FormatVersionError,
    NotAStoreError,
    StoreExistsError,
    StoreNotFoundError,
)
from birdzarr.demo import _synthetic
from birdzarr.maintenance._verify import verify

GOOD = "7,2014-01-01 10:00:00,{i},-1,0.100000,-0.200000,0.900000,3.5\n"


def _burst(n: int = 60) -> list[str]:
    return [GOOD.format(i=i) for i in range(n)]


def _with_line(line_number: int, text: str) -> str:
    lines = _burst()
    lines[line_number - 1] = text
    return "".join(lines)


CSV_CASES = {
    "non-numeric field": (_with_line(5, "7,2014-01-01 10:00:00,4,-1,abc,-0.2,0.9,3.5\n"), 5, "imu_x 'abc'"),
    "wrong column count": (_with_line(7, "7,2014-01-01 10:00:00,6,-1,0.1,-0.2,0.9\n"), 7, "found 7"),
    "unparsable time": (_with_line(3, "7,2014-13-45 10:00:00,2,-1,0.1,-0.2,0.9,3.5\n"), 3, "date_time"),
    "NaN in imu": (_with_line(9, "7,2014-01-01 10:00:00,8,-1,0.1,nan,0.9,3.5\n"), 9, "imu_y"),
    "truncated file": ("".join(_burst())[:-25], 60, "fields"),
}


@pytest.mark.parametrize("case", sorted(CSV_CASES))
def test_bad_csv_line_stops_with_file_line_and_remedy(case: str, tmp_path: pathlib.Path) -> None:
    text, line, what = CSV_CASES[case]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "7_0.csv").write_text(text)
    with pytest.raises(BadInputError) as caught:
        birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False)
    message = str(caught.value)
    assert "7_0.csv" in message and f"line {line}:" in message and what in message
    assert "--on-bad-rows skip" in message
    assert not (tmp_path / "s.zarr").exists()  # nothing committed, nothing left behind


@pytest.mark.parametrize("case", sorted(CSV_CASES))
def test_bad_csv_line_skipped_and_counted(case: str, tmp_path: pathlib.Path) -> None:
    text, _, _ = CSV_CASES[case]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "7_0.csv").write_text(text)
    store = birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False, on_bad_rows="skip")
    report = store.report[7]
    assert report.bad_lines == 1
    # the bad line's window is dropped; the other two windows of the burst stay aligned
    assert len(store) == 2
    assert report.dropped.get("bad_rows") == 1
    assert report.problems and "7_0.csv, line" in report.problems[0]
    assert birdzarr.open_store(tmp_path / "s.zarr").report[7].bad_lines == 1


def test_empty_csv(tmp_path: pathlib.Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "7_0.csv").write_text("".join(_burst(20)))
    (tmp_path / "src" / "7_1.csv").write_text("")
    with pytest.raises(BadInputError, match=r"7_1.csv: the file is empty.*--on-bad-rows skip"):
        birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False)
    store = birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False, on_bad_rows="skip")
    assert len(store) == 1
    assert store.report[7].bad_files == 1


# -- Parquet ------------------------------------------------------------------------------------


def _good_parquet(path: pathlib.Path, n: int = 300) -> np.ndarray:
    windows = _synthetic.curated_windows(n, seed=1)
    _synthetic.write_parquet(windows, path)
    return windows


def _lists(rows: list[list[float]], kind: pa.DataType) -> pa.Table:
    return pa.table({"gimu": pa.array(rows, type=kind)})


def _bad_parquet(case: str, path: pathlib.Path) -> None:
    if case == "truncated":
        _good_parquet(path)
        path.write_bytes(path.read_bytes()[:-300])
    elif case == "garbage":
        path.write_bytes(b"PAR1" + bytes(range(256)) * 10)
    elif case == "non-list column":
        pq.write_table(pa.table({"gimu": pa.array(np.zeros(10, np.float32))}), path)
    elif case == "list<double>":
        pq.write_table(_lists([[0.5] * 80] * 5, pa.list_(pa.float64())), path)
    elif case == "no gimu column":
        pq.write_table(pa.table({"x": pa.array([1, 2])}), path)


PARQUET_FILE_CASES = {
    "truncated": "not a readable Parquet file",
    "garbage": "not a readable Parquet file",
    "non-list column": "has type float, expected list<float32>",
    "list<double>": "has type list<element: double>, expected list<float32>",
    "no gimu column": "no column 'gimu'",
}


@pytest.mark.parametrize("case", sorted(PARQUET_FILE_CASES))
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_bad_parquet_file(case: str, tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    good = _good_parquet(source / "1.parquet")
    _bad_parquet(case, source / "2.parquet")
    with pytest.raises(BadInputError) as caught:
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    message = str(caught.value)
    assert "2.parquet" in message and PARQUET_FILE_CASES[case] in message
    assert "--on-bad-rows skip" in message
    assert not (tmp_path / "s.zarr").exists()
    store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False, on_bad_rows="skip")
    assert store.report[2].bad_files == 1 and store.report[2].problems
    assert np.array_equal(store.device_windows(1), good)
    assert store.device(2).n_windows == 0


@pytest.mark.parametrize("case", ["79 values", "null row", "NaN value"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_bad_parquet_rows_name_row_group_and_row(case: str, tmp_path: pathlib.Path) -> None:
    rows: list[list[float] | None] = [[float(i)] * 80 for i in range(250)]
    if case == "79 values":
        rows[130] = [1.0] * 79
    elif case == "null row":
        rows[130] = None
    else:
        rows[130] = [1.0] * 79 + [float("nan")]
    source = tmp_path / "src"
    source.mkdir()
    pq.write_table(_lists(rows, pa.list_(pa.float32())), source / "5.parquet", row_group_size=100)  # type: ignore[arg-type]
    with pytest.raises(BadInputError) as caught:
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    message = str(caught.value)
    assert "5.parquet, row group 1, row 30:" in message and "--on-bad-rows skip" in message
    store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False, on_bad_rows="skip")
    assert len(store) == 249
    assert store.report[5].bad_lines == 1
    assert store.report[5].dropped == {"bad_rows": 1}
    assert store.windows[130][0, 0] == 131.0  # later windows keep their order


# -- destinations and stores ----------------------------------------------------------------------


def test_overwrite_refusal_has_a_hint(
    small_store: birdzarr.Store, parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]]
) -> None:
    directory, _ = parquet_source
    with pytest.raises(StoreExistsError, match="--overwrite"):
        birdzarr.convert(directory, small_store.location.path, progress=False)
    assert len(birdzarr.open_store(small_store.location.path)) == len(small_store)  # untouched


def test_failed_conversion_leaves_nothing(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    _good_parquet(source / "1.parquet", 5000)
    _bad_parquet("truncated", source / "9.parquet")  # the last device fails after others were written
    with pytest.raises(BadInputError):
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False, chunk_windows=512)
    assert not (tmp_path / "s.zarr").exists()
    with pytest.raises(StoreNotFoundError):
        birdzarr.open_store(tmp_path / "s.zarr")


# -- --overwrite keeps the old store until the new one has committed ------------------------------


def _siblings(dest: pathlib.Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(dest.name + ".birdzarr-"))


def _files(store: pathlib.Path) -> dict[pathlib.Path, bytes]:
    """Every file of a store and its bytes, except a (possibly stale) writer lock."""
    files = (p for p in store.rglob("*") if p.is_file() and "lock" not in p.name)
    return {p.relative_to(store): p.read_bytes() for p in files}


def _sources(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Two Parquet sources: 3000 windows (the old store) and 4500 (its replacement)."""
    first, second = tmp_path / "first", tmp_path / "second"
    for directory, n in ((first, 3000), (second, 4500)):
        directory.mkdir()
        _good_parquet(directory / "1.parquet", n)
    return first, second


def _convert(source: pathlib.Path, dest: pathlib.Path, **options: object) -> birdzarr.Store:
    return birdzarr.convert(source, dest, progress=False, chunk_windows=512, **options)  # type: ignore[arg-type]


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_overwrite_replaces_the_store_and_leaves_no_siblings(tmp_path: pathlib.Path) -> None:
    first, second = _sources(tmp_path)
    dest = tmp_path / "s.zarr"
    _convert(first, dest)
    (tmp_path / ("s.zarr" + ".birdzarr-new-0123456789ab")).mkdir()  # a killed replacement's leftover
    replaced = _convert(second, dest, overwrite=True)
    assert len(replaced) == len(birdzarr.open_store(dest)) == 4500
    assert verify(dest).ok
    assert _siblings(dest) == []


_DIE_BEFORE_COMMIT = """
import os, signal, sys
import birdzarr
from birdzarr.convert import _writer
_writer.StoreWriter.commit = lambda self, *a, **k: os.kill(os.getpid(), signal.SIGKILL)
birdzarr.convert(sys.argv[1], sys.argv[2], overwrite=True, progress=False, chunk_windows=512)
"""


@pytest.mark.slow
def test_killed_overwrite_keeps_the_old_store(tmp_path: pathlib.Path) -> None:
    import signal
    import subprocess
    import sys

    first, second = _sources(tmp_path)
    dest = tmp_path / "s.zarr"
    _convert(first, dest)
    before = _files(dest)
    # killed after writing every chunk of the replacement, just before its commit
    child = subprocess.run([sys.executable, "-c", _DIE_BEFORE_COMMIT, str(second), str(dest)], timeout=120)
    assert child.returncode == -signal.SIGKILL
    assert _files(dest) == before  # the dead writer's lock file stays (stale) and is not compared
    assert len(birdzarr.open_store(dest)) == 3000 and verify(dest).ok
    assert len(_siblings(dest)) == 1  # the unfinished replacement
    _convert(second, dest, overwrite=True)
    assert len(birdzarr.open_store(dest)) == 4500 and _siblings(dest) == []


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_overwrite_through_a_symlink_replaces_the_real_directory(tmp_path: pathlib.Path) -> None:
    first, second = _sources(tmp_path)
    (tmp_path / "big_disk").mkdir()
    real, link = tmp_path / "big_disk" / "s.zarr", tmp_path / "s.zarr"
    _convert(first, real)
    link.symlink_to(real, target_is_directory=True)
    _convert(second, link, overwrite=True)
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert len(birdzarr.open_store(real)) == 4500
    assert _siblings(real) == [] and _siblings(link) == []


def _copy_store(store: birdzarr.Store, dest: pathlib.Path) -> pathlib.Path:
    import shutil

    shutil.copytree(store.location.path, dest, ignore=shutil.ignore_patterns(".*lock*"))
    return dest


def test_newer_format_version(small_store: birdzarr.Store, tmp_path: pathlib.Path) -> None:
    copy = _copy_store(small_store, tmp_path / "new.zarr")
    meta = json.loads((copy / "zarr.json").read_text())
    meta["attributes"]["birdzarr"]["format_version"] = 3  # versions 1 and 2 are read
    (copy / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(FormatVersionError) as caught:
        birdzarr.open_store(copy)
    message = str(caught.value)
    assert "version 3; this birdzarr supports versions 1 and 2." in message


def test_not_a_store(tmp_path: pathlib.Path) -> None:
    import zarr

    zarr.open_group(str(tmp_path / "plain.zarr"), mode="w", zarr_format=3).attrs["x"] = 1
    with pytest.raises(NotAStoreError, match="not a birdzarr store"):
        birdzarr.open_store(tmp_path / "plain.zarr")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotAStoreError):
        birdzarr.open_store(tmp_path / "empty")
    with pytest.raises(StoreNotFoundError):
        birdzarr.open_store(tmp_path / "missing")


def test_bad_source_paths(tmp_path: pathlib.Path) -> None:
    with pytest.raises(StoreNotFoundError):
        birdzarr.convert(tmp_path / "missing", tmp_path / "s.zarr", progress=False)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "notes.txt").write_text("x")
    with pytest.raises(BadInputError, match="1 entry is not an input file: 'notes.txt'"):
        birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False)
    with pytest.raises(BadInputError, match="no .csv, .csv.gz, .csv.zst or .parquet files"):
        birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False, skip_unknown_files=True)
    (tmp_path / "src" / "abc.parquet").write_bytes(b"")
    with pytest.raises(BadInputError, match=r"\{device\}.parquet"):
        birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False, skip_unknown_files=True)
