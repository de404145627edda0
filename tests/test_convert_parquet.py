"""Parquet input: an exact copy, streamed; identical stores whatever the worker count."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import birdzarr
from birdzarr import TIMESTAMP_UNKNOWN, BadInputError
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.format import _v2


def _documented_decode(path: pathlib.Path) -> np.ndarray:
    """A format-2 store's windows as docs/format.md decodes them: zarr-python and numpy only."""
    import zarr

    z = zarr.open_group(str(path), mode="r")
    codes, row, start, values = z[_v2.CODES][:], z[_v2.ROW][:], z[_v2.START][:], z[_v2.VALUES][:]
    windows = np.empty((len(row), 20, 4), np.float32)
    windows[:, :, :3] = values[start[row][:, None, :] + codes]
    windows[:, :, 3] = z[_v2.GPS][:]
    return windows


def _write(windows: np.ndarray, path: pathlib.Path, **options: object) -> None:
    """Written here with pyarrow directly, not with birdzarr's helper."""
    column = pa.array(
        [row.tolist() for row in windows.reshape(len(windows), 80)], type=pa.list_(pa.float32())
    )
    pq.write_table(pa.table({"gimu": column}), path, **options)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def truth_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, dict[int, np.ndarray]]:
    """Three devices; one spans several row groups and batches; special float values included."""
    directory = tmp_path_factory.mktemp("pq")
    rng = np.random.default_rng(11)
    truth = {
        4: rng.standard_normal((5000, 20, 4)).astype(np.float32),
        12: _synthetic.curated_windows(37, seed=2),
        300: rng.integers(-3, 3, (2500, 20, 4)).astype(np.float32),
    }
    truth[4][0, 0] = [-0.0, np.float32(1e-45), np.float32(3.4e38), np.float32(-3.4e38)]
    for device, windows in truth.items():
        _write(windows, directory / f"{device}.parquet", row_group_size=1700)
    return directory, truth


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_parquet_round_trip_is_bit_exact(
    truth_dir: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path
) -> None:
    directory, truth = truth_dir
    store = birdzarr.convert(directory, tmp_path / "s.zarr", chunk_windows=1000, progress=False)
    assert store.format_version == 2
    assert len(store) == sum(len(w) for w in truth.values())
    assert store.devices["device_id"].tolist() == [4, 12, 300]
    expected = np.concatenate([truth[d] for d in (4, 12, 300)])
    assert np.array_equal(store.windows[:].view(np.uint32), expected.view(np.uint32))
    for device, windows in truth.items():
        got = store.device_windows(device)
        assert np.array_equal(got.view(np.uint32), windows.view(np.uint32))
        entry = store.device(device)
        assert entry.n_windows == len(windows)
        assert entry.first_time == TIMESTAMP_UNKNOWN
        assert entry.sources == [f"{device}.parquet"]
    assert (store.timestamps[:] == TIMESTAMP_UNKNOWN).all()
    assert (store.labels[:] == -1).all()
    codes = store.group[_v2.CODES]
    assert codes.shape == (len(store), 20, 3)
    assert codes.metadata.dimension_names == ("window", "sample", "channel")
    # plain zarr-python and numpy decode the same values with the documented lines
    decoded = _documented_decode(tmp_path / "s.zarr")
    assert np.array_equal(decoded.view(np.uint32), expected.view(np.uint32))


def _chunk_files(root: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "zarr.json" and not p.name.startswith(".")
    }


@pytest.mark.slow
def test_worker_count_does_not_change_the_store(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path
) -> None:
    directory, _ = parquet_source
    one = birdzarr.convert(directory, tmp_path / "one.zarr", workers=1, chunk_windows=2048, progress=False)
    two = birdzarr.convert(directory, tmp_path / "two.zarr", workers=2, chunk_windows=2048, progress=False)
    files_one, files_two = _chunk_files(tmp_path / "one.zarr"), _chunk_files(tmp_path / "two.zarr")
    assert len(files_one) > 4 * 10
    assert files_one == files_two
    assert one.meta["devices"] == two.meta["devices"]
    for name in (*_v2.ARRAYS, "device", "timestamp", "label"):
        assert (tmp_path / "one.zarr" / name / "zarr.json").read_bytes() == (
            tmp_path / "two.zarr" / name / "zarr.json"
        ).read_bytes()


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_fast_write_path_matches_zarr(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path
) -> None:
    """Chunks the converter writes itself are byte-identical to zarr-python writing the same data."""
    import zarr

    directory, _ = parquet_source
    store = birdzarr.convert(directory, tmp_path / "s.zarr", chunk_windows=4096, progress=False)
    # the arrays written, with the tail of a window chunk's key ("c/<i>/0/0" for a (N, 20, k) array);
    # None for format 2's dictionary arrays, whose chunks do not follow the windows
    names: dict[str, tuple[str, ...] | None] = {
        _v2.CODES: ("0", "0"), _v2.GPS: ("0",), _v2.ROW: (), _v2.VALUES: None, _v2.START: None,
        _v2.DEVICE: None}
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="r+", zarr_format=3)
    rewritten = {}
    for name, tail in names.items():
        copy = group[name]
        data = copy[:]
        with zarr.config.set({"array.write_empty_chunks": True}):  # the converter stores every chunk
            copy[:] = data  # rewrite every chunk through zarr-python
        for i in range(-(-len(store) // 4096) if tail is not None else 0):
            path = tmp_path.joinpath("s.zarr", name, "c", str(i), *tail)
            assert path.is_file(), path
        rewritten[name] = _chunk_files(tmp_path / "s.zarr" / name)
    again = birdzarr.convert(directory, tmp_path / "t.zarr", chunk_windows=4096, progress=False)
    for name in names:
        assert _chunk_files(tmp_path / "t.zarr" / name) == rewritten[name], name
    assert len(again) == len(store)


def test_device_table_and_report(
    small_store: birdzarr.Store, parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]]
) -> None:
    _, truth = parquet_source
    start = 0
    for device in sorted(truth):
        entry = small_store.device(device)
        assert [(r.start, r.stop) for r in entry.ranges] == [(start, start + len(truth[device]))]
        start += len(truth[device])
        report = small_store.report[device]
        assert report.rows_read == report.windows_written == len(truth[device])
    assert small_store.meta["committed"]["n_windows"] == len(small_store)
    assert small_store.meta["format_version"] == birdzarr.FORMAT_VERSION
    assert small_store.meta["layout"]["chunk_windows"] == 1024


