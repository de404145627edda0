"""The device table's check arrays (``range_checksum``, ``scattered_digest``): every writer writes
what the entries say, verify reads them instead of the entries' JSON, a table written before them
verifies as before, and an array that disagrees with the chunks is named."""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import numpy as np
import pytest
import zarr
from format2_support import device_table_file, read_details, write_details

import birdzarr
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.maintenance import _verify
from birdzarr.storage._root import RESTORE_HINT

TABLE = "device_table/1"  # the table of a store's first commit
CHUNK = 64  # windows a chunk of the stores here
WINDOW_ARRAYS = "'gimu_codes', 'gps_speed', 'gimu_row'"


def _partition_source(root: pathlib.Path, sizes: list[int]) -> None:
    """Two Parquet partition files of consecutive devices (ids 2, 5, 8, ...) with ``sizes``
    windows, labels and timestamps: the devices a conversion reads together, as columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    ids = [3 * k + 2 for k in range(len(sizes))]
    owner = np.repeat(ids, sizes)
    windows = _synthetic.curated_windows(len(owner), seed=4)
    labels = np.arange(len(owner), dtype=np.int32) % 3
    times = 1_700_000_000 + 60 * np.arange(len(owner), dtype=np.int64)
    for number, part in enumerate(np.array_split(np.arange(len(ids)), 2)):
        rows = np.isin(owner, np.asarray(ids)[part])
        flat = pa.array(windows[rows].reshape(-1), type=pa.float32())
        gimu = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)
        pq.write_table(pa.table({"device_id": pa.array(owner[rows], pa.int32()),
                                 "label": pa.array(labels[rows]), "timestamp": pa.array(times[rows]),
                                 "gimu": gimu}), root / f"part-{number}.parquet")


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """A partition source of 9 devices converted in device order and shuffled (64-window chunks)."""
    root = tmp_path_factory.mktemp("columns")
    _partition_source(root / "src", [40, 7, 130, 1, 64, 3, 90, 20, 5])
    ordered, shuffled = root / "ordered.zarr", root / "shuffled.zarr"
    birdzarr.convert(root / "src", ordered, chunk_windows=CHUNK, progress=False)
    birdzarr.convert(root / "src", shuffled, chunk_windows=CHUNK, shuffle=True, seed=1, progress=False)
    return {"src": root / "src", "ordered": ordered, "shuffled": shuffled}


@pytest.fixture()
def ordered(stores: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy of the device-ordered store, free to damage."""
    return pathlib.Path(shutil.copytree(stores["ordered"], tmp_path / "ordered.zarr"))


