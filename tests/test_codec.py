"""The dict16 codec: lossless for every float32 bit pattern, and the byte layout of docs/format.md."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import zarr

from birdzarr.demo import _synthetic
from birdzarr.format._codec import MAGIC, decode_dict16, encode_dict16, gimu_codecs


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


@pytest.mark.parametrize("codec", ["dict16", "gdict16", "standard"])
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


@pytest.mark.parametrize("codec", ["dict16", "gdict16", "standard"])
def test_chunk_codec_reads_what_zarr_wrote_and_writes_what_zarr_writes(codec: str, tmp_path: object) -> None:
    """One object per chain, parsed from zarr.json: its bytes are zarr's, and it decodes zarr's."""
    from birdzarr.format._codec import ChunkCodec, per_window_codecs

    windows = _synthetic.curated_windows(2048, seed=9)
    array = zarr.create_array(str(tmp_path), name="gimu", shape=windows.shape, chunks=(2048, 20, 4),
                              dtype="float32", fill_value=0.0, zarr_format=3, **gimu_codecs(codec))
    array[:] = windows
    parsed = ChunkCodec.parse(array.metadata.to_dict()["codecs"], dtype="float32")
    assert parsed is not None and parsed.kind == codec and parsed.crc32c
    stored = (pathlib.Path(str(tmp_path)) / "gimu" / "c" / "0" / "0" / "0").read_bytes()
    assert parsed.encode(windows) == stored
    out = np.empty_like(windows)
    assert parsed.decode(stored, windows.shape, out=out) is out and _same_bits(out, windows)
    assert _same_bits(parsed.decode(stored, windows.shape), windows)
    with pytest.raises(ValueError, match="crc32c checksum mismatch"):
        parsed.decode(stored[:-1] + bytes([stored[-1] ^ 1]), windows.shape)

    labels = np.arange(2048, dtype=np.int32)
    per_window = zarr.create_array(str(tmp_path), name="label", shape=(2048,), chunks=(2048,), dtype="int32",
                                   fill_value=-1, zarr_format=3, **per_window_codecs())
    per_window[:] = labels
    plain = ChunkCodec.parse(per_window.metadata.to_dict()["codecs"], dtype="int32")
    assert plain is not None and plain.kind == "plain"
    stored = (pathlib.Path(str(tmp_path)) / "label" / "c" / "0").read_bytes()
    assert plain.encode(labels) == stored
    assert plain.decode(stored, (2048,)).tolist() == labels.tolist()
    # a chain birdzarr does not write (no compressor) is left to zarr-python
    assert ChunkCodec.parse([{"name": "bytes", "configuration": {"endian": "little"}}]) is None


def test_dict16_beats_parquet_class_ratio() -> None:
    """On calibrated values the dict16 chain must stay well above Parquet's ~2.1x (CONTEXT.md)."""
    from numcodecs import Blosc

    from birdzarr.format._codec import DEFAULT_CLEVEL, DEFAULT_CNAME

    windows = _synthetic.curated_windows(8192, seed=9)
    default = Blosc(cname=DEFAULT_CNAME, clevel=DEFAULT_CLEVEL, shuffle=Blosc.BITSHUFFLE, typesize=2)
    assert windows.nbytes / len(default.encode(encode_dict16(windows))) > 2.5
    # and far above a plain blosc store of the same values (~1.35x)
    plain = Blosc(cname=DEFAULT_CNAME, clevel=DEFAULT_CLEVEL, shuffle=Blosc.BITSHUFFLE, typesize=4)
    assert len(plain.encode(windows)) > 1.8 * len(default.encode(encode_dict16(windows)))


