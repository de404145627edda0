"""CLI commands that make and describe stores: demo, convert, subset, info."""

from __future__ import annotations

import argparse
import json

from birdzarr._errors import ArgumentError
from birdzarr.cli._args import chunk_windows, non_negative_int, positive_int, seed


def _cmd_convert(args: argparse.Namespace) -> int:
    from birdzarr.convert import convert
    from birdzarr.store._summary import format_summary, summary

    if not args.shuffle and (args.seed is not None or args.shuffle_tmp is not None):
        raise ArgumentError("--seed and --shuffle-tmp apply to --shuffle only: add --shuffle, or leave them "
                            "out")
    client = None
    if args.dask_scheduler:  # read, curate and write on a Dask cluster (docs/scaling.md#dask)
        from birdzarr.convert._dask import connect

        client = connect(args.dask_scheduler)
    source = args.source if len(args.source) > 1 else args.source[0]
    store = convert(
        source, args.dest, overwrite=args.overwrite, chunk_windows=args.chunk_windows,
        on_bad_rows=args.on_bad_rows, workers=args.workers, progress=not args.quiet, shuffle=args.shuffle,
        seed=args.seed, shuffle_tmp=args.shuffle_tmp, client=client,
        skip_unknown_files=args.skip_unknown_files,
    )
    if client is not None:
        client.close()
    print(format_summary(summary(store)))
    # the root attributes hold these (and the summary's totals): no device table is parsed
    skipped = store.root.get("skipped_files") or []
    if skipped:
        print(f"skipped {len(skipped)} source entries that are not input files (--skip-unknown-files): "
              f"{', '.join(skipped[:10])}{' ...' if len(skipped) > 10 else ''}")
    ignored = store.root.get("report", {}).get("ignored_columns") or {}
    if ignored:
        print(f"columns not read (see the warning): {', '.join(ignored)}")
    duplicates = store.root.get("report", {}).get("duplicate_windows") or {}
    if duplicates:
        print(f"duplicate windows (kept, see the warning): {sum(duplicates.values()):,} in "
              f"{len(duplicates)} device(s)")
    return 0


def _cmd_info(args: argparse.Namespace) -> int:
    from birdzarr.store._handle import open_store
    from birdzarr.store._summary import format_summary

    store = open_store(args.store)
    if args.devices:
        from birdzarr.explore._html import device_records, device_table_text

        print(json.dumps(device_records(store), indent=2) if args.json else device_table_text(store))
        return 0
    info = store.summary()
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        print(format_summary(info))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from birdzarr.demo._run import run_demo

    return run_demo(args.directory, windows=args.windows)


def add_convert(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("convert", help="convert CSV exports or Parquet files into a store")
    p.add_argument("source", nargs="+",
                   help="directory, file or fsspec URL of {device}_{part}.csv, {device}.parquet or Parquet "
                        "partition files with a device_id column; several sources convert as one directory "
                        "holding all their files")
    p.add_argument("dest", help="store path or URL (s3://bucket/x.zarr, ...)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a birdzarr store at DEST, only once the new one has committed (needs "
                        "room for both until then); anything else at DEST is never replaced")
    p.add_argument("--chunk-windows", type=chunk_windows, default=None,
                   help="windows per chunk (default 8192; 32768 with --shuffle)")
    p.add_argument("--on-bad-rows", choices=("error", "skip"), default="error",
                   help="stop at the first malformed row (default) or skip and count them")
    p.add_argument("--skip-unknown-files", action="store_true",
                   help="skip entries of SOURCE that are not input files and list them in the report "
                        "(default: such entries are an error)")
    p.add_argument("--workers", type=non_negative_int, default=None,
                   help="processes or threads doing conversion work (default, or 0: all usable cores, as "
                        "CPU affinity and the cgroup quota allow; at most 4 per core); the store is "
                        "identical for any count")
    p.add_argument("--shuffle", action="store_true",
                   help="store every chunk as a seeded uniform random sample of all windows "
                        "(docs/conversion.md#shuffle)")
    p.add_argument("--seed", type=seed, default=None,
                   help="seed of --shuffle (default: random, recorded)")
    p.add_argument("--shuffle-tmp", default=None, metavar="DIR",
                   help="where --shuffle spills its temporary bucket files (default: $TMPDIR); removed after")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dask-scheduler", default=None, metavar="ADDRESS",
                   help="run on a Dask cluster (tcp://host:8786); needs birdzarr[dask]")
    p.set_defaults(func=_cmd_convert)


