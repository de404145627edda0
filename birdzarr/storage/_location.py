"""Store locations: one ``StoreLike`` input turned into a filesystem and a Zarr store in one place.

Accepted: a path (``~`` expanded), ``file://``, ``memory://``, ``s3://`` (and any other fsspec
protocol whose package is installed), read-only ``http(s)://``, and fsspec chains such as
``simplecache::s3://...``. ``storage_options`` go to fsspec untouched, so the standard AWS
credential chain (environment, profile, instance role) applies whenever they hold no keys. For a
chain, options are nested by protocol as fsspec expects: ``{"s3": {...}, "simplecache": {...}}``.

Credentials never leave this module in clear: every string birdzarr prints, raises or stores goes
through ``redact``, which removes ``user:password@`` parts of URLs and every secret value
that was ever passed in ``storage_options`` in this process.

Object stores fail transiently (503 SlowDown, connection resets, timeouts). s3fs and botocore
already retry each request a few times; ``read_object`` adds a slower outer retry with
exponential backoff for every filesystem (the HTTP one has none of its own) and turns what still
fails into an error that names the store and the key.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import re
import threading
import time
import urllib.parse
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, Union, cast

import fsspec
from fsspec.core import url_to_fs

from birdzarr._errors import (
    ChunkFetchError,
    FallbackWarning,
    MissingChunkError,
    MissingDependencyError,
    ReadOnlyLocationError,
    StorageError,
    StoreNotFoundError,
    UnknownProtocolError,
)


class OpenedStore(Protocol):
    """Anything opened at a location (``birdzarr.Store``): it is used where it was opened."""

    @property
    def location(self) -> Location: ...


StoreLike = Union[str, "os.PathLike[str]", "Location", OpenedStore]
T = TypeVar("T")

# s3fs issues a HEAD before each whole-object GET unless max_concurrency is 1 (test_s3.py counts
# the requests).
# Bounded waiting: an unreachable endpoint fails in seconds, not minutes (docs/reliability.md).
# botocore's "standard" retry mode still retries throttling and resets; read_object adds its
# own slower outer retry for chunk reads.
_S3_CONFIG = {"connect_timeout": 3, "read_timeout": 20, "retries": {"mode": "standard", "max_attempts": 2}}
_S3_RETRIES = 2  # s3fs's own retries of connection errors (its default 5 multiplies botocore's)
_PROTOCOL_DEFAULTS: dict[str, dict[str, Any]] = {"s3": {"max_concurrency": 1, "config_kwargs": _S3_CONFIG}}
_READ_ONLY_PROTOCOLS = frozenset({"http", "https"})
_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/@\s]*@")
# storage_options keys whose values are secrets, at any nesting depth (client_kwargs, s3={...}).
_SECRET_KEYS = re.compile(r"(secret|token|password|passwd|key$|key_id|credential|sas|signature)", re.I)
_SECRETS: set[str] = set()
_SECRETS_LOCK = threading.Lock()
_MASK = "***"


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently to re-try a read that failed transiently.

    Delays grow ``base_delay * 2**attempt`` up to ``max_delay`` with full jitter, so many
    DataLoader workers throttled at once do not retry in lock step.
    """

    attempts: int = 4
    base_delay: float = 0.25
    max_delay: float = 8.0

    def delays(self) -> Iterator[float]:
        for attempt in range(self.attempts - 1):
            yield random.uniform(0.5, 1.0) * min(self.max_delay, self.base_delay * 2**attempt)


DEFAULT_RETRY = RetryPolicy()


