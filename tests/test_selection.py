"""Selections: splits that stay put when the store grows or is re-converted, filters on labels
and burst time on both training paths, label counts and class weights of exactly a selection."""

from __future__ import annotations

import datetime as dt
import pathlib
import shutil
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import birdzarr
from birdzarr.convert import append
from birdzarr.demo import _synthetic
from birdzarr.store._selection import (
    _ranges_mask,
    _selected_below,
    device_in_val,
    split_devices,
    window_in_val,
)

CHUNK = 128


def _indices(ds: birdzarr.WindowDataset) -> np.ndarray:
    """Global indices of every window the dataset delivers this epoch, in delivery order."""
    plan = None if ds.resident is not None else ds.plan()
    return np.concatenate([ds.batch_indices(b, plan) for b in ds.delivery_order()])


def _dataset(store: birdzarr.Store, **options: object) -> birdzarr.WindowDataset:
    options.setdefault("batch_size", 64)
    options.setdefault("allow_device_order", True)
    options.setdefault("progress", False)
    return birdzarr.WindowDataset(store.url, **options)  # type: ignore[arg-type]


def _burst_cut(raw: _synthetic.RawDevice) -> int:
    """A row where a burst starts, about halfway: a season ends there."""
    starts = np.flatnonzero(np.diff(raw.time)) + 1
    return int(starts[len(starts) // 2])


@pytest.fixture(scope="module")
def seasons(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """30 labelled CSV devices: season 1 holds the first half of 20 devices (parts 0 and 1),
    season 2 their second half (parts 2 and 3, later bursts) and 10 new devices; 'all' holds both."""
    root = tmp_path_factory.mktemp("seasons")
    for name in ("s1", "s2", "all"):
        (root / name).mkdir()
    ids = _synthetic.device_ids(30).tolist()
    for n, device in enumerate(ids):
        raw = _synthetic.raw_device(device, 24, seed=1000 + device, labelled=True)
        if n < 20:
            cut = _burst_cut(raw)
            pieces = [("s1", 0, 0, cut // 2), ("s1", 1, cut // 2, cut),
                      ("s2", 2, cut, (cut + len(raw.time)) // 2), ("s2", 3, (cut + len(raw.time)) // 2, None)]
        else:
            pieces = [("s2", 0, 0, len(raw.time) // 3), ("s2", 1, len(raw.time) // 3, None)]
        for season, part, start, stop in pieces:
            _synthetic.write_csv(raw, root / season / f"{device}_{part}.csv", start, stop)
            shutil.copy(root / season / f"{device}_{part}.csv", root / "all")
    return {"s1": root / "s1", "s2": root / "s2", "all": root / "all", "root": root}


def _keys(store: birdzarr.Store) -> list[tuple[int, int, bytes]]:
    """Each window's identity: device, burst time and values (what a re-conversion keeps)."""
    devices, times, windows = store.window_devices[:], store.timestamps[:], store.windows[:]
    return [(int(d), int(t), w.tobytes()) for d, t, w in zip(devices, times, windows, strict=True)]


def _sides(store: birdzarr.Store, **split: object) -> dict[tuple[int, int, bytes], str]:
    """The side of every window of the store under a split."""
    keys = _keys(store)
    out = {}
    for side in ("train", "val"):
        for index in _indices(_dataset(store, shuffle=False, split=side, **split)).tolist():
            assert keys[index] not in out, "a window on both sides, or twice"
            out[keys[index]] = side
    assert len(out) == len(set(keys))  # both sides together: every window
    return out


@pytest.mark.slow
def test_splits_stay_put_when_a_season_is_appended_and_when_reconverted_shuffled(
    seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    first = birdzarr.convert(seasons["s1"], tmp_path / "a.zarr", chunk_windows=CHUNK, progress=False)
    shutil.copytree(tmp_path / "a.zarr", tmp_path / "grown.zarr")
    grown = append(tmp_path / "grown.zarr", seasons["s2"], progress=False)
    shuffled = birdzarr.convert(seasons["all"], tmp_path / "b.zarr", chunk_windows=CHUNK, shuffle=True,
                                seed=3, progress=False)
    old = set(_keys(first))
    assert old <= set(_keys(grown)) and old <= set(_keys(shuffled))
    assert len(grown) == len(shuffled) > len(first)
    for split in ({"split_by": "device", "val_fraction": 0.2, "split_seed": 2},
                  {"split_by": "window", "val_fraction": 0.2, "split_seed": 2}):
        before = _sides(first, **split)
        assert "val" in before.values() and "train" in before.values()
        for later in (grown, shuffled):
            after = _sides(later, **split)
            moved = [key for key, side in before.items() if after[key] != side]
            assert not moved, f"{len(moved)} of {len(before)} windows changed sides ({split})"
        if split["split_by"] == "device":  # whole devices: a bird is on one side only
            by_device: dict[int, set[str]] = {}
            for (device, _, _), side in _sides(shuffled, **split).items():
                by_device.setdefault(device, set()).add(side)
            assert all(len(sides) == 1 for sides in by_device.values())


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_side_is_a_function_of_the_seed_and_the_identity_alone() -> None:
    ids = np.arange(100_000, 140_000)
    in_val = device_in_val(ids, val_fraction=0.2, split_seed=7)
    assert abs(in_val.mean() - 0.2) < 0.01  # the realised fraction over many devices
    # a device's side does not depend on which other devices there are
    train, val = split_devices(ids[::3].tolist(), val_fraction=0.2, split_seed=7)
    assert val == set(ids[::3][in_val[::3]].tolist()) and not train & val
    assert not np.array_equal(in_val, device_in_val(ids, val_fraction=0.2, split_seed=8))
    # windows: 200,000 of 40 devices, by device, time and values
    rng = np.random.default_rng(0)
    windows = rng.normal(size=(200_000, 20, 4)).astype(np.float32)
    devices, times = rng.integers(200, 240, 200_000), rng.integers(0, 2**31, 200_000)
    sides = window_in_val(devices, windows, times, val_fraction=0.1, split_seed=1)
    assert abs(sides.mean() - 0.1) < 0.005
    order = rng.permutation(200_000)  # a re-conversion stores them elsewhere: the same sides
    again = window_in_val(devices[order], windows[order], times[order], val_fraction=0.1, split_seed=1)
    assert np.array_equal(again, sides[order])


def test_a_selection_holds_its_devices_as_sorted_ids_and_lists_them_as_a_set(
    seasons: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    """The selection keeps its devices as one sorted int64 array (no Python set a device: a
    store of 100,000 devices), the device split's side of each; ``selection.devices`` (the
    documented set) is the same devices."""
    store = birdzarr.convert(seasons["s1"], tmp_path / "a.zarr", chunk_windows=CHUNK, progress=False)
    ids = sorted(e.device_id for e in store.device_table)
    train, val = split_devices(ids, val_fraction=0.5, split_seed=3)
    assert train and val
    for side, expected in (("train", train), ("val", val)):
        selection = _dataset(store, split=side, val_fraction=0.5, split_seed=3).selection
        assert selection.device_ids is not None and selection.device_ids.dtype == np.int64
        assert selection.device_ids.tolist() == sorted(expected)
        assert selection.devices == frozenset(expected)
    kept = _dataset(store, devices=[ids[2], np.int64(ids[0]), ids[2]], exclude_devices=[ids[2]]).selection
    assert kept.device_ids is not None and kept.device_ids.tolist() == [ids[0]]
    assert _dataset(store, exclude_devices=[]).selection.device_ids is None  # every device


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_a_split_that_leaves_a_side_without_devices_says_so(seasons: dict[str, pathlib.Path],
                                                             tmp_path: pathlib.Path) -> None:
    store = birdzarr.convert(seasons["s1"], tmp_path / "a.zarr", chunk_windows=CHUNK, progress=False)
    ids = [e.device_id for e in store.device_table][:3]
    seed = next(s for s in range(100) if not split_devices(ids, val_fraction=0.1, split_seed=s)[1])
    with pytest.raises(ValueError, match=rf"^split='val' holds no device: split_seed={seed} with "
                                         r"val_fraction=0\.1 puts none of the 3 device\(s\) in 'val'"):
        _dataset(store, devices=ids, split="val", val_fraction=0.1, split_seed=seed)
    assert len(_indices(_dataset(store, devices=ids, split="train", val_fraction=0.1, split_seed=seed))) == \
        sum(e.n_windows for e in store.device_table if e.device_id in ids)


# -- filters on labels and time ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, birdzarr.Store]:
    """12 CSV devices, 8 labelled (labels 0-9) and 4 not, as a device-ordered and a shuffled store."""
    root = tmp_path_factory.mktemp("labelled")
    (root / "csv").mkdir()
    for n, device in enumerate(_synthetic.device_ids(12).tolist()):
        raw = _synthetic.raw_device(device, 60, seed=500 + device, labelled=n < 8)
        _synthetic.write_csv(raw, root / "csv" / f"{device}_0.csv")
    return {
        "device": birdzarr.convert(root / "csv", root / "d.zarr", chunk_windows=CHUNK, progress=False),
        "shuffled": birdzarr.convert(root / "csv", root / "s.zarr", chunk_windows=CHUNK, shuffle=True, seed=1,
                                     progress=False),
    }


def _middle(store: birdzarr.Store) -> tuple[int, int]:
    times = np.sort(store.timestamps[:])
    return int(times[len(times) // 4]), int(times[3 * len(times) // 4])


@pytest.mark.slow
@pytest.mark.parametrize("resident", [False, "cpu"])
@pytest.mark.parametrize("order", ["device", "shuffled"])
def test_filters_deliver_exactly_the_matching_windows_once(
    labelled: dict[str, birdzarr.Store], order: str, resident: str | bool
) -> None:
    store = labelled[order]
    labels, times, devices = store.labels[:], store.timestamps[:], store.window_devices[:]
    lo, hi = _middle(store)
    train_devices, _ = split_devices(devices.tolist(), val_fraction=0.3, split_seed=1)
    cases: list[tuple[dict[str, object], np.ndarray]] = [
        ({"labelled_only": True}, labels != -1),
        ({"labels": [3, 1]}, np.isin(labels, [1, 3])),
        ({"start": lo, "stop": hi}, (times >= lo) & (times < hi)),
        ({"start": dt.datetime.fromtimestamp(lo, dt.UTC)}, times >= lo),
        ({"stop": np.datetime64(hi, "s").astype(str)}, times < hi),  # ISO 8601, UTC
        ({"time_mask": lambda t: t % 7200 < 3600}, times % 7200 < 3600),
        ({"labelled_only": True, "start": lo, "split": "train", "val_fraction": 0.3, "split_seed": 1},
         (labels != -1) & (times >= lo) & np.isin(devices, list(train_devices))),
    ]
    for options, expected in cases:
        ds = _dataset(store, resident=resident, with_ldt=True, **options)
        got = _indices(ds)
        assert np.array_equal(np.sort(got), np.flatnonzero(expected)), options
        values, counts = np.unique(labels[expected], return_counts=True)
        assert ds.label_counts() == dict(zip(values.tolist(), counts.tolist(), strict=True))
        # what the batches hold: the same windows, their labels and times
        seen = np.concatenate([ldt.numpy() for _, ldt in ds])
        assert len(seen) == expected.sum()
        assert np.array_equal(np.sort(seen[:, 2]), np.sort(times[expected]))
        assert np.array_equal(np.sort(seen[:, 0]), np.sort(labels[expected]))


@pytest.mark.parametrize("resident", [False, "cpu"])
def test_a_filtered_epoch_resumes_exactly_and_a_state_of_other_filters_is_refused(
    labelled: dict[str, birdzarr.Store], resident: str | bool
) -> None:
    store = labelled["shuffled"]
    options = {"labels": [1, 2, 3], "start": _middle(store)[0], "resident": resident, "seed": 4}
    whole = [b.clone() for b in _dataset(store, **options)]
    ds = _dataset(store, **options)
    it = iter(ds)
    for _ in range(3):
        next(it)
    state = ds.state_dict()
    assert state["selection"]["labels"] == [1, 2, 3] and state["selection"]["start"] == options["start"]
    resumed = _dataset(store, **options)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(whole) - 3
    assert all(torch.equal(a, b) for a, b in zip(rest, whole[3:], strict=True))
    with pytest.raises(ValueError, match=r"^cannot resume: the state was saved with labels=\[1, 2, 3\], this "
                                         r"dataset has labels=\[1, 2\]"):
        _dataset(store, **{**options, "labels": [1, 2]}).load_state_dict(state)
    masked = _dataset(store, time_mask=lambda t: t % 2 == 0, resident=resident).state_dict()
    with pytest.raises(ValueError, match="^cannot resume: the state was saved with time_mask="):
        _dataset(store, time_mask=lambda t: t % 2 == 1, resident=resident).load_state_dict(masked)


def test_class_weights_balance_the_selection(labelled: dict[str, birdzarr.Store]) -> None:
    store = labelled["device"]
    ds = _dataset(store, shuffle=False)
    counts = ds.label_counts()
    labels = store.labels[:]
    assert counts == {int(k): int(v) for k, v in zip(*np.unique(labels, return_counts=True), strict=True)}
    assert counts[-1] > 0  # 4 unlabelled devices
    weights = ds.class_weights()
    labelled_counts = {k: v for k, v in counts.items() if k >= 0}
    total = sum(labelled_counts.values())
    assert weights.dtype == torch.float32 and len(weights) == max(labelled_counts) + 1
    for label, n in labelled_counts.items():
        assert weights[label].item() == pytest.approx(total / (len(labelled_counts) * n))
    # every label weighs the same in the loss: weight x count is one constant
    products = [weights[k].item() * n for k, n in labelled_counts.items()]
    assert np.allclose(products, total / len(labelled_counts))
    assert len(ds.class_weights(num_classes=12)) == 12 and ds.class_weights(num_classes=12)[11] == 0
    with pytest.raises(ValueError, match="^num_classes=3 is too small: the selection holds label 9$"):
        ds.class_weights(num_classes=3)
    unlabelled = [e.device_id for e in store.device_table if set(e.label_counts) == {-1}]
    with pytest.raises(ValueError, match="no labelled window"):
        _dataset(store, devices=unlabelled).class_weights()


def test_bad_filters_fail_at_once_with_their_name(labelled: dict[str, birdzarr.Store]) -> None:
    store = labelled["device"]
    cases: list[tuple[dict[str, object], type[Exception], str]] = [
        ({"labels": 3}, TypeError, r"labels is a list of label ids, got 3: write \[3\]"),
        ({"labels": [1.5]}, TypeError, "a label must be an integer, got 1.5"),
        ({"start": 10, "stop": 10}, ValueError, "start must be before stop, got start=10 and stop=10"),
        ({"start": "June"}, ValueError, r"start='June' is not an ISO 8601 time"),
        ({"stop": [1]}, TypeError, "stop must be a datetime, an ISO 8601 string or unix seconds"),
        ({"time_mask": True}, TypeError, "time_mask must be a callable"),
        ({"labelled_only": "yes"}, TypeError, "labelled_only must be True or False"),
        ({"time_mask": lambda t: t[:1] > 0}, ValueError, "time_mask must return a boolean array of"),
        ({"labels": [99]}, ValueError, r"the selection holds no window of .*labels=\(99,\)"),
    ]
    for options, error, message in cases:
        with pytest.raises(error, match=message):
            _dataset(store, **options)


def test_a_selection_costs_a_bit_per_window_and_reading_a_chunk_reads_nothing_more(
    labelled: dict[str, birdzarr.Store],
) -> None:
    store = labelled["shuffled"]
    ds = _dataset(store, labelled_only=True, split="train", split_by="window", with_ldt=False)
    selection = ds.selection
    assert selection.bits is not None and selection.bits.nbytes <= -(-len(store) // 8) + selection.n_chunks
    reader = ds._local().reader
    requests = reader.requests
    for chunk in range(selection.n_chunks):
        selection.chunk_mask(reader, chunk)
    assert reader.requests == requests
    # device filters of a device-ordered store: ranges, no bits, nothing read at all
    plain = _dataset(labelled["device"], devices=[e.device_id for e in labelled["device"].device_table][:2])
    assert plain.selection.bits is None and plain.selection.ranges is not None


def test_range_masks_and_counts_match_a_loop_over_every_range() -> None:
    """Selection.chunk_mask and counts take each chunk's ranges with searchsorted: the same as
    looping over every range (which cost 7.6 s a chunk pass at 100,000 devices)."""
    rng = np.random.default_rng(3)
    cuts = np.sort(rng.choice(np.arange(1, 50_000), 4_000, replace=False))
    runs = np.stack([np.concatenate([[0], cuts]), np.concatenate([cuts, [50_000]])], axis=1)
    ranges = runs[rng.random(len(runs)) < 0.4]
    width = 777
    bounds = np.minimum(np.arange(-(-50_000 // width) + 1) * width, 50_000)
    truth = np.zeros(50_000, dtype=bool)
    for lo, hi in ranges.tolist():
        truth[lo:hi] = True
    for start, stop in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        assert np.array_equal(_ranges_mask(ranges, start, stop), truth[start:stop])
    assert np.array_equal(np.diff(_selected_below(ranges, bounds)),
                          [truth[a:b].sum() for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


@pytest.mark.parametrize("order", ["device", "shuffled"])
def test_stats_of_a_selection_are_those_of_exactly_its_windows(
    labelled: dict[str, birdzarr.Store], order: str
) -> None:
    store = labelled[order]
    options = {"split": "train", "split_by": "window", "labelled_only": True, "val_fraction": 0.3}
    ds = _dataset(store, **options)
    stats = ds.stats()
    values = store.windows[np.sort(_indices(ds))].reshape(-1, 4).astype(np.float64)
    assert stats.n_windows == len(values) // 20 and stats.count == len(values)
    assert np.allclose(stats.mean, values.mean(axis=0), rtol=0, atol=1e-12)
    assert np.allclose(stats.std, values.std(axis=0), rtol=0, atol=1e-12)
    assert np.array_equal(stats.min, values.min(axis=0)) and np.array_equal(stats.max, values.max(axis=0))
    assert ds.stats() is stats  # computed once
    whole = _dataset(store).stats()
    assert not np.allclose(whole.mean, stats.mean, rtol=0, atol=1e-12)  # the validation windows left out
    table = stats.to_dataframe()
    assert list(table.index) == ["imu_x", "imu_y", "imu_z", "gps_speed"]
    assert np.array_equal(table["std"].to_numpy(), stats.std)


def test_a_dataset_with_a_lambda_time_mask_pickles_for_spawned_workers(
    labelled: dict[str, birdzarr.Store],
) -> None:
    """spawn/forkserver workers get the dataset pickled: the selection is already made, so a
    time_mask that does not pickle (a lambda) is not needed there."""
    import pickle

    ds = _dataset(labelled["shuffled"], time_mask=lambda t: t % 7200 < 3600, seed=2)
    copy = pickle.loads(pickle.dumps(ds))
    assert np.array_equal(_indices(copy), _indices(ds))
    assert copy.state_dict() == ds.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(copy, ds, strict=True))


def test_the_split_rule_is_the_one_docs_training_md_writes_out() -> None:
    """docs/training.md#subsets-and-splits, in plain integers, for one device and one window."""
    mask, golden = 2**64 - 1, 0x9E3779B97F4A7C15

    def fmix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    from birdzarr.format._digest import window_hashes

    seed, device, fraction = 7, 263, 0.37
    threshold = int(fraction * 2**64)
    ids = list(range(200, 400))
    device_key = fmix((0xD5E1CE5B117 + seed * golden) & mask)
    expected = [fmix((i * golden + device_key) & mask) < threshold for i in ids]
    assert device_in_val(np.array(ids), val_fraction=fraction, split_seed=seed).tolist() == expected
    rng = np.random.default_rng(1)
    windows = rng.normal(size=(64, 20, 4)).astype(np.float32)
    times = rng.integers(0, 2**31, 64)
    devices = np.full(64, device)
    sides = window_in_val(devices, windows, times, val_fraction=fraction, split_seed=seed)
    key = fmix((device * golden + fmix((0x3A1D0BB117 + seed * golden) & mask)) & mask)
    w = window_hashes(windows, times).tolist()
    assert sides.tolist() == [fmix(key ^ h) < threshold for h in w]
    assert 0 < sides.sum() < 64


@pytest.mark.parametrize("resident", [False, "cpu"])
def test_ranks_share_a_filtered_selection_exactly_once(
    labelled: dict[str, birdzarr.Store], resident: str | bool
) -> None:
    store = labelled["shuffled"]
    labels, times = store.labels[:], store.timestamps[:]
    lo, hi = _middle(store)
    options = {"labels": [0, 2, 5, 7], "start": lo, "stop": hi, "resident": resident, "world_size": 2}
    ranks = [_indices(_dataset(store, rank=rank, **options)) for rank in (0, 1)]
    assert len(ranks[0]) and len(ranks[1])
    expected = np.flatnonzero(np.isin(labels, [0, 2, 5, 7]) & (times >= lo) & (times < hi))
    assert np.array_equal(np.sort(np.concatenate(ranks)), expected)


# -- labels reach the transform (transform_ldt=True) -------------------------------------------------


def _label_aware(x: torch.Tensor, ldt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales each window by its label + 2 and maps labels 0-9 to 10 x label (-1 stays)."""
    scale = (ldt[:, 0] + 2).to(x.dtype).view(-1, 1, 1)
    mapped = ldt.clone()
    mapped[:, 0] = torch.where(ldt[:, 0] >= 0, ldt[:, 0] * 10, ldt[:, 0])
    return x * scale, mapped


def _check_label_aware(store: birdzarr.Store, ds: birdzarr.WindowDataset, batches: Sequence[object],
                       num_workers: int = 0) -> None:
    labels, windows, devices = store.labels[:], store.windows[:], store.window_devices[:]
    assert len(batches) == len(ds)
    plan = None if ds.resident is not None else ds.plan(num_workers=num_workers)
    for number, batch in zip(ds.delivery_order(num_workers), batches, strict=True):
        assert isinstance(batch, tuple)
        x, ldt = batch
        idx = ds.batch_indices(number, plan)
        expected_labels = np.where(labels[idx] >= 0, labels[idx] * 10, labels[idx])
        assert np.array_equal(ldt[:, 0].numpy(), expected_labels)
        assert np.array_equal(ldt[:, 1].numpy(), devices[idx])
        assert np.array_equal(x.numpy(), windows[idx] * (labels[idx] + 2).astype(np.float32)[:, None, None])


@pytest.mark.parametrize("resident", [False, "cpu"])
def test_a_label_aware_transform_gets_and_returns_x_and_ldt(
    labelled: dict[str, birdzarr.Store], resident: str | bool
) -> None:
    store = labelled["shuffled"]
    ds = _dataset(store, resident=resident, with_ldt=True, transform=_label_aware, transform_ldt=True, seed=2)
    _check_label_aware(store, ds, list(ds))
    # the old signature keeps working with with_ldt: transform(x), ldt untouched
    plain = _dataset(store, resident=resident, with_ldt=True, transform=lambda x: x * 3, seed=2)
    x, ldt = next(iter(plain))
    idx = plain.batch_indices(plain.delivery_order()[0])
    assert np.array_equal(x.numpy(), store.windows[idx] * 3)
    assert np.array_equal(ldt[:, 0].numpy(), store.labels[idx])


def test_a_label_aware_transform_on_the_device_gather(labelled: dict[str, birdzarr.Store]) -> None:
    """device_batch (what resident="cuda" yields) applies it too; run here on a CPU copy."""
    from birdzarr.loader._sink import device_batch

    store = labelled["shuffled"]
    ds = _dataset(store, resident="cpu", with_ldt=True, seed=5)
    plan = ds._resident_plan()
    batches = [device_batch(ds.resident, plan, b, False, _label_aware, True) for b in range(len(ds))]
    _check_label_aware(store, ds, batches)
    with pytest.raises(TypeError, match=r"^transform \(transform_ldt=True\) must return a tuple "
                                        r"\(x, ldt\) of two torch.Tensors, got Tensor$"):
        device_batch(ds.resident, plan, 0, False, lambda x, ldt: x, True)


@pytest.mark.parametrize("reuse", [True, False])
@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_label_aware_transform_in_dataloader_workers(
    labelled: dict[str, birdzarr.Store], reuse: bool
) -> None:
    """In a worker the batch is written into a reused shared-memory slot (reuse_batch_memory) or
    new shared tensors; a transform changing ldt's dtype travels by torch's own transport."""
    store = labelled["shuffled"]
    ds = _dataset(store, with_ldt=True, transform=_label_aware, transform_ldt=True, seed=3,
                  reuse_batch_memory=reuse)
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    _check_label_aware(store, ds, [(x.clone(), ldt.clone()) for x, ldt in loader], num_workers=2)
    narrow = _dataset(store, with_ldt=True, transform=lambda x, ldt: (x, ldt[:, 0].to(torch.int32)),
                      transform_ldt=True, seed=3, reuse_batch_memory=reuse)
    got = [(x.clone(), labels.clone()) for x, labels in DataLoader(narrow, batch_size=None, num_workers=1,
                                                                    multiprocessing_context="fork")]
    plan = narrow.plan(num_workers=1)
    for number, (x, labels) in zip(narrow.delivery_order(1), got, strict=True):
        idx = narrow.batch_indices(number, plan)
        assert labels.dtype == torch.int32 and np.array_equal(labels.numpy(), store.labels[idx])
        assert np.array_equal(x.numpy(), store.windows[idx])


@pytest.mark.parametrize("resident", [False, "cpu"])
def test_a_label_aware_transform_that_returns_something_else_is_named(
    labelled: dict[str, birdzarr.Store], resident: str | bool
) -> None:
    store = labelled["shuffled"]
    for wrong, got in ((lambda x, ldt: x, "Tensor"),
                       (lambda x, ldt: (x, ldt.numpy()), r"tuple of \(Tensor, ndarray\)"),
                       (lambda x, ldt: [x, ldt], "list")):
        ds = _dataset(store, resident=resident, with_ldt=True, transform=wrong, transform_ldt=True)
        with pytest.raises(TypeError, match=r"^transform \(transform_ldt=True\) must return a tuple "
                                            rf"\(x, ldt\) of two torch.Tensors, got {got}$"):
            next(iter(ds))
    with pytest.raises(ValueError, match=r"^transform_ldt=True calls transform\(x, ldt\): it needs a "
                                         r"transform and with_ldt=True, got transform=<function .*>, "
                                         r"with_ldt=False$"):
        _dataset(store, transform=_label_aware, transform_ldt=True)
    with pytest.raises(TypeError, match="^transform_ldt must be"):
        _dataset(store, with_ldt=True, transform=_label_aware, transform_ldt=1)


@pytest.mark.parametrize("ids", [
    [0, 3, 4, 90], [7], [], [2, 1 << 22, 1 << 23],  # the last: ids past the table, np.isin's way
])
def test_device_membership_is_np_isin(ids: list[int]) -> None:
    from birdzarr.store._selection import DeviceMembership

    chosen = np.asarray(ids, dtype=np.int64)
    device = np.array([-5, -1, 0, 1, 2, 3, 4, 7, 89, 90, 91, 1000, 1 << 22, 1 << 23, 2**31 - 1],
                      dtype=np.int32)
    assert np.array_equal(DeviceMembership(chosen)(device), np.isin(device, chosen))
