"""A resident batch's gather on a CUDA device, replayed from one captured CUDA graph.

Why: the gather and decode of a batch held on a GPU are 6-10 small torch ops (``HeldCodes.decode``:
index_selects, an add, copies; then the channel-first copy and ``ldt``). On an H200 their GPU time
is ~50 us for 8,192 windows, but launching them one by one costs ~190 us of the training process's
CPU, and a small model's training step is itself bound by that CPU: fed from data already on the
GPU a step took 1.77 ms, fed by ``resident="cuda"`` 2.17 ms (0.81x; ``benchmarks/gpu.py``). A graph
replays all of them in one launch: what is left per batch is copying the batch's row numbers in,
the replay, and copying the result out (the graph writes into the same memory every replay, and
a caller may keep a batch while asking for the next one).

The held tensors never move once loaded, so one capture serves every full batch of every epoch;
a batch of another size (an epoch's last) runs the ops one by one. Memory: the graph's private
pool holds one batch's intermediates, by their sizes about ``batch_size x 1.3 KB`` (11 MB at 8,192
windows: index, values, output and its channel-first copy).
If capture fails (an op this torch cannot capture), the ops run one by one from then on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

Gathered = tuple[torch.Tensor, torch.Tensor | None]


class GraphedGather:
    """``gather(rows)`` for batches of one size, from a graph captured on first use."""

    def __init__(self, gather: Callable[[torch.Tensor], Gathered], device: torch.device) -> None:
        self._gather = gather  # the eager ops: resident rows (int64, on ``device``) -> (x, ldt)
        self._device = device
        self._size: int | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._rows: torch.Tensor | None = None
        self._out: Gathered | None = None
        self.failed = False  # capture failed: every batch runs the ops one by one

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, rows: torch.Tensor) -> Gathered:
        if self.failed or (self._size is not None and len(rows) != self._size):
            return self._gather(rows)
        if self._graph is None:
            self._capture(len(rows))
            if self._graph is None:
                return self._gather(rows)
        assert self._rows is not None and self._out is not None
        self._rows.copy_(rows, non_blocking=True)
        self._graph.replay()
        x, ldt = self._out
        return x.clone(), None if ldt is None else ldt.clone()

    def _capture(self, size: int) -> None:
        self._size = size
        with torch.cuda.device(self._device):
            rows = torch.zeros(size, dtype=torch.int64, device=self._device)
            try:
                # warm up on a side stream (torch's recipe: lazy initialisation stays out of the graph)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._gather(rows)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = self._gather(rows)
            except RuntimeError as error:  # not capturable here: stay correct, only slower
                self.failed = True
                warnings.warn(f"resident batches on {self._device} run op by op: CUDA graph capture failed "
                              f"({str(error).splitlines()[0]})", RuntimeWarning, stacklevel=3)
                return
        self._rows, self._out, self._graph = rows, out, graph
