#!/usr/bin/env python
"""What the template's own callbacks cost per step, measured inside one train.py run (no process-to-process noise).

    python scripts/bench_callbacks.py                          # 1 process, batch 1024, the shipped callbacks
    python scripts/bench_callbacks.py --batch-size 256 --cycles 12
    python scripts/bench_callbacks.py --ddp                    # 2 gloo processes (trainer=ddp_cpu), no raw phase
    python scripts/bench_callbacks.py -- model=cnn             # extra train.py overrides after --
    python scripts/bench_callbacks.py --totals                 # all / none / raw only, in short blocks

scripts/benchmark.py starts each variant as its own process, and on a shared machine one process can run 70% slower
than the next for no reason of its own, which hides differences of a few percent. Here one run takes the template's
callbacks out of ``trainer.callbacks`` and puts them back in blocks of steps (``lit_template.testing.bench.
CallbackGate``): all of them (as shipped), none, and each one alone, in a cycle that reverses every other time. Each
figure is a median over one block's steps; each ratio is taken within a cycle (blocks seconds apart) and the median
over cycles is printed with the spread (lowest .. highest cycle), so a reader can tell a real difference from noise;
the two ratios with targets also get a 95% bootstrap interval of that median (resampling the cycles).
With ``--totals`` a cycle is only ``raw``, ``all`` and ``none`` in blocks of 10 steps, so the blocks of one ratio lie a
fraction of a second apart and a slow spell of the machine (they last seconds here) rarely splits them; the
per-callback rows then show only the time inside each callback's hooks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the template's own callbacks (conf/callbacks/*.yaml key -> class); those in the shipped defaults are gated.
# garbage_collection is not: it changes Python's collector for the whole process, so every phase runs under it
# (scripts/bench_gc.py measures it, process against process).
OWN = {
    "sync_check": "SyncCheck",
    "profiling": "ProfilingCallback",
    "hang_doctor": "HangDoctor",
    "nonfinite_guard": "NonFiniteGuard",
    "rng_state": "RngState",
    "last_checkpoint": "LastCheckpoint",
    "preemption": "Preemption",
}


def shipped_callbacks() -> set[str]:
    from hydra import compose, initialize_config_dir

    import lit_template.utils.resolvers  # noqa: F401

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return {k for k, v in compose(config_name="train").callbacks.items() if v is not None}


def block_medians(times: dict[str, list[list[float]]], phase: str) -> list[float]:
    """Per cycle, the median step time (ms) of that phase's block; NaN for a cycle whose block kept no step."""
    return [statistics.median(block) * 1e3 if block else float("nan") for block in times[phase]]


def spread(values: list[float]) -> str:
    values = [v for v in values if v == v]
    return f"{statistics.median(values):.3f} ({min(values):.3f} .. {max(values):.3f})" if values else "-"


