"""The ``embcache`` command: tools around the cache.

    embcache sizing TRACE...    miss-ratio curves and tier sizes for a target hit ratio
    embcache reshard --servers A,B --add C     add or remove parameter-server shards, moving rows
    embcache export STORE_DIR OUT_DIR          every stored row as a full version of the export format
    embcache import EXPORT_DIR STORE_DIR       load an exported version into a cache's store

``embcache reshard`` and ``embcache-server`` need the server extra (``pip install 'embcache[server]'``),
the plot of ``embcache sizing`` the sizing extra; without them they stop with a message naming it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from . import __version__, sizing
from ._extras import MissingExtraError, missing_extra
from .export import commands

__all__ = ["main", "server_main"]


def _reshard() -> ModuleType | MissingExtraError:
    """embcache.reshard, or the error naming the extra it needs (it speaks gRPC to the servers)."""
    try:
        from . import reshard
    except ImportError as exc:
        err = missing_extra(exc, "embcache reshard")
        if not isinstance(err, MissingExtraError):
            raise
        return err
    return reshard


def _fail(err: MissingExtraError, prog: str) -> int:
    print(f"{prog}: {err}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand."""
    parser = argparse.ArgumentParser(prog="embcache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"embcache {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sizing", help="miss-ratio curves of a key trace and the tier sizes a target needs",
                       description=sizing.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sizing.add_arguments(p)
    p.set_defaults(run=sizing.run)
    p = sub.add_parser("export", help="write every stored row of a closed cache or a checkpoint as a full version",
                       description=commands.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands.add_export_arguments(p)
    p.set_defaults(run=commands.run_export)
    p = sub.add_parser("import", help="load an exported version (full + deltas) into a cache's store",
                       description=commands.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands.add_import_arguments(p)
    p.set_defaults(run=commands.run_import)
    reshard = _reshard()
    p = sub.add_parser("reshard", help="add or remove parameter-server shards, moving every row whose owner changes",
                       description=reshard.__doc__ if isinstance(reshard, ModuleType) else str(reshard),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    if isinstance(reshard, ModuleType):
        reshard.add_arguments(p)
        p.set_defaults(run=reshard.run)
    else:  # its flags are unknown here: take any (below), and say what to install
        p.set_defaults(run=lambda _args, err=reshard: _fail(err, "embcache reshard"))
    args, unknown = parser.parse_known_args(argv)
    if unknown and not (args.command == "reshard" and isinstance(reshard, MissingExtraError)):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.run(args))


def server_main(argv: Sequence[str] | None = None) -> int:
    """``embcache-server``: :func:`embcache.server.main.main`, or status 2 naming the extra it needs."""
    try:
        from .server.main import main as run
    except ImportError as exc:
        err = missing_extra(exc, "embcache-server")
        if not isinstance(err, MissingExtraError):
            raise
        return _fail(err, "embcache-server")
    return run(argv)
