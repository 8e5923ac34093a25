"""Test-only callback for tests/test_host_sync.py (on PYTHONPATH=tests): counts, per optimizer step, the calls that
read a tensor's value on the host (on a GPU each is a device->host sync), and writes where they came from.

Counted from a training batch's start until the next one (its optimizer step and Lightning's logging and progress
bar after it included; validation and the epoch's end are not per-step costs and are not counted): ``Tensor.item``,
``.tolist``, ``.cpu``, ``.numpy``, ``__bool__``, ``__int__``, ``__float__``. Not counted: reads inside
``torch.optim`` (Adam's step counters live on the CPU unless ``capturable``: no device sync) and ``.to("cpu")``, which
on a CPU run cannot be told apart from the loader moving the batch to the root device. Each read is attributed to
the innermost frame of the template or of Lightning.
"""

from __future__ import annotations

import json
import sys
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning as L
import torch

from lit_template.models.gpt import GPT

METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


class HostReads(L.Callback):
    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.per_step: dict[int, int] = defaultdict(int)
        self.where: dict[str, int] = defaultdict(int)
        self._saved: dict[str, Any] = {}
        self._trainer: L.Trainer | None = None
        self._log_steps: set[int] = set()
        self._in_batch = False
        self._batch_step = 0

    def _count(self) -> None:
        if not self._in_batch:
            return
        stack = traceback.extract_stack()[:-2]
        if stack and "/torch/optim/" in stack[-1].filename:  # the optimizer's own (CPU) step counters
            return
        frames = [f for f in stack if "/lit_template/" in f.filename or "/lightning/" in f.filename]
        top = frames[-1] if frames else None
        owner = "template" if top is not None and "/lit_template/" in top.filename else "lightning"
        self.per_step[f"{self._batch_step}:{owner}"] += 1
        self.where[f"{owner} {Path(top.filename).name}:{top.lineno} {top.name}" if top else "?"] += 1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        for name in METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(tensor, *args, __original=original, **kwargs):
                self._count()
                return __original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        # Lightning logs when (batches stepped + 1) % log_every_n_steps == 0 (or at an epoch's last batch)
        loop = trainer.fit_loop.epoch_loop
        if (loop._batches_that_stepped + 1) % trainer.log_every_n_steps == 0 or loop.batch_progress.is_last_batch:
            self._log_steps.add(trainer.global_step)
        self._in_batch = True
        self._batch_step = trainer.global_step

    # what Lightning does after a batch's hooks (logging, the progress bar) belongs to that batch; validation and
    # the epoch's end do not
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._in_batch = False

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._in_batch = False

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved = {}
        if trainer.is_global_zero:
            self.out.write_text(
                json.dumps(
                    {
                        "per_step": dict(self.per_step),
                        "log_steps": sorted(self._log_steps),
                        "where": dict(self.where),
                        "steps": trainer.global_step,
                    },
                    indent=1,
                )
            )
        print(f"host reads written to {self.out}", file=sys.stderr)


class GPTLossOnBar(GPT):
    """model=gpt logging its step loss with ``prog_bar=True``, the way Lightning's docs show it (for the test that
    shows what that costs)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.model_step(batch)
        self.log("train/loss_step", loss.detach(), on_step=True, on_epoch=False, prog_bar=True)
        return loss


class CudaSyncDebug(L.Callback):
    """On a GPU: ``torch.cuda.set_sync_debug_mode("error")`` from a training batch's start until the next one's (its
    optimizer step, Lightning's logging and the progress bar after it, the next batch's copy to the device), so any
    synchronising CUDA call there raises and fails the run. Off for the first ``warmup`` steps (lazy CUDA and cuBLAS
    set-up), at log steps, at the sync check's steps (every ``sync_every``), at an epoch's last batch and outside the
    training batches (validation, epoch ends). Rank zero writes ``{"checked": [steps], "steps": S}`` to ``out``."""

    def __init__(self, out: str, warmup: int = 3, sync_every: int = 100) -> None:
        self.out = Path(out)
        self.warmup, self.sync_every = warmup, sync_every
        self.checked: list[int] = []

    def _set(self, on: bool) -> None:
        if torch.cuda.is_available():  # on the CPU only the choice of steps runs (its own test)
            torch.cuda.set_sync_debug_mode("error" if on else "default")

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        loop = trainer.fit_loop.epoch_loop
        step = trainer.global_step
        log_step = (loop._batches_that_stepped + 1) % trainer.log_every_n_steps == 0
        last = loop.batch_progress.is_last_batch
        # the sync check compares replicas when the step it is about to make is a multiple of sync_every
        sync_step = (step + 1) % self.sync_every == 0 or step % self.sync_every == 0
        quiet = step >= self.warmup and not (log_step or last or sync_step)
        self._set(quiet)
        if quiet:
            self.checked.append(step)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._set(False)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._set(False)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._set(False)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._set(False)
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"checked": self.checked, "steps": trainer.global_step}))
