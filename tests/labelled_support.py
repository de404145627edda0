"""Test-only: CSV exports whose bursts all carry a label, drawn per burst with given shares."""

from __future__ import annotations

import pathlib

import numpy as np

import birdzarr
from birdzarr.demo import _synthetic


def labelled_csv_store(root: pathlib.Path, *, n_devices: int, n_bursts: int, shares: list[float],
                       seed: int, name: str) -> birdzarr.Store:
    """``n_devices`` CSV devices of ``n_bursts`` bursts, each burst labelled ``k`` with probability
    ``shares[k]``, converted with 1024-window chunks into ``root / name``."""
    (root / "csv").mkdir()
    for device in _synthetic.device_ids(n_devices).tolist():
        raw = _synthetic.raw_device(device, n_bursts, seed=seed + device)
        bursts = np.flatnonzero(np.diff(raw.time, prepend=raw.time[0] - 1)).tolist() + [len(raw.time)]
        rng = np.random.default_rng(device)
        for start, stop in zip(bursts[:-1], bursts[1:], strict=True):
            raw.label[start:stop] = rng.choice(len(shares), p=shares)
        _synthetic.write_csv(raw, root / "csv" / f"{device}_0.csv")
    return birdzarr.convert(root / "csv", root / name, chunk_windows=1024, progress=False)
