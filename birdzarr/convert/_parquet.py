"""Reader of the existing per-device Parquet files (``{device}.parquet``, column ``gimu``).

Each row is one curated window: 80 float32 values, time-major (``reshape(-1, 20, 4)``). Files
are streamed batch by batch, so memory is bounded by the batch size, not by the device's size.
The files carry no timestamps or labels: windows get ``TIMESTAMP_UNKNOWN`` and label -1.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from birdzarr._errors import BadInputError
from birdzarr._format import (
    LABEL_UNLABELLED,
    N_CHANNELS,
    TIMESTAMP_UNKNOWN,
    WINDOW_LENGTH,
    WINDOW_VALUES,
    DeviceReport,
)
from birdzarr._storage import Location
from birdzarr.convert._blocks import WindowBlock

COLUMN = "gimu"
BATCH_ROWS = 65536
_SKIP_HINT = "or pass --on-bad-rows skip to skip such rows and count them in the report"


def _check_schema(schema: pa.Schema, source: str) -> None:
    if COLUMN not in schema.names:
        raise BadInputError(
            f"{source}: no column '{COLUMN}' (columns: {', '.join(schema.names) or 'none'}). "
            "birdzarr reads Parquet files with one list<float32> column 'gimu' of 80 values a row."
        )
    kind = schema.field(COLUMN).type
    is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not is_list or kind.value_type != pa.float32():
        raise BadInputError(
            f"{source}: column '{COLUMN}' has type {kind}, expected list<float32> (80 values a row). "
            "Cast it to float32 lists before converting; birdzarr does not round values silently."
        )


def _row_problems(column: pa.Array) -> np.ndarray:
    """Boolean mask of rows that are not exactly 80 finite float32 values."""
    n = len(column)
    bad = np.zeros(n, dtype=bool)
    if column.null_count:
        bad |= ~np.asarray(column.is_valid())
    lengths = np.asarray(pa.compute.list_value_length(column).fill_null(0))
    bad |= lengths != WINDOW_VALUES
    values = column.flatten()
    if values.null_count:
        # a null inside a list makes the row bad; map each flat value back to its row
        row_of_value = np.repeat(np.arange(n), lengths)
        bad[row_of_value[~np.asarray(values.is_valid())]] = True
        values = values.fill_null(np.float32(np.nan))
    flat = values.to_numpy(zero_copy_only=False)
    if not bad.any() and len(flat) == n * WINDOW_VALUES:
        rows_finite = np.isfinite(flat.reshape(n, WINDOW_VALUES)).all(axis=1)
        bad |= ~rows_finite
    else:
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        finite = np.isfinite(flat)
        nonfinite_rows = np.add.reduceat(~finite, offsets[:-1]) if len(flat) else np.zeros(n, int)
        bad |= (nonfinite_rows > 0) & (lengths > 0)
    return bad


@dataclass
class ParquetDeviceReader:
    """Streams one device file into :class:`WindowBlock` s of at most ``BATCH_ROWS`` windows."""

    device_id: int
    path: Location
    on_bad_rows: str = "error"

    def blocks(self) -> Iterator[WindowBlock]:
        source = self.path.display
        try:
            handle = self.path.fs.open(self.path.path, "rb")
            file = pq.ParquetFile(handle)
        except (pa.ArrowInvalid, OSError) as exc:
            raise BadInputError(
                f"{source}: not a readable Parquet file ({exc}). Is it truncated? Re-export or "
                "re-copy it."
            ) from None
        with handle:
            _check_schema(file.schema_arrow, source)
            for group in range(file.num_row_groups):
                yield from self._row_group(file, group, source)

    def _row_group(self, file: pq.ParquetFile, group: int, source: str) -> Iterator[WindowBlock]:
        first_row = 0
        try:
            batches = file.iter_batches(batch_size=BATCH_ROWS, row_groups=[group], columns=[COLUMN])
            for batch in batches:
                yield self._batch(batch.column(0), group, first_row, source)
                first_row += batch.num_rows
        except (pa.ArrowInvalid, OSError) as exc:
            raise BadInputError(
                f"{source}, row group {group}: cannot be decoded ({exc}). The file is damaged or "
                "truncated; re-export or re-copy it."
            ) from None

    def _batch(self, column: pa.Array, group: int, first_row: int, source: str) -> WindowBlock:
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        report = DeviceReport(rows_read=len(column))
        bad = _row_problems(column)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            if self.on_bad_rows != "skip":
                length = pa.compute.list_value_length(column[row : row + 1]).to_pylist()[0]
                what = (
                    "is null" if not column[row].is_valid
                    else f"has {length} values (expected {WINDOW_VALUES})" if length != WINDOW_VALUES
                    else "holds a null, NaN or infinite value"
                )
                raise BadInputError(
                    f"{source}, row group {group}, row {first_row + row}: the window {what}. "
                    f"Fix the file, {_SKIP_HINT}."
                )
            report.bad_lines += int(bad.sum())
            report.drop("bad_rows", int(bad.sum()))
            column = column.filter(pa.array(~bad))
        flat = column.flatten().to_numpy(zero_copy_only=False)
        windows = np.asarray(flat, dtype=np.float32).reshape(-1, WINDOW_LENGTH, N_CHANNELS)
        n = len(windows)
        report.windows_written = n
        return WindowBlock(
            windows,
            np.full(n, TIMESTAMP_UNKNOWN, dtype=np.int64),
            np.full(n, LABEL_UNLABELLED, dtype=np.int32),
            report,
        )
