"""``LoaderConfig``: the options of a ``WindowDataset``, resolved and validated in one place.

``WindowDataset(store, batch_size=..., ...)`` keeps its keyword options (what users and the docs
write); it turns them into one frozen ``LoaderConfig`` before anything is opened, so a bad option
fails at once with a message naming it, and the rest of the loader reads typed fields instead of
re-checking them. The store-dependent values (the selection's counts, ``pool_chunks``) are not
options and live on the dataset.
"""

from __future__ import annotations

import errno
import numbers
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from birdzarr._checks import require_bool, require_int
from birdzarr._errors import ArgumentError, warn_renamed
from birdzarr.loader._balanced import check_epoch_windows, check_label_weights
from birdzarr.store._selection import SPLIT_BY, SPLITS, TimeMask, WindowFilter, unix_seconds

Transform = Callable[[torch.Tensor], torch.Tensor]
# with transform_ldt=True the transform is called as transform(x, ldt) and returns (x, ldt)
LdtTransform = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# windows per pool: 160 MiB of float32, 16 chunks of a shuffled store (32768 windows), 64 of 8192.
# Pair co-occurrence grows with n_windows x chunk_windows / shuffle_buffer**2: this keeps it
# under 4 at 25 M windows (docs/training.md#shuffle-quality)
DEFAULT_SHUFFLE_BUFFER = 2**19


def _ids(devices: Iterable[int] | None) -> tuple[int, ...] | None:
    if devices is None:
        return None
    # one id given alone (devices="200" was read as the devices 2, 0, 0)
    if isinstance(devices, (str, bytes, numbers.Integral)):
        raise TypeError(f"devices and exclude_devices are lists of device ids, got {devices!r}: "
                        f"write [{devices!r}]")
    ids = tuple(devices)
    return tuple(require_int("a device id", d) for d in ids)  # 200.5 would read as 200


def _labels(labels: Iterable[int] | None) -> tuple[int, ...] | None:
    if labels is None:
        return None
    if isinstance(labels, (str, bytes, numbers.Integral)):
        raise TypeError(f"labels is a list of label ids, got {labels!r}: write [{labels!r}]")
    return tuple(sorted({require_int("a label", label) for label in labels}))


