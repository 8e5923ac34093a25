#!/usr/bin/env python
"""What Python's garbage collector costs per step, with the template's schedule (callbacks.garbage_collection, as
shipped) and without it (Python's automatic collector), one train.py process each, interleaved rounds.

    python scripts/bench_gc.py                        # 1 process, batch 1024, 3 rounds of 600 steps
    python scripts/bench_gc.py --ddp                  # 2 gloo processes (trainer=ddp_cpu)
    python scripts/bench_gc.py --batch-size 256 --rounds 5

The figure that matters is the mean step (the wall time a run takes), not the median: Python's full collection is
rare (every few hundred steps) and long (a quarter of a second over the half a million objects torch, Lightning and
Hydra leave alive), so a median of step times never sees it. Printed per variant: mean, median and 99th-percentile
step, the time inside collections per step (``gc.callbacks``) and the collections per generation; then, within each
round, the ratio of the mean steps (automatic over scheduled) and the median over rounds with its range. Under
``--ddp`` the figures are rank zero's: the other rank's collections reach it as waits at the gradient all-reduce.
The schedule's one-off cost at train start (one full collection and the freeze) is not in the steps; it is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {"scheduled": [], "automatic": ["callbacks.garbage_collection=null"]}


def run(variant: str, args: argparse.Namespace, tmp: Path, round_: int) -> dict:
    out = tmp / f"{variant}{round_}.json"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        *(["trainer=ddp_cpu"] if args.ddp else []),
        f"data.batch_size={args.batch_size}",
        # one epoch longer than the run (each of the ranks gets its share): no validation or epoch end inside it
        f"data.train_repeat={max(1, args.steps * args.batch_size * (2 if args.ddp else 1) // 1000 + 1)}",
        f"trainer.max_steps={args.steps}",
        "trainer.max_epochs=1",
        "test=false",
        "callbacks.early_stopping=null",
        "optimized_metric=null",
        f"paths.log_dir={tmp}/logs",
        "+callbacks.bench._target_=lit_template.testing.bench.BenchGcTimes",
        f"+callbacks.bench.out={out}",
        *VARIANTS[variant],
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"train.py ({variant}) failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(Path(f"{out}.rank0").read_text())
    steps = result["step_s"][args.skip :]
    ordered = sorted(steps)
    return {
        "mean_ms": statistics.mean(steps) * 1e3,
        "median_ms": statistics.median(steps) * 1e3,
        "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3,
        "gc_us_per_step": sum(result["gc_s"]) / max(result["global_step"], 1) * 1e6,
        "gc_max_ms": result["gc_max_s"] * 1e3,
        "gc_count": result["gc_count"],
        "start_ms": result["gc_start_ms"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out")
    parser.add_argument("--rounds", type=int, default=3, help="times each variant runs, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--ddp", action="store_true", help="2 gloo processes (trainer=ddp_cpu)")
    args = parser.parse_args()

    rows: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="lt-bench-gc-") as tmp:
        for round_ in range(args.rounds):
            order = list(VARIANTS) if round_ % 2 == 0 else list(VARIANTS)[::-1]
            for variant in order:
                rows[variant].append(run(variant, args, Path(tmp), round_))
                print(f"round {round_ + 1}/{args.rounds} {variant}: {rows[variant][-1]}", file=sys.stderr, flush=True)
    print(
        f"\nprocesses: {2 if args.ddp else 1}  batch size: {args.batch_size}  steps: {args.steps} (first {args.skip} "
        f"left out)  rounds: {args.rounds}  threads per process: {args.threads}  cpus: {os.cpu_count()}"
    )
    print(
        f"{'':<11}{'mean ms':>9}{'median ms':>11}{'p99 ms':>9}{'in gc us/step':>15}{'longest gc ms':>15}"
        "   collections (gen 0, 1, 2; per run)"
    )
    for variant, runs in rows.items():

        def med(key: str, runs: list[dict] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        counts = [round(statistics.median(r["gc_count"][g] for r in runs)) for g in range(3)]
        print(
            f"{variant:<11}{med('mean_ms'):>9.3f}{med('median_ms'):>11.3f}{med('p99_ms'):>9.3f}"
            f"{med('gc_us_per_step'):>15.0f}{med('gc_max_ms'):>15.1f}   {counts}"
        )
    ratios = [a["mean_ms"] / s["mean_ms"] for a, s in zip(rows["automatic"], rows["scheduled"], strict=True)]
    medians = [a["median_ms"] / s["median_ms"] for a, s in zip(rows["automatic"], rows["scheduled"], strict=True)]
    print(
        f"automatic / scheduled, mean step: {statistics.median(ratios):.3f} ({min(ratios):.3f} .. {max(ratios):.3f})"
        f"   median step: {statistics.median(medians):.3f} ({min(medians):.3f} .. {max(medians):.3f})"
    )
    start = [r["start_ms"] for r in rows["scheduled"]]
    print(f"the schedule's one-off cost at train start (full collection + freeze): {statistics.median(start):.0f} ms")
    print("(per variant: the median over rounds of each figure; ratios taken within a round, then the median)")


if __name__ == "__main__":
    main()
