"""Replacing an existing local store (``overwrite=True``) without a moment where it is lost.

The new store is converted into a sibling directory ``DEST.birdzarr-new-TOKEN`` while DEST's
writer lock is held, and swapped in only after it has committed: two renames (DEST aside to
``DEST.birdzarr-old-TOKEN``, the new one to DEST), then the old one is deleted. A failure or a
kill during the conversion leaves DEST as it was (the next ``--overwrite`` removes the unfinished
sibling); a kill between the two renames leaves both complete stores under those names
(docs/reliability.md says how to finish by hand). It needs room for both stores until the swap.

Object stores have no rename, so there ``overwrite`` still clears DEST before writing.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from birdzarr._lock import StoreLock
from birdzarr._storage import Location, resolve

NEW_INFIX = ".birdzarr-new-"
OLD_INFIX = ".birdzarr-old-"


def staged_location(dest: Location, *, overwrite: bool) -> Location | None:
    """Where to convert instead of ``dest``: a sibling directory when overwriting a non-empty
    local directory; None when writing to ``dest`` directly is safe (or the only way)."""
    if not (overwrite and dest.is_local and os.path.isdir(dest.path) and os.listdir(dest.path)):
        return None
    return resolve(_real(dest) + NEW_INFIX + uuid.uuid4().hex[:12])


def _real(dest: Location) -> str:
    """DEST's real directory: behind a symlink, the swap happens where the data is."""
    return os.path.realpath(dest.path).rstrip(os.sep)


@contextmanager
def replacing(dest: Location, staged: Location) -> Iterator[None]:
    """Hold ``dest``'s lock while the body converts into ``staged``; then swap it in. If the body
    raises, ``staged`` is removed and ``dest`` is untouched."""
    lock = StoreLock(dest, "birdzarr convert --overwrite (writing a replacement aside)")
    lock.acquire()  # no other writer may change DEST while its replacement is written
    try:
        # with the lock held, any other replacement in the making is a killed one's leftover
        real = _real(dest)
        for leftover in glob.glob(glob.escape(real) + NEW_INFIX + "*"):
            if leftover != staged.path.rstrip(os.sep):
                shutil.rmtree(leftover, ignore_errors=True)
        try:
            yield
        except BaseException:
            shutil.rmtree(staged.path, ignore_errors=True)
            raise
        old = real + OLD_INFIX + uuid.uuid4().hex[:12]
        os.rename(real, old)  # our lock file moves aside with the old store
        os.rename(staged.path, real)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        lock.release()  # a no-op once the lock file has moved away with the old store
