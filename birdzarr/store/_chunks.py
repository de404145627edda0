"""Fetching and decoding whole chunks straight from the store's files, without zarr-python.

The training hot path needs three things zarr's generic reader does not give: a missing chunk
must raise (zarr returns fill values), no event loop or thread pool may exist before DataLoader
workers fork, and decoding must be a couple of numpy calls per chunk. The chunk keys and codec
chains are those birdzarr writes (docs/format.md); other chains fall back to zarr-python.

Format version 1 stores the windows as one float32 ``gimu`` array (codecs ``birdzarr.dict16`` /
``birdzarr.gdict16`` / standard). Format version 2 stores them as uint16 ``gimu_codes``,
float32 ``gps_speed`` and uint32 ``gimu_row`` per window, plus the dictionary arrays
``dict_values`` / ``dict_start`` / ``dict_device`` (birdzarr/format/_v2.py), core Zarr v3 codecs
only. ``ChunkReader.read(GIMU, i)`` returns float32 windows for both: on a version-2 store it
fetches the chunk of each per-window array, checks every code against its dictionary
(``_v2.check``: a damaged chunk is refused, never misread) and decodes with ``_v2.decode``;
``ChunkReader.read_windows`` checks and decodes only the windows a selection keeps. The
dictionaries are read once per reader, on the first decode, and kept.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numcodecs import Blosc

from birdzarr._errors import CorruptChunkError, MissingChunkError, NotAStoreError, WindowIndexError
from birdzarr.format import _v2
from birdzarr.format._codec import ChunkCodec, blosc_decode_scratch, parse_dict16, strip_crc32c
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
    # a format-2 dictionary array: the length the commit counts (root attribute
    # committed.dictionary); the array may be longer after an interrupted append
    committed_length: int | None = field(default=None, compare=False)

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
        if codec is not None and list(chunk_shape[1:]) != list(meta["shape"][1:]):
            codec = None  # chunked along another axis than the first: zarr-python
        return cls(name, int(chunk_shape[0]), dtype, codec, separator, meta.get("fill_value"), meta)

    @property
    def ndim(self) -> int:
        """The array's number of dimensions (its chunk grid's)."""
        if self.meta:
            return len(self.meta["chunk_grid"]["configuration"]["chunk_shape"])
        return 3 if self.name == GIMU else 1

    @property
    def length(self) -> int:
        """The array's committed length along its first axis: the commit's count for a format-2
        dictionary array where the root attributes give one, else its zarr.json's shape."""
        return int(self.meta["shape"][0]) if self.committed_length is None else self.committed_length

    def key(self, index: int) -> str:
        """The key of chunk ``index`` along the first axis (every other axis is one chunk)."""
        tail = ["0"] * (self.ndim - 1)
        return self.separator.join(["c", str(index), *tail]) if self.separator else ""


# The arrays of each format version, by name (birdzarr/format/_spec.py, birdzarr/format/_v2.py)
ARRAYS_V1 = (GIMU, DEVICE, TIMESTAMP, LABEL)
ARRAYS_V2 = (*_v2.ARRAYS, DEVICE, TIMESTAMP, LABEL)
V2_WINDOW_ARRAYS = (_v2.CODES, _v2.GPS, _v2.ROW)  # chunked by window like gimu, decoded together
# each per-window array's shape after the window axis
_ITEM_SHAPES: dict[str, tuple[int, ...]] = {
    GIMU: (WINDOW_LENGTH, N_CHANNELS), _v2.CODES: (WINDOW_LENGTH, _v2.N_CODED), _v2.GPS: (WINDOW_LENGTH,),
}


def array_names(format_version: int) -> tuple[str, ...]:
    """The arrays a store of ``format_version`` holds."""
    return ARRAYS_V2 if format_version >= 2 else ARRAYS_V1


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


_BLOSC = Blosc()  # decoding needs no settings: every blosc frame describes itself
# Windows a _v2.decode call decodes: its temporary index arrays stay in the CPU caches (a
# 32768-window chunk decoded whole measured ~1.5x slower than in blocks of 4096; 8192 the same)
_DECODE_BLOCK = 4096
_BUFFERS = threading.local()  # per decoding thread: a reusable output buffer per array


def _decode_exactly(raw: bytes | memoryview, out: np.ndarray) -> None:
    """Blosc-decode ``raw`` into ``out`` (uint8), which its frame must fill exactly."""
    nbytes = int.from_bytes(bytes(raw[4:8]), "little")  # blosc header: uncompressed size
    if nbytes != len(out):
        raise ValueError(f"{nbytes} bytes where a chunk holds {len(out)}")
    _BLOSC.decode(raw, out=out)


