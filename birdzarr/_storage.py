"""Store locations: one ``StoreLike`` input turned into a filesystem and a Zarr store in one place.

Accepted: a path (``~`` expanded), ``file://``, ``memory://``, ``s3://``, read-only ``https://``,
and fsspec chains such as ``simplecache::s3://...``. ``storage_options`` go to fsspec untouched;
they are never logged or stored (see :func:`redact`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Union

import fsspec
from fsspec.core import url_to_fs

StoreLike = Union[str, "os.PathLike[str]", "Location"]

# s3fs issues a HEAD before each whole-object GET unless max_concurrency is 1 (CONTEXT.md).
_PROTOCOL_DEFAULTS: dict[str, dict[str, Any]] = {"s3": {"max_concurrency": 1}}
_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/@]*@")


@dataclass(frozen=True)
class Location:
    """Where a store or source lives: a filesystem, the root path inside it, and its URL."""

    url: str
    fs: fsspec.AbstractFileSystem
    path: str
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_local(self) -> bool:
        return _is_local_fs(self.fs)

    @property
    def display(self) -> str:
        """The URL safe to print: user/password parts removed."""
        return redact(self.url)

    def join(self, *parts: str) -> str:
        """A path inside this location, for ``self.fs``."""
        return "/".join([self.path.rstrip("/"), *parts])

    def child(self, name: str) -> Location:
        return Location(
            url=self.url.rstrip("/") + "/" + name,
            fs=self.fs,
            path=self.join(name),
            storage_options=self.storage_options,
        )


def _is_local_fs(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def redact(url: str) -> str:
    """Remove credentials embedded in a URL (``s3://key:secret@bucket`` style)."""
    return _CREDENTIALS_IN_URL.sub("", url)


def resolve(store: StoreLike, storage_options: dict[str, Any] | None = None) -> Location:
    """Turn any accepted store or source reference into a :class:`Location`."""
    if isinstance(store, Location):
        return store
    url = os.fspath(store)
    if "://" not in url and "::" not in url:
        url = os.path.abspath(os.path.expanduser(url))
    options = dict(storage_options or {})
    protocol = url.split("::")[-1].split("://")[0] if "://" in url else "file"
    for key, value in _PROTOCOL_DEFAULTS.get(protocol, {}).items():
        options.setdefault(key, value)
    fs, path = url_to_fs(url, **options)
    return Location(url=url.rstrip("/") or url, fs=fs, path=path.rstrip("/") or path, storage_options=options)


def zarr_store(location: Location, *, read_only: bool) -> Any:
    """A zarr-python store for the location (LocalStore on disk: atomic renames, no fsspec cost)."""
    from zarr.storage import FsspecStore, LocalStore

    if location.is_local:
        return LocalStore(location.path, read_only=read_only)
    fs = location.fs
    if not getattr(fs, "async_impl", False):
        from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

        fs = AsyncFileSystemWrapper(fs)
    return FsspecStore(fs, path=location.path, read_only=read_only)


def exists(location: Location) -> bool:
    return bool(location.fs.exists(location.path))


def remove_tree(location: Location) -> None:
    """Delete everything under the location (used for ``--overwrite`` and failed conversions)."""
    if location.fs.exists(location.path):
        location.fs.rm(location.path, recursive=True)