@dataclass(frozen=True)
class Location:
    """Where a store or source lives: a filesystem, the root path inside it, and its URL."""

    url: str
    fs: fsspec.AbstractFileSystem
    path: str
    storage_options: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    retry: RetryPolicy = field(default=DEFAULT_RETRY, repr=False, compare=False)

    @property
    def protocol(self) -> str:
        """The innermost protocol (``s3`` for ``simplecache::s3://...``; ``file`` for paths)."""
        return _protocol(self.url)

    @property
    def is_local(self) -> bool:
        return _is_local_fs(self.fs)

    @property
    def read_only(self) -> bool:
        """True where birdzarr can only read (a static HTTP server)."""
        return self.protocol in _READ_ONLY_PROTOCOLS

    @property
    def shared_between_processes(self) -> bool:
        """Whether what another process writes here is seen by this one (not ``memory://``:
        each process has a store of its own), so worker processes may write here."""
        return self.protocol != "memory"

    @property
    def display(self) -> str:
        """The URL safe to print: user/password parts and known secrets removed."""
        return redact(self.url)

    def __repr__(self) -> str:
        return f"Location({self.display!r})"  # the URL or path may hold credentials

    def join(self, *parts: str) -> str:
        """A path inside this location, for ``self.fs``."""
        return "/".join([self.path.rstrip("/"), *parts])

    def reopened(self) -> Location:
        """This location with a filesystem of the calling process's own, made from its picklable
        description (URL, ``storage_options``, retry policy).

        A worker process forked from the one that resolved a location must use this instead of
        the location's ``fs``: an inherited s3fs (any async fsspec filesystem) refuses to run
        after a fork ("This class is not fork-safe"), and fsspec forgets its cached instances in
        a forked child, so the filesystem made here is the child's own. A location sent to a
        process pickled is safe as it is (fsspec pickles a filesystem as its arguments)."""
        return resolve(self.url, self.storage_options, retry=self.retry)

    def child(self, name: str) -> Location:
        return Location(
            url=self.url.rstrip("/") + "/" + name,
            fs=self.fs,
            path=self.join(name),
            storage_options=self.storage_options,
            retry=self.retry,
        )


def _protocol(url: str) -> str:
    last = url.split("::")[-1]
    return last.split("://")[0] if "://" in last else "file"


def _is_local_fs(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


# -- credentials ---------------------------------------------------------------------------------
def _remember_secrets(options: Any, key: str = "") -> None:
    if isinstance(options, dict):
        for name, value in options.items():
            _remember_secrets(value, str(name))
    elif isinstance(options, str) and _SECRET_KEYS.search(key) and len(options) >= 4:
        with _SECRETS_LOCK:
            _SECRETS.add(options)


def redact(text: str) -> str:
    """``text`` without URL credentials (``https://user:pw@host``) or any secret seen in options."""
    text = _CREDENTIALS_IN_URL.sub("", text)
    with _SECRETS_LOCK:
        secrets = sorted(_SECRETS, key=len, reverse=True)
    for secret in secrets:
        text = text.replace(secret, _MASK)
    return text


# -- resolving -----------------------------------------------------------------------------------
def resolve(
    store: StoreLike, storage_options: dict[str, Any] | None = None, *, retry: RetryPolicy | None = None
) -> Location:
    """Turn any accepted store or source reference into a ``Location``: a path or URL (with
    ``storage_options``), a ``Location``, or an opened ``birdzarr.Store`` (its own location)."""
    if isinstance(store, Location):
        return store
    if isinstance(store, str) and not store.strip():  # "" would be the current directory
        raise StoreNotFoundError("an empty path names no store or source: give a path or URL")
    if not isinstance(store, (str, os.PathLike)):
        opened = getattr(store, "location", None)
        if isinstance(opened, Location):
            return opened
        raise TypeError(f"expected a path, a URL or a birdzarr.Store, got {type(store).__name__}")
    if storage_options is not None and not isinstance(storage_options, dict):
        raise TypeError(f"storage_options must be a dict of fsspec options, got {storage_options!r}")
    url = os.fspath(store)
    if "://" not in url and "::" not in url:
        url = os.path.abspath(os.path.expanduser(url))
    options = _with_defaults(url, dict(storage_options or {}))
    _remember_secrets(options)
    _remember_secrets_in_url(url)
    try:
        fs, path = url_to_fs(url, **options)
    except ImportError as exc:
        protocol = _protocol(url)
        package = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "az": "adlfs", "abfs": "adlfs"}.get(protocol)
        raise MissingDependencyError(
            f"{redact(url)}: {protocol}:// needs a package that is not installed ({redact(str(exc))}). "
            f"Install it: pip install {package or 'the fsspec implementation of ' + protocol}"
            f"{' (or birdzarr[s3])' if protocol == 's3' else ''}."
        ) from None
    except ValueError as exc:
        if "Protocol not known" not in str(exc):
            raise
        raise UnknownProtocolError(
            f"{redact(url)}: unknown protocol {_protocol(url)}://. Use a path, file://, s3://, "
            "memory://, http(s):// or another fsspec protocol whose package is installed."
        ) from None
    if _protocol(url) == "s3" and getattr(fs, "retries", None) == 5 and "::" not in url:
        fs.retries = _S3_RETRIES  # s3fs's class default; see _S3_CONFIG
    return Location(
        url=url.rstrip("/") or url,
        fs=fs,
        path=path.rstrip("/") or path,
        storage_options=options,
        retry=retry or DEFAULT_RETRY,
    )


