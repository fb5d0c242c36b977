"""The ``embcache`` command: tools around the cache.

    embcache sizing TRACE...    miss-ratio curves and tier sizes for a target hit ratio
    embcache reshard --servers A,B --add C     add or remove parameter-server shards, moving rows
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import __version__, reshard, sizing

__all__ = ["main"]


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
    p = sub.add_parser("reshard", help="add or remove parameter-server shards, moving every row whose owner changes",
                       description=reshard.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    reshard.add_arguments(p)
    p.set_defaults(run=reshard.run)
    args = parser.parse_args(argv)
    return int(args.run(args))
