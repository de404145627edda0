"""Where a ``WindowDataset`` stands in its epochs, and the saved form of that (``state_dict``).

``ResumeState`` is the typed, immutable form of what ``WindowDataset.state_dict()`` returns and
``load_state_dict()`` accepts (a plain dict of version 4: pools sized for and taken by the
DataLoader's workers, so batches and their order depend on ``num_workers``). Two forms share the common keys:

* the training process's: ``next_batch`` (batches delivered this epoch) and ``num_workers``;
* a DataLoader worker's own (torchdata's ``StatefulDataLoader`` snapshots each worker):
  ``start`` and ``start_workers`` (the resume point its iteration began at) and
  ``worker_yielded``, plus ``num_workers``.

``Progress`` is the mutable position of one process: the epoch, the resume point the next
iteration starts from and the batches yielded so far. Persistent DataLoader workers keep their
own copy of the dataset, so the training process publishes its epoch and resume point through a
small shared tensor that workers follow at the start of every iteration (and workers report
their count back through it).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import get_worker_info

from birdzarr._checks import require_int
from birdzarr._errors import ArgumentError
from birdzarr.loader._sampling import resumed_worker

# 3: pools of whole chunks taken by workers; 4: equal batches on every rank, pools cut at batch
# boundaries and sized for num_workers (membership and order depend on num_workers)
STATE_VERSION = 4
# what the batch order depends on: a state saved with other values cannot be resumed
MUST_MATCH = ("seed", "world_size", "batch_size", "pool_chunks", "resident")


@dataclass(frozen=True)
class OrderKey:
    """The configuration a dataset's batch order is a function of (saved with every state)."""

    seed: int
    world_size: int
    rank: int
    batch_size: int
    pool_chunks: int
    resident: bool
    # which windows the epoch holds and how they are drawn (the store's windows and shuffle seed,
    # shuffle, drop_last, the device filters and the split); None in states saved before it was
    # recorded, which are resumed unchecked on these
    selection: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class WorkerSnapshot:
    """A DataLoader worker's own progress."""

    start: int  # the resume point this worker's iteration started from
    start_workers: int  # the num_workers that resume point was counted with (0: unknown)
    yielded: int  # batches of this iteration it yielded, those before a restore included


@dataclass(frozen=True)
class ResumeState:
    """A saved position in an epoch; ``to_dict``/``from_dict`` give the ``state_dict`` format."""

    key: OrderKey
    epoch: int
    num_workers: int
    next_batch: int | None = None  # the training process's form
    worker: WorkerSnapshot | None = None  # a worker's own form

    def to_dict(self) -> dict[str, Any]:
        k = self.key
        state: dict[str, Any] = {
            "version": STATE_VERSION, "seed": k.seed, "epoch": self.epoch, "world_size": k.world_size,
            "rank": k.rank, "batch_size": k.batch_size, "pool_chunks": k.pool_chunks, "resident": k.resident,
            "selection": None if k.selection is None else dict(k.selection),
        }
        if self.worker is not None:
            return {**state, "start": self.worker.start, "start_workers": self.worker.start_workers,
                    "worker_yielded": self.worker.yielded, "num_workers": self.num_workers}
        return {**state, "next_batch": self.next_batch, "num_workers": self.num_workers}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> ResumeState:
        """Read a ``state_dict()``; refuses other versions (their batch order differs) and
        anything that is not one."""
        if not isinstance(state, Mapping):
            raise TypeError("load_state_dict takes what state_dict() returned (a dict), got "
                            f"{type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"cannot resume from WindowDataset state version {state.get('version')!r}: this "
                f"birdzarr writes and reads version {STATE_VERSION}, whose batch order differs. "
                "Restart the epoch (call set_epoch without load_state_dict) or use the birdzarr "
                "version that saved the state."
            )
        in_worker = "worker_yielded" in state
        position = ("start", "start_workers", "worker_yielded") if in_worker else ("next_batch",)
        for name in (*MUST_MATCH, "rank", "epoch", "num_workers", *position):
            if name not in state:
                raise ValueError(f"not a WindowDataset state_dict: it has no {name!r} "
                                 f"(keys: {sorted(state)})")
        for name in ("epoch", "num_workers", *position):
            value = state[name]
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"not a WindowDataset state_dict: {name} is {value!r}, "
                                 "not an integer of 0 or more")
        check_epoch(state["epoch"])
        key = OrderKey(state["seed"], state["world_size"], state["rank"], state["batch_size"],
                       state["pool_chunks"], state["resident"], state.get("selection"))
        if "worker_yielded" in state:
            worker = WorkerSnapshot(
                int(state["start"]), int(state["start_workers"]), int(state["worker_yielded"])
            )
            return cls(key, int(state["epoch"]), int(state["num_workers"]), worker=worker)
        return cls(key, int(state["epoch"]), int(state["num_workers"]), next_batch=int(state["next_batch"]))

    def check_resumable(self, current: OrderKey) -> None:
        """Raise unless a dataset configured as ``current`` yields the order this state was saved in."""
        for name in MUST_MATCH:
            saved, now = getattr(self.key, name), getattr(current, name)
            if saved != now:
                raise ValueError(
                    f"cannot resume: the state was saved with {name}={saved!r}, this dataset "
                    f"has {name}={now!r}; the order would differ"
                )
        if self.key.selection is None or current.selection is None:
            return
        for name in sorted({*self.key.selection, *current.selection}):
            saved, now = self.key.selection.get(name), current.selection.get(name)
            if saved != now:
                raise ValueError(
                    f"cannot resume: the state was saved with {name}={saved!r}, this dataset "
                    f"has {name}={now!r}; the epoch's windows would differ (some twice, some never)"
                )


