#!/usr/bin/env python
"""How much does the template cost over a hand-written PyTorch loop? Prints ratios measured in this one run.

    python scripts/benchmark.py            # 1 process: a hand-written loop (a), train.py as shipped (b), train.py
                                           # with sync check and profiling off (c), with all the template's own
                                           # callbacks off (d)
    python scripts/benchmark.py --ddp      # the same with 2 gloo processes: a hand-written torch.distributed DDP
                                           # loop vs train.py trainer=ddp_cpu

Each variant runs as its own process, so "start to first step" includes interpreter start and imports. Step time is
the median wall time between consecutive training-iteration starts (fetch + forward + backward + step + hooks),
with warm-up steps and epoch boundaries (validation) left out. Same model (conf/model/mlp.yaml), data (digits,
repeated so an epoch is long), batch size, steps and intra-op threads everywhere. The variants run in turn, --rounds
times (a b c d, d c b a, ...), so a busy or slow spell of the machine falls on all of them; each ratio is taken within
a round and the median over rounds is printed. The hand-written loop (a) collects garbage on the schedule train.py
ships (callbacks.garbage_collection: a freeze, Python's automatic collector off, the young generations every
every_n_steps; --raw-automatic-gc: Python's own), so b/a does not count that schedule's win; (d) has it off with the
other template callbacks, so d runs Python's automatic collector (scripts/bench_gc.py measures the difference).
"""

from __future__ import annotations

import argparse
import gc
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
OWN_CALLBACKS = (
    "sync_check",
    "profiling",
    "hang_doctor",
    "nonfinite_guard",
    "rng_state",
    "last_checkpoint",
    "preemption",
    "garbage_collection",
)
# --lightning-costs: (d) with one piece of Lightning's per-step work removed (or, for the stock bar, put back)
STOCK_BAR = [
    "callbacks.rich_progress_bar._target_=lightning.pytorch.callbacks.RichProgressBar",
    "callbacks.rich_progress_bar.refresh_rate=100",
    "~callbacks.rich_progress_bar.step_metrics",
]
LIGHTNING_COSTS = {
    "d-bar": (
        "the progress bar (none at all)",
        ["callbacks.rich_progress_bar=null", "++trainer.enable_progress_bar=false"],
    ),
    "d-logger": ("the CSV logger (writes every log_every_n_steps)", ["~logger"]),
    "d-ckpt": (
        "ModelCheckpoint's per-batch hook",
        ["callbacks.model_checkpoint=null", "++trainer.enable_checkpointing=false"],
    ),
    # negative: what Lightning's own bar (redrawn 100 times a second, metrics read every step) costs on top
    "d-stockbar": ("the template's bar instead of Lightning's RichProgressBar", STOCK_BAR),
    # negative: what Lightning's own hook dispatch (profiler contexts, no-op hooks) and the NVML probe of every CPU
    # optimizer step cost over extras.lean_hooks
    "d-lean": ("Lightning's stock hook dispatch and CUDA probe (extras.lean_hooks=false)", ["extras.lean_hooks=false"]),
}
# --per-callback: each one on alone against all off, in the same rounds (preemption saves through last_checkpoint)
ALONE = {"preemption": ("last_checkpoint", "preemption")}


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    import lit_template.utils.resolvers  # noqa: F401

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def raw_worker(rank: int, world: int, args: argparse.Namespace, port: int, out: str, t0: float) -> None:
    """The hand-written loop: the shipped MLP and optimizer, the digits loader, loss and accuracy kept by hand."""
    import hydra
    import torch
    from torch import nn

    from lit_template.testing.bench import StepClock

    torch.set_num_threads(args.threads)
    # Importing lit_template imports Lightning, which sets this; a hand-written loop has no Lightning, and under it
    # Adam's step would probe NVML for the CUDA device count at every step on the CPU (train.py avoids it too:
    # lightning_compat.cuda_device_count_cached)
    os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
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
    # the same work as train.py's callbacks.garbage_collection (on by default): one full pass and a freeze, then
    # the young generations every every_n_steps, so b/a compares the loops and not Python's collector
    gc_every = None if args.raw_automatic_gc else cfg.callbacks.garbage_collection.every_n_steps
    if gc_every is not None:
        gc.collect()
        gc.freeze()
        gc.disable()
    clock = StepClock(t0)
    step, epoch = 0, 0
    loss_sum, correct, seen = torch.zeros(()), torch.zeros((), dtype=torch.long), 0
    model.train()
    while step < args.steps:
        if world > 1:
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            clock.iteration_start()
            optimizer.zero_grad(set_to_none=True)
            logits = model(x)
            loss = loss_fn(logits, y)
            # what the template's LitClassifier also tracks per step: the epoch's mean loss and accuracy
            loss_sum += loss.detach()
            correct += (logits.argmax(dim=1) == y).sum()
            seen += y.numel()
            loss.backward()
            optimizer.step()
            clock.first_step_done()
            step += 1
            if gc_every is not None and step % gc_every == 0:
                gc.collect(1)
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


