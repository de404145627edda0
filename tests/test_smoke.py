"""The package imports, converts and reads back exactly (fuller tests live beside this file)."""

from __future__ import annotations

import numpy as np

import birdzarr


def test_parquet_round_trip_is_exact(parquet_source, small_store) -> None:  # type: ignore[no-untyped-def]
    _, truth = parquet_source
    assert len(small_store) == sum(len(w) for w in truth.values())
    for device, windows in truth.items():
        got = small_store.device_windows(device)
        assert got.dtype == np.float32
        assert np.array_equal(got.view(np.uint32), windows.view(np.uint32))
    assert list(small_store.devices["device_id"]) == sorted(truth)
    assert isinstance(small_store, birdzarr.Store)


def test_generate_demo_makes_exports_that_convert(tmp_path) -> None:  # type: ignore[no-untyped-def]
    source = birdzarr.generate_demo(tmp_path / "csv", devices=2, bursts_per_device=20, parts=2, seed=1)
    assert source == tmp_path / "csv"
    assert sorted(p.name for p in source.iterdir()) == ["200_0.csv", "200_1.csv", "207_0.csv", "207_1.csv"]
    store = birdzarr.convert(source, tmp_path / "demo.zarr", progress=False)
    assert store.devices["device_id"].tolist() == [200, 207]
    assert store.devices["n_windows"].sum() == len(store) > 0
