"""Resident mode: the selection held once in memory (a GPU's, or shared host memory), a full
permutation drawn every epoch, batches gathered where the data lies.

Loading reads every chunk once through the same fetch path as streaming (local files, S3, the
chunk cache), many chunks in flight, with a progress bar. A dict16 store stays dictionary-coded
in memory: uint16 codes plus per-channel dictionaries, one shared by each run of consecutive
chunks whose values fit 16-bit codes (``_shared_dictionaries``), decoded inside the batch
gather. The codes are 122 B a window with gps_speed held once a window (``_code_layout``), 160 B
where some window's gps_speed varies (found while loading: the load then starts again with all
80 codes). A version-2 store (``birdzarr.format._v2``) is held as its own arrays (``HeldCodes``):
uint16 codes (120 B a window), the dictionary row of each window (4 B), gps_speed once a window
(4 B; 80 B where some window's gps_speed varies, found while loading as for dict16): 128 B a
window, 0.40x float32 (204 B, 0.64x, with varying gps_speed), one row a window on the host
(``HeldCodes.packed``: a batch's gather reads two cache lines a window); plus the dictionary
rows the selection uses (4 B an entry, 240 B a row), merged while loading into groups of
consecutive rows that share values (``held_dictionaries``, ``share_rows``: a union a channel of
at most 65,535 entries, the codes recoded into it, consecutive rows on the same entries one held
row). On 1 M windows cut from one calibrated sequence the table held 1.51 M entries (186
devices) and 3.57 M (100,000 devices) before, 10,993 and one row after: an epoch took 0.48x and
0.40x the CPU seconds, and 100,000 devices 1.06x the CPU of 186 (1.52x before); making the
dataset (the load) took about +0.6 and +1.0 CPU s (``benchmarks/many_devices.py --steps
resident_epoch``, docs/scaling.md#many-small-devices). Rows calibrated one by one do not merge
(held as stored).
They are decoded inside the gather as ``values[start[row, c] + code]``: by torch ops on a GPU
(``HeldCodes.decode``), by numpy on the host (``HeldCodes.decode_host``, the windows grouped by
dictionary row for the lookup). Any other store, or ``codes=False``, is held as
float32 (320 B a window). ``ldt`` adds 16 B a window. The bytes needed are checked against what
the device (free GPU memory) or the process (cgroup limit, available RAM, /dev/shm) can give
before anything is allocated.

Each epoch, one permutation of all selected windows is drawn from ``(seed, epoch)`` with a torch
generator on the holding device; rank ``r`` takes a contiguous slice of it, split and cut into
batches as streaming's plan does (``_sampling``: every window once over all ranks, the same
number of batches of the same size); DataLoader workers (``resident="cpu"``) take every ``k``-th batch
of their rank, so the order does not depend on ``num_workers``.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from birdzarr._errors import ResidentMemoryError
from birdzarr._progress import progress_bar
from birdzarr.convert._cpus import usable_cpus
from birdzarr.format import _v2
from birdzarr.format._codec import constant_rows
from birdzarr.format._spec import DEVICE, GIMU, LABEL, N_CHANNELS, TIMESTAMP, WINDOW_LENGTH
from birdzarr.loader._code_layout import ONCE_A_WINDOW, CodeLayout
from birdzarr.loader._sampling import batch_sizes, rank_starts, rank_window_counts
from birdzarr.loader._shared_dictionaries import share_dictionaries, share_rows
from birdzarr.store._chunks import ChunkReader
from birdzarr.store._selection import Selection

_VALUES = WINDOW_LENGTH * N_CHANNELS  # 80 float32 values a window
# ldt is held as one (n, 4) int32 row a window: label, device, then the int64 timestamp's two
# little-endian halves. One row is one cache line's gather; three separate arrays cost three
# (0.18 vs 0.30 ms a batch of 8192 from 2.5 M windows, ``benchmarks/resident_decode.py``).
_LDT_COLUMNS = 4
_HEADROOM = 0.9  # use at most 90% of what is free: allocators and the batches need some room


@dataclass(frozen=True)
class ResidentPlan:
    """One rank's epoch in resident mode: its slice of the epoch's permutation."""

    order: torch.Tensor  # resident row numbers of this rank's windows, on the holding device
    offsets: np.ndarray  # batch boundaries in ``order``; len n_batches + 1

    @property
    def n_batches(self) -> int:
        return len(self.offsets) - 1

    def rows(self, batch: int) -> torch.Tensor:
        """Resident rows of one batch, in the permutation's order: any slice of a batch (a
        micro-batch) is a uniform sample too, also on a device-ordered store."""
        return self.order[int(self.offsets[batch]) : int(self.offsets[batch + 1])]


# Codes are held biased by -2**15 (``code ^ 0x8000`` as int16: torch indexes no uint16) and each
# row's starts raised by 2**15, so that one int16 + int32 add gives a value's index.
CODE_BIAS = 2**15
# Windows a host decode takes at once in a process with several torch threads: 60 codes a
# window stay below torch's parallel grain (at::internal::GRAIN_SIZE, 32,768 elements)
_HOST_SLICE = 512
# In a process with several torch threads (the training process; a DataLoader worker has one),
# a host decode's lookups go through torch.index_select (int32 indices, no int64 copy as np.take
# makes) this many at a time: below torch's parallel grain, as _HOST_SLICE. With one thread they
# go in one call (a call costs ~5 us: 0.90x the time of 30,720 a call, measured on the loader
# benchmark's store)
_LOOKUP_SLICE = _HOST_SLICE * WINDOW_LENGTH * 3
# The 16 bytes of a sample (imu x, y, z and gps_speed) as one item: the looked-up values are
# copied into the batch's (n, 20, 4) array a sample at a time, reading 16 bytes at a 12-byte
# stride (the fourth value, the next sample's first, is then overwritten by gps_speed): with
# the gather before it, half the time of the same with 12-byte items (1.6 ms a batch of 8192)
_SAMPLE = np.dtype((np.void, 4 * N_CHANNELS))
# A window's row of the host layout (``HeldCodes.packed``, int16 columns): its 60 codes, its
# dictionary row (int32, two columns) and gps_speed (float32: two columns, or 40 in every sample)
_PACKED_ROW = WINDOW_LENGTH * _v2.N_CODED
_PACKED_GPS = _PACKED_ROW + 2


def packed_width(gps_once: bool) -> int:
    """int16 columns of a window's row in the host layout: 64 (128 B, two cache lines) with
    gps_speed once a window, 102 with gps_speed in every sample."""
    return _PACKED_GPS + 2 * (1 if gps_once else WINDOW_LENGTH)


@dataclass(frozen=True)
class HeldCodes:
    """A version-2 store's selection as held (``birdzarr.format._v2``'s arrays): a window's codes,
    dictionary row and gps_speed, and the dictionary rows the selection uses, renumbered.

    ``decode`` is the documented decode, ``x[:, :, c] = values[start[row, c] + codes[:, :, c]]``
    and channel 3 = gps_speed, in torch ops (``index_select``, an add, copies), as a GPU runs it;
    ``decode_host`` gives the same values with numpy on the host (DataLoader workers and the
    training process with ``resident="cpu"``). Bytes a window: 120 (codes) + 4 (row) + 4
    (gps_speed once a window) or 80 (in every sample); and 4 an entry plus 240 a row for the
    dictionaries. On the host the three lie in one row a window (``packed``, of which ``codes``,
    ``row`` and ``gps`` are views): a batch's gather reads two cache lines a window instead of
    four (three arrays), in one call."""

    codes: torch.Tensor  # int16 (n, 20, 3): code - CODE_BIAS
    gps: torch.Tensor  # float32 (n,) (one gps_speed a window) or (n, 20)
    row: torch.Tensor  # int32 (n,): the window's dictionary row among the rows held
    values: torch.Tensor  # float32 (M,): the held rows' entries, row after row, channel after channel
    # int32 (int64 past 2**31 entries) (R, 60): start[r, c] + CODE_BIAS in the layout of a window's
    # codes (sample-major), so that a window's indices are its row's offsets plus its codes, one
    # add of two contiguous arrays (torch broadcasting (n, 1, 3) starts over the samples is slower)
    offsets: torch.Tensor
    # int16 (n, packed_width): codes, row and gps_speed of a window in one row (``host_layout``),
    # where codes, gps and row are its views; None where they are arrays of their own (on a GPU)
    packed: torch.Tensor | None = None

    @classmethod
    def host_layout(cls, n: int, gps_once: bool, shared: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Uninitialised host arrays of ``n`` windows in the host layout: ``(packed, codes, gps,
        row)``, the last three views of the first (in shared memory where ``shared``)."""
        packed = _host_empty((n, packed_width(gps_once)), torch.int16, shared)
        codes = packed[:, :_PACKED_ROW].view(n, WINDOW_LENGTH, _v2.N_CODED)
        row = packed[:, _PACKED_ROW:_PACKED_GPS].view(torch.int32).view(n)
        gps = packed[:, _PACKED_GPS:].view(torch.float32)
        return packed, codes, gps.view(n) if gps_once else gps, row

    @property
    def nbytes(self) -> int:
        held = (self.codes, self.gps, self.row) if self.packed is None else (self.packed,)
        return sum(t.numel() * t.element_size() for t in (*held, self.values, self.offsets))

    @property
    def start(self) -> torch.Tensor:
        """The held rows' ``dict_start`` (R, 3), renumbered as ``row`` is."""
        return self.offsets[:, : _v2.N_CODED] - CODE_BIAS

    def to(self, device: torch.device) -> HeldCodes:
        """The held arrays on ``device``, each an array of its own (``decode``'s torch ops)."""
        return HeldCodes(*(t.to(device).contiguous() for t in (self.codes, self.gps, self.row, self.values,
                                                               self.offsets)))

    def decode(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 windows ``(len(rows), 20, 4)`` of the held ``rows`` (int64, on the holding
        device), into ``out`` where given.

        On the host with more than one torch thread (the training process; a DataLoader worker
        has one), ``_HOST_SLICE`` windows at a time: every op then stays below torch's parallel
        grain and never wakes its intra-op threads, which on a busy machine each such op waits
        for (measured on the loaded 2-core machine: 0.15 against 0.6-0.7 M windows/s in one
        thread; ``python benchmarks/resident_decode.py --loader``, 0 workers, shows the epoch)."""
        n = len(rows)
        if out is None:
            out = torch.empty((n, WINDOW_LENGTH, N_CHANNELS), dtype=torch.float32, device=self.values.device)
        step = _HOST_SLICE if rows.device.type == "cpu" and torch.get_num_threads() > 1 else max(n, 1)
        for first in range(0, n, step):
            self._decode(rows[first : first + step], out[first : first + step])
        return out

    def _decode(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        n = len(rows)
        index = self.offsets.index_select(0, self.row.index_select(0, rows))  # (n, 60)
        index += self.codes.index_select(0, rows).view(index.shape)
        out[:, :, : _v2.N_CODED] = self.values.index_select(0, index.view(-1)).view(n, WINDOW_LENGTH, -1)
        gps = self.gps.index_select(0, rows)
        out[:, :, _v2.N_CODED] = gps if gps.dim() == 2 else gps.unsqueeze(1)

    def decode_host(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """``decode`` on the host, with numpy: the float32 windows ``(len(rows), 20, 4)`` of the
        held ``rows`` (int64), into ``out`` (C-contiguous) where given. The same values, bit for bit.

        One gather of the windows' rows of the host layout (codes, dictionary row and gps_speed:
        two cache lines a window, one call); each window's row offsets plus its codes give the
        index, one table lookup gives the values, which go into ``out`` a sample (16 bytes) at a
        time, and gps_speed is written over each sample's fourth value: four passes over the
        batch, each one numpy call (the lookup: ``torch.index_select``, in ``_LOOKUP_SLICE``
        indices a call where torch has several threads, so that it never wakes them), the
        temporaries kept per thread. The lookups go in the batch's order: grouping the windows
        by dictionary row first (a sort, a second gather, the order restored) kept each device's
        lookups inside its few tens of KB of dictionary but cost about what it saved: in the
        batch's order the decode took 0.97x (1.03x after a cache flush) on the loader
        benchmark's 186 devices (5.8 MiB of dictionaries), and 1.10x, 0.95x and 0.93x on
        synthetic dictionaries of 186, 1,860 and 6,000 rows (6, 57 and 185 MiB: the more rows,
        the fewer windows of a batch share one). ``python benchmarks/resident_decode.py`` times
        it against ``decode``."""
        n = len(rows)
        if out is None:
            out = np.empty((n, WINDOW_LENGTH, N_CHANNELS), np.float32)
        if not out.flags.c_contiguous:  # the window-wide gather below needs out's own memory
            out[...] = self.decode_host(rows)
            return out
        if n == 0:
            return out
        width = packed_width(self.gps.dim() == 1)
        taken = _scratch("taken", (n, width), np.int16)
        if self.packed is not None:
            np.take(self.packed.numpy(), rows, axis=0, out=taken, mode="clip")  # clip: out= unbuffered
        else:  # arrays of their own: gathered into the same layout
            held = self.codes.numpy().view()
            held.shape = (len(held), _PACKED_ROW)  # raises rather than copy the held codes
            np.take(held, rows, axis=0, out=taken[:, :_PACKED_ROW])
            taken[:, _PACKED_ROW:_PACKED_GPS] = np.take(self.row.numpy(), rows).view(np.int16).reshape(n, 2)
            gps = np.take(self.gps.numpy(), rows, axis=0)
            taken[:, _PACKED_GPS:] = gps.view(np.int16).reshape(n, width - _PACKED_GPS)
        offsets = self.offsets.numpy()
        index = _scratch("index", (n, _PACKED_ROW), offsets.dtype)
        row = taken[:, _PACKED_ROW:_PACKED_GPS].view(np.int32)[:, 0]
        np.take(offsets, row, axis=0, out=index, mode="clip")
        np.add(index, taken[:, :_PACKED_ROW], out=index)  # int16 (code - CODE_BIAS) + (start + CODE_BIAS)
        # one more sample's worth: the last sample's 16-byte read below stays inside
        looked_up = _scratch("looked_up", (index.size + N_CHANNELS,), np.float32)
        flat_index = torch.from_numpy(index.reshape(-1))
        flat_values = torch.from_numpy(looked_up[: index.size])
        step = _LOOKUP_SLICE if torch.get_num_threads() > 1 else index.size
        for first in range(0, index.size, step):
            last = first + step
            torch.index_select(self.values, 0, flat_index[first:last], out=flat_values[first:last])
        samples = np.ndarray((n * WINDOW_LENGTH,), _SAMPLE, buffer=looked_up, strides=(4 * _v2.N_CODED,))
        np.copyto(out.reshape(-1).view(_SAMPLE), samples)
        out[:, :, _v2.N_CODED] = taken[:, _PACKED_GPS:].view(np.float32)  # (n, 1) or (n, 20)
        return out


def memory_limit() -> tuple[int, str]:
    """Bytes this process may still allocate on the host, and what sets that limit."""
    limits: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        limits.append((info["MemAvailable"], "available RAM (/proc/meminfo)"))
    except (OSError, KeyError, ValueError):
        pass
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f_limit, open(usage_file) as f_used:
                raw, used = f_limit.read().strip(), int(f_used.read().strip())
        except (OSError, ValueError):
            continue
        if raw.isdigit() and int(raw) < 2**60:
            what = f"the job's memory limit ({limit_file}: {int(raw) / 2**30:.1f} GiB)"
            limits.append((int(raw) - used, what))
    try:
        shm = os.statvfs("/dev/shm")
        limits.append((shm.f_bavail * shm.f_frsize, "free space in /dev/shm (shared memory)"))
    except OSError:
        pass
    if not limits:
        return 2**62, "no limit found"
    return min(limits)


class ResidentSelection:
    """The selected windows of a store, held on ``device``."""

    def __init__(self, device: torch.device, x: torch.Tensor, table: torch.Tensor | None,
                 row_offsets: torch.Tensor | None, chunk_bounds: torch.Tensor | None,
                 ldt: torch.Tensor | None, global_index: np.ndarray,
                 layout: CodeLayout | None = None, coded: HeldCodes | None = None) -> None:
        self.device = device
        # float32 (n, 20, 4), int16 dict16 codes (n, layout.width) when table is set, or a version-2
        # store's int16 codes (n, 20, 3) when coded is set
        self.x = x
        self.coded = coded  # a version-2 store's held arrays (None: float32 or dict16)
        self.table = table  # float32: the shared dictionaries, group after group, channel after channel
        # int32 (chunks, layout.width): where each code's dictionary starts in the table, per chunk
        self.row_offsets = row_offsets
        self.chunk_bounds = chunk_bounds  # int64: first resident row of each chunk; len chunks + 1
        self.ldt = ldt  # int32 (n, 4): label, device, timestamp low and high halves
        self.global_index = global_index  # the store's window index of each resident row
        self.labels: np.ndarray | None = None  # int32 label of each resident row (class-balanced sampling)
        self.layout = layout  # where a window's codes lie in its row (None: float32)
        # each of a window's 80 values' column in its row of codes (None: the row is the window)
        self._expand_host = None if layout is None else layout.expand()
        self._expand = None if self._expand_host is None else torch.from_numpy(self._expand_host).to(device)
        self.plans_drawn = 0  # epochs' plans drawn by this process (tests count them)
        self._graphs: dict[bool, Any] = {}  # a CUDA device's captured gathers, by channel_first

    def __len__(self) -> int:
        return len(self.global_index)

    @property
    def nbytes(self) -> int:
        tensors = [self.x, self.table, self.row_offsets, self.chunk_bounds, self.ldt]
        if self.coded is not None:  # x is coded.codes
            tensors = [self.ldt]
        held = 0 if self.coded is None else self.coded.nbytes
        return held + sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # -- loading -------------------------------------------------------------------------------
    @classmethod
    def load(cls, opened: Any, selection: Selection, *, device: str | torch.device | bool, with_ldt: bool,
             prefetch: int, progress: bool = True, codes: bool = True, labels: bool = False
             ) -> ResidentSelection:
        """Read the selection into memory; ``labels`` also keeps each window's label on the host
        (int32, 4 B a window) for class-balanced sampling."""
        target = torch.device("cpu" if device is True else device)
        reader: ChunkReader = opened.reader
        chunks = [c for c in range(reader.n_chunks)]
        with ThreadPoolExecutor(max_workers=max(4, prefetch)) as threads:
            picked = list(threads.map(lambda c: selection.selected_indices(reader, c), chunks))
        keep = [(c, rows) for c, rows in zip(chunks, picked, strict=True) if len(rows)]
        n = sum(len(rows) for _, rows in keep)
        if codes and getattr(reader, "format_version", 1) >= 2:
            return cls._load_format2(target, reader, keep, n, with_ldt, prefetch, progress, opened.url,
                                     labels)
        coded = codes and reader.layouts[GIMU].chain == "dict16"
        layout = CodeLayout(ONCE_A_WINDOW) if coded else None
        while True:
            per_window = ((4 * _VALUES if layout is None else 2 * layout.width) + (16 if with_ldt else 0)
                          + (4 if labels else 0))
            dictionaries = 0 if layout is None else len(keep) * 4 * 4096 * 4
            cls._check_budget(target, n * per_window + dictionaries, n, opened.url, layout is not None)
            try:
                return cls._load(target, reader, keep, n, layout, with_ldt, prefetch, progress, opened.url,
                                 labels)
            except _NotCodable:  # a raw-mode chunk: too many distinct values for 16-bit codes
                layout = None
            except _NotOnceAWindow:  # some window's gps_speed varies: all 80 codes a window
                layout = CodeLayout()

    @staticmethod
    def _check_budget(device: torch.device, needed: int, n: int, url: str, coded: bool) -> None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            limit, what = int(free), f"free memory on {device}"
        else:
            limit, what = memory_limit()
        if needed > _HEADROOM * limit:
            form = "16-bit dictionary codes" if coded else "float32"
            raise ResidentMemoryError(
                f"{url}: holding the selection ({n:,} windows as {form}) needs {_size(needed)}, "
                f"but {what} is {_size(limit)}. Stream instead (resident=False, on a "
                "store converted with --shuffle), select fewer devices, or use a device with more memory."
            )

    @classmethod
    def _load_format2(cls, device: torch.device, reader: ChunkReader, keep: list[tuple[int, np.ndarray]],
                      n: int, with_ldt: bool, prefetch: int, progress: bool, url: str, with_labels: bool
                      ) -> ResidentSelection:
        """A version-2 store's selection as its codes (``HeldCodes``): gps_speed once a window
        unless some window's varies (then the load starts again with it in every sample)."""
        dictionaries = reader.dictionaries()
        if dictionaries.n_rows >= 2**31:
            raise ValueError(f"{url}: {dictionaries.n_rows:,} dictionary rows; resident mode holds "
                             "fewer than 2**31")
        # at most every row, with int64 offsets: the rows the selection uses are known only once
        # loaded (merging them stays within 4 B an entry and 480 B a row: held_dictionaries)
        table = len(dictionaries.values) * 4 + dictionaries.n_rows * WINDOW_LENGTH * _v2.N_CODED * 8
        once = True
        while True:
            per_window = (format2_window_bytes(once) + (16 if with_ldt else 0) + (4 if with_labels else 0))
            cls._check_budget(device, n * per_window + table, n, url, True)
            try:
                return cls._load_format2_once(device, reader, dictionaries, keep, n, once, with_ldt,
                                              prefetch, progress, url, with_labels)
            except _NotOnceAWindow:
                once = False

    @classmethod
    def _load_format2_once(cls, device: torch.device, reader: ChunkReader, dictionaries: _v2.Dictionaries,
                           keep: list[tuple[int, np.ndarray]], n: int, once: bool, with_ldt: bool,
                           prefetch: int, progress: bool, url: str, with_labels: bool) -> ResidentSelection:
        shared = device.type == "cpu"  # host copies live in shared memory: DataLoader workers share them
        starts = np.concatenate(([0], np.cumsum([len(rows) for _, rows in keep]))).astype(np.int64)
        # the host layout (one row a window) also where it only stages the copy to a GPU: the
        # copy moves the three arrays apart
        packed, codes, gps, row = HeldCodes.host_layout(n, once, shared)
        codes_np, gps_np, row_np = codes.numpy(), gps.numpy(), row.numpy()
        ldt = _host_empty((n, _LDT_COLUMNS), torch.int32, shared) if with_ldt else None
        ldt_np = None if ldt is None else ldt.numpy()
        labels_np = np.empty(n, np.int32) if with_labels else None

        def load_one(i: int) -> int:
            chunk, rows = keep[i]
            first, stop = reader.chunk_span(chunk)
            local = rows - first
            at = slice(int(starts[i]), int(starts[i + 1]))
            # only the selected windows are gathered from the decompressed chunk (and checked)
            selected = None if len(rows) == stop - first else local
            chunk_codes, chunk_row, speeds = reader.read_coded(chunk, selected)
            # code - CODE_BIAS as int16, written straight into the held codes
            np.bitwise_xor(chunk_codes, np.uint16(CODE_BIAS), out=codes_np[at].view(np.uint16))
            row_np[at] = chunk_row  # below 2**31: checked against the row count above
            if once:
                if not constant_rows(speeds.view(np.uint32)):  # bit patterns: NaN and -0.0 too
                    raise _NotOnceAWindow
                gps_np[at] = speeds[:, 0]
            else:
                gps_np[at] = speeds
            _fill_ldt(reader, chunk, local, ldt_np, labels_np, at)
            return len(rows)

        _load_chunks(load_one, len(keep), n, prefetch=prefetch, progress=progress, url=url)
        values, offsets = held_dictionaries(dictionaries, row_np, codes_np,
                                            threads=min(prefetch, usable_cpus()))
        held = HeldCodes(codes, gps, row, torch.from_numpy(values), torch.from_numpy(offsets), packed)
        global_index = np.concatenate([rows for _, rows in keep]) if keep else np.empty(0, np.int64)
        if device.type != "cpu":
            held = held.to(device)
            ldt = None if ldt is None else ldt.to(device)
        selection = cls(device, held.codes, None, None, None, ldt, global_index.astype(np.int64), coded=held)
        selection.labels = labels_np
        return selection

    @classmethod
    def _load(cls, device: torch.device, reader: ChunkReader, keep: list[tuple[int, np.ndarray]], n: int,
              layout: CodeLayout | None, with_ldt: bool, prefetch: int, progress: bool, url: str,
              with_labels: bool = False) -> ResidentSelection:
        shared = device.type == "cpu"  # host copies live in shared memory: DataLoader workers share them
        starts = np.concatenate(([0], np.cumsum([len(rows) for _, rows in keep]))).astype(np.int64)
        shape = (n, WINDOW_LENGTH, N_CHANNELS) if layout is None else (n, layout.width)
        host_x = _host_empty(shape, torch.float32 if layout is None else torch.int16, shared)
        x_np = host_x.numpy()
        ldt = _host_empty((n, _LDT_COLUMNS), torch.int32, shared) if with_ldt else None
        ldt_np = None if ldt is None else ldt.numpy()
        labels_np = np.empty(n, np.int32) if with_labels else None
        dictionaries: list[list[np.ndarray]] = [[] for _ in keep]
        width = reader.chunk_windows

        def load_one(i: int) -> int:
            chunk, rows = keep[i]
            start, stop = reader.chunk_span(chunk)
            local = rows - start
            at = slice(int(starts[i]), int(starts[i + 1]))
            if layout is not None:
                got = reader.read_codes(chunk)
                if got is None:  # a raw-mode chunk: too many distinct values for 16-bit codes
                    raise _NotCodable
                codes, dictionaries[i] = got
                by_window = codes.reshape(N_CHANNELS, width, WINDOW_LENGTH)[:, local, :].view(np.int16)
                for c in range(N_CHANNELS):
                    if c in layout.once:
                        if not constant_rows(by_window[c]):
                            raise _NotOnceAWindow
                        x_np[at, layout.columns(c)] = by_window[c][:, :1]
                    else:
                        x_np[at, layout.columns(c)] = by_window[c]
            else:
                x_np[at] = reader.read(GIMU, chunk)[local]
            _fill_ldt(reader, chunk, local, ldt_np, labels_np, at)
            return len(rows)

        _load_chunks(load_one, len(keep), n, prefetch=prefetch, progress=progress, url=url)
        table = row_offsets = bounds = None
        if layout is not None:
            columns = [layout.columns(c) for c in range(N_CHANNELS)]
            shared_table = share_dictionaries(dictionaries, x_np.view(np.uint16), starts, columns,
                                              threads=prefetch)
            table = torch.from_numpy(shared_table.values).to(device)
            row_offsets = torch.from_numpy(layout.row_offsets(shared_table.offsets)).to(device)
            bounds = torch.from_numpy(starts).to(device)
        global_index = np.concatenate([rows for _, rows in keep]) if keep else np.empty(0, np.int64)
        if device.type != "cpu":
            host_x = host_x.to(device)
            ldt = None if ldt is None else ldt.to(device)
        held = cls(device, host_x, table, row_offsets, bounds, ldt, global_index.astype(np.int64), layout)
        held.labels = labels_np
        return held

    # -- epochs --------------------------------------------------------------------------------
    def plan(self, *, seed: int, epoch: int, world_size: int, rank: int, batch_size: int,
             drop_last: bool, shuffle: bool, epoch_rows: np.ndarray | None = None) -> ResidentPlan:
        """This rank's slice of the epoch's permutation (a pure function of seed, epoch, world
        size and the holding device's kind), or of ``epoch_rows``, an epoch drawn by label
        (``_balanced``), cut into ranks and batches the same way. Held: 8 B a window of this
        rank (int64 rows; the whole permutation, 8 B a window of every rank, only while drawing)."""
        self.plans_drawn += 1
        n = len(self) if epoch_rows is None else len(epoch_rows)
        per_rank, n_batches = rank_window_counts(n, world_size, batch_size, drop_last)
        if epoch_rows is not None:
            order = torch.from_numpy(epoch_rows).to(self.device)
        elif shuffle:
            generator = torch.Generator(device=self.device)
            generator.manual_seed((int(seed) * 1_000_003 + int(epoch)) & 0x7FFFFFFFFFFFFFFF)
            order = torch.randperm(n, generator=generator, device=self.device)
        else:
            order = torch.arange(n, device=self.device)
        start = int(rank_starts(n, world_size)[rank])
        mine = order[start : start + int(per_rank[rank])]
        if len(mine) < len(order):  # a copy: the plan keeps this rank's rows, not every rank's
            mine = mine.clone()
        sizes = batch_sizes(int(per_rank[rank]), n_batches, batch_size)
        return ResidentPlan(mine, np.concatenate(([0], np.cumsum(sizes))).astype(np.int64))

    def epoch_size(self, *, world_size: int, rank: int, batch_size: int, drop_last: bool,
                   epoch_windows: int | None = None) -> tuple[int, int]:
        """This rank's windows and batches in an epoch (of ``epoch_windows`` windows over all
        ranks, default every held window): what ``plan`` gives, counted without drawing."""
        n = len(self) if epoch_windows is None else epoch_windows
        per_rank, n_batches = rank_window_counts(n, world_size, batch_size, drop_last)
        return int(per_rank[rank]), int(n_batches)

    def rank_windows(self, plan: ResidentPlan) -> int:
        return int(plan.offsets[-1])

    def batch_indices(self, plan: ResidentPlan, batch: int) -> np.ndarray:
        """The store's window indices of one batch, in delivered order."""
        return self.global_index[plan.rows(batch).cpu().numpy()]

    def gather(self, plan: ResidentPlan, batch: int, *, channel_first: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = plan.rows(batch)
        if self.device.type == "cuda":  # one graph replay instead of launching each op (_cuda_graph)
            graphed = self._graphs.get(channel_first)
            if graphed is None:
                from birdzarr.loader._cuda_graph import GraphedGather

                graphed = self._graphs[channel_first] = GraphedGather(
                    lambda r: self._gather_rows(r, channel_first=channel_first), self.device)
            return graphed(rows)
        return self._gather_rows(rows, channel_first=channel_first)

    def _gather_rows(self, rows: torch.Tensor, *, channel_first: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' windows (and ldt), op by op, on the holding device."""
        if self.coded is not None:  # a version-2 store: the same torch ops on any device
            x = self.coded.decode(rows)
        elif self.device.type == "cpu":  # numpy's take is ~3x torch's index_select on the host
            if self.table is None:
                x = torch.from_numpy(np.take(self.x.numpy(), rows.numpy(), axis=0))
            else:
                x = torch.from_numpy(self._decode_on_host(rows.numpy()))
        else:
            x = self._gather_with_torch(rows)
        if channel_first:
            x = x.transpose(1, 2).contiguous()
        return x, None if self.ldt is None else self._ldt_with_torch(rows)

    def _gather_with_torch(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows' float32 windows, gathered (and decoded) by torch ops on the holding device."""
        if self.coded is not None:
            return self.coded.decode(rows)
        if self.table is None:
            return self.x.index_select(0, rows)
        assert self.row_offsets is not None and self.chunk_bounds is not None
        codes = self.x.index_select(0, rows).to(torch.int32) & 0xFFFF  # int16 holds uint16 codes
        chunk = torch.searchsorted(self.chunk_bounds, rows, right=True) - 1
        values = self.table[codes + self.row_offsets[chunk]]
        if self._expand is not None:  # gps_speed held once a window: its value to all 20 samples
            values = values[:, self._expand]
        return values.view(len(rows), WINDOW_LENGTH, N_CHANNELS)

    def _ldt_with_torch(self, rows: torch.Tensor) -> torch.Tensor:
        """The rows' int64 ``(label, device, timestamp)``, from the packed int32 rows."""
        assert self.ldt is not None
        held = self.ldt.index_select(0, rows)
        return torch.cat([held[:, :2].to(torch.int64), held[:, 2:].contiguous().view(torch.int64)], dim=1)

    def filler(self, rows: np.ndarray) -> Any:
        """Write the host-resident ``rows`` into a batch's channel-last ``x`` and ``ldt`` arrays."""

        def fill(x: np.ndarray, ldt: np.ndarray | None) -> None:
            if self.coded is not None:
                self.coded.decode_host(rows, out=x)
            elif self.table is None:
                np.take(self.x.numpy(), rows, axis=0, out=x, mode="clip")
            else:
                self._decode_on_host(rows, out=x)
            if ldt is not None and self.ldt is not None:
                held = np.take(self.ldt.numpy(), rows, axis=0, out=_scratch("ldt", (len(rows), _LDT_COLUMNS),
                                                                           np.int32), mode="clip")
                ldt[:, :2] = held[:, :2]
                ldt[:, 2:] = held[:, 2:].view(np.int64)  # the two halves, in memory order

        return fill

    def _decode_on_host(self, rows: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Gather the rows' codes and look them up in their chunks' dictionaries.

        Looked up in ascending row order (the windows of one group of chunks, which share a
        dictionary, then look up one after another), then put back in the batch's order by one
        row copy, and gps_speed's one value a window copied to its 20 samples by one column
        gather. Measured on a 2.5 M-window dict16 store (a 6 MB table), a batch of 8192, each
        way from cold caches: the table lookup is about half the decode; fancy indexing of the
        codes instead of ``np.take`` of rows cost 1.19x, the offsets built per batch 1.07x, the
        index in two passes 1.01x. Without the sort the decode was 4% faster there (the table
        fits in the L3 cache); the sort is for tables that do not (the 25 M-window corpus's
        would be about ten times larger)."""
        assert self.table is not None and self.chunk_bounds is not None and self.row_offsets is not None
        n = len(rows)
        order = np.argsort(rows)  # rows are distinct: any sort is stable
        ascending = rows[order]
        chunk = np.searchsorted(self.chunk_bounds.numpy(), ascending, side="right") - 1
        index = np.take(self.row_offsets.numpy(), chunk, axis=0)  # int32 (batch, width)
        # uint16 codes added straight into the int32 offsets: one pass, no int32 copy of the codes
        np.add(index, np.take(self._code_rows, ascending, axis=0), out=index)
        looked_up = np.empty(index.shape, np.float32)
        torch.index_select(self.table, 0, torch.from_numpy(index.reshape(-1)),
                           out=torch.from_numpy(looked_up).view(-1))  # view: never a silent copy
        out = np.empty((n, WINDOW_LENGTH, N_CHANNELS), np.float32) if out is None else out
        back = np.empty_like(order)  # the batch row of each ascending row
        back[order] = np.arange(n)
        if self._expand_host is None:
            np.take(looked_up.reshape(out.shape), back, axis=0, out=out, mode="clip")
            return out
        by_window = out.view()
        by_window.shape = (n, _VALUES)  # raises rather than copy: the values must land in ``out``
        np.take(np.take(looked_up, back, axis=0), self._expand_host, axis=1, out=by_window, mode="clip")
        return out

    @property
    def _code_rows(self) -> np.ndarray:
        """The host codes as uint16 rows (``layout.width`` a window): a view, made per call, so
        that pickling this object for a DataLoader worker never copies the codes out of shared
        memory."""
        return self.x.numpy().view(np.uint16)


def format2_window_bytes(gps_once: bool) -> int:
    """Bytes a window of a version-2 store held as codes (without ldt): uint16 codes of imu_x/y/z,
    an int32 dictionary row, and gps_speed as float32 once a window or in every sample."""
    return WINDOW_LENGTH * _v2.N_CODED * 2 + 4 + (4 if gps_once else 4 * WINDOW_LENGTH)


def held_dictionaries(dictionaries: _v2.Dictionaries, row: np.ndarray, codes: np.ndarray, *, threads: int = 1
                      ) -> tuple[np.ndarray, np.ndarray]:
    """The dictionaries of the rows that ``row`` (the store's row of each held window, int32)
    uses, merged into groups (``share_rows``), and each held row's offsets into them
    (``HeldCodes.offsets``); ``row`` is renumbered ``0..R-1`` in store order, consecutive rows
    that start at the same entries (a group's, or small devices' that share a row) made one,
    and ``codes`` (the held int16 codes, (n, 20, 3) with rows of any stride: code - CODE_BIAS)
    recoded into the groups' unions, both in place. Entries that several rows share are held
    once. Offsets are int32 unless the held entries pass 2**31.

    Why the groups: a batch's lookups spread over the whole table, which holds each shared row
    of small devices whole (every value of up to 2,048 windows): for the same 1 M windows, 3.57 M
    entries (14 MB) at 100,000 devices against 1.51 M at 186 devices, past what the CPU caches
    hold. Merged, devices that share calibrated values share one union a channel.
    Memory: the held entries (4 B each, at most those of the rows used) and ``share_rows``' remap
    (2 B an entry of a group's rows after its first, which bring at most half as many new
    entries: the two within 4 B an entry of the rows used); the row offsets, into the table and
    into the remap (240 B a row each: the 480 B a row the budget counts); per recoding thread,
    one slice's index and new codes (``_RECODE_SLICE`` windows: 3.9 and 2 MB)."""
    used = np.zeros(dictionaries.n_rows, dtype=bool)
    used[row] = True
    renumber = (np.cumsum(used) - 1).astype(np.int32)
    np.take(renumber, row, out=row)
    shared = share_rows(dictionaries.values, dictionaries.start[used], dictionaries.sizes()[used],
                        _v2.MAX_ENTRIES)
    if shared is None:  # no two rows merge: their entries as stored
        kept = dictionaries.kept(used)
        values, start = np.ascontiguousarray(kept.values, dtype=np.float32), kept.start
    else:
        _recode(codes, row, _row_offsets(shared.remap_start, len(shared.remap)), shared.remap, shared.recoded,
                threads)
        values, start = shared.values, shared.start
    # consecutive rows that start at the same entries (a group's, small devices' sharing a row)
    # become one held row: a batch then gathers each window's offsets (240 B) from one row a
    # group, not from one a device (24 MB of offsets at 100,000 devices)
    opens = np.ones(len(start), dtype=bool)
    opens[1:] = (start[1:] != start[:-1]).any(axis=1)
    if not opens.all():
        np.take((np.cumsum(opens) - 1).astype(np.int32), row, out=row)
        start = start[opens]
    return values, _row_offsets(start, len(values))


# Windows a recode step takes: an int32 index (3.9 MB) and the new codes (2 MB) a thread; 61
# steps for 1 M windows keep the threads busy
_RECODE_SLICE = 16_384


def _row_offsets(start: np.ndarray, n_values: int) -> np.ndarray:
    """``HeldCodes.offsets`` of rows that start at ``start`` (R, 3): start + CODE_BIAS, int32 (int64
    past 2**31 entries), repeated for the 20 samples (sample-major, the layout of a window's codes)."""
    dtype = np.int32 if n_values + CODE_BIAS < 2**31 else np.int64
    return np.tile((start + CODE_BIAS).astype(dtype), (1, WINDOW_LENGTH))


def _recode(codes: np.ndarray, row: np.ndarray, offsets: np.ndarray, remap: np.ndarray, recoded: np.ndarray,
            threads: int) -> None:
    """Recode in place the held ``codes`` (int16 (n, 20, 3): code - CODE_BIAS) of the windows whose
    ``row`` is ``recoded``: ``new = remap[remap_start[row, c] + code]`` (``offsets``: the rows'
    ``remap_start`` laid out as ``HeldCodes.offsets``; a row whose codes stay points at an
    identity), ``_RECODE_SLICE`` windows at a time on ``threads`` threads (numpy and torch release
    the GIL); a slice without such a window is left as it is. ``remap`` is biased in place
    (``^ CODE_BIAS``) so that the lookup gives held codes. The index is built
    as ``decode_host`` builds it (one row gather, one add) and looked up by torch's
    index_select, below its parallel grain: 0.22 CPU s for 1 M windows against 0.60 for a
    broadcast add and numpy's take (synthetic, one thread)."""
    np.bitwise_xor(remap, np.uint16(CODE_BIAS), out=remap)
    table = torch.from_numpy(remap.view(np.int16))
    flat = codes.view()
    flat.shape = (len(codes), _PACKED_ROW)  # raises rather than copy: the codes are recoded in place

    def one(first: int) -> None:
        rows = row[first : first + _RECODE_SLICE]
        if not np.take(recoded, rows).any():  # a device's windows lie together in store order
            return
        at = slice(first, first + len(rows))
        index = _scratch("recode_index", (len(rows), _PACKED_ROW), offsets.dtype)
        np.take(offsets, rows, axis=0, out=index, mode="clip")
        np.add(index, flat[at], out=index)
        new = _scratch("recode_codes", (len(rows), _PACKED_ROW), np.int16)
        flat_index, flat_new = torch.from_numpy(index.reshape(-1)), torch.from_numpy(new.reshape(-1))
        for step in range(0, index.size, _LOOKUP_SLICE):
            done = step + _LOOKUP_SLICE
            torch.index_select(table, 0, flat_index[step:done], out=flat_new[step:done])
        flat[at] = new

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="birdzarr-recode") as pool:
        list(pool.map(one, range(0, len(row), _RECODE_SLICE)))


def _fill_ldt(reader: ChunkReader, chunk: int, local: np.ndarray, ldt: np.ndarray | None,
              labels: np.ndarray | None, at: slice) -> None:
    """The packed ``(label, device, timestamp halves)`` rows and the labels of a chunk's held windows."""
    if ldt is not None:
        ldt[at, 0] = reader.read(LABEL, chunk)[local]
        ldt[at, 1] = reader.read(DEVICE, chunk)[local]
        ldt[at, 2:] = timestamp_halves(reader.read(TIMESTAMP, chunk)[local])
    if labels is not None:
        labels[at] = ldt[at, 0] if ldt is not None else reader.read(LABEL, chunk)[local]


def timestamp_halves(seconds: np.ndarray) -> np.ndarray:
    """int64 timestamps as ``(n, 2)`` int32 halves, in memory order (the packed ``ldt`` columns)."""
    return np.ascontiguousarray(seconds, dtype=np.int64).view(np.int32).reshape(-1, 2)


def timestamps_of(halves: np.ndarray) -> np.ndarray:
    """The int64 timestamps of ``(n, 2)`` int32 halves: the inverse of ``timestamp_halves``."""
    return np.ascontiguousarray(halves, dtype=np.int32).view(np.int64).reshape(-1)


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class _NotCodable(Exception):
    """A chunk of a dict16 store is stored raw: hold float32 instead."""


class _NotOnceAWindow(Exception):
    """A window's gps_speed varies: hold all 80 codes a window."""


_SCRATCH = threading.local()
_SCRATCH_LIMIT = 16 * 2**20  # 16 MiB: the temporaries of batches up to ~70,000 windows are kept


def _scratch(name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A temporary of this thread, reused from batch to batch (a fresh one page-faults every
    batch); valid until this thread asks for ``name`` again. One of more than
    ``_SCRATCH_LIMIT`` bytes is new memory each time: a huge batch leaves nothing held."""
    size = math.prod(shape)  # not np.prod: ~5 us a call, several calls a batch
    if size * np.dtype(dtype).itemsize > _SCRATCH_LIMIT:
        return np.empty(shape, dtype)
    held = getattr(_SCRATCH, name, None)
    if held is None or held.dtype != dtype or len(held) < size:
        held = np.empty(size, dtype)
        setattr(_SCRATCH, name, held)
    return held[:size].reshape(shape)


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype, shared: bool) -> torch.Tensor:
    """An uninitialised host tensor, in shared memory when DataLoader workers are to read it."""
    if not shared:
        return torch.empty(shape, dtype=dtype)
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    storage = torch.UntypedStorage._new_shared(max(nbytes, 1))
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]


def _load_chunks(load_one: Any, n_chunks: int, n_windows: int, *, prefetch: int, progress: bool,
                 url: str) -> None:
    """Run ``load_one(i)`` (it returns the windows it loaded) for every kept chunk on ``prefetch``
    threads, with one progress bar: how both resident layouts fill their host arrays."""
    bar = progress_bar(progress, total=n_windows, desc=f"loading {url}", unit=" windows")
    pool = ThreadPoolExecutor(max_workers=max(1, prefetch), thread_name_prefix="birdzarr-resident")
    with bar, pool as threads:
        for count in threads.map(load_one, range(n_chunks)):
            bar.update(count)
