"""Shuffle quality: how close each batch's device mix is to the data set's.

For each batch, the total variation distance between its device histogram and the data set's
device proportions, averaged over batches, divided by the same figure for uniformly random
batches of the same size. 1.0 means as good as a full shuffle; larger is worse.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def mean_tv_distance(batches: Iterable[np.ndarray], devices: np.ndarray, proportions: np.ndarray) -> float:
    """Mean TV distance of the batches' device histograms from ``proportions`` (aligned with ``devices``)."""
    lookup = {int(d): i for i, d in enumerate(devices.tolist())}
    distances = []
    for batch in batches:
        ids, counts = np.unique(batch, return_counts=True)
        observed = np.zeros(len(devices))
        observed[[lookup[int(i)] for i in ids]] = counts / counts.sum()
        distances.append(0.5 * np.abs(observed - proportions).sum())
    return float(np.mean(distances)) if distances else float("nan")


def uniform_tv_distance(
    proportions: np.ndarray, batch_size: int, *, trials: int = 200, seed: int = 0
) -> float:
    """The same figure for batches drawn uniformly at random (multinomial)."""
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(batch_size, proportions, size=trials) / batch_size
    return float((0.5 * np.abs(draws - proportions).sum(axis=1)).mean())


def quality_ratio(batches: list[np.ndarray], devices: np.ndarray, counts: np.ndarray) -> float:
    """Mean TV of these batches divided by that of uniform batches of their typical size."""
    proportions = counts / counts.sum()
    size = int(np.median([len(b) for b in batches]))
    return mean_tv_distance(batches, devices, proportions) / uniform_tv_distance(proportions, size)


def repeated_batch_fraction(previous: list[np.ndarray], current: list[np.ndarray]) -> float:
    """Fraction of ``current``'s batches equal, as sets of windows, to a batch of ``previous``.

    A true reshuffle gives 0; one fixed chunk per batch ("shuffle once") gives 1.
    """
    seen = {np.sort(b).tobytes() for b in previous}
    if not current:
        return float("nan")
    return sum(np.sort(b).tobytes() in seen for b in current) / len(current)


def pair_cooccurrence_ratio(
    previous: list[np.ndarray],
    current: list[np.ndarray],
    n_windows: int,
    *,
    pairs: int = 200_000,
    seed: int = 0,
) -> float:
    """Of pairs of windows batched together in ``previous``, the fraction batched together again
    in ``current``, divided by the uniform value ``batch_size / n_windows``.

    1.0 is a fresh uniform reshuffle; ``n_windows / batch_size`` means pairs always meet again.
    Estimated from ``pairs`` random pairs drawn within ``previous``'s batches.
    """
    rng = np.random.default_rng(seed)
    batch_of = np.full(n_windows, -1, dtype=np.int64)
    for number, batch in enumerate(current):
        batch_of[batch] = number
    sizes = np.array([len(b) for b in previous])
    usable = np.flatnonzero(sizes >= 2)
    if len(usable) == 0:
        return float("nan")
    # pairs drawn in proportion to the pairs each batch holds
    weights = sizes[usable] * (sizes[usable] - 1.0)
    chosen = rng.choice(usable, size=pairs, p=weights / weights.sum())
    together = 0
    for number in np.unique(chosen).tolist():
        batch = previous[number]
        k = int((chosen == number).sum())
        a = rng.integers(0, len(batch), size=k)
        b = (a + rng.integers(1, len(batch), size=k)) % len(batch)  # a different member
        ba, bb = batch_of[batch[a]], batch_of[batch[b]]
        together += int(((ba == bb) & (ba >= 0)).sum())
    typical = float(np.mean([len(b) for b in current]))
    return (together / pairs) / (typical / n_windows)
