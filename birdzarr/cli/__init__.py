"""The ``birdzarr`` command line. Each private module registers one group of subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from birdzarr._errors import BirdzarrError
from birdzarr.cli import _cloud_cmds, _explore_cmds, _reliability_cmds, _store_cmds

# One module per group of subcommands; each exposes COMMANDS, a list of add_<name>(subparsers).
_MODULES = [_store_cmds, _cloud_cmds, _explore_cmds, _reliability_cmds]


def build_parser() -> argparse.ArgumentParser:
    from birdzarr import __version__

    parser = argparse.ArgumentParser(
        prog="birdzarr", description="Convert, inspect and serve bird tracker windows as Zarr v3 stores."
    )
    parser.add_argument("--version", action="version", version=f"birdzarr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _MODULES:
        for add in module.COMMANDS:
            add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BirdzarrError as exc:
        print(f"birdzarr {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"birdzarr {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
