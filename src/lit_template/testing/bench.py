"""A step timer for scripts/benchmark.py: the same clock for the raw PyTorch loop and for train.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F


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


class BenchGcTimes(BenchStepTimes):
    """``BenchStepTimes`` plus, from train start to the end of the first training epoch (scripts/bench_gc.py's runs are
    one epoch, the schedule's full pass at its end included), every garbage collection: per generation how many and
    the seconds they took (``gc.callbacks``). Not past it: at train end the schedule gives the collector back and its
    automatic passes then are not the steps'. Every rank writes ``<out>.rank<R>``."""

    def __init__(self, out: str) -> None:
        super().__init__(out)
        self.gc_count = [0, 0, 0]
        self.gc_s = [0.0, 0.0, 0.0]
        self.gc_max_s = 0.0
        self._gc_start: float | None = None

    def _seen(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            took = time.perf_counter() - self._gc_start
            self.gc_count[info["generation"]] += 1
            self.gc_s[info["generation"]] += took
            self.gc_max_s = max(self.gc_max_s, took)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import gc

        gc.callbacks.append(self._seen)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.on_train_end(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import gc

        if self._seen in gc.callbacks:
            gc.callbacks.remove(self._seen)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        schedule = [c for c in trainer.callbacks if type(c).__name__ == "GarbageCollection"]
        self.clock.dump(
            f"{self.out}.rank{trainer.global_rank}",
            gc_start_ms=schedule[0].start_ms if schedule else None,
            global_step=trainer.global_step,
            gc_count=self.gc_count,
            gc_s=self.gc_s,
            gc_max_s=self.gc_max_s,
        )


# the hooks Lightning calls on every callback at every training batch (per micro-batch or per optimizer step)
HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)


class CallbackGate(L.Callback):
    """Takes the template's own callbacks out and puts them back in blocks of steps inside one run; times each step.

    ``scripts/bench_callbacks.py`` adds it as ``+callbacks.bench``. Phases: ``all`` (as shipped), ``none`` (the
    callbacks named in ``classes`` removed from ``trainer.callbacks``, so Lightning does not even call their hooks)
    and ``only:<class>``; with ``raw``, also ``raw``: a hand-written step (the raw loop of scripts/benchmark.py: fetch
    from an iterator of its own over the datamodule's training loader, zero_grad, forward, cross-entropy, the loss
    sum and correct count the LitModule also keeps, backward, optimizer step) on the same net and optimizer, run from
    this callback's ``on_train_batch_end``, once per Lightning step of that block and timed from its fetch to its
    optimizer step, so the template and the loop it replaces are compared in one process.
    Each cycle visits every phase for ``block_steps`` steps, in reverse order every other cycle,
    so a slow spell of the machine falls on all phases alike. A step is the time between this callback's
    ``on_train_batch_end`` calls; the first step of a block (it mixes two phases) and a step across an epoch boundary
    are not kept. From the last step on every callback is back, so validation and the end of fit see them all.
    What a removed callback installed outside Lightning's hooks still runs (the profiler's fetch marks on the loop,
    the hang doctor's watchdog thread): ``none`` is the template without their hooks, not without them entirely.

    It also times each gated callback's own per-step hooks (``HOOKS``) directly, over the steps it was in the list:
    that figure has no noise from the rest of the step, but leaves out Lightning's cost of calling the hooks.

    Args:
        classes: class names of the callbacks to gate, each present once in the trainer.
        block_steps: steps per block (>= 2).
        out: JSON file rank zero writes at the end of fit: per phase, per cycle, the kept step times in seconds.
        raw: add the ``raw`` phase (1 process, a LitModule with ``net`` and ``(x, y)`` batches of class indices).
        alone: add the ``only:<class>`` phases; without them a cycle is short (``all``, ``none``, maybe ``raw``), so
            the ratios between them come from blocks a fraction of a second apart.
    """

    def __init__(self, classes: list[str], block_steps: int, out: str, raw: bool = False, alone: bool = True) -> None:
        if block_steps < 2:
            raise ValueError(f"CallbackGate: block_steps must be >= 2, got {block_steps}")
        self.classes, self.block_steps, self.out = list(classes), block_steps, out
        self.phases = [*(["raw"] if raw else []), "all", "none", *[f"only:{c}" for c in self.classes if alone]]
        self.times: dict[str, list[list[float]]] = {p: [] for p in self.phases}
        self._full: list[L.Callback] = []
        self._gated: dict[str, L.Callback] = {}
        self._phase: str | None = None
        self._cycle = 0
        self._kept = False
        self._start: float | None = None
        self.hook_s = {c: 0.0 for c in self.classes}  # time inside each callback's per-step hooks
        self.present_steps = {c: 0 for c in self.classes}
        self._present: set[str] = set(self.classes)
        self._raw_batches: Any = None
        self._raw_sums: list[torch.Tensor] = []

    def _raw_step(self, trainer: L.Trainer, pl_module: L.LightningModule) -> float:
        """One step of the hand-written loop on the LitModule's net and optimizer; its time in seconds."""
        if trainer.world_size > 1:
            raise ValueError("CallbackGate: the raw phase runs on 1 process only")
        optimizer = trainer.optimizers[0]
        start = time.perf_counter()
        try:
            x, y = next(self._raw_batches)
        except StopIteration:
            self._raw_batches = iter(trainer.datamodule.train_dataloader())
            x, y = next(self._raw_batches)
        x, y = x.to(pl_module.device), y.to(pl_module.device)
        optimizer.zero_grad(set_to_none=True)
        logits = pl_module.net(x)
        loss = F.cross_entropy(logits, y)
        self._raw_sums[0] += loss.detach()
        self._raw_sums[1] += (logits.argmax(dim=1) == y).sum()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    def _time_hooks(self, cls: str, callback: L.Callback) -> None:
        for hook in HOOKS:
            if getattr(type(callback), hook) is getattr(L.Callback, hook):
                # Callback's own no-op: the shipped run's dispatch (lightning_compat.lean_hooks) skips it, and so
                # must the timed run, or "all" would pay for calls the shipped run never makes (25 a step with the
                # shipped callbacks, about 10 us)
                continue
            original = getattr(callback, hook)

            def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.hook_s[cls] += time.perf_counter() - start

            setattr(callback, hook, timed)  # an instance attribute: Lightning's getattr finds it first

    def _schedule(self, step: int) -> tuple[int, str]:
        cycle, block = divmod(step // self.block_steps, len(self.phases))
        return cycle, (self.phases if cycle % 2 == 0 else self.phases[::-1])[block]

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._full = list(trainer.callbacks)
        for cls in self.classes:
            found = [c for c in self._full if type(c).__name__ == cls]
            if len(found) != 1:
                raise ValueError(f"CallbackGate: {len(found)} callbacks of class {cls} in the trainer, not 1")
            self._gated[cls] = found[0]
            self._time_hooks(cls, found[0])
        if "raw" in self.phases:
            self._raw_batches = iter(trainer.datamodule.train_dataloader())
            self._raw_sums = [torch.zeros((), device=pl_module.device) for _ in range(2)]

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = None  # the interval since the last batch holds validation and the epoch's end

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self._start is not None and self._kept:
            rows = self.times[self._phase]
            rows.extend([] for _ in range(self._cycle + 1 - len(rows)))
            rows[self._cycle].append(self._raw_step(trainer, args[0]) if self._phase == "raw" else now - self._start)
        for cls in self._present:
            self.present_steps[cls] += 1
        step = trainer.global_step  # optimizer steps done: the next batch belongs to step + 1
        last = 0 < trainer.max_steps <= step
        cycle, phase = self._schedule(step)
        self._kept = phase == self._phase and not last
        self._phase, self._cycle = phase, cycle
        if phase == "all" or last:
            keep = set(self.classes)
        else:
            keep = set() if phase in ("none", "raw") else {phase.removeprefix("only:")}
        self._present = keep
        out = {id(c) for cls, c in self._gated.items() if cls not in keep}
        # Lightning iterates trainer.callbacks afresh for every hook: the next batch sees this list
        trainer.callbacks = [c for c in self._full if id(c) not in out]
        self._start = time.perf_counter()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._full:
            trainer.callbacks = list(self._full)
        if trainer.global_rank == 0:
            hook_us = {c: self.hook_s[c] / max(self.present_steps[c], 1) * 1e6 for c in self.classes}
            payload = {
                "phases": self.phases,
                "times": self.times,
                "hook_us": hook_us,
                "present_steps": self.present_steps,
                "global_step": trainer.global_step,
            }
            Path(self.out).write_text(json.dumps(payload))
