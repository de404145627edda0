"""CLI commands for stores in buckets and on other machines: copy."""

from __future__ import annotations

import argparse

from birdzarr.cli._args import positive_int


def _cmd_copy(args: argparse.Namespace) -> int:
    from birdzarr.maintenance._copy import copy_store
    from birdzarr.storage._location import redact

    result = copy_store(
        args.source, args.dest, overwrite=args.overwrite, requests=args.requests, progress=not args.quiet
    )
    print(f"{redact(args.dest)}: {result.format()}")
    return 0


def add_copy(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "copy",
        help="upload or download a whole store (resumable, checksums verified, committed last)",
        description="Copy a committed store between any two locations (path, s3://, memory://, ...). "
        "Objects already at DEST with the same size and MD5 are skipped, so re-running an "
        "interrupted copy resumes it. The root zarr.json is written last, after every object is "
        "verified: DEST becomes a store only when the copy is complete. A damaged source (a "
        "committed chunk missing, or failing its CRC-32C) is never committed: the copy stops "
        "before its commit, exit 2, naming the first damaged chunk. Credentials come from the "
        "standard AWS chain (AWS_* variables, profile, instance role); AWS_ENDPOINT_URL or "
        "FSSPEC_S3_ENDPOINT_URL point s3:// at MinIO or another S3-compatible server.",
    )
    p.add_argument("source", help="committed store: path or URL")
    p.add_argument("dest", help="destination path or URL (s3://bucket/prefix/store.zarr, /scratch/x.zarr)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a different store at DEST (identical objects are kept)")
    p.add_argument("--requests", type=positive_int, default=16,
                   help="objects transferred at once (default 16)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_copy)


COMMANDS = [add_copy]
