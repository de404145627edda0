"""Python API arguments of the wrong type or value are refused with a message naming them, before
anything is read or written: a truthy string must never act as True on a destructive flag."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import numpy as np
import pytest

import birdzarr
from birdzarr import ArgumentError
from birdzarr.storage._location import resolve
from birdzarr.storage._lock import LOCK_NAME, StoreLock


@pytest.fixture(scope="module")
def other_store(parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
                tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A committed store that differs from small_store (other chunks): what a replacement would change."""
    dest = tmp_path_factory.mktemp("other") / "other.zarr"
    birdzarr.convert(parquet_source[0], dest, chunk_windows=4096, progress=False)
    return dest


@pytest.fixture
def existing(other_store: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy of other_store, for a test that must leave it exactly as it was."""
    dest = tmp_path / "existing.zarr"
    shutil.copytree(other_store, dest)
    return dest


def _snapshot(store: pathlib.Path) -> dict[str, tuple[int, int, bytes | None]]:
    """Every file's size and inode (a replaced file has a new one), and zarr.json's bytes."""
    return {str(p.relative_to(store)): (p.stat().st_size, p.stat().st_ino,
                                        p.read_bytes() if p.name in ("zarr.json", LOCK_NAME) else None)
            for p in sorted(store.rglob("*")) if p.is_file()}


# -- 1. destructive and other bool flags -----------------------------------------------------------

@pytest.mark.parametrize(("option", "value"), [
    ("overwrite", "no"), ("shuffle", "no"), ("progress", "no"), ("skip_unknown_files", 1),
])
def test_convert_refuses_a_flag_that_is_not_a_bool_and_keeps_the_store(
    option: str, value: Any, parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
    existing: pathlib.Path,
) -> None:
    before = _snapshot(existing)
    options: dict[str, Any] = {"progress": False, option: value}
    with pytest.raises(TypeError) as refused:
        birdzarr.convert(parquet_source[0], existing, **options)
    assert type(refused.value) is TypeError
    assert str(refused.value) == f"{option} must be True or False, got {value!r}"
    assert _snapshot(existing) == before


@pytest.mark.parametrize(("option", "value"), [("progress", "no"), ("skip_unknown_files", "yes")])
def test_append_refuses_a_flag_that_is_not_a_bool(
    option: str, value: Any, parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
    existing: pathlib.Path,
) -> None:
    before = _snapshot(existing)
    with pytest.raises(TypeError) as refused:
        birdzarr.append(existing, parquet_source[0], **{option: value})  # type: ignore[misc]
    assert str(refused.value) == f"{option} must be True or False, got {value!r}"
    assert _snapshot(existing) == before


@pytest.mark.parametrize(("option", "value"), [("overwrite", "no"), ("progress", "no")])
def test_copy_refuses_a_flag_that_is_not_a_bool_and_keeps_the_destination(
    option: str, value: Any, small_store: birdzarr.Store, existing: pathlib.Path,
) -> None:
    before = _snapshot(existing)
    options: dict[str, Any] = {"progress": False, option: value}
    with pytest.raises(TypeError) as refused:
        birdzarr.copy(small_store.url, existing, **options)
    assert str(refused.value) == f"{option} must be True or False, got {value!r}"
    assert _snapshot(existing) == before


def test_repair_refuses_break_lock_that_is_not_a_bool_and_keeps_the_lock(existing: pathlib.Path) -> None:
    lock = StoreLock(resolve(str(existing)), "birdzarr append a-live-writer").acquire()  # this process: alive
    try:
        before = _snapshot(existing)
        with pytest.raises(TypeError) as refused:
            birdzarr.repair(existing, break_lock="no")  # type: ignore[arg-type]
        assert str(refused.value) == "break_lock must be True or False, got 'no'"
        assert _snapshot(existing) == before  # the lock file included, byte for byte
        with pytest.raises(birdzarr.StoreLockedError):  # still held by the live writer
            birdzarr.repair(existing, break_lock=np.False_)
    finally:
        lock.release()


def test_verify_refuses_progress_that_is_not_a_bool_and_takes_a_numpy_bool(
    small_store: birdzarr.Store,
) -> None:
    with pytest.raises(TypeError) as refused:
        birdzarr.verify(small_store.url, progress="no")  # type: ignore[arg-type]
    assert str(refused.value) == "progress must be True or False, got 'no'"
    assert birdzarr.verify(small_store.url, progress=np.False_).n_windows == len(small_store)


# -- 2. negative window indices in the xarray view ---------------------------------------------------

@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_xarray_negative_window_indices_index_as_numpy_does(small_store: birdzarr.Store) -> None:
    pytest.importorskip("xarray")
    n = len(small_store)
    ds = small_store.to_xarray()
    every = small_store.windows[:]
    for index in (-1, -2, -1000, -n):
        np.testing.assert_array_equal(ds.isel(window=index).gimu.values, every[index])
        assert int(ds.isel(window=index).device.values) == int(small_store.window_devices[:][index])
    np.testing.assert_array_equal(ds.isel(window=[-1, -n, 5]).gimu.values, every[[-1, -n, 5]])
    for index in (-n - 1, -n - 1000, -2 * n + 7):  # -n - 1000 read window n - 1000 before
        with pytest.raises(IndexError):
            every[index]  # numpy refuses it ...
        with pytest.raises(birdzarr.WindowIndexError) as refused:  # ... and so does the view (an IndexError)
            _ = ds.isel(window=index).gimu.values
        assert str(refused.value) == f"a window index is out of range: the store holds {n} windows"
        with pytest.raises(birdzarr.WindowIndexError):
            _ = ds.isel(window=index).device.values
        with pytest.raises(birdzarr.WindowIndexError):
            _ = ds.isel(window=[0, index]).gimu.values


# -- 3. curation parameters ---------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"gps_scale": 0}, ArgumentError,
     "Curation gps_scale must be above 0 (gps_speed is divided by it), got 0.0"),
    ({"gps_scale": -1.5}, ArgumentError,
     "Curation gps_scale must be above 0 (gps_speed is divided by it), got -1.5"),
    ({"gps_scale": float("nan")}, ArgumentError, "Curation gps_scale must be a finite number, got nan"),
    ({"clip_min": float("nan")}, ArgumentError, "Curation clip_min must be a finite number, got nan"),
    ({"clip_max": float("inf")}, ArgumentError, "Curation clip_max must be a finite number, got inf"),
    ({"clip_min": 2, "clip_max": -2}, ArgumentError,
     "Curation clip_min must be below clip_max (imu_x/y/z are clipped to [clip_min, clip_max]), "
     "got 2.0 and -2.0"),
    ({"speed_limit": 0}, ArgumentError, "Curation speed_limit must be above 0 m/s (windows with a gps_speed "
                                     "at or above it are dropped), got 0.0"),
    ({"speed_limit": "30"}, TypeError, "Curation speed_limit must be a number, got '30'"),
    ({"clip_max": True}, TypeError, "Curation clip_max must be a number, got True"),
])
def test_curation_refuses_parameters_that_cannot_curate(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as refused:
        birdzarr.Curation(**fields)
    assert type(refused.value) is error
    assert str(refused.value) == message


def test_curation_stores_numbers_as_floats() -> None:
    curation = birdzarr.Curation(speed_limit=np.float32(25), clip_min=-3, clip_max=np.int64(3))
    assert curation.to_json(applied_by="birdzarr")["clip"] == [-3.0, 3.0]
    assert type(curation.speed_limit) is float and curation.speed_limit == 25.0


# -- 4. conversion arguments --------------------------------------------------------------------------

@pytest.fixture
def csv_source(tmp_path: pathlib.Path) -> pathlib.Path:
    source = tmp_path / "csv"
    source.mkdir()
    shutil.copy(pathlib.Path(__file__).parent / "data" / "data.csv", source / "data.csv")
    return source


@pytest.mark.parametrize("kind", ["csv", "parquet"])
@pytest.mark.parametrize(("options", "error", "message"), [
    ({"workers": "2"}, TypeError, "workers must be an integer, got '2'"),
    ({"workers": 1.0}, TypeError, "workers must be an integer, got 1.0"),
    ({"chunk_windows": 1.5}, TypeError, "chunk_windows must be an integer, got 1.5"),
    ({"chunk_windows": "1024"}, TypeError, "chunk_windows must be an integer, got '1024'"),
    ({"shuffle": True, "seed": "1"}, TypeError, "seed must be an integer, got '1'"),
    ({"curation": "x"}, TypeError, "curation must be a birdzarr.Curation (or None for the default), got 'x'"),
    ({"curation": {"speed_limit": 20}}, TypeError,
     "curation must be a birdzarr.Curation (or None for the default), got {'speed_limit': 20}"),
    ({"client": "tcp://x:8786"}, TypeError, "client must be a distributed.Client (or None to convert here), "
                                            "got 'tcp://x:8786'; connect first: client=distributed.Client('tcp://x:8786')"),
    ({"client": object}, TypeError,
     "client must be a distributed.Client (or None to convert here), got <class 'object'>"),
])
def test_convert_refuses_arguments_of_the_wrong_type(
    kind: str, options: dict[str, Any], error: type[Exception], message: str, csv_source: pathlib.Path,
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path,
) -> None:
    source = csv_source if kind == "csv" else parquet_source[0]
    with pytest.raises(error) as refused:
        birdzarr.convert(source, tmp_path / "new.zarr", progress=False, **options)
    assert type(refused.value) is error
    assert str(refused.value) == message
    assert not (tmp_path / "new.zarr").exists()


def test_append_refuses_workers_that_is_not_an_integer(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], existing: pathlib.Path,
) -> None:
    before = _snapshot(existing)
    with pytest.raises(TypeError) as refused:
        birdzarr.append(existing, parquet_source[0], workers="2", progress=False)  # type: ignore[typeddict-item]
    assert str(refused.value) == "workers must be an integer, got '2'"
    assert _snapshot(existing) == before


# -- 5. exploration arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize(("max_windows", "message"), [
    (1.5, "max_windows must be an integer, got 1.5"),
    ("10", "max_windows must be an integer, got '10'"),
    (None, "max_windows must be an integer, got None"),
])
def test_plot_device_refuses_max_windows_that_is_not_an_integer(
    max_windows: Any, message: str, small_store: birdzarr.Store
) -> None:
    device = small_store.device_table[0].device_id
    with pytest.raises(TypeError) as refused:
        small_store.plot_device(device, max_windows=max_windows)
    assert str(refused.value) == message


def test_plots_refuse_label_names_that_are_not_a_mapping(small_store: birdzarr.Store) -> None:
    device = small_store.device_table[0].device_id
    message = "label_names must be a mapping of label ids to names, such as {3: 'flying'}, got ['a', 'b']"
    with pytest.raises(TypeError) as refused:
        small_store.plot_device(device, label_names=["a", "b"])  # type: ignore[arg-type]
    assert str(refused.value) == message
    with pytest.raises(TypeError) as refused:
        small_store.plot_window(0, label_names=["a", "b"])  # type: ignore[arg-type]
    assert str(refused.value) == message


@pytest.mark.parametrize("index", ["3", None, 1.5, np.float64(2.0)])
def test_plot_window_refuses_an_index_that_is_not_an_integer(index: Any, small_store: birdzarr.Store) -> None:
    with pytest.raises(TypeError) as refused:
        small_store.plot_window(index)
    assert str(refused.value) == f"index must be an integer, got {index!r}"


def test_plot_window_refuses_an_index_below_minus_the_length(small_store: birdzarr.Store) -> None:
    n = len(small_store)
    with pytest.raises(birdzarr.WindowIndexError) as refused:  # it drew window n - 1 before
        small_store.plot_window(-n - 1)
    assert str(refused.value) == f"window {-n - 1} is out of range: the store holds {n} windows"


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"bins": -1}, ArgumentError, "bins must be an integer of 1 or more, got -1"),
    ({"bins": 0}, ArgumentError, "bins must be an integer of 1 or more, got 0"),
    ({"bins": "8"}, TypeError, "bins must be an integer, got '8'"),
    ({"bins": 8.0}, TypeError, "bins must be an integer, got 8.0"),
    ({"persist": "no"}, TypeError, "persist must be True or False, got 'no'"),
])
def test_stats_refuses_wrong_arguments(
    options: dict[str, Any], error: type[Exception], message: str, small_store: birdzarr.Store
) -> None:
    with pytest.raises(error) as refused:
        small_store.stats(progress=False, **options)
    assert type(refused.value) is error
    assert str(refused.value) == message
