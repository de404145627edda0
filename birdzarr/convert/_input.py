"""Reading one input file's bytes, decompressed: ``.csv``, ``.csv.gz`` and ``.csv.zst``.

Exports are often compressed. gzip and zstandard streams (also several concatenated frames, as
``cat a.gz b.gz`` or ``zstd`` of a pipe without a content size give) are decompressed with
pyarrow's codecs, which birdzarr already depends on: no extra package. File name extensions are
matched case-insensitively (``500_1.CSV.GZ``).
"""

from __future__ import annotations

import pyarrow as pa

from birdzarr._errors import BadInputError
from birdzarr.storage._location import Location

# extension (lower case) -> pyarrow codec name; "" = stored as is
CSV_SUFFIXES = {".csv": "", ".csv.gz": "gzip", ".csv.zst": "zstd"}
PARQUET_SUFFIXES = {".parquet": ""}


def split_suffix(name: str) -> tuple[str, str] | None:
    """(stem, lower-case suffix) for a known input file name, or None. ``500_1.CSV.gz`` gives
    ``("500_1", ".csv.gz")``."""
    lower = name.lower()
    for suffix in sorted([*CSV_SUFFIXES, *PARQUET_SUFFIXES], key=len, reverse=True):
        if lower.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], suffix
    return None


def read_bytes(file: Location) -> bytes:
    """The file's content, decompressed according to its name (``.gz``, ``.zst``).

    A stream that does not decompress (truncated, another format under that name) raises
    ``BadInputError`` naming the file.
    """
    data = bytes(file.fs.cat_file(file.path))
    found = split_suffix(file.path.rsplit("/", 1)[-1])
    codec = CSV_SUFFIXES.get(found[1], "") if found else ""
    if not codec or not data:
        return data
    try:
        return bytes(pa.CompressedInputStream(pa.BufferReader(data), codec).read())
    except (OSError, pa.ArrowException) as exc:
        raise BadInputError(
            f"{file.display}: cannot be decompressed as {codec} ({exc}). The file is damaged or "
            f"not {codec}-compressed: check it with `{'gzip -t' if codec == 'gzip' else 'zstd -t'}`, "
            "or rename it to what it holds."
        ) from None
