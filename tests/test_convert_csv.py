"""CSV input: the converter's windows equal a window-level curation computed here independently.

The truth is built from the text with Python's csv module and plain loops, sharing no code with
birdzarr's parser or curation.
"""

from __future__ import annotations

import calendar
import csv
import datetime as dt
import itertools
import math
import pathlib
from collections import Counter

import numpy as np
import pytest

import birdzarr
from birdzarr.demo import _synthetic

FIXTURES = pathlib.Path(__file__).resolve().parent / "data"  # copied from the shared fixtures (MIT)
SPEED_LIMIT = 30.0
GPS_SCALE = 22.3012351755624


def _part_number(path: pathlib.Path) -> int:
    return int(path.stem.rsplit("_", 1)[1])


def expected_windows(paths: list[pathlib.Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(windows float32 (n,20,4), labels (n,), unix times (n,)) of one device's ordered parts."""
    rows: list[list[str]] = []
    for path in paths:
        with open(path, newline="") as handle:
            rows.extend(csv.reader(handle))
    windows, labels, times = [], [], []
    for (_, when), burst in itertools.groupby(rows, key=lambda r: (r[0], r[1])):
        burst = list(burst)
        for w in range(len(burst) // 20):
            window = burst[20 * w : 20 * w + 20]
            speeds = [float(r[7]) for r in window]
            if any(not math.isfinite(s) or s >= SPEED_LIMIT for s in speeds):
                continue
            values = [
                [min(max(float(r[c]), -2.0), 2.0) for c in (4, 5, 6)] + [float(r[7]) / GPS_SCALE]
                for r in window
            ]
            windows.append(values)
            counts = Counter(int(r[3]) for r in window)
            best = max(counts.values())
            labels.append(next(int(r[3]) for r in window if counts[int(r[3])] == best))
            moment = dt.datetime.strptime(when, "%Y-%m-%d %H:%M:%S")
            times.append(calendar.timegm(moment.timetuple()))
    return (
        np.array(windows, dtype=np.float64).astype(np.float32).reshape(-1, 20, 4),
        np.array(labels, dtype=np.int64),
        np.array(times, dtype=np.int64),
    )


def _device_part(store: birdzarr.Store, device: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    index = store.device_indices(device)
    return store.device_windows(device), store.labels[index], store.timestamps[index]


def assert_bit_equal(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.fixture(scope="module")
def csv_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """4 labelled devices of generated exports, 11 parts each (so part 10 must follow part 9)."""
    directory = tmp_path_factory.mktemp("csv")
    _synthetic.make_csv_dir(directory, n_devices=4, bursts_per_device=120, parts=11, seed=3)
    return directory


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_generated_csv_equals_independent_window_curation(
    csv_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    store = birdzarr.convert(csv_dir, tmp_path / "s.zarr", progress=False, chunk_windows=64)
    total = 0
    for device in sorted({int(p.stem.split("_")[0]) for p in csv_dir.glob("*.csv")}):
        parts = sorted(csv_dir.glob(f"{device}_*.csv"), key=_part_number)
        assert [_part_number(p) for p in parts] == list(range(11))
        windows, labels, times = expected_windows(parts)
        got_windows, got_labels, got_times = _device_part(store, device)
        assert_bit_equal(got_windows, windows)
        assert np.array_equal(got_labels, labels)
        assert np.array_equal(got_times, times)
        assert store.device(device).n_windows == len(windows)
        assert store.device(device).first_time == times.min()
        total += len(windows)
    assert len(store) == total
    assert store.meta["curation"]["speed_limit"] == SPEED_LIMIT
    assert store.meta["curation"]["gps_scale"] == GPS_SCALE
    dropped = sum(r.dropped.get("speed_limit", 0) for r in store.report.values())
    assert dropped > 0  # the generator makes ~3% of bursts too fast; they must be dropped, not kept


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_parts_sort_numerically(tmp_path: pathlib.Path) -> None:
    """A burst split over parts 9 and 10 only forms its windows if 10 is read after 9."""
    source = tmp_path / "src"
    source.mkdir()
    raw = _synthetic.raw_device(77, 40, seed=5)
    cuts = np.linspace(0, len(raw.time), 12).astype(int)
    for part in range(11):
        _synthetic.write_csv(raw, source / f"77_{part}.csv", cuts[part], cuts[part + 1])
    store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    parts = sorted(source.glob("*.csv"), key=_part_number)
    windows, _, times = expected_windows(parts)
    assert_bit_equal(store.device_windows(77), windows)
    assert store.device(77).sources == [f"77_{i}.csv" for i in range(11)]


# -- the three real files -----------------------------------------------------------------------


def _row(x: float, y: float, z: float, speed: float) -> list[float]:
    return [x, y, z, speed / GPS_SCALE]


def test_fixture_data_from_db(tmp_path: pathlib.Path) -> None:
    store = birdzarr.convert(FIXTURES / "data_from_db.csv", tmp_path / "s.zarr", progress=False)
    assert len(store) == 3  # one 60-row burst -> three windows
    assert store.devices["device_id"].tolist() == [533]
    assert store.labels[:].tolist() == [-1, -1, -1]
    # 2012-05-15 05:41:52 UTC: 15,475 days after 1970-01-01 plus 20,512 s
    assert store.timestamps[:].tolist() == [1337060512] * 3
    windows = store.windows[:]
    assert (
        windows[0, 0].tolist() == np.array(_row(0.193825, -0.109957, 0.880520, 9.072514), np.float32).tolist()
    )
    assert (
        windows[0, 1].tolist() == np.array(_row(0.209418, -0.093328, 0.904723, 9.072514), np.float32).tolist()
    )
    assert_bit_equal(windows, expected_windows([FIXTURES / "data_from_db.csv"])[0])
    report = store.report[533]
    assert (report.rows_read, report.windows_written, report.mixed_label_windows) == (60, 3, 0)


def test_fixture_slice_w_data_majority_label(tmp_path: pathlib.Path) -> None:
    store = birdzarr.convert(FIXTURES / "slice_w_data.csv", tmp_path / "s.zarr", progress=False)
    assert len(store) == 3
    # window 0 = rows 0-19: nineteen rows of label 2, one of label 8 -> majority 2
    assert store.labels[:].tolist() == [2, 8, 8]
    assert store.timestamps[:].tolist() == [1337060512] * 3
    assert store.report[533].mixed_label_windows == 1
    assert store.meta["mixed_label_policy"] == "majority"
    assert store.device(533).label_counts == {2: 1, 8: 2}
    assert_bit_equal(store.windows[:], expected_windows([FIXTURES / "slice_w_data.csv"])[0])


def test_fixture_data_non_consecutive_index(tmp_path: pathlib.Path) -> None:
    store = birdzarr.convert(FIXTURES / "data.csv", tmp_path / "s.zarr", progress=False)
    assert len(store) == 1  # 20 rows, index column 0,2,0,0,... is ignored
    assert store.devices["device_id"].tolist() == [537]
    assert store.labels[:].tolist() == [-1]
    # 2013-06-06 20:34:11 UTC: 15,862 days plus 74,051 s
    assert store.timestamps[:].tolist() == [1370550851]
    first = np.array(_row(0.36737926, 0.03602193, 1.59495666, 9.84760679), np.float32)
    last = np.array(_row(0.44734759, -0.08300705, 1.26556344, 9.84760679), np.float32)
    assert store.windows[0][0].tolist() == first.tolist()
    assert store.windows[0][19].tolist() == last.tolist()


# -- curation per window ------------------------------------------------------------------------


def _line(device: int, when: str, i: int, x: float, speed: float, label: int = -1) -> str:
    return f"{device},{when},{i},{label},{x:.6f},{-x:.6f},{x / 2:.6f},{speed}\n"


def test_fast_row_mid_burst_drops_only_its_window(tmp_path: pathlib.Path) -> None:
    """Row 25 of a 60-row burst is too fast: window 1 goes, windows 0 and 2 and the next burst
    stay exactly aligned (the old row-level filter shifted everything after row 25)."""
    t1, t2 = "2014-01-01 10:00:00", "2014-01-01 10:05:00"
    lines = [_line(9, t1, i, 0.001 * i, 30.0 if i == 25 else 3.5) for i in range(60)]
    lines += [_line(9, t2, i, 0.001 * (60 + i), 4.0) for i in range(40)]
    path = tmp_path / "9_0.csv"
    path.write_text("".join(lines))
    store = birdzarr.convert(path, tmp_path / "s.zarr", progress=False)
    assert len(store) == 4
    first_x = store.windows[:][:, 0, 0]
    # each window starts at its own row: rows 0, 40 (burst 1), 60, 80 (burst 2)
    assert first_x.tolist() == np.array([0.0, 0.040, 0.060, 0.080], np.float32).tolist()
    assert store.timestamps[:].tolist() == [1388570400, 1388570400, 1388570700, 1388570700]
    assert store.report[9].dropped == {"speed_limit": 1}
    assert_bit_equal(store.windows[:], expected_windows([path])[0])


def test_nan_speed_and_remainders_are_counted(tmp_path: pathlib.Path) -> None:
    t1, t2 = "2014-01-01 10:00:00", "2014-01-01 10:05:00"
    lines = [_line(9, t1, i, 0.01, float("nan") if i == 3 else 1.0) for i in range(59)]  # 2 windows + 19
    lines += [_line(9, t2, i, 0.02, 1.0) for i in range(25)]  # 1 window + 5
    path = tmp_path / "9_0.csv"
    path.write_text("".join(lines))
    store = birdzarr.convert(path, tmp_path / "s.zarr", progress=False)
    assert len(store) == 2
    report = store.report[9]
    assert report.dropped == {"speed_not_finite": 1, "remainder_rows": 24}
    assert report.rows_read == 84


def test_burst_continues_across_parts(tmp_path: pathlib.Path) -> None:
    when = "2015-03-01 00:00:00"
    lines = [_line(5, when, i, 0.001 * i, 2.0) for i in range(40)]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "5_0.csv").write_text("".join(lines[:10]))
    (tmp_path / "src" / "5_1.csv").write_text("".join(lines[10:]))
    store = birdzarr.convert(tmp_path / "src", tmp_path / "s.zarr", progress=False)
    assert len(store) == 2
    assert store.windows[:][:, 0, 0].tolist() == np.array([0.0, 0.020], np.float32).tolist()


def test_clip_and_scale(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "3_0.csv"
    path.write_text(
        "".join(f"3,2016-01-01 00:00:00,{i},-1,{2.5},{-7},{1.999},{22.3012351755624}\n" for i in range(20))
    )
    store = birdzarr.convert(path, tmp_path / "s.zarr", progress=False)
    assert store.windows[0][0].tolist() == [2.0, -2.0, np.float32(1.999), 1.0]


# -- a file cut off inside its last line --------------------------------------------------------


def _cut_export(tmp_path: pathlib.Path) -> pathlib.Path:
    """Two parts of device 9: part 0 whole, part 1 cut inside its last field (1.910000 -> 1.)."""
    t1, t2 = "2014-01-01 10:00:00", "2014-01-01 10:05:00"
    source = tmp_path / "src"
    source.mkdir()
    (source / "9_0.csv").write_text("".join(_line(9, t1, i, 0.001 * i, 3.5) for i in range(40)))
    text = "".join(_line(9, t2, i, 0.002 * i, 1.91) for i in range(40)).replace(",1.91\n", ",1.910000\n")
    assert text.endswith(",1.910000\n")
    (source / "9_1.csv").write_text(text[: -len("910000\n")])  # "...,1." and no newline
    return source


def test_a_file_cut_inside_its_last_line_is_an_error(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from birdzarr.cli import main

    source = _cut_export(tmp_path)
    expected = (
        f"{source / '9_1.csv'}, line 40: the file ends inside this line: no newline follows it and "
        "its gps_speed '1.' has 0 decimals where the line before has 6, so the file looks cut off "
        "(copy it again from its origin; if the line is complete, end the file with a newline). "
        "Fix or remove that line, or pass --on-bad-rows skip (Python: on_bad_rows='skip') to skip "
        "bad lines and count them in the report."
    )
    with pytest.raises(birdzarr.BadInputError) as caught:
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    assert str(caught.value) == expected
    assert not (tmp_path / "s.zarr").exists()
    assert main(["convert", str(source), str(tmp_path / "s.zarr"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"birdzarr convert: error: {expected}\n"
    # fewer fields than the line before: the same error, naming the fields
    cut = source / "9_1.csv"
    cut.write_text(cut.read_text()[: -len("-0.039000,1.")])
    with pytest.raises(birdzarr.BadInputError, match=r"9_1.csv, line 40: .* it has 6 of the 8 fields"):
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)


def test_a_file_cut_inside_its_last_line_skips_that_line(tmp_path: pathlib.Path) -> None:
    source = _cut_export(tmp_path)
    store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False, on_bad_rows="skip")
    report = store.report[9]
    assert report.bad_lines == 1 and report.rows_read == 80
    # the cut line's window (rows 20..39 of the second burst) is dropped; a speed of 1.0 is not stored
    assert len(store) == 3 and report.dropped == {"bad_rows": 1}
    assert store.timestamps[:].tolist() == [1388570400, 1388570400, 1388570700]
    assert report.problems == [
        f"{source / '9_1.csv'}, line 40: the file ends inside this line: no newline follows it and its "
        "gps_speed '1.' has 0 decimals where the line before has 6, so the file looks cut off (copy it "
        "again from its origin; if the line is complete, end the file with a newline) (skipped)"
    ]


def test_a_complete_last_line_without_a_newline_is_read(tmp_path: pathlib.Path) -> None:
    """Real exports end without a newline (tests/data/data_from_db.csv): a complete last line is
    read, also when its number is shorter than the line before's only in its integer part."""
    text = "".join(_line(9, "2014-01-01 10:00:00", i, 0.001 * i, 12.5 if i < 19 else 3.25) for i in range(20))
    assert not (FIXTURES / "data_from_db.csv").read_bytes().endswith(b"\n")
    path = tmp_path / "9_0.csv"
    path.write_text(text.rstrip("\n"))
    store = birdzarr.convert(path, tmp_path / "s.zarr", progress=False)
    assert len(store) == 1 and store.report[9].bad_lines == 0
    assert store.windows[0][-1][3] == np.float32(3.25 / GPS_SCALE)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_progress_in_a_log_starts_with_work_done_not_an_empty_bar(
    csv_dir: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """stderr is not a terminal here (a log): tqdm's empty start ("0.00 windows [00:00, ?]")
    and a reset bar write no line; a short conversion writes its final line only."""
    from birdzarr._progress import progress_bar
    from birdzarr.cli import main

    assert main(["convert", str(csv_dir), str(tmp_path / "s.zarr")]) == 0
    store = birdzarr.open_store(tmp_path / "s.zarr")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert csv: ") and "0.00" not in lines[0], lines
    assert lines[0].startswith(f"convert csv: {len(store)} windows ["), lines
    with progress_bar(True, desc="nothing", unit=" windows"):
        pass
    with progress_bar(True, desc="pass", total=5, unit=" windows") as bar:
        bar.update(5)
        bar.reset(total=7)
        bar.update(7)
    lines = capsys.readouterr().err.splitlines()  # nothing from "nothing", nor from the reset
    assert len(lines) == 1 and lines[0].startswith("pass: 100%|") and "7.00/7.00" in lines[0], lines
