"""verify: damaged chunks, changed windows and an inconsistent table are all found and listed;
the loader refuses damaged chunks instead of returning fill values."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import zarr
from format2_support import rewrite_device_table

import birdzarr
from birdzarr._errors import BadInputError, MissingChunkError, StoreNotFoundError
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.maintenance._verify import verify

CODES = "gimu_codes"  # the windows' codes in a format-2 store (the default), (n, 20, 3) chunks


def _chunk(store: pathlib.Path, name: str, index: int) -> pathlib.Path:
    tail = {"gimu": "0/0", CODES: "0/0", "gps_speed": "0"}.get(name, "")
    return store / name / "c" / str(index) / tail


def _swap_windows(store: pathlib.Path, i: int, j: int) -> None:
    """Exchange the windows of chunks ``i`` and ``j``: each one's chunks of the three format-2 arrays
    that decode to them (codes, gps_speed and the dictionary rows the codes index, swapped alone,
    would give codes past their rows' ends), so both decode fine to the other's windows."""
    for name in (CODES, "gps_speed", "gimu_row"):
        a, b = _chunk(store, name, i), _chunk(store, name, j)
        data_a, data_b = a.read_bytes(), b.read_bytes()
        a.write_bytes(data_b)
        b.write_bytes(data_a)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_clean_store_verifies(store_copy: pathlib.Path, parquet_source: tuple[pathlib.Path, dict]) -> None:
    result = verify(store_copy, source=parquet_source[0])
    assert result.ok, result.format()
    assert result.chunks_checked == birdzarr.open_store(store_copy).reader.n_chunks
    assert result.checksums_checked == len(birdzarr.open_store(store_copy).device_table)
    assert result.devices_compared == len(parquet_source[1])


def test_a_deleted_chunk_is_found_by_verify_and_the_readers(store_copy: pathlib.Path) -> None:
    _chunk(store_copy, CODES, 3).unlink()
    _chunk(store_copy, "label", 5).unlink()
    result = verify(store_copy)
    assert not result.ok
    text = result.format()
    assert "'gimu_codes/c/3/0/0' is missing" in text and "'label/c/5' is missing" in text
    assert "checksum cannot be checked" in text
    store = birdzarr.open_store(store_copy)
    with pytest.raises(MissingChunkError, match="gimu_codes/c/3/0/0"):
        store.windows[3 * 1024 + 5]  # never zeros
    _iterate_loader_expecting_damage(store_copy)


def test_a_flipped_byte_is_found(store_copy: pathlib.Path) -> None:
    path = _chunk(store_copy, CODES, 2)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # in the compressed payload: a decode error or silently other values
    path.write_bytes(bytes(raw))
    result = verify(store_copy)
    assert not result.ok
    assert "gimu_codes/c/2/0/0' cannot be decoded" in result.format() or "checksum" in result.format()


def test_a_flipped_header_byte_is_refused_by_the_loader(store_copy: pathlib.Path) -> None:
    path = _chunk(store_copy, CODES, 1)
    raw = bytearray(path.read_bytes())
    raw[6] ^= 0xFF  # blosc header, uncompressed size: decoding must fail
    path.write_bytes(bytes(raw))
    assert "gimu_codes/c/1/0/0' cannot be decoded" in verify(store_copy).format()
    _iterate_loader_expecting_damage(store_copy)


def _iterate_loader_expecting_damage(store: pathlib.Path) -> None:
    try:
        dataset = birdzarr.WindowDataset(store, batch_size=512, shuffle=False)
    except ImportError:  # pragma: no cover - torch is a dependency; the loader may not exist yet
        pytest.skip("birdzarr.WindowDataset is not available")
    with pytest.raises(MissingChunkError):
        for _ in dataset:
            pass


def test_silently_changed_windows_fail_their_checksum(store_copy: pathlib.Path) -> None:
    # Two chunks swapped: both decode fine, the windows are simply not the ones written.
    _swap_windows(store_copy, 1, 4)
    result = verify(store_copy)
    assert not result.ok
    assert sum("differs from the" in p for p in result.problems) >= 2, result.format()


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_wrong_device_ids_and_an_inconsistent_table(store_copy: pathlib.Path) -> None:
    a, b = _chunk(store_copy, "device", 0), _chunk(store_copy, "device", 20)
    a.write_bytes(b.read_bytes())

    def overlap(devices: list[dict]) -> None:
        devices[1]["ranges"][0][0] -= 1  # now overlaps device 0's range
        devices[1]["n_windows"] += 1

    rewrite_device_table(store_copy, overlap)
    result = verify(store_copy)
    text = result.format()
    assert "carry another device id" in text
    assert "overlap" in text
    assert "add up to" in text


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_an_array_shorter_than_the_committed_count_is_damage(store_copy: pathlib.Path) -> None:
    """An array cut short in its zarr.json (a re-run append left its per-window arrays at the
    previous commit's shape): zarr-python and TensorStore miss the last windows. verify called it
    an uncommitted leftover 'invisible to readers' and said OK; repair sets the shape back."""
    from birdzarr.maintenance._repair import repair

    meta_path = store_copy / CODES / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["shape"][0] = 1000
    meta_path.write_text(json.dumps(meta))
    result = verify(store_copy)
    assert result.problems == [
        "array 'gimu_codes' has shape 1,000 along windows, but 30,000 windows are committed: readers of "
        "its Zarr array (zarr-python, TensorStore) see only 1,000; `birdzarr repair` sets it back to the "
        "committed count"]
    assert result.notes == []
    actions = repair(store_copy).actions
    assert any("resized 'gimu_codes' from 1,000 to the committed 30,000" in a for a in actions), actions
    assert zarr.open_array(store_copy / CODES, mode="r").shape[0] == 30_000
    assert verify(store_copy).ok


def _changed_source(
    parquet_source: tuple[pathlib.Path, dict], tmp_path: pathlib.Path, nth_device: int,
    at: tuple[int, int, int], delta: float,
) -> tuple[pathlib.Path, int, np.ndarray]:
    """A copy of the Parquet source with one value of one device's windows changed."""
    source = tmp_path / "src"
    shutil.copytree(parquet_source[0], source)
    device = sorted(parquet_source[1])[nth_device]
    windows = parquet_source[1][device].copy()
    windows[at] += np.float32(delta)
    _synthetic.write_parquet(windows, source / f"{device}.parquet")
    return source, device, windows


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_verify_against_changed_sources(store_copy: pathlib.Path, tmp_path: pathlib.Path,
                                        parquet_source: tuple[pathlib.Path, dict]) -> None:
    source, device, windows = _changed_source(parquet_source, tmp_path, 2, (7, 3, 1), 0.5)
    (source / f"{sorted(parquet_source[1])[0]}.parquet").unlink()
    _synthetic.write_parquet(windows[:10], source / "99999.parquet")
    result = verify(store_copy, source=source)
    text = result.format()
    assert f"device {device}: 1 window(s) differ in windows from the sources" in text
    assert "(first at the device's window 7)" in text
    assert "no source files in" in text
    assert "device 99999 is in" in text


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_cli_verify_exit_status_and_listing(
    store_copy: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(store_copy), "--quiet"]) == 0
    _chunk(store_copy, "timestamp", 2).unlink()
    assert main(["verify", str(store_copy), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "timestamp/c/2' is missing" in out
    assert main(["verify", str(store_copy / "nope")]) == 2


@pytest.mark.slow
def test_a_shuffled_store_checks_its_scattered_digests(
    tmp_path: pathlib.Path, parquet_source: tuple[pathlib.Path, dict]
) -> None:
    dest = tmp_path / "shuffled.zarr"
    birdzarr.convert(parquet_source[0], dest, chunk_windows=1024, shuffle=True, seed=1, progress=False)
    result = verify(dest, source=parquet_source[0])
    assert result.ok, result.format()
    assert result.checksums_checked == len(parquet_source[1])
    assert verify(dest).ok
    source, device, _ = _changed_source(parquet_source, tmp_path, 1, (3, 0, 0), 1.0)
    assert f"device {device}: 1 window(s)" in verify(dest, source=source).format()
    # one window's label changed (a valid chunk, written by zarr): its device's digest differs
    kept = _chunk(dest, "label", 0).read_bytes()
    labels = zarr.open_array(dest / "label", mode="r+")
    devices = zarr.open_array(dest / "device", mode="r")[:]
    labels[7] = int(labels[7]) + 1
    found = verify(dest).format()
    assert found.count("scattered digest") == 1 and f"device {int(devices[7])}: scattered digest" in found
    _chunk(dest, "label", 0).write_bytes(kept)
    assert verify(dest).ok
    # two chunks exchanged: the windows no longer match their devices, times and labels
    _swap_windows(dest, 1, 4)
    assert "scattered digest" in verify(dest).format()


@pytest.mark.slow
def test_a_store_shuffled_by_an_earlier_version_checks_its_scattered_checksums(
    tmp_path: pathlib.Path,
) -> None:
    """Earlier versions recorded a CRC-32C of each device's windows in index order instead of
    the digest: such stores (format 1) still verify, and a change is still found."""
    from birdzarr.convert._summary import checksum_hasher
    from tests.format1_support import format1_copy

    dest = format1_copy("gdict16.zarr", tmp_path)
    store = birdzarr.open_store(dest)
    root = json.loads((dest / "zarr.json").read_text())
    for entry in root["attributes"]["birdzarr"]["devices"]:
        hasher = checksum_hasher()
        hasher.update(store.device_windows(entry["device_id"]).astype("<f4"))  # in index order
        entry["scattered_checksum"] = hasher.hexdigest()
        del entry["scattered_digest"]
    (dest / "zarr.json").write_text(json.dumps(root))
    result = verify(dest)
    assert result.ok, result.format()
    assert result.checksums_checked == len(store.devices) == 4
    a, b = _chunk(dest, "gimu", 0), _chunk(dest, "gimu", 1)
    data_a, data_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(data_b)
    b.write_bytes(data_a)
    found = verify(dest).format()
    assert "scattered checksum" in found and "scattered digest" not in found


def _unreadable_sources(tmp_path: pathlib.Path) -> dict[str, pathlib.Path]:
    (tmp_path / "a-file.txt").write_text("not a source\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "unrelated").mkdir()
    (tmp_path / "unrelated" / "notes.txt").write_text("hello\n")
    return {"missing": tmp_path / "nonexistent", "file": tmp_path / "a-file.txt",
            "empty": tmp_path / "empty", "unrelated": tmp_path / "unrelated"}


@pytest.mark.parametrize("case", ["missing", "file", "empty", "unrelated"])
def test_an_unreadable_source_is_the_converters_error_not_damage(
    store_copy: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    source = _unreadable_sources(tmp_path)[case]
    with pytest.raises(birdzarr.BirdzarrError) as converting:
        birdzarr.convert(source, tmp_path / "c.zarr", progress=False)
    with pytest.raises(type(converting.value)) as verifying:
        verify(store_copy, source=source)
    assert type(verifying.value) is type(converting.value)
    assert str(verifying.value) == str(converting.value)
    assert isinstance(verifying.value, StoreNotFoundError if case == "missing" else BadInputError)
    capsys.readouterr()
    assert main(["verify", str(store_copy), "--source", str(source), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"birdzarr verify: error: {converting.value}\n"
    assert captured.out == ""  # refused before checking anything: no FAILED listing


def test_a_source_of_the_other_kind_is_refused(
    store_copy: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "csv"
    source.mkdir()
    (source / "5_1.csv").write_text("device_id,date_time\n")
    expected = (f"{source} holds csv files, but {store_copy} was converted from parquet input: point "
                "--source (Python: source=) at the files it was converted from.")
    with pytest.raises(BadInputError) as caught:
        verify(store_copy, source=source)
    assert str(caught.value) == expected
    assert main(["verify", str(store_copy), "--source", str(source), "--quiet"]) == 2
    assert capsys.readouterr().err == f"birdzarr verify: error: {expected}\n"


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_entries_skipped_at_conversion_are_skipped_again_and_only_those(tmp_path: pathlib.Path) -> None:
    source = tmp_path / "src"
    _synthetic.make_parquet_dir(source, n_devices=3, total_windows=3000, seed=5)
    (source / "notes.txt").write_text("field notes")
    dest = tmp_path / "s.zarr"
    birdzarr.convert(source, dest, skip_unknown_files=True, progress=False)
    assert verify(dest, source=source).ok  # notes.txt was skipped by the conversion: skipped again
    (source / "later.txt").write_text("x")
    with pytest.raises(BadInputError) as refused:
        verify(dest, source=source)
    assert str(refused.value) == (
        f"{source}: 1 entry is not an input file and was not skipped when {dest} was converted: "
        "'later.txt'. Remove or rename it, or point --source at the converted files only.")


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_shuffled_csv_store_verifies_against_its_source_and_finds_a_changed_window(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CSV device ends in an empty block (its unfinished last burst forms no window): verify
    --source of a shuffled CSV store hashed it and crashed ("cannot reshape array of size 0")."""
    source = tmp_path / "csv"
    _synthetic.make_csv_dir(source, n_devices=3, bursts_per_device=40, parts=2, seed=3)
    dest = tmp_path / "shuffled.zarr"
    birdzarr.convert(source, dest, chunk_windows=64, shuffle=True, seed=1, progress=False)
    result = verify(dest, source=source)
    assert result.ok, result.format()
    assert result.devices_compared == 3 and result.checksums_checked == 3
    assert main(["verify", str(dest), "--source", str(source), "--quiet"]) == 0
    capsys.readouterr()
    # one value of one stored window changed through zarr (its chunk stays valid)
    gps = zarr.open_array(dest / "gps_speed", mode="r+")  # format 2 stores the channel as float32
    device = int(zarr.open_array(dest / "device", mode="r")[5])
    gps[5, 3] = float(gps[5, 3]) + 0.25
    found = verify(dest, source=source)
    assert not found.ok
    assert f"device {device}: scattered digest" in found.format()
    assert (f"device {device}: 1 window(s) (with their times and labels) differ from the sources "
            "(compared as sets: the store is shuffled)") in found.problems
    assert main(["verify", str(dest), "--source", str(source), "--quiet"]) == 1
    assert "FAILED" in capsys.readouterr().out


def _two_seasons(tmp_path: pathlib.Path, *, bursts_per_device: int, parts: int
                 ) -> tuple[pathlib.Path, pathlib.Path]:
    """CSV exports of 3 devices in ``parts`` parts: the last part of each device in ``s2`` (a
    second season), the others in ``s1``."""
    raw = tmp_path / "raw"
    _synthetic.make_csv_dir(raw, n_devices=3, bursts_per_device=bursts_per_device, parts=parts)
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    s1.mkdir()
    s2.mkdir()
    for f in sorted(raw.iterdir()):
        (s2 if f.stem.endswith(f"_{parts - 1}") else s1).joinpath(f.name).write_bytes(f.read_bytes())
    return s1, s2


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_verify_takes_the_several_sources_convert_and_append_took(tmp_path: pathlib.Path) -> None:
    """A store converted from season 1 and appended season 2 verifies against both sources at
    once (``--source s1 s2``, Python ``source=[s1, s2]``), as ``convert s1 s2`` reads them; one
    season alone is reported as missing windows, not as OK."""
    s1, s2 = _two_seasons(tmp_path, bursts_per_device=40, parts=3)
    dest = tmp_path / "a.zarr"
    assert main(["convert", str(s1), str(dest), "--quiet"]) == 0
    assert main(["append", str(dest), str(s2), "--quiet"]) == 0
    assert main(["verify", str(dest), "--source", str(s1), str(s2), "--quiet"]) == 0
    assert birdzarr.verify(dest, source=[s1, s2]).ok
    assert not birdzarr.verify(dest, source=s1).ok


# -- 100,000 devices: the device table read as columns, small devices compared in runs -------------


def _partition_source(root: pathlib.Path, names: list[str], sizes: list[int], seed: int = 4
                      ) -> tuple[list[int], np.ndarray]:
    """Parquet partition files (``names``) of consecutive devices with ``sizes`` windows, with
    labels and timestamps; the device ids and the windows in their order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir()
    ids = [3 * k + 2 for k in range(len(sizes))]
    owner = np.repeat(ids, sizes)
    windows = _synthetic.curated_windows(len(owner), seed=seed)
    labels = np.arange(len(owner), dtype=np.int32) % 3
    times = 1_700_000_000 + 60 * np.arange(len(owner), dtype=np.int64)
    for name, part in zip(names, np.array_split(np.arange(len(ids)), len(names)), strict=True):
        rows = np.isin(owner, np.asarray(ids)[part])
        flat = pa.array(windows[rows].reshape(-1), type=pa.float32())
        gimu = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)
        pq.write_table(pa.table({"device_id": pa.array(owner[rows], pa.int32()),
                                 "label": pa.array(labels[rows]), "timestamp": pa.array(times[rows]),
                                 "gimu": gimu}), root / name)
    return ids, windows


def _count_read_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of devices each ``_parquet.read_runs`` call reads at once, from now on."""
    from birdzarr.convert import _parquet

    together: list[int] = []
    read_runs = _parquet.read_runs

    def counted(devices: list) -> object:
        together.append(len(devices))
        return read_runs(devices)

    monkeypatch.setattr(_parquet, "read_runs", counted)
    return together


def _same_table(store: birdzarr.Store) -> None:
    """The table read as columns (not as DeviceEntry objects) holds what its entries hold, read
    from the store and from its JSON written either way a table group holds it: as the group's
    attributes (json.dumps' separators) or as the group's details array (compact separators)."""
    from birdzarr.maintenance import _verify

    tables = [_verify.device_table_columns(store)]
    assert "device_table" not in store.__dict__  # read from the text, not through the entries
    details = {"devices": store.meta["devices"], "report_devices": store.meta["report"]["devices"],
               "csv_tails": store.meta.get("csv_tails")}
    group = {"zarr_format": 3, "node_type": "group", "attributes": {"birdzarr": details}}
    tables += [_verify._Table.of_text(json.dumps(group).encode(), _verify._IN_ATTRIBUTES),
               _verify._Table.of_text(json.dumps(details, separators=(",", ":")).encode(), _verify._IN_ARRAY)]
    entries = _verify._Table.of_entries(store.device_table)
    for table in tables:
        assert table is not None
        for name in ("ids", "n_windows", "first_time", "last_time", "range_entry", "range_start",
                     "range_stop", "range_checksum"):
            assert np.array_equal(getattr(table, name), getattr(entries, name)), name
        assert [table.entry(k) for k in range(len(table))] == store.device_table


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_the_device_table_read_as_columns_holds_its_entries(tmp_path: pathlib.Path) -> None:
    """verify reads a format-2 table's zarr.json with pyarrow and patterns, without a Python
    object a device: the same ids, counts, times, ranges, checksums, sources and label counts as
    the entries, for file names JSON escapes, devices appended (two ranges), labels and times,
    and a shuffled store's digests."""
    names = ['part "é" 0.parquet', "part\\1.parquet", "part-2.parquet"]
    _partition_source(tmp_path / "src", names, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    dest = tmp_path / "s.zarr"
    store = birdzarr.convert(tmp_path / "src", dest, chunk_windows=8, progress=False)
    assert store.device_table[0].sources == ['part "é" 0.parquet']
    _same_table(birdzarr.open_store(dest))
    shuffled = birdzarr.convert(tmp_path / "src", tmp_path / "sh.zarr", chunk_windows=8, shuffle=True, seed=1,
                                progress=False)
    assert shuffled.device_table[0].scattered_digest is not None
    _same_table(birdzarr.open_store(tmp_path / "sh.zarr"))
    s1, s2 = _two_seasons(tmp_path, bursts_per_device=12, parts=2)
    appended = tmp_path / "a.zarr"
    assert main(["convert", str(s1), str(appended), "--quiet"]) == 0
    assert main(["append", str(appended), str(s2), "--quiet"]) == 0
    assert all(len(e.ranges) == 2 for e in birdzarr.open_store(appended).device_table)
    _same_table(birdzarr.open_store(appended))
    assert verify(appended, source=[s1, s2]).ok


def test_a_table_the_columns_cannot_read_is_read_as_before(store_copy: pathlib.Path) -> None:
    """A checksum that is not 8 hex digits, or a number past int64, is not read by the patterns:
    the table is read through its entries, and verify says what it always said."""
    from birdzarr.format import _device_table
    from birdzarr.maintenance import _verify

    def odd(devices: list[dict]) -> str:
        devices[3]["ranges"][0][2] = "not-hex!"
        return str(devices[3]["device_id"])

    device = rewrite_device_table(store_copy, odd)
    # its writers write no range_checksum array for it: the array cannot hold "not-hex!"
    assert "range_checksum" not in _device_table.columns(birdzarr.open_store(store_copy).device_table)
    shutil.rmtree(store_copy / "device_table" / "1" / "range_checksum")
    store = birdzarr.open_store(store_copy)
    assert _verify.device_table_columns(store, details=False).range_checksum[3] == b"not-hex!"
    assert "device_table" in store.__dict__  # read through the entries
    problems = [p for p in verify(store_copy).problems if "checksum" in p]
    assert len(problems) == 1 and problems[0].startswith(f"device {device}, windows [")
    assert "differs from the not-hex! recorded at write time" in problems[0]


def test_a_damaged_device_table_document_is_refused_as_before(store_copy: pathlib.Path) -> None:
    from birdzarr._errors import CorruptChunkError

    path = store_copy / "device_table" / "1" / "zarr.json"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CorruptChunkError, match="device_table/1/zarr.json' is damaged"):
        verify(store_copy)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_verify_source_compares_small_devices_together_and_says_what_each_alone_says(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Devices of partition files are read and compared a run at a time (as convert reads
    them); a device that differs is then compared alone: the messages of the per-device
    comparison, in device order, and every device counted once."""
    import pyarrow.parquet as pq


    sizes = [4, 2, 5, 3, 6, 1, 4, 3, 2, 5, 4, 3]
    names = ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    ids, _ = _partition_source(tmp_path / "src", names, sizes)
    dest = tmp_path / "s.zarr"
    birdzarr.convert(tmp_path / "src", dest, chunk_windows=8, progress=False)
    together = _count_read_runs(monkeypatch)
    clean = verify(dest, source=tmp_path / "src")
    assert clean.ok and clean.devices_compared == len(ids), clean.format()
    assert together == [len(ids)]  # one run: 47 windows
    # in part-1: one value of the 3rd window of its first device changed, its last device's last
    # window gone, and one label of its second device changed
    path = tmp_path / "src" / "part-1.parquet"
    table = pq.read_table(path).to_pydict()
    first, second, last = ids[4], ids[5], ids[7]
    rows = [i for i, d in enumerate(table["device_id"]) if d == first]
    table["gimu"][rows[2]][13] += 0.5
    table["label"][table["device_id"].index(second)] += 1
    drop = max(i for i, d in enumerate(table["device_id"]) if d == last)
    changed = {k: [v for i, v in enumerate(values) if i != drop] for k, values in table.items()}
    import pyarrow as pa

    pq.write_table(pa.table(changed, schema=pq.read_schema(path)), path)
    result = verify(dest, source=tmp_path / "src")
    assert result.problems == [
        f"device {first}: 1 window(s) differ in windows from the sources (first at the device's window 2)",
        f"device {second}: 1 window(s) differ in labels from the sources (first at the device's window 0)",
        f"device {last}: the store holds {sizes[7]:,} windows, its sources give {sizes[7] - 1:,}",
    ]
    assert result.devices_compared == len(ids)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_verify_source_of_a_shuffled_store_compares_runs_of_devices_by_their_digests(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A shuffled store's small partition devices are read a run at a time and compared with the
    digests of the pass over the chunks; a device that differs is compared alone, as before."""
    import pyarrow.parquet as pq


    sizes = [4, 2, 5, 3, 6, 1, 4, 3]
    ids, _ = _partition_source(tmp_path / "src", ["part-0.parquet", "part-1.parquet"], sizes)
    dest = tmp_path / "sh.zarr"
    birdzarr.convert(tmp_path / "src", dest, chunk_windows=8, shuffle=True, seed=1, progress=False)
    together = _count_read_runs(monkeypatch)
    clean = verify(dest, source=tmp_path / "src")
    assert clean.ok and clean.devices_compared == len(ids), clean.format()
    assert together == [len(ids)]
    path = tmp_path / "src" / "part-1.parquet"
    table = pq.read_table(path).to_pydict()
    table["gimu"][1][5] += 0.25  # the second window of part-1's first device
    import pyarrow as pa

    pq.write_table(pa.table(table, schema=pq.read_schema(path)), path)
    result = verify(dest, source=tmp_path / "src")
    assert result.problems == [f"device {ids[4]}: 1 window(s) (with their times and labels) differ from "
                               "the sources (compared as sets: the store is shuffled)"]
    assert result.devices_compared == len(ids)


def test_verify_source_starts_the_next_run_with_the_device_that_did_not_fit(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A device that would take a run past its windows starts the next run (it is not read and
    compared alone): every device of partition files is compared in a run, and the result is the
    same. Each device's entry is found by one search over the sorted ids."""
    from birdzarr.maintenance import _verify

    sizes = [4, 2, 5, 3, 6, 1, 4, 3, 2, 5, 4, 3]
    ids, _ = _partition_source(tmp_path / "src", ["part-0.parquet", "part-1.parquet"], sizes)
    dest = tmp_path / "s.zarr"
    birdzarr.convert(tmp_path / "src", dest, chunk_windows=8, progress=False)
    monkeypatch.setattr(_verify, "_RUN_WINDOWS", 10)
    alone: list[int] = []
    derive = _verify.derive_device

    def counted(store: object, device: object, *args: object) -> object:
        alone.append(device.device_id)  # type: ignore[attr-defined]
        return derive(store, device, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_verify, "derive_device", counted)
    together = _count_read_runs(monkeypatch)
    result = verify(dest, source=tmp_path / "src")
    assert result.ok and result.devices_compared == len(ids), result.format()
    assert together == [2, 2, 2, 3, 2, 1] and alone == []  # runs of at most 10 windows, greedily


def test_rows_of_finds_each_ids_entry_or_none() -> None:
    from birdzarr.format._spec import DeviceEntry
    from birdzarr.maintenance import _verify

    table = _verify._Table.of_entries([DeviceEntry(device_id=d) for d in (30, 4, 17, 4)])
    rows = _verify._rows_of(table, np.array([4, 5, 17, 30, 31, 0]))
    assert rows.tolist() == [3, -1, 2, 0, -1, -1]  # a repeated id: its last entry
    assert _verify._rows_of(_verify._Table.of_entries([]), np.array([1])).tolist() == [-1]
