"""Progress bars on long work (tqdm, to stderr)."""

from __future__ import annotations

import importlib.util
import sys
from typing import Any

# tqdm.auto picks the notebook widget, which warns on import when ipywidgets is missing;
# plain tqdm renders fine in notebooks too.
if importlib.util.find_spec("ipywidgets") is not None:
    from tqdm.auto import tqdm
else:
    from tqdm import tqdm


def progress_bar(enabled: bool, **kwargs: Any) -> Any:
    """A tqdm bar on stderr, or a silent one when ``enabled`` is false."""
    return tqdm(disable=not enabled, file=sys.stderr, unit_scale=True, dynamic_ncols=True, **kwargs)
