"""Resident mode merges a version-2 store's held dictionary rows into groups (``held_dictionaries``,
``share_rows``): rows that share values share one union a channel, their codes recoded into it,
and every window decodes to the store's values, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from birdzarr.format import _v2
from birdzarr.loader._resident import CODE_BIAS, HeldCodes, held_dictionaries
from birdzarr.loader._shared_dictionaries import share_rows

# Bit patterns that only a bit-pattern union keeps apart: 0.0 and -0.0, two NaN payloads
_SPECIAL = np.array([0x00000000, 0x80000000, 0x7FC00123, 0xFFC00001], np.uint32)


def _store(rows: list[list[np.ndarray]], windows_a_row: int, seed: int = 0
           ) -> tuple[_v2.Dictionaries, np.ndarray, np.ndarray, np.ndarray]:
    """Dictionary arrays of ``rows`` (uint32 entries per channel, row after row) and
    ``windows_a_row`` windows a row, their codes drawn over each row's entries (every entry
    used at least once where the windows allow): ``(dictionaries, codes, row, gps)``."""
    rng = np.random.default_rng(seed)
    sizes = np.array([[len(e) for e in channels] for channels in rows], np.int64)
    start = (np.cumsum(sizes.reshape(-1)) - sizes.reshape(-1)).reshape(sizes.shape)
    values = np.concatenate([e for channels in rows for e in channels]).view(np.float32)
    dictionaries = _v2.Dictionaries(values, start, np.arange(len(rows), dtype=np.int64))
    row = np.repeat(np.arange(len(rows), dtype=np.uint32), windows_a_row)
    codes = np.empty((len(row), _v2.WINDOW_LENGTH, _v2.N_CODED), np.uint16)
    for r in range(len(rows)):
        for c in range(_v2.N_CODED):
            drawn = np.resize(rng.permutation(sizes[r, c]), windows_a_row * _v2.WINDOW_LENGTH)
            codes[row == r, :, c] = drawn.reshape(windows_a_row, _v2.WINDOW_LENGTH)
    return dictionaries, codes, row, rng.standard_normal(len(row)).astype(np.float32)


def _held(dictionaries: _v2.Dictionaries, codes: np.ndarray, row: np.ndarray, gps: np.ndarray) -> HeldCodes:
    """What ``_load_format2_once`` holds for these windows (the host layout, merged rows)."""
    packed, held_codes, held_gps, held_row = HeldCodes.host_layout(len(row), True, shared=False)
    np.bitwise_xor(codes, np.uint16(CODE_BIAS), out=held_codes.numpy().view(np.uint16))
    held_row.numpy()[:] = row
    held_gps.numpy()[:] = gps
    values, offsets = held_dictionaries(dictionaries, held_row.numpy(), held_codes.numpy(), threads=2)
    return HeldCodes(held_codes, held_gps, held_row, torch.from_numpy(values), torch.from_numpy(offsets),
                     packed)


def _decodes_as_stored(held: HeldCodes, dictionaries: _v2.Dictionaries, codes: np.ndarray, row: np.ndarray,
                       gps: np.ndarray) -> None:
    """Every window, decoded on the host and by the torch ops, equals the store's decode bit for bit."""
    expected = _v2.decode_reference(codes.astype(np.int64), row.astype(np.int64), gps[:, None],
                                    dictionaries.values, dictionaries.start).view(np.uint32)
    every = np.arange(len(row))
    assert np.array_equal(held.decode_host(every).view(np.uint32), expected)
    assert np.array_equal(held.decode(torch.from_numpy(every)).numpy().view(np.uint32), expected)


def _bits(low: int, count: int) -> np.ndarray:
    """``count`` distinct positive float32 bit patterns from ``low`` on."""
    return np.arange(0x3F800000 + low, 0x3F800000 + low + count, dtype=np.uint32)


