"""The one error hierarchy of birdzarr.

Every error birdzarr raises on purpose derives from ``BirdzarrError``; each subclass also
derives from the matching built-in so callers can keep catching ``FileNotFoundError`` and friends.
"""

from __future__ import annotations


class BirdzarrError(Exception):
    """Base class of every error raised by birdzarr."""


class StoreNotFoundError(BirdzarrError, FileNotFoundError):
    """Nothing exists at the given store location."""


class ArgumentError(BirdzarrError, ValueError):
    """A call's arguments are out of range or do not go together; the message names them (the
    command line reports it in one line, as the errors of the input)."""


class NotAStoreError(BirdzarrError, ValueError):
    """The location holds something that is not a birdzarr store."""


class FormatVersionError(BirdzarrError, ValueError):
    """The store was written by a newer (or unknown) format version."""


class IncompleteStoreError(BirdzarrError, ValueError):
    """A conversion started at this location and never committed."""


class DeviceNotFoundError(BirdzarrError, KeyError):
    """A device id that the store does not hold."""

    def __str__(self) -> str:  # the message as written, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


class WindowIndexError(BirdzarrError, IndexError):
    """A window (or chunk) index outside the store's committed windows."""


class StoreExistsError(BirdzarrError, FileExistsError):
    """The destination already holds data and ``overwrite`` was not given."""


class StoreLockedError(BirdzarrError, BlockingIOError):
    """Another writer holds the store's lock."""


class BadInputError(BirdzarrError, ValueError):
    """A source file cannot be converted; the message names file, line and a remedy."""


class MissingChunkError(BirdzarrError, OSError):
    """A committed chunk is missing or unreadable (never returned as fill values)."""


class ChecksumMismatchError(BirdzarrError, ValueError):
    """Stored windows do not match the checksum recorded when they were written."""


class MissingDependencyError(BirdzarrError, ImportError):
    """An optional dependency (an extra) is needed for this feature."""


class CorruptChunkError(MissingChunkError):
    """A stored chunk fails its checksum or cannot be decoded (changed or truncated bytes).

    A subclass of ``MissingChunkError``: either way the chunk's windows cannot be read.
    """


class ChunkFetchError(MissingChunkError):
    """A chunk could not be fetched even after retries (storage unreachable or throttling).

    A subclass of ``MissingChunkError`` so one ``except`` covers every unreadable chunk; the
    store itself may be intact, so retrying later can succeed.
    """


class ReadOnlyLocationError(BirdzarrError, PermissionError):
    """The location can be read but not written (a static ``http(s)://`` server)."""


class AppendError(BirdzarrError, ValueError):
    """The store cannot take this append (another kind of source, a shuffled layout, ...)."""


class TransferError(BirdzarrError, OSError):
    """An object could not be copied even after retries; what was copied is kept for a resume."""


class StoreAccessError(BirdzarrError, PermissionError):
    """The store exists but the credentials in use may not read (or write) it."""


class SamplingError(BirdzarrError, ValueError):
    """Shuffled batches cannot be well mixed from this store as configured (a shuffled read of
    a device-ordered store, streamed); the message names the conversion or option to use."""


class ResidentMemoryError(BirdzarrError, MemoryError):
    """A resident selection needs more memory than the device or the process may use."""


class DestinationError(BirdzarrError, ValueError):
    """The destination cannot be written: it lies inside the source (or holds it), or under a file."""


class UnknownProtocolError(BirdzarrError, ValueError):
    """A URL names a protocol that neither fsspec nor an installed package knows."""


class SchedulerError(BirdzarrError, ConnectionError):
    """The Dask scheduler given to a conversion is not a valid address or does not answer."""


class StorageError(BirdzarrError, OSError):
    """The storage cannot be used: no credentials, an unreachable endpoint, a refused request."""


class BirdzarrWarning(UserWarning):
    """Base class of every warning birdzarr issues."""


class DuplicateWindowsWarning(BirdzarrWarning):
    """Some windows of a device are exact copies of others (same time and values); they were kept
    and counted in the report."""


class IgnoredColumnsWarning(BirdzarrWarning):
    """Input files have columns birdzarr does not read; they are named in the report."""


class SkippedFilesWarning(BirdzarrWarning):
    """An append skipped source files whose names its devices already record (a file is identified
    by its name within its device); the message names them."""


class FallbackWarning(BirdzarrWarning):
    """birdzarr fell back to a weaker mechanism (a non-exclusive lock, fsspec instead of obstore);
    the message says what and what it costs."""


def warn_renamed(old: str, new: str, *, stacklevel: int = 3) -> None:
    """A renamed option, method or class used under its old name: it keeps working for one
    release, with a ``DeprecationWarning`` naming the new spelling (docs/format.md#glossary)."""
    import warnings

    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new} instead",
                  DeprecationWarning, stacklevel=stacklevel)
