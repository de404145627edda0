"""The shuffle's first pass codes each device's windows into its own dictionaries
(``birdzarr.convert._device_coder``): codes that give the windows back exactly, in any number of
blocks, and a shuffled store that verifies against its source."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import birdzarr
from birdzarr.convert import _shuffle
from birdzarr.convert._device_coder import DeviceCoder
from birdzarr.demo import _synthetic


def test_device_coder_codes_block_after_block_in_order_first_seen() -> None:
    windows = _synthetic.curated_windows(5000, seed=1, calibration_seed=1)
    windows[0, 0, 0] = np.float32(-0.0)
    coder = DeviceCoder(4)
    blocks = [coder.codes(windows[a : a + 1500]) for a in range(0, 5000, 1500)]
    codes = np.concatenate(blocks, axis=1)
    assert codes.dtype == np.uint16 and codes.shape == (4, 5000, 20)
    for c in range(4):
        known = coder.known[c]
        assert len(np.unique(known)) == len(known)
        assert np.array_equal(known[codes[c]], windows.view(np.uint32)[:, :, c])
        _, first = np.unique(windows.view(np.uint32)[:, :, c].reshape(-1), return_index=True)
        assert np.array_equal(known, windows.view(np.uint32)[:, :, c].reshape(-1)[np.sort(first)])


def test_device_coder_widens_its_codes_beyond_65536_values() -> None:
    coder = DeviceCoder(1)
    values = np.arange(70_000, dtype=np.float32).reshape(-1, 20, 1)
    codes = coder.codes(values)
    assert codes.dtype == np.uint32
    assert np.array_equal(coder.known[0][codes[0]], values.view(np.uint32)[:, :, 0])


@pytest.mark.slow
def test_a_shuffled_store_verifies_against_its_source(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pass 1 spills codes into each device's dictionaries, pass 2 turns them back into the
    float32 windows the writer codes: the store holds every window once and its checksums verify
    against the source."""
    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 4000)
    directory, truth = parquet_source
    store = birdzarr.convert(directory, tmp_path / "s.zarr", shuffle=True, seed=8, chunk_windows=1024,
                             progress=False, shuffle_tmp=str(tmp_path))
    assert store.format_version == 2 and store.meta["layout"]["shuffle_buckets"] > 1
    result = birdzarr.verify(tmp_path / "s.zarr", source=directory)
    assert result.ok, result.format()
    assert result.checksums_checked == len(truth)
    for device, windows in truth.items():
        got = store.device_windows(device)
        assert sorted(map(bytes, got.view(np.uint32))) == sorted(map(bytes, windows.view(np.uint32)))
