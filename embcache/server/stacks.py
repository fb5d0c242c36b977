"""Every thread's stack, named, for an operator looking at a stuck server (``kill -USR1 PID``).

``faulthandler`` stops at 100 threads, and a server runs more on a large machine (4 gRPC workers
a core, half as many stream workers, plus its own): on a 16-core H100 node its dump on SIGUSR1 was
cut before the main thread. This module writes all of them, with their names, main thread first.
The shutdown's dump of gRPC calls that outlived their grace period uses it too. It runs in Python,
so for USR1 the server calls it from its main loop, which the signal handler only flags;
a server whose interpreter is stuck still answers ``kill -USR2`` from faulthandler's C handler
(at most 100 threads, no names).
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import TextIO

__all__ = ["dump_stacks"]


def dump_stacks(file: TextIO | None = None) -> int:
    """Write every Python thread's name and stack to ``file`` (default stderr), the main thread
    first, the rest by name; returns how many threads were written."""
    out = file if file is not None else sys.stderr
    frames = sys._current_frames()
    threads = {t.ident: t for t in threading.enumerate()}
    main = threading.main_thread().ident

    def name(ident: int) -> str:
        t = threads.get(ident)
        return t.name if t is not None else "(no threading.Thread)"

    order = sorted(frames, key=lambda ident: (ident != main, name(ident), ident))
    parts = [f"embcache-server: the stacks of {len(order)} threads (most recent call last)\n"]
    for ident in order:
        t = threads.get(ident)
        daemon = ", daemon" if t is not None and t.daemon else ""
        parts.append(f"\nThread 0x{ident:x} ({name(ident)}{daemon}):\n")
        parts.append("".join(traceback.format_stack(frames[ident])))
    del frames  # frames hold their locals: let them go at once
    out.write("".join(parts))
    out.flush()
    return len(order)