def _with_defaults(url: str, options: dict[str, Any]) -> dict[str, Any]:
    protocol = _protocol(url)
    defaults = copy.deepcopy(_PROTOCOL_DEFAULTS.get(protocol, {}))  # botocore edits its config
    if not defaults:
        return options
    if "::" in url:  # a chain: the innermost filesystem's options sit under its protocol name
        return {**options, protocol: _with_defaults(url.split("::")[-1], dict(options.get(protocol, {})))}
    for key, value in defaults.items():
        if key == "config_kwargs" and isinstance(options.get(key), dict):
            options[key] = {**value, **options[key]}  # the user's settings win, ours fill in
        else:
            options.setdefault(key, value)
    return options


def _remember_secrets_in_url(url: str) -> None:
    for match in re.finditer(r"://([^/@\s]*)@", url):
        user_info = match.group(1)
        password = user_info.split(":", 1)[1] if ":" in user_info else ""
        if len(password) >= 4:
            with _SECRETS_LOCK:
                _SECRETS.add(password)


def zarr_store(location: Location, *, read_only: bool) -> Any:
    """A zarr-python store for the location (LocalStore on disk: atomic renames, no fsspec cost)."""
    from zarr.storage import FsspecStore, LocalStore

    if not read_only:
        require_writable(location)
    if location.is_local:
        return LocalStore(location.path, read_only=read_only)
    if "::" not in location.url and location.fs.async_impl:
        # zarr runs its own event loop: an async filesystem must be created for it (asynchronous=
        # True) rather than shared with fsspec's loop, or aiohttp fails with "different loop".
        fs, path = url_to_fs(location.url, **{**location.storage_options, "asynchronous": True})
        return FsspecStore(fs, path=path.rstrip("/"), read_only=read_only)
    # Sync filesystems, and chains (whose caching layer hides its target's async methods), are
    # called from zarr's loop through a thread wrapper.
    from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

    wrapped = AsyncFileSystemWrapper(location.fs, asynchronous=True)
    return FsspecStore(wrapped, path=location.path, read_only=read_only)


def require_writable(location: Location) -> None:
    if location.read_only:
        raise ReadOnlyLocationError(
            f"{location.display} is served over {location.protocol}://, which birdzarr reads but "
            "cannot write. Write to a path or a bucket (s3://...) and serve that instead."
        )


def exists(location: Location) -> bool:
    return bool(location.fs.exists(location.path))


_BUCKET_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def bucket_of(location: Location) -> str | None:
    """The bucket (container) an object-store location lies in; None for other filesystems."""
    if location.protocol not in _BUCKET_PROTOCOLS:
        return None
    return location.path.lstrip("/").split("/", 1)[0] or None


def missing_bucket_error(location: Location) -> StoreNotFoundError | None:
    """A one-line error naming the location's bucket if that bucket does not exist (or these
    credentials cannot see it); None if it exists or the location has no bucket. One request:
    for error paths only."""
    bucket = bucket_of(location)
    if bucket is None:
        return None
    try:
        location.fs.invalidate_cache(bucket)
        if location.fs.exists(bucket):
            return None
    except Exception:  # noqa: BLE001 - cannot tell: the caller's own error stands
        return None
    return no_bucket_error(location, bucket)


def no_bucket_error(location: Location, bucket: str) -> StoreNotFoundError:
    """The one-line error for a location whose bucket does not exist."""
    create = f" (aws s3 mb s3://{bucket})" if location.protocol in ("s3", "s3a") else ""
    return StoreNotFoundError(
        f"{location.display}: the bucket '{bucket}' does not exist (or these credentials cannot "
        f"see it). Check its name, or create the bucket first{create}."
    )


