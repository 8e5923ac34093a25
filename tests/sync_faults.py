"""Test-only pieces for tests/test_sync_check.py, loaded by train.py through PYTHONPATH=tests.

- NoSyncStep: every rank runs one step's backward under DDP's ``no_sync()``: each keeps its own shard's gradient.
- MLPWithSideBranch: the default MLP plus a side layer that one rank never uses (the unused-parameter case).
- CollectiveProbe: at fit end each rank writes the sync check's collective log to ``<run dir>/probe_rank<r>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn

from lit_template.callbacks.sync_check import SyncCheck
from lit_template.models import MLP


class NoSyncStep(L.Callback):
    def __init__(self, step: int = 2) -> None:
        self.step = step
        self._context: Any = None
        self.fired = False

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self.step and not self.fired:
            self.fired = True
            self._context = trainer.strategy.model.no_sync()
            self._context.__enter__()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None


class MLPWithSideBranch(MLP):
    def __init__(self, *args: Any, skip_on_rank: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        num_classes = kwargs["num_classes"]
        self.side = nn.Linear(num_classes, num_classes)
        self.skip_on_rank = skip_on_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if dist.is_initialized() and dist.get_rank() == self.skip_on_rank:
            return logits
        return logits + self.side(logits)


class CollectiveProbe(L.Callback):
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        check = next(c for c in trainer.callbacks if isinstance(c, SyncCheck))
        path = Path(trainer.default_root_dir) / f"probe_rank{trainer.global_rank}.json"
        path.write_text(
            json.dumps(
                {"global_rank": trainer.global_rank, "collective_log": check.collective_log, "active": check.active}
            )
        )
