"""A store of many small devices (5,000 devices of 2-3 windows, from partition files): `verify`,
`verify --source`, `Store.device` for every device and `info` give exact answers, and the
per-device work reads each chunk once rather than once a device (issue 33, "100K devices at the
cost of 186")."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from format2_support import rewrite_device_table

import birdzarr
from birdzarr._errors import DeviceNotFoundError
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.maintenance import _verify
from birdzarr.maintenance._verify import VerifyResult, verify
from birdzarr.storage._location import resolve

N_DEVICES = 5000
N_FILES = 5
CHUNK = 1024  # about 12 chunks: many devices a chunk, some devices across two

# converting and comparing 5,000 devices takes seconds (each device's source is read on its own)
pytestmark = pytest.mark.slow


def _gimu(windows: np.ndarray) -> pa.Array:
    flat = pa.array(windows.reshape(-1), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("many")
    rng = np.random.default_rng(33)
    ids = np.arange(1, N_DEVICES + 1) * 7  # not 1..N: ids and positions differ
    sizes = rng.integers(2, 4, size=N_DEVICES)  # 2 or 3 windows each
    total = int(sizes.sum())
    windows = _synthetic.curated_windows(total, seed=3)
    owner = np.repeat(ids, sizes)
    labels = rng.integers(0, 3, size=total).astype(np.int32)
    source = root / "parts"
    source.mkdir()
    bounds = np.linspace(0, N_DEVICES, N_FILES + 1).astype(int)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for number in range(N_FILES):
        lo, hi = starts[bounds[number]], starts[bounds[number + 1]]
        pq.write_table(pa.table({
            "device_id": pa.array(owner[lo:hi], pa.int32()),
            "label": pa.array(labels[lo:hi], pa.int32()),
            "gimu": _gimu(windows[lo:hi]),
        }), source / f"part-{number}.parquet")
    store = root / "many.zarr"
    birdzarr.convert(str(source), str(store), chunk_windows=CHUNK, workers=1, progress=False)
    return {"source": source, "store": store, "ids": ids, "sizes": sizes, "starts": starts,
            "windows": windows, "labels": labels, "total": total}


def _unknown_row(store: pathlib.Path, device: int) -> str:
    """Format 2's problem for a device gone from the table: its dictionary row names it."""
    return (f"{store}: the dictionaries: 'dict_device' names device ids [{device}] that are not in "
            "the device table")


def test_every_device_is_found_with_its_exact_entry(many: dict) -> None:
    store = birdzarr.open_store(many["store"])
    ids, sizes, starts, labels = many["ids"], many["sizes"], many["starts"], many["labels"]
    assert len(store) == many["total"]
    assert len(store.device_table) == N_DEVICES
    for position, device in enumerate(ids.tolist()):
        entry = store.device(device)
        assert entry.device_id == device
        assert entry.n_windows == sizes[position]
        start, stop = int(starts[position]), int(starts[position + 1])
        assert [(r.start, r.stop) for r in entry.ranges] == [(start, stop)]
        values, counts = np.unique(labels[start:stop], return_counts=True)
        assert entry.label_counts == dict(zip(values.tolist(), counts.tolist(), strict=True))
    # the same entry by a string id, and ids between, below and above the table's are refused
    assert store.device(str(ids[1234])) is store.device(int(ids[1234]))  # type: ignore[arg-type]
    for missing in (0, 8, int(ids[-1]) + 7, 2**70):
        with pytest.raises(DeviceNotFoundError, match=f"device {missing} is not in"):
            store.device(missing)
    assert np.array_equal(store.device_windows(int(ids[-1])), many["windows"][starts[-2]:])


