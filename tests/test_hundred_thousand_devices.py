"""A store of 100,000 devices (2 windows each, from partition files), issue 33's device count:
every device's entry, `Store.device`, the windows, `verify` and `info` are exact, in both orders.
The per-device costs at that count are measured by benchmarks/many_devices.py; this checks the
answers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import birdzarr
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.maintenance._verify import verify

N_DEVICES = 100_000
N_FILES = 4

# converting 100,000 devices twice takes seconds
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def devices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("hundred_thousand")
    ids = np.arange(N_DEVICES, dtype=np.int64) * 3 + 5  # ids and positions differ
    total = 2 * N_DEVICES
    windows = _synthetic.curated_windows(total, seed=7)
    owner = np.repeat(ids, 2)
    labels = (np.arange(total) % 3).astype(np.int32)
    source = root / "parts"
    source.mkdir()
    # partition files of whole devices, their rows not grouped by device within a file
    cuts = np.linspace(0, total, N_FILES + 1).astype(int) // 2 * 2
    rng = np.random.default_rng(1)
    for number in range(N_FILES):
        rows = rng.permutation(np.arange(cuts[number], cuts[number + 1]))
        flat = pa.array(windows[rows].reshape(-1), type=pa.float32())
        gimu = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)
        pq.write_table(pa.table({"device_id": pa.array(owner[rows], pa.int32()),
                                 "label": pa.array(labels[rows], pa.int32()), "gimu": gimu}),
                       source / f"part-{number}.parquet")
    stores = {}
    for name, shuffle in (("ordered", False), ("shuffled", True)):
        stores[name] = root / f"{name}.zarr"
        birdzarr.convert(str(source), str(stores[name]), workers=1, progress=False, shuffle=shuffle,
                         seed=3 if shuffle else None)
    return {"ids": ids, "windows": windows, "labels": labels, **stores}


def _sorted_rows(windows: np.ndarray) -> np.ndarray:
    """The windows as one bytes value each, sorted: the same multiset in any order."""
    rows = np.ascontiguousarray(windows, dtype=np.float32).reshape(len(windows), -1)
    return np.sort(rows.view(np.dtype((np.void, rows.shape[1] * 4))).ravel())


def test_every_device_has_its_exact_entry_and_windows(devices: dict) -> None:
    store = birdzarr.open_store(devices["ordered"])
    ids, windows = devices["ids"], devices["windows"]
    assert (store.n_devices, len(store)) == (N_DEVICES, 2 * N_DEVICES)
    table = store.devices
    np.testing.assert_array_equal(table["device_id"].to_numpy(), ids)
    np.testing.assert_array_equal(table["n_windows"].to_numpy(), np.full(N_DEVICES, 2))
    for k in (0, 1, 4_999, 77_777, N_DEVICES - 1):  # in id order, each device its own two windows
        entry = store.device(int(ids[k]))
        assert (entry.device_id, entry.n_windows) == (int(ids[k]), 2)
        [window_range] = entry.ranges
        assert (window_range.start, window_range.stop) == (2 * k, 2 * k + 2)
        # consecutive windows' labels differ (window i has label i % 3): one window of each
        assert entry.label_counts == {int(label): 1 for label in devices["labels"][2 * k: 2 * k + 2]}
        # a device's rows were not grouped in its file: its two windows in the file's order
        np.testing.assert_array_equal(_sorted_rows(store.windows[2 * k: 2 * k + 2]),
                                      _sorted_rows(windows[2 * k: 2 * k + 2]))
    np.testing.assert_array_equal(_sorted_rows(store.windows[:]), _sorted_rows(windows))


def test_verify_and_info_check_all_devices(devices: dict, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("ordered", "shuffled"):
        result = verify(str(devices[name]))
        assert result.ok, result.problems
        assert main(["info", str(devices[name])]) == 0
        out = capsys.readouterr().out
        assert "200,000 from 100,000 devices" in out


def test_the_shuffled_store_holds_every_window_once(devices: dict) -> None:
    store = birdzarr.open_store(devices["shuffled"])
    assert (store.n_devices, len(store)) == (N_DEVICES, 2 * N_DEVICES)
    np.testing.assert_array_equal(_sorted_rows(store.windows[:]), _sorted_rows(devices["windows"]))
