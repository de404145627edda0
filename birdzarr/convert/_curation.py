"""Window-level curation of raw CSV rows.

The old script filtered single *rows* by speed and then reshaped every 20 rows, so one dropped
row shifted every later window and mixed bursts. Here rows are first grouped into windows (see
``WINDOW_RULE``) and only then is a whole window kept or dropped.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from birdzarr.format._spec import WINDOW_LENGTH, Curation, DeviceReport


def window_rows(burst_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """Row indices that form complete windows, and the number of rows left in the last burst.

    ``burst_ids`` gives each row's burst (non-decreasing run ids). Returns the indices of rows
    inside complete windows (a multiple of 20, in order) and the count of trailing rows of the
    final burst that did not complete a window (the caller may carry them into the next part).
    """
    n = len(burst_ids)
    if n == 0:
        return np.empty(0, dtype=np.int64), 0
    starts = np.flatnonzero(np.concatenate(([True], burst_ids[1:] != burst_ids[:-1])))
    lengths = np.diff(np.append(starts, n))
    burst_of_row = np.repeat(np.arange(len(starts)), lengths)
    position = np.arange(n) - starts[burst_of_row]
    full = (lengths // WINDOW_LENGTH) * WINDOW_LENGTH
    keep = position < full[burst_of_row]
    trailing = int(lengths[-1] - full[-1])
    return np.flatnonzero(keep), trailing


def window_labels(labels: np.ndarray, report: DeviceReport) -> np.ndarray:
    """One label per window (n, 20) -> (n,): the majority label, ties to the earliest row."""
    result = labels[:, 0].astype(np.int32)
    mixed = np.flatnonzero((labels != labels[:, :1]).any(axis=1))
    report.mixed_label_windows += len(mixed)
    for w in mixed:  # mixed windows are rare; Counter keeps first-seen order among ties
        result[w] = Counter(labels[w].tolist()).most_common(1)[0][0]
    return result


def curate_windows(
    values: np.ndarray, bad: np.ndarray, curation: Curation, report: DeviceReport
) -> tuple[np.ndarray, np.ndarray]:
    """Apply curation to raw windows.

    ``values`` is float64 (n, 20, 4) straight from the text, ``bad`` (n, 20) marks rows skipped as
    malformed. Returns the kept float32 windows and the boolean mask of kept windows.
    """
    speed = values[:, :, 3]
    has_bad_row = bad.any(axis=1)
    with np.errstate(invalid="ignore"):
        nonfinite = ~np.isfinite(speed).all(axis=1) & ~has_bad_row
        too_fast = (speed >= curation.speed_limit).any(axis=1) & ~nonfinite & ~has_bad_row
    keep = ~(has_bad_row | nonfinite | too_fast)
    report.drop("bad_rows", int(has_bad_row.sum()))
    report.drop("speed_not_finite", int(nonfinite.sum()))
    report.drop("speed_limit", int(too_fast.sum()))
    kept = values[keep]
    out = np.empty(kept.shape, dtype=np.float32)
    np.clip(kept[:, :, :3], curation.clip_min, curation.clip_max, out=out[:, :, :3], casting="same_kind")
    out[:, :, 3] = kept[:, :, 3] / curation.gps_scale
    return out, keep
