"""bfloat16 rows on the DLRM example: stochastic rounding vs round-to-nearest, against float32.

Run from the repository root::

    .venv/bin/python bench/bench_rounding.py            # full: 8 passes of 20,000 samples, ~6 min
    .venv/bin/python bench/bench_rounding.py --quick    # 4 passes of 20,000 samples, ~3 min

Workload: ``examples/dlrm.py`` (``--mode cache-nopass``: rows move on demand) on its synthetic
Criteo-like data, embedding dim 16, row-wise AdaGrad (``--emb-optimizer``, default
``rowwise_adagrad``) at each of ``--emb-lr`` (0.01 and 0.002: late updates of a hot row are then a
few bfloat16 steps of it or less), small MLPs. Per learning rate, three runs on the same data from
the same initial model (``--seed``), one after another:

* **fp32**: rows stored in float32 (the reference);
* **bf16 RTN**: rows stored in bfloat16, updated rows rounded to nearest (torch's cast);
* **bf16 SR**: rows stored in bfloat16 with ``TableConfig.stochastic_rounding``.

Measured per run: the last training pass's mean loss, the held-out log loss and AUC, and, after
the last pass, the embedding rows of every key the run touched, compared with the fp32 run's rows
(root mean square of the difference over all tables). The summary rows are, per learning rate,
the bf16 SR run's RMS row gap to fp32 and its |log loss - fp32's| over the same for bf16 RTN (below
1: stochastic rounding is the closer). The two measure different things: stochastic rounding adds
zero-mean noise to every updated row, which the RMS row gap counts, while round-to-nearest drops
the updates below half a bfloat16 step, a bias the held-out loss shows. The dense part trains on
different embeddings in each run, so a gap of a few 1e-4 in log loss may be noise of one run.

Writes ``bench/results/rounding.json`` and ``rounding.md`` (``rounding-quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from _common import machine_info, markdown_table, write_json  # noqa: E402

from examples import dlrm  # noqa: E402

RUNS = {"fp32": [], "bf16 RTN": ["--emb-dtype", "bfloat16"],
        "bf16 SR": ["--emb-dtype", "bfloat16", "--stochastic-rounding"]}


def _options(args: argparse.Namespace, lr: float, data: str, path: str, extra: Sequence[str]) -> argparse.Namespace:
    passes, samples = (4, 20_000) if args.quick else (8, 20_000)
    argv = ["--passes", str(passes), "--samples-per-pass", str(samples), "--eval-samples", str(samples),
            "--batch", "512", "--dim", "16", "--scale", "0.01", "--bottom-mlp", "64", "--top-mlp", "64",
            "--emb-optimizer", args.emb_optimizer, "--emb-lr", str(lr), "--threads", "1", "--seed",
            str(args.seed), "--no-progress", "--mode", "cache-nopass", "--data", data, "--path", path, *extra]
    return dlrm.build_parser().parse_args(argv)


def _train(opts: argparse.Namespace) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train all passes; the summary and every touched row (float32) per table."""
    with dlrm.Trainer(opts) as tr:
        for p in range(tr.train_passes):
            tr.train_pass(p)
        assert tr.cache is not None
        rows = {t: tr.cache.lookup(t, tr.touched[t].keys).float().cpu() for t in dlrm.TABLES}
        return tr.finish(), rows


def _compare(args: argparse.Namespace, lr: float, tmp: str) -> dict[str, Any]:
    """The three runs at ``lr``, and each one's gaps to the fp32 run."""
    runs: dict[str, Any] = {}
    rows: dict[str, dict[str, torch.Tensor]] = {}
    for name, extra in RUNS.items():
        t0 = time.perf_counter()
        summary, rows[name] = _train(_options(args, lr, f"{tmp}/data", f"{tmp}/{lr:g}-{len(runs)}", extra))
        runs[name] = {"options": extra, "last_pass_loss": summary["passes"][-1]["loss"],
                      "eval_logloss": summary["eval"]["logloss"], "eval_auc": summary["auc"],
                      "seconds": time.perf_counter() - t0}
        print(f"lr {lr:g} {name}: {runs[name]}", flush=True)
    ref_rows, ref = rows["fp32"], runs["fp32"]
    n = sum(ref_rows[t].numel() for t in dlrm.TABLES)
    for name, r in runs.items():
        sq = sum(float((rows[name][t] - ref_rows[t]).pow(2).sum()) for t in dlrm.TABLES)
        r["row_rms_gap_to_fp32"] = math.sqrt(sq / n)
        r["logloss_gap_to_fp32"] = abs(r["eval_logloss"] - ref["eval_logloss"])
        r["auc_gap_to_fp32"] = abs(r["eval_auc"] - ref["eval_auc"])
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--quick", action="store_true", help="4 passes of 20,000 samples")
    p.add_argument("--out", type=Path, default=Path(HERE) / "results", help="results directory")
    p.add_argument("--emb-optimizer", default="rowwise_adagrad", choices=dlrm.EMB_OPTIMIZERS)
    p.add_argument("--emb-lr", default="0.01,0.002", help="embedding learning rates, comma-separated")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    lrs = [float(x) for x in args.emb_lr.split(",") if x.strip()]
    header = machine_info(script="bench/bench_rounding.py", argv=None if argv is None else list(argv))
    start = time.perf_counter()
    by_lr: dict[str, Any] = {}
    summary_rows = []
    with tempfile.TemporaryDirectory(prefix="embcache-rounding-") as tmp:
        for lr in lrs:
            runs = by_lr[f"{lr:g}"] = _compare(args, lr, tmp)
            sr, rtn = runs["bf16 SR"], runs["bf16 RTN"]
            for what, key in (("RMS row gap to fp32", "row_rms_gap_to_fp32"),
                              ("|log loss - fp32's|", "logloss_gap_to_fp32")):
                ratio = sr[key] / rtn[key] if rtn[key] > 0 else None
                summary_rows.append({"case": f"DLRM bf16 rows (lr {lr:g}), stochastic rounding: {what}",
                                     "reference": "the same with round-to-nearest", "ratio": ratio, "target": 1.0,
                                     "met": None if ratio is None else ratio < 1.0, "lower_is_better": True})
    result = {"machine": header, "quick": args.quick, "emb_optimizer": args.emb_optimizer, "by_lr": by_lr,
              "summary": summary_rows, "seconds": time.perf_counter() - start}
    stem = "rounding-quick" if args.quick else "rounding"
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(str(args.out / f"{stem}.json"), result)
    table = markdown_table(
        ["lr", "run", "last-pass loss", "held-out log loss", "AUC", "RMS row gap to fp32", "|log loss - fp32|",
         "|AUC - fp32|"],
        [[lr, n, f"{r['last_pass_loss']:.5f}", f"{r['eval_logloss']:.5f}", f"{r['eval_auc']:.5f}",
          f"{r['row_rms_gap_to_fp32']:.2e}", f"{r['logloss_gap_to_fp32']:.1e}", f"{r['auc_gap_to_fp32']:.1e}"]
         for lr, runs in by_lr.items() for n, r in runs.items()])
    text = (f"# bf16 rows on the DLRM example: stochastic rounding vs round-to-nearest\n\n"
            f"{'quick' if args.quick else 'full'} run, {args.emb_optimizer}, commit "
            f"`{str(header.get('git_commit'))[:7]}`\n\n{table}\n")
    (args.out / f"{stem}.md").write_text(text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
