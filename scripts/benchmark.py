#!/usr/bin/env python
"""How much does the template cost over a hand-written PyTorch loop? Prints ratios measured in this one run.

    python scripts/benchmark.py            # 1 process: raw loop (a), train.py as shipped (b), train.py without the
                                           # template's own callbacks (c)
    python scripts/benchmark.py --ddp      # the same with 2 gloo processes: raw torch.distributed DDP loop vs
                                           # train.py trainer=ddp_cpu

Each variant runs as its own process, so "start to first step" includes interpreter start and imports. Step time is
the median wall time between consecutive training-iteration starts (fetch + forward + backward + step + hooks),
with warm-up steps and epoch boundaries (validation) left out. Same model (conf/model/mlp.yaml), data (digits,
repeated so an epoch is long), batch size and number of steps everywhere.
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

ROOT = Path(__file__).resolve().parents[1]
# the template's own callbacks; variant (c) turns off those present in conf/callbacks/default.yaml
OWN_CALLBACKS = ("sync_check", "profiling", "hang_doctor", "nonfinite_guard", "rng_state")


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    import lit_template.utils.resolvers  # noqa: F401

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def raw_worker(rank: int, world: int, args: argparse.Namespace, port: int, out: str, t0: float) -> None:
    """The hand-written loop: the shipped MLP and optimizer, the digits loader, nothing else."""
    import hydra
    import torch
    from torch import nn

    from lit_template.utils.bench import StepClock

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        import torch.distributed as dist

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = compose(data_overrides(args))
    torch.manual_seed(cfg.seed)
    dm = hydra.utils.instantiate(cfg.data)
    dm.setup("fit")
    net = hydra.utils.instantiate(cfg.model.net)
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    optimizer = hydra.utils.instantiate(cfg.model.optimizer)(params=model.parameters())
    loader = dm.train_dataloader()
    if world > 1:
        from torch.utils.data import DataLoader, DistributedSampler

        sampler = DistributedSampler(dm.data_train, num_replicas=world, rank=rank, shuffle=True)
        loader = DataLoader(dm.data_train, batch_size=cfg.data.batch_size, sampler=sampler)
    loss_fn = nn.CrossEntropyLoss()
    clock = StepClock(t0)
    step, epoch = 0, 0
    model.train()
    while step < args.steps:
        if world > 1:
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            clock.iteration_start()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            clock.first_step_done()
            step += 1
            if step >= args.steps:
                break
        clock.epoch_boundary()
        epoch += 1
    if rank == 0:
        clock.dump(out, global_step=step)
    if world > 1:
        dist.destroy_process_group()


def data_overrides(args: argparse.Namespace) -> list[str]:
    return [f"data.batch_size={args.batch_size}", f"data.train_repeat={args.repeat}"]


def run_variant(name: str, cmd: list[str], out: Path, env: dict) -> dict:
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "LT_BENCH_T0": repr(t0)}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.time() - t0
    return result


def summarize(result: dict, skip: int) -> tuple[float, float]:
    steps = result["step_s"][skip:]
    return statistics.median(steps) * 1e3, result["first_step_after_start_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=20, help="digits training split repeated per epoch")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the median")
    parser.add_argument("--ddp", action="store_true", help="2 gloo processes instead of 1")
    parser.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.raw_worker:
        t0 = float(os.environ.get("LT_BENCH_T0", time.time()))
        if args.world == 1:
            raw_worker(0, 1, args, 0, args.out, t0)
        else:
            import socket

            import torch.multiprocessing as mp

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            mp.spawn(raw_worker, args=(args.world, args, port, args.out, t0), nprocs=args.world)
        return

    world = 2 if args.ddp else 1
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    tmp = Path(tempfile.mkdtemp(prefix="lt-bench-"))
    common = [*data_overrides(args), f"trainer.max_steps={args.steps}", "trainer.max_epochs=1000", "test=false",
              f"paths.log_dir={tmp / 'logs'}", "callbacks.early_stopping=null", "optimized_metric=null"]
    if world > 1:
        common.insert(0, "trainer=ddp_cpu")
    default_callbacks = set(compose([]).callbacks)
    own_off = [f"callbacks.{name}=null" for name in OWN_CALLBACKS if name in default_callbacks]
    timer = ["+callbacks.bench._target_=lit_template.utils.bench.StepTimer"]

    variants = {
        "a": ("raw PyTorch loop" + (" (DDP, torch.distributed)" if world > 1 else ""),
              [sys.executable, __file__, "--raw-worker", f"--world={world}", f"--batch-size={args.batch_size}",
               f"--repeat={args.repeat}", f"--steps={args.steps}"]),
        "b": ("train.py, default callbacks", [sys.executable, "train.py", *common, *timer]),
        "c": ("train.py, template callbacks off", [sys.executable, "train.py", *common, *own_off, *timer]),
    }
    results = {}
    for key, (label, cmd) in variants.items():
        out = tmp / f"{key}.json"
        cmd = cmd + ([f"--out={out}"] if key == "a" else [f"+callbacks.bench.out={out}"])
        print(f"running ({key}) {label} ...", file=sys.stderr, flush=True)
        results[key] = summarize(run_variant(label, cmd, out, env), args.skip)

    a_ms = results["a"][0]
    print(f"\nprocesses: {world}  batch size: {args.batch_size}  steps: {args.steps} (median over the last "
          f"{args.steps - args.skip - 1})  cpu threads: {os.cpu_count()}")
    print(f"{'variant':<42} {'step ms (median)':>17} {'ratio to a':>11} {'start to first step s':>22}")
    for key, (label, _) in variants.items():
        ms, first = results[key]
        print(f"({key}) {label:<38} {ms:>17.2f} {ms / a_ms:>11.3f} {first:>22.2f}")
    print(f"\nb/a = {results['b'][0] / a_ms:.3f}   c/a = {results['c'][0] / a_ms:.3f}")
    if own_off:
        print(f"(c) turns off: {', '.join(own_off)}")


if __name__ == "__main__":
    main()
