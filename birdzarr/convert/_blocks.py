"""The unit that flows from readers to the writer: a run of curated windows of one device."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from birdzarr.format._digest import window_hashes
from birdzarr.format._spec import DeviceReport


@dataclass
class WindowBlock:
    """Curated windows in store order, with their per-window metadata.

    Readers yield blocks of one device (``devices`` is None: the writer knows the device). The
    shuffle yields blocks that mix devices and carry a device id per window in ``devices``.
    """

    windows: np.ndarray  # float32 (n, 20, 4)
    timestamps: np.ndarray  # int64 (n,)
    labels: np.ndarray  # int32 (n,)
    report: DeviceReport  # what producing this block read, wrote and dropped
    devices: np.ndarray | None = None  # int32 (n,), only in blocks that mix devices
    # format 2: the windows' codes (uint16 (n, 20, 3)) and dictionary rows (int64 (n,)) from the
    # writer's RowCoder (birdzarr/format/_rows.py); gps_speed stays in ``windows``
    coded: tuple[np.ndarray, np.ndarray] | None = None
    _hashes: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return int(self.windows.shape[0])

    def window_hashes(self) -> np.ndarray:
        """``window_hashes`` of the windows and timestamps, found once: the duplicate check and a
        shuffle's device digest both need them (found by each, they took 7% of a shuffle's CPU
        samples in py-spy; found once, 3%)."""
        if self._hashes is None:
            self._hashes = window_hashes(self.windows, self.timestamps)
        return self._hashes

    def device_ids(self, device_id: int) -> np.ndarray | int:
        """The device id of each window, to assign into a column: ``devices``, or ``device_id``
        itself (numpy broadcasts it; no array of copies is made)."""
        return device_id if self.devices is None else self.devices

    def part(self, start: int, stop: int) -> WindowBlock:
        """Windows ``[start, stop)`` (views, no copies), with the whole block's report."""
        window = slice(start, stop)
        devices = None if self.devices is None else self.devices[window]
        coded = None if self.coded is None else (self.coded[0][window], self.coded[1][window])
        return WindowBlock(
            self.windows[window], self.timestamps[window], self.labels[window], self.report, devices, coded,
        )

    def tail(self, start: int) -> WindowBlock:
        """The windows from ``start`` on (views, no copies)."""
        return self.part(start, len(self))