def test_rows_that_share_values_hold_one_union_and_decode_as_stored() -> None:
    """Four rows cut from one calibrated sequence of 3,000 values a channel (each holding 2,500
    of them, in its own order, with -0.0, 0.0 and two NaN payloads) merge into one union a
    channel of the 3,000 + 4 values (the first row's entries in their order, then the others'
    new ones by bit pattern): 9,012 entries held instead of 30,048, one held row (one row of
    offsets for every window to gather); the first row's codes stay, and every window decodes
    to the stored values."""
    rng = np.random.default_rng(1)
    sequence = [rng.permutation(_bits(10_000 * c, 3_000)) for c in range(3)]
    rows = [[rng.permutation(np.concatenate([np.roll(sequence[c], -500 * r)[:2_500], _SPECIAL]))
             for c in range(3)] for r in range(4)]
    dictionaries, codes, row, gps = _store(rows, windows_a_row=150)
    held = _held(dictionaries, codes, row, gps)
    unions = [np.unique(np.concatenate([r[c] for r in rows])) for c in range(3)]
    assert held.values.numel() == sum(len(u) for u in unions) == 9_012
    first_then_new = [np.concatenate([rows[0][c], np.setdiff1d(unions[c], rows[0][c])]) for c in range(3)]
    assert np.array_equal(held.values.numpy().view(np.uint32), np.concatenate(first_then_new))
    assert held.start.tolist() == [[0, 3_004, 6_008]]  # one group: one held row, every window's
    assert not held.row.numpy().any()
    first = row == 0
    assert np.array_equal(held.codes.numpy()[first].view(np.uint16) ^ np.uint16(CODE_BIAS), codes[first])
    _decodes_as_stored(held, dictionaries, codes, row, gps)


def test_rows_that_share_nothing_are_held_as_stored() -> None:
    """Rows with no value in common (devices calibrated one by one) are not merged: the held
    entries are the store's, in its order, and the codes are not touched."""
    rows = [[_bits(100_000 * r + 10_000 * c, 2_500 + r) for c in range(3)] for r in range(4)]
    dictionaries, codes, row, gps = _store(rows, windows_a_row=150)
    held = _held(dictionaries, codes, row, gps)
    assert np.array_equal(held.values.numpy().view(np.uint32), dictionaries.values.view(np.uint32))
    assert np.array_equal(held.start.numpy(), dictionaries.start)
    assert np.array_equal(held.codes.numpy().view(np.uint16) ^ np.uint16(CODE_BIAS), codes)
    _decodes_as_stored(held, dictionaries, codes, row, gps)


def test_a_group_closes_before_its_union_passes_65535_entries() -> None:
    """Channel 0 of row 0 holds 40,000 values; row 1 holds 30,000 of them and ``new`` more:
    with 25,535 new ones the union holds 65,535 entries and the rows merge; with 25,536 it would
    pass that, so row 1 opens a group of its own (and its codes stay as they are). Row 2 shares
    row 1's values and joins whichever group row 1 is in (its codes change)."""
    for new, groups in ((25_535, 1), (25_536, 2)):
        shared_part = _bits(0, 30_000)
        row0 = [_bits(0, 40_000), _bits(100_000, 50), _bits(200_000, 50)]
        row1 = [np.concatenate([_bits(50_000, new), shared_part[::-1]]), row0[1][::-1], row0[2]]
        rows = [row0, row1, [row1[0][:20_000], row0[1], row0[2]]]
        sizes = np.array([len(e) for r in rows for e in r])
        start = (np.cumsum(sizes) - sizes).reshape(3, 3)
        merged = share_rows(np.concatenate([e for r in rows for e in r]).view(np.float32), start,
                            sizes.reshape(3, 3), _v2.MAX_ENTRIES)
        assert merged is not None and merged.groups == groups
        union0 = merged.values[merged.start[1, 0] : merged.start[1, 1]]
        assert len(union0) == (65_535 if groups == 1 else 30_000 + new)
        assert merged.recoded.tolist() == ([False, True, True] if groups == 1 else [False, False, True])
        dictionaries, codes, row, gps = _store(rows, windows_a_row=2_000, seed=groups)
        _decodes_as_stored(_held(dictionaries, codes, row, gps), dictionaries, codes, row, gps)


