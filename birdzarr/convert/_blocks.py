"""The unit that flows from readers to the writer: a run of curated windows of one device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from birdzarr._format import DeviceReport


@dataclass
class WindowBlock:
    """Curated windows of one device, in source order, with their per-window metadata."""

    windows: np.ndarray  # float32 (n, 20, 4)
    timestamps: np.ndarray  # int64 (n,)
    labels: np.ndarray  # int32 (n,)
    report: DeviceReport  # what producing this block read, wrote and dropped

    def __len__(self) -> int:
        return int(self.windows.shape[0])
