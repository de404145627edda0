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
