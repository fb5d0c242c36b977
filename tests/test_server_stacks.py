"""The server's stack dump (``kill -USR1``): every thread, named, the main thread first."""

from __future__ import annotations

import faulthandler
import io
import tempfile
import threading

from embcache.server.stacks import dump_stacks


def test_every_thread_is_dumped_by_name_even_past_faulthandlers_100() -> None:
    # A 16-core server runs more than 100 Python threads (64 gRPC workers, 32 stream workers, its
    # own); faulthandler stops at 100 and cut the main thread on an H100 node.
    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, name=f"worker-{i:03d}", daemon=True) for i in range(120)]
    for t in threads:
        t.start()
    try:
        out = io.StringIO()
        n = dump_stacks(out)
        text = out.getvalue()
        with tempfile.TemporaryFile("w+") as f:  # what faulthandler makes of the same threads
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            fh = f.read()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert n >= 121 and text.count("\nThread 0x") == n
    assert all(f"(worker-{i:03d}, daemon):" in text for i in range(120))
    first = text.index("\nThread 0x")
    assert text[first:].split("\n")[1].endswith("(MainThread):")  # the main thread first
    assert "in test_every_thread_is_dumped_by_name_even_past_faulthandlers_100\n" in text
    assert fh.rstrip().endswith("...")  # faulthandler: cut at 100 threads
