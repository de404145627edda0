"""Greedy groups of consecutive dictionaries that can share one union a channel (pure numpy).

Two layers merge consecutive dictionaries into unions: the ``--shuffle`` writer merges the
dictionary rows it seeds (``convert/_shuffle.seed_rows``), so that the store itself holds the
small table, and resident mode merges the rows (or dict16 chunks) of a store it loads
(``loader/_shared_dictionaries``). Both group them here, the same way: consecutive members form a
group while, in every channel, the union of their entries (float32 bit patterns, sorted) holds at
most ``max_entries``, and, where ``min_shared`` is set, while each member after the first has at
least that fraction of its entries in the group already (members with little in common, such as
devices calibrated one by one, stay apart: merging them would shrink nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# A row joins a group only if at least this fraction of its entries are in the group already
MIN_SHARED = 0.5


def bits(values: np.ndarray) -> np.ndarray:
    """``values`` (float32, or their bit patterns: uint32) as bit patterns, a view where they are
    either already."""
    values = np.ascontiguousarray(values)
    return values if values.dtype == np.uint32 else values.astype(np.float32, copy=False).view(np.uint32)


def sorted_bits(member: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each channel's bit patterns, sorted (a dictionary's values are distinct already)."""
    return [np.sort(bits(d)) for d in member]


def share_groups(dictionaries: Sequence[Sequence[np.ndarray]], max_entries: int,
                 min_shared: float = 0.0) -> list[tuple[int, int, list[np.ndarray] | None]]:
    """Greedy runs of consecutive members (chunks or rows) ``[first, stop)`` whose unions (sorted
    bit patterns, per channel) stay within ``max_entries`` and, where ``min_shared`` is set, each of
    whose members after the first has at least that fraction of its entries (all channels
    together) in the union already: a member that would bring mostly new entries opens a group,
    so that dictionaries with little in common are not merged (that shrinks nothing and costs a
    recode). With ``min_shared`` the fraction is first estimated on samples (``_sample``), and a
    member that clearly shares too little is never sorted. ``dictionaries[i]`` are member ``i``'s
    distinct values a channel (float32, or their bit patterns). A group of one member comes back
    with ``None`` for its unions. A pure function of the dictionaries: every caller, engine and
    worker count gets the same groups.

    Memory: the current group's unions (at most ``max_entries`` a channel, 4 B each), a sample of
    1 in 32 of their entries, and the groups of several members' unions, handed back."""
    groups: list[tuple[int, int, list[np.ndarray] | None]] = []
    first, unions, samples = 0, None, []
    for i, chunk in enumerate(dictionaries):
        own_samples = [_sample(bits(d)) for d in chunk] if min_shared else []
        if i == 0:
            unions, samples = (None if min_shared else sorted_bits(chunk)), own_samples
            continue
        own = joined = None
        if not (min_shared and _shares_too_little(samples, own_samples, min_shared)):
            unions = sorted_bits(dictionaries[first]) if unions is None else unions
            own = sorted_bits(chunk)
            joined = _joined(unions, own, max_entries, min_shared)
        if joined is None:  # a group of one keeps no unions: what a caller holds stays bounded
            groups.append((first, i, unions if i - first > 1 else None))
            first, unions, samples = i, own, own_samples
        else:
            unions = joined
            samples = _merged(samples, own_samples)
    if len(dictionaries):
        groups.append((first, len(dictionaries), unions if len(dictionaries) - first > 1 else None))
    return groups


def _merged(unions: list[np.ndarray], own: list[np.ndarray]) -> list[np.ndarray]:
    """The sorted ``unions`` with the sorted ``own`` in them."""
    return _inserted(unions, [_missing(union, d) for union, d in zip(unions, own, strict=True)])


def _inserted(unions: list[np.ndarray], missing: list[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """The missing values inserted where they sort: one copy of each union, no sort of it."""
    return [np.insert(u, at, values) if len(values) else u
            for u, (at, values) in zip(unions, missing, strict=True)]


def _joined(unions: list[np.ndarray], own: list[np.ndarray], max_entries: int, min_shared: float
            ) -> list[np.ndarray] | None:
    """The unions with ``own`` (sorted) merged in, or None where some channel would pass
    ``max_entries`` or fewer than ``min_shared`` of own's entries are in the unions already."""
    missing = [_missing(union, d) for union, d in zip(unions, own, strict=True)]
    if any(len(u) + len(values) > max_entries for u, (_, values) in zip(unions, missing, strict=True)):
        return None
    if min_shared and sum(len(v) for _, v in missing) > (1 - min_shared) * sum(len(d) for d in own):
        return None
    return _inserted(unions, missing)


# A sample keeps the entries whose multiplicative hash has its top 5 bits 0 (about 1 in 32): the
# same values in every dictionary, so an entry of a member's sample is in the group's union
# exactly where it is in the union of its members' samples
_SAMPLE_SHIFT = np.uint32(27)
_SAMPLE_HASH = np.uint32(0x9E3779B1)
_SAMPLE_MIN = 64  # fewer sampled entries than this: decided exactly (cheap at that size)


def _sample(entries: np.ndarray) -> np.ndarray:
    """The sorted ``entries`` (uint32 bit patterns) in the sample."""
    return np.sort(entries[(entries * _SAMPLE_HASH) >> _SAMPLE_SHIFT == 0])


def _shares_too_little(samples: list[np.ndarray], own: list[np.ndarray], min_shared: float) -> bool:
    """Whether the samples say that fewer than ``min_shared`` of a member's entries are in the
    group (``samples``: the union of its members' samples): only with enough sampled entries."""
    total = sum(len(d) for d in own)
    if total < _SAMPLE_MIN:
        return False
    new = sum(len(_missing(union, d)[1]) for union, d in zip(samples, own, strict=True))
    return total - new < min_shared * total


def _missing(union: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sorted ``values`` not in the sorted ``union``, and where each goes in it."""
    at = np.searchsorted(union, values)
    found = at < len(union)
    found[found] = union[at[found]] == values[found]
    return at[~found], values[~found]
