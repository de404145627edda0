"""The shuffle's gdict16 encoder (codes into per-device dictionaries, no sort) writes exactly the
bytes of the reference encoder, ``birdzarr.format._codec.encode_gdict16``."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import birdzarr
from birdzarr.convert import _shuffle
from birdzarr.convert._gdict_encode import PAD_GROUP, DeviceCoder, DictionaryTable
from birdzarr.demo import _synthetic
from birdzarr.format._codec import ChunkCodec, encode_gdict16


def _coded(windows: np.ndarray, devices: np.ndarray) -> tuple[DictionaryTable, np.ndarray]:
    """A table of every device's distinct values and the windows' codes into it."""
    bits = windows.view(np.uint32)
    dictionaries = {
        int(d): [np.unique(bits[devices == d][:, :, c]) for c in range(windows.shape[2])]
        for d in np.unique(devices)
    }
    table = DictionaryTable(dictionaries, windows.shape[2])
    codes = np.empty((len(windows), windows.shape[2], windows.shape[1]), dtype=table.code_dtype)
    for d in dictionaries:
        rows = np.flatnonzero(devices == d)
        for c in range(windows.shape[2]):
            codes[rows, c, :] = table.codes_of(d, c, bits[rows][:, :, c])
    return table, codes


def _shuffled(n_devices: int, per_device: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Calibrated windows of several devices in one random order (gps_speed constant within
    each window), with their device ids."""
    windows = np.concatenate([
        _synthetic.curated_windows(per_device, seed=seed + d, calibration_seed=d) for d in range(n_devices)
    ])
    devices = np.repeat(np.arange(n_devices, dtype=np.int32) * 7 + 3, per_device)
    order = np.random.default_rng(seed).permutation(len(windows))
    return np.ascontiguousarray(windows[order]), devices[order]