def median_ci(values: list[float], draws: int = 2000) -> str:
    """A 95% bootstrap interval of the median over cycles: how far the printed median itself may be off."""
    values = [v for v in values if v == v]
    if len(values) < 4:
        return "too few cycles for an interval"
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return f"median's 95% interval {medians[int(0.025 * draws)]:.3f} .. {medians[int(0.975 * draws) - 1]:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument(
        "--block-steps", type=int, default=None, help="steps per block, the first not kept (40; 10 with --totals)"
    )
    parser.add_argument("--cycles", type=int, default=None, help="times every phase runs (8; 64 with --totals)")
    parser.add_argument("--totals", action="store_true", help="only the all, none and raw phases, in short blocks")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--ddp", action="store_true", help="2 gloo processes (trainer=ddp_cpu)")
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides (after --)")
    args = parser.parse_args()
    if args.block_steps is None:
        args.block_steps = 10 if args.totals else 40
    if args.cycles is None:
        args.cycles = 64 if args.totals else 8

    gated = {k: c for k, c in OWN.items() if k in shipped_callbacks()}
    phases = 2 + (not args.ddp) + (0 if args.totals else len(gated))
    steps = args.block_steps * phases * args.cycles
    with tempfile.TemporaryDirectory(prefix="lt-bench-callbacks-") as tmp:
        out = Path(tmp) / "gate.json"
        classes = "[" + ",".join(gated.values()) + "]"
        cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            *(["trainer=ddp_cpu"] if args.ddp else []),
            f"data.batch_size={args.batch_size}",
            # one epoch longer than the run (each of the ranks gets its share): no validation or epoch end inside it
            f"data.train_repeat={max(1, steps * args.batch_size * (2 if args.ddp else 1) // 1000 + 1)}",
            f"trainer.max_steps={steps}",
            "trainer.max_epochs=1",
            "test=false",
            "callbacks.early_stopping=null",
            "optimized_metric=null",
            f"paths.log_dir={tmp}/logs",
            "+callbacks.bench._target_=lit_template.testing.bench.CallbackGate",
            f"+callbacks.bench.classes={classes}",
            f"+callbacks.bench.block_steps={args.block_steps}",
            f"+callbacks.bench.out={out}",
            f"+callbacks.bench.raw={not args.ddp}",
            f"+callbacks.bench.alone={not args.totals}",
            *args.overrides,
        ]
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(args.threads)}
        print(f"{steps} steps: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"train.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    times = result["times"]
    none = block_medians(times, "none")
    every = block_medians(times, "all")
    print(
        f"\nprocesses: {2 if args.ddp else 1}  batch size: {args.batch_size}  blocks of {args.block_steps} steps  "
        f"cycles: {len(none)}  threads per process: {args.threads}  cpus: {os.cpu_count()}"
    )
    raw = block_medians(times, "raw") if "raw" in times else []
    if raw:
        print(f"step time of the hand-written loop (raw):       {spread(raw)} ms (median of block medians, range)")
    print(f"step time with none of the template's callbacks: {spread(none)} ms")
    print(f"step time as shipped (all of them):              {spread(every)} ms")
    ratio = [a / n for a, n in zip(every, none, strict=False)]
    print(f"all / none (the template's own callbacks together): {spread(ratio)}   target <= 1.03 at batch 1024")
    print(f"  {median_ci(ratio)}")
    if raw:
        shipped_raw = [a / r for a, r in zip(every, raw, strict=False)]
        print(f"as shipped / raw (b/a): {spread(shipped_raw)}   target <= 1.15 at batch 1024, <= 1.30 at 256")
        print(f"  {median_ci(shipped_raw)}")
        print(
            f"none / raw (d/a, Lightning and the LitModule): {spread([n / r for n, r in zip(none, raw, strict=False)])}"
        )
    hook_us = result["hook_us"]
    if args.totals:
        print("each callback: the time inside its own per-step hooks (us per step, measured directly)")
    else:
        print(
            "each callback: alone minus none in the same cycle (us per step; median, range over cycles), and the time"
            " inside its own per-step hooks (us per step, measured directly)"
        )
    for cls in gated.values():
        if args.totals:
            print(f"  {cls:<18} {'':<32} hooks {hook_us[cls]:8.1f}")
            continue
        alone = block_medians(times, f"only:{cls}")
        us = [(a - n) * 1e3 for a, n in zip(alone, none, strict=False)]
        print(f"  {cls:<18} {spread(us):<32} hooks {hook_us[cls]:8.1f}")
    us = [(a - n) * 1e3 for a, n in zip(every, none, strict=False)]
    print(f"  {'all together':<18} {spread(us):<32} hooks {sum(hook_us.values()):8.1f}")
    print(
        "(the difference between 'all together' and the hooks' sum is Lightning's dispatch of the hooks the"
        " callbacks override (lean_hooks skips the others), the timing of each hook, and what the hooks leave"
        " behind for the step: caches, allocations)"
    )
    print(
        "(none: the callbacks' Lightning hooks are not called; what they installed outside those hooks still runs:"
        " the profiler's fetch marks, the hang doctor's watchdog thread)"
    )


if __name__ == "__main__":
    main()
