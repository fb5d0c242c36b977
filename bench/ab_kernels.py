"""A compiled CPU kernel against its torch fallback, inside the tiered lookup, in one process.

Command: ``.venv/bin/python bench/ab_kernels.py [score|sketch] [--ids N] [--batch B] [--lookups L]``
(default ``score``, 766,000 ids as in ``bench_cache.py``'s tiered cases, B=8,192, 240 lookups;
about a minute).

Timing two checkouts one after the other (``bench/ab.py``, ``profile_tiered.py`` run alternately)
cannot see a change of a few percent on this VM: a lookup's time drifts by 30% between runs. Here
one cache serves ``profile_tiered.py``'s Zipf(1.1) trace (1% / 10% tiers, row-wise AdaGrad, d=64,
one torch thread) and the lookups alternate, one by one, between the kernels on and off (the
torch operations they replace: the same results bit for bit, so both modes see the same cache),
with the parity of the first switched between runs' halves. Each lookup is timed in the thread's
CPU time, which leaves out the time the VM lends the core to others; so is the kernel's own
call site (``Policy.score_at`` for ``score``, ``FrequencySketch.add_and_estimate`` and
``raise_to`` for ``sketch``), so that both the part and the whole are seen.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from bench.profile_tiered import tiered_cache, zipf_batches  # noqa: E402
from embcache import policy as policy_mod  # noqa: E402
from embcache import score_kernels, sketch_kernels  # noqa: E402

# what each case switches: the module whose kernels are on or off, and the call sites it times
_CASES: dict[str, tuple[Any, list[tuple[Any, str]]]] = {
    "score": (score_kernels, [(policy_mod.Policy, "score_at")]),
    "sketch": (sketch_kernels, [(policy_mod.FrequencySketch, "add_and_estimate"),
                                (policy_mod.FrequencySketch, "raise_to")]),
}


def main(argv: list[str]) -> int:
    """Run the A/B; see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", nargs="?", default="score", choices=sorted(_CASES))
    ap.add_argument("--ids", type=int, default=766_000)
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--lookups", type=int, default=240)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    module, sites = _CASES[args.case]
    if not module.available():
        print(f"{args.case}: the compiled kernels are not available here (numba missing?)")
        return 1
    kernels_on = dict(module._KERNELS)
    mode = [True]
    site_time = {True: 0.0, False: 0.0}

    def set_mode(on: bool) -> None:
        mode[0] = on
        module._KERNELS.clear()
        module._KERNELS.update(kernels_on if on else {"ok": False})

    originals = [(owner, name, getattr(owner, name)) for owner, name in sites]

    def timed(fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                site_time[mode[0]] += time.thread_time() - t0
        return call

    draw = zipf_batches(args.ids, args.batch)
    lookups: dict[bool, list[float]] = {True: [], False: []}
    try:
        for owner, name, fn in originals:
            setattr(owner, name, timed(fn))
        with tempfile.TemporaryDirectory() as d, tiered_cache(args.ids, 64, d) as cache:
            for i in range(60):  # warm-up, both modes
                set_mode(i % 2 == 0)
                cache.lookup("t", draw())
            site_time[True] = site_time[False] = 0.0
            for i in range(args.lookups):
                first = i < args.lookups // 2  # the first half starts with the kernels on, the second off
                set_mode((i % 2 == 0) == first)
                keys = draw()
                t0 = time.thread_time()
                cache.lookup("t", keys)
                lookups[mode[0]].append(time.thread_time() - t0)
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        set_mode(True)
    where = " + ".join(name for _, name in sites)
    for on in (True, False):
        t = 1e3 * np.array(lookups[on])
        state = "on " if on else "off"
        print(f"{args.case} kernels {state}: lookup median {np.median(t):.2f} ms, mean {t.mean():.2f} ms; "
              f"{where} {1e3 * site_time[on] / max(len(t), 1):.3f} ms a lookup ({len(t)} lookups, thread CPU time)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