MAX_EPOCH = 2**31 - 1  # far beyond any training run; the shared control tensor holds it exactly


def check_epoch(epoch: object) -> int:
    """An epoch number: an integer from 0 to ``MAX_EPOCH`` (-1 marks "no resume point" in the
    shared control tensor, and a float would be truncated into another epoch's order)."""
    value = require_int("epoch", epoch)
    if not 0 <= value <= MAX_EPOCH:
        raise ArgumentError(f"epoch must be from 0 to {MAX_EPOCH:,}, got {value}")
    return value


# Slots of the shared control tensor (training process -> persistent workers, and back).
_EPOCH, _RESUME_AT, _RESUME_EPOCH, _RESUME_WORKERS, _NUM_WORKERS = range(5)


class Progress:
    """One process's position: the epoch, the resume point, and the batches yielded."""

    def __init__(self) -> None:
        self.epoch = 0
        self.resume_at = 0  # delivered-batch position the next iteration starts from
        self.resume_epoch: int | None = None
        self.resume_workers = 0  # num_workers the resume point was counted with (0: unknown)
        self.yielded = 0
        self.skip_own = 0  # batches this worker already yielded before a StatefulDataLoader resume
        self.restored_here = False  # restore() ran in this worker (StatefulDataLoader)
        # [epoch, resume_at, resume_epoch or -1, resume_workers, num_workers seen] in shared memory
        self.control = torch.tensor([0, 0, -1, 0, 0], dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch; a resume point of another epoch is dropped."""
        self.epoch = check_epoch(epoch)
        if self.resume_epoch is not None and self.resume_epoch != self.epoch:
            self.resume_at, self.resume_epoch, self.skip_own = 0, None, 0
        self.publish()

    def publish(self) -> None:
        """Share the epoch and resume point with (persistent) workers; the training process only."""
        if get_worker_info() is None:
            resume_epoch = -1 if self.resume_epoch is None else self.resume_epoch
            self.control[:4] = torch.tensor([self.epoch, self.resume_at, resume_epoch, self.resume_workers])

    def follow(self) -> None:
        """At the start of an iteration: in a worker, take the epoch and resume point the training
        process set last; everywhere, report the number of readers."""
        info = get_worker_info()
        self.control[_NUM_WORKERS] = 1 if info is None else info.num_workers
        if info is None:
            return
        if self.restored_here:  # a worker's own restored state wins for the iteration it resumes
            self.restored_here = False
            return
        epoch, resume_at, resume_epoch, resume_workers, _ = self.control.tolist()
        self.epoch, self.resume_at, self.skip_own = epoch, resume_at, 0
        self.resume_epoch = None if resume_epoch < 0 else resume_epoch
        self.resume_workers = resume_workers
        if self.resume_epoch != self.epoch:
            self.resume_at, self.resume_workers = 0, 0

    def start(
        self, worker: int, num_workers: int, per_worker_counts: Callable[[int], list[int]]
    ) -> tuple[int, int]:
        """(role, skip): whose batch list reader ``worker`` of ``num_workers`` continues this
        iteration, and how many of that list's batches were already delivered."""
        role, skip = worker, 0
        if self.resume_at:
            saved = self.resume_workers or num_workers
            if saved != num_workers:
                here = ("reads in the training process (num_workers=0)" if get_worker_info() is None
                        else f"has num_workers={num_workers}")
                then = f"num_workers={saved}" if saved > 1 else "num_workers=0 or 1"
                raise ValueError(
                    f"cannot resume: the resume point was counted with {then}, this loader "
                    f"{here}; which windows form a batch and the order batches arrive in depend "
                    f"on num_workers. Resume with {then}."
                )
            role, skip = resumed_worker(per_worker_counts(num_workers), self.resume_at, worker)
        return role, skip + self.skip_own

    def begin(self) -> None:
        """The first batch of an iteration is about to be produced."""
        self.yielded = self.skip_own
        self.skip_own = 0

    def finish(self) -> None:
        """An iteration ran to its end. In the training process that consumes the resume point."""
        if get_worker_info() is None:
            self.yielded += self.resume_at
            self.resume_at, self.resume_epoch, self.resume_workers = 0, None, 0
            self.publish()

    def snapshot(self, key: OrderKey, batches_seen: int | None) -> ResumeState:
        """The state to save (see ``WindowDataset.state_dict``)."""
        info = get_worker_info()
        if info is not None and batches_seen is None:  # inside a worker: its own progress
            worker = WorkerSnapshot(self.resume_at, self.resume_workers, self.yielded)
            return ResumeState(key, self.epoch, info.num_workers, worker=worker)
        seen = self.yielded if batches_seen is None else int(batches_seen)
        workers = int(self.control[_NUM_WORKERS]) or 1
        return ResumeState(key, self.epoch, workers, next_batch=self.resume_at + seen)

    def restore(self, saved: ResumeState) -> None:
        """Resume: the next iteration of ``saved.epoch`` starts at its next batch."""
        self.epoch = saved.epoch
        self.resume_epoch = self.epoch
        self.yielded = 0
        self.skip_own = 0
        if saved.worker is not None:  # a worker's own snapshot, restored into that worker
            self.resume_at, self.skip_own = saved.worker.start, saved.worker.yielded
            self.resume_workers = saved.worker.start_workers
        else:
            assert saved.next_batch is not None
            self.resume_at = saved.next_batch
            self.resume_workers = saved.num_workers
        self.restored_here = get_worker_info() is not None
        self.publish()
