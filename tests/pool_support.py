"""A DataLoader collate_fn that reports a worker's pool counters beside each batch."""

from __future__ import annotations

import functools
from collections.abc import Callable


def _with_pool_counts(names: tuple[str, ...], batch: object) -> tuple[object, tuple[int, ...]]:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    assert info is not None
    pool = info.dataset._local().pool  # type: ignore[attr-defined]
    return batch, (info.id, *(int(getattr(pool, name)) for name in names))


def with_pool_counts(*names: str) -> Callable[[object], tuple[object, tuple[int, ...]]]:
    """collate_fn (it runs in the worker): the batch, and (the worker's id, its pool's counters
    ``names``: e.g. ``decoded``, ``reused``, ``early_batches``, ``prefetched``)."""
    return functools.partial(_with_pool_counts, names)
