"""CLI commands that keep a store whole: append, verify, repair."""

from __future__ import annotations

import argparse
import json

from birdzarr.cli._args import non_negative_int


def _cmd_append(args: argparse.Namespace) -> int:
    from birdzarr.convert._append import append_detailed
    from birdzarr.store._summary import format_summary, summary

    client = None
    if args.dask_scheduler:  # read and write on a Dask cluster, as convert does (docs/scaling.md)
        from birdzarr.convert._dask import connect

        client = connect(args.dask_scheduler)
    try:
        result = append_detailed(
            args.store, args.source, on_bad_rows=args.on_bad_rows, workers=args.workers,
            progress=not args.quiet, skip_unknown_files=args.skip_unknown_files, client=client,
        )
    finally:
        if client is not None:
            client.close()
    print(format_summary(summary(result.store)))
    print(result.format())
    if (skipped := result.skipped_line()) is not None:
        print(skipped)
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from birdzarr.maintenance._verify import verify

    source = args.source[0] if args.source and len(args.source) == 1 else args.source
    result = verify(args.store, source=source, progress=not args.quiet and not args.json)
    print(json.dumps(result.to_json(), indent=2) if args.json else result.format())
    return 0 if result.ok else 1


def _cmd_repair(args: argparse.Namespace) -> int:
    from birdzarr.maintenance._repair import repair

    source = args.source[0] if args.source and len(args.source) == 1 else args.source
    print(repair(args.store, break_lock=args.break_lock, source=source).format())
    return 0


def add_append(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("append", help="add new devices or new CSV parts to a store (atomic commit)")
    p.add_argument("store", help="an existing store (path or URL)")
    p.add_argument("source", help="directory, file or fsspec URL of {device}_{part}.csv or {device}.parquet")
    p.add_argument("--on-bad-rows", choices=("error", "skip"), default="error",
                   help="stop at the first malformed row (default) or skip and count them")
    p.add_argument("--skip-unknown-files", action="store_true",
                   help="skip entries of SOURCE that are not input files and list them (default: error)")
    p.add_argument("--workers", type=non_negative_int, default=None,
                   help="processes or threads doing the work, as convert's (default, or 0: all usable "
                        "cores)")
    p.add_argument("--dask-scheduler", default=None, metavar="ADDRESS",
                   help="run on a Dask cluster (tcp://host:8786), as convert does; needs birdzarr[dask]")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_append)


def add_verify(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("verify", help="recompute checksums, find missing chunks, compare with sources")
    p.add_argument("store")
    p.add_argument("--source", default=None, nargs="+", metavar="SOURCE",
                   help="also derive the windows again from these sources (one or several, as given "
                        "to convert and append) and compare")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_verify)


def add_repair(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("repair", help="remove what an interrupted convert or append left behind; with "
                                      "--source, rebuild damaged chunks of a format-2 store")
    p.add_argument("store")
    p.add_argument("--source", default=None, nargs="+", metavar="SOURCE",
                   help="rebuild the damaged per-window chunks (gimu_codes, gps_speed, gimu_row; in device "
                        "order also device, timestamp, label) of a format-2 store from these sources (the "
                        "files it was converted from)")
    p.add_argument("--break-lock", action="store_true",
                   help="also remove a lock whose holder cannot be checked (another host); only when "
                        "you know no writer is running")
    p.set_defaults(func=_cmd_repair)


COMMANDS = [add_append, add_verify, add_repair]