def forget_listings(location: Location) -> None:
    """Drop the filesystem's cached listings of the location, its parents and everything below
    it. s3fs caches a prefix's listing in its instance; objects written since through another
    instance (zarr's, or a worker process's) are missing from it, so a listing made to delete
    or check what a write left must not come from that cache."""
    fs = location.fs
    path = fs._strip_protocol(location.path).rstrip("/")
    fs.invalidate_cache(path)
    cache = getattr(fs, "dircache", None)
    if cache is not None:
        for key in [k for k in list(cache) if isinstance(k, str) and k.startswith(path + "/")]:
            cache.pop(key, None)


# -- reading with retries ------------------------------------------------------------------------
# Errors that are answers, not accidents: retrying cannot change them.
_FINAL_ERRORS: tuple[type[BaseException], ...] = (
    FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError,
    MissingChunkError, ReadOnlyLocationError,
)
_TRANSIENT_MODULES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "http", "ssl", "obstore")
_FINAL_NAMES = frozenset({"PermissionDeniedError", "UnauthenticatedError", "InvalidPathError",
                          "UnknownConfigurationKeyError", "NotSupportedError"})  # obstore's answers


def is_transient(exc: BaseException) -> bool:
    """Whether an error from a filesystem may go away on retry (throttling, resets, timeouts)."""
    if isinstance(exc, _FINAL_ERRORS) or type(exc).__name__ in _FINAL_NAMES:
        return False
    status = getattr(exc, "status", None)  # aiohttp's ClientResponseError (the HTTP filesystem)
    if isinstance(status, int) and 400 <= status < 500 and status not in (408, 429):
        return False  # the server's answer (403, 404, 416, ...) will not change on retry
    if isinstance(exc, (OSError, TimeoutError, ConnectionError)):
        return True
    return type(exc).__module__.split(".")[0] in _TRANSIENT_MODULES


def with_retries(call: Callable[[], T], policy: RetryPolicy) -> T:
    """``call()``, re-tried with backoff while it fails transiently; the last error propagates."""
    delays = policy.delays()
    while True:
        try:
            return call()
        except Exception as exc:
            if not is_transient(exc):
                raise
            delay = next(delays, None)
            if delay is None:
                raise
            time.sleep(delay)


# -- optional obstore fetcher --------------------------------------------------------------------
# obstore (Rust) fetches S3 objects ~3x faster than s3fs on a busy CPU (docs/cloud.md#benchmark).
# It is opt-in, for whole chunk objects only; everything else stays on fsspec.
FETCHER_ENV = "BIRDZARR_S3_FETCHER"
_obstore_pid: int | None = None  # the process that started obstore's runtime
_obstore_stores: dict[tuple[str, str], Any] = {}
# Credentials map one to one; the endpoint and region are the s3fs client's own (_obstore_endpoint).
_OBSTORE_OPTIONS = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}
_OBSTORE_PASSED = frozenset({"endpoint_url", "max_concurrency"})  # read from the client, or moot
_OBSTORE_CLIENT_KWARGS = frozenset({"region_name", "endpoint_url"})
_obstore_endpoints: weakref.WeakKeyDictionary[Any, tuple[str, str] | str] = weakref.WeakKeyDictionary()


def _obstore_config(options: dict[str, Any]) -> dict[str, str] | None:
    """obstore's S3 credentials for these s3fs options, or None if some option has no equivalent."""
    config: dict[str, str] = {}
    for name, value in options.items():
        if name in _OBSTORE_OPTIONS:
            config[_OBSTORE_OPTIONS[name]] = str(value)
        elif name == "client_kwargs" and isinstance(value, dict) and set(value) <= _OBSTORE_CLIENT_KWARGS:
            continue  # the client built from them gives the endpoint and region
        elif name == "config_kwargs" and _is_default_config(value):
            continue  # birdzarr's own timeouts and retries: obstore has its own
        elif name not in _OBSTORE_PASSED:
            return None
    return config


