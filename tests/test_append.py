"""Append: new devices and new CSV parts go to the end, committed windows never change, readers
see one committed snapshot or the next, and re-running an append adds nothing twice."""

from __future__ import annotations

import json
import pathlib
import shutil
import threading

import numpy as np
import pytest
from format2_support import read_details

import birdzarr
from birdzarr._errors import AppendError, BirdzarrError, IncompleteStoreError
from birdzarr.cli import main
from birdzarr.convert import append
from birdzarr.convert._append import append_detailed
from birdzarr.convert._slabs import SlabWriter
from birdzarr.convert._summary import checksum_hasher
from birdzarr.demo import _synthetic
from birdzarr.maintenance._verify import verify
from birdzarr.store._tail import leftovers

CHUNK = 100  # small and not a divisor of the stores' sizes: appends start inside a chunk


@pytest.fixture(scope="module")
def csv_parts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Four devices in two parts; 'base' holds part 0 of three, 'more' the rest."""
    root = tmp_path_factory.mktemp("append")
    raws = _synthetic.make_csv_dir(root / "all", n_devices=4, bursts_per_device=25, parts=2, seed=11)
    last = max(raws)
    for name in ("base", "more"):
        (root / name).mkdir()
    for path in sorted((root / "all").iterdir()):
        device, part = (int(x) for x in path.stem.split("_"))
        shutil.copy(path, root / ("base" if part == 0 and device != last else "more") / path.name)
    return {"all": root / "all", "base": root / "base", "more": root / "more", "root": root}


def _windows_of(source: pathlib.Path, device: int) -> np.ndarray:
    """The windows a conversion of ``source`` alone gives a device (the independent truth)."""
    from birdzarr.convert._sources import discover
    from birdzarr.format._spec import Curation
    from birdzarr.storage._location import resolve

    _, devices = discover(resolve(source))
    blocks = [b.windows for d in devices if d.device_id == device
              for b in d.blocks(curation=Curation(), on_bad_rows="error")]
    return np.concatenate(blocks) if blocks else np.empty((0, 20, 4), np.float32)


# the per-window arrays of a (default, format-2) store: the chunk file's path below c/<index>
_CHUNK_TAILS = {"gimu_codes": "0/0", "gps_speed": "0", "gimu_row": "", "device": "", "timestamp": "",
                "label": ""}


def _csv_tails(dest: pathlib.Path) -> dict:
    """The unfinished CSV bursts as written on disk: in the committed device table's details."""
    tails: dict = read_details(dest)["csv_tails"]
    return tails


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_append_adds_devices_and_parts_at_the_end(
    csv_parts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "s.zarr"
    base = birdzarr.convert(csv_parts["base"], dest, chunk_windows=CHUNK, progress=False)
    n0 = len(base)
    assert n0 % CHUNK  # the append starts inside the last chunk
    committed_before = {(name, p.name): (p / tail).read_bytes() for name, tail in _CHUNK_TAILS.items()
                        for p in (dest / name / "c").iterdir()}
    old = {e.device_id: base.device_windows(e.device_id) for e in base.device_table}

    result = append_detailed(dest, csv_parts["more"], progress=False)
    store = result.store
    assert store.meta["committed"]["generation"] == 2
    assert result.windows_added == len(store) - n0 > 0
    assert len(result.devices_added) == 1 and len(result.devices_extended) == 3
    # committed windows did not move; full chunks before the append are byte-identical
    assert np.array_equal(store.windows[:n0], base.windows[:n0])
    for index in range(n0 // CHUNK):
        for name, tail in _CHUNK_TAILS.items():
            assert (dest / name / "c" / str(index) / tail).read_bytes() == committed_before[name, str(index)]
    for entry in store.device_table:
        # bursts split between the parts continue: the windows of converting all parts at once
        expected = _windows_of(csv_parts["all"], entry.device_id)
        assert np.array_equal(store.device_windows(entry.device_id)[: len(old.get(entry.device_id, []))],
                              old.get(entry.device_id, np.empty((0, 20, 4), np.float32)))
        assert np.array_equal(store.device_windows(entry.device_id), expected)
        if entry.device_id in old:
            assert len(entry.ranges) == 2 and entry.ranges[1].start >= n0
            assert entry.sources[-1].endswith("_1.csv")
        for r in entry.ranges:  # each range has its own checksum
            hasher = checksum_hasher()
            hasher.update(np.ascontiguousarray(store.windows[r.start:r.stop], dtype="<f4").tobytes())
            assert hasher.hexdigest() == r.checksum
        assert (store.window_devices[entry.ranges[-1].start:entry.ranges[-1].stop] == entry.device_id).all()
    report = store.meta["report"]
    assert report["appends"][0]["first_window"] == n0
    assert sum(d["windows_written"] for d in report["devices"].values()) == len(store)
    assert verify(dest).ok
    assert verify(dest, source=csv_parts["all"]).ok


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_append_is_idempotent(csv_parts: dict[str, pathlib.Path], tmp_path: pathlib.Path) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_parts["base"], dest, chunk_windows=CHUNK, progress=False)
    once = append(dest, csv_parts["more"], progress=False)
    again = append_detailed(dest, csv_parts["more"], progress=False)
    assert again.windows_added == 0 and len(again.skipped_files) == len(list(csv_parts["more"].iterdir()))
    assert again.store.meta["committed"] == once.meta["committed"]
    # the whole export directory: only what is missing is added (here: nothing)
    assert append_detailed(dest, csv_parts["all"], progress=False).windows_added == 0


@pytest.mark.slow
def test_append_refuses_what_it_cannot_do_cleanly(
    csv_parts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_parts["base"], dest, chunk_windows=CHUNK, progress=False)
    before = (dest / "zarr.json").read_bytes()
    parquet = tmp_path / "pq"
    _synthetic.make_parquet_dir(parquet, n_devices=2, total_windows=300, seed=1)
    with pytest.raises(AppendError, match="converted from csv input"):
        append(dest, parquet, progress=False)
    bad = tmp_path / "bad"
    shutil.copytree(csv_parts["more"], bad)  # good new windows are written first, then:
    (bad / "9999_0.csv").write_text("9999,not a time,0,-1,0,0,0,0\n")
    with pytest.raises(BirdzarrError, match="9999_0.csv, line 1"):
        append(dest, bad, progress=False)
    assert (dest / "zarr.json").read_bytes() == before  # nothing committed
    assert not (dest / ".birdzarr.lock").exists()
    store = birdzarr.open_store(dest)
    assert leftovers(store.location, len(store)) == []  # the failed append cleaned up after itself
    assert verify(dest).ok
    # a shuffled store cannot take unshuffled windows at its end
    meta = json.loads(before)
    meta["attributes"]["birdzarr"]["layout"]["shuffled"] = True
    shuffled = tmp_path / "shuffled.zarr"
    shutil.copytree(dest, shuffled)
    (shuffled / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(AppendError, match="--shuffle"):
        append(shuffled, csv_parts["more"], progress=False)
    # an unfinished conversion has nothing to append to
    meta["attributes"]["birdzarr"]["committed"] = None
    (shuffled / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(IncompleteStoreError):
        append(shuffled, csv_parts["more"], progress=False)


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_readers_during_an_append_see_one_committed_snapshot(
    csv_parts: dict[str, pathlib.Path], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / "final.zarr"
    birdzarr.convert(csv_parts["base"], final, chunk_windows=CHUNK, progress=False)
    dest = tmp_path / "live.zarr"
    shutil.copytree(final, dest)
    truth = append(final, csv_parts["more"], progress=False).windows[:]
    n0 = len(birdzarr.open_store(dest))

    original = SlabWriter._write_slab
    passes = threading.Semaphore(0)  # one release per complete read of the store by a reader
    saw_new = threading.Event()

    def overlapped(self: SlabWriter, start: int, stop: int, data: dict[str, np.ndarray]) -> None:
        # each slab is written only after a reader has completed a read while the append is
        # under way (an event, not a sleep): readers overlap the writer at every slab
        assert passes.acquire(timeout=60), "no reader completed a read during the append"
        original(self, start, stop, data)

    monkeypatch.setattr(SlabWriter, "_write_slab", overlapped)
    done = threading.Event()
    seen: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not done.is_set():
                store = birdzarr.open_store(dest)
                n = len(store)
                assert n in (n0, len(truth)), n
                assert sum(e.n_windows for e in store.device_table) == n
                assert np.array_equal(store.windows[:], truth[:n])
                seen.append(n)
                passes.release()
                if n == len(truth):
                    saw_new.set()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            saw_new.set()

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        append(dest, csv_parts["more"], progress=False, workers=1)
        assert saw_new.wait(timeout=60), "no reader opened the new commit"
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]
    assert n0 in seen and len(truth) in seen, sorted(set(seen))
    assert len(seen) >= 4


def test_a_reader_opened_before_an_append_reads_its_own_snapshot_after_the_commit(
    csv_parts: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """A reader opens the root and reads the device table later, when first used: the commit
    keeps the table it replaced, so the reader still gets the snapshot it opened (before, the
    commit removed that table and the reader failed: a race the test above met under load)."""
    more = sorted(csv_parts["more"].iterdir())
    for name, files in (("more_a", more[: len(more) // 2]), ("more_b", more[len(more) // 2 :])):
        (tmp_path / name).mkdir()
        for path in files:
            shutil.copy(path, tmp_path / name / path.name)
    dest = tmp_path / "live.zarr"
    birdzarr.convert(csv_parts["base"], dest, chunk_windows=CHUNK, progress=False)
    expected = birdzarr.open_store(dest)
    before = (expected.device_table, expected.windows[:])
    reader = birdzarr.open_store(dest)  # the root only: nothing of the table read yet
    stale = birdzarr.open_store(dest)
    assert "device_table" not in reader.__dict__
    appended = append(dest, tmp_path / "more_a", progress=False)
    assert len(appended) > len(reader)
    assert reader.device_table == before[0]
    assert np.array_equal(reader.windows[:], before[1])
    assert sorted(p.name for p in (dest / "device_table").iterdir()) == ["1", "2", "zarr.json"]
    assert verify(dest).notes == []  # the replaced table is no leftover
    # a second commit removes the first table: a reader opened before both is told to open again
    append(dest, tmp_path / "more_b", progress=False)
    assert sorted(p.name for p in (dest / "device_table").iterdir()) == ["2", "3", "zarr.json"]
    with pytest.raises(BirdzarrError, match=(
            r"live.zarr: this Store was opened at commit generation 1, and the store has been committed "
            r"since \(now generation 3\), which removed the device table of the commit it opened. Open the "
            r"store again \(birdzarr.open_store\).$")):
        stale.device_table  # noqa: B018


def test_an_append_names_the_files_it_skips_in_a_warning(csv_parts: dict[str, pathlib.Path],
                                                          tmp_path: pathlib.Path) -> None:
    """Files already in the store (by name within their device) are skipped with a word, not
    silently: a new export reusing old file names would otherwise add nothing."""
    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_parts["base"], dest, chunk_windows=CHUNK, progress=False)
    n = len(birdzarr.open_store(dest))
    with pytest.warns(birdzarr.SkippedFilesWarning) as warned:
        store = append(dest, csv_parts["base"], progress=False, workers=1)
    assert len(store) == n
    names = sorted(p.name for p in csv_parts["base"].iterdir())
    message = str(warned[0].message)
    assert message.startswith(f"{len(names)} file(s) skipped, already in the store by name within "
                              "their device: ")
    assert names[0] in message and message.endswith("New data for an existing device needs a new file name.")


@pytest.mark.slow
def test_cli_append_verify_repair(csv_parts: dict[str, pathlib.Path], tmp_path: pathlib.Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "s.zarr"
    birdzarr.convert(csv_parts["base"], dest, chunk_windows=CHUNK, progress=False)
    assert main(["append", str(dest), str(csv_parts["more"]), "--quiet"]) == 0
    assert "appended" in capsys.readouterr().out
    assert main(["append", str(dest), str(csv_parts["more"]), "--quiet"]) == 0
    assert "already in the store" in capsys.readouterr().out
    assert main(["verify", str(dest), "--source", str(csv_parts["all"]), "--quiet"]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["verify", str(dest), "--source", str(csv_parts["base"]), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and any("not in" in p or "does not hold" in p for p in out["problems"])
    assert main(["repair", str(dest)]) == 0
    assert "nothing to repair" in capsys.readouterr().out
    assert main(["append", str(tmp_path / "nowhere.zarr"), str(csv_parts["more"])]) == 2
    assert "no store at" in capsys.readouterr().err


# -- a burst split between a committed part and an appended one -----------------------------------


@pytest.fixture(scope="module")
def seasons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Five labelled devices in four parts cut at arbitrary rows (bursts split between parts):
    season 1 holds parts 0-1 of four devices, season 2 part 2, season 3 part 3 and the fifth
    device; 'all' every file (what converting both seasons at once reads)."""
    root = tmp_path_factory.mktemp("seasons")
    raws = _synthetic.make_csv_dir(root / "all", n_devices=5, bursts_per_device=50, parts=4, seed=23)
    last = max(raws)
    for path in sorted((root / "all").iterdir()):
        device, part = (int(x) for x in path.stem.split("_"))
        season = "s3" if device == last or part == 3 else "s2" if part == 2 else "s1"
        (root / season).mkdir(exist_ok=True)
        shutil.copy(path, root / season / path.name)
    return {name: root / name for name in ("all", "s1", "s2", "s3")}


def _rows_by_device(store: birdzarr.Store) -> dict[int, tuple[np.ndarray, ...]]:
    """Each device's windows (as bits), times, labels and device ids, in store order."""
    found = {}
    for entry in store.device_table:
        index = store.device_indices(entry.device_id)
        found[entry.device_id] = (store.device_windows(entry.device_id).view(np.uint32),
                                  store.timestamps[index], store.labels[index], store.window_devices[index])
    return found


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_append_continues_a_burst_split_between_seasons_as_one_conversion_would(
    seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """convert(s1) + append(s2) + append(s3) == convert(s1 + s2 + s3), window for window; before,
    a burst split between the last committed part and the first appended one lost its remainder."""
    dest = tmp_path / "appended.zarr"
    birdzarr.convert(seasons["s1"], dest, chunk_windows=CHUNK, progress=False)
    tails = _csv_tails(dest)
    assert tails["unknown"] == [] and tails["devices"]  # some device ends inside a burst
    assert all(0 < len(t["labels"]) < 20 for t in tails["devices"].values())  # small and bounded
    second = append_detailed(dest, seasons["s2"], progress=False)
    continued = second.store.meta["report"]["appends"][0]["continued_rows"]  # device -> rows continued
    assert continued and all(n == len(tails["devices"][d]["labels"]) for d, n in continued.items())
    appended = append(dest, seasons["s3"], progress=False)
    whole = birdzarr.convert(seasons["all"], tmp_path / "whole.zarr", chunk_windows=CHUNK, progress=False)
    assert len(appended) == len(whole)
    mine, theirs = _rows_by_device(appended), _rows_by_device(whole)
    assert mine.keys() == theirs.keys()
    for device in theirs:
        for a, b in zip(mine[device], theirs[device], strict=True):
            assert np.array_equal(a, b), device
        # the report counts every row once, as one conversion does
        assert appended.report[device].to_json() == whole.report[device].to_json(), device
    assert appended.meta["csv_tails"] == whole.meta["csv_tails"]
    assert verify(dest, source=seasons["all"]).ok
    # a shuffled conversion of all seasons holds the same windows, times and labels per device
    shuffled = birdzarr.convert(seasons["all"], tmp_path / "shuffled.zarr", chunk_windows=CHUNK,
                                shuffle=True, seed=3, progress=False)
    for device, (bits, times, labels, _) in mine.items():
        index = shuffled.device_indices(device)
        rows = {(w.tobytes(), int(t), int(label)) for w, t, label in zip(bits, times, labels, strict=True)}
        got = {(w.view(np.uint32).tobytes(), int(t), int(label)) for w, t, label in
               zip(shuffled.windows[index], shuffled.timestamps[index], shuffled.labels[index], strict=True)}
        assert len(index) == len(bits) and got == rows, device


@pytest.mark.slow
def test_info_and_the_store_report_each_append(
    csv_parts: dict[str, pathlib.Path], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`info` gave the first conversion's time as the whole store's, and neither it (`--json`)
    nor the Python store showed the appends the report keeps."""
    dest = tmp_path / "s.zarr"
    n0 = len(birdzarr.convert(csv_parts["base"], dest, chunk_windows=CHUNK, progress=False))
    store = append(dest, csv_parts["more"], progress=False)
    (record,) = store.appends
    assert record == store.meta["report"]["appends"][0]
    assert record["first_window"] == n0 and record["windows"] == len(store) - n0
    assert main(["info", str(dest), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["report"]["windows"] == n0  # what the conversion's seconds and CPU figures cover
    (listed,) = info["appends"]
    assert listed["windows"] == len(store) - n0 and listed["seconds"] == record["seconds"]
    files = len(list(csv_parts["more"].iterdir()))
    assert listed["devices_appended"] == 4 and listed["files_appended"] == files
    assert main(["info", str(dest)]) == 0
    text = capsys.readouterr().out
    assert f"s for its {n0:,} windows (" in text
    assert (f"append 1     +{len(store) - n0:,} windows (4 device(s), {listed['files_appended']} file(s)) "
            f"in {record['seconds']:.1f} s, {record['finished_at']}, from {csv_parts['more']}") in text
    fresh = birdzarr.convert(csv_parts["base"], tmp_path / "fresh.zarr", progress=False)
    assert fresh.appends == []
    assert main(["info", str(tmp_path / "fresh.zarr")]) == 0
    assert "append 1" not in capsys.readouterr().out


def test_a_continued_burst_keeps_its_skipped_line(tmp_path: pathlib.Path) -> None:
    """The recorded unfinished burst holds a skipped line's placeholder (NaN values): the window it
    falls in is dropped after the append as in one conversion, and every other value is exact."""
    def lines(when: str, rows: range, bad: int = -1) -> str:
        return "".join(f"5,{when},{i},3,{'abc' if i == bad else f'{0.001 * i:.6f}'},0.500000,-0.250000,"
                       f"{1.25 + 0.01 * i:.6f}\n" for i in rows)

    a, b, c = "2020-05-01 10:00:00", "2020-05-01 10:10:00", "2020-05-01 10:20:00"
    for name in ("all", "s1", "s2"):
        (tmp_path / name).mkdir()
    first = lines(a, range(20)) + lines(b, range(25), bad=22)  # burst b: 5 rows left, one skipped
    second = lines(b, range(25, 40)) + lines(c, range(20))
    for folder, part, text in (("s1", 0, first), ("s2", 1, second)):
        (tmp_path / folder / f"5_{part}.csv").write_text(text)
        (tmp_path / "all" / f"5_{part}.csv").write_text(text)
    dest = tmp_path / "appended.zarr"
    birdzarr.convert(tmp_path / "s1", dest, on_bad_rows="skip", progress=False)
    assert _csv_tails(dest)["devices"]["5"]["bad_rows"] == [2]
    store = append(dest, tmp_path / "s2", on_bad_rows="skip", progress=False)
    whole = birdzarr.convert(tmp_path / "all", tmp_path / "whole.zarr", on_bad_rows="skip", progress=False)
    assert len(store) == len(whole) == 3
    assert np.array_equal(store.windows[:].view(np.uint32), whole.windows[:].view(np.uint32))
    assert store.timestamps[:].tolist() == whole.timestamps[:].tolist()
    assert store.report[5].dropped == whole.report[5].dropped == {"bad_rows": 1}
    assert store.report[5].rows_read == whole.report[5].rows_read == 80
    assert verify(dest, source=tmp_path / "all").ok
