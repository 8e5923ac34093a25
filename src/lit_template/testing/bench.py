"""A step timer for scripts/benchmark.py: the same clock for the raw PyTorch loop and for train.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L


class StepClock:
    """Records the wall time between consecutive training-iteration starts, epoch boundaries left out.

    An iteration is everything the loop does for one batch: fetch, forward, backward, step, hooks, logging.
    """

    def __init__(self, t0: float | None = None) -> None:
        self.t0 = t0 if t0 is not None else float(os.environ.get("LT_BENCH_T0", time.time()))
        self.step_s: list[float] = []
        # the process's CPU time per step: on a shared machine it leaves out the time the process was not running
        self.step_cpu_s: list[float] = []
        self.first_step_after_start_s: float | None = None
        self._last: float | None = None
        self._last_cpu: float | None = None

    def iteration_start(self) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self._last is not None:
            self.step_s.append(now - self._last)
            self.step_cpu_s.append(cpu - self._last_cpu)
        self._last, self._last_cpu = now, cpu

    def epoch_boundary(self) -> None:
        self._last = self._last_cpu = None

    def first_step_done(self) -> None:
        if self.first_step_after_start_s is None:
            self.first_step_after_start_s = time.time() - self.t0

    def dump(self, path: str | os.PathLike, **extra: Any) -> None:
        Path(path).write_text(
            json.dumps(
                {
                    "step_s": self.step_s,
                    "step_cpu_s": self.step_cpu_s,
                    "first_step_after_start_s": self.first_step_after_start_s,
                    **extra,
                }
            )
        )


class BenchStepTimes(L.Callback):
    """``+callbacks.bench._target_=lit_template.testing.bench.BenchStepTimes +callbacks.bench.out=FILE``
    (rank zero writes)."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.clock = StepClock()

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.clock.iteration_start()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.clock.first_step_done()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.clock.epoch_boundary()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            self.clock.dump(self.out, global_step=trainer.global_step)
