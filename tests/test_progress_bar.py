"""The template's progress bar (conf/callbacks/rich_progress_bar.yaml): per-step values named in ``step_metrics`` are
shown from the first log step on, and change only at log steps (read on the host there, not per step)."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lit_template.callbacks.progress_bar import ProgressBar


class StepLoss(BoringModel):
    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        # a value that differs every step, logged without prog_bar as the template's models do
        self.log("train/loss_step", torch.tensor(float(self.global_step)), on_step=True, on_epoch=False)
        return out


class Shown(L.Callback):
    def __init__(self, bar: ProgressBar) -> None:
        self.bar, self.seen = bar, {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.seen[trainer.global_step] = self.bar.get_metrics(trainer, pl_module).get("train/loss_step")


def test_step_metrics_are_read_at_log_steps_and_held_in_between(tmp_path):
    bar = ProgressBar(refresh_rate=10, step_metrics=["train/loss_step"])
    shown = Shown(bar)
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=25,
        log_every_n_steps=10,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        callbacks=[bar, shown],
    )
    trainer.fit(StepLoss())
    assert all(shown.seen[step] is None for step in range(1, 10)), shown.seen
    # logged at step k (global_step k+1 after it): shown from log step 10 until the next one, 20
    assert {shown.seen[step] for step in range(10, 20)} == {9.0}, shown.seen
    assert {shown.seen[step] for step in range(20, 26)} == {19.0}, shown.seen


def test_shipped_config_is_this_bar_at_ten_redraws_a_second():
    from conftest import ROOT
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=gpt_tiny"])
    bar = cfg.callbacks.rich_progress_bar
    assert bar._target_ == "lit_template.callbacks.progress_bar.ProgressBar"
    assert bar.refresh_rate == 10 and list(bar.step_metrics) == ["train/loss_step"]


class Counting(ProgressBar):
    """Counts the rebuilds of the metrics column in training batches, and records the bar's position after each."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rebuilt_at: list[int] = []
        self.position: list[int] = []

    def _update_metrics(self, trainer, pl_module) -> None:
        if trainer.training:
            self.rebuilt_at.append(trainer.global_step)
        super()._update_metrics(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.position.append(int(self.progress.tasks[self.train_progress_bar_id].completed))


def test_metrics_column_is_rebuilt_at_log_steps_and_the_bar_moves_every_batch(tmp_path):
    bar = Counting(refresh_rate=10, step_metrics=["train/loss_step"])
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        limit_train_batches=25,
        log_every_n_steps=10,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        callbacks=[bar],
    )
    trainer.fit(StepLoss())
    # each epoch's first batch (global_step 1 and 26 after it), the log steps 10, 20, 30, 40 and 50, and the epoch
    # ends (25 and 50, Lightning's on_train_epoch_end): 9 of the 50 batches, not 50
    assert bar.rebuilt_at == [1, 10, 20, 25, 26, 30, 40, 50, 50], bar.rebuilt_at
    assert bar.position == [*range(1, 26), *range(1, 26)], bar.position
