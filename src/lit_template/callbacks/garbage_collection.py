"""Python's garbage collector on a schedule during fit: at the same steps on every rank, full passes at fixed points.

Left to itself, CPython's collector runs whenever enough objects were allocated: a few young collections per step
(Lightning's loop allocates thousands of small objects a step) and, every few hundred steps, a full pass over every
object the process holds (500,000 after importing torch, Lightning and Hydra: about 0.25 s on this project's CPU
machine, so 1.5-2 ms a step on average at batch 1024, see docs/benchmarks.md). Under DDP each rank's collector fires
at its own moment, and the other ranks wait for it at the next gradient all-reduce.

This callback, at the start of fit: one full collection, then ``gc.freeze()`` (the objects alive now, the libraries'
and the model's, are never traversed again), then automatic collection off. It collects the young generations every
``every_n_steps`` optimizer steps, on every rank at the same step, and does a full pass at each validation end and
training epoch end, where the loop pauses anyway, and every ``full_every_n_steps`` steps (so one long epoch frees its
cyclic garbage too; with the freeze a full pass takes a few ms). At the end of fit (or on an exception) the collector
is put back as it was. Forked children (dataloader workers) get automatic collection back at once
(``os.register_at_fork``).

    python train.py callbacks.garbage_collection.every_n_steps=200   # fewer, larger collections
    python train.py callbacks.garbage_collection=null                # Python's automatic collector
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import lightning as L

from lit_template.diagnostics.report import append_jsonl, reports_dir, say
from lit_template.errors import ConfigError

OPTION = "callbacks.garbage_collection"

# The forked child of a process whose collector this callback turned off turns it back on (dataloader workers run
# user code for a whole epoch). Registered once per process; a flag says whether the schedule is active.
_SCHEDULE_ACTIVE = False
_FORK_HOOK_REGISTERED = False


def _after_fork_in_child() -> None:
    global _SCHEDULE_ACTIVE
    if _SCHEDULE_ACTIVE:
        _SCHEDULE_ACTIVE = False
        gc.enable()


class GarbageCollection(L.Callback):
    """Collects garbage at fixed optimizer steps on every rank instead of whenever CPython's thresholds say.

    Args:
        every_n_steps: collect the young generations (``gc.collect(1)``) every this many optimizer steps; a full
            collection runs at each validation end and training epoch end. None: automatic collection stays on (only
            the freeze applies).
        full_every_n_steps: also a full collection every this many optimizer steps (None: only at validation and
            epoch ends); a multiple of ``every_n_steps`` replaces that step's young collection.
        freeze: ``gc.freeze()`` after the first full collection, so later full passes skip what was alive at the
            start of fit.
        warn_ms: say so (console and ``reports/gc.jsonl``) when one collection takes longer: the step makes many
            reference cycles, or holds many objects that are not frozen.
    """

    def __init__(
        self,
        every_n_steps: int | None = 50,
        full_every_n_steps: int | None = 1000,
        freeze: bool = True,
        warn_ms: float = 50.0,
    ) -> None:
        for name, value, null in (
            ("every_n_steps", every_n_steps, "Python's automatic collector"),
            ("full_every_n_steps", full_every_n_steps, "full passes at validation and epoch ends only"),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(
                    f"{OPTION}.{name} must be a whole number of optimizer steps >= 1 (or null: {null}), got {value!r}"
                )
        if not warn_ms > 0:
            raise ConfigError(f"{OPTION}.warn_ms must be a positive number of milliseconds, got {warn_ms!r}")
        self.every_n_steps = every_n_steps
        self.full_every_n_steps = full_every_n_steps
        self.freeze = freeze
        self.warn_ms = float(warn_ms)
        self._active = False
        self._was_enabled = True
        self._froze = False
        self._last_step = -1
        self._last_full_step = -1
        self.collections = 0
        self.start_ms = 0.0  # the first full collection and the freeze

    # -- the loop -----------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        global _SCHEDULE_ACTIVE, _FORK_HOOK_REGISTERED
        self._restore()  # a second fit with the same callback starts from Python's own state
        self._was_enabled = gc.isenabled()
        self._last_step = trainer.global_step
        self._last_full_step = -1
        self.collections = 0
        start = time.perf_counter()
        gc.collect()
        if self.freeze:
            gc.freeze()
            self._froze = True
        self.start_ms = (time.perf_counter() - start) * 1e3
        if self.every_n_steps is not None:
            gc.disable()
            self._active = _SCHEDULE_ACTIVE = True
            if not _FORK_HOOK_REGISTERED and hasattr(os, "register_at_fork"):
                os.register_at_fork(after_in_child=_after_fork_in_child)
                _FORK_HOOK_REGISTERED = True
        if trainer.is_global_zero:
            schedule = (
                f"automatic collection off, the young generations collected every {self.every_n_steps} steps on every "
                "rank and a full pass at epoch ends"
                + (f" and every {self.full_every_n_steps} steps" if self.full_every_n_steps else "")
                if self._active
                else "automatic collection on"
            )
            frozen = f"{gc.get_freeze_count()} objects frozen, " if self._froze else ""
            say(f"garbage collection: {frozen}{schedule} ({self.start_ms:.0f} ms at train start)", level=logging.INFO)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if not self._active or step == self._last_step:  # no optimizer step in this batch (accumulation)
            return
        self._last_step = step
        if self.full_every_n_steps is not None and step % self.full_every_n_steps == 0:
            self._full_pass(trainer)
        elif step % self.every_n_steps == 0:
            self._collect(trainer, generation=1)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._full_pass(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._full_pass(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._restore()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()

    # -- helpers ------------------------------------------------------------------------------------------------------
    def _full_pass(self, trainer: L.Trainer) -> None:
        # once per step: validation at an epoch's end is followed by the epoch end itself
        if self._active and trainer.global_step != self._last_full_step:
            self._last_full_step = trainer.global_step
            self._collect(trainer, generation=2)

    def _collect(self, trainer: L.Trainer, generation: int) -> None:
        start = time.perf_counter()
        freed = gc.collect(generation)
        took_ms = (time.perf_counter() - start) * 1e3
        self.collections += 1
        if took_ms > self.warn_ms:
            record = {
                "kind": "slow_garbage_collection",
                "global_step": trainer.global_step,
                "global_rank": trainer.global_rank,
                "generation": generation,
                "took_ms": round(took_ms, 3),
                "freed_objects": freed,
                "unfrozen_objects": len(gc.get_objects()),
            }
            append_jsonl(reports_dir(trainer) / "gc.jsonl", record)
            say(
                f"garbage collection: on global rank {trainer.global_rank} at step {trainer.global_step} a "
                f"generation-{generation} collection took {took_ms:.0f} ms and freed {freed} objects "
                f"({record['unfrozen_objects']} objects not frozen): the training step leaves many reference cycles "
                f"or long-lived objects behind ({OPTION}.warn_ms={self.warn_ms:g})"
            )

    def _restore(self) -> None:
        global _SCHEDULE_ACTIVE
        if self._active:
            self._active = _SCHEDULE_ACTIVE = False
            if self._was_enabled:
                gc.enable()
        if self._froze:
            self._froze = False
            gc.unfreeze()
