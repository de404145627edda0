"""Fetching and decoding whole chunks straight from the store's files, without zarr-python.

The training hot path needs three things zarr's generic reader does not give: a missing chunk
must raise (zarr returns fill values), no event loop or thread pool may exist before DataLoader
workers fork, and decoding must be a couple of numpy calls per chunk. The chunk keys and codec
chains are those of format version 1 (docs/format.md); other chains fall back to zarr-python.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from birdzarr._errors import CorruptChunkError, MissingChunkError, NotAStoreError, WindowIndexError
from birdzarr.format._codec import ChunkCodec, parse_dict16
from birdzarr.format._spec import DEVICE, GIMU, LABEL, N_CHANNELS, TIMESTAMP, WINDOW_LENGTH
from birdzarr.storage._location import Location
from birdzarr.storage._root import RESTORE_HINT, load_json


@dataclass(frozen=True)
class ArrayLayout:
    """What the reader needs from one array's zarr.json, its codec chain parsed once."""

    name: str
    chunk_windows: int
    dtype: np.dtype[Any]
    codec: ChunkCodec | None  # None: a chain birdzarr does not write, read through zarr-python
    separator: str
    fill_value: Any
    # the zarr.json it was parsed from, for what needs more of it (copy's list of chunk keys)
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def chain(self) -> str:
        """``dict16`` | ``gdict16`` | ``standard`` | ``plain`` (per-window arrays) | ``zarr``."""
        return "zarr" if self.codec is None else self.codec.kind

    @classmethod
    def from_metadata(cls, name: str, meta: dict[str, Any]) -> ArrayLayout:
        """The layout of array ``name`` from its parsed zarr.json (``read_array_meta``)."""
        chunk_shape = meta["chunk_grid"]["configuration"]["chunk_shape"]
        encoding = meta.get("chunk_key_encoding", {})
        separator = encoding.get("configuration", {}).get("separator", "/")
        dtype = np.dtype(meta["data_type"])
        codec = ChunkCodec.parse(meta["codecs"], dtype=dtype)
        if encoding.get("name", "default") != "default":
            separator, codec = "", None  # v2-style keys: let zarr-python read it
        windows_chain = codec is not None and codec.kind in ("dict16", "gdict16", "standard")
        if codec is not None and windows_chain != (len(chunk_shape) == 3):
            codec = None  # a chain on an array of another shape than birdzarr writes: zarr-python
        return cls(name, int(chunk_shape[0]), dtype, codec, separator, meta.get("fill_value"), meta)

    def key(self, index: int) -> str:
        tail = ["0", "0"] if self.name == GIMU else []
        return self.separator.join(["c", str(index), *tail]) if self.separator else ""


def read_array_meta(location: Location, name: str) -> dict[str, Any]:
    """Array ``name``'s zarr.json, checked to be the metadata of a Zarr v3 array with what every
    reader of it uses (shape, chunk grid, data type, codecs), or one NotAStoreError naming the
    file: a damaged store's metadata is the user's problem to fix, not a crash deep in a reader.
    """
    where = f"{location.display}/{name}/zarr.json"
    try:
        raw = location.fs.cat_file(location.join(name, "zarr.json"))
    except FileNotFoundError:
        raise NotAStoreError(
            f"{location.display}: array '{name}' is missing (no {name}/zarr.json): the store is "
            "damaged; restore the array from a copy of the store, or convert the store again from "
            "its sources."
        ) from None
    meta = load_json(raw, where, what=f"the metadata of array '{name}'")
    try:
        if not isinstance(meta, dict):
            raise ValueError(f"a JSON {type(meta).__name__}, not an object")
        if meta.get("node_type") != "array" or meta.get("zarr_format") != 3:
            raise ValueError(f"node_type {meta.get('node_type')!r}, zarr_format {meta.get('zarr_format')!r}")
        int(meta["shape"][0])
        ArrayLayout.from_metadata(name, meta)  # the chunk grid, data type and codecs parse
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        detail = f"{exc} is missing" if isinstance(exc, KeyError) else str(exc)
        raise NotAStoreError(
            f"{where} is not the metadata of a Zarr v3 array ({detail[:120]}): the metadata of "
            f"array '{name}' is damaged; {RESTORE_HINT}."
        ) from None
    return meta


