"""Format 2's row numbers of a device-order conversion's segments: each segment numbers its rows
from 0, and the collector shifts them after the rows of the segments before it as soon as those
are all in (``SegmentCollector.take_shifts``, run as tasks on the engine beside the segments still
running), not one after another at the end."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from birdzarr.convert._segments import (
    AppendTo,
    RowShift,
    Segment,
    SegmentCollector,
    SegmentResult,
    SharedChunkPart,
)
from birdzarr.format import _v2
from birdzarr.format._spec import DEVICE

CHUNK = 8192


class _Writer:
    """What the collector uses of a writer: the rows it is handed and the shared chunks written."""

    def __init__(self) -> None:
        self.rows: list[_v2.Dictionaries] = []
        self.chunks: list[tuple[int, int, dict[str, np.ndarray]]] = []
        self.slabs = SimpleNamespace(chunk_windows=CHUNK, reserve=lambda n: None,
                                     sink=SimpleNamespace(write=self._write))

    def _write(self, start: int, stop: int, data: dict[str, np.ndarray]) -> None:
        self.chunks.append((start, stop, data))

    def reserve(self, n: int) -> None:
        pass

    def add_rows(self, rows: _v2.Dictionaries) -> None:
        self.rows.append(rows)


def _rows(n_rows: int, n_values: int) -> _v2.Dictionaries:
    start = np.arange(n_rows * 3, dtype=np.int64).reshape(n_rows, 3) % max(n_values, 1)
    return _v2.Dictionaries(np.arange(n_values, dtype=np.float32), start, np.arange(n_rows, dtype=np.int64))


def _part(chunk: int, start: int, rows: np.ndarray) -> SharedChunkPart:
    return SharedChunkPart(chunk, start, {_v2.ROW: rows.astype(np.int32),
                                          DEVICE: np.zeros(len(rows), np.int32)})


def _result(rows: _v2.Dictionaries, shared: list[SharedChunkPart]) -> SegmentResult:
    return SegmentResult([], {}, shared=shared, rows=rows)


def test_each_segment_is_shifted_once_the_segments_before_it_are_in() -> None:
    segments = [Segment(0, 20_000, []), Segment(20_000, 50_000, []), Segment(50_000, 70_000, [])]
    writer = _Writer()
    collector = SegmentCollector(writer, segments, duplicates=None, bar=None)  # type: ignore[arg-type]
    # chunk 2 (windows 16,384-24,575) is shared by the first two segments
    first_half = _part(2, 16_384, np.array([0, 1] * 1_808))
    second_half = _part(2, 20_000, np.array([0, 2] * 2_288))

    collector.add(segments[2], _result(_rows(1, 4), []))  # the last ends first: nothing known yet
    assert collector.take_shifts() == [] and writer.rows == []

    collector.add(segments[0], _result(_rows(2, 10), [first_half]))
    assert collector.take_shifts() == []  # the first segment's numbers are already the store's
    assert len(writer.rows) == 1 and writer.chunks == []  # chunk 2 still misses the second's windows

    collector.add(segments[1], _result(_rows(3, 7), [second_half]))
    # the second segment follows the first's 2 rows; the third the first two's 5 rows; each
    # shifts its whole chunks only (chunk 3-5 and chunk 7)
    assert collector.take_shifts() == [RowShift(3 * CHUNK, 6 * CHUNK, 2, 0),
                                       RowShift(7 * CHUNK, 8 * CHUNK, 5, 0)]
    assert collector.take_shifts() == []
    # the rows reach the writer in store order, their entries after the rows before them
    assert [r.n_rows for r in writer.rows] == [2, 3, 1]
    assert [int(r.start.min()) for r in writer.rows] == [0, 10, 17]
    # the shared chunk, written once both parts are in: the second part's rows shifted by 2
    [(start, stop, data)] = writer.chunks
    assert (start, stop) == (2 * CHUNK, 3 * CHUNK)
    np.testing.assert_array_equal(data[_v2.ROW], np.concatenate([[0, 1] * 1_808, [2, 4] * 2_288]))
    collector.finish()


def test_an_appends_committed_row_numbers_stay() -> None:

    segments = [Segment(100, 20_000, []), Segment(20_000, 50_000, [])]
    writer = _Writer()
    append = AppendTo(committed=100, first_row=40, values=500)
    collector = SegmentCollector(writer, segments, duplicates=None, bar=None, append=append)  # type: ignore[arg-type]
    collector.add(segments[1], _result(_rows(1, 3), []))
    collector.add(segments[0], _result(_rows(4, 6), []))
    # the second segment's new rows (numbered from the committed 40) come after the first's 4
    assert collector.take_shifts() == [RowShift(3 * CHUNK, 6 * CHUNK, 4, 40)]
    assert [int(r.start.min()) for r in writer.rows] == [500, 506]
