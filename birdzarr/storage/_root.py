"""Reading a location's root ``zarr.json``, with one clear error for each way it can fail."""

from __future__ import annotations

import json
from typing import Any

from birdzarr._errors import IncompleteStoreError, NotAStoreError, StoreAccessError, StoreNotFoundError
from birdzarr.storage._location import Location


def read_root(location: Location) -> dict[str, Any]:
    try:
        raw = location.fs.cat_file(location.join("zarr.json"))
    except FileNotFoundError:
        if location.fs.exists(location.join(".zgroup")) or location.fs.exists(location.join(".zarray")):
            raise NotAStoreError(
                f"{location.display} is a Zarr v2 hierarchy, not a birdzarr store (Zarr v3)."
            ) from None
        if location.fs.exists(location.join(".birdzarr.lock")):  # birdzarr/storage/_lock.py LOCK_NAME
            raise IncompleteStoreError(
                f"{location.display}: a conversion started here and never wrote its first metadata "
                "(it was interrupted, or is still starting). Re-run the same `birdzarr convert` "
                "command to finish it, or `birdzarr repair` to see who holds the lock."
            ) from None
        if location.fs.exists(location.path):
            raise NotAStoreError(
                f"{location.display} exists but is not a Zarr v3 group (no zarr.json). "
                "Create a store with `birdzarr convert SOURCE DEST`; if it is an unfinished "
                "`birdzarr copy`, run the same copy again (the root zarr.json is copied last)."
            ) from None
        raise StoreNotFoundError(f"no store at {location.display}") from None
    except PermissionError as exc:
        raise StoreAccessError(
            f"{location.display}: access denied ({type(exc).__name__}). Check the credentials "
            "(the AWS_* environment, profile or instance role, or storage_options) and that they "
            "may read this bucket and prefix."
        ) from None
    try:
        meta = json.loads(raw)
    except ValueError:
        raise NotAStoreError(f"{location.display}/zarr.json is not valid JSON") from None
    if meta.get("node_type") != "group" or meta.get("zarr_format") != 3:
        raise NotAStoreError(f"{location.display} is not a Zarr v3 group")
    return dict(meta.get("attributes", {}))
