"""RowCoder (birdzarr/format/_rows.py): dictionary rows built block by block, as writers code format 2.
Exact round trips, the same rows whatever the blocks, the overflow and append rules at the exact window."""

from __future__ import annotations

import numpy as np
import pytest

from birdzarr.format import _v2
from birdzarr.format._rows import RowCoder
from tests.test_format2 import assert_exact, calibrated


def decode_all(codes: np.ndarray, rows: np.ndarray, windows: np.ndarray, dictionaries: _v2.Dictionaries
               ) -> np.ndarray:
    _v2.check(codes, rows, dictionaries.start, len(dictionaries.values))
    return _v2.decode_reference(codes, rows, windows[:, :, 3], dictionaries.values, dictionaries.start)


def code_in_blocks(coder: RowCoder, device_windows: list[tuple[int, np.ndarray]], cuts: list[int]
                   ) -> tuple[np.ndarray, np.ndarray]:
    codes, rows = [], []
    for device, windows in device_windows:
        bounds = [0, *[c for c in cuts if 0 < c < len(windows)], len(windows)]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            c, r = coder.code(device, windows[a:b])
            codes.append(c)
            rows.append(r)
        coder.close_device(device)
    return np.concatenate(codes), np.concatenate(rows)


def test_rows_round_trip_and_do_not_depend_on_the_blocks() -> None:
    parts = [(533, calibrated(900, seed=1)), (7, calibrated(40, seed=2)), (298, calibrated(1500, seed=3))]
    windows = np.concatenate([w for _, w in parts])
    one = RowCoder()
    codes1, rows1 = code_in_blocks(one, parts, [])
    cut = RowCoder()
    codes2, rows2 = code_in_blocks(cut, parts, [1, 17, 400, 401, 1000])
    assert np.array_equal(codes1, codes2) and np.array_equal(rows1, rows2)
    d1, d2 = one.new_rows(), cut.new_rows()
    assert np.array_equal(d1.values.view(np.uint32), d2.values.view(np.uint32))
    assert np.array_equal(d1.start, d2.start) and d1.device.tolist() == [533, 7, 298]
    assert_exact(decode_all(codes1, rows1, windows, d1), windows)
    # entries in first-seen order: the first window's first value is code 0 of its row
    assert codes1[0, 0].tolist() == [0, 0, 0]


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_a_row_that_would_pass_65535_entries_closes_at_the_exact_window() -> None:
    rng = np.random.default_rng(0)
    windows = calibrated(5000, seed=4)
    # imu_y holds 20 new distinct values in every window: 65,535 // 20 = 3,276 windows fit a row
    windows[:, :, 1] = rng.permutation(5000 * 20).reshape(5000, 20).astype(np.float32) / 7.0
    for cuts in ([], [3000, 3276, 3277], [100, 4000]):
        coder = RowCoder()
        codes, rows = code_in_blocks(coder, [(11, windows)], cuts)
        assert rows[:3276].tolist() == [0] * 3276 and rows[3276:].tolist() == [1] * (5000 - 3276)
        d = coder.new_rows()
        assert d.device.tolist() == [11, 11] and d.sizes()[0, 1] == 65520
        assert_exact(decode_all(codes, rows, windows, d), windows)


def test_an_append_reuses_the_stored_row_or_adds_one_and_leaves_old_codes_alone() -> None:
    first = calibrated(600, seed=5)
    coder = RowCoder()
    old_codes, old_rows = coder.code(3, first)
    stored = coder.new_rows()
    # the same values again: the stored row serves, nothing is added
    again = RowCoder.appending_to(stored)
    codes, rows = again.code(3, first[::-1].copy())
    assert rows.tolist() == [0] * 600 and again.new_rows().n_rows == 0
    # new values: a new row = the stored entries + the new ones; a new device: a row of its own
    grows = RowCoder.appending_to(stored)
    more = calibrated(300, seed=6)
    codes, rows = grows.code(3, more)
    other_codes, other_rows = grows.code(9, first[:10])
    added = grows.new_rows()
    assert rows.tolist() == [1] * 300 and other_rows.tolist() == [2] * 10
    assert added.device.tolist() == [3, 9] and added.start[0, 0] == len(stored.values)
    total = stored.extend(added)
    row1 = [total.entries(1, c) for c in range(3)]
    for c in range(3):  # the new row starts with the stored row's entries, in their order
        old = stored.entries(0, c)
        assert np.array_equal(row1[c][: len(old)].view(np.uint32), old.view(np.uint32))
    both = np.concatenate([first, more, first[:10]])
    all_codes = np.concatenate([old_codes, codes, other_codes])
    all_rows = np.concatenate([old_rows, rows, other_rows])
    assert_exact(decode_all(all_codes, all_rows, both, total), both)