def _thread_buffer(name: str, nbytes: int) -> np.ndarray:
    """This thread's reusable byte buffer for array ``name`` (valid until its next call)."""
    buffers: dict[str, np.ndarray] | None = getattr(_BUFFERS, "by_name", None)
    if buffers is None:
        buffers = _BUFFERS.by_name = {}
    buffer = buffers.get(name)
    if buffer is None or len(buffer) < nbytes:
        buffer = buffers[name] = np.empty(max(nbytes, 1), np.uint8)
    return buffer[:nbytes]


class ChunkReader:
    """Reads chunk ``i`` of the store's arrays as numpy, for windows below ``n_windows`` only.

    ``format_version`` follows from the arrays in ``layouts``: 2 when they hold ``gimu_codes``,
    else 1. On either version ``read(GIMU, i)`` gives float32 windows ``(n, 20, 4)``.
    """

    def __init__(self, location: Location, layouts: dict[str, ArrayLayout], n_windows: int) -> None:
        self.location = location
        self.layouts = layouts
        self.n_windows = n_windows
        self.format_version = 2 if _v2.CODES in layouts else 1
        windows = _v2.CODES if self.format_version == 2 else GIMU
        self.chunk_windows = layouts[windows].chunk_windows
        self.n_chunks = -(-n_windows // self.chunk_windows)
        self.requests = 0
        self.bytes_read = 0
        self.cache: Any = None  # an opt-in local chunk cache (birdzarr.storage._cache.ChunkCache)
        self._zarr_arrays: dict[str, Any] = {}
        self._dictionaries: _v2.Dictionaries | None = None
        self._limits: np.ndarray | None = None  # entries of each (row, channel) dictionary, uint16
        self._dictionaries_lock = threading.Lock()
        if self.format_version == 2:
            for name in V2_WINDOW_ARRAYS:
                if layouts[name].chunk_windows != self.chunk_windows:
                    raise NotAStoreError(
                        f"{location.display}: array '{name}' has chunks of {layouts[name].chunk_windows} "
                        f"windows and '{_v2.CODES}' of {self.chunk_windows}: a format-2 store chunks its "
                        f"per-window arrays alike; its metadata is damaged; {RESTORE_HINT}."
                    )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_dictionaries_lock"]  # a lock does not pickle; the dictionaries do
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._dictionaries_lock = threading.Lock()

    @classmethod
    def open(cls, location: Location, n_windows: int, format_version: int | None = None, *,
             committed: dict[str, Any] | None = None) -> ChunkReader:
        """The reader of the store at ``location``: its arrays' metadata read and parsed. The
        format version and ``committed`` (the root attributes' commit record: a format-2 store's
        committed dictionary lengths) are the root attributes' (read here when no version is given)."""
        if format_version is None:
            from birdzarr.format._spec import check_root_attrs
            from birdzarr.storage._root import read_root

            meta = check_root_attrs(read_root(location), where=location.display)
            format_version, committed = int(meta["format_version"]), meta.get("committed")
        layouts = {name: ArrayLayout.from_metadata(name, read_array_meta(location, name))
                   for name in array_names(format_version)}
        recorded = (committed or {}).get("dictionary") or {}
        for names, key in (((_v2.VALUES,), "values"), ((_v2.START, _v2.DEVICE), "rows")):
            if format_version >= 2 and key in recorded:
                for name in names:
                    layouts[name] = replace(layouts[name], committed_length=int(recorded[key]))
        return cls(location, layouts, n_windows)

    def item_shape(self, name: str) -> tuple[int, ...]:
        """The shape of one window's entry in array ``name`` (``(20, 4)`` for ``gimu``)."""
        return _ITEM_SHAPES.get(name, ())

    def dtype(self, name: str) -> np.dtype[Any]:
        """The dtype ``read(name, ...)`` returns: float32 for ``gimu`` on every version."""
        if name == GIMU:
            return np.dtype(np.float32)
        return self.layouts[name].dtype

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

        ``gimu`` is float32 ``(n, 20, 4)`` on every format version (decoded from the codes and
        dictionaries on version 2). ``out`` (``gimu``): a C-contiguous float32
        ``(chunk_windows, 20, 4)`` buffer the chunk is decoded into (straight into it on birdzarr's
        own chains, copied otherwise), so a reader can recycle chunk buffers instead of faulting
        in fresh pages; the result is then a view of ``out``. On version 2, ``gimu_codes``,
        ``gps_speed`` and ``gimu_row`` read as stored (uint16 codes, not values).
        """
        data = self._decode(name, index, out)
        if out is not None and not np.shares_memory(data, out):  # a chain decoded elsewhere
            out[: len(data)] = data
            return out[: len(data)]
        return data

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.n_chunks:
            raise WindowIndexError(f"chunk {index} is out of range: the store has {self.n_chunks} chunks")

    def _corrupt(self, layout: ArrayLayout, index: int, exc: Exception) -> CorruptChunkError:
        return CorruptChunkError(
            f"{self.location.display}: chunk '{layout.name}/{layout.key(index)}' cannot be decoded "
            f"({exc}). The store is damaged; run `birdzarr verify`."
        )

    def _decode(self, name: str, index: int, out: np.ndarray | None) -> np.ndarray:
        if self.format_version == 2 and name in (GIMU, *V2_WINDOW_ARRAYS):
            self._check_index(index)
            if name == GIMU:
                return self._decode_v2(index, out)
            return self._v2_part(name, index, owned=True)
        layout = self.layouts[name]
        start, stop = self.chunk_span(index)
        self._check_index(index)
        if layout.chain == "zarr":
            return self._read_with_zarr(name, start, stop)
        assert layout.codec is not None
        fetched = self._fetch(layout, index)
        shape = (self.chunk_windows, WINDOW_LENGTH, N_CHANNELS) if name == GIMU else (self.chunk_windows,)
        try:
            array = layout.codec.decode(fetched, shape, out=out)
        except (ValueError, RuntimeError, IndexError) as exc:
            raise self._corrupt(layout, index, exc) from None
        return array[: stop - start]

    # -- format version 2 ----------------------------------------------------------------------------
    def _v2_part(self, name: str, index: int, *, owned: bool) -> np.ndarray:
        """Chunk ``index`` of one per-window array of a version-2 store (``gimu_codes``,
        ``gps_speed``, ``gimu_row``) as stored, trimmed to committed windows: codes ``(n, 20, 3)``
        (a view of the channel-major chunk unless ``owned``), gps_speed ``(n, 20)``, rows ``(n,)``.
        Unless ``owned``, the result lives in this thread's buffer for the array, valid until its
        next read in this thread."""
        layout = self.layouts[name]
        start, stop = self.chunk_span(index)
        n = stop - start
        if layout.codec is None:  # a chain birdzarr does not write: zarr-python reads it
            return self._read_with_zarr(name, start, stop)
        tail = self.item_shape(name)
        count = self.chunk_windows * int(np.prod(tail, dtype=np.int64))
        fetched = self._fetch(layout, index)
        try:
            raw = strip_crc32c(fetched) if layout.codec.crc32c else memoryview(fetched)
            nbytes = int.from_bytes(bytes(raw[4:8]), "little")  # blosc header: uncompressed size
            if nbytes != count * layout.dtype.itemsize:
                raise ValueError(f"{nbytes} bytes where a chunk holds {count * layout.dtype.itemsize}")
            if name == _v2.CODES:  # blosc's own scratch: decoded once, used at once
                buffer = blosc_decode_scratch(raw)
            else:
                buffer = _thread_buffer(name, nbytes)
                _BLOSC.decode(raw, out=buffer)
        except (ValueError, RuntimeError, IndexError) as exc:
            raise self._corrupt(layout, index, exc) from None
        flat = buffer.view(layout.dtype.newbyteorder("<"))
        if name == _v2.CODES and layout.chain == "standard":  # transpose (2, 0, 1): channel-major
            array = flat.reshape(_v2.N_CODED, self.chunk_windows, WINDOW_LENGTH).transpose(1, 2, 0)[:n]
        else:
            array = flat.reshape(self.chunk_windows, *tail)[:n]
        return np.array(array, order="C") if owned else array

    def _v2_chunk(self, index: int, *, owned: bool, selected: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, _v2.Dictionaries]:
        """Codes, rows and gps_speed of chunk ``index`` of a version-2 store, every code checked
        against the dictionaries; and the dictionaries. ``selected`` (positions within the chunk):
        only those windows, gathered (new memory) before the check."""
        if self.format_version != 2:
            raise ValueError(f"{self.location.display} is a format-{self.format_version} store: it has no "
                             "dictionary codes (read float32 windows with read(GIMU, i))")
        self._check_index(index)
        row = self._v2_part(_v2.ROW, index, owned=owned and selected is None)
        gps = self._v2_part(_v2.GPS, index, owned=owned and selected is None)
        codes = self._v2_part(_v2.CODES, index, owned=owned and selected is None)
        if selected is not None:
            row = np.take(row, selected)
            gps = np.take(gps, selected, axis=0)
            # the channel-major chunk's rows of 20 codes a channel: (3, k, 20), viewed (k, 20, 3)
            codes = np.take(codes.transpose(2, 0, 1), selected, axis=1).transpose(1, 2, 0)
        dictionaries = self.dictionaries()
        problem = self._out_of_dictionary(codes, row)
        if problem is not None:
            raise self._corrupt(self.layouts[_v2.CODES], index, ValueError(problem)) from None
        return codes, row, gps, dictionaries

    def _out_of_dictionary(self, codes: np.ndarray, row: np.ndarray) -> str | None:
        """What ``_v2.check`` says of these codes and rows (None: every row exists and every code
        is inside its dictionary), in uint16 against the sizes kept with the dictionaries: 2x
        faster than ``_v2.check``, which recomputes the sizes and compares in int64."""
        limits = self._limits
        assert limits is not None
        if not len(row):
            return None
        last = int(row.max())
        if last >= len(limits):
            return f"gimu_row refers to row {last}; the dictionary has {len(limits)} rows"
        first = int(row.min())
        if first == last:  # one row (device order): each channel's largest code against its size
            if any(int(codes[:, :, c].max()) >= int(limits[first, c]) for c in range(_v2.N_CODED)):
                return "a gimu code is past the end of its dictionary"
            return None
        limit = np.take(limits, row, axis=0)  # ~3x faster than limits[row]
        for c in range(_v2.N_CODED):
            if (codes[:, :, c] >= limit[:, c : c + 1]).any():
                return "a gimu code is past the end of its dictionary"
        return None

    def _decode_v2(self, index: int, out: np.ndarray | None, selected: np.ndarray | None = None
                   ) -> np.ndarray:
        codes, row, gps, dictionaries = self._v2_chunk(index, owned=False, selected=selected)
        n = len(row)
        if out is None or out.dtype != np.float32 or out.ndim != 3 or len(out) < n or (
            out.shape[1:] != (WINDOW_LENGTH, N_CHANNELS)
        ):
            target = np.empty((n, WINDOW_LENGTH, N_CHANNELS), np.float32)
        else:
            target = out[:n]
        values, start = dictionaries.values, dictionaries.start
        for a in range(0, n, _DECODE_BLOCK):
            b = a + _DECODE_BLOCK
            _v2.decode(codes[a:b], row[a:b], gps[a:b], values, start, out=target[a:b])
        return target

    def read_windows(self, index: int, selected: np.ndarray | None, out: np.ndarray) -> np.ndarray:
        """Windows ``selected`` of chunk ``index`` (ascending positions within the chunk; None:
        every committed window) as float32, decoded into ``out`` (a C-contiguous float32
        ``(chunk_windows, 20, 4)`` buffer). Returns where they went: ``out[rows[i]]`` is selected
        window ``i``.

        A version-2 chunk's blosc frames are decompressed whole, but only the selected windows'
        rows, codes and gps_speed are gathered, checked and looked up, packed into
        ``out[:len(selected)]`` (``rows`` is ``arange``): a selection that keeps a small part of
        each chunk costs that part of the lookup. A version-1 chunk decodes whole into ``out``
        (``rows`` is ``selected``).
        """
        if self.format_version != 2:
            n = len(self.read(GIMU, index, out=out))
            return np.arange(n) if selected is None else np.asarray(selected, dtype=np.int64)
        self._check_index(index)
        if selected is not None:
            selected = np.asarray(selected, dtype=np.intp)
            start, stop = self.chunk_span(index)
            if len(selected) == stop - start:  # every window: nothing to gather
                selected = None
            elif not len(selected):
                return np.arange(0)
        decoded = self._decode_v2(index, out, selected)
        if not np.shares_memory(decoded, out):  # out is not such a buffer
            out[: len(decoded)] = decoded
        return np.arange(len(decoded))

    def read_coded(self, index: int, selected: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Chunk ``index`` of a version-2 store undecoded, trimmed to committed windows:
        ``(codes, row, gps)``, uint16 ``(n, 20, 3)``, uint32 ``(n,)``, float32 ``(n, 20)``, each
        new memory, every code checked against its dictionary (``dictionaries()`` decodes them).
        ``selected`` (positions within the chunk): only those windows, gathered from the
        decompressed chunk (codes then a view of channel-major memory), never a copy of the whole
        chunk. ValueError on a version-1 store."""
        codes, row, gps, _ = self._v2_chunk(index, owned=selected is None, selected=selected)
        return codes, row, gps

    def dictionaries(self) -> _v2.Dictionaries:
        """The dictionary arrays of a version-2 store (``dict_values``, ``dict_start``,
        ``dict_device``): read on the first call, then kept (one read per reader, thread-safe)."""
        found = self._dictionaries
        if found is None:
            with self._dictionaries_lock:
                if self._dictionaries is None:
                    dictionaries, sizes = self._read_dictionaries()
                    self._limits = sizes.astype(np.uint16)  # each <= MAX_ENTRIES (checked)
                    self._dictionaries = dictionaries
                found = self._dictionaries
        return found

    def take_dictionaries_from(self, other: ChunkReader) -> None:
        """Use the dictionaries ``other`` (a reader of the same store) has read and checked, if
        any, instead of reading them again: a dataset reads them once and each process's reader
        takes them (a forked worker inherits the arrays)."""
        with self._dictionaries_lock:
            self._dictionaries, self._limits = other._dictionaries, other._limits

    def _read_dictionaries(self) -> tuple[_v2.Dictionaries, np.ndarray]:
        """The dictionary arrays, checked, and their (row, channel) entry counts."""
        if self.format_version != 2:
            raise ValueError(f"{self.location.display} is a format-{self.format_version} store: it has no "
                             "dictionary arrays")
        for name in (_v2.VALUES, _v2.START, _v2.DEVICE):
            layout = self.layouts[name]
            if layout.length > int(layout.meta["shape"][0]):
                raise CorruptChunkError(
                    f"{self.location.display}: the dictionary arrays do not agree with the commit ('{name}' "
                    f"holds {int(layout.meta['shape'][0])} where the commit counts {layout.length}). The "
                    "store is damaged; run `birdzarr verify`."
                )
        values = self._whole(_v2.VALUES)
        start = self._whole(_v2.START).reshape(-1, _v2.N_CODED)
        device = self._whole(_v2.DEVICE)
        sizes = _v2.entry_counts(start, len(values))
        problem = None
        if len(device) != len(start):
            problem = f"{len(device)} rows in '{_v2.DEVICE}' and {len(start)} in '{_v2.START}'"
        elif len(start) and int(start[0, 0]) != 0:
            problem = f"the first row of '{_v2.START}' starts at entry {int(start[0, 0])}, not 0"
        elif _v2.misplaced_rows(start, len(values)).any() or (sizes > _v2.MAX_ENTRIES).any():
            problem = f"'{_v2.START}' is not ascending within the {len(values)} entries of '{_v2.VALUES}'"
        if problem is not None:
            raise CorruptChunkError(
                f"{self.location.display}: the dictionary arrays do not agree ({problem}). The store "
                "is damaged; run `birdzarr verify`."
            )
        return _v2.Dictionaries(values, start, device), sizes

    def _whole(self, name: str) -> np.ndarray:
        """All of a (small, non-window) array, each chunk fetched through the cache and checked."""
        layout = self.layouts[name]
        length = layout.length
        if layout.codec is None or layout.codec.kind != "plain":  # a chain birdzarr does not write
            return self._read_with_zarr(name, 0, length)
        tail = tuple(int(d) for d in layout.meta["shape"][1:])
        per_item = int(np.prod(tail, dtype=np.int64))
        step = layout.chunk_windows
        out = np.empty((length, *tail), layout.dtype)
        # whole chunks decode straight into ``out`` where its bytes are the stored little-endian ones
        whole = out.reshape(-1).view(np.uint8) if out.dtype == out.dtype.newbyteorder("<") else None
        for index in range(-(-length // step)):
            fetched = self._fetch(layout, index)
            first = index * step
            try:
                raw = strip_crc32c(fetched) if layout.codec.crc32c else fetched
                if whole is not None and first + step <= length:  # decoded in place: no copy
                    size = step * per_item * out.dtype.itemsize
                    _decode_exactly(raw, whole[first * per_item * out.dtype.itemsize :][:size])
                    continue
                flat = np.frombuffer(_BLOSC.decode(raw), dtype=layout.dtype.newbyteorder("<"))
                if len(flat) != step * per_item:
                    raise ValueError(f"{len(flat)} values where a chunk holds {step * per_item}")
            except (ValueError, RuntimeError, IndexError) as exc:
                raise self._corrupt(layout, index, exc) from None
            out[first:length] = flat.reshape(step, *tail)[: length - first]
        return out

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
        channel; None when the chunk is not dictionary-coded (another chain, or raw mode, or a
        version-2 store: ``read_coded``)."""
        if self.format_version != 1:
            return None
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
        out = np.empty((stop - start, *self.item_shape(name)), dtype=self.dtype(name))
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