def test_rows_sharing_entries_count_once_and_other_sharing_is_held_as_stored() -> None:
    """Consecutive rows that start at the same entries (small devices sharing a row) are one row
    of the group; entries shared any other way (no birdzarr writer does that) leave the
    dictionaries as stored. Both decode as stored."""
    rng = np.random.default_rng(3)
    base = [rng.permutation(_bits(10_000 * c, 3_000)) for c in range(3)]
    values = np.concatenate([*(b[:2_600] for b in base), *(b[400:] for b in base)]).view(np.float32)
    first, second = [0, 2_600, 5_200], [7_800, 10_400, 13_000]
    for starts, merged_groups in (([first, first, second, second], 1), ([first, second, first], None)):
        start = np.array(starts, np.int64)
        dictionaries = _v2.Dictionaries(values, start, np.arange(len(start), dtype=np.int64))
        merged = share_rows(values, start, _v2.entry_counts(start, len(values)), _v2.MAX_ENTRIES)
        if merged_groups is None:
            assert merged is None
        else:
            assert merged is not None and merged.groups == merged_groups and len(merged.values) == 9_000
            assert merged.recoded.tolist() == [False, False, True, True]
        windows = 40
        row = np.repeat(np.arange(len(start), dtype=np.uint32), windows)
        codes = rng.integers(0, 2_600, (len(row), 20, 3)).astype(np.uint16)
        gps = np.zeros(len(row), np.float32)
        _decodes_as_stored(_held(dictionaries, codes, row, gps), dictionaries, codes, row, gps)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_recode_in_slices_on_threads_equals_one_pass(threads: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices of 1,000 windows (a device's windows cut over several) on 1 or 3 threads give
    every window its store values."""
    from birdzarr.loader import _resident

    monkeypatch.setattr(_resident, "_RECODE_SLICE", 1_000)
    rng = np.random.default_rng(4)
    rows = [[rng.permutation(_bits(10_000 * c, 3_000))[:2_700] for c in range(3)] for _ in range(5)]
    dictionaries, codes, row, gps = _store(rows, windows_a_row=1_300)
    packed, held_codes, held_gps, held_row = HeldCodes.host_layout(len(row), True, shared=False)
    np.bitwise_xor(codes, np.uint16(CODE_BIAS), out=held_codes.numpy().view(np.uint16))
    held_row.numpy()[:] = row
    held_gps.numpy()[:] = gps
    values, offsets = held_dictionaries(dictionaries, held_row.numpy(), held_codes.numpy(), threads=threads)
    assert len(values) == 9_000
    held = HeldCodes(held_codes, held_gps, held_row, torch.from_numpy(values), torch.from_numpy(offsets),
                     packed)
    _decodes_as_stored(held, dictionaries, codes, row, gps)


def test_consecutive_rows_on_the_same_entries_are_one_held_row_where_nothing_merges() -> None:
    """Rows 0 and 1 start at the same entries (small devices sharing a row), row 2 shares no
    value with them: nothing merges, the entries are held as stored, and rows 0 and 1 are one
    held row (one row of offsets), every window decoding as stored."""
    values = np.concatenate([_bits(10_000 * c, 2_600) for c in range(6)]).view(np.float32)
    start = np.array([[0, 2_600, 5_200], [0, 2_600, 5_200], [7_800, 10_400, 13_000]], np.int64)
    dictionaries = _v2.Dictionaries(values, start, np.arange(3, dtype=np.int64))
    row = np.repeat(np.arange(3, dtype=np.uint32), 40)
    codes = np.random.default_rng(5).integers(0, 2_600, (len(row), 20, 3)).astype(np.uint16)
    gps = np.ones(len(row), np.float32)
    held = _held(dictionaries, codes, row, gps)
    assert np.array_equal(held.values.numpy().view(np.uint32), values.view(np.uint32))
    assert held.start.tolist() == [[0, 2_600, 5_200], [7_800, 10_400, 13_000]]
    assert held.row.tolist() == [0] * 80 + [1] * 40
    _decodes_as_stored(held, dictionaries, codes, row, gps)
