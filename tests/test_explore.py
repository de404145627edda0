"""Exploration: summaries, device table, window access, the xarray view, plots, stats and CLI.

Truth is computed here from the generated raw data, independently of the converter: the CSV
window rule (20 consecutive rows of one burst, a whole window dropped when any speed >= 30 m/s,
imu clipped to [-2, 2], gps_speed / 22.3012351755624) and the exact Parquet windows.
"""

from __future__ import annotations

import html
import json
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import pytest
from s3_support import moto, new_bucket, s3_options  # noqa: F401  (moto is a fixture)

import birdzarr
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.explore import _stats
from birdzarr.format._spec import GIMU_DIMS_BEFORE_SAMPLE, TIMESTAMP_UNKNOWN
from birdzarr.storage import _location as _storage

pytest.importorskip("matplotlib")
pytest.importorskip("xarray")

GPS_SCALE = 22.3012351755624


@dataclass
class DeviceTruth:
    windows: np.ndarray  # float32 (n, 20, 4), curated
    labels: np.ndarray  # int (n,)
    times: np.ndarray  # int64 unix seconds (n,)
    sources: list[str]


def csv_truth(raw: _synthetic.RawDevice, parts: int) -> DeviceTruth:
    """Window-level curation of one device's raw rows, as the CONTEXT.md rule states it."""
    # The CSV text holds 8 decimals for imu and 6 for speed: start from what the file says.
    values = np.column_stack([np.round(raw.values[:, :3], 8), np.round(raw.values[:, 3], 6)])
    windows, labels, times = [], [], []
    burst_starts = np.flatnonzero(np.r_[True, raw.time[1:] != raw.time[:-1]])
    burst_stops = np.r_[burst_starts[1:], len(raw.time)]
    for start, stop in zip(burst_starts, burst_stops, strict=True):
        for w in range(start, stop - 19, 20):
            rows = values[w : w + 20]
            if not np.all(np.isfinite(rows[:, 3])) or np.any(rows[:, 3] >= 30.0):
                continue
            curated = np.empty((20, 4))
            curated[:, :3] = np.clip(rows[:, :3], -2.0, 2.0)
            curated[:, 3] = rows[:, 3] / GPS_SCALE
            windows.append(curated)
            labels.append(raw.label[w])
            times.append(raw.time[w])
    return DeviceTruth(
        windows=np.asarray(windows, dtype=np.float32), labels=np.asarray(labels), times=np.asarray(times),
        sources=[f"{raw.device_id}_{p}.csv" for p in range(parts)],
    )


@pytest.fixture(scope="module")
def csv_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[birdzarr.Store, dict[int, DeviceTruth]]:
    """A labelled CSV store with timestamps, 128-window chunks so devices span several chunks."""
    root = tmp_path_factory.mktemp("explore_csv")
    raws = _synthetic.make_csv_dir(root / "csv", n_devices=4, bursts_per_device=120, parts=2, seed=5)
    store = birdzarr.convert(root / "csv", root / "csv.zarr", chunk_windows=128, progress=False)
    return store, {device: csv_truth(raw, parts=2) for device, raw in raws.items()}


@pytest.fixture(scope="module")
def parquet_case(parquet_source, tmp_path_factory) -> tuple[birdzarr.Store, dict[int, np.ndarray]]:  # type: ignore[no-untyped-def]
    """The shared Parquet source in a store of our own."""
    directory, truth = parquet_source
    dest = tmp_path_factory.mktemp("explore_pq") / "pq.zarr"
    return birdzarr.convert(directory, dest, chunk_windows=1024, progress=False), truth


class ReadCounter:
    """Counts chunk decodes of one store (every chunk read goes through ChunkReader.read)."""

    def __init__(self, store: birdzarr.Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int]] = []
        original = store.reader.read

        def counted(name: str, index: int) -> np.ndarray:
            self.calls.append((name, index))
            return original(name, index)

        monkeypatch.setattr(store.reader, "read", counted)


def parquet_case_source(store: birdzarr.Store) -> str:
    """The Parquet directory a store was converted from (recorded in its report)."""
    return str(store.meta["report"]["source"])


def fresh(store: birdzarr.Store) -> birdzarr.Store:
    return birdzarr.open_store(store.location.path)


def copy_of(store: birdzarr.Store, directory: pathlib.Path) -> birdzarr.Store:
    """The store copied to a directory of the test's own (for tests that look at its stats cache)."""
    path = directory / pathlib.Path(store.location.path).name
    store.location.fs.cp(store.location.path, str(path), recursive=True)
    return birdzarr.open_store(path)


# -- summaries -------------------------------------------------------------------------------