def _cmd_subset(args: argparse.Namespace) -> int:
    from birdzarr import subset
    from birdzarr.store._summary import format_summary, summary

    store = subset(
        args.source, args.dest, devices=args.devices, exclude_devices=args.exclude_devices,
        split=args.split, split_by=args.split_by, val_fraction=args.val_fraction, split_seed=args.split_seed,
        labelled_only=args.labelled_only, labels=args.labels, start=args.start, stop=args.stop,
        overwrite=args.overwrite, progress=not args.quiet,
    )
    print(format_summary(summary(store)))
    made = store.root["subset"]
    print(f"subset: {made['windows']:,} of the {made['source_n_windows']:,} windows of {made['source']}")
    return 0


def _ids(text: str) -> list[int]:
    """Comma-separated integers (device ids, labels): ``1,2,5``."""
    try:
        return [int(one) for one in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers (1,2,5), got {text!r}") from None


def _time(text: str) -> str | int:
    """A burst time: unix seconds (digits only) or an ISO 8601 date or time, UTC (checked by
    ``birdzarr.subset``, as ``WindowDataset`` checks it)."""
    return int(text) if text.lstrip("-").isdigit() else text


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number between 0 and 1, got {text}")
    return value


def add_subset(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("subset", help="write the windows a training selection keeps as their own store "
                                      "(streams without reading the windows it leaves out)")
    p.add_argument("source", help="a format-2 store (path or URL)")
    p.add_argument("dest", help="the new store's path or URL")
    p.add_argument("--devices", type=_ids, default=None, metavar="ID,ID,...", help="only these devices")
    p.add_argument("--exclude-devices", type=_ids, default=None, metavar="ID,ID,...",
                   help="leave these devices out")
    p.add_argument("--split", choices=("train", "val"), default=None,
                   help="one side of WindowDataset's seeded split (docs/training.md#subsets-and-splits)")
    p.add_argument("--split-by", choices=("device", "window"), default="device",
                   help="split whole devices (default) or single windows")
    p.add_argument("--val-fraction", type=_fraction, default=0.1, help="the share of 'val' (default 0.1)")
    p.add_argument("--split-seed", type=non_negative_int, default=0, help="seed of the split (default 0)")
    p.add_argument("--labelled-only", action="store_true", help="only labelled windows (label != -1)")
    p.add_argument("--labels", type=_ids, default=None, metavar="L,L,...",
                   help="only windows of these labels")
    p.add_argument("--start", type=_time, default=None, metavar="TIME",
                   help="only windows whose burst time is at or after TIME: ISO 8601, UTC (2012-06-01, "
                        "2012-06-01T12:00) or unix seconds (1338508800)")
    p.add_argument("--stop", type=_time, default=None, metavar="TIME",
                   help="only windows whose burst time is before TIME (as --start)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a birdzarr store at DEST, only once the subset has committed")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_subset)


def add_info(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("info", help="summarise a store")
    p.add_argument("store")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--devices", action="store_true", help="the device table: one line per device")
    p.set_defaults(func=_cmd_info)


def add_demo(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="generate small raw data in both formats, convert, summarise")
    p.add_argument("directory", nargs="?", default="./demo")
    p.add_argument("--windows", type=positive_int, default=200_000,
                   help="windows of Parquet data to generate")
    p.set_defaults(func=_cmd_demo)



COMMANDS = [add_demo, add_convert, add_subset, add_info]