def test_verify_and_verify_source_check_every_device(many: dict) -> None:
    total = many["total"]
    chunks = -(-total // CHUNK)
    checked = verify(many["store"])
    assert checked.ok, checked.problems
    assert (checked.chunks_checked, checked.checksums_checked, checked.devices_compared) == (
        chunks, N_DEVICES, 0)
    compared = verify(many["store"], source=many["source"])
    assert compared.ok, compared.problems
    assert (compared.chunks_checked, compared.checksums_checked, compared.devices_compared) == (
        chunks, N_DEVICES, N_DEVICES)


def test_comparing_with_the_source_decodes_each_chunk_once(many: dict) -> None:
    """5,000 devices in ~12 chunks: the stored side of the comparison reads each chunk of the
    three compared arrays once (it read a chunk of each array once a device: 15,000 reads). On
    format 2 (the default) the windows' chunk is three objects (gimu_codes, gps_speed, gimu_row)
    and the three dictionary arrays (one chunk each here) are read once."""
    store = birdzarr.open_store(many["store"])
    source, devices = _verify._read_source(store, [resolve(str(many["source"]))])
    result = VerifyResult(url=store.url, n_windows=len(store), generation=0)
    before = store.reader.requests
    _verify._compare_with_source(store, source, devices, result)
    assert result.ok, result.problems
    assert result.devices_compared == N_DEVICES
    assert store.reader.requests - before == (3 + 2) * store.reader.n_chunks + 3


def test_verify_names_windows_of_a_device_missing_from_the_table(many: dict, tmp_path: pathlib.Path) -> None:
    copy = tmp_path / "copy.zarr"
    shutil.copytree(many["store"], copy)
    gone = rewrite_device_table(copy, lambda table: table.pop(2500))
    start, stop = gone["ranges"][0][:2]
    first = start // CHUNK * CHUNK
    last = min(first + CHUNK, many["total"]) - 1
    result = verify(copy)
    assert result.problems == [
        f"device table: its window counts add up to {many['total'] - (stop - start):,}, but "
        f"{many['total']:,} windows are committed",
        _unknown_row(copy, gone["device_id"]),
        f"windows {first:,}..{last:,}: device ids [{gone['device_id']}] are not in the device table",
    ]


def test_info_counts_every_device(many: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(many["store"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["devices"], info["windows"]) == (N_DEVICES, many["total"])
    assert info["report"]["rows_read"] == many["total"]
    assert main(["info", str(many["store"]), "--devices", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["device_id"] for r in rows] == many["ids"].tolist()
    assert [r["n_windows"] for r in rows] == many["sizes"].tolist()


@pytest.fixture(scope="module")
def shuffled(many: dict, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    store = tmp_path_factory.mktemp("shuffled") / "shuffled.zarr"
    birdzarr.convert(str(many["source"]), str(store), shuffle=True, seed=1, chunk_windows=CHUNK,
                     workers=1, progress=False)
    return store


def test_verify_checks_every_device_of_a_shuffled_store(many: dict, shuffled: pathlib.Path) -> None:
    """Each device's digest, summed over every chunk it is scattered over, is checked; a device
    whose windows lose their table entry is named with the chunks holding its windows."""
    result = verify(shuffled)
    assert result.ok, result.problems
    assert (result.chunks_checked, result.checksums_checked) == (-(-many["total"] // CHUNK), N_DEVICES)
    store = birdzarr.open_store(shuffled)
    device = int(many["ids"][4321])
    assert [e.device_id for e in store.device_table][4321] == device
    holding = np.flatnonzero(store.window_devices[:] == device)
    assert len(holding) == many["sizes"][4321]
    damaged = shuffled.parent / "damaged.zarr"
    shutil.copytree(shuffled, damaged)
    rewrite_device_table(damaged, lambda table: table.pop(4321))
    where = sorted({int(i) // CHUNK for i in holding})
    expected = [f"device table: its window counts add up to {many['total'] - len(holding):,}, but "
                f"{many['total']:,} windows are committed", _unknown_row(damaged, device)]
    expected += [f"windows {c * CHUNK:,}..{min((c + 1) * CHUNK, many['total']) - 1:,}: device ids "
                 f"[{device}] are not in the device table" for c in where]
    assert verify(damaged).problems == expected


def test_a_device_report_serialises_as_its_dataclass_fields() -> None:
    """The report's JSON is written for every device at every commit: built directly, it is
    still exactly ``dataclasses.asdict`` (same keys in the same order, copies of the containers)."""
    import dataclasses

    from birdzarr.format._spec import DeviceReport

    report = DeviceReport(rows_read=10, windows_written=7, dropped={"gap": 2, "short": 1},
                          mixed_label_windows=1, bad_lines=3, bad_files=1, problems=["a", "b"])
    raw = report.to_json()
    assert list(raw.items()) == list(dataclasses.asdict(report).items())
    raw["dropped"]["gap"] = 99
    raw["problems"].append("c")
    assert (report.dropped, report.problems) == ({"gap": 2, "short": 1}, ["a", "b"])
    assert DeviceReport.from_json(raw) != report
    assert DeviceReport.from_json(report.to_json()) == report


def test_verify_counts_windows_carrying_another_devices_id(many: dict, tmp_path: pathlib.Path) -> None:
    """Two neighbours' ids exchanged in the table: each range's windows carry the other's id."""
    copy = tmp_path / "swapped.zarr"
    shutil.copytree(many["store"], copy)
    def swap(table: list[dict]) -> None:
        table[100]["device_id"], table[101]["device_id"] = table[101]["device_id"], table[100]["device_id"]

    rewrite_device_table(copy, swap)
    ids, sizes, starts = many["ids"], many["sizes"], many["starts"]
    assert verify(copy).problems == [
        f"device {ids[101]}, windows [{starts[100]:,}, {starts[101]:,}): {sizes[100]:,} window(s) carry "
        "another device id in the 'device' array",
        f"device {ids[100]}, windows [{starts[101]:,}, {starts[102]:,}): {sizes[101]:,} window(s) carry "
        "another device id in the 'device' array",
    ]


def test_a_partition_files_footer_is_read_once_for_all_its_devices(
    many: dict, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5,000 devices in 5 partition files: the listing opens each file once (its device_id
    column), and the conversion each file once more, not once a device (the footer of a
    partition file is kept for its next devices, with the decoded groups); the store is the same."""
    from birdzarr.convert import _parquet

    opened: list[str] = []

    class Counted(pq.ParquetFile):
        def __init__(self, source: object, *args: object, **kwargs: object) -> None:
            opened.append(str(getattr(source, "path", source)))
            super().__init__(source, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", Counted)
    dest = tmp_path / "again.zarr"
    birdzarr.convert(str(many["source"]), str(dest), chunk_windows=CHUNK, workers=1, progress=False)
    assert len(opened) == 2 * N_FILES, len(opened)  # before: N_FILES + N_DEVICES
    assert not _parquet._FILES  # the conversion forgot them when it ended
    for name in ("gimu_codes", "gimu_row", "device", "label", "dict_values"):
        ours, theirs = sorted((dest / name).rglob("*")), sorted((many["store"] / name).rglob("*"))
        assert [p.relative_to(dest) for p in ours] == [p.relative_to(many["store"]) for p in theirs]
        for a, b in zip(ours, theirs, strict=True):
            assert a.is_dir() or a.read_bytes() == b.read_bytes(), a