@pytest.fixture()
def shuffled(stores: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> pathlib.Path:
    """A private copy of the shuffled store, free to damage."""
    return pathlib.Path(shutil.copytree(stores["shuffled"], tmp_path / "shuffled.zarr"))


def _held(store: pathlib.Path) -> dict[str, list[int]]:
    """The check arrays the committed table group holds, read with zarr-python."""
    group = zarr.open_group(str(device_table_file(store).parent), mode="r", zarr_format=3)
    return {name: group[name][:].tolist() for name in ("range_checksum", "scattered_digest")
            if name in group}


def _said(store: pathlib.Path) -> dict[str, list[int]]:
    """What the entries (the details' JSON) record: each range's checksum by (start, stop, device),
    and each device's digest by id (uint64 bits as int64) where every device has one."""
    devices = sorted(read_details(store)["devices"], key=lambda d: d["device_id"])
    ranges = sorted((r[0], r[1], d["device_id"], r[2]) for d in devices for r in d["ranges"])
    said = {"range_checksum": [int(checksum, 16) for *_, checksum in ranges]}
    if devices and all(d["scattered_digest"] for d in devices):
        said["scattered_digest"] = [int(np.array(int(d["scattered_digest"], 16), np.uint64).view(np.int64))
                                    for d in devices]
    return said


def _set(store: pathlib.Path, name: str, at: int, value: int) -> None:
    """Write one value of a table array, as a writer would (its chunk's CRC-32C intact)."""
    array: Any = zarr.open_array(str(store / TABLE / name), mode="r+", zarr_format=3)
    values = array[:]
    values[at] = value
    array[:] = values


def test_converted_stores_hold_the_checks_their_entries_record(stores: dict[str, pathlib.Path]) -> None:
    ordered, shuffled = _held(stores["ordered"]), _held(stores["shuffled"])
    assert ordered == _said(stores["ordered"]) and len(ordered["range_checksum"]) == 9
    assert "scattered_digest" not in ordered  # its entries have none
    assert shuffled == _said(stores["shuffled"]) and len(shuffled["scattered_digest"]) == 9
    assert shuffled["range_checksum"] == []  # no ranges: the windows are scattered
    first = read_details(stores["ordered"])["devices"][0]["ranges"][0][2]
    assert ordered["range_checksum"][0] == int(first, 16)


def test_copied_and_subset_stores_hold_the_checks_their_entries_record(
        stores: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    copied = tmp_path / "copied.zarr"
    birdzarr.copy(stores["shuffled"], copied, progress=False)
    assert _held(copied) == _said(copied) == _held(stores["shuffled"])
    part = tmp_path / "subset.zarr"
    birdzarr.subset(stores["ordered"], part, devices=[5, 8, 20], progress=False)
    assert _held(part) == _said(part) and len(_held(part)["range_checksum"]) == 3
    for store in (copied, part):
        result = birdzarr.verify(store)
        assert (result.ok, result.checksums_checked) == (True, 9 if store == copied else 3)


def test_a_repaired_store_keeps_its_checks(stores: dict[str, pathlib.Path], ordered: pathlib.Path) -> None:
    """A damaged window chunk rebuilt from the source: the table (and its arrays) stays as written."""
    before = _held(ordered)
    (ordered / "gimu_codes" / "c" / "1" / "0" / "0").unlink()
    assert not birdzarr.verify(ordered).ok
    birdzarr.repair(ordered, source=stores["src"])
    assert _held(ordered) == before == _said(ordered)
    result = birdzarr.verify(ordered)
    assert (result.ok, result.checksums_checked) == (True, 9)


def test_an_appended_store_holds_the_checks_of_both_commits(tmp_path: pathlib.Path) -> None:
    """CSV devices continued by an append: two ranges each, and the append's own new device."""
    raw, s1, s2 = tmp_path / "raw", tmp_path / "s1", tmp_path / "s2"
    _synthetic.make_csv_dir(raw, n_devices=3, bursts_per_device=12, parts=2)
    s1.mkdir()
    s2.mkdir()
    for f in sorted(raw.iterdir()):
        (s2 if f.stem.endswith("_1") else s1).joinpath(f.name).write_bytes(f.read_bytes())
    store = tmp_path / "a.zarr"
    assert main(["convert", str(s1), str(store), "--quiet"]) == 0
    assert main(["append", str(store), str(s2), "--quiet"]) == 0
    held = _held(store)
    assert device_table_file(store).parent.name == "2"
    assert held == _said(store) and len(held["range_checksum"]) == 6
    result = birdzarr.verify(store)
    assert result.ok and result.checksums_checked == 6


def _count_text_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The table groups whose entries' JSON is read from now on."""
    read: list[str] = []
    table_text = _verify._table_text

    def counted(location: Any, where: str) -> Any:
        read.append(where)
        return table_text(location, where)

    monkeypatch.setattr(_verify, "_table_text", counted)
    return read


def test_verify_reads_the_check_arrays_not_the_entries(
        stores: dict[str, pathlib.Path], monkeypatch: pytest.MonkeyPatch) -> None:
    read = _count_text_reads(monkeypatch)
    for store in (stores["ordered"], stores["shuffled"]):
        result = birdzarr.verify(store)
        assert (result.ok, result.checksums_checked) == (True, 9)
    assert read == []
    result = birdzarr.verify(stores["ordered"], source=stores["src"])
    assert (result.ok, result.checksums_checked, result.devices_compared) == (True, 9, 9)
    assert read == [TABLE]  # the source's comparison needs the entries' sources and labels


def test_a_table_written_before_the_check_arrays_verifies_as_before(
        ordered: pathlib.Path, shuffled: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The arrays removed (a store of the code before): the entries are read, everything checks
    as with them, and a recorded checksum that the windows do not match is found."""
    read = _count_text_reads(monkeypatch)
    shutil.rmtree(ordered / TABLE / "range_checksum")
    shutil.rmtree(shuffled / TABLE / "scattered_digest")
    for store in (ordered, shuffled):
        result = birdzarr.verify(store)
        assert (result.ok, result.checksums_checked) == (True, 9)
    assert read == [TABLE, TABLE]
    details = read_details(ordered)
    entry = details["devices"][2]
    start, stop, recorded = entry["ranges"][0]
    entry["ranges"][0][2] = "0badc0de"
    write_details(ordered, details)
    assert birdzarr.verify(ordered).problems == [
        f"device {entry['device_id']}, windows [{start:,}, {stop:,}): checksum {recorded} differs from the "
        f"0badc0de recorded at write time: the windows changed after they were written (chunks "
        f"{start // CHUNK}..{(stop - 1) // CHUNK} of {WINDOW_ARRAYS})"]


def _disagreeing(name: str) -> list[str]:
    return [f"device table: its index array '{TABLE}/{name}' disagrees with the entries it indexes "
            f"(in '{TABLE}/details'); {RESTORE_HINT}"]


def test_a_check_array_that_disagrees_with_the_chunks_is_named(
        ordered: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass that read the array finds a checksum that differs; the entries say the windows
    are as written: the array is named, and the windows checked again with the entries."""
    read = _count_text_reads(monkeypatch)
    recorded = read_details(ordered)["devices"][2]["ranges"][0][2]
    _set(ordered, "range_checksum", 2, int(recorded, 16) ^ 1)
    result = birdzarr.verify(ordered)
    assert (result.problems, result.checksums_checked) == (_disagreeing("range_checksum"), 9)
    assert read == [TABLE, TABLE]  # to compare the arrays, then for the pass with the entries


def test_a_digest_array_that_disagrees_with_the_chunks_is_named(shuffled: pathlib.Path) -> None:
    recorded = read_details(shuffled)["devices"][4]["scattered_digest"]
    wrong = int(recorded, 16) ^ (1 << 63)
    _set(shuffled, "scattered_digest", 4, int(np.array(wrong, np.uint64).view(np.int64)))
    result = birdzarr.verify(shuffled)
    assert (result.problems, result.checksums_checked) == (_disagreeing("scattered_digest"), 9)


def test_damaged_windows_are_found_in_one_pass_with_the_arrays(
        ordered: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows that changed (chunks 0 and 1 swapped): the arrays agree with the entries, so the one
    pass's findings stand, the same as a table without the arrays gives."""
    for name, tail in (("gimu_codes", "0/0"), ("gps_speed", "0"), ("gimu_row", "")):
        first, second = (ordered / name / "c" / str(i) / tail for i in (0, 1))
        data = first.read_bytes()
        first.write_bytes(second.read_bytes())
        second.write_bytes(data)
    before = pathlib.Path(shutil.copytree(ordered, tmp_path / "before.zarr"))
    shutil.rmtree(before / TABLE / "range_checksum")
    read = _count_text_reads(monkeypatch)
    problems = birdzarr.verify(ordered).problems
    assert read == [TABLE]  # the arrays compared with the entries once, no second pass
    assert problems == birdzarr.verify(before).problems
    assert [p.split(":")[0] for p in problems] == [
        "windows 0..63 (chunk 'gimu_row/c/0')", "windows 64..127 (chunk 'gimu_row/c/1')",
        "device 2, windows [0, 40)", "device 5, windows [40, 47)", "device 8, windows [47, 177)"]


def test_damaged_entries_are_listed_when_only_the_arrays_are_read(ordered: pathlib.Path) -> None:
    """The details' chunks are checked by their CRC-32C without parsing their JSON."""
    chunk = ordered / TABLE / "details" / "c" / "0"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF
    chunk.write_bytes(bytes(data))
    assert birdzarr.verify(ordered).problems == [
        f"{ordered}: chunk '{TABLE}/details/c/0' fails its CRC-32C: the device table's entries changed "
        f"after they were written; {RESTORE_HINT}"]
