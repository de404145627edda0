"""Reading a format-2 store (uint16 codes + dictionaries, birdzarr/format/_v2.py): every window bit
for bit what the version-1 store it was made from gives, through every read path; damaged, missing
and out-of-dictionary chunks refused with the named error, never misread."""

from __future__ import annotations

import json
import pickle
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import birdzarr
from birdzarr._errors import CorruptChunkError, FormatVersionError, MissingChunkError
from birdzarr.format import _v2
from birdzarr.format._spec import GIMU
from birdzarr.store._chunks import ChunkReader
from birdzarr.store._summary import format_summary, summary

pytest_plugins = ["format2_support"]  # its fixtures: v2_pair, v2_shuffled_pair

Pair = tuple[birdzarr.Store, birdzarr.Store]


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def assert_exact(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(bits(got), bits(expected))


@pytest.fixture(params=["device order", "shuffled"])
def pair(request: pytest.FixtureRequest) -> Pair:
    name = "v2_pair" if request.param == "device order" else "v2_shuffled_pair"
    got: Pair = request.getfixturevalue(name)
    return got


def writable_copy(store: birdzarr.Store, dest: Path) -> Path:
    shutil.copytree(store.location.path, dest)
    return dest


def assert_cannot_decode(store: birdzarr.Store, read: Callable[[birdzarr.Store], object], chunk: str,
                         why: str) -> None:
    """``read(store)`` raises CorruptChunkError saying that ``chunk`` cannot be decoded, and ``why``."""
    with pytest.raises(CorruptChunkError) as refused:
        read(store)
    assert str(refused.value) == (
        f"{store.url}: chunk '{chunk}' cannot be decoded ({why}). The store is damaged; run "
        "`birdzarr verify`.")


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_every_read_path_gives_the_same_windows_bit_for_bit(pair: Pair) -> None:
    v1, v2 = pair  # v1: the reference, read through windows[:] and whole chunks
    assert (v2.format_version, v2.reader.format_version, v1.reader.format_version) == (2, 2, 2)
    assert "gimu" not in v2.reader.layouts and set(_v2.ARRAYS) <= set(v2.reader.layouts)
    assert len(v2) == len(v1) == 30_000 and v2.chunk_windows == 1024 and v2.reader.n_chunks == 30
    assert_exact(v2.windows[:], v1.windows[:])
    rng = np.random.default_rng(5)
    picked = rng.integers(-len(v1), len(v1), 3000)  # unsorted, repeated and negative indices
    assert_exact(v2.windows[picked], v1.windows[picked])
    assert_exact(v2.windows[5:1500], v1.windows[5:1500])  # partial chunks at both ends
    assert_exact(v2.windows[29_000:], v1.windows[29_000:])  # the last chunk is partial (304 windows)
    assert_exact(v2.windows[7:9000:7], v1.windows[7:9000:7])
    assert_exact(v2.windows[-1], v1.windows[-1])
    assert np.array_equal(v2.windows[100, :, 2], v1.windows[100, :, 2])
    assert_exact(v2.array_view(GIMU)[:50], v1.windows[:50])
    out = np.full((1024, 20, 4), np.nan, np.float32)
    for chunk in range(v2.reader.n_chunks):
        expected = v1.reader.read(GIMU, chunk)
        assert_exact(v2.reader.read(GIMU, chunk), expected)
        into = v2.reader.read(GIMU, chunk, out=out)
        assert np.shares_memory(into, out)  # decoded straight into the caller's buffer
        assert_exact(into, expected)
    device = int(v1.devices["device_id"].iloc[5])
    assert_exact(v2.device_windows(device), v1.device_windows(device))
    for view in ("window_devices", "labels", "timestamps"):
        assert np.array_equal(getattr(v2, view)[:], getattr(v1, view)[:])


def test_read_coded_and_the_dictionaries_decode_with_the_documented_lines(pair: Pair) -> None:
    v1, v2 = pair
    reader = v2.reader
    dictionaries = reader.dictionaries()
    assert reader.dictionaries() is dictionaries  # read once, kept
    assert sorted(dictionaries.device.tolist()) == sorted(v1.devices["device_id"].tolist())
    for chunk in (0, 17, reader.n_chunks - 1):
        codes, row, gps = reader.read_coded(chunk)
        n = len(v1.reader.read(GIMU, chunk))
        assert (codes.dtype, codes.shape, row.dtype, row.shape, gps.dtype, gps.shape) == (
            np.uint16, (n, 20, 3), np.uint32, (n,), np.float32, (n, 20))
        assert codes.flags.c_contiguous and row.flags.c_contiguous and gps.flags.c_contiguous
        decoded = _v2.decode_reference(codes, row, gps, dictionaries.values, dictionaries.start)
        assert_exact(decoded, v1.reader.read(GIMU, chunk))
        # each window's row is a row of its own device
        assert np.array_equal(dictionaries.device[row], v2.reader.read("device", chunk))
        # the stored arrays read as stored through read() too
        assert np.array_equal(reader.read(_v2.CODES, chunk), codes)
        assert np.array_equal(reader.read(_v2.ROW, chunk), row)
        assert np.array_equal(bits(reader.read(_v2.GPS, chunk)), bits(gps))
    assert v2.reader.read_codes(0) is None  # version 1's dict16 codes: none here


def test_a_format_1_store_has_no_dictionary_codes(small_store_v1: birdzarr.Store) -> None:
    with pytest.raises(ValueError, match="is a format-1 store: it has no dictionary codes"):
        small_store_v1.reader.read_coded(0)


def test_the_dictionaries_are_read_once_by_threads_reading_together(v2_pair: Pair) -> None:
    v1, v2 = v2_pair
    reader = ChunkReader(v2.location, v2.reader.layouts, len(v2))  # a fresh reader, nothing read yet
    results: dict[int, np.ndarray] = {}

    def read(chunk: int) -> None:
        results[chunk] = reader.read(GIMU, chunk)

    threads = [threading.Thread(target=read, args=(chunk,)) for chunk in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for chunk in range(8):
        assert_exact(results[chunk], v1.reader.read(GIMU, chunk))
    # 3 objects a chunk (codes, gps_speed, rows), and one chunk of each dictionary array, once
    assert reader.requests == 8 * 3 + 3


def test_a_reader_pickles_with_its_dictionaries(v2_pair: Pair) -> None:
    v1, v2 = v2_pair
    v2.reader.dictionaries()
    copied = pickle.loads(pickle.dumps(v2.reader))
    assert copied.dictionaries() is not v2.reader.dictionaries()
    assert_exact(copied.read(GIMU, 3), v1.reader.read(GIMU, 3))


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_chunk_cache_serves_a_version_2_store(v2_pair: Pair, tmp_path: Path) -> None:
    v1, v2 = v2_pair
    cached = birdzarr.open_store(v2.location.path, cache_dir=tmp_path / "cache")
    assert_exact(cached.windows[:], v1.windows[:])
    first = (cached.cache.hits, cached.cache.misses)  # type: ignore[union-attr]
    assert first == (0, 30 * 3 + 3)
    again = birdzarr.open_store(v2.location.path, cache_dir=tmp_path / "cache")
    assert_exact(again.windows[:], v1.windows[:])
    assert (again.cache.hits, again.cache.misses) == (30 * 3 + 3, 0)  # type: ignore[union-attr]
    assert again.reader.requests == 0


def test_the_gimu_zarr_array_is_refused_naming_store_windows(v2_pair: Pair) -> None:
    _, v2 = v2_pair
    with pytest.raises(FormatVersionError) as refused:
        _ = v2.gimu
    assert str(refused.value) == (
        f"{v2.url} is a format-2 store: it has no 'gimu' array (its windows are stored as dictionary "
        "codes). Read float32 windows with store.windows[a:b]; store.group['gimu_codes'] and the dict_* "
        "arrays are the stored arrays.")
    assert v2.group["gimu_codes"].dtype == np.uint16  # type: ignore[union-attr]


@pytest.mark.parametrize(("array", "key"), [
    ("gimu_codes", "c/3/0/0"), ("gps_speed", "c/3/0"), ("gimu_row", "c/3"), ("dict_values", "c/0"),
    ("dict_start", "c/0/0"), ("dict_device", "c/0"),
])
def test_a_missing_chunk_raises_naming_its_array_and_key(v2_pair: Pair, tmp_path: Path, array: str,
                                                        key: str) -> None:
    path = writable_copy(v2_pair[1], tmp_path / "s.zarr")
    (path / array / key).unlink()
    store = birdzarr.open_store(path)
    with pytest.raises(MissingChunkError) as missing:
        store.windows[3000:3100]
    assert type(missing.value) is MissingChunkError
    assert str(missing.value) == (
        f"{store.url}: committed chunk '{array}/{key}' is missing. The store is damaged; run "
        "`birdzarr verify` on it and re-convert or restore the missing files.")


@pytest.mark.parametrize(("array", "key"), [
    ("gimu_codes", "c/2/0/0"), ("gps_speed", "c/2/0"), ("gimu_row", "c/2"), ("dict_values", "c/0"),
])
def test_a_damaged_chunk_raises_naming_its_array_and_key(v2_pair: Pair, tmp_path: Path, array: str,
                                                        key: str) -> None:
    path = writable_copy(v2_pair[1], tmp_path / "s.zarr")
    data = bytearray((path / array / key).read_bytes())
    data[len(data) // 2] ^= 0x10
    (path / array / key).write_bytes(bytes(data))
    assert_cannot_decode(birdzarr.open_store(path), lambda store: store.windows[2048:2100], f"{array}/{key}",
                         "crc32c checksum mismatch: the chunk's bytes were changed or truncated")


def _store_rows(path: Path) -> tuple[Any, np.ndarray, np.ndarray]:
    import zarr

    codes = zarr.open_array(str(path / _v2.CODES), mode="r+", zarr_format=3)
    row: np.ndarray = np.asarray(zarr.open_array(str(path / _v2.ROW), mode="r", zarr_format=3)[:])
    start: np.ndarray = np.asarray(zarr.open_array(str(path / _v2.START), mode="r", zarr_format=3)[:])
    values = zarr.open_array(str(path / _v2.VALUES), mode="r", zarr_format=3)
    return codes, row, _v2.entry_counts(start, values.shape[0])


@pytest.mark.parametrize("window", [5000, 3327 + 4])  # a chunk of one device; one of two (a boundary)
def test_a_code_past_its_dictionary_is_refused_not_misread(v2_pair: Pair, tmp_path: Path,
                                                          window: int) -> None:
    """A chunk with a valid checksum (written by zarr-python) whose code is past the end of its
    dictionary would read a value of the next dictionary: it is refused."""
    path = writable_copy(v2_pair[1], tmp_path / "s.zarr")
    codes, row, sizes = _store_rows(path)
    chunk = window // 1024
    rows_in_chunk = len(np.unique(row[chunk * 1024 : (chunk + 1) * 1024]))
    assert rows_in_chunk == (1 if window == 5000 else 2)
    codes[window, 7, 1] = sizes[row[window], 1]  # one past the last entry
    store = birdzarr.open_store(path)
    assert_exact(store.windows[: chunk * 1024], v2_pair[0].windows[: chunk * 1024])  # the rest reads
    assert_cannot_decode(store, lambda store: store.windows[window], f"gimu_codes/c/{chunk}/0/0",
                         "a gimu code is past the end of its dictionary")
    with pytest.raises(CorruptChunkError):
        store.reader.read_coded(chunk)


def test_a_row_past_the_dictionary_is_refused(v2_pair: Pair, tmp_path: Path) -> None:
    import zarr

    path = writable_copy(v2_pair[1], tmp_path / "s.zarr")
    rows = zarr.open_array(str(path / _v2.ROW), mode="r+", zarr_format=3)
    rows[4100] = 12  # the store has rows 0..11
    assert_cannot_decode(birdzarr.open_store(path), lambda store: store.windows[4096:4200],
                         "gimu_codes/c/4/0/0", "gimu_row refers to row 12; the dictionary has 12 rows")


def test_dictionary_arrays_that_disagree_are_refused(v2_pair: Pair, tmp_path: Path) -> None:
    import zarr

    path = writable_copy(v2_pair[1], tmp_path / "s.zarr")
    start: Any = zarr.open_array(str(path / _v2.START), mode="r+", zarr_format=3)
    n_values = zarr.open_array(str(path / _v2.VALUES), mode="r", zarr_format=3).shape[0]
    start[3, 1] = start[3, 2] + 1  # row 3's channel 1 now starts after its channel 2
    store = birdzarr.open_store(path)
    with pytest.raises(CorruptChunkError) as refused:
        store.windows[0]
    assert str(refused.value) == (
        f"{store.url}: the dictionary arrays do not agree ('dict_start' is not ascending within the "
        f"{n_values} entries of 'dict_values'). The store is damaged; run `birdzarr verify`.")


def test_info_shows_format_2_and_the_stored_arrays(v2_pair: Pair, capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
    from birdzarr.cli import main

    v1, v2 = v2_pair
    info = summary(v2)
    assert info["format_version"] == 2 and info["windows"] == 30_000
    arrays = info["bytes_arrays"]
    assert list(arrays) == list(_v2.ARRAYS) and all(size > 0 for size in arrays.values())
    assert info["bytes_stored"] == sum(arrays.values())
    for name, size in arrays.items():  # every chunk file's bytes, the arrays' metadata not counted
        files = [f for f in Path(v2.location.join(name)).rglob("*") if f.is_file()]
        assert size == sum(f.stat().st_size for f in files if f.name != "zarr.json")
    text = format_summary(info)
    assert "format       birdzarr v2 (Zarr v3)" in text
    assert "codec uint16 codes + dictionaries (core Zarr v3 codecs), shuffled False" in text
    assert "\narrays       gimu_codes " in text and ", dict_device " in text
    assert "codec uint16 codes + dictionaries (core Zarr v3 codecs), in device order" in repr(v2)
    assert main(["info", v2.url]) == 0
    assert "birdzarr v2" in capsys.readouterr().out
    assert main(["info", v2.url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes_arrays"] == arrays


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_xarray_view_reads_as_the_reference(pair: Pair) -> None:
    pytest.importorskip("xarray")
    v1, v2 = pair
    a, b = v1.to_xarray(), v2.to_xarray()  # type: ignore[attr-defined]
    assert b["gimu"].dtype == np.float32 and b["gimu"].dims == a["gimu"].dims
    assert b["gimu"].attrs == a["gimu"].attrs
    assert_exact(b["gimu"].values, a["gimu"].values)
    assert_exact(b["gimu"].isel(window=[3, 29_999, 7]).values, a["gimu"].isel(window=[3, 29_999, 7]).values)
    for name in ("device", "label", "time", "window", "channel"):
        got, expected = np.asarray(b[name].values), np.asarray(a[name].values)
        if got.dtype.kind == "M":  # NaT (unknown times, a Parquet source) compared by value
            got, expected = got.view(np.int64), expected.view(np.int64)
        assert got.dtype == expected.dtype and np.array_equal(got, expected), name
        assert b[name].attrs == a[name].attrs, name
    assert {k: v for k, v in b.attrs.items() if k not in ("store", "birdzarr_format_version")} == {
        k: v for k, v in a.attrs.items() if k not in ("store", "birdzarr_format_version")}
    assert (a.attrs["birdzarr_format_version"], b.attrs["birdzarr_format_version"]) == (2, 2)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_statistics_are_the_reference_statistics(v2_pair: Pair) -> None:
    import dataclasses

    v1, v2 = v2_pair
    a, b = v1.stats(), v2.stats()  # type: ignore[attr-defined]
    for field in dataclasses.fields(a):
        got, expected = np.asarray(getattr(b, field.name)), np.asarray(getattr(a, field.name))
        assert np.array_equal(got, expected), field.name


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_dictionary_rows_past_the_commit_are_not_read(v2_pair: Pair, tmp_path: Path) -> None:
    """An interrupted append leaves the dictionary arrays longer than the commit counts
    (committed.dictionary): readers use the committed rows and entries only."""
    import zarr

    v1, v2 = v2_pair
    path = writable_copy(v2, tmp_path / "s.zarr")
    root = json.loads((path / "zarr.json").read_text())
    recorded = root["attributes"]["birdzarr"]["committed"]["dictionary"]
    rows, n_values = recorded["rows"], recorded["values"]
    assert rows == 12 and n_values == len(v2.reader.dictionaries().values)
    for name, extra in ((_v2.VALUES, 100), (_v2.START, 2), (_v2.DEVICE, 2)):
        array: Any = zarr.open_array(str(path / name), mode="r+", zarr_format=3)
        array.resize((array.shape[0] + extra, *array.shape[1:]))
        array[-extra:] = 7  # what the interrupted append wrote
    store = birdzarr.open_store(path)
    dictionaries = store.reader.dictionaries()
    assert (len(dictionaries.values), len(dictionaries.start), len(dictionaries.device)) == (n_values, 12, 12)
    assert_exact(store.windows[:], v1.windows[:])
    # a commit that counts more than the arrays hold is damage, said once
    root["attributes"]["birdzarr"]["committed"]["dictionary"]["rows"] = 20
    (path / "zarr.json").write_text(json.dumps(root))
    store = birdzarr.open_store(path)
    with pytest.raises(CorruptChunkError) as refused:
        store.windows[0]
    assert str(refused.value) == (
        f"{store.url}: the dictionary arrays do not agree with the commit ('dict_start' holds 14 where "
        "the commit counts 20). The store is damaged; run `birdzarr verify`.")


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_store_the_converter_writes_reads_as_its_source(parquet_source: Any,
                                                          small_store: birdzarr.Store) -> None:
    """The windows of each Parquet device, in device order, exactly (float32 bits)."""
    _, truth = parquet_source
    assert small_store.format_version == 2
    assert not Path(small_store.location.path, "gimu").exists()
    expected = np.concatenate([truth[d] for d in sorted(truth)])
    assert_exact(small_store.windows[:], expected)
    devices = np.concatenate([np.full(len(truth[d]), d, np.int32) for d in sorted(truth)])
    assert np.array_equal(small_store.window_devices[:], devices)
    reopened = birdzarr.open_store(small_store.location.path)
    assert_exact(reopened.windows[np.arange(29_999, 0, -97)], expected[np.arange(29_999, 0, -97)])


def test_a_format_1_store_describes_its_codec_and_one_array(small_store_v1: birdzarr.Store) -> None:
    info = summary(small_store_v1)
    assert info["format_version"] == 1 and info["bytes_arrays"] == {"gimu": info["bytes_stored"]}
    assert "\narrays" not in format_summary(info)
    assert "codec dict16, in device order" in repr(small_store_v1)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_arrays_another_writer_coded_otherwise_are_read_through_zarr(v2_pair: Pair, tmp_path: Path) -> None:
    """A format-2 store whose arrays use other core chains (here zstd without blosc, and codes
    without the transpose) reads the same: chains birdzarr does not write go through zarr-python."""
    import zarr

    v1, v2 = v2_pair
    path = writable_copy(v2, tmp_path / "s.zarr")
    zstd = [{"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "zstd", "configuration": {"level": 1, "checksum": False}}, {"name": "crc32c"}]
    for name in (_v2.CODES, _v2.GPS, _v2.ROW, _v2.VALUES, _v2.START):
        data = np.asarray(zarr.open_array(str(path / name), mode="r", zarr_format=3)[:])
        meta = json.loads((path / name / "zarr.json").read_text())
        shutil.rmtree(path / name)
        (path / name).mkdir()
        (path / name / "zarr.json").write_text(json.dumps({**meta, "codecs": zstd}))
        zarr.open_array(str(path / name), mode="r+", zarr_format=3)[...] = data
    store = birdzarr.open_store(path)
    assert {store.reader.layouts[name].chain for name in (_v2.CODES, _v2.GPS, _v2.VALUES)} == {"zarr"}
    assert_exact(store.windows[:], v1.windows[:])
    assert_exact(store.windows[[29_999, 5, 17_000]], v1.windows[[29_999, 5, 17_000]])
    (path / _v2.CODES / "c" / "4" / "0" / "0").unlink()
    with pytest.raises(MissingChunkError, match=r"committed chunk 'gimu_codes/c/4/0/0' is missing"):
        birdzarr.open_store(path).windows[4096]


def _rechunk(path: Path, name: str, chunk: int) -> np.ndarray:
    """Rewrite array ``name`` of the store at ``path`` with chunks of ``chunk`` items and the
    same codecs (through zarr-python); returns its values."""
    import zarr

    values = zarr.open_array(str(path / name), mode="r", zarr_format=3)[:]
    meta_path = path / name / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["chunk_grid"]["configuration"]["chunk_shape"][0] = chunk
    shutil.rmtree(path / name / "c")
    meta_path.write_text(json.dumps(meta))
    zarr.open_array(str(path / name), mode="r+", zarr_format=3)[:] = values
    return values


def test_the_dictionary_arrays_read_whole_chunks_in_place_and_the_last_one_trimmed(
        v2_pair: Pair, tmp_path: Path) -> None:
    """Whole chunks of a dictionary array decode straight into the result; the last, partial one
    is trimmed: the arrays equal zarr-python's reading, and a frame of the wrong size in a whole
    chunk is refused by name."""
    path = writable_copy(v2_pair[1], tmp_path / "s.zarr")
    values = _rechunk(path, _v2.VALUES, 64)
    assert len(values) % 64  # whole chunks and a partial last one
    start = _rechunk(path, _v2.START, 5)
    read = birdzarr.open_store(path).reader.dictionaries()
    assert np.array_equal(read.values.view(np.uint32), values.view(np.uint32))
    assert np.array_equal(read.start, start) and read.start.dtype == np.int64
    assert_exact(birdzarr.open_store(path).windows[:], v2_pair[0].windows[:])
    import google_crc32c
    from numcodecs import Blosc

    # chunk 1 replaced by a valid frame (blosc, then its CRC-32C) of 32 values: half a chunk's bytes
    frame = Blosc(cname="zstd", clevel=3, shuffle=Blosc.BITSHUFFLE).encode(values[64:96].tobytes())
    (path / _v2.VALUES / "c" / "1").write_bytes(frame + google_crc32c.value(frame).to_bytes(4, "little"))
    store = birdzarr.open_store(path)
    assert_cannot_decode(store, lambda store: store.windows[0], "dict_values/c/1",
                         "128 bytes where a chunk holds 256")
