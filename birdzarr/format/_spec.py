"""Store format: names, constants and the root-attribute schema (see docs/format.md).

This module is the single place that knows how the format is spelled; everything else imports
its names. It has no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from birdzarr._checks import require_number
from birdzarr._errors import ArgumentError, FormatVersionError, NotAStoreError

FORMAT_VERSION = 2
# the versions this birdzarr reads; it writes FORMAT_VERSION only (format 1 is read, never written)
SUPPORTED_VERSIONS = (1, 2)
ATTRS_KEY = "birdzarr"

WINDOW_LENGTH = 20
CHANNELS = ("imu_x", "imu_y", "imu_z", "gps_speed")
N_CHANNELS = len(CHANNELS)
WINDOW_VALUES = WINDOW_LENGTH * N_CHANNELS

GIMU = "gimu"
DEVICE = "device"
TIMESTAMP = "timestamp"
LABEL = "label"
PER_WINDOW_ARRAYS = (DEVICE, TIMESTAMP, LABEL)
# The gimu axes: window (global index), sample (0..19 within the window), channel. Version-1
# stores written before the rename call the middle axis "time" (the names are labels: no byte
# changes, so the version stays 1); readers accept both, and the xarray view always says
# "sample", which leaves "time" to the burst-time coordinate.
GIMU_DIMS = ("window", "sample", "channel")
GIMU_DIMS_BEFORE_SAMPLE = ("window", "time", "channel")
PER_WINDOW_DIMS = ("window",)

# Units, as each array's "units" attribute (informative: the format's meaning is this spec).
# gimu: one unit per channel, in CHANNELS order; gps_speed is stored divided by gps_scale (the
# root attribute curation.gps_scale; Parquet sources used the same constant).
CHANNEL_UNITS = ("g", "g", "g", "m/s divided by gps_scale")
# CF-style, so xarray.open_zarr decodes the timestamps to datetime64 (INT64_MIN -> NaT).
TIMESTAMP_UNITS = "seconds since 1970-01-01T00:00:00Z"

# int64 minimum is NaT when read as datetime64, so "unknown time" survives xarray and pandas.
TIMESTAMP_UNKNOWN = -(2**63)
LABEL_UNLABELLED = -1

DEFAULT_CHUNK_WINDOWS = 8192
# A shuffled store's chunk is a uniform sample of every device, so it holds ~190 per-device
# dictionaries: in chunks of 32768 windows each is shared by 4x more windows than in 8192, which
# makes the store 0.75x the size with the same compressor and decoding cheaper per window
# (docs/format.md, shuffled stores).
SHUFFLED_CHUNK_WINDOWS = 32768
# Blosc compresses at most 2 GiB at once, and a chunk is read and decoded whole: 2**22 windows
# (1.3 GB of float32) is far beyond any useful chunk and within that limit for every codec
MAX_CHUNK_WINDOWS = 2**22

# The window rule, recorded verbatim in every store converted from CSV.
WINDOW_RULE = (
    "a burst is a maximal run of consecutive rows with the same (device_id, date_time), "
    "continuing across the numerically ordered parts of one device; every 20 consecutive rows "
    "of a burst form one window, a remainder of fewer than 20 rows forms none; the index column "
    "is ignored; curation drops whole windows, never single rows"
)
MAX_PROBLEMS = 10  # skip messages kept per device in the conversion report
MIXED_LABEL_POLICY = "majority"  # most frequent label of the 20 rows; ties go to the earliest


@dataclass(frozen=True)
class Curation:
    """The curation applied to CSV input (the parameters are recorded in the store)."""

    speed_limit: float = 30.0
    clip_min: float = -2.0
    clip_max: float = 2.0
    gps_scale: float = 22.3012351755624

    def __post_init__(self) -> None:
        # Checked here, not where they are used: a zero scale, a NaN or a reversed clip range
        # would otherwise be written into every window (inf, NaN) and recorded in the store.
        for name in ("speed_limit", "clip_min", "clip_max", "gps_scale"):
            # stored as float: a numpy float32 would not serialise into the store's attributes
            object.__setattr__(self, name, require_number(f"Curation {name}", getattr(self, name)))
        if self.speed_limit <= 0:
            raise ArgumentError(f"Curation speed_limit must be above 0 m/s (windows with a gps_speed at or "
                                f"above it are dropped), got {self.speed_limit}")
        if self.gps_scale <= 0:
            raise ArgumentError(f"Curation gps_scale must be above 0 (gps_speed is divided by it), "
                                f"got {self.gps_scale}")
        if self.clip_min >= self.clip_max:
            raise ArgumentError(f"Curation clip_min must be below clip_max (imu_x/y/z are clipped to "
                                f"[clip_min, clip_max]), got {self.clip_min} and {self.clip_max}")

    def to_json(self, *, applied_by: str) -> dict[str, Any]:
        return {
            "applied_by": applied_by,
            "speed_limit": self.speed_limit,
            "clip": [self.clip_min, self.clip_max],
            "gps_scale": self.gps_scale,
            "rule": (
                "drop a window if any gps_speed is >= speed_limit or not finite; "
                "clip imu_x/y/z to clip; divide gps_speed by gps_scale"
            ),
        }


@dataclass(frozen=True)
class DeviceRange:
    """A run ``[start, stop)`` of global window indices holding one device's windows."""

    start: int
    stop: int
    checksum: str

    def to_json(self) -> list[Any]:
        return [self.start, self.stop, self.checksum]

    @classmethod
    def from_json(cls, raw: list[Any]) -> DeviceRange:
        return cls(int(raw[0]), int(raw[1]), str(raw[2]))


