#!/usr/bin/env python
"""Why a callback's hooks take 10x longer inside a training step than in a loop: ``python scripts/bench_cold_hooks.py``.

``bench_callbacks.py`` times each callback's per-step hooks inside the step (the "hooks" column), and those figures are
several times what the same calls take in a tight loop. This script shows where the difference goes, on the default
model (conf/model/mlp.yaml, digits' shape, batch 1024 by default, one CPU thread): the profiling callback's and the
NaN guard's per-step hooks, and Lightning's ``trainer.global_step``, each timed

- warm: called again and again with nothing in between;
- cold: called once right after a real forward, backward and optimizer step (the shipped loop's situation);
- again: called a second time right after the cold call.

If "again" is close to "warm", the cold call's extra time is the hook's own code and data being out of the caches
after the step, not work the hook does: any code that runs there pays it, Lightning's included (its ModelCheckpoint
reads ``trainer.global_step`` at every batch end, so the "none" blocks of bench_callbacks.py pay that one themselves).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import lightning as L
import torch
import torch.nn.functional as F
from bench_hang_doctor import bare_trainer, default_model  # scripts/ is on sys.path: this script's own folder

from lit_template.callbacks.nonfinite_guard import NonFiniteGuard
from lit_template.callbacks.profiling import ProfilingCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=400, help="real training steps per cold measurement")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)

    model = default_model()
    x, y = torch.randn(args.batch_size, 1, 8, 8), torch.randint(0, 10, (args.batch_size,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size)
    profiling, guard = ProfilingCallback(plot=False, mfu=False), NonFiniteGuard()
    with tempfile.TemporaryDirectory() as root:
        trainer = bare_trainer(3, [profiling, guard], root)
        trainer.fit(model, loader)  # the trainer, the optimizer and the callbacks as a real fit leaves them
        # the callbacks armed again, through their own hooks, for the steps below; no profiling window (its
        # all_gather and report) in the loop. trainer.global_step does not move here, so the profiler's batch end
        # takes its path for a micro-batch without an optimizer step (a few lines fewer than a stepped batch's)
        profiling.log_every_n_steps = 10**9
        profiling.setup(trainer, model, "fit")
        profiling.on_train_start(trainer, model)
        profiling.on_train_epoch_start(trainer, model)
        guard.on_train_start(trainer, model)
        optimizer = trainer.optimizers[0]
        batch = (x, y)
        loss = torch.zeros(())

        def profiling_hooks() -> None:
            profiling.on_train_batch_start(trainer, model, batch, 0)
            profiling.on_before_backward(trainer, model, loss)
            profiling.on_before_optimizer_step(trainer, model, optimizer)
            profiling.on_train_batch_end(trainer, model, None, batch, 0)

        def guard_hooks() -> None:
            guard.on_before_backward(trainer, model, loss)
            guard.on_before_optimizer_step(trainer, model, optimizer)

        def global_step() -> None:
            trainer.global_step  # noqa: B018  a property chain through the fit loop's objects

        def real_step() -> None:
            nonlocal loss
            out = F.cross_entropy(model(x), y)
            out.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # the guard reads the gradients: keep them (zeros)
            loss = out.detach()

        print(f"batch {args.batch_size}, {args.steps} real steps per cold figure; us per call, median")
        print(f"{'hooks':34s} {'warm':>8s} {'cold':>8s} {'again':>8s}")
        for name, fn in (
            ("profiling (4 per-step hooks)", profiling_hooks),
            ("NaN guard (2 per-step hooks)", guard_hooks),
            ("trainer.global_step", global_step),
        ):
            warm = [_timed(fn) for _ in range(2000)][100:]
            cold, again = [], []
            for _ in range(args.steps):
                real_step()
                cold.append(_timed(fn))
                again.append(_timed(fn))
            print(f"{name:34s} {_us(warm):8.1f} {_us(cold):8.1f} {_us(again):8.1f}")
        raw = [_timed(real_step) for _ in range(50)]
        print(f"(the real step itself: {_us(raw) / 1e3:.2f} ms)")


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _us(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e6


if __name__ == "__main__":
    main()
