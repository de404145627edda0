"""Realistic generated data, for the demo, the tests and the benchmarks.

Values imitate real trackers: 12-bit sensor counts calibrated per device and channel,
``(count - offset) / scale`` with non-power-of-two scales, so their float32 mantissas are not
round (rounded test data compresses far better than real data and misleads codec choices).
Device sizes are as skewed as the real corpus (largest ~6% of all windows, smallest ~0.04%).
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from birdzarr.format._spec import WINDOW_LENGTH, Curation

_EPOCH = int(dt.datetime(2012, 5, 15, tzinfo=dt.UTC).timestamp())


def device_sizes(n_devices: int, total_windows: int, *, seed: int = 0) -> np.ndarray:
    """Window counts per device, log-normally skewed, summing to ``total_windows``."""
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(mean=0.0, sigma=1.3, size=n_devices)
    weights = np.minimum(weights, weights.sum() * 0.06)
    sizes = np.maximum(np.floor(weights / weights.sum() * total_windows).astype(np.int64), 1)
    sizes[np.argmax(sizes)] += total_windows - sizes.sum()
    return sizes


def device_ids(n_devices: int) -> np.ndarray:
    """Plausible, non-contiguous device ids."""
    return 200 + np.arange(n_devices) * 7 % 9973


@dataclass
class RawDevice:
    """Raw rows of one device as a CSV export would hold them (before curation)."""

    device_id: int
    time: np.ndarray  # int64 per row (burst start, shared by the burst)
    label: np.ndarray  # int64 per row
    values: np.ndarray  # float64 (rows, 4): imu_x, imu_y, imu_z, gps_speed in m/s


def _calibrated(rng: np.random.Generator, shape: tuple[int, ...],
                calibration: np.random.Generator | None = None) -> np.ndarray:
    """12-bit sensor counts through one device's calibration (drawn from ``calibration``, or
    from ``rng`` when not given), in g."""
    source = rng if calibration is None else calibration
    offset = source.normal(2048, 40, 3)
    scale = source.uniform(900.0, 1100.0, 3)
    posture = rng.normal(0, 0.35, (shape[0], 1, 3)) + np.array([0.0, 0.0, 1.0])
    motion = rng.normal(0, 0.2, (*shape, 3)) * rng.uniform(0.05, 2.0, (shape[0], 1, 1))
    counts = np.clip(np.round((posture + motion) * scale + offset), 0, 4095)
    return (counts - offset) / scale


def curated_windows(n_windows: int, *, seed: int, calibration_seed: int | None = None) -> np.ndarray:
    """Curated float32 windows (n, 20, 4), as the per-device Parquet files hold them.

    ``calibration_seed`` fixes the device's sensor calibration apart from the samples, so a
    device generated in pieces (different ``seed`` each) keeps one calibration, as a tracker does.
    """
    rng = np.random.default_rng(seed)
    calibration = None if calibration_seed is None else np.random.default_rng(calibration_seed)
    imu = np.clip(_calibrated(rng, (n_windows, WINDOW_LENGTH), calibration), -2.0, 2.0)
    speed = np.round(rng.lognormal(0.0, 1.0, (n_windows, 1)), 2)
    speed = np.minimum(speed, 29.0) / Curation().gps_scale
    out = np.empty((n_windows, WINDOW_LENGTH, 4), dtype=np.float32)
    out[:, :, :3] = imu
    out[:, :, 3] = np.repeat(speed, WINDOW_LENGTH, axis=1)
    return out


def raw_device(device_id: int, n_bursts: int, *, seed: int, labelled: bool = False) -> RawDevice:
    """Bursts of 20/40/60 rows (some ragged), a few too fast, as a tracker would export them."""
    rng = np.random.default_rng(seed)
    lengths = rng.choice([20, 40, 60, 59, 21], size=n_bursts, p=[0.45, 0.25, 0.2, 0.05, 0.05])
    starts = _EPOCH + np.cumsum(rng.integers(60, 3600, n_bursts))
    rows = int(lengths.sum())
    time = np.repeat(starts, lengths)
    values = np.empty((rows, 4))
    values[:, :3] = _calibrated(rng, (rows, 1))[:, 0, :]
    speed = np.round(rng.lognormal(0.0, 1.0, n_bursts), 2)
    speed[rng.random(n_bursts) < 0.03] = 35.0  # GPS glitches the curation must drop
    values[:, 3] = np.repeat(speed, lengths)
    label = np.repeat(rng.integers(0, 10, n_bursts), lengths) if labelled else np.full(rows, -1)
    return RawDevice(device_id, time, label.astype(np.int64), values)


def write_csv(raw: RawDevice, path: str | os.PathLike[str], start: int = 0, stop: int | None = None) -> None:
    """Write rows ``[start, stop)`` in the export format (no header, 8 columns)."""
    stop = len(raw.time) if stop is None else stop
    times = raw.time[start:stop].astype("datetime64[s]").astype(str)
    index = np.zeros(stop - start, dtype=np.int64)  # the index column is ignored by the converter
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(stop - start):
            v = raw.values[start + i]
            handle.write(
                f"{raw.device_id},{times[i].replace('T', ' ')},{index[i]},{raw.label[start + i]},"
                f"{v[0]:.8f},{v[1]:.8f},{v[2]:.8f},{v[3]:.6f}\n"
            )


def write_parquet(windows: np.ndarray, path: str | os.PathLike[str]) -> None:
    """Write windows as the existing per-device files: one list<float32> column ``gimu``."""
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    offsets = pa.array(np.arange(0, flat.__len__() + 1, 80, dtype=np.int32))
    pq.write_table(pa.table({"gimu": pa.ListArray.from_arrays(offsets, flat)}), path)


def make_parquet_dir(
    directory: str | os.PathLike[str], *, n_devices: int, total_windows: int, seed: int = 0
) -> dict[int, np.ndarray]:
    """A directory of ``{device}.parquet`` files; returns the windows per device (the truth)."""
    os.makedirs(directory, exist_ok=True)
    truth = {}
    sizes = device_sizes(n_devices, total_windows, seed=seed)
    for device, size in zip(device_ids(n_devices).tolist(), sizes.tolist(), strict=True):
        windows = curated_windows(size, seed=seed * 100_003 + device)
        write_parquet(windows, os.path.join(directory, f"{device}.parquet"))
        truth[device] = windows
    return truth


def make_csv_dir(
    directory: str | os.PathLike[str], *, n_devices: int, bursts_per_device: int, parts: int = 2,
    seed: int = 0, labelled: bool = True,
) -> dict[int, RawDevice]:
    """A directory of ``{device}_{part}.csv`` exports; returns the raw rows per device."""
    os.makedirs(directory, exist_ok=True)
    raws = {}
    for device in device_ids(n_devices).tolist():
        raw = raw_device(device, bursts_per_device, seed=seed * 100_003 + device, labelled=labelled)
        cuts = np.linspace(0, len(raw.time), parts + 1).astype(int)
        for part in range(parts):
            write_csv(raw, os.path.join(directory, f"{device}_{part}.csv"), cuts[part], cuts[part + 1])
        raws[device] = raw
    return raws