@dataclass
class DeviceEntry:
    """One row of the device table."""

    device_id: int
    n_windows: int = 0
    ranges: list[DeviceRange] = field(default_factory=list)
    first_time: int = TIMESTAMP_UNKNOWN
    last_time: int = TIMESTAMP_UNKNOWN
    sources: list[str] = field(default_factory=list)
    label_counts: dict[int, int] = field(default_factory=dict)
    # Shuffled stores have no ranges. Their devices carry an order-free digest of their rows
    # (window, timestamp, label: format/_digest.py); stores shuffled by earlier versions carry
    # instead a CRC-32C of the windows in ascending global index order (as DeviceRange.checksum).
    # None in unshuffled stores.
    scattered_checksum: str | None = None
    scattered_digest: str | None = None

    def to_json(self) -> dict[str, Any]:
        # (a format-2 commit spells this JSON out without the dict: format/_device_table.py details_json)
        counts = self.label_counts
        return {
            "device_id": self.device_id,
            "n_windows": self.n_windows,
            "ranges": [[r.start, r.stop, r.checksum] for r in self.ranges],
            "first_time": self.first_time,
            "last_time": self.last_time,
            "sources": list(self.sources),
            "label_counts": ({str(k): v for k, v in counts.items()} if len(counts) < 2
                             else {str(k): v for k, v in sorted(counts.items())}),
            "scattered_checksum": self.scattered_checksum,
            "scattered_digest": self.scattered_digest,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> DeviceEntry:
        return cls(
            device_id=int(raw["device_id"]),
            n_windows=int(raw["n_windows"]),
            ranges=[DeviceRange.from_json(r) for r in raw["ranges"]],
            first_time=int(raw["first_time"]),
            last_time=int(raw["last_time"]),
            sources=[str(s) for s in raw["sources"]],
            label_counts={int(k): int(v) for k, v in raw.get("label_counts", {}).items()},
            scattered_checksum=raw.get("scattered_checksum"),
            scattered_digest=raw.get("scattered_digest"),
        )


def label_totals(entries: Iterable[DeviceEntry]) -> dict[str, int]:
    """Windows per label over every device entry, label as a string in ascending order (-1:
    unlabelled), as a format-2 store records them in its root ``committed.label_counts`` so that
    a store's summary reads no per-device JSON."""
    totals: dict[int, int] = {}
    for entry in entries:
        for label, count in entry.label_counts.items():
            totals[label] = totals.get(label, 0) + count
    return {str(label): totals[label] for label in sorted(totals)}


def report_totals(reports: Iterable[DeviceReport]) -> dict[str, Any]:
    """The sums over every device's conversion report, as a format-2 store records them in its
    root ``report.totals`` so that ``birdzarr info`` reads no per-device JSON: rows read, bad
    lines and files, mixed-label windows, and windows dropped by reason."""
    dropped: dict[str, int] = {}
    rows_read = bad_lines = bad_files = mixed = 0
    for r in reports:
        rows_read += r.rows_read
        bad_lines += r.bad_lines
        bad_files += r.bad_files
        mixed += r.mixed_label_windows
        for reason, count in r.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + count
    return {"rows_read": rows_read, "bad_lines": bad_lines, "bad_files": bad_files,
            "mixed_label_windows": mixed, "dropped": dict(sorted(dropped.items()))}


@dataclass
class DeviceReport:
    """What conversion did with one device's input."""

    rows_read: int = 0
    windows_written: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    mixed_label_windows: int = 0
    bad_lines: int = 0  # CSV lines or Parquet rows skipped as malformed (on_bad_rows="skip")
    bad_files: int = 0  # whole files skipped as unreadable, empty or of the wrong schema
    problems: list[str] = field(default_factory=list)  # the first MAX_PROBLEMS skip messages

    def note(self, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(message)

    def drop(self, reason: str, count: int) -> None:
        if count:
            self.dropped[reason] = self.dropped.get(reason, 0) + int(count)

    def merge(self, other: DeviceReport) -> None:
        self.rows_read += other.rows_read
        self.windows_written += other.windows_written
        self.mixed_label_windows += other.mixed_label_windows
        self.bad_lines += other.bad_lines
        self.bad_files += other.bad_files
        for message in other.problems:
            self.note(message)
        for reason, count in other.dropped.items():
            self.drop(reason, count)

    def to_json(self) -> dict[str, Any]:
        # dataclasses.asdict's dict, in field order, built directly: asdict's recursive copy
        # cost ~40 us a device (4 s of a 100K-device conversion's commit)
        return {"rows_read": self.rows_read, "windows_written": self.windows_written,
                "dropped": dict(self.dropped), "mixed_label_windows": self.mixed_label_windows,
                "bad_lines": self.bad_lines, "bad_files": self.bad_files, "problems": list(self.problems)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> DeviceReport:
        return cls(
            rows_read=int(raw["rows_read"]),
            windows_written=int(raw["windows_written"]),
            dropped={str(k): int(v) for k, v in raw["dropped"].items()},
            mixed_label_windows=int(raw["mixed_label_windows"]),
            bad_lines=int(raw["bad_lines"]),
            bad_files=int(raw.get("bad_files", 0)),
            problems=[str(p) for p in raw.get("problems", [])],
        )


def array_attributes(name: str) -> dict[str, Any]:
    """The Zarr attributes a writer gives array ``name``: what it holds, and its units."""
    if name == GIMU:
        return {"long_name": "curated sensor windows", "channels": list(CHANNELS),
                "units": list(CHANNEL_UNITS)}
    if name == TIMESTAMP:
        return {"long_name": "burst start, UTC (INT64_MIN = unknown)", "units": TIMESTAMP_UNITS}
    if name == DEVICE:
        return {"long_name": "device (tracker) id"}
    if name == LABEL:
        return {"long_name": f"behaviour label ({LABEL_UNLABELLED} = unlabelled)"}
    raise KeyError(f"{name!r} is not an array of the format")


def check_root_attrs(attrs: dict[str, Any], *, where: str) -> dict[str, Any]:
    """Return the birdzarr section of a group's attributes, or raise a precise error."""
    meta = attrs.get(ATTRS_KEY)
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise NotAStoreError(
            f"{where} is a Zarr group but not a birdzarr store (no '{ATTRS_KEY}.format_version' "
            "attribute). Create one with `birdzarr convert SOURCE DEST`."
        )
    version = meta["format_version"]
    if not isinstance(version, int) or isinstance(version, bool):  # "1" would read as version 1
        raise FormatVersionError(
            f"{where} has birdzarr format version {version!r}, a {type(version).__name__} where every "
            f"version so far is an integer (this birdzarr supports {_supported()}): a newer birdzarr "
            "wrote it (upgrade: pip install -U birdzarr), or its zarr.json is damaged (restore it "
            "from a copy of the store)."
        )
    if version not in SUPPORTED_VERSIONS:
        raise FormatVersionError(
            f"{where} has birdzarr format version {version!r}; this birdzarr "
            f"supports {_supported()}. Upgrade birdzarr (pip install -U birdzarr)."
        )
    return meta


def _supported() -> str:
    """``version 1`` / ``versions 1 and 2``: the readable versions, for messages."""
    if len(SUPPORTED_VERSIONS) == 1:
        return f"version {SUPPORTED_VERSIONS[0]}"
    return f"versions {', '.join(map(str, SUPPORTED_VERSIONS[:-1]))} and {SUPPORTED_VERSIONS[-1]}"


def format1_refusal(where: str, operation: str, meta: dict[str, Any], *,
                    cannot: str = "change it") -> FormatVersionError:
    """The one error of every operation that would write into a format-1 store (append, repair
    --source, subset, ...): birdzarr reads format 1 and writes format 2 only. Names the store,
    the operation, and the ``birdzarr convert`` command that writes a format-2 store from the
    store's recorded source(s) (``meta``: its root attributes); ``cannot``: what the operation
    would have done to the store."""
    report = meta.get("report") or {}
    records = [report, *(a for a in report.get("appends") or [] if isinstance(a, dict))]
    # a conversion of several sources records them comma-separated
    sources = [one for r in records if r.get("source") for one in str(r["source"]).split(", ")]
    named = " ".join(dict.fromkeys(sources)) or "SOURCE"
    shuffle = " --shuffle" if (meta.get("layout") or {}).get("shuffled") else ""
    return FormatVersionError(
        f"{where} is a format-1 store, which birdzarr reads but no longer writes, so {operation} "
        f"cannot {cannot}: write a format-2 store from its source with `birdzarr convert {named} "
        f"NEW_STORE{shuffle}` and use that one."
    )
