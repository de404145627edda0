"""The dict16 codec: lossless for every float32 bit pattern, and the byte layout of docs/format.md."""

from __future__ import annotations

import numpy as np
import pytest
import zarr

from birdzarr import _synthetic
from birdzarr._codec import MAGIC, decode_dict16, encode_dict16, gimu_codecs


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_round_trip_realistic(n: int) -> None:
    windows = _synthetic.curated_windows(n, seed=n)
    assert _same_bits(decode_dict16(encode_dict16(windows), windows.shape), windows)


def test_special_values_round_trip() -> None:
    bits = np.array([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800000, 0xFF800000, 0x80000000, 0, 1], np.uint32)
    values = np.resize(bits, 40 * 80).view(np.float32).reshape(40, 20, 4)
    assert _same_bits(decode_dict16(encode_dict16(values), values.shape), values)


def test_byte_layout_dict_mode() -> None:
    """Header, per-channel sizes, sorted dictionaries, then uint16 codes channel-major."""
    values = np.array([[[3.0, 1.0], [2.0, 1.0], [3.0, 5.0]]], dtype=np.float32)  # (1, 3, 2)
    data = encode_dict16(values)
    assert data[:4] == MAGIC
    mode, per_channel, channels = np.frombuffer(data[4:16], "<u4")
    assert (mode, per_channel, channels) == (1, 3, 2)
    assert np.frombuffer(data[16:24], "<u4").tolist() == [2, 2]
    assert np.frombuffer(data[24:40], "<f4").tolist() == [2.0, 3.0, 1.0, 5.0]
    assert np.frombuffer(data[40:], "<u2").tolist() == [1, 0, 1, 0, 0, 1]


def test_raw_mode_when_a_channel_has_too_many_values() -> None:
    values = np.arange(70_000 * 4, dtype=np.float32).reshape(-1, 20, 4) * np.float32(1.0001)
    data = encode_dict16(values)
    assert np.frombuffer(data[4:8], "<u4")[0] == 0  # mode raw
    assert len(data) == 16 + values.nbytes
    assert _same_bits(decode_dict16(data, values.shape), values)


def test_decode_rejects_other_bytes() -> None:
    data = encode_dict16(np.zeros((2, 20, 4), np.float32))
    with pytest.raises(ValueError, match="not a dict16 chunk"):
        decode_dict16(data, (3, 20, 4))
    with pytest.raises(ValueError, match="not a dict16 chunk"):
        decode_dict16(b"XXXX" + data[4:], (2, 20, 4))
    with pytest.raises(TypeError):
        encode_dict16(np.zeros((2, 20, 4), np.float64))


@pytest.mark.parametrize("codec", ["dict16", "standard"])
def test_zarr_chain(codec: str, tmp_path: object) -> None:
    windows = _synthetic.curated_windows(5000, seed=4)
    array = zarr.create_array(
        str(tmp_path),
        shape=windows.shape,
        chunks=(2048, 20, 4),
        dtype="float32",
        fill_value=0.0,
        zarr_format=3,
        **gimu_codecs(codec),
    )
    array[:] = windows
    reopened = zarr.open_array(str(tmp_path), mode="r")
    assert _same_bits(reopened[:], windows)
    assert _same_bits(reopened[4000:4100], windows[4000:4100])


def test_dict16_beats_parquet_class_ratio() -> None:
    """On calibrated values the dict16 chain must stay well above Parquet's ~2.1x (CONTEXT.md)."""
    from numcodecs import Blosc

    from birdzarr._codec import DEFAULT_CLEVEL, DEFAULT_CNAME

    windows = _synthetic.curated_windows(8192, seed=9)
    default = Blosc(cname=DEFAULT_CNAME, clevel=DEFAULT_CLEVEL, shuffle=Blosc.BITSHUFFLE, typesize=2)
    assert windows.nbytes / len(default.encode(encode_dict16(windows))) > 2.5
    # and far above a plain blosc store of the same values (~1.35x)
    plain = Blosc(cname=DEFAULT_CNAME, clevel=DEFAULT_CLEVEL, shuffle=Blosc.BITSHUFFLE, typesize=4)
    assert len(plain.encode(windows)) > 1.8 * len(default.encode(encode_dict16(windows)))
