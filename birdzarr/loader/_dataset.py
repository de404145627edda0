"""``WindowDataset``: shuffled, batched windows for ``torch.utils.data.DataLoader``.

This package is the only one that imports torch. The dataset yields whole batches (use
``DataLoader(ds, batch_size=None)``). Streaming (the default), each epoch is planned by the pure
functions in ``_sampling``: a seeded permutation of chunks split over ranks, cut into pools that
DataLoader workers take whole; a worker decodes a pool's chunks once into its own buffers
(``_pool``), permutes the pool's windows and gathers each batch with one vectorised take.
``resident=`` holds the selection in memory instead and draws a full permutation every epoch
(``_resident``). The options are validated once into a frozen ``LoaderConfig`` (``_config``), the
position in the epochs and its saved form live in ``_state``, and each batch is gathered into
the memory of its output path by a sink (``_sink``).

Memory per streaming reader (the main process, or each DataLoader worker) is set by its settings::

    pool_chunks x chunk_windows x (320 B + 16 B with ldt)  +  (4 + 2) x batch_size x 344 B

(the pool; the reused batch slots and scratch), twice the pool in a DataLoader worker (its next
pool is decoded while it serves one), plus DataLoader's own ``prefetch_factor x
num_workers`` batches in flight. It never depends on the number of windows in the store.
"""

from __future__ import annotations

import functools
import itertools
import math
import numbers
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from birdzarr._checks import require_int
from birdzarr._errors import ArgumentError, SamplingError, warn_renamed
from birdzarr.format._spec import DEVICE, LABEL, TIMESTAMP
from birdzarr.loader._balanced import LabelRows, resolve_shares
from birdzarr.loader._config import (
    DEFAULT_SHUFFLE_BUFFER,
    BalanceOptions,
    CacheOptions,
    LdtTransform,
    LoaderConfig,
    ResidentOptions,
    SubsetOptions,
    Transform,
    resolve_ranks,
)
from birdzarr.loader._pool import LoadedPool, PoolBuffers, _DaemonThreads, reader_threads
from birdzarr.loader._sampling import EpochPlan, plan_epoch
from birdzarr.loader._sink import Batch, BatchLayout, Filler, SharedBatch, Sink, device_batch, make_sink
from birdzarr.loader._state import MAX_EPOCH, OrderKey, Progress, ResumeState
from birdzarr.storage._location import StoreLike, resolve
from birdzarr.store._chunks import ChunkReader
from birdzarr.store._handle import Store, open_store
from birdzarr.store._selection import SPLIT_RULE, SelectionStats, make_selection

if TYPE_CHECKING:
    from birdzarr.loader._resident import ResidentPlan, ResidentSelection

_T = TypeVar("_T")


def _few(ids: tuple[int, ...] | None) -> str:
    """Device ids for a message: at most ten, then how many more."""
    if ids is None:
        return "None"
    more = f", ... ({len(ids)} in all)" if len(ids) > 10 else ""
    return "[" + ", ".join(str(i) for i in ids[:10]) + more + "]"


def _renamed_prefetch(prefetch: Any, requests: int) -> int:
    """``WindowDataset(prefetch=n)``: the deprecated name of ``requests``, checked under its own name."""
    warn_renamed("WindowDataset(prefetch=...)", "WindowDataset(requests=...)", stacklevel=4)
    if requests != 4:
        raise ArgumentError("prefetch is the deprecated name of requests: give one of them")
    if require_int("prefetch", prefetch) < 1:
        raise ArgumentError(f"prefetch must be positive, got {prefetch}")
    return int(prefetch)


def _forwarded(option: str, name: str | None = None) -> Any:
    """A deprecated read-only attribute ``ds.<name>`` for ``ds.config.<option>``."""
    name = name or option

    def get(self: WindowDataset) -> Any:
        warn_renamed(f"WindowDataset.{name}", f"WindowDataset.config.{option}")
        return getattr(self.config, option)

    get.__doc__ = f"Deprecated: ``ds.config.{option}``."
    return property(get)


class _PlanAhead:
    """The next epoch's plan, computed on a daemon thread of this process while the current
    epoch is served (plans are pure functions of their key), as ``PoolBuffers.prefetch``
    decodes the next pool: ``take`` hands it over only for the same key, else drops it."""

    def __init__(self) -> None:
        self._threads: _DaemonThreads | None = None  # started on the first prepare
        self._pending: tuple[tuple[Any, ...], Future[Any]] | None = None
        self.prepared = 0  # plans started ahead (tests count them)
        self.taken = 0  # plans asked for and found prepared
        self.discarded = 0  # prepared plans asked for under another key, or never

    def prepare(self, key: tuple[Any, ...], compute: Callable[[], Any]) -> None:
        if self._pending is not None and self._pending[0] == key:
            return
        self._drop()
        if self._threads is None:
            self._threads = _DaemonThreads(1, "birdzarr-plan")
        self._pending = (key, self._threads.submit(compute))
        self.prepared += 1

    def take(self, key: tuple[Any, ...]) -> tuple[bool, Any]:
        """``(True, plan)`` if the plan of ``key`` was prepared (waiting for it if still drawn),
        else ``(False, None)``, dropping a prepared plan of the same kind (the key's first
        item) and another key."""
        pending = self._pending
        if pending is None or pending[0] != key:
            if pending is not None and pending[0][0] == key[0]:
                self._drop()
            return False, None
        self._pending = None
        self.taken += 1
        return True, pending[1].result()

    def _drop(self) -> None:
        if self._pending is not None:
            self._pending[1].cancel()  # one being drawn finishes on its thread, unused
            self._pending = None
            self.discarded += 1


