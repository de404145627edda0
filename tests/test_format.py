"""The format's schema objects: JSON round trips and the version/identity checks."""

from __future__ import annotations

import numpy as np
import pytest

from birdzarr import FormatVersionError, NotAStoreError
from birdzarr.format import _v2
from birdzarr.format._spec import (
    FORMAT_VERSION,
    TIMESTAMP_UNKNOWN,
    Curation,
    DeviceEntry,
    DeviceRange,
    DeviceReport,
    array_attributes,
    check_root_attrs,
)


def test_timestamp_unknown_is_nat() -> None:
    assert np.isnat(np.array([TIMESTAMP_UNKNOWN], dtype="datetime64[s]"))[0]


def test_device_entry_round_trip() -> None:
    entry = DeviceEntry(
        device_id=298,
        n_windows=30,
        ranges=[DeviceRange(0, 10, "ab"), DeviceRange(50, 70, "cd")],
        first_time=1,
        last_time=2,
        sources=["298_0.csv"],
        label_counts={-1: 20, 3: 10},
    )
    raw = entry.to_json()
    assert raw["scattered_checksum"] is None
    assert DeviceEntry.from_json(raw) == entry
    assert raw["scattered_digest"] is None
    shuffled = DeviceEntry(device_id=1, n_windows=3, scattered_digest="0123456789abcdef")
    assert DeviceEntry.from_json(shuffled.to_json()) == shuffled
    earlier = DeviceEntry(device_id=1, n_windows=3, scattered_checksum="00ff")  # shuffled by earlier versions
    assert DeviceEntry.from_json(earlier.to_json()) == earlier
    del raw["scattered_checksum"], raw["scattered_digest"]  # written before the fields existed
    assert DeviceEntry.from_json(raw) == entry


def test_scattered_digest_follows_its_specification() -> None:
    """docs/format.md's definition, written out in plain Python integers, gives the digest."""
    from birdzarr.format._digest import RowDigest, row_hashes

    mask = 2**64 - 1

    def fmix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    keys = [fmix(0x5EEDB12D + i) | 1 for i in range(41)]

    def row_hash(window: np.ndarray, timestamp: int, label: int) -> int:
        words = np.frombuffer(window.astype("<f4").tobytes(), dtype="<u8").tolist()
        total = 0
        for key, word in zip(keys, words, strict=False):
            mixed = (key * word) & mask
            total += mixed ^ (mixed >> 29)
        total = fmix((total + (timestamp & mask) * keys[40]) & mask)
        return fmix((total + (label & mask) * 0x9E3779B97F4A7C15) & mask)

    rng = np.random.default_rng(4)
    windows = rng.standard_normal((5, 20, 4)).astype(np.float32)
    timestamps = np.array([-(2**63), -1, 0, 1_700_000_000, 2**62], dtype=np.int64)
    labels = np.array([-1, 0, 3, 7, -1], dtype=np.int32)
    expected = [row_hash(w, int(t), int(lab)) for w, t, lab in zip(windows, timestamps, labels, strict=True)]
    assert row_hashes(windows, timestamps, labels).tolist() == expected
    digest = RowDigest()
    digest.update(windows[3:], timestamps[3:], labels[3:])  # in any order, in any pieces
    digest.update(windows[:3], timestamps[:3], labels[:3])
    assert digest.hexdigest() == f"{sum(expected) & mask:016x}"


def test_device_report_merge_and_round_trip() -> None:
    a = DeviceReport(rows_read=10, windows_written=2, bad_lines=1, problems=["x"])
    a.drop("speed_limit", 1)
    b = DeviceReport(rows_read=5, bad_files=1, problems=["y"])
    b.drop("speed_limit", 2)
    b.drop("remainder_rows", 0)  # zero counts are not recorded
    a.merge(b)
    assert a.dropped == {"speed_limit": 3} and a.bad_files == 1 and a.problems == ["x", "y"]
    assert DeviceReport.from_json(a.to_json()) == a
    for i in range(50):
        a.note(str(i))
    assert len(a.problems) == 10


def test_curation_record() -> None:
    record = Curation().to_json(applied_by="birdzarr")
    assert record["speed_limit"] == 30.0 and record["clip"] == [-2.0, 2.0]
    assert record["gps_scale"] == 22.3012351755624


def test_check_root_attrs() -> None:
    meta = check_root_attrs({"birdzarr": {"format_version": FORMAT_VERSION}}, where="s")
    assert meta["format_version"] == FORMAT_VERSION
    with pytest.raises(NotAStoreError, match="not a birdzarr store"):
        check_root_attrs({}, where="s")
    with pytest.raises(FormatVersionError, match="version 7; this birdzarr supports versions 1 and 2"):
        check_root_attrs({"birdzarr": {"format_version": 7}}, where="s")
    with pytest.raises(FormatVersionError):
        check_root_attrs({"birdzarr": {"format_version": "1"}}, where="s")


def test_array_attributes_name_units() -> None:
    assert array_attributes("gimu") == {
        "long_name": "curated sensor windows", "channels": ["imu_x", "imu_y", "imu_z", "gps_speed"],
        "units": ["g", "g", "g", "m/s divided by gps_scale"],
    }
    assert array_attributes("timestamp") == {
        "long_name": "burst start, UTC (INT64_MIN = unknown)", "units": "seconds since 1970-01-01T00:00:00Z",
    }
    assert array_attributes("device") == {"long_name": "device (tracker) id"}
    assert array_attributes("label") == {"long_name": "behaviour label (-1 = unlabelled)"}
    with pytest.raises(KeyError):
        array_attributes("stats")


def test_a_written_store_spells_dimension_names_and_units(small_store, small_store_v1) -> None:  # type: ignore[no-untyped-def]
    """What docs/format.md's Arrays table says, read from the arrays' zarr.json: the default store
    (format 2: device, timestamp and label as format 1's, the others from _v2.ATTRIBUTES) and
    format 1's (gimu's units)."""
    import json

    def meta(store, name):  # type: ignore[no-untyped-def]
        return json.loads(store.location.fs.cat_file(store.location.join(name, "zarr.json")))

    table = {  # array: dimension_names, data_type, fill_value
        "gimu_codes": (["window", "sample", "channel"], "uint16", 0),
        "gps_speed": (["window", "sample"], "float32", 0.0),
        "gimu_row": (["window"], "uint32", 4294967295),
        "device": (["window"], "int32", -1),
        "timestamp": (["window"], "int64", -9223372036854775808),
        "label": (["window"], "int32", -1),
        "dict_values": (["entry"], "float32", 0.0),
        "dict_start": (["row", "channel"], "int64", -1),
        "dict_device": (["row"], "int64", -1),
    }
    for name, (dims, dtype, fill) in table.items():
        got = meta(small_store, name)
        assert (got["dimension_names"], got["data_type"], got["fill_value"]) == (dims, dtype, fill), name
        described = name in ("device", "timestamp", "label")
        assert got["attributes"] == (array_attributes(name) if described else _v2.ATTRIBUTES[name]), name
    assert small_store.format_version == FORMAT_VERSION == 2
    for name, dims in (("gimu", ["window", "sample", "channel"]), ("device", ["window"]),
                       ("timestamp", ["window"]), ("label", ["window"])):
        got = meta(small_store_v1, name)
        assert got["dimension_names"] == dims, name
        assert got["attributes"] == array_attributes(name), name
    assert small_store_v1.format_version == 1