class ChunkReader:
    """Reads chunk ``i`` of the store's arrays as numpy, for windows below ``n_windows`` only."""

    def __init__(self, location: Location, layouts: dict[str, ArrayLayout], n_windows: int) -> None:
        self.location = location
        self.layouts = layouts
        self.n_windows = n_windows
        self.chunk_windows = layouts[GIMU].chunk_windows
        self.n_chunks = -(-n_windows // self.chunk_windows)
        self.requests = 0
        self.bytes_read = 0
        self.cache: Any = None  # an opt-in local chunk cache (birdzarr.storage._cache.ChunkCache)
        self._zarr_arrays: dict[str, Any] = {}

    @classmethod
    def open(cls, location: Location, n_windows: int) -> ChunkReader:
        layouts = {name: ArrayLayout.from_metadata(name, read_array_meta(location, name))
                   for name in (GIMU, DEVICE, TIMESTAMP, LABEL)}
        return cls(location, layouts, n_windows)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Global window range ``[start, stop)`` of chunk ``index``, clipped to committed windows."""
        start = index * self.chunk_windows
        return start, min(start + self.chunk_windows, self.n_windows)

    def _fetch(self, layout: ArrayLayout, index: int) -> bytes:
        """One chunk's bytes: from the opt-in local cache (birdzarr/storage/_cache.py) or the store.

        Transient faults are retried with backoff; a missing chunk raises MissingChunkError and
        one that still fails raises ChunkFetchError, both naming store and key (_storage.py).
        """
        from birdzarr.storage._location import read_object

        key = f"{layout.name}/{layout.key(index)}"
        cache = self.cache
        if cache is not None and (cached := cache.get(key)) is not None:
            return bytes(cached)
        data = read_object(self.location, key)
        self.requests += 1
        self.bytes_read += len(data)
        if cache is not None:
            cache.put(key, data)
        return data

    def read(self, name: str, index: int, out: np.ndarray | None = None) -> np.ndarray:
        """Chunk ``index`` of array ``name``, trimmed to committed windows.

        ``out`` (``gimu``): a C-contiguous float32 ``(chunk_windows, 20, 4)`` buffer the chunk is
        decoded into (straight into it on birdzarr's own chains, copied otherwise), so a reader
        can recycle chunk buffers instead of faulting in fresh pages; the result is then a view
        of ``out``.
        """
        data = self._decode(name, index, out)
        if out is not None and not np.shares_memory(data, out):  # a chain decoded elsewhere
            out[: len(data)] = data
            return out[: len(data)]
        return data

    def _decode(self, name: str, index: int, out: np.ndarray | None) -> np.ndarray:
        layout = self.layouts[name]
        start, stop = self.chunk_span(index)
        if not 0 <= index < self.n_chunks:
            raise WindowIndexError(f"chunk {index} is out of range: the store has {self.n_chunks} chunks")
        if layout.chain == "zarr":
            return self._read_with_zarr(name, start, stop)
        assert layout.codec is not None
        fetched = self._fetch(layout, index)
        shape = (self.chunk_windows, WINDOW_LENGTH, N_CHANNELS) if name == GIMU else (self.chunk_windows,)
        try:
            array = layout.codec.decode(fetched, shape, out=out)
        except (ValueError, RuntimeError, IndexError) as exc:
            raise CorruptChunkError(
                f"{self.location.display}: chunk '{layout.name}/{layout.key(index)}' cannot be decoded "
                f"({exc}). The store is damaged; run `birdzarr verify`."
            ) from None
        return array[: stop - start]

    def _read_with_zarr(self, name: str, start: int, stop: int) -> np.ndarray:
        import zarr

        from birdzarr.storage._location import zarr_store

        if name not in self._zarr_arrays:
            group = zarr.open_group(zarr_store(self.location, read_only=True), mode="r", zarr_format=3)
            self._zarr_arrays[name] = group[name]
        array = self._zarr_arrays[name]
        # zarr reads a missing chunk (or shard) as fill values: check every object the range
        # needs first, so this path raises MissingChunkError like the others
        import itertools

        grid = array.shards or array.chunks
        first, last = start // grid[0], -(-stop // grid[0])
        rest = [range(-(-size // step)) for size, step in zip(array.shape[1:], grid[1:], strict=True)]
        for coords in itertools.product(range(first, last), *rest):
            key = f"{name}/{array.metadata.encode_chunk_key(coords)}"
            if not self.location.fs.exists(self.location.join(key)):
                raise MissingChunkError(
                    f"{self.location.display}: committed chunk '{key}' is missing. The store is "
                    "damaged; run `birdzarr verify` on it and re-convert or restore the missing files."
                )
        return np.asarray(array[start:stop])

    def read_codes(self, index: int) -> tuple[np.ndarray, list[np.ndarray]] | None:
        """Chunk ``index`` of ``gimu`` as dict16 codes, undecoded: ``(codes, dictionaries)`` with
        ``codes`` uint16 ``(4, chunk_windows * 20)`` channel-major and one float32 dictionary per
        channel; None when the chunk is not dictionary-coded (another chain, or raw mode)."""
        layout = self.layouts[GIMU]
        if layout.chain != "dict16":
            return None
        fetched = self._fetch(layout, index)
        try:
            assert layout.codec is not None
            body = parse_dict16(layout.codec.payload(fetched))
        except (ValueError, RuntimeError, IndexError) as exc:
            raise CorruptChunkError(
                f"{self.location.display}: chunk '{layout.name}/{layout.key(index)}' cannot be decoded "
                f"({exc}). The store is damaged; run `birdzarr verify`."
            ) from None
        if body.codes is None:
            return None
        return body.codes, body.dictionaries

    def read_range(self, name: str, start: int, stop: int, *, threads: int = 8) -> np.ndarray:
        """Windows ``[start, stop)`` of one array, each needed chunk read once, several at a time,
        whole chunks decoded straight into the result (no second copy)."""
        if not 0 <= start <= stop <= self.n_windows:
            raise WindowIndexError(
                f"window range [{start}, {stop}) is outside the store's {self.n_windows} windows")
        width = self.chunk_windows
        shape = (stop - start, WINDOW_LENGTH, N_CHANNELS) if name == GIMU else (stop - start,)
        out = np.empty(shape, dtype=self.layouts[name].dtype)
        chunks = range(start // width, -(-stop // width))

        def one(index: int) -> None:
            chunk_start, chunk_stop = self.chunk_span(index)
            lo, hi = max(start, chunk_start), min(stop, chunk_stop)
            whole = lo == chunk_start and chunk_start + width <= stop  # a full-length chunk inside
            if whole and name == GIMU:
                self.read(name, index, out=out[lo - start : lo - start + width])
                return
            data = self.read(name, index)
            out[lo - start : hi - start] = data[lo - chunk_start : hi - chunk_start]

        if len(chunks) <= 1:
            for index in chunks:
                one(index)
        else:
            workers = min(threads, len(chunks))
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="birdzarr-range") as pool:
                list(pool.map(one, chunks))
        return out