def test_text_and_html_summaries_name_the_facts_without_reading_chunks(csv_case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store, truth = csv_case
    reads = ReadCounter(store, monkeypatch)
    text = repr(store)
    page = store._repr_html_()
    assert reads.calls == []
    n = sum(len(t.windows) for t in truth.values())
    first = min(int(t.times.min()) for t in truth.values())
    last = max(int(t.times.max()) for t in truth.values())
    first_text = str(np.datetime64(first, "s")).replace("T", " ")
    last_text = str(np.datetime64(last, "s")).replace("T", " ")
    assert text.splitlines()[0] == f"<birdzarr.Store {store.url}: {n:,} windows, {len(truth)} devices>"
    for fact in (first_text, last_text, "codec uint16 codes + dictionaries (core Zarr v3 codecs)",
                 "128 windows", "format v2", "gps_speed >= 30 m/s",
                 f"{n:,} windows labelled (10 classes)"):
        assert fact in text
        assert html.escape(fact) in page
    for device in truth:
        assert f"{device} (" in text
        assert f"<td class='num'>{device}</td>" in page
    assert page.count("<table>") == 2 and "<details>" in page


def test_summary_of_a_parquet_store_says_times_and_labels_are_unknown(parquet_case) -> None:  # type: ignore[no-untyped-def]
    store, truth = parquet_case
    text = repr(store)
    assert "unknown (the source has no timestamps)" in text
    assert f"none ({len(store):,} windows unlabelled)" in text
    assert "... 4 more" in text  # 12 devices, 8 named inline
    assert "<th>curation</th><td>done before conversion (values copied exactly)</td>" in store._repr_html_()


# -- device table and window access ------------------------------------------------------------


def test_device_table_matches_converter_report_and_truth(csv_case) -> None:  # type: ignore[no-untyped-def]
    store, truth = csv_case
    table = store.devices
    report = store.report
    assert list(table.columns) == ["device_id", "n_windows", "first_time", "last_time", "n_ranges",
                                   "label_counts", "sources"]
    assert list(table["device_id"]) == sorted(truth)
    assert table.index.equals(pd.RangeIndex(len(truth)))  # device_id is a column only
    assert list(table.reset_index()["index"]) == list(range(len(truth)))
    by_id = table.set_index("device_id")
    for device, t in truth.items():
        row = by_id.loc[device]
        assert row["n_windows"] == len(t.windows) == report[device].windows_written
        assert row["first_time"] == np.datetime64(int(t.times.min()), "s")
        assert row["last_time"] == np.datetime64(int(t.times.max()), "s")
        labels, counts = np.unique(t.labels, return_counts=True)
        assert row["label_counts"] == dict(zip(labels.tolist(), counts.tolist(), strict=True))
        assert row["sources"] == t.sources
    assert table["n_windows"].sum() == len(store)


def test_device_windows_and_global_slices_equal_the_truth(csv_case, parquet_case) -> None:  # type: ignore[no-untyped-def]
    store, truth = csv_case
    for device, t in truth.items():
        np.testing.assert_allclose(store.device_windows(device), t.windows, rtol=1e-6, atol=1e-7)
    # Global order is device order: concatenated truth, sliced across chunk boundaries (128).
    ordered = [truth[d] for d in sorted(truth)]
    windows = np.concatenate([t.windows for t in ordered])
    labels = np.concatenate([t.labels for t in ordered])
    times = np.concatenate([t.times for t in ordered])
    for start, stop in ((0, 16), (120, 260), (len(store) - 5, len(store))):
        np.testing.assert_allclose(store.windows[start:stop], windows[start:stop], rtol=1e-6, atol=1e-7)
        assert np.array_equal(store.labels[start:stop], labels[start:stop])
        assert np.array_equal(store.timestamps[start:stop], times[start:stop])
    picks = np.array([300, 3, 129, 3])
    np.testing.assert_allclose(store.windows[picks], windows[picks], rtol=1e-6, atol=1e-7)

    pq_store, pq_truth = parquet_case
    pq_windows = np.concatenate([pq_truth[d] for d in sorted(pq_truth)])
    for device, expected in pq_truth.items():
        assert np.array_equal(pq_store.device_windows(device).view(np.uint32), expected.view(np.uint32))
    assert np.array_equal(pq_store.windows[1000:1016].view(np.uint32), pq_windows[1000:1016].view(np.uint32))
    assert np.all(pq_store.timestamps[:100] == TIMESTAMP_UNKNOWN)


# -- xarray --------------------------------------------------------------------------------------


def test_to_xarray_dims_coords_and_values(csv_case) -> None:  # type: ignore[no-untyped-def]
    store, truth = csv_case
    ds = store.to_xarray()
    assert ds.gimu.dims == ("window", "sample", "channel")
    assert dict(ds.sizes) == {"window": len(store), "sample": 20, "channel": 4}
    assert list(ds.channel.values) == ["imu_x", "imu_y", "imu_z", "gps_speed"]
    assert ds.time.dims == ("window",) and ds.time.dtype == np.dtype("datetime64[s]")
    assert ds.gimu.dtype == np.float32
    assert ds.gimu.attrs == {"long_name": "curated sensor windows", "channels": list(birdzarr.CHANNELS),
                             "units": ["g", "g", "g", "m/s divided by gps_scale"], "gps_scale": GPS_SCALE}
    assert "units" not in ds.time.attrs  # datetime64 carries its unit; an attribute would block to_zarr
    ordered = [truth[d] for d in sorted(truth)]
    devices = np.concatenate([np.full(len(truth[d].windows), d) for d in sorted(truth)])
    assert np.array_equal(ds.device.values, devices)
    assert np.array_equal(ds.time.values, np.concatenate([t.times for t in ordered]).astype("datetime64[s]"))
    assert np.array_equal(ds.label.values, np.concatenate([t.labels for t in ordered]))
    assert np.array_equal(ds.gimu.values, store.windows[:])
    # Outer indexing along every axis, including a scattered window vector.
    picked = ds.gimu.isel(window=[5, 300, 129], sample=slice(2, 6), channel=[0, 3]).values
    assert np.array_equal(picked, store.windows[np.array([5, 300, 129])][:, 2:6][:, :, [0, 3]])
    assert np.array_equal(ds.gimu[7, :, 1].values, store.windows[7][:, 1])
    one_device = ds.where(ds.device == sorted(truth)[1], drop=True)
    np.testing.assert_allclose(one_device.gimu.values, ordered[1].windows, rtol=1e-6, atol=1e-7)


@pytest.mark.filterwarnings("error")
def test_to_xarray_selects_by_burst_time(csv_case) -> None:  # type: ignore[no-untyped-def]
    """Burst times repeat and restart at each device: sel compares them, it needs no sorting."""
    store, truth = csv_case
    ds = store.to_xarray()
    times = store.timestamps[:].astype("datetime64[s]")
    windows = store.windows[:]

    def selected(result: Any, mask: np.ndarray) -> None:
        assert np.array_equal(result.time.values, times[mask])
        assert np.array_equal(result.gimu.values, windows[mask])

    some = times[700]
    selected(ds.sel(time=some), times == some)  # exact: every window of that burst, window dim kept
    assert ds.sel(time=some).sizes["window"] == int((times == some).sum()) >= 1
    selected(ds.sel(time=[times[3], times[800]]), (times == times[3]) | (times == times[800]))
    day = str(times[0])[:10]  # a date string means the whole day, as in pandas
    start = np.datetime64(day, "s")
    day_mask = (times >= start) & (times < start + np.timedelta64(1, "D"))
    selected(ds.sel(time=day), day_mask)
    hour = str(times[40])[:13]
    begin = np.datetime64(hour, "s")
    selected(ds.sel(time=hour), (times >= begin) & (times < begin + np.timedelta64(1, "h")))
    low, high = np.sort(times)[[100, 400]]
    range_mask = (times >= low) & (times <= high)  # both ends included, across all four devices
    assert len(np.unique(store.window_devices[:][range_mask])) == len(truth)
    selected(ds.sel(time=slice(str(low), str(high))), range_mask)
    selected(ds.sel(time=slice(low, None)), times >= low)
    assert ds.sel(time=slice("1990-01-01", "1990-02-01")).sizes["window"] == 0
    with pytest.raises(KeyError, match="no window has burst time '1990-01-01'"):
        ds.sel(time="1990-01-01")
    with pytest.raises(NotImplementedError, match="method="):
        ds.sel(time=some, method="nearest")
    # After isel the index covers the selected windows only; a swap needs the index dropped first.
    part = ds.isel(window=slice(200, 600))
    in_part = np.zeros(len(times), bool)
    in_part[200:600] = True
    selected(part.sel(time=day), in_part & day_mask)
    swapped = ds.drop_indexes(["window", "time"]).swap_dims(window="time")
    assert swapped.gimu.dims == ("time", "sample", "channel")
    assert np.array_equal(swapped.time.values, times)
    # Arrays of one Dataset align without reading the timestamps again.
    assert (ds.gimu.isel(window=slice(0, 10)) - ds.gimu.isel(window=slice(0, 10))).sizes["window"] == 10


def test_to_xarray_is_lazy_and_reads_only_touched_chunks(csv_case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = fresh(csv_case[0])
    reads = ReadCounter(store, monkeypatch)
    ds = store.to_xarray()
    repr(ds)
    ds._repr_html_()
    subset = ds.isel(window=slice(250, 260))
    repr(subset)
    assert reads.calls == []  # building, displaying and selecting read nothing
    window_values = subset.gimu.variable.values  # the data variable alone, not its coordinates
    assert window_values.shape == (10, 20, 4)
    assert reads.calls == [("gimu", 1), ("gimu", 2)]  # windows 250..259 span chunks 1 and 2 (128 each)
    reads.calls.clear()
    assert not np.isnat(ds.time[700].values)
    assert reads.calls == [("timestamp", 700 // 128)]
    reads.calls.clear()
    subset.sel(time=slice(None, "2100-01-01"))  # the first sel reads the subset's timestamps only
    assert reads.calls == [("timestamp", 1), ("timestamp", 2)]
    reads.calls.clear()
    subset.sel(time=slice("2000-01-01", None))  # then they are kept
    assert reads.calls == []


def test_to_xarray_of_a_store_written_before_the_sample_rename(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Stores written before the rename call the sample axis "time" on disk; the view says "sample"."""
    from tests.format1_support import format1_copy

    # a store of that time is a version-1 store (a ``gimu`` array): one from CSV
    old = format1_copy("appended.zarr", tmp_path)
    gimu_meta = old / "gimu" / "zarr.json"
    meta = json.loads(gimu_meta.read_text())
    meta["dimension_names"] = list(GIMU_DIMS_BEFORE_SAMPLE)
    meta["attributes"] = {"channels": list(birdzarr.CHANNELS)}  # nor did they carry units
    gimu_meta.write_text(json.dumps(meta))
    for name in ("device", "timestamp", "label"):
        array_meta = old / name / "zarr.json"
        array_meta.write_text(json.dumps({**json.loads(array_meta.read_text()), "attributes": {}}))
    reopened = birdzarr.open_store(old)
    assert reopened.gimu.metadata.dimension_names == GIMU_DIMS_BEFORE_SAMPLE == ("window", "time", "channel")
    ds = reopened.to_xarray()
    assert ds.gimu.dims == ("window", "sample", "channel")
    assert ds.gimu.attrs["units"] == ["g", "g", "g", "m/s divided by gps_scale"]
    times = reopened.timestamps[:].astype("datetime64[s]")
    assert np.array_equal(ds.sel(time=times[9]).gimu.values, reopened.windows[:][times == times[9]])


def test_parquet_store_times_are_nat(parquet_case) -> None:  # type: ignore[no-untyped-def]
    ds = parquet_case[0].to_xarray()
    assert np.all(np.isnat(ds.time[:50].values))
    assert np.all(ds.label[:50].values == -1)
    assert ds.sel(time=slice(None, None)).sizes["window"] == 0  # unknown times are never selected


# -- plots ---------------------------------------------------------------------------------------


def test_plot_window_draws_the_window_in_physical_units(csv_case) -> None:  # type: ignore[no-untyped-def]
    store, _ = csv_case
    index = 131
    window = store.windows[index]
    fig = store.plot_window(index)
    imu_ax, gps_ax = fig.axes
    assert [line.get_label() for line in imu_ax.lines] == ["imu_x", "imu_y", "imu_z"]
    for channel, line in enumerate(imu_ax.lines):
        assert np.array_equal(line.get_xdata(), np.arange(20))
        assert np.array_equal(line.get_ydata(), window[:, channel])
    np.testing.assert_allclose(gps_ax.lines[0].get_ydata(), window[:, 3] * GPS_SCALE, rtol=1e-6)
    assert imu_ax.get_ylabel() == "acceleration (g)" and gps_ax.get_ylabel() == "speed (m/s)"
    assert gps_ax.get_xlabel() == "sample within the window"
    assert [t.get_text() for t in imu_ax.get_legend().get_texts()] == ["imu_x", "imu_y", "imu_z"]
    device, label = int(store.window_devices[index]), int(store.labels[index])
    title = fig.get_suptitle()
    assert title.startswith(f"window {index}: device {device}, 2012-") and title.endswith(f"label {label}")
    assert store.plot_window(-1).get_suptitle().startswith(f"window {len(store) - 1:,}:")


@pytest.mark.slow
def test_plot_device_shows_means_by_label_and_spread(csv_case) -> None:  # type: ignore[no-untyped-def]
    store, truth = csv_case
    device = sorted(truth)[2]
    t = truth[device]
    fig = store.plot_device(device, max_windows=40)
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == ["imu_x (g)", "imu_y (g)", "imu_z (g)", "gps_speed (m/s)"]
    assert axes[-1].get_xlabel() == "burst time (UTC)"
    assert fig.get_suptitle().startswith(f"device {device}: 40 of {len(t.windows):,} windows")
    positions = np.unique(np.linspace(0, len(t.windows) - 1, 40).round().astype(int))
    expected = t.windows[positions].astype(np.float64).mean(axis=1)
    expected[:, 3] *= GPS_SCALE
    for channel, ax in enumerate(axes):
        points = np.concatenate([c.get_offsets() for c in ax.collections[1:]])  # [0] is the min..max bars
        assert len(points) == 40
        np.testing.assert_allclose(np.sort(points[:, 1]), np.sort(expected[:, channel]), rtol=1e-5, atol=1e-6)
    legend = [text.get_text() for text in fig.legends[0].get_texts()]
    assert legend[0] == "min..max of the 20 samples"
    assert set(legend[1:]) == {f"label {v}" for v in np.unique(t.labels[positions])}
    # Concise date ticks (the day, with month and year once) instead of full dates that collide.
    import matplotlib.dates as mdates

    assert isinstance(axes[-1].xaxis.get_major_formatter(), mdates.ConciseDateFormatter)
    fig.canvas.draw()
    ticks = [tick.get_text() for tick in axes[-1].get_xticklabels() if tick.get_text()]
    assert len(ticks) >= 3 and all(len(text) <= 6 for text in ticks), ticks  # "May-15", "12:00"
    assert axes[-1].xaxis.get_major_formatter().get_offset().startswith("2012-")  # the year, once

    names = {int(v): f"behaviour {v}" for v in np.unique(t.labels)}
    named = store.plot_device(device, max_windows=40, label_names=names)
    legend = [text.get_text() for text in named.legends[0].get_texts()]
    assert set(legend[1:]) == {f"behaviour {v} ({v})" for v in np.unique(t.labels[positions])}
    partial = store.plot_device(device, max_windows=40, label_names={int(t.labels[positions][0]): "x"})
    assert "label" in " ".join(text.get_text() for text in partial.legends[0].get_texts())  # others keep ids


@pytest.mark.slow
def test_plot_device_without_timestamps_uses_global_indices(parquet_case, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """No times: the x axis is the global window index, ascending, and says what order that is."""
    store, truth = parquet_case
    device = min(truth, key=lambda d: len(truth[d]))
    fig = store.plot_device(device, max_windows=10_000)
    assert fig.axes[-1].get_xlabel() == (
        "global window index (stored order, as in the source; the source has no timestamps)")
    points = fig.axes[0].collections[1].get_offsets()
    assert np.array_equal(np.asarray(points[:, 0]), store.device_indices(device))

    shuffled = birdzarr.convert(parquet_case_source(store), tmp_path / "shuffled.zarr", shuffle=True, seed=1,
                                chunk_windows=1024, progress=False)
    fig = shuffled.plot_device(device, max_windows=10_000)
    assert fig.axes[-1].get_xlabel() == (
        "global window index (shuffled store: a random order, not time; the source has no timestamps)")
    x = np.asarray(fig.axes[0].collections[1].get_offsets()[:, 0])
    assert np.array_equal(x, shuffled.device_indices(device)) and np.all(np.diff(x) > 0)
    means = np.asarray(fig.axes[0].collections[1].get_offsets()[:, 1])
    imu_x = shuffled.windows[x.astype(np.int64)][:, :, 0].astype(np.float64)
    np.testing.assert_allclose(means, imu_x.mean(axis=1), rtol=1e-6)


def test_plot_window_names_the_label(csv_case) -> None:  # type: ignore[no-untyped-def]
    store, _ = csv_case
    label = int(store.labels[131])
    assert store.plot_window(131, label_names={label: "flying"}).get_suptitle().endswith(f"flying ({label})")


@pytest.fixture(scope="module")
def months_case(tmp_path_factory: pytest.TempPathFactory) -> tuple[birdzarr.Store, birdzarr.Store]:
    """One labelled device whose bursts span 2012-05-15 .. 2012-09-16, in device order and shuffled."""
    root = tmp_path_factory.mktemp("explore_months")
    (root / "csv").mkdir()
    raw = _synthetic.raw_device(300, 300, seed=1, labelled=True)
    raw.time[:] = raw.time[0] + (raw.time - raw.time[0]) * 20  # bursts days apart instead of minutes
    _synthetic.write_csv(raw, root / "csv" / "300_0.csv")
    ordered = birdzarr.convert(root / "csv", root / "ordered.zarr", chunk_windows=64, progress=False)
    shuffled = birdzarr.convert(root / "csv", root / "shuffled.zarr", chunk_windows=64, shuffle=True, seed=3,
                                progress=False)
    return ordered, shuffled


def _plotted_times(fig: Any) -> np.ndarray:
    import matplotlib.dates as mdates

    points = np.concatenate([c.get_offsets() for c in fig.axes[0].collections[1:]])
    days = np.sort(np.asarray(points[:, 0], dtype=np.float64))
    return np.array([np.datetime64(mdates.num2date(d).replace(tzinfo=None), "s") for d in days])


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_plot_device_samples_a_shuffled_store_in_time_order(months_case) -> None:  # type: ignore[no-untyped-def]
    """Windows are spread over the device's burst times, not its stored order: a shuffled store
    gives the same plot as the device-ordered one, first and last burst included, no false gap."""
    ordered, shuffled = months_case
    times = np.sort(ordered.timestamps[ordered.device_indices(300)]).astype("datetime64[s]")
    positions = np.unique(np.linspace(0, len(times) - 1, 50).round().astype(np.int64))
    for store in (ordered, shuffled):
        fig = store.plot_device(300, max_windows=50)
        plotted = _plotted_times(fig)
        assert np.array_equal(plotted, times[positions])
        assert plotted[0] == times[0] and plotted[-1] == times[-1]
        assert f"{times[0]}".replace("T", " ") in fig.get_suptitle()


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_plot_device_date_ticks_over_months_name_every_month_and_the_year_once(months_case) -> None:  # type: ignore[no-untyped-def]
    fig = months_case[1].plot_device(300, max_windows=100)
    fig.canvas.draw()
    axis = fig.axes[-1].xaxis
    assert [tick.get_text() for tick in fig.axes[-1].get_xticklabels()] == [
        "May 15", "Jun", "15", "Jul", "15", "Aug", "15", "Sep", "15"]
    assert axis.get_major_formatter().get_offset() == "2012"  # not "2012-Sep", the last tick's month


@pytest.mark.parametrize(("ticks", "labels", "offset"), [
    (["2012-05-15", "2012-06-01", "2012-06-15"], ["May 15", "Jun", "15"], "2012"),
    (["2012-05-15", "2012-05-16", "2012-05-17"], ["15", "16", "17"], "2012-May"),  # one month: as matplotlib
    (["2012-05-15T12", "2012-05-16T00", "2012-05-16T12"], ["May-15 12:00", "May-16", "12:00"], "2012-May"),
    (["2012-11-01", "2012-12-01", "2013-01-01", "2013-02-01"], ["Nov 2012", "Dec", "2013", "Feb"], ""),
    (["2012-05-15T03", "2012-05-15T06"], ["03:00", "06:00"], "2012-May-15"),  # one day: as matplotlib
])
def test_time_axis_offset_names_only_what_every_tick_shares(ticks, labels, offset) -> None:  # type: ignore[no-untyped-def]
    import matplotlib.dates as mdates

    from birdzarr.explore._plots import time_formatter

    formatter = time_formatter(mdates.AutoDateLocator())
    values = [mdates.date2num(np.datetime64(t, "s")) for t in ticks]
    assert formatter.format_ticks(values) == labels
    assert formatter.get_offset() == offset


def test_to_xarray_window_coordinate_is_the_global_index(csv_case) -> None:  # type: ignore[no-untyped-def]
    store, truth = csv_case
    ds = store.to_xarray()
    assert ds.window.dtype == np.int64 and np.array_equal(ds.window.values, np.arange(len(store)))
    device = sorted(truth)[2]
    indices = store.device_indices(device)
    one_bird = ds.isel(window=indices)
    assert np.array_equal(one_bird.window.values, indices) and indices[0] > 0
    assert np.array_equal(one_bird.device.values, np.full(len(indices), device))
    day = str(truth[device].times[0].astype("datetime64[s]").astype("datetime64[D]"))
    of_day = one_bird.sel(time=day)  # the time index and the window coordinate both survive
    assert np.array_equal(of_day.window.values, indices[truth[device].times.astype("datetime64[s]")
                                                        .astype("datetime64[D]") == np.datetime64(day)])
    picked = ds.sel(window=[int(indices[3]), 5])
    assert np.array_equal(picked.gimu.values, store.windows[np.array([indices[3], 5])])
    assert ds.isel(window=slice(10, 13)).window.values.tolist() == [10, 11, 12]


def test_to_dataframe_keeps_the_window_index_and_burst_time(csv_case, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """xarray leaves indexed coordinates out of a frame's columns and indexes its rows by the
    dimensions' indexes: the window index carries the time, so the frame keeps it."""
    store, _ = csv_case
    ds = store.to_xarray()
    picked = np.array([700, 3, 129])
    frame = ds.isel(window=picked).to_dataframe()
    assert frame.index.names == ["window", "time", "sample", "channel"]
    assert list(frame.columns) == ["gimu", "device", "label"]
    flat = frame.reset_index()
    times = store.timestamps[picked].astype("datetime64[s]")
    assert np.array_equal(flat.window.to_numpy(), np.repeat(picked, 80))
    assert np.array_equal(flat.time.to_numpy().astype("datetime64[s]"), np.repeat(times, 80))
    assert np.array_equal(flat.gimu.to_numpy(), store.windows[picked].reshape(-1))
    per_window = ds[["device", "label"]].isel(window=slice(10, 14)).to_dataframe()
    assert per_window.index.names == ["window", "time"] and list(per_window.columns) == ["device", "label"]
    assert per_window.index.get_level_values("window").tolist() == [10, 11, 12, 13]
    assert np.array_equal(per_window.index.get_level_values("time").to_numpy().astype("datetime64[s]"),
                          store.timestamps[10:14].astype("datetime64[s]"))
    # selecting by window label, then by time, and concatenating selections keep both
    assert ds.sel(window=slice(3, 5)).window.values.tolist() == [3, 4, 5]
    import xarray as xr

    joined = xr.concat([ds.isel(window=[5, 6]), ds.isel(window=[100])], "window")
    assert joined.window.values.tolist() == [5, 6, 100]
    assert np.array_equal(joined.time.values, store.timestamps[np.array([5, 6, 100])].astype("datetime64[s]"))
    with pytest.raises(birdzarr.WindowIndexError, match="^a window index is out of range: this selection "
                       "of the store holds 10 windows$"):
        ds.isel(window=slice(0, 10)).isel(window=[3, 10])
    reads = ReadCounter(store, monkeypatch)
    repr(store.to_xarray().isel(window=picked))  # building, selecting and showing read nothing
    assert reads.calls == []


def test_window_table_has_a_row_per_window_with_channel_summaries(csv_case, months_case) -> None:  # type: ignore[no-untyped-def]
    from birdzarr import explore

    assert birdzarr.Store.window_table is explore.window_table
    store, truth = csv_case
    table = store.window_table()
    columns = ["device", "time", "label"] + [f"{c}_{s}" for c in birdzarr.CHANNELS
                                             for s in ("mean", "std", "min", "max")]
    assert list(table.columns) == columns and table.index.name == "window"
    assert np.array_equal(table.index, np.arange(len(store)))
    assert np.array_equal(table.device, store.window_devices[:])
    assert np.array_equal(table.label, store.labels[:])
    assert table.time.dtype == np.dtype("datetime64[s]")
    assert np.array_equal(table.time.values, store.timestamps[:].astype("datetime64[s]"))
    values = store.windows[:].astype(np.float64)
    for c, channel in enumerate(birdzarr.CHANNELS):
        for what, expected in (("mean", values.mean(axis=1)), ("std", values.std(axis=1)),
                               ("min", values.min(axis=1)), ("max", values.max(axis=1))):
            assert table[f"{channel}_{what}"].dtype == np.float32
            np.testing.assert_allclose(table[f"{channel}_{what}"], expected[:, c], rtol=1e-6, atol=1e-7)

    shuffled = months_case[1]  # picked rows, in the order given, on a shuffled store
    picked = shuffled.device_indices(300)[::-7]
    rows = shuffled.window_table(picked)
    assert np.array_equal(rows.index, picked)
    np.testing.assert_allclose(rows.gps_speed_max, shuffled.windows[picked][:, :, 3].max(axis=1))
    assert np.array_equal(rows.time.values, shuffled.timestamps[picked].astype("datetime64[s]"))
    assert np.array_equal(store.window_table(slice(5, 9)).index, [5, 6, 7, 8])
    mask = store.labels[:] == 2
    assert np.array_equal(store.window_table(mask).index, np.flatnonzero(mask))
    with pytest.raises(birdzarr.WindowIndexError, match="out of range"):
        store.window_table([len(store)])


def test_window_table_of_a_store_without_times(parquet_case) -> None:  # type: ignore[no-untyped-def]
    store, _ = parquet_case
    table = store.window_table(slice(0, 3000))
    assert table.time.isna().all() and len(table) == 3000
    imu_y = store.windows[:3000][:, :, 1].astype(np.float64)
    np.testing.assert_allclose(table.imu_y_mean, imu_y.mean(axis=1), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_cli_plot_label_names(csv_case, tmp_path: pathlib.Path, capsys) -> None:  # type: ignore[no-untyped-def]
    import matplotlib

    store, _ = csv_case
    label = int(store.labels[5])
    out = tmp_path / "w.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # text kept as text, to be read back
        assert main(["plot", store.location.path, "--window", "5", "--out", str(out),
                     "--label-names", f"{label}=flying, 99 = resting"]) == 0
    assert f"flying ({label})" in out.read_text()
    capsys.readouterr()
    for bad, why in (("3=flying,x", "'x' is not LABEL=NAME"), ("three=flying", "'three=flying' is not"),
                     ("3=", "'3=' is not"), ("3=a,3=b", "label 3 is named twice")):
        target = tmp_path / "bad.png"
        assert main(["plot", store.location.path, "--device", "200", "--out", str(target),
                     "--label-names", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"birdzarr plot: error: --label-names {bad}: ")
        assert why in err and not target.exists()


# -- statistics ------------------------------------------------------------------------------------


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_stats_equal_numpy(parquet_case) -> None:  # type: ignore[no-untyped-def]
    store, truth = parquet_case
    stats = store.stats(progress=False, cache=False, persist=False)
    values = np.concatenate([truth[d] for d in sorted(truth)]).reshape(-1, 4).astype(np.float64)
    assert stats.count == len(values)
    np.testing.assert_allclose(stats.mean, values.mean(axis=0), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(stats.std, values.std(axis=0), rtol=1e-10)
    assert np.array_equal(stats.min, values.min(axis=0)) and np.array_equal(stats.max, values.max(axis=0))
    for c in range(4):
        counts, _ = np.histogram(values[:, c], bins=stats.edges[c])
        assert np.array_equal(stats.counts[c], counts)
        assert stats.counts[c].sum() + stats.below[c] + stats.above[c] == len(values)
    frame = stats.to_dataframe()
    assert list(frame.index) == ["imu_x", "imu_y", "imu_z", "gps_speed"]
    assert frame.loc["imu_z", "mean"] == stats.mean[2]
    assert stats.gps_scale == GPS_SCALE


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_stats_plot_counts_in_physical_units_with_one_legend(parquet_case) -> None:  # type: ignore[no-untyped-def]
    store, _ = parquet_case
    stats = store.stats(progress=False, cache=False, persist=False)
    fig = stats.plot()
    axes = fig.axes
    assert len(axes) == 4 and len(fig.legends) == 1 and all(ax.get_legend() is None for ax in axes)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["mean", "mean ± std"]
    assert [ax.get_ylabel() for ax in axes] == ["count"] * 4
    assert [ax.get_xlabel() for ax in axes] == ["imu_x (g)", "imu_y (g)", "imu_z (g)", "gps_speed (m/s)"]
    gps = axes[3]
    (bars,) = gps.patches  # the stairs: edges in m/s, the counts unchanged
    np.testing.assert_allclose(gps.get_xlim()[1], stats.edges[3][-1] * GPS_SCALE, rtol=0.1)
    assert bars.get_data().values.tolist() == stats.counts[3].tolist()
    np.testing.assert_allclose(bars.get_data().edges, stats.edges[3] * GPS_SCALE)
    mean_line = gps.lines[0]
    np.testing.assert_allclose(mean_line.get_xdata()[0], stats.mean[3] * GPS_SCALE)
    in_m_s = _stats.mean_std_text(stats.mean[3] * GPS_SCALE, stats.std[3] * GPS_SCALE, "m/s")
    assert gps.get_title() == f"gps_speed: {in_m_s}"


def test_mean_std_text_keeps_three_significant_figures_of_the_std() -> None:
    assert _stats.mean_std_text(-0.00225, 0.422, "g") == "mean -0.002 g, std 0.422 g"
    assert _stats.mean_std_text(0.996, 0.0415, "g") == "mean 0.9960 g, std 0.0415 g"
    assert _stats.mean_std_text(1.6512, 2.134, "m/s") == "mean 1.65 m/s, std 2.13 m/s"
    assert _stats.mean_std_text(123.44, 45.61, "m/s") == "mean 123.4 m/s, std 45.6 m/s"
    assert _stats.mean_std_text(1234.6, 456.7, "m/s") == "mean 1235 m/s, std 457 m/s"
    assert _stats.mean_std_text(-0.0001, 0.5, "g") == "mean 0.000 g, std 0.500 g"  # never "-0.000"
    assert _stats.mean_std_text(3.0, 0.0, "g") == "mean 3 g, std 0 g"


def _files(store: birdzarr.Store) -> dict[str, tuple[int, int]]:
    """Every file of a local store with its size and modification time."""
    root = pathlib.Path(store.location.path)
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_stats_are_cached_on_this_machine_never_in_the_store(parquet_case, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(tmp_path / "cache"))
    store = copy_of(parquet_case[0], tmp_path)
    before = _files(store)
    reads = ReadCounter(store, monkeypatch)
    first = store.stats(progress=False, cache=False)
    assert len(reads.calls) == store.reader.n_chunks
    reads.calls.clear()
    assert store.stats(progress=False) is first  # in memory
    assert reads.calls == []

    reopened = fresh(store)  # a new process on this machine: the numbers are in the local cache
    reads = ReadCounter(reopened, monkeypatch)
    again = reopened.stats(progress=False)
    assert reads.calls == []
    assert np.array_equal(again.mean, first.mean) and np.array_equal(again.counts, first.counts)
    assert [p.parent.name for p in (tmp_path / "cache").rglob("*.json")] == ["stats"]
    assert _files(store) == before  # not a byte of the store written: no stats group, no lock

    # A store that changed (a new generation, or a new conversion: generation 1 again, another
    # commit time) recomputes.
    for key, value in (("generation", 99), ("committed_at", "2030-01-01T00:00:00+00:00")):
        changed = fresh(store)
        changed.meta["committed"] = {**changed.meta["committed"], key: value}
        reads = ReadCounter(changed, monkeypatch)
        recomputed = changed.stats(progress=False)
        assert len(reads.calls) == changed.reader.n_chunks
        assert getattr(recomputed, key) == value
    assert _files(store) == before


def test_stats_ignore_a_writer_holding_the_lock(csv_case, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Reading statistics takes no lock: a conversion or append at work changes nothing for them."""
    import warnings

    from birdzarr.storage._lock import StoreLock, read_holder

    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(tmp_path / "cache"))
    store = copy_of(csv_case[0], tmp_path)
    with StoreLock(store.location, command="birdzarr append (test)") as lock:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            computed = store.stats(progress=False, cache=False)
        holder = read_holder(store.location)
        assert holder is not None and holder.token == lock.holder.token  # the writer's lock is untouched
    assert computed.count == len(store) * 20
    assert _stats.load_saved(store) is None


def test_stats_persist_false_writes_nothing_anywhere(csv_case, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(tmp_path / "cache"))
    store = copy_of(csv_case[0], tmp_path)
    before = _files(store)
    store.stats(progress=False, cache=False, persist=False)
    assert not (tmp_path / "cache").exists() and _files(store) == before


def test_a_stats_cache_that_cannot_be_written_is_a_warning(csv_case, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(blocked))
    store = fresh(csv_case[0])
    not_cached = rf"computed but not cached in {blocked}/stats \((FileExistsError|NotADirectoryError): "
    with pytest.warns(birdzarr.BirdzarrWarning, match=not_cached):
        stats = store.stats(progress=False, cache=False)
    assert stats.count == len(store) * 20
    reads = ReadCounter(store, monkeypatch)
    assert store.stats(progress=False) is stats and reads.calls == []  # kept in memory


def test_stats_save_writes_the_stats_group_under_the_lock(csv_case, monkeypatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """``birdzarr stats --save``: the one way statistics go into a store, for every machine."""
    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(tmp_path / "cache"))
    store = copy_of(csv_case[0], tmp_path)
    assert main(["stats", store.location.path, "--save", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    saved = _stats.load_saved(store)
    assert saved is not None and saved.to_json() == printed
    # the stats group is a valid (empty) Zarr group: the root's arrays are the store's nine
    assert sorted(name for name, _ in store.group.arrays()) == [
        "device", "dict_device", "dict_start", "dict_values", "gimu_codes", "gimu_row", "gps_speed",
        "label", "timestamp"]
    assert not store.location.fs.exists(store.location.join(".birdzarr.lock"))  # taken and released

    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(tmp_path / "another_machine"))
    elsewhere = fresh(store)
    reads = ReadCounter(elsewhere, monkeypatch)
    assert elsewhere.stats(progress=False).to_json() == printed and reads.calls == []

    # numbers saved by an older birdzarr (stats version 1: before committed_at was in the key)
    node = store.location.join("stats", "zarr.json")
    raw = json.loads(store.location.fs.cat_file(node))
    assert raw["attributes"]["birdzarr_stats"]["stats_version"] == 2
    raw["attributes"]["birdzarr_stats"]["stats_version"] = 1
    store.location.fs.pipe_file(node, json.dumps(raw).encode())
    assert _stats.load_saved(store) is None
    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(tmp_path / "a_third_machine"))
    again = fresh(store)
    reads = ReadCounter(again, monkeypatch)
    assert again.stats(progress=False).to_json() == printed
    assert len(reads.calls) == again.reader.n_chunks


def test_stats_save_refuses_a_locked_or_changed_store(csv_case, monkeypatch, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from birdzarr.explore import save_stats
    from birdzarr.storage._lock import StoreLock, read_holder

    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(tmp_path / "cache"))
    store = copy_of(csv_case[0], tmp_path)
    with StoreLock(store.location, command="birdzarr append (test)") as lock:
        assert main(["stats", store.location.path, "--save"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "locked by 'birdzarr append (test)'" in err[0]
        assert "statistics not saved" in err[0]
        holder = read_holder(store.location)
        assert holder is not None and holder.token == lock.holder.token
    assert _stats.load_saved(store) is None

    changed = fresh(store)  # a commit landed after this handle was opened
    changed.meta["committed"] = {**changed.meta["committed"], "generation": 99}
    with pytest.raises(birdzarr.StoreLockedError, match="a writer committed while the statistics were"):
        save_stats(changed, progress=False)
    assert _stats.load_saved(store) is None
    assert not store.location.fs.exists(store.location.join(".birdzarr.lock"))


# -- optional dependencies and CLI ---------------------------------------------------------------


@pytest.mark.parametrize(("module", "call"), [
    ("matplotlib", lambda s: s.plot_window(0)),
    ("xarray", lambda s: s.to_xarray()),
])
def test_missing_extra_names_the_install_command(csv_case, monkeypatch, module, call) -> None:  # type: ignore[no-untyped-def]
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(birdzarr.MissingDependencyError, match=r'pip install "birdzarr\[explore\]"'):
        call(csv_case[0])


@pytest.mark.slow
def test_cli_plot_and_info_devices(csv_case, tmp_path: pathlib.Path, capsys) -> None:  # type: ignore[no-untyped-def]
    store, truth = csv_case
    device = sorted(truth)[0]
    out = tmp_path / "bird.png"
    assert main(["plot", store.location.path, "--device", str(device), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", store.location.path, "--window", "5", "--out", str(tmp_path / "w.svg")]) == 0
    assert (tmp_path / "w.svg").read_text().lstrip().startswith("<?xml")
    capsys.readouterr()

    assert main(["info", store.location.path, "--devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["device", "windows"]
    assert [int(line.split()[0]) for line in lines[1:]] == sorted(truth)
    counts = [int(line.split()[1].replace(",", "")) for line in lines[1:]]
    assert counts == [len(truth[d].windows) for d in sorted(truth)]

    assert main(["info", store.location.path, "--devices", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [r["n_windows"] for r in records] == [len(truth[d].windows) for d in sorted(truth)]
    assert records[0]["sources"] == truth[device].sources

    assert main(["stats", store.location.path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["n_windows"] == len(store)


# -- the same over S3 (moto's real S3 endpoint on loopback) ------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint(request: pytest.FixtureRequest) -> Any:
    """The session's moto server (shared with tests/test_s3.py), or a skip without the s3 extras."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    return request.getfixturevalue("moto")


@pytest.mark.slow
@pytest.mark.s3
def test_views_and_stats_cache_over_s3(csv_case, s3_endpoint, monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    local, _ = csv_case
    url = f"s3://{new_bucket(s3_endpoint)}/birds.zarr"
    options = s3_options(s3_endpoint.url)
    remote = _storage.resolve(url, options)
    remote.fs.put(local.location.path + "/", remote.path, recursive=True)  # a store is plain objects
    store = birdzarr.open_store(url, storage_options=options)
    assert repr(store).startswith(f"<birdzarr.Store {url}: {len(local):,} windows")

    ds = store.to_xarray()
    before = store.reader.requests
    window_values = ds.gimu.isel(window=slice(250, 260)).variable.values
    # two chunks of the three per-window arrays (codes, rows, gps_speed) and the three dictionary
    # arrays' one chunk each, loaded once: nothing else
    assert store.reader.requests - before == 2 * 3 + 3
    assert np.array_equal(window_values, local.windows[250:260])
    before = store.reader.requests
    assert np.array_equal(ds.gimu.isel(window=slice(0, 10)).variable.values, local.windows[:10])
    assert store.reader.requests - before == 3  # one more chunk a per-window array; dictionaries kept

    first = store.stats(progress=False, cache=False)  # computed; cached on this machine, not in the bucket
    assert not remote.fs.exists(remote.path + "/stats/zarr.json")
    reopened = birdzarr.open_store(url, storage_options=options)
    assert np.array_equal(reopened.stats(progress=False).counts, first.counts)
    assert reopened.reader.requests == 0  # from the local cache

    from birdzarr.explore import save_stats

    save_stats(reopened, progress=False)  # explicit: into the bucket, under the store's lock
    monkeypatch.setenv("BIRDZARR_CACHE_DIR", str(tmp_path / "another_machine"))
    elsewhere = birdzarr.open_store(url, storage_options=options)
    again = elsewhere.stats(progress=False)
    assert elsewhere.reader.requests == 0  # read from the bucket's stats/zarr.json
    assert np.array_equal(again.counts, first.counts)
