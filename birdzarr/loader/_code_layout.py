"""Where a window's 16-bit codes lie in its row of a resident dict16 selection.

A store's window is 20 samples x 4 channels. gps_speed holds one value a window in every real
export (the tracker records one speed a burst), so resident mode holds it once: 61 codes a
window instead of 80, 24% less memory for the codes (122 B a window). A batch then looks up 19
fewer values a window but copies gps_speed to its 20 samples: the host decode of a batch of
8,192 was 5% faster, measured on a dict16 store (both layouts held in shared memory, 1.05x).
A selection where some window's gps_speed varies is held with all 80 codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from birdzarr.format._spec import CHANNELS, N_CHANNELS, WINDOW_LENGTH

# Channels resident mode tries to hold once a window
ONCE_A_WINDOW = (CHANNELS.index("gps_speed"),)


@dataclass(frozen=True)
class CodeLayout:
    """A row of codes: the varying channels sample-major (sample 0's channels, then sample
    1's, ...), then one code for each channel in ``once`` (held once a window)."""

    once: tuple[int, ...] = ()

    @property
    def varying(self) -> list[int]:
        return [c for c in range(N_CHANNELS) if c not in self.once]

    @property
    def width(self) -> int:
        """Codes a window."""
        return WINDOW_LENGTH * len(self.varying) + len(self.once)

    def columns(self, channel: int) -> slice:
        """The row's codes of ``channel``: 20 columns, or one if it is held once a window."""
        varying = self.varying
        if channel in self.once:
            at = WINDOW_LENGTH * len(varying) + self.once.index(channel)
            return slice(at, at + 1)
        return slice(varying.index(channel), WINDOW_LENGTH * len(varying), len(varying))

    def expand(self) -> np.ndarray | None:
        """For each of a window's 80 values (sample-major), its column in the row; None when
        the row is the window itself."""
        if not self.once:
            return None
        where = np.empty((WINDOW_LENGTH, N_CHANNELS), dtype=np.intp)
        for c in range(N_CHANNELS):
            where[:, c] = np.arange(self.width)[self.columns(c)]  # a column once a window: broadcast
        return where.reshape(-1)

    def row_offsets(self, offsets: np.ndarray) -> np.ndarray:
        """Per chunk, each column's dictionary offset (int32 ``(chunks, width)``), from each
        chunk's offset per channel (``(chunks, channels)``)."""
        out = np.empty((len(offsets), self.width), dtype=np.int32)
        for c in range(N_CHANNELS):
            out[:, self.columns(c)] = offsets[:, c : c + 1]
        return out
