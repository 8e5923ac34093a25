"""``last.ckpt`` that follows training: the one checkpoint ``ckpt_path=auto`` and ``ckpt_path=last`` resume from."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

from lit_template.distributed.preemption import StepVote
from lit_template.errors import ConfigError
from lit_template.lightning_compat import is_last_batch_of_epoch, load_pending_dataloader_state

NAME = "last"


class LastCheckpoint(ModelCheckpoint):
    """Keeps ``<dirpath>/last.ckpt`` at the newest state of training.

    Lightning 2.6's ``ModelCheckpoint(save_last=True)`` writes ``last.ckpt`` only at a step where it also saves a
    top-k checkpoint, so once the monitored metric stops improving ``last.ckpt`` stops following training. This
    callback writes it at every epoch end whatever the metrics do (at the same point of the loop as Lightning's own
    epoch checkpoints: validation end, or train epoch end without validation), at the end of training, optionally
    every ``every_n_train_steps`` optimizer steps and every ``every_n_minutes`` minutes, and when the ``preemption``
    callback stops the run. A mid-epoch ``last.ckpt`` holds the training dataloader's position
    (``data/sampling.py``), so a run resumed from it gets the batches an uninterrupted run would have got.

    Every rank calls the save (rank zero writes, through ``trainer.save_checkpoint``); the decision to save is the
    same on every rank: a step count, or rank zero's clock shared in one small vote per step.

    Args:
        dirpath: the folder of ``last.ckpt`` (the run's ``checkpoints/``).
        every_n_train_steps: also save every N optimizer steps, mid-epoch; 0: only at epoch ends.
        every_n_minutes: also save when this many minutes have passed since the last save (rank zero's clock); null:
            off. Costs one asynchronous 8-byte all-reduce per step on a CPU process group while it is on.

    Example::

        python train.py callbacks.last_checkpoint.every_n_train_steps=500
    """

    def __init__(self, dirpath: str, every_n_train_steps: int = 0, every_n_minutes: float | None = None) -> None:
        if isinstance(every_n_train_steps, bool) or not isinstance(every_n_train_steps, int) or every_n_train_steps < 0:
            raise ConfigError(
                f"callbacks.last_checkpoint.every_n_train_steps={every_n_train_steps!r}: use a whole "
                "number >= 0 (0: only at epoch ends)"
            )
        if every_n_minutes is not None and not (
            isinstance(every_n_minutes, (int, float)) and every_n_minutes > 0 and math.isfinite(every_n_minutes)
        ):
            raise ConfigError(
                f"callbacks.last_checkpoint.every_n_minutes={every_n_minutes!r}: use a number of "
                "minutes > 0, or null (off)"
            )
        super().__init__(
            dirpath=dirpath,
            filename=NAME,
            monitor=None,
            save_top_k=1,
            save_last=False,
            every_n_epochs=1,
            enable_version_counter=False,
            auto_insert_metric_name=False,
        )
        self.every_n_train_steps = every_n_train_steps
        self.every_n_minutes = every_n_minutes
        self._vote: StepVote | None = None
        self._step_seen = -1
        self._saved_at = time.monotonic()

    @property
    def path(self) -> Path:
        return Path(str(self.dirpath)) / f"{NAME}{self.FILE_EXTENSION}"

    @property
    def saved_at_step(self) -> int | None:
        """The global step of the newest ``last.ckpt`` this run wrote (None before the first)."""
        return self._last_global_step_saved if self.last_checkpoint_saved else None

    @property
    def last_checkpoint_saved(self) -> bool:
        return bool(self._last_checkpoint_saved)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if load_pending_dataloader_state(trainer):
            rank_zero_info(
                "last checkpoint: loaded the train dataloader's position from the checkpoint, which "
                "Lightning had skipped (#20550: estimated_stepping_batches read before the restore)"
            )
        self._step_seen = trainer.global_step
        self._saved_at = time.monotonic()
        if self.every_n_minutes is not None:
            self._vote = StepVote(trainer.world_size, trainer.global_rank)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._step_seen:  # accumulating gradients: no optimizer step yet
            return
        self._step_seen = step
        due = self.every_n_train_steps > 0 and step % self.every_n_train_steps == 0
        if self._vote is not None:
            minutes = (time.monotonic() - self._saved_at) / 60
            result = self._vote.vote([int(trainer.is_global_zero and minutes >= self.every_n_minutes)])
            due = due or bool(result and result[0][0])
        # at an epoch's last batch the epoch's own save comes right after validation
        if due and not is_last_batch_of_epoch(trainer) and not trainer.fast_dev_run:
            self.save_now(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._vote is not None:
            self._vote.finish()
            self._vote = None
        # stopped mid-epoch (max_steps, early stopping at a mid-epoch validation): the final state too
        if not trainer.fast_dev_run and self._last_global_step_saved != trainer.global_step:
            self.save_now(trainer)
        super().on_train_end(trainer, pl_module)

    def save_now(self, trainer: L.Trainer) -> Path:
        """Write ``last.ckpt`` now. Every rank must call this at the same point (it ends in a barrier)."""
        self.best_model_path = str(self.path)
        self._save_checkpoint(trainer, str(self.path))
        return self.path

    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self._saved_at = time.monotonic()