@dataclass(frozen=True)
class SubsetOptions:
    """Which windows to draw from: device filters, one side of a seeded split, and filters on
    each window's label and burst time."""

    devices: tuple[int, ...] | None = None
    exclude_devices: tuple[int, ...] | None = None
    split: str | None = None
    split_by: str = "device"
    val_fraction: float = 0.1
    split_seed: int = 0
    filters: WindowFilter = WindowFilter()

    @classmethod
    def of(cls, devices: Iterable[int] | None, exclude_devices: Iterable[int] | None, split: str | None,
           split_by: str, val_fraction: float, split_seed: int, *, labelled_only: bool = False,
           labels: Iterable[int] | None = None, start: Any = None, stop: Any = None,
           time_mask: TimeMask | None = None) -> SubsetOptions:
        """The options as given (device and label iterables are read once, here)."""
        require_int("split_seed", split_seed, minimum=0)
        require_bool("labelled_only", labelled_only)
        if time_mask is not None and not callable(time_mask):
            raise TypeError(f"time_mask must be a callable (burst times in unix seconds -> a boolean "
                            f"array) or None, got {time_mask!r}")
        first, end = unix_seconds("start", start), unix_seconds("stop", stop)
        if first is not None and end is not None and first >= end:
            raise ArgumentError(f"start must be before stop, got start={start!r} and stop={stop!r}")
        filters = WindowFilter(bool(labelled_only), _labels(labels), first, end, time_mask)
        return cls(_ids(devices), _ids(exclude_devices), split, split_by, float(val_fraction),
                   int(split_seed), filters)

    def __post_init__(self) -> None:
        if self.split is None:  # split_by and val_fraction only matter with a split
            return
        if self.split not in SPLITS:
            raise ArgumentError(f"split must be one of {SPLITS} or None, got {self.split!r}")
        if self.split_by not in SPLIT_BY:
            raise ArgumentError(f"split_by must be one of {SPLIT_BY}, got {self.split_by!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ArgumentError(f"val_fraction must be between 0 and 1, got {self.val_fraction}")


@dataclass(frozen=True)
class ResidentOptions:
    """Resident mode: where the selection is held, in which form, and whether loading shows a bar."""

    device: torch.device
    codes: bool = True  # a dict16 store's 16-bit codes, decoded in each gather
    progress: bool = True

    @classmethod
    def of(
        cls, resident: bool | str | torch.device | None, codes: bool, progress: bool
    ) -> ResidentOptions | None:
        """``None`` when streaming (``resident=False``); ``True`` means ``"cpu"``."""
        if resident is False or resident is None:
            return None
        try:
            device = torch.device("cpu" if resident is True else resident)
        except (RuntimeError, TypeError) as exc:
            raise ArgumentError(f"resident must be False, 'cpu' or a torch device, got {resident!r}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            # else a bare AssertionError from torch once the selection is loaded
            raise ArgumentError(f"resident={resident!r}: this PyTorch sees no CUDA device (torch "
                                f"{torch.__version__}, CUDA build: {torch.version.cuda is not None}); "
                             "use resident='cpu', or install the CUDA build of PyTorch (README)")
        return cls(device, bool(codes), bool(progress))


@dataclass(frozen=True)
class BalanceOptions:
    """Class-balanced sampling: each label's share of an epoch, drawn with or without replacement."""

    weights: str | tuple[tuple[int, float], ...]  # "balanced", or sorted (label, weight) pairs
    replacement: bool = True
    epoch_windows: int | None = None  # windows of an epoch over all ranks (None: the default)

    @classmethod
    def of(cls, label_weights: Any, replacement: bool | None, epoch_windows: int | None
           ) -> BalanceOptions | None:
        """``None`` without ``label_weights`` (``replacement`` and ``epoch_windows`` are then refused)."""
        if label_weights is None:
            for name, value in (("replacement", replacement), ("epoch_windows", epoch_windows)):
                if value is not None:
                    raise ArgumentError(f"{name}= applies to class-balanced sampling: give label_weights= "
                                        f"too (got {name}={value!r} without it)")
            return None
        return cls(check_label_weights(label_weights),
                   True if replacement is None else require_bool("replacement", replacement),
                   check_epoch_windows(epoch_windows))

    def record(self) -> dict[str, Any]:
        """What a resume state records of it."""
        weights = self.weights if isinstance(self.weights, str) else [list(pair) for pair in self.weights]
        return {"label_weights": weights, "replacement": self.replacement}


@dataclass(frozen=True)
class CacheOptions:
    """The opt-in local disk cache of a remote store's chunks."""

    directory: str | os.PathLike[str]
    max_bytes: int

    def __post_init__(self) -> None:
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise NotADirectoryError(errno.ENOTDIR, "cache_dir is not a directory: give a directory (it is "
                                     "made if missing)", os.fspath(self.directory))
        if not isinstance(self.max_bytes, int) or self.max_bytes < 0:
            raise ArgumentError(f"cache_max_bytes must be an integer of 0 or more, got {self.max_bytes!r}")


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """The validated options of one ``WindowDataset`` (see its docstring for each option)."""

    batch_size: int
    shuffle: bool
    seed: int
    drop_last: bool
    shuffle_buffer: int
    channel_first: bool
    with_ldt: bool
    transform: Transform | LdtTransform | None
    requests: int  # chunk reads in flight per reader, at least 1 (``prefetch`` before)
    reuse_batch_memory: bool
    allow_device_order: bool
    world_size: int
    rank: int
    subset: SubsetOptions
    resident: ResidentOptions | None  # None: streaming
    cache: CacheOptions | None
    transform_ldt: bool = False  # the transform takes and returns (x, ldt)
    balance: BalanceOptions | None = None  # class-balanced sampling (resident only)

    def __post_init__(self) -> None:
        for name in ("shuffle", "drop_last", "channel_first", "with_ldt", "reuse_batch_memory",
                     "allow_device_order", "transform_ldt"):
            require_bool(name, getattr(self, name))  # shuffle="no" would read as True
        for name in ("batch_size", "shuffle_buffer", "requests", "world_size", "rank", "seed"):
            # a float or a string would fail later, deep in the planning, with numpy's words
            require_int(name, getattr(self, name))
        if self.batch_size < 1:
            raise ArgumentError(f"batch_size must be positive, got {self.batch_size}")
        if self.shuffle_buffer < 1:
            raise ArgumentError(f"shuffle_buffer must be positive, got {self.shuffle_buffer}")
        if self.requests < 1:
            raise ArgumentError(f"requests must be positive, got {self.requests}")
        require_int("seed", self.seed, minimum=0)  # numpy's seeds are non-negative
        if self.world_size < 1:
            raise ArgumentError(f"world_size must be positive, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ArgumentError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if self.transform is not None and not callable(self.transform):
            raise TypeError(f"transform must be a callable or None, got {self.transform!r}")
        if self.transform_ldt and (self.transform is None or not self.with_ldt):
            raise ArgumentError("transform_ldt=True calls transform(x, ldt): it needs a transform and "
                                f"with_ldt=True, got transform={self.transform!r}, with_ldt={self.with_ldt}")
        if self.balance is not None:
            if self.resident is None:
                raise ArgumentError(
                    "label_weights (class-balanced sampling) needs the selection held in memory: pass "
                    "resident='cpu' (or 'cuda'); streamed batches are cut from pools of whole chunks and "
                    "cannot be drawn by label")
            if not self.shuffle:
                raise ArgumentError(
                    "label_weights draws every epoch's windows at random: it needs shuffle=True")

    @property
    def prefetch(self) -> int:
        """Deprecated name of ``requests``."""
        warn_renamed("LoaderConfig.prefetch", "LoaderConfig.requests")
        return self.requests

    def pool_chunks(self, chunk_windows: int) -> int:
        """Chunks per pool: ``shuffle_buffer`` windows rounded up to whole chunks."""
        return max(1, -(-self.shuffle_buffer // chunk_windows))


def distributed_defaults() -> tuple[int, int]:
    """(world_size, rank) from torch.distributed if initialised, else torchrun's environment."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))


def resolve_ranks(world_size: int | None, rank: int | None) -> tuple[int, int]:
    """The given world size and rank, each defaulting to what torch.distributed or torchrun say."""
    env_world, env_rank = distributed_defaults()
    # given values are checked, not coerced: LoaderConfig refuses "2" or 1.0
    return (env_world if world_size is None else world_size), (env_rank if rank is None else rank)
