"""Tokens/s of experiment=gpt_tiny: train.py on 1 process, FSDP2 x2 and TP x2 on the CPU, and a hand-written loop.

    nice -n 10 python scripts/bench_gpt.py --rounds 3 --steps 300

Each round runs, one after another in fresh processes: the hand-written loop (the same GPTNet, AdamW groups, schedule,
clipping and data, no Lightning), ``train.py experiment=gpt_tiny`` (trainer=cpu), the same with trainer=fsdp2_cpu and
with trainer=model_parallel_cpu. Rounds interleave so that a slow minute of a shared machine hits every variant;
ratios are taken within a round, and the table gives their median and spread (min-max over rounds).

Throughput is the job's: ``tokens per optimizer step over all data-parallel ranks / median step time`` (train.py's
from ``reports/profile.json``, which times steps as the loop sees them, without start-up and validation). FSDP2 x2
runs 2 x batch_size per step (2 data-parallel ranks), TP x2 one batch shared by both ranks. Memory per rank: the
bytes of this rank's parameters, gradients and optimizer state (local shards of DTensors), written by the
``StateMemory`` callback below, and the process's peak RSS (the profiling callback).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
BATCH, BLOCK = 32, 64  # conf/experiment/gpt_tiny.yaml
VARIANTS = {
    "train.py 1 proc": ["trainer=cpu"],
    "FSDP2 x2": ["trainer=fsdp2_cpu"],
    "TP x2": ["trainer=model_parallel_cpu"],
}
DP_SIZE = {"train.py 1 proc": 1, "FSDP2 x2": 2, "TP x2": 1}


class StateMemory(L.Callback):
    """At the end of fit: this rank's bytes of parameters, gradients and optimizer state (local shards), written to
    ``reports/state_memory_rank<R>.json``."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch.distributed.tensor import DTensor

        def nbytes(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else t
            return t.numel() * t.element_size()

        params = list(pl_module.parameters())
        state = [v for opt in trainer.optimizers for s in opt.state.values() for v in s.values()]
        record = {
            "global_rank": trainer.global_rank,
            "params_mib": sum(nbytes(p) for p in params) / 2**20,
            "grads_mib": sum(nbytes(p.grad) for p in params if p.grad is not None) / 2**20,
            "optimizer_state_mib": sum(nbytes(v) for v in state if isinstance(v, torch.Tensor) and v.dim() > 0) / 2**20,
        }
        out = Path(trainer.default_root_dir) / "reports" / f"state_memory_rank{trainer.global_rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record))


def run_train(name: str, steps: int, log_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "experiment=gpt_tiny",
        *VARIANTS[name],
        f"trainer.max_steps={steps}",
        "test=false",
        "callbacks.rich_progress_bar=null",
        "callbacks.model_checkpoint=null",
        "callbacks.last_checkpoint=null",
        "callbacks.preemption=null",
        "optimized_metric=null",
        "+callbacks.state_memory._target_=bench_gpt.StateMemory",
        f"paths.log_dir={log_dir}",
    ]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'scripts'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for key in ("LT_RUN_ID", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    run_dir = sorted((log_dir / "train" / "runs").glob("*"))[-1]
    profile = json.loads((run_dir / "reports" / "profile.json").read_text())
    step_ms = profile["step_time_ms"]["p50"]
    memory = [json.loads(p.read_text()) for p in sorted((run_dir / "reports").glob("state_memory_rank*.json"))]
    return {
        "tokens_per_s": BATCH * BLOCK * DP_SIZE[name] / (step_ms / 1000),
        "step_ms": step_ms,
        "rss_gib_max": profile["memory"]["rss_gib"]["max"],
        "state_mib_per_rank": [round(m["params_mib"] + m["grads_mib"] + m["optimizer_state_mib"], 3) for m in memory],
        "params_mib_per_rank": [round(m["params_mib"], 3) for m in memory],
    }


def hand_loop(steps: int) -> dict[str, Any]:
    """The same model, optimizer, schedule, clipping and data as experiment=gpt_tiny on one process, in plain torch."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from lit_template.data.text import TextDataModule
    from lit_template.models.gpt import WarmupCosine
    from lit_template.models.gpt_net import GPTNet

    torch.manual_seed(12345)
    data = TextDataModule(block_size=BLOCK, batch_size=BATCH)
    data.setup("fit")
    loader = DataLoader(data.data_train, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    net = GPTNet(256, BLOCK, 4, 4, 64, 0.0, True)
    params = list(net.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=0.003, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(100, steps, 0.1))
    times = []
    batches = iter(loader)
    for _ in range(steps):
        t0 = time.perf_counter()
        x, y = next(batches)
        loss = F.cross_entropy(net(x).view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        times.append(time.perf_counter() - t0)
    step_ms = statistics.median(times) * 1000
    return {"tokens_per_s": BATCH * BLOCK / (step_ms / 1000), "step_ms": step_ms, "loss": float(loss)}


def run_hand_loop(steps: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--hand-loop", "--steps", str(steps)], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode:
        raise SystemExit(f"hand-written loop failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--hand-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if args.hand_loop:
        print(json.dumps(hand_loop(args.steps)))
        return
    rounds: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            result = {"hand-written loop": run_hand_loop(args.steps)}
            for name in VARIANTS:
                result[name] = run_train(name, args.steps, Path(tmp) / f"r{r}_{name.replace(' ', '_')}")
            rounds.append(result)
            print(f"round {r + 1}: " + ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s" for k, v in result.items()))
    names = list(rounds[0])
    print(f"\nexperiment=gpt_tiny, {args.steps} steps, {args.rounds} rounds, {os.cpu_count()} CPU cores")
    print("| run | tokens/s median (min-max) | step ms median | vs train.py 1 proc, within a round: median (min-max) |")
    print("|---|---|---|---|")
    for name in names:
        tps = [r[name]["tokens_per_s"] for r in rounds]
        ratios = [r[name]["tokens_per_s"] / r["train.py 1 proc"]["tokens_per_s"] for r in rounds]
        step = statistics.median(r[name]["step_ms"] for r in rounds)
        tokens = f"{statistics.median(tps):.0f} ({min(tps):.0f}-{max(tps):.0f})"
        print(f"| {name} | {tokens} | {step:.1f} | {spread(ratios)} |")
    print("\n| run | params+grads+optimizer state per rank (MiB) | params per rank (MiB) | peak RSS per rank (GiB) |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        last = rounds[-1][name]
        print(f"| {name} | {last['state_mib_per_rank']} | {last['params_mib_per_rank']} | {last['rss_gib_max']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
