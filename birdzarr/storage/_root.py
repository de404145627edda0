"""Reading a location's root ``zarr.json``, with one clear error for each way it can fail."""

from __future__ import annotations

import json
from typing import Any

from birdzarr._errors import IncompleteStoreError, NotAStoreError, StoreAccessError, StoreNotFoundError
from birdzarr.storage._location import Location, missing_bucket_error


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
        missing_bucket = missing_bucket_error(location)
        if missing_bucket is not None:
            raise missing_bucket from None
        raise StoreNotFoundError(f"no store at {location.display}") from None
    except PermissionError as exc:
        raise StoreAccessError(
            f"{location.display}: access denied ({type(exc).__name__}). Check the credentials "
            "(the AWS_* environment, profile or instance role, or storage_options) and that they "
            "may read this bucket and prefix."
        ) from None
    return parse_root(raw, location)


# What to do about a damaged metadata file: birdzarr cannot rebuild one (its content is the
# commit), and repair only removes leftovers, so the cure is a copy of the store or a conversion.
RESTORE_HINT = "restore that file from a copy of the store, or convert the store again from its sources"


def parse_root(raw: bytes, location: Location) -> dict[str, Any]:
    """The attributes of the root ``zarr.json`` bytes ``raw``; NotAStoreError when they are not a
    Zarr v3 group's metadata (every reader and ``repair`` say the same for the same damage)."""
    meta = load_json(raw, f"{location.display}/zarr.json", what="the store's root metadata")
    # valid JSON but no object ([] or "x") is refused like {}: no caller meets a list for a dict
    attributes = meta.get("attributes", {}) if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or meta.get("node_type") != "group" or meta.get("zarr_format") != 3 \
            or not isinstance(attributes, dict):
        raise NotAStoreError(
            f"{location.display} is not a Zarr v3 group (its zarr.json is not a group's metadata). "
            f"If it was a birdzarr store, its zarr.json is damaged: {RESTORE_HINT}."
        )
    return dict(attributes)


def load_json(raw: bytes, where: str, *, what: str) -> Any:
    """``raw`` parsed as JSON, or NotAStoreError naming ``where`` (a metadata file) and ``what``
    it holds. Truncated, empty or binary bytes (UnicodeDecodeError is a ValueError too) all
    land here; the caller checks the parsed value's shape."""
    try:
        return json.loads(raw)
    except ValueError:
        raise NotAStoreError(f"{where} is not valid JSON: {what} is damaged; {RESTORE_HINT}.") from None
