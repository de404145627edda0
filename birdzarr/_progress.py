"""Progress bars on long work (tqdm, to stderr; silent when disabled or not a terminal)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm


def progress_bar(enabled: bool, **kwargs: Any) -> Any:
    """A tqdm bar, disabled unless asked for and stderr is interactive or forced by the caller."""
    return tqdm(disable=not enabled, file=sys.stderr, unit_scale=True, dynamic_ncols=True, **kwargs)