def _obstore_endpoint(location: Location) -> tuple[str, str] | str:
    """``(endpoint, region)`` for obstore: those of the botocore client s3fs made for this
    location, so chunk requests go exactly where s3fs sends metadata requests, whichever of
    ``storage_options`` (``endpoint_url``, ``client_kwargs``), ``FSSPEC_S3_ENDPOINT_URL``,
    ``AWS_ENDPOINT_URL(_S3)``, ``AWS_DEFAULT_REGION`` or ``~/.aws/config`` set them; or why
    obstore cannot be told the same endpoint (birdzarr then keeps s3fs)."""
    fs = location.fs
    try:
        return _obstore_endpoints[fs]
    except (KeyError, TypeError):
        pass
    found: tuple[str, str] | str
    try:
        if getattr(fs, "cache_regions", False):
            raise LookupError("s3fs resolves each bucket's region itself (cache_regions=True)")
        client = fs.s3  # s3fs's botocore client (made once; no request is sent)
        endpoint, region = str(client.meta.endpoint_url).rstrip("/"), str(client.meta.region_name)
    except Exception as exc:  # noqa: BLE001 - cannot tell: keep s3fs
        why = f"{type(exc).__name__}: {redact(str(exc))[:120]}"
        found = f"the endpoint s3fs uses could not be determined ({why})"
    else:
        host = (urllib.parse.urlsplit(endpoint).hostname or "").lower()
        if endpoint in ("https://s3.amazonaws.com", f"https://s3.{region}.amazonaws.com"):
            found = (f"https://s3.{region}.amazonaws.com", region)  # AWS S3 in the client's region
        elif host.endswith((".amazonaws.com", ".amazonaws.com.cn")):
            found = (f"s3fs uses the AWS endpoint {endpoint} (FIPS, dual-stack, accelerated or another "
                     "partition), which birdzarr does not hand to obstore")
        else:
            found = (endpoint, region)  # the endpoint the user named (MinIO, Ceph, a proxy, ...)
    with contextlib.suppress(TypeError):
        _obstore_endpoints[fs] = found
    return found


_fallbacks_warned: set[str] = set()


def _obstore_fallback(why: str) -> bool:
    """Warn (once per reason and process) that chunks are fetched with fsspec instead."""
    if why not in _fallbacks_warned:
        _fallbacks_warned.add(why)
        warnings.warn(
            f"{FETCHER_ENV}=obstore is set, but chunks are fetched with fsspec (s3fs) instead: {why}. "
            "Reads are correct, only slower (docs/cloud.md).", FallbackWarning, stacklevel=4,
        )
    return False


def _is_default_config(value: Any) -> bool:
    default = _S3_CONFIG
    return isinstance(value, dict) and set(value) == set(default) and all(
        value[k] == default[k] for k in ("connect_timeout", "read_timeout"))


def _uses_obstore(location: Location) -> bool:
    wanted = os.environ.get(FETCHER_ENV, "fsspec") == "obstore"
    if not wanted:
        return False
    if location.protocol != "s3":
        return False  # the variable is about S3; other stores are read as always
    if "::" in location.url:
        return _obstore_fallback("obstore serves plain s3:// URLs, not fsspec chains (simplecache::s3://)")
    if _obstore_pid is not None and _obstore_pid != os.getpid():
        # its runtime was started before this process forked: it would hang here
        return _obstore_fallback(
            "obstore was first used in the parent process before this worker forked, and its "
            "runtime cannot be used after a fork (open the store in the workers, or use the "
            "'spawn' or 'forkserver' start method)"
        )
    if _obstore_config(location.storage_options) is None:
        unsupported = sorted(
            k for k, v in location.storage_options.items()
            if k not in _OBSTORE_OPTIONS and k not in _OBSTORE_PASSED and k != "client_kwargs"
            and not (k == "config_kwargs" and _is_default_config(v)))
        return _obstore_fallback(
            f"storage_options {unsupported or ['client_kwargs']} have no obstore equivalent")
    if (why := _profile_credentials(location.storage_options)) is not None:
        return _obstore_fallback(why)
    endpoint = _obstore_endpoint(location)
    if isinstance(endpoint, str):
        return _obstore_fallback(endpoint)
    return True


