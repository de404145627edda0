"""Format 2's window layout (birdzarr/format/_v2.py) coded by its one encoder (birdzarr/format/_rows.py):
exact round trips for every dictionary rule, and stores written with core Zarr v3 codecs only, read
by TensorStore and by zarr-python without birdzarr."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from format2_support import documented_decode, run_without_birdzarr

from birdzarr.format import _rows, _v2
from birdzarr.format._rows import Encoded, encode

NEG_ZERO = np.float32(-0.0)
# a quiet NaN with a payload: a dictionary keyed by bit pattern keeps it (curation drops NaN windows,
# the layout does not rely on it)
NAN_PAYLOAD = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
OTHER_NAN = np.array([0x7FC05678], np.uint32).view(np.float32)[0]


def calibrated(n_windows: int, *, seed: int, gps_per_sample: bool = False) -> np.ndarray:
    """Windows of one device as real trackers make them: 12-bit counts through a per-device
    calibration with non-power-of-two scales; gps_speed one continuous value per window (or per
    sample), 6-8 decimals, divided by gps_scale."""
    rng = np.random.default_rng(seed)
    offset, scale = rng.normal(2048, 40, 3), rng.uniform(900.0, 1100.0, 3)
    counts = np.clip(np.round(rng.normal(0, 0.4, (n_windows, 20, 3)) * scale + offset), 0, 4095)
    windows = np.empty((n_windows, 20, 4), np.float32)
    windows[:, :, :3] = np.clip((counts - offset) / scale, -2.0, 2.0)
    shape = (n_windows, 20) if gps_per_sample else (n_windows, 1)
    windows[:, :, 3] = np.round(rng.lognormal(0, 1, shape), 7) / 22.3012351755624
    return windows


def assert_exact(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


def round_trip(windows: np.ndarray, device: np.ndarray, encoded: Encoded,
               dictionaries: _v2.Dictionaries) -> None:
    """Both decoders give the input bit for bit, and every code falls inside its dictionary."""
    _v2.check(encoded.codes, encoded.row, dictionaries.start, len(dictionaries.values))
    args = (encoded.codes, encoded.row, encoded.gps, dictionaries.values, dictionaries.start)
    assert_exact(_v2.decode_reference(*args), windows)
    assert_exact(_v2.decode(*args), windows)
    # every window's row belongs to its device
    assert np.array_equal(dictionaries.device[encoded.row], device)


def first_seen(values: np.ndarray) -> np.ndarray:
    """The distinct float32 bit patterns of ``values`` in the order they first occur."""
    import pandas as pd

    return np.asarray(pd.unique(np.ascontiguousarray(values).reshape(-1).view(np.uint32)), np.uint32)


def test_normal_devices_get_one_row_each_and_round_trip_bit_for_bit() -> None:
    parts = [calibrated(n, seed=s) for s, n in enumerate((700, 50, 1200))]
    windows = np.concatenate(parts)
    device = np.repeat([533, 7, 298], [len(p) for p in parts])
    windows[3, 5, 0] = NEG_ZERO
    windows[3, 6, 0] = np.float32(0.0)  # +0.0 beside -0.0: two entries
    windows[4, 0, 3] = NEG_ZERO
    windows[800, 2, 1] = NAN_PAYLOAD
    windows[801, 2, 1] = OTHER_NAN  # another payload: another entry
    encoded = encode(windows, device)
    round_trip(windows, device, encoded, encoded.new)
    # a row per device, numbered in the order of their first windows
    assert encoded.new.device.tolist() == [533, 7, 298]
    assert encoded.row.tolist() == np.repeat([0, 1, 2], [700, 50, 1200]).tolist()
    # each row's entries: its device's distinct bit patterns, in the order its windows hold them
    for r, d in enumerate((533, 7, 298)):
        for c in range(_v2.N_CODED):
            expected = first_seen(windows[device == d][:, :, c])
            assert np.array_equal(encoded.new.entries(r, c).view(np.uint32), expected)
    assert (encoded.new.sizes() <= 4096 + 2).all()  # 12-bit counts (+ the zeros or the NaNs)
    zero_codes = encoded.codes[3, 5:7, 0]
    assert zero_codes[0] != zero_codes[1]
    assert encoded.codes[800, 2, 1] != encoded.codes[801, 2, 1]


def test_a_device_channel_over_65535_distinct_values_splits_into_rows() -> None:
    # 4,000 windows of a channel with every value distinct (80,000 > 65,535): not 12-bit counts
    windows = calibrated(4000, seed=5)
    distinct = (np.random.default_rng(1).permutation(80_000) + 0.5) / 7  # float32 keeps them apart
    windows[:, :, 1] = distinct.reshape(4000, 20).astype(np.float32)
    device = np.full(4000, 42)
    encoded = encode(windows, device)
    round_trip(windows, device, encoded, encoded.new)
    sizes = encoded.new.sizes()
    assert encoded.new.n_rows == 2 and (sizes <= _v2.MAX_ENTRIES).all()
    # a row takes windows in order up to the last one that fits: 65,535 // 20 whole windows
    assert np.array_equal(encoded.row, np.repeat([0, 1], [3276, 724]))
    assert sizes[0, 1] == 3276 * 20 and sizes[1, 1] == 724 * 20
    # the rows' IMU channels that did not overflow keep their few thousand entries each
    assert (sizes[:, 0] <= 4096).all()


def test_the_split_starts_a_row_at_the_first_window_that_would_overflow() -> None:
    # windows 0..3275 hold 65,520 distinct values, window 3276 adds 15 more (65,535: still fits), the
    # next brings one new value, which would make 65,536
    values = np.arange(3278 * 20, dtype=np.uint32) + np.uint32(0x3F000000)  # 0.5 and up, bit by bit
    values[3276 * 20 + 15 : 3277 * 20] = values[3276 * 20]  # window 3276: 15 distinct new values + repeats
    values[3277 * 20 + 1 :] = values[0]  # window 3277: one new value, then old ones
    windows = calibrated(3278, seed=7)
    windows[:, :, 0] = values.view(np.float32).reshape(3278, 20)
    device = np.full(3278, 3)
    encoded = encode(windows, device)
    round_trip(windows, device, encoded, encoded.new)
    assert np.array_equal(encoded.row, np.repeat([0, 1], [3277, 1]))
    assert encoded.new.sizes()[:, 0].tolist() == [_v2.MAX_ENTRIES, 2]


def test_gps_speed_with_over_65535_distinct_values_needs_no_split() -> None:
    # gps_speed varying inside windows (some exports): 4,000 x 20 distinct speeds, stored as float32
    windows = calibrated(4000, seed=6, gps_per_sample=True)
    assert len(np.unique(windows[:, :, 3])) > _v2.MAX_ENTRIES
    device = np.full(4000, 1)
    encoded = encode(windows, device)
    round_trip(windows, device, encoded, encoded.new)
    assert encoded.new.n_rows == 1


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_many_small_devices_in_shuffled_order() -> None:
    rng = np.random.default_rng(9)
    sizes = rng.integers(1, 6, 3000)
    windows = np.concatenate([calibrated(int(n), seed=1000 + i) for i, n in enumerate(sizes)])
    device = np.repeat(np.arange(3000) * 3 + 100, sizes)
    order = rng.permutation(len(windows))
    windows, device = windows[order], device[order]
    encoded = encode(windows, device)
    round_trip(windows, device, encoded, encoded.new)
    # still a row per device (a device's windows need not lie together), in first-window order
    assert encoded.new.n_rows == 3000
    assert np.array_equal(encoded.new.device, first_seen_ids(device))
    assert encoded.new.sizes().max() <= 5 * 20


def first_seen_ids(device: np.ndarray) -> np.ndarray:
    _, first = np.unique(device, return_index=True)
    return device[np.sort(first)]


def test_an_append_with_new_values_grows_the_dictionary_and_old_codes_stay_valid() -> None:
    old_windows = calibrated(300, seed=11)
    old_device = np.full(300, 533)
    first = encode(old_windows, old_device)
    # new windows of device 533 (other counts: new values) and of a new device 7
    new_windows = np.concatenate([calibrated(200, seed=12), calibrated(100, seed=13)])
    new_windows[:, :, :3] = np.concatenate([
        calibrated(200, seed=11)[:, :, :3] * np.float32(1.5),  # device 533: values it never had
        new_windows[200:, :, :3],
    ])
    new_device = np.repeat([533, 7], [200, 100])
    new_windows[150, 4, 1] = old_windows[0, 0, 1]  # an old value among the new ones keeps its code
    second = encode(new_windows, new_device, previous=first.new)
    store = first.new.extend(second.new)
    assert store.device.tolist() == [533, 533, 7]
    assert second.codes[150, 4, 1] == first.codes[0, 0, 1]
    # the old windows still decode from the grown arrays (nothing of theirs changed)
    round_trip(old_windows, old_device, first, store)
    round_trip(new_windows, new_device, second, store)
    assert set(second.row[:200].tolist()) == {1} and set(second.row[200:].tolist()) == {2}
    sizes = store.sizes()
    for c in range(_v2.N_CODED):
        # the grown row begins with the old row's entries: an old code means the same value in both
        old_entries, grown = store.entries(0, c), store.entries(1, c)
        assert sizes[1, c] > sizes[0, c]
        assert_exact(grown[: sizes[0, c]], old_entries)
        assert_exact(grown[first.codes[:, :, c]], old_windows[:, :, c])
        # then the values the row lacked, in the order the new windows hold them
        lacking = first_seen(new_windows[:200, :, c])
        lacking = lacking[~np.isin(lacking, old_entries.view(np.uint32))]
        assert np.array_equal(grown[sizes[0, c]:].view(np.uint32), lacking)
    # starts of the appended rows count the entries before them
    assert second.new.start[0, 0] == len(first.new.values)


def test_an_append_without_new_values_reuses_the_row() -> None:
    windows = calibrated(400, seed=21)
    first = encode(windows[:300], np.full(300, 5))
    again = windows[:100].copy()
    again[:, :, 3] = windows[300:, :, 3]  # gps_speed is stored as it is: new speeds need no entries
    second = encode(again, np.full(100, 5), previous=first.new)
    assert second.new.n_rows == 0 and len(second.new.values) == 0
    assert set(second.row.tolist()) == {0}
    round_trip(again, np.full(100, 5), second, first.new.extend(second.new))


def test_an_append_that_would_overflow_the_row_grows_it_to_the_last_window_that_fits() -> None:
    windows = calibrated(3500, seed=31)
    distinct = (np.random.default_rng(2).permutation(70_000) + 0.5) / 7
    windows[:, :, 2] = distinct.reshape(3500, 20).astype(np.float32)
    first = encode(windows[:2500], np.full(2500, 8))  # 50,000 entries in imu_z
    second = encode(windows[2500:], np.full(1000, 8), previous=first.new)  # +20,000 > 65,535
    store = first.new.extend(second.new)
    # the append rule grows a new row from the stored one (50,000 + 776 x 20 = 65,520 entries); the
    # window that would pass 65,535 opens the device's next row (the overflow rule)
    assert store.device.tolist() == [8, 8, 8]
    assert np.array_equal(second.row, np.repeat([1, 2], [776, 224]))
    assert store.sizes()[1:, 2].tolist() == [50_000 + 776 * 20, 224 * 20]
    assert_exact(store.entries(1, 2)[:50_000], store.entries(0, 2))
    round_trip(windows[:2500], np.full(2500, 8), first, store)
    round_trip(windows[2500:], np.full(1000, 8), second, store)


def test_encode_refuses_windows_of_another_shape_and_a_device_count_that_differs() -> None:
    with pytest.raises(ValueError, match=r"^windows must be float32 \(n, 20, 4\), got float64 \(3, 20, 4\)$"):
        encode(np.zeros((3, 20, 4)), np.zeros(3))
    with pytest.raises(ValueError, match="^2 device keys for 3 windows$"):
        encode(np.zeros((3, 20, 4), np.float32), np.zeros(2))


def test_check_refuses_codes_past_their_dictionary() -> None:
    windows = calibrated(10, seed=41)
    encoded = encode(windows, np.zeros(10))
    codes = encoded.codes.copy()
    codes[3, 4, 2] = encoded.new.sizes()[0, 2]
    with pytest.raises(ValueError, match="past the end of its dictionary"):
        _v2.check(codes, encoded.row, encoded.new.start, len(encoded.new.values))
    with pytest.raises(ValueError, match="refers to row 1; the dictionary has 1 rows"):
        _v2.check(encoded.codes, encoded.row + 1, encoded.new.start, len(encoded.new.values))


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_slabs_of_devices_code_as_one_table_does(monkeypatch: pytest.MonkeyPatch, shuffled: bool) -> None:
    """RowCoder hashes a slab's values ``_FACTORISED`` at a time, cut between devices: the rows are
    those of one hash table."""
    sizes = np.random.default_rng(4).integers(1, 40, 200)
    windows = np.concatenate([calibrated(int(n), seed=2000 + i) for i, n in enumerate(sizes)])
    device = np.repeat(np.arange(200), sizes)
    if shuffled:
        order = np.random.default_rng(5).permutation(len(windows))
        windows, device = windows[order], device[order]
    monkeypatch.setattr(_rows, "_FACTORISED", 2**40)  # one table
    whole = encode(windows, device)
    monkeypatch.setattr(_rows, "_FACTORISED", 1000)  # a table every few devices
    slabs = encode(windows, device)
    assert np.array_equal(whole.codes, slabs.codes) and np.array_equal(whole.row, slabs.row)
    assert np.array_equal(whole.new.values.view(np.uint32), slabs.new.values.view(np.uint32))
    assert np.array_equal(whole.new.start, slabs.new.start)
    round_trip(windows, device, slabs, slabs.new)


# -- interop: a store written with core codecs only, read without birdzarr ------------------------


@pytest.fixture(scope="module", params=["device", "shuffled"])
def v2_store(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Path, np.ndarray]:
    """A small store of the format 2 arrays in device order or shuffled (the codes coded in device
    order, then permuted, as a converter would), written by zarr-python from ``array_metadata``
    (3 chunks of 512 windows, the last one partial)."""
    import zarr

    sizes = [600, 300, 400]
    windows = np.concatenate([calibrated(n, seed=50 + i) for i, n in enumerate(sizes)])
    windows[7, 3, 0] = NEG_ZERO
    device = np.repeat([533, 298, 7], sizes)
    encoded = encode(windows, device)
    if request.param == "shuffled":
        order = np.random.default_rng(17).permutation(len(windows))
        windows = windows[order]
        encoded = Encoded(encoded.codes[order], encoded.row[order], encoded.gps[order], encoded.new)
    path = tmp_path_factory.mktemp("v2") / "store.zarr"
    data = {_v2.CODES: encoded.codes, _v2.GPS: encoded.gps, _v2.ROW: encoded.row,
            _v2.VALUES: encoded.new.values, _v2.START: encoded.new.start, _v2.DEVICE: encoded.new.device}
    metadata = _v2.array_metadata(len(windows), len(encoded.new.values), encoded.new.n_rows,
                                  chunk_windows=512)
    path.mkdir(parents=True)
    (path / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    for name, meta in metadata.items():
        assert {codec["name"] for codec in meta["codecs"]} <= _v2.CORE_CODECS
        (path / name).mkdir()
        (path / name / "zarr.json").write_text(json.dumps(meta))
        array = zarr.open_array(str(path / name), mode="r+", zarr_format=3)
        array[...] = data[name]
    return path, windows


def test_the_store_holds_only_core_codecs_and_every_chunk(v2_store: tuple[Path, np.ndarray]) -> None:
    path, _ = v2_store
    for name in _v2.ARRAYS:
        meta = json.loads((path / name / "zarr.json").read_text())
        assert {codec["name"] for codec in meta["codecs"]} <= _v2.CORE_CODECS
        assert meta["codecs"][-1] == {"name": "crc32c"}
    assert sorted(p.name for p in (path / _v2.CODES / "c").iterdir()) == ["0", "1", "2"]


def test_tensorstore_reads_the_store_and_the_documented_lines_decode_it(
    v2_store: tuple[Path, np.ndarray],
) -> None:
    ts = pytest.importorskip("tensorstore")
    path, windows = v2_store

    def read(name: str) -> np.ndarray:
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path / name)}}
        return ts.open(spec, open=True).result().read().result()

    z = {name: read(name) for name in _v2.ARRAYS}
    for a, b in ((0, len(windows)), (500, 1100)):
        scope: dict[str, Any] = {"np": np, "z": z, "a": a, "b": b}
        exec(documented_decode(), scope)
        assert_exact(scope["windows"], windows[a:b])


@pytest.mark.slow
def test_zarr_without_birdzarr_reads_the_store_and_the_documented_lines_decode_it(
    v2_store: tuple[Path, np.ndarray], tmp_path: Path,
) -> None:
    path, windows = v2_store
    out = tmp_path / "decoded.npy"
    run_without_birdzarr([
        "import numpy as np, zarr",
        f"root = {str(path)!r}",
        "z = {name: zarr.open_array(root + '/' + name, mode='r', zarr_format=3)",
        f"     for name in {_v2.ARRAYS!r}}}",
        f"a, b = 100, {len(windows)}",
        documented_decode(),
        f"np.save({str(out)!r}, windows)",
    ])
    assert_exact(np.load(out), windows[100:])


# Each array's attributes, exactly as docs/format.md (Arrays) spells them.
ARRAY_ATTRIBUTES = {
    "gimu_codes": {"long_name": "imu_x, imu_y, imu_z of each window, as codes into dict_values",
                   "channels": ["imu_x", "imu_y", "imu_z"], "units": ["g", "g", "g"]},
    "gps_speed": {"long_name": "gps_speed of each window", "units": "m/s divided by gps_scale"},
    "gimu_row": {"long_name": "the dictionary row of each window"},
    "dict_values": {"long_name": "dictionary entries: imu_x, imu_y, imu_z values", "units": "g"},
    "dict_start": {"long_name": "first dict_values entry of row r, channel c",
                   "channels": ["imu_x", "imu_y", "imu_z"]},
    "dict_device": {"long_name": "device (tracker) id whose windows the row codes"},
    "device": {"long_name": "device (tracker) id"},
    "timestamp": {"long_name": "burst start, UTC (INT64_MIN = unknown)",
                  "units": "seconds since 1970-01-01T00:00:00Z"},
    "label": {"long_name": "behaviour label (-1 = unlabelled)"},
}


@pytest.mark.parametrize("shuffle", [False, True], ids=["device", "shuffled"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_converted_store_names_each_array_and_its_units(
    parquet_source: tuple[Path, dict[int, np.ndarray]], tmp_path: Path, shuffle: bool,
) -> None:
    """What each array holds and its units, as plain zarr-python reads them from a default store of
    each order: the codes in the units of the values they decode to (g), gps_speed in m/s divided by
    gps_scale (version 1 gave its gimu array the same units, one per channel)."""
    import zarr

    import birdzarr

    directory, _ = parquet_source
    birdzarr.convert(directory, tmp_path / "s.zarr", shuffle=shuffle, seed=0 if shuffle else None,
                     progress=False)
    for name, expected in ARRAY_ATTRIBUTES.items():
        got = zarr.open_array(str(tmp_path / "s.zarr" / name), mode="r", zarr_format=3).attrs
        assert dict(got) == expected, name


def test_docs_format_spells_each_arrays_attributes() -> None:
    """docs/format.md's attributes table is the one the tests above and the writers use."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "format.md").read_text()
    section = text[text.index("- Array attributes"):text.index("## Decoding the windows")]
    table = {found[1]: json.loads(found[2])
             for found in re.finditer(r"^\| `(\w+)` \| `(\{.*\})`", section, re.MULTILINE)}
    assert table == ARRAY_ATTRIBUTES
    assert {name: _v2.ATTRIBUTES[name] for name in _v2.ARRAYS} == {
        name: ARRAY_ATTRIBUTES[name] for name in _v2.ARRAYS}