def test_seeded_rows_and_mixed_blocks_code_each_device_against_its_row() -> None:
    a, b = calibrated(200, seed=7), calibrated(300, seed=8)
    coder = RowCoder()
    for device, w in ((1, a), (2, b)):
        coder.seed(device, [np.unique(w[:, :, c].view(np.uint32)) for c in range(3)])
    mixed = np.concatenate([a, b])
    devices = np.repeat([1, 2], [200, 300])
    order = np.random.default_rng(1).permutation(500)
    codes, rows = coder.code_mixed(devices[order], mixed[order])
    d = coder.new_rows()
    assert d.device.tolist() == [1, 2] and rows.tolist() == (devices[order] - 1).tolist()
    # seeded entries are complete: no row grew
    distinct = [[len(np.unique(w[:, :, c].view(np.uint32))) for c in range(3)] for w in (a, b)]
    assert d.sizes().tolist() == distinct
    assert_exact(decode_all(codes, rows, mixed[order], d), mixed[order])


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_the_seeded_fast_path_codes_as_the_device_by_device_path() -> None:
    """code_mixed's vectorised path (every device seeded with sorted entries) gives the codes and
    rows of coding each device on its own; a value a row lacks, or unsorted seeds, take the
    device-by-device path and still round-trip."""
    parts = {d: calibrated(150 + 10 * d, seed=d) for d in range(1, 7)}
    devices = np.concatenate([np.full(len(w), d) for d, w in parts.items()])
    windows = np.concatenate(list(parts.values()))
    order = np.random.default_rng(2).permutation(len(devices))
    sorted_seeds = {d: [np.unique(w[:, :, c].view(np.uint32)) for c in range(3)] for d, w in parts.items()}
    fast, slow = RowCoder(), RowCoder()
    for d, entries in sorted_seeds.items():
        fast.seed(d, entries)
        slow.seed(d, [e[::-1].copy() for e in entries])  # unsorted: never the fast path
    assert fast._seeded_index() is not None and slow._seeded_index() is None
    codes, rows = fast.code_mixed(devices[order], windows[order])
    slow_codes, slow_rows = slow.code_mixed(devices[order], windows[order])
    assert np.array_equal(rows, slow_rows)
    assert_exact(decode_all(codes, rows, windows[order], fast.new_rows()), windows[order])
    assert_exact(decode_all(slow_codes, slow_rows, windows[order], slow.new_rows()), windows[order])
    # the fast path's codes are positions in the sorted entries: as pandas' look-up gives them
    expected = np.stack([np.searchsorted(sorted_seeds[d][c], windows[order][i, :, c].view(np.uint32))
                         for i, d in enumerate(devices[order].tolist()) for c in range(3)]).reshape(-1, 3, 20)
    assert np.array_equal(codes.transpose(0, 2, 1), expected)
    # a value no row holds: the row grows (device by device) and the windows still round-trip
    extra = windows[order][:5].copy()
    extra[:, 0, 0] = np.float32(7.25)
    more_codes, more_rows = fast.code_mixed(devices[order][:5], extra)
    assert fast._seeded_index() is None  # a grown row is no longer sorted
    assert_exact(decode_all(more_codes, more_rows, extra, fast.new_rows()), extra)


def test_a_first_block_is_coded_as_the_hash_look_up_codes_it() -> None:
    """A device's first block takes the numpy path (no entries yet); the same windows coded
    after a one-window block take the pandas look-up. Both give first-seen entries, so the rows
    are equal and the codes of the shared windows too."""
    windows = calibrated(400, seed=12)
    fresh = RowCoder()
    codes, rows = fresh.code(5, windows)
    looked_up = RowCoder()
    first_codes, _ = looked_up.code(5, windows[:1])
    rest_codes, _ = looked_up.code(5, windows[1:])
    a, b = fresh.new_rows(), looked_up.new_rows()
    assert np.array_equal(a.values.view(np.uint32), b.values.view(np.uint32))
    assert np.array_equal(a.start, b.start)
    assert np.array_equal(codes, np.concatenate([first_codes, rest_codes]))
    assert_exact(decode_all(codes, rows, windows, a), windows)


