"""Global seeded pre-shuffle: deterministic, a permutation of the unshuffled store, bounded memory."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import birdzarr
from birdzarr.cli import main
from birdzarr.convert import _shuffle


@pytest.fixture()
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several buckets even on test-sized data, so the two-pass path is really exercised."""
    monkeypatch.setattr(_shuffle, "BUCKET_WINDOWS", 4000)


def _rows(store: birdzarr.Store) -> np.ndarray:
    """One bytes row per window: its values, device, label and time (order-free comparison)."""
    windows = store.windows[:].reshape(len(store), -1).view(np.uint32)
    extra = np.stack([store.window_devices[:], store.labels[:], store.timestamps[:]], axis=1).astype(np.int64)
    return np.concatenate([windows.astype(np.int64), extra], axis=1)


def _sorted_rows(rows: np.ndarray) -> np.ndarray:
    """Rows as opaque byte strings, sorted: equal multisets of rows give equal results."""
    rows = np.ascontiguousarray(rows)
    return np.sort(rows.view(np.dtype((np.void, rows.dtype.itemsize * rows.shape[1]))).ravel())


@pytest.mark.slow
def test_shuffled_store_is_a_seeded_permutation(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
    small_store: birdzarr.Store,
    tmp_path: pathlib.Path,
    small_buckets: None,
) -> None:
    directory, truth = parquet_source
    a = birdzarr.convert(
        directory, tmp_path / "a.zarr", shuffle=True, seed=5, chunk_windows=1024, progress=False
    )
    b = birdzarr.convert(
        directory, tmp_path / "b.zarr", shuffle=True, seed=5, chunk_windows=1024, progress=False
    )
    c = birdzarr.convert(
        directory, tmp_path / "c.zarr", shuffle=True, seed=6, chunk_windows=1024, progress=False
    )
    layout = a.meta["layout"]
    assert layout["shuffled"] is True and layout["shuffle_seed"] == 5 and layout["shuffle_buckets"] > 1
    same = np.array_equal(a.windows[:].view(np.uint32), b.windows[:].view(np.uint32))
    assert same and np.array_equal(a.window_devices[:], b.window_devices[:])
    assert not np.array_equal(a.window_devices[:], c.window_devices[:])
    # every window exactly once: the sorted rows equal the unshuffled store's sorted rows
    ours, plain = _rows(a), _rows(small_store)
    assert len(ours) == len(plain) == 30_000
    assert np.array_equal(_sorted_rows(ours), _sorted_rows(plain))
    assert len(np.unique(_sorted_rows(ours))) == len(ours)
    # every chunk is a uniform sample of all devices (in device order each would hold one or two),
    # its windows grouped by device: one run a device, two where a bucket boundary falls inside
    devices = a.window_devices[:]
    ids, counts = np.unique(devices, return_counts=True)
    for start in range(0, len(devices) - 1024 + 1, 1024):  # the full chunks
        chunk = devices[start : start + 1024]
        share = np.array([(chunk == i).mean() for i in ids])
        assert 0.5 * np.abs(share - counts / counts.sum()).sum() < 0.12  # uniform draws: ~0.04
        assert 1 + int((np.diff(chunk) != 0).sum()) <= 2 * len(np.unique(chunk))
    from birdzarr.format._digest import RowDigest

    def digests(store: birdzarr.Store) -> dict[int, str]:
        """Each device's digest of its rows, fed in store order."""
        ids = store.window_devices[:]
        out = {}
        for device in np.unique(ids).tolist():
            mine, digest = ids == device, RowDigest()
            digest.update(store.windows[:][mine], store.timestamps[:][mine], store.labels[:][mine])
            out[device] = digest.hexdigest()
        return out

    # each device's digest is its rows', whatever their order: the unshuffled store's rows give it
    assert digests(a) == digests(small_store)
    for device, windows in truth.items():
        entry = a.device(device)
        assert entry.n_windows == len(windows) and entry.ranges == []
        assert entry.scattered_digest == digests(small_store)[device]
        assert entry.scattered_checksum is None  # the CRC of earlier versions' shuffled stores
        got = a.device_windows(device)  # stored order: same multiset as the truth
        assert np.array_equal(
            _sorted_rows(got.reshape(len(got), -1)),
            _sorted_rows(windows.reshape(len(windows), -1)),
        )
    assert small_store.device(sorted(truth)[0]).scattered_digest is None


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_shuffle_csv_counts_and_cli(
    tmp_path: pathlib.Path, small_buckets: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from birdzarr.demo import _synthetic

    _synthetic.make_csv_dir(tmp_path / "csv", n_devices=3, bursts_per_device=300, parts=2, seed=2)
    plain = birdzarr.convert(tmp_path / "csv", tmp_path / "plain.zarr", progress=False)
    assert (
        main(
            [
                "convert",
                str(tmp_path / "csv"),
                str(tmp_path / "s.zarr"),
                "--quiet",
                "--shuffle",
                "--seed",
                "9",
                "--shuffle-tmp",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "shuffled True" in capsys.readouterr().out
    store = birdzarr.open_store(tmp_path / "s.zarr")
    assert len(store) == len(plain)
    counts = dict(zip(*np.unique(store.window_devices[:], return_counts=True), strict=True))
    for entry in store.device_table:
        assert counts[entry.device_id] == entry.n_windows == plain.device(entry.device_id).n_windows
        assert entry.label_counts == plain.device(entry.device_id).label_counts
        assert entry.first_time == plain.device(entry.device_id).first_time
    assert store.report == plain.report
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("birdzarr-shuffle-")] == []  # tmp removed


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_layout_defaults_of_each_order(parquet_source, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A shuffled store defaults to 32,768-window chunks, a device-ordered one to 8192-window chunks
    (docs/format.md), and the layout records them."""
    directory, _ = parquet_source
    shuffled = birdzarr.convert(directory, tmp_path / "s.zarr", shuffle=True, seed=1, progress=False)
    ordered = birdzarr.convert(directory, tmp_path / "o.zarr", progress=False)
    for store, chunk in ((shuffled, 32768), (ordered, 8192)):
        layout = store.meta["layout"]
        assert store.format_version == 2 and "codec" not in layout and "compressor" not in layout
        assert (layout["chunk_windows"], store.group["gimu_codes"].chunks[0]) == (chunk, chunk)
    assert np.array_equal(np.sort(shuffled.window_devices[:]), np.sort(ordered.window_devices[:]))


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_second_pass_progress_bar_ends_full(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]],
    tmp_path: pathlib.Path,
    small_buckets: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bar of pass 2 counts the windows written, so a finished shuffle's last line says
    100% of them, not the 0% it was reset to; and every pass-2 line shows its total, never pass
    1's count under pass 2's name."""
    directory, truth = parquet_source
    total = sum(len(w) for w in truth.values())
    assert main(["convert", str(directory), str(tmp_path / "s.zarr"), "--shuffle", "--seed", "2"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "write shuffled" in line]
    assert lines and "100%" in lines[-1] and f"{total / 1000:.1f}k/{total / 1000:.1f}k" in lines[-1]
    assert all(f"/{total / 1000:.1f}k" in line for line in lines), lines


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_each_window_is_hashed_once(
    parquet_source, tmp_path, monkeypatch: pytest.MonkeyPatch, workers: int  # type: ignore[no-untyped-def]
) -> None:
    """The duplicate check and the shuffle's digest share one hash per window (on threads too)."""
    from birdzarr.convert import _blocks

    hashed: list[int] = []
    real = _blocks.window_hashes

    def counting(windows: np.ndarray, timestamps: np.ndarray) -> np.ndarray:
        hashed.append(len(windows))
        return real(windows, timestamps)

    monkeypatch.setattr(_blocks, "window_hashes", counting)
    store = birdzarr.convert(parquet_source[0], tmp_path / "s.zarr", shuffle=True, seed=1, workers=workers,
                             progress=False)  # 30,000 windows: under the worker processes' 64 MB
    assert sum(hashed) == len(store) == 30_000


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_bucket_is_freed_before_the_next_one_loads(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path, small_buckets: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pass 2 holds one permuted bucket at a time: when a bucket loads, nothing refers to the one
    before (the slab writer keeps a copy of its tail, not a view of it), and a format-2 store's
    the store is unchanged."""
    import gc
    import weakref


    loaded: list[weakref.ref[np.ndarray]] = []
    alive_at_load: list[bool] = []
    load = _shuffle.BucketLoader.load

    def watched(self: _shuffle.BucketLoader, bucket: int) -> object:
        gc.collect()
        alive_at_load.append(any(ref() is not None for ref in loaded))
        block = load(self, bucket)
        loaded.append(weakref.ref(block.windows))
        return block

    monkeypatch.setattr(_shuffle.BucketLoader, "load", watched)
    directory, _ = parquet_source
    watched_store = birdzarr.convert(directory, tmp_path / "a.zarr", shuffle=True, seed=3, workers=1,
                                     chunk_windows=1024, progress=False)
    assert len(alive_at_load) > 3 and not any(alive_at_load)
    monkeypatch.setattr(_shuffle.BucketLoader, "load", load)  # the same buckets, unwatched
    plain = birdzarr.convert(directory, tmp_path / "b.zarr", shuffle=True, seed=3, workers=1,
                             chunk_windows=1024, progress=False)
    for name in ("gimu_codes", "gps_speed", "gimu_row", "device", "timestamp", "label", "dict_values"):
        assert np.array_equal(watched_store.group[name][:], plain.group[name][:]), name  # type: ignore[index]


def test_pass_2_copies_only_the_windows_that_outlive_a_bucket() -> None:
    """A bucket at windows [5, 15) of a run whose whole chunks are [8, 40), slabs of 4 from 8:
    [5, 8) (a chunk shared with the run before) and [12, 15) (past the last slab boundary, kept
    by the slab writer) are copies; [8, 12), written as the bucket is added, stays a view."""
    from birdzarr.convert._blocks import WindowBlock
    from birdzarr.convert._shuffle_processes import _pieces
    from birdzarr.format._spec import DeviceReport

    n = 10
    windows = np.arange(n * 80, dtype=np.float32).reshape(n, 20, 4)
    block = WindowBlock(windows, np.arange(n, dtype=np.int64), np.zeros(n, np.int32), DeviceReport(),
                        np.arange(n, dtype=np.int32))
    pieces = list(_pieces(block, 5, (8, 40), 4))
    assert [(at, len(piece)) for at, piece in pieces] == [(5, 3), (8, 4), (12, 3)]
    assert [np.shares_memory(piece.windows, windows) for _, piece in pieces] == [False, True, False]
    assert not np.shares_memory(pieces[2][1].devices, block.devices)  # type: ignore[arg-type]
    assert np.array_equal(np.concatenate([piece.windows for _, piece in pieces]), windows)
    assert np.array_equal(np.concatenate([piece.timestamps for _, piece in pieces]), block.timestamps)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_device_past_a_rows_entries_among_devices_read_together_is_shuffled_as_alone(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, small_buckets: None, workers: int
) -> None:
    """Small devices of partition files read together, one of them with more distinct values in a
    channel than a dictionary row holds (its run's codes are uint32, its rows open in pass 2, and
    pass 2 leaves the coding to the writer): the store is byte-identical to spilling each device
    alone, and holds the input's windows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zarr

    from birdzarr.convert import _segments, _shuffle_processes
    from birdzarr.demo import _synthetic
    from birdzarr.format import _v2
    from tests.store_files import assert_same_store

    rng = np.random.default_rng(4)
    sizes = rng.integers(1, 12, size=90)
    sizes[40] = 3400  # 68,000 distinct imu_x values: more than a row holds
    ids = np.arange(90) * 2 + 1
    owner = np.repeat(ids, sizes)
    windows = _synthetic.curated_windows(len(owner), seed=4)
    big = np.flatnonzero(owner == ids[40])
    windows[big, :, 0] = (np.arange(len(big) * 20, dtype=np.float32) / 70_000 - 0.5).reshape(-1, 20)
    source = tmp_path / "parts"
    source.mkdir()
    for number, rows in enumerate(np.array_split(np.arange(len(owner)), 3)):
        flat = pa.array(windows[rows].reshape(-1), type=pa.float32())
        gimu = pa.ListArray.from_arrays(pa.array(np.arange(0, len(flat) + 1, 80, dtype=np.int32)), flat)
        pq.write_table(pa.table({"device_id": pa.array(owner[rows], pa.int32()), "gimu": gimu}),
                       source / f"part-{number}.parquet")
    options = {"chunk_windows": 512, "shuffle": True, "seed": 9, "workers": workers, "progress": False}
    with monkeypatch.context() as patch:
        patch.setattr(_segments, "RUN_WINDOWS", 0)
        alone = birdzarr.convert(str(source), str(tmp_path / "alone.zarr"), **options)
    monkeypatch.setattr(_segments, "RUN_WINDOWS", 4000)  # the large device in a run of others
    read_runs, runs = _shuffle_processes.read_runs, []

    def watched(devices: list) -> object:
        found = read_runs(devices)
        runs.append([d for d, _ in devices] if found is not None else [])
        return found

    monkeypatch.setattr(_shuffle_processes, "read_runs", watched)
    together = birdzarr.convert(str(source), str(tmp_path / "together.zarr"), **options)
    assert_same_store(tmp_path / "alone.zarr", tmp_path / "together.zarr")
    assert alone.meta["layout"]["shuffle_buckets"] > 1
    assert any(ids[40] in run and len(run) > 1 for run in runs)
    rows = zarr.open_array(str(tmp_path / "together.zarr" / _v2.DEVICE), mode="r")[:]
    assert len(rows) == len(ids) + 1 and (rows == ids[40]).sum() == 2  # the large device's two rows
    stored = _rows(together)[:, :81]  # values and device
    expected = np.concatenate([windows.reshape(len(owner), -1).view(np.uint32).astype(np.int64),
                               owner[:, None].astype(np.int64)], axis=1)
    assert np.array_equal(_sorted_rows(stored), _sorted_rows(expected))


def test_buckets_are_drawn_by_window_number_whatever_the_cut() -> None:
    """``draw_buckets`` is a pure function of (seed, device, the window's number in its device):
    drawing a device's windows in blocks (a device read alone), or many devices at once (a run of
    small devices), gives the same buckets; they are uniform and the seed changes them. The
    values are pinned: they are the store's layout for a seed."""
    draw = _shuffle.draw_buckets
    together = draw(1, np.array([5, 7]), np.array([10, 3]), 0, 8)
    blocks = np.concatenate([draw(1, np.array([5]), np.array([4]), 0, 8),
                             draw(1, np.array([5]), np.array([6]), 4, 8),
                             draw(1, np.array([7]), np.array([3]), 0, 8)])
    assert together.tolist() == blocks.tolist() == [5, 3, 5, 2, 0, 2, 7, 0, 3, 1, 5, 2, 3]
    assert draw(1, np.array([7]), np.array([2]), np.array([1]), 8).tolist() == [2, 3]
    assert draw(2, np.array([5, 7]), np.array([10, 3]), 0, 8).tolist() != together.tolist()
    many = draw(3, np.arange(20_000), np.full(20_000, 10), 0, 40)
    counts = np.bincount(many, minlength=40)
    assert len(counts) == 40 and abs(counts - 5000).max() < 5 * np.sqrt(5000)
    assert draw(3, np.array([], np.int64), np.array([], np.int64), 0, 40).tolist() == []


def test_pass_ones_dictionaries_are_joined_once_each_run_freed_as_copied() -> None:
    """``DeviceValues.joined(consume=True)`` (pass 1's dictionaries of many runs) empties the
    list it is given, so each run's arrays are freed once copied, and joins exactly as without."""
    from birdzarr.convert._device_coder import DeviceValues

    rng = np.random.default_rng(3)

    def part(ids: list[int]) -> DeviceValues:
        values = [(i, [rng.integers(0, 99, rng.integers(0, 6)).astype(np.uint32) for _ in range(4)])
                  for i in ids]
        return DeviceValues.of_devices(values, 4)

    parts = [part([1, 2, 3]), part([]), part([8]), part([4, 5])]
    kept = DeviceValues.joined(list(parts), 4)
    given = list(parts)
    joined = DeviceValues.joined(given, 4, consume=True)
    assert given == []
    assert joined.ids.tolist() == kept.ids.tolist() == [1, 2, 3, 4, 5, 8]
    for c in range(4):
        assert joined.values[c].tolist() == kept.values[c].tolist()
        assert joined.starts[c].tolist() == kept.starts[c].tolist()
        for k, device in enumerate(joined.ids.tolist()):
            owner = next(p for p in parts if device in p.ids.tolist())
            assert joined.of(k)[c].tolist() == owner.of(owner.index(device))[c].tolist()
    single = [parts[0]]
    assert DeviceValues.joined(single, 4, consume=True) is parts[0] and single == []


@pytest.mark.parametrize("workers", [1, 2])
def test_pass_two_in_this_process_shares_the_plan_without_writing_it(
    parquet_source: tuple[pathlib.Path, dict[int, np.ndarray]], tmp_path: pathlib.Path, small_buckets: None,
    monkeypatch: pytest.MonkeyPatch, workers: int,
) -> None:
    """Pass 2's tasks in this process (this thread; threads, under the worker processes' 64 MB)
    read the plan the conversion holds (every device seeded: read only): no ``pass2.pickle``
    is written and read back (336 MB at 100,000 devices of 10 windows). The store is the one
    the same seed gives on any engine (test_convert_parallel), and the plan is let go after."""
    import os

    from birdzarr.convert import _shuffle_processes

    seen: list[tuple[bool, bool]] = []
    run = _shuffle_processes.write_bucket_run

    def watched(plan_path: str, *args: object, **kwargs: object) -> object:
        seen.append((os.path.exists(plan_path), plan_path in _shuffle_processes._PLANS))
        return run(plan_path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_shuffle_processes, "write_bucket_run", watched)
    store = birdzarr.convert(parquet_source[0], tmp_path / "s.zarr", shuffle=True, seed=1, workers=workers,
                             chunk_windows=1024, progress=False)
    assert len(store) == 30_000 and store.meta["layout"]["shuffle_buckets"] > 1
    assert seen and set(seen) == {(False, True)}
    assert _shuffle_processes._PLANS == {}


def test_rows_are_seeded_with_each_groups_sorted_union_also_where_a_channel_is_empty() -> None:
    """``seed_rows``: consecutive small devices share one row, seeded with the sorted union of
    their values a channel, and each pass-1 code (a device's sorted dictionary) maps to its
    value's place in that union; a channel without values in a whole batch of rows is seeded
    empty (it used to fail)."""
    from birdzarr.convert._device_coder import DeviceValues
    from birdzarr.format._rows import RowCoder

    u = lambda *v: np.array(v, np.uint32)  # noqa: E731
    dictionaries = DeviceValues.of_devices([(1, [u(), u(5, 9), u(7), u(1)]),
                                            (2, [u(), u(2, 9), u(3, 7), u(1)])], 4)
    coder = RowCoder()
    seeded = _shuffle.seed_rows(coder, dictionaries, [1, 1])
    assert seeded.left_out == []
    assert [c.tolist() for c in seeded.row_codes] == [[], [1, 2, 0, 2], [1, 0, 1]]
    rows = coder.new_rows()
    assert rows.device.tolist() == [1, 2]  # one row each, both starting at the group's entries
    values = rows.values.view(np.uint32)
    assert rows.start[0].tolist() == rows.start[1].tolist()
    ends = [*rows.start[0][1:].tolist(), len(values)]
    entries = [values[a:b].tolist() for a, b in zip(rows.start[0].tolist(), ends, strict=True)]
    assert entries == [[], [2, 5, 9], [3, 7]]


def test_rows_are_seeded_from_parts_of_several_devices_a_whole_sorted_part_as_it_is() -> None:
    """``seed_rows`` of pass 1's parts (``Spiller.runs``: a row's devices that a run holds, coded
    into one sorted dictionary under the first one's id): a row that is one sorted part is
    seeded with its entries as they are and keeps its codes (a channel where every row is:
    ``row_codes`` None); a row of several parts, or of a device coded alone (entries in first-seen
    order), is seeded with the sorted union and its codes mapped; a part across two rows is
    refused."""
    from birdzarr.convert._device_coder import DeviceValues
    from birdzarr.format import _rows
    from birdzarr.format._rows import RowCoder

    u = lambda *v: np.array(v, np.uint32)  # noqa: E731
    # devices 1-3: one row, one part; 4-5: one row, two parts (4, 5); 6: alone, first-seen order
    parts = DeviceValues.of_devices([(1, [u(2, 4, 8), u(1), u(3), u(0)]),
                                     (4, [u(5, 9), u(1, 2), u(3), u(0)]),
                                     (5, [u(7, 9), u(2), u(3), u(0)]),
                                     (6, [u(6, 3), u(4), u(5), u(0)])], 4)
    devices = np.array([1, 2, 3, 4, 5, 6], np.int64)
    with pytest.raises(RuntimeError, match="two dictionary rows"):  # 3 opens a row: part 1 is in two
        _shuffle.seed_rows(RowCoder(), parts, [5, 5, _rows.SHARED_ROW_WINDOWS - 8, 5, 5, 5], devices)
    counts = [5, 5, 5, 985, 5, _rows.SHARED_ROW_WINDOWS + 1]
    assert _rows.shared_groups(devices.tolist(), counts) == [[1, 2, 3, 4, 5]]
    coder = RowCoder()
    seeded = _shuffle.seed_rows(coder, parts, counts, devices)
    assert seeded.left_out == []
    assert _entries(coder.new_rows()) == {1: [[2, 4, 5, 7, 8, 9], [1, 2], [3]], 6: [[3, 6], [4], [5]]}
    codes = [None if c is None else c.tolist() for c in seeded.row_codes]
    assert codes == [[0, 1, 4, 2, 5, 3, 5, 1, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0]]
    # one row, one sorted part: its entries and codes as they are
    coder = RowCoder()
    seeded = _shuffle.seed_rows(coder, DeviceValues.of_devices([(1, [u(2, 4, 8), u(1), u(), u(0)])], 4),
                                [5, 5, 5], devices[:3])
    assert seeded.row_codes == [None, None, None]
    assert _entries(coder.new_rows()) == {1: [[2, 4, 8], [1], []]}


def _entries(rows: object) -> dict[int, list[list[int]]]:
    """Each distinct dictionary row's entries a coded channel, under the first device whose row
    starts there (devices of a group share one)."""
    values = rows.values.view(np.uint32)  # type: ignore[attr-defined]
    start = rows.start  # type: ignore[attr-defined]
    ends = start + rows.sizes()  # type: ignore[attr-defined]
    out: dict[int, list[list[int]]] = {}
    for device, a, b in zip(rows.device.tolist(), start.tolist(), ends.tolist(), strict=True):  # type: ignore[attr-defined]
        found = [values[x:y].tolist() for x, y in zip(a, b, strict=True)]
        if found not in out.values():
            out[device] = found
    return out


def test_pass_ones_dictionaries_grow_in_place_as_runs_are_added() -> None:
    """``DeviceValuesBuilder`` (the spiller's dictionaries, run after run) gives what joining the
    runs' dictionaries gives, in arrays of its own sized to their entries, and starts empty again
    once it has handed them over."""
    from birdzarr.convert._device_coder import DeviceValues, DeviceValuesBuilder

    rng = np.random.default_rng(5)

    def part(ids: list[int]) -> DeviceValues:
        values = [(i, [rng.integers(0, 99, rng.integers(0, 3000)).astype(np.uint32) for _ in range(4)])
                  for i in ids]
        return DeviceValues.of_devices(values, 4)

    parts = [part([1, 2, 3]), part([]), part([5]), part(list(range(10, 60))), part([70])]
    builder = DeviceValuesBuilder(4)
    for p in parts:
        builder.add(p)
    built, joined = builder.finish(), DeviceValues.joined(parts, 4)
    assert built.ids.tolist() == joined.ids.tolist()
    for c in range(4):
        assert built.values[c].tolist() == joined.values[c].tolist()
        assert built.starts[c].tolist() == joined.starts[c].tolist()
        assert built.values[c].flags.owndata and len(built.values[c]) == built.starts[c][-1]
    again = builder.finish()
    assert len(again.ids) == 0 and all(len(v) == 0 for v in again.values)


@pytest.mark.parametrize("rows", [[3, 0, 5, 1], [70_000, 2], [1] * 70_000])
def test_seed_rows_ranks_each_rows_entries_among_its_distinct_values(rows: list[int]) -> None:
    """``_row_ranks`` (seed_rows' sorted factorisation of a batch of rows): each entry's rank among
    its row's distinct values, and the rows' distinct values in order, whether the keys and their
    places fit one packed sort (few rows) or not (70,000 rows: a stable argsort)."""
    rng = np.random.default_rng(7)
    row_len = np.array(rows, np.int64)
    values = rng.integers(0, 50, int(row_len.sum())).astype(np.uint32)
    rank, entries, before = _shuffle._row_ranks(values, row_len)
    bounds = np.concatenate([[0], np.cumsum(row_len)])
    expected_entries, expected_rank = [], []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        distinct, inverse = np.unique(values[a:b], return_inverse=True)
        expected_entries.append(distinct)
        expected_rank.append(inverse.reshape(-1))
    assert rank.tolist() == np.concatenate(expected_rank).tolist()
    assert entries.tolist() == np.concatenate(expected_entries).tolist()
    sizes = np.array([len(e) for e in expected_entries], np.int64)
    assert before.tolist() == (np.cumsum(sizes) - sizes).tolist()


@pytest.mark.parametrize("devices,windows,values", [(40, 30, 10), (9000, 5, 2**32 - 1), (1, 1, 1), (0, 0, 1)])
def test_run_codes_keys_are_ranked_as_a_sorted_factorisation(devices: int, windows: int, values: int) -> None:
    """``_device_coder._sorted_codes`` (run_codes' sort of (device, value) keys) gives
    ``pd.factorize(keys, sort=True)``'s codes and distinct keys, whether the keys and their
    places fit one packed sort (few devices) or not (a stable argsort: 9,000 devices)."""
    import pandas as pd

    from birdzarr.convert._device_coder import _sorted_codes

    rng = np.random.default_rng(11)
    counts = rng.integers(0, windows + 1, devices)
    run = np.repeat(np.arange(devices, dtype=np.uint64), counts)
    keys = (run[:, None] << np.uint64(32)) | rng.integers(0, values, (len(run), 20), dtype=np.uint64)
    codes, distinct = _sorted_codes(keys.reshape(-1))
    expected, expected_distinct = pd.factorize(keys.reshape(-1), sort=True)
    assert codes.tolist() == expected.tolist()
    assert distinct.tolist() == np.asarray(expected_distinct, np.uint64).tolist()