# -- columns beside gimu: label, timestamp and device_id are read, any other is named ---------------


def _gimu(windows: np.ndarray) -> pa.Array:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)


def _labelled_table(n: int, *, device: int | None = None) -> tuple[pa.Table, np.ndarray]:
    windows = _synthetic.curated_windows(n, seed=4)
    times = pa.array([1_400_000_000_123 + 1000 * i if i != 2 else None for i in range(n)],
                     pa.timestamp("ms", tz="UTC"))
    columns = {"gimu": _gimu(windows), "label": pa.array([i % 5 if i != 1 else None for i in range(n)],
                                                          pa.int16()),
               "timestamp": times}
    if device is not None:
        columns["device_id"] = pa.array([device] * n, pa.int64())
    return pa.table(columns), windows


@pytest.mark.parametrize("name", ["12.parquet", "part-0.parquet"])
def test_label_and_timestamp_columns_are_read(tmp_path: pathlib.Path, name: str) -> None:
    source = tmp_path / "src"
    source.mkdir()
    table, windows = _labelled_table(6, device=None if name[0].isdigit() else 12)
    pq.write_table(table, source / name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", birdzarr.IgnoredColumnsWarning)
        store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    assert store.labels[:].tolist() == [0, -1, 2, 3, 4, 0]
    expected = [1_400_000_000 + i for i in range(6)]
    expected[2] = birdzarr.TIMESTAMP_UNKNOWN
    assert store.timestamps[:].tolist() == expected
    assert np.array_equal(store.windows[:], windows)
    assert "ignored_columns" not in store.meta["report"]


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_integer_seconds_timestamps_and_bad_label_types(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    windows = _synthetic.curated_windows(3, seed=4)
    table = pa.table({"gimu": _gimu(windows), "timestamp": pa.array([10, -5, 7], pa.int64())})
    pq.write_table(table, source / "4.parquet")
    assert birdzarr.convert(source, tmp_path / "s.zarr", progress=False).timestamps[:].tolist() == [10, -5, 7]
    table = pa.table({"gimu": _gimu(windows), "label": pa.array(["a", "b", "c"])})
    pq.write_table(table, source / "4.parquet")
    with pytest.raises(BadInputError, match="column 'label' has type string, expected an integer type"):
        birdzarr.convert(source, tmp_path / "t.zarr", progress=False)
    table = pa.table({"gimu": _gimu(windows), "label": pa.array([1, 2**40, 3], pa.int64())})
    pq.write_table(table, source / "4.parquet")
    with pytest.raises(BadInputError, match=r"column 'label' holds values from 1 to 1099511627776, outside"):
        birdzarr.convert(source, tmp_path / "t.zarr", progress=False)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_other_columns_are_named_in_the_report_and_a_warning(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "src"
    source.mkdir()
    table, _ = _labelled_table(5, device=3)
    pq.write_table(table.append_column("speed_kmh", pa.array([1.0] * 5)), source / "part-0.parquet")
    pq.write_table(table.drop_columns(["device_id"]).append_column("note", pa.array(["x"] * 5)),
                   source / "4.parquet")
    with pytest.warns(birdzarr.IgnoredColumnsWarning,
                      match=r"2 input file\(s\) \(4.parquet, part-0.parquet\) have columns birdzarr does not "
                            r"read: 'note', 'speed_kmh'"):
        store = birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    assert "meta" not in store.__dict__  # warned from the root attributes: no device table parsed
    assert store.meta["report"]["ignored_columns"] == {"note": ["4.parquet"], "speed_kmh": ["part-0.parquet"]}
    assert main(["convert", str(source), str(tmp_path / "t.zarr"), "--quiet"]) == 0
    assert "columns not read (see the warning): note, speed_kmh" in capsys.readouterr().out


def test_nested_lists_get_the_flattening_hint_not_rounding(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    nested = pa.array([[[0.5] * 4] * 20], type=pa.list_(pa.list_(pa.float32())))
    pq.write_table(pa.table({"gimu": nested}), source / "3.parquet")
    with pytest.raises(birdzarr.BadInputError) as raised:
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
    message = str(raised.value)
    assert "has type list<element: list<element: float>>, expected list<float32> of 80 values" in message
    assert "flatten each row's nested lists" in message and "rounding" not in message
    pq.write_table(pa.table({"gimu": pa.array([[0.5] * 80], pa.list_(pa.float64()))}), source / "3.parquet")
    with pytest.raises(birdzarr.BadInputError, match="if rounding is acceptable"):
        birdzarr.convert(source, tmp_path / "s.zarr", progress=False)