@pytest.mark.parametrize(("n_devices", "per_device"), [
    (1, 50), (5, 400), (40, 205),
    pytest.param(300, 30, marks=pytest.mark.slow),  # over 0.2 s of CPU: not in the fast loop
])
def test_chunks_are_the_reference_bytes(n_devices: int, per_device: int) -> None:
    windows, devices = _shuffled(n_devices, per_device, seed=n_devices)
    table, codes = _coded(windows, devices)
    assert np.array_equal(table.decode(codes, devices).view(np.uint32), windows.view(np.uint32))
    assert table.encode(codes, devices) == encode_gdict16(windows, devices)
    # any run of windows is a chunk: the device dictionaries are supersets of what it uses
    part = slice(len(windows) // 3, len(windows) // 2)
    assert table.encode(codes[part], devices[part]) == encode_gdict16(windows[part], devices[part])


def test_the_padded_last_chunk_is_the_reference_bytes() -> None:
    """The chunk sink pads a store's last chunk with 0.0 in group -1; the encoder pads itself."""
    windows, devices = _shuffled(6, 100, seed=2)
    table, codes = _coded(windows, devices)
    n = 1024
    padded = np.zeros((n, *windows.shape[1:]), dtype=np.float32)
    padded[: len(windows)] = windows
    groups = np.concatenate([devices, np.full(n - len(devices), PAD_GROUP, dtype=devices.dtype)])
    assert table.encode(codes, devices, n) == encode_gdict16(padded, groups)


def test_special_bit_patterns_and_a_device_numbered_like_the_padding() -> None:
    """NaNs of several payloads, -0.0 and 0.0, infinities: bit patterns, as the reference; a real
    device -1 shares the padding's group, as in the reference."""
    windows, _ = _shuffled(3, 64, seed=4)
    special = np.array([np.nan, -0.0, 0.0, np.inf, -np.inf], dtype=np.float32)
    windows[::7, 3, :3] = special[np.arange(len(windows[::7])) % len(special)][:, None]
    windows.view(np.uint32)[5, 2, 0] = 0x7FC00001  # another NaN payload
    windows.view(np.uint32)[9, 4, 1] = 0xFFC00000  # and a negative one
    devices = np.random.default_rng(1).choice(np.array([-1, 4, 9], dtype=np.int32), len(windows))
    table, codes = _coded(windows, devices)
    assert np.array_equal(table.decode(codes, devices).view(np.uint32), windows.view(np.uint32))
    assert table.encode(codes, devices) == encode_gdict16(windows, devices)
    padded = np.zeros((256, *windows.shape[1:]), dtype=np.float32)
    padded[: len(windows)] = windows
    groups = np.concatenate([devices, np.full(256 - len(devices), PAD_GROUP, dtype=np.int32)])
    assert table.encode(codes, devices, 256) == encode_gdict16(padded, groups)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_group_with_too_many_values_makes_the_chunk_raw_as_the_reference() -> None:
    """A device with more than 65,535 distinct values in a chunk: the whole chunk is raw floats;
    its dictionary of 72,000 entries needs uint32 codes."""
    rng = np.random.default_rng(3)
    windows = rng.standard_normal((4000, 20, 4)).astype(np.float32)
    windows[:, :, 3] = windows[:, :1, 3]  # gps_speed: constant within each window
    devices = np.where(np.arange(4000) % 10 == 0, 11, 12).astype(np.int32)
    table, codes = _coded(windows, devices)
    assert table.code_dtype == np.uint32
    reference = encode_gdict16(windows, devices)
    assert int.from_bytes(reference[4:8], "little") == 0  # raw mode
    assert table.encode(codes, devices) == reference
    # a chunk of fewer windows stays in dictionary mode, coded from the same uint32 codes
    assert table.encode(codes[:3000], devices[:3000]) == encode_gdict16(windows[:3000], devices[:3000])


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


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_shuffled_store_chunks_are_what_the_reference_encoder_writes(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every gimu chunk of a format-1 shuffled store (the last one padded) equals the reference
    chain's bytes for the chunk's windows and device ids."""
    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 4000)
    directory, _ = parquet_source
    store = birdzarr.convert(directory, tmp_path / "s.zarr", shuffle=True, seed=3, chunk_windows=2048,
                             progress=False, shuffle_tmp=str(tmp_path), format_version=1)
    codec = ChunkCodec.parse(store.gimu.metadata.to_dict()["codecs"])
    assert codec is not None and codec.kind == "gdict16"
    windows, devices = store.windows[:], store.window_devices[:]
    n_chunks = -(-len(windows) // 2048)
    assert len(windows) % 2048  # the last chunk is padded
    for index in range(n_chunks):
        part = slice(index * 2048, (index + 1) * 2048)
        chunk = np.zeros((2048, 20, 4), dtype=np.float32)
        groups = np.full(2048, PAD_GROUP, dtype=np.int32)
        chunk[: len(windows[part])], groups[: len(devices[part])] = windows[part], devices[part]
        stored = (tmp_path / "s.zarr" / "gimu" / "c" / str(index) / "0" / "0").read_bytes()
        assert codec.encode(chunk, groups) == stored


@pytest.mark.slow
@pytest.mark.parametrize("codec", [None, "gdict16", "standard"], ids=["default", "gdict16", "standard"])
def test_a_shuffled_store_verifies_against_its_source_with_any_codec(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch, codec: str | None,
) -> None:
    """gdict16 is written from codes, format 1's other codecs from the float32 windows pass 2
    decodes, format 2 (the default, codec None) as uint16 codes and dictionaries: each holds every
    window once and their checksums verify against the source."""
    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 4000)
    directory, truth = parquet_source
    options = {} if codec is None else {"codec": codec, "format_version": 1}
    store = birdzarr.convert(directory, tmp_path / "s.zarr", shuffle=True, seed=8, chunk_windows=1024,
                             progress=False, shuffle_tmp=str(tmp_path), **options)
    assert store.meta["layout"].get("codec") == codec and store.meta["layout"]["shuffle_buckets"] > 1
    assert store.format_version == (2 if codec is None else 1)
    result = birdzarr.verify(tmp_path / "s.zarr", source=directory)
    assert result.ok, result.format()
    assert result.checksums_checked == len(truth)
    for device, windows in truth.items():
        got = store.device_windows(device)
        assert sorted(map(bytes, got.view(np.uint32))) == sorted(map(bytes, windows.view(np.uint32)))
