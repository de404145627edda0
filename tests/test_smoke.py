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