def run_in_terminal(cmd: list[str], env: dict) -> tuple[int, str]:
    """``cmd`` with stdin/stdout/stderr on a pseudo-terminal (200 x 50), as a user in a terminal runs it: rich draws
    its progress bar (to a pipe it draws nothing). The output is read as a terminal would, as fast as it comes."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env={**env, "TERM": "xterm-256color"}, stdin=slave, stdout=slave, stderr=slave
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: every process holding the terminal has exited
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(), b"".join(chunks).decode(errors="replace")


def run_variant(name: str, cmd: list[str], out: Path, env: dict, tty: bool = False) -> dict:
    out.unlink(missing_ok=True)
    t0 = time.time()
    env = {**env, "LT_BENCH_T0": repr(t0)}
    if tty:
        returncode, output = run_in_terminal(cmd, env)
        if returncode != 0:
            sys.exit(f"{name} failed ({' '.join(cmd)}):\n{output[-4000:]}")
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name} failed ({' '.join(cmd)}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["wall_s"] = time.time() - t0
    return result


def summarize(result: dict, skip: int) -> tuple[float, float, float]:
    """(median step wall ms, median step CPU ms, start to first step s)"""
    return (
        statistics.median(result["step_s"][skip:]) * 1e3,
        statistics.median(result["step_cpu_s"][skip:]) * 1e3,
        result["first_step_after_start_s"],
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=100, help="digits training split repeated per epoch")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the median")
    parser.add_argument("--rounds", type=int, default=4, help="times each variant runs, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (OMP_NUM_THREADS)")
    parser.add_argument("--ddp", action="store_true", help="2 gloo processes instead of 1")
    parser.add_argument(
        "--per-callback", action="store_true", help="also each template callback on alone (vs all off): us per step"
    )
    parser.add_argument(
        "--lightning-costs",
        action="store_true",
        help="also (d) without each avoidable piece of Lightning's per-step work (progress bar, logger) and with "
        "Lightning's stock RichProgressBar instead of the template's: us per step",
    )
    parser.add_argument(
        "--tty", action="store_true", help="run every variant on a pseudo-terminal, as a user does (rich draws its bar)"
    )
    parser.add_argument(
        "--raw-automatic-gc",
        action="store_true",
        help="the hand-written loop keeps Python's automatic garbage collector (default: the schedule train.py ships)",
    )
    parser.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    return parser.parse_args()


def raw_main(args: argparse.Namespace) -> None:
    """Variant (a) in its own process: the hand-written loop on 1 process or ``--world`` spawned ones."""
    t0 = float(os.environ.get("LT_BENCH_T0", time.time()))
    if args.world == 1:
        raw_worker(0, 1, args, 0, args.out, t0)
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(raw_worker, args=(args.world, args, port, args.out, t0), nprocs=args.world)


def build_variants(args: argparse.Namespace, world: int, tmp: Path) -> tuple[dict[str, tuple[str, list[str]]], str]:
    """{key: (label, command)} for every variant asked for, and a line saying what (c) and (d) turn off."""
    common = [
        *data_overrides(args),
        f"trainer.max_steps={args.steps}",
        "trainer.max_epochs=1000",
        "test=false",
        f"paths.log_dir={tmp / 'logs'}",
        "callbacks.early_stopping=null",
        "optimized_metric=null",
    ]
    if world > 1:
        common.insert(0, "trainer=ddp_cpu")
    default_callbacks = set(compose([]).callbacks)
    own_off = [f"callbacks.{name}=null" for name in OWN_CALLBACKS if name in default_callbacks]
    sync_prof_off = [f"callbacks.{name}=null" for name in ("sync_check", "profiling") if name in default_callbacks]
    timer = ["+callbacks.bench._target_=lit_template.testing.bench.BenchStepTimes"]
    raw = [sys.executable, __file__, "--raw-worker", f"--world={world}", f"--batch-size={args.batch_size}"]
    raw += [f"--repeat={args.repeat}", f"--steps={args.steps}", f"--threads={args.threads}"]
    raw += ["--raw-automatic-gc"] if args.raw_automatic_gc else []
    train = [sys.executable, "train.py", *common]
    variants = {
        "a": ("raw PyTorch loop" + (" (DDP, torch.distributed)" if world > 1 else ""), raw),
        "b": ("train.py, default callbacks", [*train, *timer]),
        "c": ("train.py, sync check + profiling off", [*train, *sync_prof_off, *timer]),
        "d": ("train.py, all template callbacks off", [*train, *own_off, *timer]),
    }
    if args.per_callback:
        for name in OWN_CALLBACKS:
            if name not in default_callbacks:
                continue
            on = ALONE.get(name, (name,))
            off = [o for o in own_off if o.split("=")[0].removeprefix("callbacks.") not in on]
            variants[f"d+{name}"] = (f"all off but {' + '.join(on)}", [*train, *off, *timer])
    if args.lightning_costs:
        # what (d) still pays per step that is Lightning's and can be switched off or replaced, one at a time
        for key, (label, extra) in LIGHTNING_COSTS.items():
            variants[key] = (label, [*train, *own_off, *extra, *timer])
    return variants, f"(c) turns off: {', '.join(sync_prof_off)}; (d) turns off: {', '.join(own_off)}"


def run_rounds(variants: dict, args: argparse.Namespace, tmp: Path, env: dict) -> dict[str, list[tuple]]:
    """Every variant ``--rounds`` times, interleaved; per variant, per round (step ms, step CPU ms, first step s)."""
    per_round: dict[str, list[tuple[float, float, float]]] = {key: [] for key in variants}
    for round_ in range(args.rounds):
        # a b c d, then d c b a: a slow drift of the machine's speed falls on every variant alike
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for key in order:
            label, cmd = variants[key]
            out = tmp / f"{key}.json"
            cmd = cmd + ([f"--out={out}"] if key == "a" else [f"+callbacks.bench.out={out}"])
            print(f"round {round_ + 1}/{args.rounds}: ({key}) {label} ...", file=sys.stderr, flush=True)
            per_round[key].append(summarize(run_variant(label, cmd, out, env, tty=args.tty), args.skip))
    return per_round


def against(per_round: dict[str, list[tuple]], key: str, base: str, us: bool = False) -> list[float]:
    """Per round, variant ``key`` against ``base`` in wall time: their ratio, or (``us``) key minus base in us."""
    return [
        (row[0] - ref[0]) * 1e3 if us else row[0] / ref[0]
        for row, ref in zip(per_round[key], per_round[base], strict=True)
    ]


def report(variants: dict, per_round: dict[str, list[tuple]], args: argparse.Namespace, world: int) -> None:
    results = {
        key: tuple(statistics.median(column) for column in zip(*rows, strict=True)) for key, rows in per_round.items()
    }
    # each ratio is taken within a round (the variants ran minutes apart at most), then the median over rounds
    ratios = {
        key: tuple(
            statistics.median(row[i] / base[i] for row, base in zip(rows, per_round["a"], strict=True)) for i in (0, 1)
        )
        for key, rows in per_round.items()
    }
    print(
        f"\nprocesses: {world}  batch size: {args.batch_size}  steps: {args.steps} (median over the last "
        f"{args.steps - args.skip - 1})  rounds: {args.rounds}  threads per process: {args.threads}  "
        f"cpus: {os.cpu_count()}"
    )
    print(f"{'variant':<42} {'step ms':>8} {'ratio':>6} {'step cpu ms':>11} {'ratio':>6} {'start to 1st step s':>20}")
    for key, (label, _) in variants.items():
        ms, cpu, first = results[key]
        print(
            f"({key}) {label:<38} {ms:>8.2f} {ratios[key][0]:>6.3f} {cpu:>11.2f} {ratios[key][1]:>6.3f} {first:>20.2f}"
        )
    print("(step ms: median of the rounds' medians; ratio: median over rounds of the ratio to (a) in that round)")
    for name, i in (("wall time", 0), ("CPU time", 1)):
        print(f"{name:>9}: b/a = {ratios['b'][i]:.3f}   c/a = {ratios['c'][i]:.3f}   d/a = {ratios['d'][i]:.3f}")
    # the spread: the same ratio in each round (how far apart repeated measurements of one thing land)
    for key in ("b", "c", "d"):
        per = against(per_round, key, "a")
        print(f"spread of {key}/a over the {args.rounds} rounds: {min(per):.3f} .. {max(per):.3f}")
    b_over_d = against(per_round, "b", "d")
    print(
        f"b/d (the template's own callbacks together): {statistics.median(b_over_d):.3f} "
        f"(rounds: {min(b_over_d):.3f} .. {max(b_over_d):.3f})"
    )
    alone = [key for key in variants if key.startswith("d+")]
    if alone:
        print("each callback on alone, against all off in the same round (median over rounds):")
        for key in alone:
            us = against(per_round, key, "d", us=True)
            print(
                f"  {key[2:]:<16} {statistics.median(us):>8.0f} us per step  (rounds: {min(us):.0f} .. {max(us):.0f})"
            )
    costs = [key for key in variants if key in LIGHTNING_COSTS]
    if costs:
        print(
            "Lightning's per-step work, against (d) in the same round (median over rounds; + is what (d) pays for it):"
        )
        for key in costs:
            us = against(per_round, "d", key, us=True)
            label = LIGHTNING_COSTS[key][0]
            print(f"  {label:<52} {statistics.median(us):>8.0f} us per step  (rounds: {min(us):.0f} .. {max(us):.0f})")


def main() -> None:
    args = parse_args()
    if args.raw_worker:
        raw_main(args)
        return
    world = 2 if args.ddp else 1
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": str(args.threads)}
    # Each run writes a full run dir (checkpoints, logs) per variant and round: removed at the end, as every bench does.
    with tempfile.TemporaryDirectory(prefix="lt-bench-") as tmp:
        variants, turned_off = build_variants(args, world, Path(tmp))
        per_round = run_rounds(variants, args, Path(tmp), env)
    report(variants, per_round, args, world)
    print(turned_off)
    print(f"output on a {'pseudo-terminal (rich draws the bar)' if args.tty else 'pipe (rich draws nothing)'}")


if __name__ == "__main__":
    main()
