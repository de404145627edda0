"""Format 1's window codecs, read only: dict16 and gdict16 chunks decode exactly what the byte
layouts of docs/format.md say (bytes built here from the spec, and the chunks of the stores in
tests/data/format1/), and ``ChunkCodec`` writes the core chains zarr-python writes."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import zarr

from birdzarr.demo import _synthetic
from birdzarr.format._codec import GMAGIC, MAGIC, ChunkCodec, decode_dict16, decode_gdict16
from tests.format1_support import FORMAT1, NAMES


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _dict16(array: np.ndarray) -> bytes:
    """A dict16 chunk spelled out from docs/format.md with np.unique (raw past 65,535 values)."""
    cm = np.ascontiguousarray(array.reshape(-1, array.shape[-1]).T).view(np.uint32)
    found = [np.unique(cm[c], return_inverse=True) for c in range(cm.shape[0])]
    if max(len(d) for d, _ in found) > 65535:
        return MAGIC + np.array([0, cm.shape[1], cm.shape[0]], "<u4").tobytes() + cm.astype("<u4").tobytes()
    header = MAGIC + np.array([1, cm.shape[1], cm.shape[0]], "<u4").tobytes()
    sizes = np.array([len(d) for d, _ in found], "<u4").tobytes()
    return b"".join([header, sizes, *[d.astype("<u4").tobytes() for d, _ in found],
                     *[i.reshape(-1).astype("<u2").tobytes() for _, i in found]])


def _gdict16(windows: np.ndarray, groups: np.ndarray) -> bytes:
    """A gdict16 chunk spelled out from docs/format.md#gdict16: per channel and group the sorted
    distinct bit patterns, as deltas restarting at each group, low halves then high halves."""
    n_windows, n_per_window, n_channels = windows.shape
    labels, group = np.unique(groups, return_inverse=True)
    n_groups = len(labels)
    bits = np.ascontiguousarray(windows.transpose(2, 0, 1)).view(np.uint32)  # (K, W, T)
    sizes = np.zeros((n_channels, n_groups), np.uint32)
    parts, codes = [], np.empty((n_channels, n_windows, n_per_window), "<u2")
    for c in range(n_channels):
        deltas = []
        for g in range(n_groups):
            mine = group == g
            values, inverse = np.unique(bits[c][mine], return_inverse=True)
            if len(values) > 65535:
                header = np.array([0, n_windows, n_per_window, n_channels, n_groups], "<u4").tobytes()
                return GMAGIC + header + bits.astype("<u4").tobytes()
            sizes[c, g] = len(values)
            codes[c][mine] = inverse.reshape(-1, n_per_window)
            deltas.append(np.diff(values, prepend=np.uint32(0)))
        d = np.concatenate(deltas).astype(np.uint32)
        parts += [(d & 0xFFFF).astype("<u2").tobytes(), (d >> 16).astype("<u2").tobytes()]
    header = np.array([1, n_windows, n_per_window, n_channels, n_groups], "<u4").tobytes()
    return b"".join([GMAGIC, header, group.astype("<u2").tobytes(), sizes.astype("<u4").tobytes(), *parts,
                     codes.tobytes()])


def _shuffled_devices(n_devices: int, per_device: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    windows = np.concatenate([_synthetic.curated_windows(per_device, seed=seed + d)
                              for d in range(n_devices)])
    devices = np.repeat(np.arange(n_devices, dtype=np.int32) * 7 + 200, per_device)
    order = np.random.default_rng(seed).permutation(len(windows))
    return np.ascontiguousarray(windows[order]), devices[order]


@pytest.mark.parametrize("n", [1, 7, 1000])
def test_dict16_decodes_realistic_windows(n: int) -> None:
    windows = _synthetic.curated_windows(n, seed=n)
    assert _same_bits(decode_dict16(_dict16(windows), windows.shape), windows)


def test_dict16_decodes_every_bit_pattern() -> None:
    bits = np.array([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800000, 0xFF800000, 0x80000000, 0, 1], np.uint32)
    values = np.resize(bits, 40 * 80).view(np.float32).reshape(40, 20, 4)
    out = np.full(values.shape, 7.0, np.float32)  # a recycled buffer, as a reader passes
    assert decode_dict16(_dict16(values), values.shape, out=out) is out and _same_bits(out, values)


def test_dict16_byte_layout() -> None:
    """Header, per-channel sizes, sorted dictionaries, then uint16 codes channel-major."""
    data = (MAGIC + np.array([1, 3, 2, 2, 2], "<u4").tobytes()
            + np.array([2.0, 3.0, 1.0, 5.0], "<f4").tobytes() + np.array([1, 0, 1, 0, 0, 1], "<u2").tobytes())
    expected = np.array([[[3.0, 1.0], [2.0, 1.0], [3.0, 5.0]]], dtype=np.float32)
    assert _same_bits(decode_dict16(data, (1, 3, 2)), expected)


def test_dict16_raw_mode_decodes() -> None:
    values = np.arange(70_000 * 4, dtype=np.float32).reshape(-1, 20, 4) * np.float32(1.0001)
    data = _dict16(values)
    assert np.frombuffer(data[4:8], "<u4")[0] == 0 and len(data) == 16 + values.nbytes  # mode raw
    assert _same_bits(decode_dict16(data, values.shape), values)


def test_dict16_decode_rejects_other_bytes() -> None:
    data = _dict16(np.zeros((2, 20, 4), np.float32))
    with pytest.raises(ValueError, match="not a dict16 chunk"):
        decode_dict16(data, (3, 20, 4))
    with pytest.raises(ValueError, match="not a dict16 chunk"):
        decode_dict16(b"XXXX" + data[4:], (2, 20, 4))


@pytest.mark.parametrize("grouped", [True, False])
def test_gdict16_decodes_the_spelled_out_layout(grouped: bool) -> None:
    windows, devices = _shuffled_devices(6, 500, seed=3)
    windows[0, 0] = [np.nan, -0.0, np.float32(1e-45), np.inf]  # any bit pattern, NaN payloads too
    windows[1, :, 3] = np.float32(-np.nan)
    blob = _gdict16(windows, devices if grouped else np.zeros(len(windows), np.int32))
    assert int(np.frombuffer(blob[20:24], "<u4")[0]) == (6 if grouped else 1)
    assert _same_bits(decode_gdict16(blob, windows.shape), windows)
    out = np.full(windows.shape, 7.0, np.float32)
    assert decode_gdict16(blob, windows.shape, out=out) is out and _same_bits(out, windows)
    with pytest.raises(ValueError, match="truncated"):
        decode_gdict16(blob[:-10], windows.shape)


def test_gdict16_rejects_a_code_outside_its_window_dictionary() -> None:
    """Both decoding paths (one value a window, as gps_speed; one a sample) check every code."""
    windows, devices = _shuffled_devices(5, 40, seed=3)
    assert (windows[:, :, 3] == windows[:, :1, 3]).all()  # gps_speed: one value a window
    blob = _gdict16(windows, devices)
    codes_at = len(blob) - 2 * windows.size  # channel-major uint16 codes end the chunk
    for channel, span in ((3, slice(0, windows.shape[1])), (0, slice(5, 6))):
        bad = bytearray(blob)
        codes = np.frombuffer(bad, dtype="<u2", offset=codes_at).reshape(4, -1)
        codes[channel, span] = 65535  # a whole window (constant path) or one sample
        with pytest.raises(ValueError, match=f"gdict16 code out of range in channel {channel}"):
            decode_gdict16(bytes(bad), windows.shape)
    assert _same_bits(decode_gdict16(blob, windows.shape), windows)


def test_gdict16_raw_mode_decodes() -> None:
    windows = np.random.default_rng(0).standard_normal((4000, 20, 4)).astype(np.float32)  # 80,000 distinct
    blob = _gdict16(windows, np.zeros(4000, np.int32))
    assert int(np.frombuffer(blob[4:8], "<u4")[0]) == 0
    assert _same_bits(decode_gdict16(blob, windows.shape), windows)


@pytest.mark.parametrize("name", NAMES)
def test_every_chunk_of_the_format_1_stores_decodes_as_zarr_reads_it(name: str) -> None:
    """Each gimu chunk of the committed format-1 stores, decoded by ``ChunkCodec`` (birdzarr's
    reader) and by zarr-python through the registered codecs, gives the same windows; both
    codecs and ChunkCodec refuse to write format 1."""
    path = FORMAT1 / name / "gimu"
    meta = json.loads((path / "zarr.json").read_text())
    codec = ChunkCodec.parse(meta["codecs"])
    assert codec is not None and codec.kind == {"standard.zarr": "standard", "gdict16.zarr": "gdict16"}.get(
        name, "dict16")
    array = zarr.open_array(str(path), mode="r", zarr_format=3)
    chunk = int(meta["chunk_grid"]["configuration"]["chunk_shape"][0])
    for index in range(-(-array.shape[0] // chunk)):
        data = (path / "c" / str(index) / "0" / "0").read_bytes()
        got = codec.decode(data, (chunk, 20, 4))
        stop = min(array.shape[0], (index + 1) * chunk)
        assert _same_bits(got[: stop - index * chunk], np.asarray(array[index * chunk : stop]))
    if codec.kind != "standard":
        with pytest.raises(ValueError, match="format 1's, which birdzarr reads and no longer writes"):
            codec.encode(np.zeros((chunk, 20, 4), np.float32))
        writable = zarr.create_array(zarr.storage.MemoryStore(), shape=(4, 20, 4), chunks=(4, 20, 4),
                                     dtype="float32", fill_value=0.0, zarr_format=3,
                                     serializer=array.metadata.codecs[0])
        with pytest.raises(NotImplementedError, match="no longer writes: write a format-2 store"):
            writable[:] = np.ones((4, 20, 4), np.float32)


def test_chunk_codec_writes_what_zarr_writes(tmp_path: pathlib.Path) -> None:
    """The chains birdzarr writes: its bytes are zarr's, and it decodes zarr's."""
    from zarr.codecs import BloscCodec, BytesCodec, Crc32cCodec, TransposeCodec

    from birdzarr.format._codec import per_window_codecs

    windows = _synthetic.curated_windows(2048, seed=9)
    array = zarr.create_array(str(tmp_path), name="w", shape=windows.shape, chunks=(2048, 20, 4),
                              dtype="float32", fill_value=0.0, zarr_format=3,
                              filters=(TransposeCodec(order=(2, 0, 1)),),
                              serializer=BytesCodec(endian="little"),
                              compressors=(BloscCodec(cname="lz4", clevel=5, shuffle="bitshuffle",
                                                      typesize=4), Crc32cCodec()))
    array[:] = windows
    parsed = ChunkCodec.parse(array.metadata.to_dict()["codecs"], dtype="float32")
    assert parsed is not None and parsed.kind == "standard" and parsed.crc32c
    stored = (tmp_path / "w" / "c" / "0" / "0" / "0").read_bytes()
    assert parsed.encode(windows) == stored
    assert _same_bits(parsed.decode(stored, windows.shape), windows)
    with pytest.raises(ValueError, match="crc32c checksum mismatch"):
        parsed.decode(stored[:-1] + bytes([stored[-1] ^ 1]), windows.shape)
    labels = np.arange(2048, dtype=np.int32)
    per_window = zarr.create_array(str(tmp_path), name="label", shape=(2048,), chunks=(2048,), dtype="int32",
                                   fill_value=-1, zarr_format=3, **per_window_codecs())
    per_window[:] = labels
    plain = ChunkCodec.parse(per_window.metadata.to_dict()["codecs"], dtype="int32")
    assert plain is not None and plain.kind == "plain"
    stored = (tmp_path / "label" / "c" / "0").read_bytes()
    assert plain.encode(labels) == stored
    assert plain.decode(stored, (2048,)).tolist() == labels.tolist()
    # a chain birdzarr does not write (no compressor) is left to zarr-python
    assert ChunkCodec.parse([{"name": "bytes", "configuration": {"endian": "little"}}]) is None