@dataclass
class _PerProcess:
    """What one process (the main one, or a DataLoader worker) opens for itself."""

    pid: int
    reader: ChunkReader
    pool: PoolBuffers
    sink: Sink  # where its batches are gathered to
    iterations: int = 0  # iterations started here: only the latest may use the pool buffer
    ahead: _PlanAhead = field(default_factory=_PlanAhead)  # the next epoch's resident plan


class WindowDataset(IterableDataset[Batch]):
    """Batches of windows from a store, reshuffled every epoch, split over workers and ranks.

    Args:
        store: path or URL of a committed store (``s3://...`` works the same), or an opened
            ``birdzarr.Store``.
        batch_size: windows per batch. Every batch holds ``batch_size`` windows but each rank's
            last one (docs/training.md#workers-order-and-batch-sizes).
        shuffle: new batches every epoch (call ``set_epoch``). Streaming from a
            device-ordered store this is refused (batches would mix only the devices of a pool's
            chunks); convert with ``--shuffle``, or use ``resident=``.
        seed: the shuffle seed; which windows form a batch is a pure function of (seed, epoch,
            world size, shuffle_buffer, batch_size, drop_last) and, streaming, of the
            DataLoader's ``num_workers`` (pools are sized for the workers), as is the order
            batches arrive in.
        drop_last: every batch has exactly ``batch_size`` windows; the rest of each rank's share
            (under ``batch_size + 1`` windows) is not delivered this epoch (a different rest
            every epoch when shuffling).
        channel_first: yield ``(B, 4, 20)`` instead of ``(B, 20, 4)``.
        with_ldt: yield ``(x, ldt)`` with ``ldt`` int64 ``(B, 3)`` = label, device id, unix seconds.
        devices / exclude_devices: keep only / drop these device ids.
        split: ``"train"`` or ``"val"`` to take one side of a seeded split; ``split_by`` is
            ``"device"`` (default: birds stay on one side) or ``"window"`` (a seeded per-window
            split, one bird on both sides); ``val_fraction`` and ``split_seed`` set it. Each
            device (or window) is in ``val`` with probability ``val_fraction``, from a hash of
            its own identity, so data added later never moves it (docs/training.md#subsets-and-splits).
        labelled_only / labels: keep only labelled windows (label != -1) / windows with these labels.
        start / stop: keep windows whose burst time is in ``[start, stop)`` (datetimes, naive
            ones UTC, ISO 8601 strings or unix seconds); windows of unknown time are dropped.
        time_mask: a callable taking burst times (int64 unix seconds, ``-2**63`` = unknown) and
            returning a boolean array: keep the windows it marks. Filters combine with devices and
            the split (all must hold); they are applied once, when the dataset is made.
        shuffle_buffer: windows shuffled together per pool, rounded up to whole chunks (default
            524,288 = 160 MiB of float32 per reader). Larger pools make batches less likely to meet
            again next epoch (docs/training.md#shuffle-quality).
        requests: chunk reads in flight per reader: chunks fetched and decoded at once (raise it
            for object stores). On a store on this machine's file system a reader uses at most
            its share of the cores (``cores // num_workers``, at least 1): decoding is the work
            there (docs/training.md#memory). ``prefetch`` is its deprecated name.
        transform: optional callable applied to each batch in the reader: ``transform(x) -> x``
            (a tensor); with ``transform_ldt=True`` (needs ``with_ldt``) ``transform(x, ldt) ->
            (x, ldt)``, a tuple of two tensors, for label mapping or label-aware augmentation
            (docs/training.md#transforms). Another return type raises ``TypeError``.
        transform_ldt: call ``transform`` with the labels as ``transform(x, ldt)``.
        label_weights: class-balanced sampling (resident mode only): ``"balanced"`` (every label
            of the selection an equal share; it must hold no unlabelled window) or a dict
            ``{label: weight}`` (shares of each epoch in proportion; a label left out is never
            drawn). Each epoch's windows are drawn by label from ``(seed, epoch)`` and spread so
            that every batch holds each label's share within a few windows
            (docs/training.md#class-balanced-sampling).
        replacement: with ``label_weights``: ``True`` (default) draws a label's windows in
            rounds of fresh permutations, so windows of a rare label repeat within an epoch
            (evenly: no window twice before all once); ``False`` draws no window twice in an
            epoch, which caps the epoch at ``min(windows of label / its share)``.
        epoch_windows: with ``label_weights``: windows of an epoch over all ranks (default: the
            selection's size with replacement, the cap without).
        resident: ``False`` (stream), ``"cpu"`` or a torch device (``"cuda"``): hold the
            selection in memory once and draw a full permutation every epoch
            (docs/training.md#resident-mode).
        resident_codes: hold a dict16 store's 16-bit codes (0.5x the memory of float32, decoded
            in each gather); ``False`` holds float32 (faster gathers on the host).
        allow_device_order: stream shuffled batches from a device-ordered store anyway.
        progress: show a progress bar while a resident selection loads.
        world_size / rank: override what torch.distributed or the environment say.
        storage_options: passed to fsspec (credentials are never stored or printed).
        cache_dir / cache_max_bytes: opt-in local disk cache of a remote store's chunks, so later
            epochs read local disk; at the cap it stops admitting chunks (docs/cloud.md).
        reuse_batch_memory: in DataLoader workers, hand batches over through a few reused
            shared-memory slots instead of a fresh segment per batch (Linux). Turn it off if a
            custom ``collate_fn`` must see tensors inside the worker. A ``transform`` keeping
            shape and dtype writes into the slot.

    The validated options are ``ds.config`` (a frozen ``birdzarr.LoaderConfig``:
    ``ds.config.batch_size``, ``ds.config.world_size``, ...). The attributes ``ds.batch_size``,
    ``ds.shuffle``, ... that repeated them are deprecated.
    """

    def __init__(
        self,
        store: StoreLike,
        *,
        batch_size: int = 8192,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        channel_first: bool = False,
        with_ldt: bool = False,
        devices: Iterable[int] | None = None,
        exclude_devices: Iterable[int] | None = None,
        split: str | None = None,
        split_by: str = "device",
        val_fraction: float = 0.1,
        split_seed: int = 0,
        labelled_only: bool = False,
        labels: Iterable[int] | None = None,
        start: Any = None,
        stop: Any = None,
        time_mask: Callable[[np.ndarray], np.ndarray] | None = None,
        shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER,
        requests: int = 4,
        transform: Transform | LdtTransform | None = None,
        transform_ldt: bool = False,
        label_weights: str | Mapping[int, float] | None = None,
        replacement: bool | None = None,
        epoch_windows: int | None = None,
        resident: bool | str | torch.device = False,
        resident_codes: bool = True,
        allow_device_order: bool = False,
        progress: bool = True,
        world_size: int | None = None,
        rank: int | None = None,
        storage_options: dict[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_max_bytes: int = 50 * 2**30,
        reuse_batch_memory: bool = True,
        prefetch: int | None = None,  # deprecated: requests
    ) -> None:
        super().__init__()
        if prefetch is not None:
            requests = _renamed_prefetch(prefetch, requests)
        world_size, rank = resolve_ranks(world_size, rank)
        self._config = LoaderConfig(
            batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
            shuffle_buffer=shuffle_buffer, channel_first=channel_first, with_ldt=with_ldt,
            transform=transform, transform_ldt=transform_ldt, requests=requests,
            reuse_batch_memory=reuse_batch_memory,
            allow_device_order=allow_device_order, world_size=world_size, rank=rank,
            subset=SubsetOptions.of(devices, exclude_devices, split, split_by, val_fraction, split_seed,
                                    labelled_only=labelled_only, labels=labels, start=start, stop=stop,
                                    time_mask=time_mask),
            resident=ResidentOptions.of(resident, resident_codes, progress),
            cache=None if cache_dir is None else CacheOptions(cache_dir, cache_max_bytes),
            balance=BalanceOptions.of(label_weights, replacement, epoch_windows),
        )
        self.location = resolve(store, storage_options)
        self._open(open_store(self.location))
        self._progress = Progress()
        self._per_process: _PerProcess | None = None
        self._plan_memo: tuple[tuple[str, int, int], Any] | None = None  # the current epoch's plan
        self._label_counts: dict[int, int] | None = None
        self._stats: SelectionStats | None = None
        c = self.config
        # Epochs of no batch would train on nothing, silently: every rank's share is
        # n // world_size windows (or one more) whatever the pools
        n = self.n_selected if self._balanced is None else self._balanced[1]
        what = "selected" if self._balanced is None else "an epoch (label_weights)"
        if c.drop_last and n // c.world_size < c.batch_size:
            raise ArgumentError(
                f"batch_size={c.batch_size:,} with drop_last=True gives no batch in any epoch: "
                f"{n:,} windows {what} over {c.world_size} rank(s) leave each rank "
                f"{n // c.world_size:,}. Lower batch_size, or leave drop_last off"
            )

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a ``spawn`` or ``forkserver`` DataLoader worker, Python 3.14's default on
        Linux) without this process's reader threads and buffers: each process opens its own
        (``_local``), also after this one has read batches."""
        state = self.__dict__.copy()
        state["_per_process"] = None
        return state

    def _open(self, opened: Store) -> None:
        """What the store says (a snapshot: windows committed later, by an append during
        training, are not seen): the selection's windows per chunk, and the resident copy."""
        config = self.config
        self.n_windows = len(opened)
        self.shuffled_store = opened.shuffled
        # which store, for state_dict (with its window count)
        self.store_shuffle_seed = opened.root.get("layout", {}).get("shuffle_seed")
        subset = config.subset
        self.selection = make_selection(
            opened.device_columns, reader=opened.reader, shuffled_store=opened.shuffled,
            devices=subset.devices, exclude_devices=subset.exclude_devices, split=subset.split,
            split_by=subset.split_by, val_fraction=subset.val_fraction, split_seed=subset.split_seed,
            filters=subset.filters, threads=config.requests,
        )
        self.counts = self.selection.counts(opened.reader)
        self.n_selected = int(self.counts.sum())
        if not self.n_selected:  # an epoch of no batch would train on nothing, silently
            f = subset.filters
            filters = "".join(f", {name}={value!r}" for name, value in (
                ("labelled_only", f.labelled_only or None), ("labels", f.labels), ("start", f.start),
                ("stop", f.stop), ("time_mask", f.time_mask)) if value is not None)
            raise ArgumentError(
                f"the selection holds no window of {opened.url}: devices={_few(subset.devices)}, "
                f"exclude_devices={_few(subset.exclude_devices)}, split={subset.split!r}{filters}; "
                "choose devices the store holds (`birdzarr info --devices`) and filters that keep "
                "windows (`ds.label_counts()` of a wider selection shows its labels)"
            )
        self.chunk_windows = opened.reader.chunk_windows
        self.pool_chunks = config.pool_chunks(self.chunk_windows)
        self._layouts = opened.reader.layouts
        # a streamed version-2 store's dictionaries, read here once: each process's reader takes
        # them (a forked DataLoader worker shares these pages) instead of reading and checking
        # them before its first batch (~70 ms of CPU a worker for 186 devices)
        self._template = opened.reader if (
            config.resident is None and opened.reader.format_version == 2) else None
        if self._template is not None:
            self._template.dictionaries()
        self._cache = None
        if config.cache is not None:
            from birdzarr.storage._cache import cache_for

            self._cache = cache_for(opened, config.cache.directory, config.cache.max_bytes)
        self.resident: ResidentSelection | None = None
        self._balanced: tuple[LabelRows, int] | None = None  # label_weights: rows by label, epoch size
        if config.resident is not None:
            from birdzarr.loader._resident import ResidentSelection

            self.resident = ResidentSelection.load(
                opened, self.selection, device=config.resident.device, with_ldt=config.with_ldt,
                prefetch=config.requests, progress=config.resident.progress, codes=config.resident.codes,
                labels=config.balance is not None,
            )
            if config.balance is not None:
                self._balanced = _balance(self.resident, config.balance)
        elif config.shuffle and not opened.shuffled and not config.allow_device_order:
            refusal = _device_order_refusal(
                opened.url, self.selection, opened.n_devices, self.counts, self.pool_chunks,
                config.batch_size, config.world_size,
            )
            if refusal:
                raise SamplingError(refusal)

    # -- the options, read-only ----------------------------------------------------------------------
    @property
    def config(self) -> LoaderConfig:
        """Every option, validated (frozen)."""
        return self._config

    # deprecated: ds.config.<name> is the one spelling of an option (docs/format.md#glossary)
    batch_size = _forwarded("batch_size")
    shuffle = _forwarded("shuffle")
    seed = _forwarded("seed")
    drop_last = _forwarded("drop_last")
    channel_first = _forwarded("channel_first")
    with_ldt = _forwarded("with_ldt")
    prefetch = _forwarded("requests", "prefetch")
    transform = _forwarded("transform")
    transform_ldt = _forwarded("transform_ldt")
    reuse_batch_memory = _forwarded("reuse_batch_memory")
    world_size = _forwarded("world_size")
    rank = _forwarded("rank")

    @property
    def epoch(self) -> int:
        """The epoch being (or about to be) iterated; set with ``set_epoch``."""
        return self._progress.epoch

    # -- sizes and state -------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches this rank yields this epoch, the same on every rank.

        Every epoch has the same count: ``ceil((n_selected / world_size) / batch_size)`` (rounded
        as docs/training.md#workers-order-and-batch-sizes says), or ``(n_selected // world_size)
        // batch_size`` with ``drop_last``.
        """
        return self._n_batches(self.epoch)

    def _n_batches(self, epoch: int) -> int:
        if self.resident is not None:
            return self._resident_size()[1]
        return self.plan(epoch).n_batches

    @property
    def windows_per_epoch(self) -> int:
        """Windows this rank yields this epoch."""
        if self.resident is not None:
            return self._resident_size()[0]
        return self.plan().n_windows

    def _resident_size(self) -> tuple[int, int]:
        """This rank's windows and batches in a resident epoch (the same every epoch), counted
        without drawing the epoch's permutation."""
        c, resident = self.config, self.resident
        assert resident is not None
        return resident.epoch_size(world_size=c.world_size, rank=c.rank, batch_size=c.batch_size,
                                   drop_last=c.drop_last,
                                   epoch_windows=None if self._balanced is None else self._balanced[1])

    def label_counts(self) -> dict[int, int]:
        """Windows per label of the selection (``-1``: unlabelled), ascending labels: exactly the
        windows one epoch delivers over all ranks and workers (less those ``drop_last`` leaves
        out); with ``label_weights`` an epoch draws by the weights instead (``label_shares()``).
        Reads the ``label`` array of the chunks holding selected windows (once; cached)."""
        if self._label_counts is None:
            self._label_counts = self.selection.label_counts(self._reader(), threads=self.config.requests)
        return dict(self._label_counts)

    def stats(self) -> SelectionStats:
        """Per-channel count, mean, std, min and max of exactly the selection (stored units), for
        the model's input normalisation without the validation windows: ``.mean`` and ``.std`` are
        float64 arrays in channel order, ``.to_dataframe()`` a table. One pass over the ``gimu``
        chunks holding selected windows, computed once per dataset (cached)."""
        if self._stats is None:
            self._stats = self.selection.channel_stats(self._reader(), threads=self.config.requests)
        return self._stats

    def _reader(self) -> ChunkReader:
        """A chunk reader of this process for one-off passes (through the chunk cache, if any)."""
        reader = ChunkReader(resolve(self.location.url, self.location.storage_options), self._layouts,
                             self.n_windows)
        reader.cache = self._cache
        return reader

    def class_weights(self, num_classes: int | None = None) -> torch.Tensor:
        """Per-label weights from ``label_counts()`` for ``torch.nn.CrossEntropyLoss(weight=...,
        ignore_index=-1)``: ``n / (k * n_c)`` for label ``c`` with ``n_c`` windows, ``n`` the
        labelled windows and ``k`` the labels present ("balanced": every label then weighs as
        much in the loss). A float32 tensor of ``num_classes`` entries (default: the largest
        label + 1); a label without windows gets 0."""
        counts = {label: n for label, n in self.label_counts().items() if label >= 0}
        if not counts:
            raise ValueError("class_weights: the selection holds no labelled window (every label is -1)")
        size = (max(counts) + 1 if num_classes is None
                else require_int("num_classes", num_classes, minimum=1))
        if max(counts) >= size:
            raise ArgumentError(f"num_classes={size} is too small: the selection holds label {max(counts)}")
        weights = torch.zeros(size, dtype=torch.float32)
        total = sum(counts.values())
        for label, n in counts.items():
            weights[label] = total / (len(counts) * n)
        return weights

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's order; call before iterating (keeps a resume point of that epoch)."""
        self._progress.set_epoch(epoch)

    def _order_key(self) -> OrderKey:
        c, resident = self.config, self.resident is not None
        subset = c.subset
        selection = {
            "store_windows": self.n_windows, "store_shuffle_seed": self.store_shuffle_seed,
            "shuffle": c.shuffle, "drop_last": c.drop_last,
            "devices": None if subset.devices is None else sorted(subset.devices),
            "exclude_devices": None if subset.exclude_devices is None else sorted(subset.exclude_devices),
            "split": subset.split,
            # the split's settings matter only with a split
            "split_by": subset.split_by if subset.split else None,
            "val_fraction": subset.val_fraction if subset.split else None,
            "split_seed": subset.split_seed if subset.split else None,
        }
        # recorded only where used, so states of datasets without them resume as before
        if subset.split:
            selection["split_rule"] = SPLIT_RULE  # states of the older, index-based rule are refused
        f = subset.filters
        for name, value in (("labelled_only", f.labelled_only or None),
                            ("labels", None if f.labels is None else list(f.labels)),
                            ("start", f.start), ("stop", f.stop),
                            ("time_mask", None if f.time_mask is None else self.selection.digest())):
            if value is not None:
                selection[name] = value
        if c.balance is not None and self._balanced is not None:
            selection.update(c.balance.record(), epoch_windows=self._balanced[1])
        return OrderKey(c.seed, c.world_size, c.rank, c.batch_size, self.pool_chunks, resident, selection)

    def state_dict(self, batches_seen: int | None = None) -> dict[str, Any]:
        """Where the epoch stands. With DataLoader workers, pass the batches the loop consumed
        this epoch (the dataset in the main process does not see workers' progress), or use
        torchdata's ``StatefulDataLoader``, which snapshots each worker's own state."""
        if batches_seen is not None:
            left = len(self) - self._progress.resume_at
            whole = isinstance(batches_seen, numbers.Integral) and not isinstance(batches_seen, bool)
            if not whole or not 0 <= batches_seen <= left:
                raise ArgumentError(f"batches_seen must be an integer from 0 to the batches left in this "
                                    f"epoch ({left}), got {batches_seen!r}")
        return self._progress.snapshot(self._order_key(), batches_seen).to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state['epoch']`` starts at its next batch."""
        saved = ResumeState.from_dict(state)
        saved.check_resumable(self._order_key())
        if saved.next_batch is not None:
            batches = self._n_batches(saved.epoch)
            if saved.next_batch > batches:
                raise ValueError(f"cannot resume at batch {saved.next_batch}: epoch {saved.epoch} of this "
                                 f"dataset has {batches} batches")
        self._progress.restore(saved)

    # -- planning ----------------------------------------------------------------------------------
    def _plan_key(self, kind: str, epoch: int, readers: int) -> tuple[Any, ...]:
        """Everything an epoch's plan depends on."""
        c = self.config
        balance = None if c.balance is None or self._balanced is None else (
            sorted(c.balance.record().items()), self._balanced[1])
        return (kind, epoch, readers, c.seed, c.world_size, c.rank, c.batch_size, c.drop_last, c.shuffle,
                balance)

    def _memoised(self, kind: str, epoch: int, compute: Callable[[], _T], readers: int = 1) -> _T:
        """An epoch's plan of one kind, computed once (only the latest plan is kept), or taken
        from this process's plan prepared ahead (``_prepare``) when it is that one."""
        key = self._plan_key(kind, epoch, readers)
        if self._plan_memo is None or self._plan_memo[0] != key:
            local = self._per_process  # another process's (forked): its plan thread is not here
            found, plan = (False, None) if local is None or local.pid != os.getpid() else \
                local.ahead.take(key)
            self._plan_memo = (key, plan if found else compute())
        return cast(_T, self._plan_memo[1])

    def _prepare(self, kind: str, epoch: int, compute: Callable[[], Any], readers: int = 1) -> None:
        """Start computing an epoch's plan on this process's plan thread, for ``_memoised`` to
        take when that epoch starts (one plan ahead at most)."""
        if epoch <= MAX_EPOCH:
            self._local().ahead.prepare(self._plan_key(kind, epoch, readers), compute)

    def plan(self, epoch: int | None = None, num_workers: int = 0) -> EpochPlan:
        """This rank's streaming plan of an epoch (default: the current one) for a DataLoader with
        ``num_workers`` workers (0: read in this process): pools and batches. The pools are sized
        for the workers, so which windows form a batch depends on ``num_workers``; how many
        batches, and their sizes, do not."""
        c, epoch = self.config, self.epoch if epoch is None else epoch
        readers = max(1, int(num_workers))
        return self._memoised("stream", epoch, lambda: plan_epoch(
            self.counts, seed=c.seed, epoch=epoch, world_size=c.world_size, rank=c.rank,
            batch_size=c.batch_size, drop_last=c.drop_last, shuffle=c.shuffle, pool_chunks=self.pool_chunks,
            num_workers=readers,
        ), readers)

    def _resident_plan(self, epoch: int | None = None) -> ResidentPlan:
        """This rank's slice of an epoch's permutation (resident mode; default: the current epoch)."""
        epoch = self.epoch if epoch is None else epoch
        return self._memoised("resident", epoch, self._resident_draw(epoch))

    def _resident_draw(self, epoch: int) -> Callable[[], ResidentPlan]:
        """How to draw an epoch's resident plan: a pure function, safe on another thread."""
        c, resident = self.config, self.resident
        assert resident is not None
        balanced, balance = self._balanced, c.balance

        def compute() -> ResidentPlan:
            rows = None
            if balanced is not None and balance is not None:
                rows = balanced[0].epoch(balanced[1], seed=c.seed, epoch=epoch,
                                         replacement=balance.replacement)
            return resident.plan(seed=c.seed, epoch=epoch, world_size=c.world_size, rank=c.rank,
                                 batch_size=c.batch_size, drop_last=c.drop_last, shuffle=c.shuffle,
                                 epoch_rows=rows)

        return compute

    def label_shares(self) -> dict[int, tuple[float, int]] | None:
        """With ``label_weights``: each drawn label's share of an epoch and its windows in one
        epoch over all ranks (the same every epoch); ``None`` without."""
        if self._balanced is None:
            return None
        rows, total = self._balanced
        return {int(label): (float(share), int(n)) for label, share, n in
                zip(rows.labels, rows.shares, rows.totals(total), strict=True)}

    def delivery_order(self, num_workers: int = 0) -> list[int]:
        """Batch numbers in the order a DataLoader with ``num_workers`` workers yields them this
        epoch (``0``: iterating the dataset itself). Resident mode's order ignores workers."""
        if self.resident is not None:
            return list(range(len(self)))
        return self.plan(num_workers=num_workers).delivery_order(max(1, num_workers)).tolist()

    def batch_indices(self, batch: int, plan: EpochPlan | None = None) -> np.ndarray:
        """Global window indices of batch number ``batch`` of this rank, in the order its rows
        are delivered (see ``delivery_order`` for which batch arrives when)."""
        if self.resident is not None:
            return self.resident.batch_indices(self._resident_plan(), batch)
        plan = plan or self.plan()
        pool = int(plan.batch_pool[batch])
        pieces, ranks = plan.locate(pool, plan.batch_positions(batch))
        reader = self._local().reader
        out = np.empty(len(pieces), dtype=np.int64)
        for piece in np.unique(pieces).tolist():
            where = np.flatnonzero(pieces == piece)
            chunk = int(plan.pools[pool].chunks[piece])
            out[where] = self.selection.selected_indices(reader, chunk)[ranks[where]]
        return out

    # -- reading -----------------------------------------------------------------------------------
    def _local(self) -> _PerProcess:
        """This process's reader, buffers and sink, opened on first use in each process, so
        nothing (sockets, event loops, threads, buffers) crosses a DataLoader worker's fork."""
        if self._per_process is None or self._per_process.pid != os.getpid():
            c = self.config
            location = resolve(self.location.url, self.location.storage_options)
            reader = ChunkReader(location, self._layouts, self.n_windows)
            reader.cache = self._cache
            if self._template is not None:  # the dictionaries read (and checked) in _open
                reader.take_dictionaries_from(self._template)
            info = get_worker_info()
            threads = reader_threads(c.requests, local=location.is_local,
                                     readers=1 if info is None else info.num_workers)
            pool = PoolBuffers(reader, self.selection, with_ldt=c.with_ldt, threads=threads)
            sink = make_sink(BatchLayout(c.batch_size, c.channel_first, c.with_ldt), c.transform,
                             in_worker=info is not None, reuse_slots=c.reuse_batch_memory,
                             transform_ldt=c.transform_ldt)
            self._per_process = _PerProcess(os.getpid(), reader, pool, sink)
        return self._per_process

    def _my_batches(
        self,
        plan_batches: Callable[[int, int], np.ndarray],
        per_worker_counts: Callable[[int], list[int]],
    ) -> np.ndarray:
        """This reader's batch numbers this epoch, after any resume point."""
        info = get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        role, skip = self._progress.start(worker, num_workers, per_worker_counts)
        return plan_batches(role, num_workers)[skip:]

    def __iter__(self) -> Iterator[Batch]:
        progress = self._progress
        progress.follow()
        # Streaming iterations of one process share its pool buffer (memory set by the options,
        # not by the number of iterators): a new one supersedes any older one, which raises if
        # it is resumed instead of yielding windows the new one has overwritten
        local = self._local() if self.resident is None else None
        if local is not None:
            local.iterations += 1
        mine = None if local is None else local.iterations
        batches = iter(self._streamed() if self.resident is None else self._held())
        progress.begin()
        try:
            while True:
                if local is not None and local.iterations != mine:
                    raise RuntimeError(
                        "this iteration of the WindowDataset was superseded: a newer iteration of "
                        "the same dataset started in this process, and streaming iterations share "
                        "its pool buffer. Iterate one at a time (finish or drop the older "
                        "iterator), or make a second WindowDataset."
                    )
                batch = next(batches, None)
                if batch is None:
                    break
                progress.yielded += 1  # counted before handing over: state_dict() names the next batch
                # a SharedBatch only in a DataLoader worker, which the transport turns into a Batch
                yield cast(Batch, batch)
        finally:
            current = self._per_process
            # a superseded iteration leaves the sink to the one that superseded it
            if current is not None and current.pid == os.getpid() and mine in (None, current.iterations):
                current.sink.end_iteration()
        progress.finish()

    def _streamed(self) -> Iterator[Batch | SharedBatch]:
        """This reader's batches of the epoch: its pools, each loaded once, cut into batches.
        Which batches are this reader's is decided now, not when the first one is asked for."""
        info = get_worker_info()
        workers = 0 if info is None else info.num_workers
        plan = self.plan(num_workers=workers)
        batches = self._my_batches(
            plan.worker_batches, lambda k: [len(plan.worker_batches(w, k)) for w in range(k)]
        )
        local = self._local()
        pools = list(dict.fromkeys(int(plan.batch_pool[b]) for b in batches.tolist()))
        following = dict(zip(pools, pools[1:], strict=False))

        def produce() -> Iterator[Batch | SharedBatch]:
            grouped = itertools.groupby(batches.tolist(), key=lambda b: int(plan.batch_pool[b]))
            for number, (pool, in_pool) in enumerate(grouped):
                mine = list(in_pool)
                # the iteration's first batch: decoded on its own ahead of its pool (which reads
                # the pool's chunks twice), unless the pool was prefetched, holds that batch
                # alone, or is all this reader serves this iteration (twice the reads of its epoch)
                key = (plan.epoch, workers, pool)
                alone = (number == 0 and len(mine) > 1 and len(pools) > 1
                         and not local.pool.prefetching(plan.pools[pool], key))
                order = plan.pool_order(pool) if alone else None
                first = None if order is None else plan.batch_positions(mine[0], order)
                loading = local.pool.start(plan.pools[pool], key, first)
                if order is None:  # a prefetch computed it; else drawn while the pool decodes
                    order = loading.order()
                    if order is None:
                        order = plan.pool_order(pool)
                # a prefetch's first batch decoded on its own serves only the batch it was for
                early = loading.early() if loading.early_batch in (None, mine[0]) else None
                if early is not None:
                    yield local.sink(len(early[0]), _early_filler(early))
                for batch in mine[0 if early is None else 1 :]:
                    loaded = loading.wait()
                    rows = loaded.rows[plan.batch_positions(batch, order)]
                    gathered = local.sink(len(rows), _pool_filler(loaded, rows))
                    if batch == mine[0 if early is None else 1] and info is not None:
                        # decode the next pool while this one is served, from its first batch
                        # gathered from the pool on: started before, the decode would delay it
                        if pool in following:
                            ahead = following[pool]
                            local.pool.prefetch((plan.epoch, workers, ahead), plan.pools[ahead],
                                                functools.partial(plan.pool_order, ahead))
                        else:  # this reader's only pool: the next one takes longer to decode
                            self._prefetch_next_epoch(local, plan.epoch, info.id, workers,
                                                      early=len(pools) == 1)
                    if batch == mine[-1] and pool not in following and info is not None:
                        # every batch of the epoch gathered: the bank it was served from is free
                        # for the next epoch's second pool, decoded while this epoch ends
                        self._prefetch_next_epoch(local, plan.epoch, info.id, workers, second=True)
                    yield gathered

        return produce()

    def _prefetch_next_epoch(self, local: _PerProcess, epoch: int, worker: int, workers: int,
                             second: bool = False, early: bool = False) -> None:
        """A DataLoader worker that starts serving its last pool of the epoch starts decoding its
        first pool of the next epoch into its other buffer, while it serves (plans are pure
        functions of the epoch): a persistent worker then starts the next epoch without decoding
        a pool first. ``second``: once it has gathered its last batch of the epoch, its second
        pool of the next epoch, into the buffer it served from (its decode then runs while the
        epoch ends and the next one starts, instead of after the next epoch's first batch). The
        next iteration takes them only if it asks for those pools of that epoch (``set_epoch`` or
        a resume point may ask for others), else they are cancelled. ``early``: the worker serves
        one pool an epoch, which takes less time than the next one's decode (a small store), so
        the next epoch's first batch is decoded on its own first, as in epoch 0."""
        if epoch >= MAX_EPOCH:
            return
        following = self.plan(epoch + 1, workers)
        mine = following.worker_pools(worker, workers)
        which = 1 if second else 0
        if len(mine) > which:
            pool = mine[which]
            batch = int(following.first_batch[pool])
            first = (batch, functools.partial(following.batch_positions, batch)) if early else None
            local.pool.prefetch((epoch + 1, workers, pool), following.pools[pool],
                                functools.partial(following.pool_order, pool), served=second, first=first)

    def _held(self) -> Iterator[Batch | SharedBatch]:
        """Resident mode: this reader's batches of the epoch's permutation (every k-th), gathered
        into this process's sink on the host, by torch where the selection lies on a device.

        On the host, once the first batch is gathered (or at once, for a reader without a
        batch), the next epoch's plan is drawn on this process's plan thread while this epoch is
        served: a persistent DataLoader worker, or the training process, then starts the next
        epoch without drawing a permutation first. The next iteration takes it only if it asks
        for that plan (``set_epoch`` or a resume point may ask for another), else it is dropped."""
        resident, epoch = self.resident, self.epoch
        assert resident is not None
        plan = self._resident_plan(epoch)
        n = plan.n_batches
        batches = self._my_batches(
            lambda worker, k: np.arange(worker, n, k), lambda k: [len(range(w, n, k)) for w in range(k)]
        ).tolist()
        if resident.device.type != "cpu":
            c = self.config
            return (device_batch(resident, plan, batch, c.channel_first, c.transform, c.transform_ldt)
                    for batch in batches)
        sink = self._local().sink

        def produce() -> Iterator[Batch | SharedBatch]:
            for i, batch in enumerate(batches):
                rows = plan.rows(batch).numpy()
                gathered = sink(len(rows), resident.filler(rows))
                if i == 0:
                    self._prepare("resident", epoch + 1, self._resident_draw(epoch + 1))
                yield gathered
            if not batches:
                self._prepare("resident", epoch + 1, self._resident_draw(epoch + 1))

        return produce()

    def __repr__(self) -> str:
        mode = "streaming" if self.resident is None else f"resident={self.resident.device}"
        c = self.config
        return (
            f"WindowDataset({self.location.display!r}, batch_size={c.batch_size}, "
            f"shuffle={c.shuffle}, seed={c.seed}, epoch={self.epoch}, rank={c.rank}/"
            f"{c.world_size}, {mode}, windows={self.windows_per_epoch:,}, batches={len(self)})"
        )


def _pool_filler(loaded: LoadedPool, rows: np.ndarray) -> Filler:
    """Gather ``rows`` of a loaded pool: windows with one take, ldt from the pool's arrays."""

    def fill(x: np.ndarray, ldt: np.ndarray | None) -> None:
        # rows index the reader's own pool buffer, so mode="clip" (3x faster than the default,
        # which buffers the output) never clips
        np.take(loaded.gimu, rows, axis=0, out=x, mode="clip")
        if ldt is not None and loaded.ldt is not None:
            ldt[:, 0] = loaded.ldt[LABEL][rows]
            ldt[:, 1] = loaded.ldt[DEVICE][rows]
            ldt[:, 2] = loaded.ldt[TIMESTAMP][rows]

    return fill


def _early_filler(early: tuple[np.ndarray, dict[str, np.ndarray] | None]) -> Filler:
    """Copy a first batch decoded on its own (``Loading.early``), already in the batch's order."""
    windows, values = early

    def fill(x: np.ndarray, ldt: np.ndarray | None) -> None:
        np.copyto(x, windows)
        if ldt is not None and values is not None:
            ldt[:, 0] = values[LABEL]
            ldt[:, 1] = values[DEVICE]
            ldt[:, 2] = values[TIMESTAMP]

    return fill


def _device_order_refusal(
    url: str, selection: Any, n_devices: int, counts: np.ndarray, pool_chunks: int, batch_size: int,
    world_size: int,
) -> str | None:
    """Why a streamed shuffle of a device-ordered store is refused (None: it mixes well)."""
    if selection.device_ids is not None:
        n_devices = len(selection.device_ids)
    chunks = int((counts > 0).sum())
    if n_devices < 2 or pool_chunks * world_size >= chunks:  # one device, or a pool holds it all
        return None
    # a batch drawn from K single-device chunks has a device-mix (TV) ratio of about sqrt(1 + B/K)
    predicted = math.sqrt(1 + batch_size / pool_chunks)
    if predicted <= 1.3:
        return None
    return (
        f"{url} is stored in device order: streamed, each batch would mix only the devices of "
        f"{pool_chunks} chunk(s) of {chunks} ({n_devices} devices; device-mix ratio about "
        f"{predicted:.1f}, 1.0 = a true shuffle). Train on a shuffled store "
        "(`birdzarr convert SRC DEST --shuffle`), or hold the selection in memory with "
        "resident='cpu' or 'cuda', or pass allow_device_order=True to stream it anyway "
        "(docs/training.md#shuffle-quality)."
    )


def _balance(resident: ResidentSelection, options: BalanceOptions) -> tuple[LabelRows, int]:
    """The resident rows grouped by drawn label, and the epoch's size (checked)."""
    assert resident.labels is not None
    values, counts = np.unique(resident.labels, return_counts=True)
    shares = resolve_shares(options.weights, dict(zip(values.tolist(), counts.tolist(), strict=True)))
    rows = LabelRows.of(resident.labels, shares)
    cap = rows.max_without_replacement()
    if options.replacement:
        return rows, len(resident) if options.epoch_windows is None else options.epoch_windows
    if options.epoch_windows is not None and options.epoch_windows > cap:
        rarest = int(np.argmin(rows.sizes / rows.shares))
        raise ArgumentError(
            f"epoch_windows={options.epoch_windows:,} with replacement=False is more than the selection "
            f"gives: label {int(rows.labels[rarest])} has {int(rows.sizes[rarest]):,} windows for a share of "
            f"{rows.shares[rarest]:.4g}, so an epoch drawing no window twice holds at most {cap:,}. "
            "Lower epoch_windows, or draw with replacement=True")
    if cap < 1:
        raise ArgumentError("label_weights with replacement=False: no epoch can draw every label its share")
    return rows, cap if options.epoch_windows is None else options.epoch_windows
