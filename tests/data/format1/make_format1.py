"""Writes the format-1 stores of this directory (run once; kept for the record).

birdzarr no longer writes format 1, so this script runs only on the commit that made the stores
(see README.md beside it), not on the current code. Each store is converted from a small source
that ``birdzarr.demo._synthetic`` generates (parameters in ``SOURCES``: tests regenerate it and
convert it to format 2 to compare), and ``expected.json`` records, per store, the SHA-256 of what
reading it gives (windows as float32 bytes, window devices, timestamps, labels) and its counts.

    python tests/data/format1/make_format1.py   # on that commit, from the repository root
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import tempfile
from typing import Any

import numpy as np

import birdzarr
from birdzarr.demo import _synthetic

HERE = pathlib.Path(__file__).resolve().parent

# name -> the source and the conversion (tests/format1_support.py regenerates the same sources)
SOURCES: dict[str, dict[str, Any]] = {
    "dict16.zarr": {"kind": "parquet", "n_devices": 4, "total_windows": 240, "seed": 7,
                    "convert": {"chunk_windows": 64}},
    "gdict16.zarr": {"kind": "parquet", "n_devices": 4, "total_windows": 240, "seed": 7,
                     "convert": {"chunk_windows": 128, "shuffle": True, "seed": 3}},
    "standard.zarr": {"kind": "parquet", "n_devices": 2, "total_windows": 60, "seed": 5,
                      "convert": {"chunk_windows": 32, "codec": "standard"}},
    "raw.zarr": {"kind": "raw", "convert": {"chunk_windows": 3300}},
    "varying_gps.zarr": {"kind": "varying_gps", "convert": {"chunk_windows": 128}},
    "appended.zarr": {"kind": "csv", "n_devices": 3, "bursts_per_device": 12, "seed": 11,
                      "convert": {"chunk_windows": 64}},
}


def raw_fallback_source(directory: pathlib.Path) -> dict[int, np.ndarray]:
    """Device 1: 3,300 windows whose imu_x are 66,000 distinct float32 values (consecutive bit
    patterns from 1.0), more than a dict16 dictionary holds: its chunk is stored raw. Device 2:
    30 ordinary windows (a dictionary chunk)."""
    directory.mkdir(parents=True, exist_ok=True)
    windows = np.zeros((3300, 20, 4), np.float32)
    bits = np.uint32(0x3F800000) + np.arange(3300 * 20, dtype=np.uint32)
    windows[:, :, 0] = bits.view(np.float32).reshape(3300, 20)
    windows[:, :, 3] = 0.25
    small = _synthetic.curated_windows(30, seed=2)
    _synthetic.write_parquet(windows, directory / "1.parquet")
    _synthetic.write_parquet(small, directory / "2.parquet")
    return {1: windows, 2: small}


def varying_gps_source(directory: pathlib.Path) -> dict[int, np.ndarray]:
    """Devices 3 (150 windows) and 4 (100): window 90 of device 4 has a gps_speed that changes
    inside the window, so the resident loader holds this store in its 80-code layout."""
    directory.mkdir(parents=True, exist_ok=True)
    windows = {3: _synthetic.curated_windows(150, seed=3), 4: _synthetic.curated_windows(100, seed=4)}
    windows[4][90, 10:, 3] += np.float32(0.5)
    for device, w in windows.items():
        _synthetic.write_parquet(w, directory / f"{device}.parquet")
    return windows


def digest(store: birdzarr.Store) -> dict[str, Any]:
    def sha(array: np.ndarray) -> str:
        return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()

    return {"windows": len(store), "devices": len(store.devices), "chunk_windows": store.chunk_windows,
            "shuffled": store.shuffled, "layout": store.meta["layout"],
            "sha256": {"windows": sha(store.windows[:]), "device": sha(store.window_devices[:]),
                       "timestamp": sha(store.timestamps[:]), "label": sha(store.labels[:])}}


def main() -> None:
    expected = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in SOURCES.items():
            source = pathlib.Path(tmp) / name / "source"
            dest = HERE / name
            shutil.rmtree(dest, ignore_errors=True)
            options = {"progress": False, "workers": 1, "format_version": 1, **spec["convert"]}
            if spec["kind"] == "parquet":
                _synthetic.make_parquet_dir(source, n_devices=spec["n_devices"],
                                            total_windows=spec["total_windows"], seed=spec["seed"])
                store = birdzarr.convert(source, dest, **options)
            elif spec["kind"] == "raw":
                raw_fallback_source(source)
                store = birdzarr.convert(source, dest, **options)
            elif spec["kind"] == "varying_gps":
                varying_gps_source(source)
                store = birdzarr.convert(source, dest, **options)
            else:  # CSV: parts 0 converted, then parts 1 and a new device appended
                _synthetic.make_csv_dir(source, n_devices=spec["n_devices"],
                                        bursts_per_device=spec["bursts_per_device"], seed=spec["seed"])
                first, more = pathlib.Path(tmp) / name / "first", pathlib.Path(tmp) / name / "more"
                first.mkdir()
                more.mkdir()
                files = sorted(source.iterdir())
                last_device = files[-1].name.split("_")[0]
                for f in files:
                    to_more = f.name.endswith("_1.csv") or f.name.startswith(last_device + "_")
                    shutil.copy(f, (more if to_more else first) / f.name)
                birdzarr.convert(first, dest, **options)
                store = birdzarr.append(dest, more, progress=False, workers=1)
            expected[name] = digest(store)
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
