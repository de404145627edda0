"""Progress bars on long work (tqdm, to stderr).

On a terminal the bar redraws in place. When stderr is not a terminal (a SLURM log, a file, a
pipe) a redrawn bar would write about ten lines a second into the log, so there it writes one
plain line every :data:`LOG_INTERVAL` (10) seconds instead, and the final state when the work
ends; never a line before anything is done (tqdm draws its empty start, "0.00 windows [00:00,
?]", and again after a reset), so a short run writes one line and a run with nothing to do none.
``BIRDZARR_PROGRESS_INTERVAL`` changes the interval, and ``0`` turns those lines off.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

# tqdm.auto picks the notebook widget, which warns on import when ipywidgets is missing;
# plain tqdm renders fine in notebooks too.
if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:
    from tqdm import tqdm
from tqdm import tqdm as _plain_tqdm

LOG_INTERVAL = 10.0  # seconds between progress lines in a log (stderr not a terminal)


def _log_interval() -> float:
    try:
        return float(os.environ.get("BIRDZARR_PROGRESS_INTERVAL", LOG_INTERVAL))
    except ValueError:
        return LOG_INTERVAL


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules and tqdm.__module__ == "tqdm.notebook"


def progress_bar(enabled: bool, **kwargs: Any) -> Any:
    """A tqdm bar on stderr, or a silent one when ``enabled`` is false. When stderr is not a
    terminal: one line every few seconds (see module doc), never a redraw per update."""
    stream = sys.stderr
    interactive = bool(getattr(stream, "isatty", lambda: False)()) or _in_notebook()
    if not enabled or interactive:
        return tqdm(disable=not enabled, file=stream, unit_scale=True, dynamic_ncols=True, **kwargs)
    interval = _log_interval()
    if interval <= 0:
        return tqdm(disable=True, file=stream, **kwargs)
    # mininterval/maxinterval: at most one line per interval; a newline per refresh, no "\r"
    return _LogBar(file=_Lines(stream), unit_scale=True, mininterval=interval, maxinterval=interval,
                   miniters=1, ncols=100, ascii=True, **kwargs)


class _LogBar(_plain_tqdm):  # type: ignore[misc]
    """A bar for a log: no line while nothing is done (its start, a reset), see module doc."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if self.n == 0 and msg is None:
            return True
        return bool(super().display(msg, pos))


class _Lines:
    """A stream for tqdm that turns its in-place redraws into whole lines."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.last = ""

    def write(self, text: str) -> None:
        line = text.replace("\r", "").strip()
        if line and line != self.last:  # tqdm also writes empty clears and repeats
            self.last = line
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()
