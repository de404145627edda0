"""Class-balanced epochs of a resident selection (``WindowDataset(label_weights=...)``).

Pure and seeded, like ``_sampling``: an epoch is a function of (the resident rows of each label,
the weights, the epoch's size, seed, epoch, replacement); nothing reads data.

1. **How many windows of each label**: the epoch's ``total`` windows are apportioned to the
   labels by their shares (the largest-remainder rule: ``floor(total x share)`` each, one more
   for the largest remainders), so label ``c`` gets ``T_c`` windows, the same every epoch.
2. **Which windows**: label ``c``'s ``T_c`` windows are drawn from its ``N_c`` windows.
   With replacement (the default), in rounds: each round a new permutation of all ``N_c``
   windows, as many rounds as needed, cut at ``T_c``; so in one epoch a window is drawn
   ``floor(T_c / N_c)`` or one more times, and no window is drawn twice before every window of
   its label was drawn once. Without replacement, the first ``T_c`` of one permutation: no window
   twice in an epoch, which bounds the epoch at ``min(N_c / share_c)`` windows.
3. **Where**: label ``c``'s ``k``-th window gets the key ``(k + u_c) / T_c`` (``u_c`` uniform in
   [0, 1), drawn each epoch); the epoch's sequence is all windows in key order. Each label's
   windows are spread evenly over the sequence, so any ``m`` consecutive windows (a batch, or a
   slice of one) hold about ``m x T_c / total`` windows of label ``c``: within 1 of it for two
   or three equal shares, within 3 over 20 random weightings of 2-11 labels and batches of
   256-8192 (``tests/test_balanced.py``). The keys of a label are already in order, so the merge
   is one stable sort of ``K`` sorted runs.

Ranks take contiguous runs of the sequence and cut them into batches exactly as the plain
resident permutation is (``_resident``), so batch counts, sizes, workers and resume are the same.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from birdzarr._checks import require_int, require_number
from birdzarr._errors import ArgumentError

_STREAM = 0xBA1A7CED  # the balanced epochs' own random stream
_GRID = 2**40  # keys are integers: floor(position in [0, 1) x _GRID) x labels + label (never a tie)
BALANCED = "balanced"
_LOOPED_ROUNDS = 64


def check_label_weights(label_weights: Any) -> str | tuple[tuple[int, float], ...]:
    """``"balanced"``, or a mapping of label -> weight as sorted ``(label, weight)`` pairs."""
    if isinstance(label_weights, str):
        if label_weights != BALANCED:
            raise ArgumentError(f"label_weights must be 'balanced' or a dict of label -> weight, "
                                f"got {label_weights!r}")
        return BALANCED
    if not isinstance(label_weights, Mapping):
        raise TypeError("label_weights must be 'balanced' or a dict of label -> weight (e.g. {0: 1, 3: 2}), "
                        f"got {type(label_weights).__name__}")
    pairs = []
    for label, weight in label_weights.items():
        label_id = require_int("a label of label_weights", label)
        try:
            share = require_number(f"label_weights[{label_id}]", weight)
        except TypeError:
            raise
        except ValueError as exc:  # not finite
            raise ArgumentError(str(exc)) from None
        if share < 0:
            raise ArgumentError(f"label_weights[{label_id}] must be 0 or more, got {weight!r}")
        pairs.append((label_id, share))
    if not any(share > 0 for _, share in pairs):
        raise ArgumentError(
            f"label_weights must give some label a weight above 0, got {dict(label_weights)!r}")
    return tuple(sorted(pairs))


def resolve_shares(spec: str | tuple[tuple[int, float], ...], counts: Mapping[int, int]) -> dict[int, float]:
    """Each drawn label's share of an epoch (summing to 1), from the spec and the selection's
    windows per label. Labels of the selection the weights leave out are not drawn."""
    present = {label: n for label, n in counts.items() if n > 0}
    if isinstance(spec, str):  # "balanced"
        if -1 in present:
            raise ArgumentError(
                f"label_weights='balanced' balances labels, but the selection holds {present[-1]:,} "
                "unlabelled windows (label -1): add labelled_only=True, or give -1 a weight in a dict")
        weights = {label: 1.0 for label in present}
    else:
        weights = {label: w for label, w in spec if w > 0}
        missing = sorted(set(weights) - set(present))
        if missing:
            raise ArgumentError(
                f"label_weights gives label(s) {missing} a weight, but the selection holds no window of "
                f"them (its windows per label: {dict(sorted(present.items()))})")
    total = math.fsum(weights.values())
    return {label: w / total for label, w in sorted(weights.items())}


def apportion(total: int, shares: np.ndarray) -> np.ndarray:
    """``total`` split by ``shares`` (summing to 1): floors, then one more for the largest
    remainders (ties: the lower label)."""
    exact = total * shares
    counts = np.floor(exact).astype(np.int64)
    rest = total - int(counts.sum())
    if rest > 0:
        counts[np.argsort(-(exact - counts), kind="stable")[:rest]] += 1
    return counts


@dataclass(frozen=True)
class LabelRows:
    """The resident rows of each drawn label, and the labels' shares of an epoch."""

    labels: np.ndarray  # int64, ascending: the labels drawn (weight above 0)
    shares: np.ndarray  # float64, summing to 1
    rows: tuple[np.ndarray, ...]  # each label's resident rows, ascending (int32 or int64)

    @classmethod
    def of(cls, resident_labels: np.ndarray, shares: Mapping[int, float]) -> LabelRows:
        """Group the resident rows by label: one stable sort, once."""
        row_dtype = np.int32 if len(resident_labels) < 2**31 else np.int64
        order = np.argsort(resident_labels, kind="stable").astype(row_dtype)
        values, starts = np.unique(resident_labels[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        where = {int(v): (int(s), int(e)) for v, s, e in zip(values, starts, ends, strict=True)}
        labels = sorted(shares)
        return cls(np.array(labels, dtype=np.int64), np.array([shares[c] for c in labels], dtype=np.float64),
                   tuple(order[slice(*where[c])] for c in labels))

    @property
    def sizes(self) -> np.ndarray:
        return np.array([len(r) for r in self.rows], dtype=np.int64)

    def max_without_replacement(self) -> int:
        """The largest epoch without replacement: every label's share fits its windows (a margin
        of 1e-12 keeps ``total x share`` below ``N_c`` in floating point, so the apportioned
        count never exceeds it)."""
        return int(min(math.floor(n / s * (1 - 1e-12)) for n, s in zip(self.sizes, self.shares, strict=True)))

    def totals(self, total: int) -> np.ndarray:
        """Windows of each label in an epoch of ``total`` windows."""
        return apportion(total, self.shares)

    def epoch(self, total: int, *, seed: int, epoch: int, replacement: bool) -> np.ndarray:
        """Resident rows of the whole epoch (all ranks), in the epoch's order."""
        rng = np.random.default_rng([_STREAM, int(seed) & 0xFFFFFFFFFFFFFFFF, int(epoch)])
        k = len(self.labels)
        wanted = self.totals(total)
        offsets = rng.random(k)
        streams, keys = [], []
        for label, (rows, n) in enumerate(zip(self.rows, wanted.tolist(), strict=True)):
            if not n:
                continue
            if replacement:
                rounds = -(-n // len(rows))
                if rounds <= _LOOPED_ROUNDS:  # one permutation a round: 4x faster than permuted()
                    drawn = np.concatenate([rng.permutation(rows) for _ in range(rounds)])[:n]
                else:  # a label of few windows drawn many times: every round at once
                    drawn = rng.permuted(np.tile(rows, (rounds, 1)), axis=1).reshape(-1)[:n]
            else:
                drawn = rng.permutation(rows)[:n]
            streams.append(drawn)
            position = (np.arange(n, dtype=np.float64) + offsets[label]) / n  # in [0, 1), rising
            keys.append(np.floor(position * _GRID).astype(np.int64) * k + label)
        order = np.argsort(np.concatenate(keys), kind="stable")  # a merge of k sorted runs
        return np.concatenate(streams)[order].astype(np.int64)


def check_epoch_windows(epoch_windows: Any) -> int | None:
    if epoch_windows is None:
        return None
    if isinstance(epoch_windows, numbers.Integral) and not isinstance(epoch_windows, bool):
        return require_int("epoch_windows", epoch_windows, minimum=1)
    raise TypeError(f"epoch_windows must be an integer or None, got {epoch_windows!r}")