def _profile_credentials(options: dict[str, Any]) -> str | None:
    """Why s3fs's credentials may come from an ``~/.aws`` profile (which obstore does not read:
    its requests would go unsigned or to the instance metadata service), or None where obstore
    finds the same ones (``storage_options``, the ``AWS_ACCESS_KEY_ID`` variables, or the
    web-identity, container and instance roles, which both read)."""
    if "key" in options or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None  # botocore's chain looks at the environment before any file
    if os.environ.get("AWS_PROFILE"):
        return "AWS_PROFILE is set, and obstore does not read ~/.aws profiles"
    for variable, default in (("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
                              ("AWS_CONFIG_FILE", "~/.aws/config")):
        path = os.path.expanduser(os.environ.get(variable) or default)
        if os.path.exists(path):
            return f"the credentials may come from {path}, which obstore does not read"
    return None


def _obstore_fetch(location: Location, path: str) -> bytes:
    global _obstore_pid
    import obstore
    from obstore.store import S3Store

    bucket, _, key = path.partition("/")
    endpoint = _obstore_endpoint(location)
    assert not isinstance(endpoint, str), "_uses_obstore checked it"
    # always the endpoint and region of s3fs's client: never where obstore's defaults or the
    # AWS_* variables would point it; credentials not given here come from the AWS_* environment
    config = {**(_obstore_config(location.storage_options) or {}),
              "endpoint": endpoint[0], "region": endpoint[1]}
    token = (bucket, repr(sorted(config.items())))
    if token not in _obstore_stores:
        _obstore_stores[token] = S3Store(
            bucket, config=cast(Any, config), client_options={"allow_http": endpoint[0].startswith("http://")}
        )
    _obstore_pid = os.getpid()
    return bytes(obstore.get(_obstore_stores[token], key).bytes())


def write_json(location: Location, key: str, document: Any) -> None:
    """Write ``document`` as the JSON object ``key`` under the location (a local file's
    directories made first: object stores have none)."""
    path = location.join(key)
    if location.is_local:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    location.fs.pipe_file(path, json.dumps(document).encode())


def read_object(location: Location, key: str) -> bytes:
    """The bytes of ``key`` under the location, with retries.

    A missing object raises ``MissingChunkError`` (a committed chunk must never read as fill
    values); one that still fails after the retries raises ``ChunkFetchError``. Both name the
    store and the key, never a credential.
    """
    path = location.join(key)
    if _uses_obstore(location):
        fetch: Callable[[], bytes] = lambda: _obstore_fetch(location, path)  # noqa: E731
    else:
        fetch = lambda: bytes(location.fs.cat_file(path))  # noqa: E731
    try:
        return with_retries(fetch, location.retry)
    except FileNotFoundError:
        raise MissingChunkError(
            f"{location.display}: committed chunk '{key}' is missing. The store is damaged; "
            "run `birdzarr verify` on it and re-convert or restore the missing files."
        ) from None
    except Exception as exc:
        if not is_transient(exc):
            raise
        raise ChunkFetchError(
            f"{location.display}: chunk '{key}' could not be read after {location.retry.attempts} "
            f"attempts ({type(exc).__name__}: {redact(str(exc))[:300]}). The storage is unreachable "
            "or throttling; the store itself may be fine. Try again later."
        ) from None


# -- errors of the environment, in one line --------------------------------------------------------
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                   "UnauthenticatedError")
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionClosedError",
                "ReadTimeoutError", "ClientConnectorError", "ServerTimeoutError", "ConnectTimeout",
                "ProxyConnectionError")


def environment_error(exc: BaseException) -> StorageError | None:
    """A one-line ``StorageError`` (what, where, what to do) for an error of the storage or
    network that is not birdzarr's (no credentials, unreachable endpoint, access denied); None
    for anything else."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    detail = redact(str(exc)).splitlines()[0][:300] if str(exc) else type(exc).__name__
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("FSSPEC_S3_ENDPOINT_URL")
    if names & set(_NO_CREDENTIALS):
        return StorageError(
            f"no credentials for the object store ({detail}). Set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or run where an instance role applies; for a "
            "public bucket, Python: storage_options={'anon': True}."
        )
    if names & set(_UNREACHABLE):
        where = f" (AWS_ENDPOINT_URL={endpoint})" if endpoint else ""
        return StorageError(
            f"cannot reach the storage endpoint{where}: {detail}. Check the URL and the network (for "
            "s3://, also AWS_ENDPOINT_URL); birdzarr gave up after a few bounded retries."
        )
    if "ClientError" in names or type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore"):
        return StorageError(f"the object store refused the request: {detail}. Check the bucket name, "
                            "the credentials' permissions and the region.")
    return None