# -- the device table's details: the bytes stored -------------------------------------------------

DETAILS_DATA = Path(__file__).resolve().parent / "data" / "details"


def _golden_csv_source(root: Path) -> Path:
    """Three devices of CSV exports in two parts each (``_synthetic``, seed 5), one with a
    malformed line (skipped: a problem, a bad line, a dropped row) and one whose last burst is
    unfinished (a CSV tail)."""
    from birdzarr.demo import _synthetic

    source = root / "src"
    _synthetic.make_csv_dir(source, n_devices=3, bursts_per_device=6, parts=2, seed=5)
    files = sorted(source.iterdir())
    with open(files[0], "a") as handle:
        handle.write('not a row,"quoted\\ \u00e9\n')
    lines = files[-1].read_text().splitlines(True)
    files[-1].write_text("".join(lines[:-7]))
    return source


@pytest.mark.parametrize("name", ["csv_store", "csv_shuffled_store"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_stored_details_are_the_bytes_of_the_golden_store(tmp_path: Path, name: str) -> None:
    """The device table's ``details`` array of a small CSV store, in device order and shuffled,
    holds exactly the JSON bytes the commit wrote before it spelled them out a device at a time
    (tests/data/details/*.json: written by 5cae983's ``json.dumps`` of the ``to_json`` dicts, the
    source's directory written as SRC)."""
    import zarr

    import birdzarr

    source = _golden_csv_source(tmp_path)
    store = tmp_path / "s.zarr"
    shuffled = name == "csv_shuffled_store"
    birdzarr.convert(source, store, on_bad_rows="skip", progress=False, shuffle=shuffled,
                     seed=1 if shuffled else None)
    group = zarr.open_group(str(store), mode="r", zarr_format=3)
    root: dict[str, Any] = dict(group.attrs["birdzarr"])  # type: ignore[arg-type]
    details: Any = group[f"{root['committed']['device_table']}/details"]
    stored = details[:].tobytes().replace(str(source).encode(), b"SRC")
    golden = (DETAILS_DATA / f"{name}.json").read_bytes()
    assert stored == golden
    decoded = json.loads(golden)
    assert root["committed"]["n_devices"] == len(decoded["devices"]) == 3
    assert list(root["committed"]) == ["n_windows", "generation", "committed_at", "dictionary",
                                       "device_table", "n_devices", "label_counts"]
    labels = {"0": 2, "1": 4, "3": 1, "5": 9, "6": 2, "7": 1, "8": 3, "9": 5}
    assert root["committed"]["label_counts"] == labels
    totals = {"rows_read": 613, "bad_lines": 1, "bad_files": 0, "mixed_label_windows": 0,
              "dropped": {"bad_rows": 1, "remainder_rows": 53}}
    assert root["report"]["totals"] == totals


def test_the_details_json_is_json_dumps_of_the_entries_and_reports_to_json() -> None:
    """``details_json`` spells out, byte for byte, the compact ``json.dumps`` of the ``to_json``
    dicts, for strings that need escaping (quotes, backslashes, control and non-ASCII
    characters), several ranges, sources and labels (unsorted), empty ones, scattered checksums
    and digests, the extreme timestamps, dropped reasons in their order and problems."""
    from birdzarr.format import _device_table
    from birdzarr.format._spec import DeviceEntry, DeviceRange, DeviceReport

    odd = 'a "quoted" \\ back\tslash\n, caf\u00e9 \u2603 \U0001f426 \x00'
    entries = [
        DeviceEntry(3, 30, [DeviceRange(0, 10, "0000abcd"), DeviceRange(50, 70, odd)], -2**63, 2**63 - 1,
                    ["3.csv", odd, "d\u00e9vice=3/part.parquet"], {9: 1, -1: 20, 2: 9}),
        DeviceEntry(7),
        DeviceEntry(11, 4, [], 1_337_000_000, 1_337_000_001, ["11.parquet"], {0: 4},
                    scattered_checksum="89abcdef", scattered_digest=odd),
    ]
    reports = [(3, DeviceReport(35, 30, {"remainder_rows": 3, "bad_rows": 2}, 1, 2, 1, [odd, "second"])),
               (7, DeviceReport()), (11, DeviceReport(80, 4, {}, 0, 0, 0, []))]
    for tails in (None, {"devices": {"3": {"time": 5, "labels": [1, -1], "values": "AAA=", "bad_rows": [0]}},
                         "unknown": [7, 11]}):
        expected = {"devices": [e.to_json() for e in entries],
                    "report_devices": {str(d): r.to_json() for d, r in reports}, "csv_tails": tails}
        spelled = _device_table.details_json(entries, reports, tails)
        assert spelled == json.dumps(expected, separators=(",", ":"), allow_nan=False).encode()
        assert json.loads(spelled) == expected
    assert _device_table.details_json([], [], None) == b'{"devices":[],"report_devices":{},"csv_tails":null}'


def test_the_range_index_is_ordered_by_start_stop_and_device() -> None:
    """The index arrays: one row a device by ascending id, the ranges by (start, stop, device)."""
    from birdzarr.format import _device_table
    from birdzarr.format._spec import DeviceEntry, DeviceRange

    entries = [DeviceEntry(9, 5, [DeviceRange(40, 45, "a")], 10, 20),
               DeviceEntry(2, 12, [DeviceRange(45, 50, "b"), DeviceRange(0, 7, "c")], 5, 6),
               DeviceEntry(5, 0, [DeviceRange(7, 7, "d"), DeviceRange(7, 7, "e")]),
               DeviceEntry(4, 0, [DeviceRange(7, 7, "f")])]
    got = {name: values.tolist() for name, values in _device_table.columns(entries).items()}
    unknown = -2**63
    assert got == {"device_id": [2, 4, 5, 9], "n_windows": [12, 0, 0, 5],
                   "first_time": [5, unknown, unknown, 10], "last_time": [6, unknown, unknown, 20],
                   "range_device": [2, 4, 5, 5, 9, 2],
                   "range_start": [0, 7, 7, 7, 40, 45], "range_stop": [7, 7, 7, 7, 45, 50]}
    empty = _device_table.columns([])
    assert all(len(values) == 0 and values.dtype == np.int64 for values in empty.values())