def per_run(coder: RowCoder, devices: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What code_runs must equal: ``code(device, run)`` for each run of equal consecutive ids."""
    bounds = np.flatnonzero(np.r_[True, devices[1:] != devices[:-1], True])
    coded = [coder.code(int(devices[a]), windows[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return np.concatenate([c for c, _ in coded]), np.concatenate([r for _, r in coded])


def assert_same_coders(a: RowCoder, b: RowCoder) -> None:
    x, y = a.new_rows(), b.new_rows()
    assert np.array_equal(x.values.view(np.uint32), y.values.view(np.uint32))
    assert np.array_equal(x.start, y.start) and np.array_equal(x.device, y.device)
    assert a.n_rows == b.n_rows and sorted(a._open) == sorted(b._open)
    assert all(a._open_row(d).number == b._open_row(d).number for d in a._open)  # type: ignore[union-attr]


@pytest.mark.slow  # over a second of CPU: not in the fast loop
def test_many_devices_coded_at_once_equal_the_device_by_device_coding() -> None:
    """code_runs (a slab of many devices' blocks in one call) gives the codes, rows, row numbers
    and entries of coding each run on its own, wherever the slabs are cut: small devices with
    ids out of order, one device whose imu_y overflows a row (3,276 windows fit) in the middle,
    a device split over two slabs, and a device that comes back later in a slab without being
    closed (its row continues)."""
    rng = np.random.default_rng(3)
    sizes = {40: 12, 3: 30, 17: 1, 9: 4000, 25: 35, 2: 20, 31: 7}
    parts = []
    for seed, (device, size) in enumerate(sizes.items()):
        w = calibrated(size, seed=20 + seed)
        if device == 9:
            w[:, :, 1] = rng.permutation(size * 20).reshape(size, 20).astype(np.float32) / 7.0
        parts.append((device, w))
    parts.append((3, calibrated(5, seed=40)))  # device 3 again, its row still open
    devices = np.concatenate([np.full(len(w), d, np.int64) for d, w in parts])
    windows = np.concatenate([w for _, w in parts])
    reference = RowCoder(first_row=4, first_value=100)
    ref_codes, ref_rows = per_run(reference, devices, windows)
    assert ref_rows.max() - 4 + 1 == reference.n_rows == len(sizes) + 1  # device 9: two rows
    for cuts in ([], [43, 1000, 3500], [1, 2, 3, 44, 3000, 3319, 3320, 4090]):
        bounds = [0, *cuts, len(devices)]
        coder = RowCoder(first_row=4, first_value=100)
        coded = [coder.code_runs(devices[a:b], windows[a:b])
                 for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        assert np.array_equal(np.concatenate([c for c, _ in coded]), ref_codes)
        assert np.array_equal(np.concatenate([r for _, r in coded]), ref_rows)
        assert_same_coders(coder, reference)
    # the decode from the dictionaries gives the windows back (starts count from first_value)
    table = reference.new_rows()
    shifted = _v2.Dictionaries(np.concatenate([np.zeros(100, np.float32), table.values]),
                               np.concatenate([np.zeros((4, 3), np.int64), table.start]),
                               np.concatenate([np.zeros(4, np.int64), table.device]))
    assert_exact(decode_all(ref_codes, ref_rows, windows, shifted), windows)
    assert table.device.tolist() == [40, 3, 17, 9, 9, 25, 2, 31]  # rows in the order they opened


def test_an_append_coded_at_once_equals_the_device_by_device_append() -> None:
    """code_runs after appending_to: a device whose stored row holds every value reuses it, one
    with new values gets a new row (stored entries first), new devices get rows of their own,
    all numbered as device-by-device coding numbers them; closed devices start new rows."""
    first = {5: calibrated(60, seed=50), 8: calibrated(30, seed=51), 1: calibrated(20, seed=52)}
    coder = RowCoder()
    for d, w in first.items():
        coder.code(d, w)
        coder.close_device(d)
    stored = coder.new_rows()
    parts = [(7, calibrated(10, seed=53)), (5, first[5][::-1].copy()), (12, calibrated(25, seed=54)),
             (8, calibrated(15, seed=55)), (1, first[1][:5].copy()), (4, calibrated(3, seed=56))]
    devices = np.concatenate([np.full(len(w), d, np.int64) for d, w in parts])
    windows = np.concatenate([w for _, w in parts])
    reference = RowCoder.appending_to(stored)
    ref_codes, ref_rows = per_run(reference, devices, windows)
    at_once = RowCoder.appending_to(stored)
    codes, rows = at_once.code_runs(devices, windows)
    assert np.array_equal(codes, ref_codes) and np.array_equal(rows, ref_rows)
    assert_same_coders(at_once, reference)
    # stored rows 0-2 (5, 8, 1) serve 5 and 1; new rows 3.. in first-window order: 7, 12, 8, 4
    assert at_once.new_rows().device.tolist() == [7, 12, 8, 4]
    assert rows[devices == 5].tolist() == [0] * 60 and rows[devices == 8].tolist() == [5] * 15
    total = stored.extend(at_once.new_rows())
    assert_exact(decode_all(codes, rows, windows, total), windows)
    # closed devices start new rows, as code does after close_device
    at_once.close_devices(np.array([7, 12]))
    reference.close_device(7)
    reference.close_device(12)
    again = np.repeat([12, 7], [4, 6])
    more = np.concatenate([parts[2][1][:4], parts[0][1][:6]])
    codes, rows = at_once.code_runs(again, more)
    ref_codes, ref_rows = per_run(reference, again, more)
    assert np.array_equal(codes, ref_codes) and np.array_equal(rows, ref_rows)
    assert rows.tolist() == [7] * 4 + [8] * 6
    assert_same_coders(at_once, reference)


@pytest.mark.slow  # over 0.2 s of CPU: not in the fast loop
def test_random_slabs_of_devices_code_as_device_by_device() -> None:
    """Random devices (ids repeated, out of order, some coming back after others), random run
    lengths and random slab cuts, some devices closed between slabs, on a new store and on an
    append: code_runs equals code run by run, window for window and row for row."""
    for seed in range(4):
        rng = np.random.default_rng(100 + seed)
        ids = rng.choice(np.arange(1, 40), size=60)
        runs = [(int(d), calibrated(int(rng.integers(1, 30)), seed=1000 * seed + i))
                for i, d in enumerate(ids)]
        devices = np.concatenate([np.full(len(w), d, np.int64) for d, w in runs])
        windows = np.concatenate([w for _, w in runs])
        stored = None
        if seed % 2:  # an append: some of these devices have stored rows
            first = RowCoder()
            for d in range(1, 40, 3):
                first.code(d, calibrated(8, seed=d) if d % 2 else windows[devices == d][:3])
            stored = first.new_rows()
        cuts = np.sort(rng.choice(np.arange(1, len(devices)), size=5, replace=False))
        bounds = [0, *cuts.tolist(), len(devices)]
        reference = RowCoder() if stored is None else RowCoder.appending_to(stored)
        at_once = RowCoder() if stored is None else RowCoder.appending_to(stored)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            ref_codes, ref_rows = per_run(reference, devices[a:b], windows[a:b])
            codes, rows = at_once.code_runs(devices[a:b], windows[a:b])
            assert np.array_equal(codes, ref_codes) and np.array_equal(rows, ref_rows)
            closed = rng.choice(devices[a:b], size=3)
            at_once.close_devices(closed)
            for d in closed.tolist():
                reference.close_device(d)
        assert_same_coders(at_once, reference)


def test_shared_rows_refuse_device_ids_outside_32_bits() -> None:
    """A (device, row) pair of shared rows is one 64-bit key: a store's device ids (int32, not
    negative) fit; others are refused, not numbered as another device's."""
    coder = RowCoder()
    coder.share([[-1, 3]])
    with pytest.raises(ValueError, match="ids 0 to 2"):
        coder.code_runs(np.array([-1, 3]), calibrated(2, seed=5))
