"""``birdzarr.subset`` / ``birdzarr subset``: a selection written once as its own store.

The subset holds exactly the windows a ``WindowDataset`` with the same options delivers, in the
source's stored order; its device table passes ``verify``; readers without birdzarr decode it;
the loader streams it (a shuffled source gives a shuffled subset); bad input is one line."""

from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import numpy as np
import pytest
from format2_support import run_without_birdzarr
from s3_support import MotoEndpoint, moto, new_bucket, s3_options  # noqa: F401  (moto is a fixture)

import birdzarr
from birdzarr.cli import main
from birdzarr.demo import _synthetic
from birdzarr.format import _v2

START = 1_337_212_800  # 2012-05-17: the generated bursts span 2012-05-15 to 05-19


@pytest.fixture(scope="module")
def csv_source(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """4 devices' CSV exports, each burst unlabelled (70%) or labelled 0, 1 or 2 (10% each)."""
    root = tmp_path_factory.mktemp("subset_csv")
    for device in _synthetic.device_ids(4).tolist():
        raw = _synthetic.raw_device(device, 200, seed=device)
        bursts = np.flatnonzero(np.diff(raw.time, prepend=raw.time[0] - 1)).tolist() + [len(raw.time)]
        rng = np.random.default_rng(device)
        for a, b in zip(bursts[:-1], bursts[1:], strict=True):
            raw.label[a:b] = rng.choice([-1, 0, 1, 2], p=[0.7, 0.1, 0.1, 0.1])
        _synthetic.write_csv(raw, root / f"{device}_0.csv")
    return root


@pytest.fixture(scope="module")
def stores(csv_source: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, birdzarr.Store]:
    """The CSV source converted with 128-window chunks, shuffled and in device order."""
    root = tmp_path_factory.mktemp("subset_stores")
    return {
        "shuffled": birdzarr.convert(csv_source, root / "shuffled.zarr", shuffle=True, seed=11,
                                     chunk_windows=128, progress=False),
        "device order": birdzarr.convert(csv_source, root / "device.zarr", chunk_windows=128, progress=False),
    }


def _selected(store: birdzarr.Store, **options: Any) -> np.ndarray:
    """Global indices, in stored order, of the windows a WindowDataset with ``options`` draws from."""
    pytest.importorskip("torch")
    ds = birdzarr.WindowDataset(store, allow_device_order=True, progress=False, **options)
    selection = ds.selection
    return np.concatenate([selection.selected_indices(store.reader, c) for c in range(selection.n_chunks)])


def _same_windows(sub: birdzarr.Store, source: birdzarr.Store, idx: np.ndarray) -> None:
    assert len(sub) == len(idx) > 0
    assert np.array_equal(sub.windows[:].view(np.uint32), source.windows[idx].view(np.uint32))
    for view in ("labels", "window_devices", "timestamps"):
        assert np.array_equal(getattr(sub, view)[:], getattr(source, view)[idx]), view


SELECTIONS: dict[str, dict[str, Any]] = {
    "labelled_only": {"labelled_only": True},
    "labels and time": {"labels": [1, 2], "start": START, "stop": START + 86_400},
    "device split": {"split": "train", "val_fraction": 0.5, "split_seed": 3},
    "window split, one label": {"split": "val", "split_by": "window", "labels": [0]},
    "devices": {"devices": [_synthetic.device_ids(4).tolist()[1]], "labelled_only": True},
}


@pytest.mark.parametrize("order", ["shuffled", "device order"])
@pytest.mark.parametrize("name", list(SELECTIONS))
def test_a_subset_holds_the_selected_windows_in_stored_order_and_verifies(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path, order: str, name: str,
) -> None:
    source = stores[order]
    options = SELECTIONS[name]
    idx = _selected(source, **options)
    sub = birdzarr.subset(source, tmp_path / "sub.zarr", progress=False, **options)
    _same_windows(sub, source, idx)
    # the device table, computed from the subset's windows, and verify's checks of it
    result = birdzarr.verify(sub, progress=False)
    assert result.ok, result.format()
    devices, labels, times = source.window_devices[idx], source.labels[idx], source.timestamps[idx]
    assert [e.device_id for e in sub.device_table] == sorted(set(devices.tolist()))
    for entry in sub.device_table:
        mine = devices == entry.device_id
        assert entry.n_windows == int(mine.sum())
        values, counts = np.unique(labels[mine], return_counts=True)
        assert entry.label_counts == dict(zip(values.tolist(), counts.tolist(), strict=True))
        assert (entry.first_time, entry.last_time) == (int(times[mine].min()), int(times[mine].max()))
        assert entry.sources == source.device(entry.device_id).sources
        if order == "shuffled":
            assert entry.ranges == [] and entry.scattered_digest is not None
        else:
            assert entry.scattered_digest is None
            assert sum(r.stop - r.start for r in entry.ranges) == entry.n_windows
    # the layout and the provenance
    assert sub.shuffled == source.shuffled and sub.chunk_windows == source.chunk_windows
    assert sub.root["layout"].get("shuffle_seed") == source.root["layout"].get("shuffle_seed")
    made = sub.root["subset"]
    assert (made["source"], made["source_n_windows"], made["windows"]) == (source.url, len(source), len(idx))
    for key, value in options.items():
        assert made["selection"][key] == value, key


@pytest.mark.parametrize("order", ["shuffled", "device order"])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_subset_of_every_window_has_the_sources_device_table(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path, order: str,
) -> None:
    """Computed again from the copied windows, every entry (counts, times, labels, sources, the
    ranges with their CRC-32C or the scattered digest) is the converter's."""
    source = stores[order]
    sub = birdzarr.subset(source, tmp_path / "all.zarr", progress=False)
    _same_windows(sub, source, np.arange(len(source)))
    assert sub.device_table == source.device_table
    assert sub.root["committed"]["dictionary"] == source.root["committed"]["dictionary"]


def test_a_subset_keeps_only_the_dictionary_rows_its_windows_use(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path,
) -> None:
    source = stores["shuffled"]
    device = _synthetic.device_ids(4).tolist()[2]
    sub = birdzarr.subset(source, tmp_path / "one.zarr", devices=[device], progress=False)
    assert np.array_equal(sub.array_view(_v2.ROW)[:], np.zeros(len(sub), np.uint32))
    assert sub.root["committed"]["dictionary"]["rows"] == 1
    assert np.array_equal(sub.reader.dictionaries().device, [device])
    _same_windows(sub, source, np.flatnonzero(source.window_devices[:] == device))


@pytest.mark.slow
def test_readers_without_birdzarr_decode_a_subset(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path,
) -> None:
    """zarr-python (and TensorStore where installed) open the subset in a process where birdzarr
    cannot be imported; the documented decode gives its windows bit for bit."""
    sub = birdzarr.subset(stores["shuffled"], tmp_path / "sub.zarr", labelled_only=True, progress=False)
    out = tmp_path / "out.npz"
    root = str(sub.location.path)
    lines = [
        "import json, numpy as np, zarr",
        f"z = zarr.open_group({root!r}, mode='r', zarr_format=3)",
        "n = z.attrs['birdzarr']['committed']['n_windows']",
        "start, values = z['dict_start'][:], z['dict_values'][:]",
        "codes, row = z['gimu_codes'][:n], z['gimu_row'][:n]",
        "windows = np.empty((n, 20, 4), np.float32)",
        "windows[:, :, :3] = values[start[row][:, None, :] + codes]",
        "windows[:, :, 3] = z['gps_speed'][:n]",
        "ts_codes = codes",
        "try:",
        "    import tensorstore as ts",
        "except ImportError:",
        "    pass",
        "else:",
        f"    path = {root!r} + '/gimu_codes'",
        "    spec = {'driver': 'zarr3', 'kvstore': {'driver': 'file', 'path': path}}",
        "    ts_codes = ts.open(spec).result()[:n].read().result()",
        f"np.savez({str(out)!r}, windows=windows, same=np.array_equal(ts_codes, codes))",
    ]
    run_without_birdzarr(lines)
    got = np.load(out)
    assert bool(got["same"])
    assert np.array_equal(got["windows"].view(np.uint32), sub.windows[:].view(np.uint32))


def test_the_loader_streams_a_shuffled_subset_without_allow_device_order(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path,
) -> None:
    pytest.importorskip("torch")
    source = stores["shuffled"]
    sub = birdzarr.subset(source, tmp_path / "sub.zarr", labelled_only=True, progress=False)
    ds = birdzarr.WindowDataset(sub, batch_size=64, seed=2, with_ldt=True, progress=False)
    seen = np.concatenate([ldt.numpy() for _, ldt in ds])
    idx = np.flatnonzero(source.labels[:] != -1)
    expected = np.stack([source.labels[idx], source.window_devices[idx], source.timestamps[idx]], axis=1)
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))
    selected = birdzarr.WindowDataset(source, labelled_only=True, progress=False)
    assert ds.label_counts() == selected.label_counts()


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_command_writes_a_subset_and_says_what_it_holds(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str],
) -> None:
    source = stores["shuffled"]
    dest = tmp_path / "sub.zarr"
    code = main(["subset", str(source.location.path), str(dest), "--labels", "1,2", "--start", "2012-05-17",
                 "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    labels, times = source.labels[:], source.timestamps[:]
    idx = np.flatnonzero(np.isin(labels, [1, 2]) & (times >= START))
    assert f"subset: {len(idx):,} of the {len(source):,} windows of {source.url}" in out
    _same_windows(birdzarr.open_store(dest), source, idx)
    # unix seconds work as well as ISO 8601
    assert main(["subset", str(source.location.path), str(tmp_path / "secs.zarr"), "--labels", "1,2",
                 "--start", str(START), "--quiet"]) == 0
    _same_windows(birdzarr.open_store(tmp_path / "secs.zarr"), source, idx)
    # `birdzarr info` on the subset says where its windows came from, not an input report of 0 rows
    assert main(["info", str(dest)]) == 0
    info = capsys.readouterr().out
    assert (f"subset       {len(idx):,} of the {len(source):,} windows of {source.url} (labels=[1, 2], "
            f"start={START}), written in ") in info
    assert "rows read" not in info and "conversion" not in info


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    return lines[-1]


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_command_refuses_bad_input_in_one_line(
    stores: dict[str, birdzarr.Store], csv_source: pathlib.Path, tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = str(stores["shuffled"].location.path)
    dest = tmp_path / "sub.zarr"
    # a bad option value: argparse's line
    with pytest.raises(SystemExit) as exited:
        main(["subset", source, str(dest), "--labels", "one"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "birdzarr subset: error: argument --labels: expected comma-separated integers (1,2,5), got 'one'")
    # an existing store at DEST, without --overwrite
    assert main(["subset", source, str(dest), "--labelled-only", "--quiet"]) == 0
    capsys.readouterr()
    line = _one_line_error(capsys, ["subset", source, str(dest), "--labels", "1", "--quiet"])
    assert line.startswith(f"birdzarr subset: error: {dest} already holds a birdzarr store. Pass --overwrite")
    # a selection of nothing
    line = _one_line_error(capsys, ["subset", source, str(tmp_path / "none.zarr"), "--labels", "7"])
    assert line == (f"birdzarr subset: error: the selection holds no window of {source} (labels=[7]); "
                    "nothing to write. Choose devices the store holds (`birdzarr info --devices`) and "
                    "filters that keep windows")
    assert not (tmp_path / "none.zarr").exists()
    # inside the source
    line = _one_line_error(capsys, ["subset", source, f"{source}/inner", "--labelled-only"])
    assert "sits inside the source" in line
    # a format-1 source (a committed fixture: birdzarr writes format 2 only)
    from tests.format1_support import format1_copy

    v1 = birdzarr.open_store(format1_copy("appended.zarr", tmp_path))
    line = _one_line_error(capsys, ["subset", str(v1.location.path), str(tmp_path / "x.zarr"),
                                    "--labelled-only"])
    assert line.startswith(f"birdzarr subset: error: {v1.url} is a format-1 store, which birdzarr reads "
                           "but no longer writes, so subset cannot copy its windows' codes: write a "
                           "format-2 store from its source with `birdzarr convert ")
    assert line.endswith(" NEW_STORE` and use that one.")
    assert not (tmp_path / "x.zarr").exists()
    # a directory that is not a store
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    line = _one_line_error(capsys, ["subset", source, str(tmp_path / "notes"), "--labelled-only",
                                    "--overwrite"])
    assert "not part of a birdzarr store: 'a.txt'" in line
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"


@pytest.mark.slow
def test_overwrite_replaces_a_subset_and_a_failed_run_leaves_the_previous_one(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path,
) -> None:
    source_copy = tmp_path / "source.zarr"
    shutil.copytree(stores["shuffled"].location.path, source_copy)
    dest = tmp_path / "sub.zarr"
    first = birdzarr.subset(source_copy, dest, labels=[0], progress=False)
    before = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    second = birdzarr.subset(source_copy, dest, labels=[1], overwrite=True, progress=False)
    assert set(second.labels[:].tolist()) == {1} and len(first) != len(second)
    birdzarr.subset(source_copy, dest, labels=[0], overwrite=True, progress=False)
    before = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    # damage a chunk of the source's codes: the run fails while writing, after the selection
    chunk = next(iter(sorted((source_copy / "gimu_codes" / "c").iterdir())))
    shutil.rmtree(chunk)
    with pytest.raises(birdzarr.MissingChunkError):
        birdzarr.subset(source_copy, dest, labelled_only=True, overwrite=True, progress=False)
    after = {p.relative_to(dest): p.read_bytes() for p in dest.rglob("*") if p.is_file()}
    assert after == before
    assert [p.name for p in tmp_path.iterdir() if ".birdzarr-" in p.name] == []
    with pytest.raises(birdzarr.MissingChunkError):
        birdzarr.subset(source_copy, tmp_path / "new.zarr", labelled_only=True, progress=False)
    assert not (tmp_path / "new.zarr").exists()  # nothing half-written is left
    json.loads((dest / "zarr.json").read_text())  # the previous subset is still committed
    assert birdzarr.verify(dest, progress=False).ok


def test_a_subset_is_refused_while_another_writer_holds_the_destination(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path,
) -> None:
    """Another writer's lock at DEST (a conversion, an append, a copy): refused in one line, the
    lock and what is there left alone; once it is released the subset is written."""
    from birdzarr.storage._location import resolve
    from birdzarr.storage._lock import StoreLock

    dest = tmp_path / "sub.zarr"
    holder = StoreLock(resolve(dest), "birdzarr convert elsewhere").acquire()
    with pytest.raises(birdzarr.StoreLockedError, match="'birdzarr convert elsewhere'"):
        birdzarr.subset(stores["shuffled"], dest, labelled_only=True, progress=False)
    assert [p.name for p in dest.iterdir()] == [".birdzarr.lock"]
    holder.release()
    assert len(birdzarr.subset(stores["shuffled"], dest, labelled_only=True, progress=False)) > 0


@pytest.mark.slow
def test_a_subset_is_written_to_and_read_from_s3(
    stores: dict[str, birdzarr.Store], tmp_path: pathlib.Path, moto: MotoEndpoint,  # noqa: F811
) -> None:
    """Through moto's S3 server: a subset written to a bucket, replaced there with overwrite (the
    remote swap), and a subset of that S3 store written back to disk, each equal to the source's
    selected windows and verified."""
    source = stores["shuffled"]
    options = s3_options(moto.url)
    url = f"s3://{new_bucket(moto)}/sub.zarr"
    birdzarr.subset(source, url, labels=[0], storage_options=options, progress=False)
    remote = birdzarr.subset(source, url, labelled_only=True, overwrite=True, storage_options=options,
                             progress=False)
    idx = np.flatnonzero(source.labels[:] != -1)
    _same_windows(remote, source, idx)
    assert birdzarr.verify(url, storage_options=options, progress=False).ok
    back = birdzarr.subset(url, tmp_path / "back.zarr", labels=[2], source_storage_options=options,
                           progress=False)
    _same_windows(back, source, idx[source.labels[idx] == 2])
    assert back.root["subset"]["source"] == url