# -- gdict16: one dictionary per group (device) of windows --------------------------------------
def _shuffled_devices(n_devices: int, per_device: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows of several calibrated devices in one random order, with their device ids."""
    windows = np.concatenate(
        [_synthetic.curated_windows(per_device, seed=seed + d) for d in range(n_devices)]
    )
    devices = np.repeat(np.arange(n_devices, dtype=np.int32) * 7 + 200, per_device)
    order = np.random.default_rng(seed).permutation(len(windows))
    return np.ascontiguousarray(windows[order]), devices[order]


def _numpy_gdict16(b: bytes, shape: tuple[int, ...]) -> np.ndarray:
    """The plain numpy decoder of docs/format.md#gdict16, spelled out as a reader would."""
    mode, W, T, K, G = (int(v) for v in np.frombuffer(b[4:24], "<u4"))
    off = 24
    if mode == 0:
        cm = np.frombuffer(b[off:off + 4 * K * W * T], "<f4").reshape(K, W, T)
        return np.ascontiguousarray(cm.transpose(1, 2, 0)).reshape(shape)
    group = np.frombuffer(b[off:off + 2 * W], "<u2").astype(np.int64)
    off += 2 * W
    sizes = np.frombuffer(b[off:off + 4 * K * G], "<u4").reshape(K, G).astype(np.int64)
    off += 4 * K * G
    dicts, starts = [], []
    for c in range(K):
        n = int(sizes[c].sum())
        halves = np.frombuffer(b[off:off + 4 * n], "<u2").astype(np.uint32)
        deltas = halves[:n] | (halves[n:] << np.uint32(16))
        off += 4 * n
        first = np.cumsum(sizes[c]) - sizes[c]
        entries = []
        for g in range(G):  # each group's entries are a running sum of its deltas
            entries.append(np.cumsum(deltas[first[g]:first[g] + sizes[c][g]], dtype=np.uint32))
        dicts.append(np.concatenate(entries).view("<f4"))
        starts.append(first)
    codes = np.frombuffer(b[off:off + 2 * K * W * T], "<u2").reshape(K, W, T)
    cm = np.stack([dicts[c][codes[c] + starts[c][group][:, None]] for c in range(K)])
    return np.ascontiguousarray(cm.transpose(1, 2, 0)).reshape(shape)


@pytest.mark.parametrize("grouped", [True, False])
def test_gdict16_round_trip_and_numpy_decoder(grouped: bool) -> None:
    from birdzarr.format._codec import GMAGIC, decode_gdict16, encode_gdict16

    windows, devices = _shuffled_devices(6, 500, seed=3)
    windows[0, 0] = [np.nan, -0.0, np.float32(1e-45), np.inf]  # any bit pattern, NaN payloads too
    windows[1, :, 3] = np.float32(-np.nan)
    blob = encode_gdict16(windows, devices if grouped else None)
    assert blob[:4] == GMAGIC and int(np.frombuffer(blob[4:8], "<u4")[0]) == 1
    assert int(np.frombuffer(blob[20:24], "<u4")[0]) == (6 if grouped else 1)
    assert _same_bits(decode_gdict16(blob, windows.shape), windows)
    assert _same_bits(_numpy_gdict16(blob, windows.shape), windows)
    out = np.full(windows.shape, 7.0, np.float32)  # a recycled buffer, as a reader passes
    assert decode_gdict16(blob, windows.shape, out=out) is out and _same_bits(out, windows)
    with pytest.raises(ValueError, match="truncated"):
        decode_gdict16(blob[:-10], windows.shape)


def test_gdict16_rejects_a_code_outside_its_window_dictionary() -> None:
    """Both decoding paths (one value a window, as gps_speed; one a sample) check every code."""
    from birdzarr.format._codec import decode_gdict16, encode_gdict16

    windows, devices = _shuffled_devices(5, 40, seed=3)
    assert (windows[:, :, 3] == windows[:, :1, 3]).all()  # gps_speed: one value a window
    blob = bytearray(encode_gdict16(windows, devices))
    n_values = windows.shape[0] * windows.shape[1]
    codes_at = len(blob) - 2 * n_values * 4  # channel-major uint16 codes end the chunk
    for channel, span in ((3, slice(0, windows.shape[1])), (0, slice(5, 6))):
        bad = bytearray(blob)
        codes = np.frombuffer(bad, dtype="<u2", offset=codes_at).reshape(4, -1)
        codes[channel, span] = 65535  # a whole window (constant path) or one sample
        with pytest.raises(ValueError, match=f"gdict16 code out of range in channel {channel}"):
            decode_gdict16(bytes(bad), windows.shape)
    assert _same_bits(decode_gdict16(bytes(blob), windows.shape), windows)


def test_gdict16_raw_mode_when_a_group_has_too_many_values() -> None:
    from birdzarr.format._codec import decode_gdict16, encode_gdict16

    windows = np.random.default_rng(0).standard_normal((4000, 20, 4)).astype(np.float32)  # 80,000 distinct
    blob = encode_gdict16(windows, np.zeros(4000, np.int32))
    assert int(np.frombuffer(blob[4:8], "<u4")[0]) == 0
    assert _same_bits(decode_gdict16(blob, windows.shape), windows)
    assert _same_bits(_numpy_gdict16(blob, windows.shape), windows)
    # split into groups that each fit, the same windows are dictionary-coded
    blob = encode_gdict16(windows, np.arange(4000) // 1000)
    assert int(np.frombuffer(blob[4:8], "<u4")[0]) == 1
    assert _same_bits(decode_gdict16(blob, windows.shape), windows)


def test_gdict16_chunk_encoder_matches_zarr_without_groups() -> None:
    """Without groups the fast path's bytes are zarr-python's; with groups zarr reads them back."""
    import zarr.storage

    from birdzarr.format._codec import ChunkCodec

    windows, devices = _shuffled_devices(5, 400, seed=8)
    store = zarr.storage.MemoryStore()
    array = zarr.create_array(store, shape=windows.shape, chunks=windows.shape, dtype="float32",
                              fill_value=0.0, zarr_format=3, **gimu_codecs("gdict16"))
    array[:] = windows
    codec = ChunkCodec.parse(array.metadata.to_dict()["codecs"])
    assert codec is not None
    encode = codec.encode
    key = "c/0/0/0"
    stored = store._store_dict[key].to_bytes()
    assert encode(windows) == stored
    grouped = encode(windows, devices)
    assert len(grouped) < 0.8 * len(stored)  # five calibrations: a dictionary each is smaller
    from zarr.core.buffer import default_buffer_prototype

    store._store_dict[key] = default_buffer_prototype().buffer.from_bytes(grouped)
    assert _same_bits(zarr.open_array(store, mode="r")[:], windows)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_gdict16_shuffled_chunk_is_smaller_than_parquet() -> None:
    """A shuffled store's chunk (its default size and compressor) mixing 40 calibrated devices:
    dict16 falls back to raw floats, gdict16 stays below the per-device Parquet size (~2.2x,
    CONTEXT.md)."""
    from numcodecs import Blosc

    from birdzarr.format._codec import DEFAULT_CLEVEL, DEFAULT_CNAME, encode_gdict16
    from birdzarr.format._spec import SHUFFLED_CHUNK_WINDOWS

    windows, devices = _shuffled_devices(40, 820, seed=5)
    windows, devices = windows[:SHUFFLED_CHUNK_WINDOWS], devices[:SHUFFLED_CHUNK_WINDOWS]
    lz4 = Blosc(cname=DEFAULT_CNAME, clevel=DEFAULT_CLEVEL, shuffle=Blosc.BITSHUFFLE, typesize=2)
    codes = np.frombuffer(encode_gdict16(windows, devices), np.uint16)  # typesize 2, as zarr's chain
    assert windows.nbytes / len(lz4.encode(codes)) > 2.2


def _reference_dict16(array: np.ndarray) -> bytes:
    """dict16 spelled out with np.unique: the fast encoder must give exactly these bytes."""
    cm = np.ascontiguousarray(array.reshape(-1, array.shape[-1]).T).view(np.uint32)
    found = [np.unique(cm[c], return_inverse=True) for c in range(cm.shape[0])]
    header = MAGIC + np.array([1, cm.shape[1], cm.shape[0]], "<u4").tobytes()
    sizes = np.array([len(d) for d, _ in found], "<u4").tobytes()
    return b"".join([header, sizes, *[d.astype("<u4").tobytes() for d, _ in found],
                     *[i.astype("<u2").tobytes() for _, i in found]])


def test_dict16_bytes_equal_a_reference_encoder() -> None:
    """The hash-based encoder (and its once-a-window path for gps_speed) changes no byte."""
    windows = _synthetic.curated_windows(3000, seed=12)
    windows[5, 3, 3] = np.float32(0.5)  # gps no longer constant in one window: the general path
    for chunk in (_synthetic.curated_windows(3000, seed=13), windows):
        assert encode_dict16(chunk) == _reference_dict16(chunk)
