"""The image classifier LitModule: any ``net``, cross-entropy, torchmetrics accuracy, optimizer and scheduler by
config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from torch import nn
from torchmetrics import MaxMetric, MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lit_template.errors import ConfigError

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


class EpochSums:
    """A training epoch's loss sum and correct count as device tensors, steps and samples as ints: no host read."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss: torch.Tensor | None = None
        self.correct: torch.Tensor | None = None
        self.steps = self.samples = 0

    def add(self, loss: torch.Tensor, preds: torch.Tensor, targets: torch.Tensor) -> None:
        correct = (preds == targets).sum()
        if self.loss is None or self.correct is None:
            self.loss, self.correct = loss.detach().clone(), correct
        else:
            self.loss += loss.detach()
            self.correct += correct
        self.steps += 1
        self.samples += targets.numel()


class LitClassifier(L.LightningModule):
    """Classifies ``(x, y)`` batches. ``optimizer`` and ``scheduler`` are partials (``_partial_: true`` in yaml)."""

    def __init__(
        self,
        net: nn.Module,
        optimizer: OptimizerFactory,
        num_classes: int,
        scheduler: SchedulerFactory | None = None,
        scheduler_interval: str = "epoch",
        compile: bool = False,
    ) -> None:
        super().__init__()
        # Only plain values go into the checkpoint's hparams, so it loads with torch.load(weights_only=True); the net's
        # weights are in the state_dict and the optimizer factories come from the config.
        self.save_hyperparameters(logger=False, ignore=["net", "optimizer", "scheduler"])
        self.net = net
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.criterion = nn.CrossEntropyLoss()
        # torchmetrics reduces across ranks itself when logged: no sync_dist needed.
        # Training: per step only the two tensor additions of EpochSums (a torchmetrics update is 35-65 us of Python
        # per call on a CPU, 1.5% of a 6 ms step: scripts/bench_callbacks.py); at epoch end the sums go into these
        # weighted means, which sync across ranks: the numbers per-step metric updates would give. No NaN check (a
        # host sync on a GPU; NonFiniteGuard checks the loss).
        self.train_sums = EpochSums()
        self.train_loss = MeanMetric(nan_strategy="disable")
        self.train_acc = MeanMetric(nan_strategy="disable")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_loss, self.test_loss = MeanMetric(), MeanMetric()
        # Persistent: it is in the checkpoint, so a resumed run reports the same best as an uninterrupted one.
        self.val_acc_best = MaxMetric()
        self.val_acc_best.persistent(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_start(self) -> None:
        # The sanity check ran validation already; its numbers must not count. val_acc_best is left alone: the sanity
        # check never updates it, and after a resume it holds the restored best.
        self.val_loss.reset()
        self.val_acc.reset()

    def model_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        loss = self.criterion(logits, y)
        return loss, logits.argmax(dim=1), y

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, preds, targets = self.model_step(batch)
        # Nothing logged per step: Lightning moves a logged Metric object to the device on every self.log call (~1 ms a
        # step for a small model). The epoch's numbers are logged once, at its end.
        self.train_sums.add(loss, preds, targets)
        return loss

    def on_train_epoch_end(self) -> None:
        sums = self.train_sums
        if sums.steps:
            self.train_loss.update(sums.loss / sums.steps, weight=sums.steps)  # the mean of the steps' losses
            self.train_acc.update(sums.correct / sums.samples, weight=sums.samples)  # micro accuracy
        # compute() syncs across DDP ranks. Every rank runs this hook, in the same order, and what is logged is then a
        # plain number: no rank-zero-only reader (the progress bar) can start a collective the others do not join.
        self.log("train/loss", self.train_loss.compute(), prog_bar=True)
        self.log("train/acc", self.train_acc.compute(), prog_bar=True)
        self.train_loss.reset()
        self.train_acc.reset()
        sums.reset()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.val_loss(loss)
        self.val_acc(preds, targets)
        self.log("val/loss", self.val_loss, on_step=False, on_epoch=True, prog_bar=True)
        self.log("val/acc", self.val_acc, on_step=False, on_epoch=True, prog_bar=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking:
            return
        self.val_acc_best(self.val_acc.compute())
        self.log("val/acc_best", self.val_acc_best.compute(), sync_dist=True, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        loss, preds, targets = self.model_step(batch)
        self.test_loss(loss)
        self.test_acc(preds, targets)
        self.log("test/loss", self.test_loss, on_step=False, on_epoch=True)
        self.log("test/acc", self.test_acc, on_step=False, on_epoch=True)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        """``prediction`` (the likeliest class), ``scores`` (softmax, batch x classes) and the samples' ``index``.

        predict.py's batches are ``{"index", "input", "target"}`` dicts; a plain ``(x, y)`` or ``x`` batch has no
        index, and a prediction writer takes the indices Lightning's predict loop tracked instead."""
        if isinstance(batch, dict):
            x, index = batch["input"], batch.get("index")
        else:
            x, index = (batch[0] if isinstance(batch, (tuple, list)) else batch), None
        scores = self(x).float().softmax(dim=1)
        out = {"prediction": scores.argmax(dim=1), "scores": scores}
        if index is not None:
            out["index"] = index
        return out

    def setup(self, stage: str) -> None:
        if self.hparams.compile and stage == "fit":
            self.net = torch.compile(self.net)

    def configure_optimizers(self) -> dict[str, Any]:
        try:
            optimizer = self.optimizer_factory(params=self.trainer.model.parameters())
        except (ValueError, TypeError) as err:  # torch's own check of lr, betas, momentum, ...
            raise ConfigError(f"model.optimizer: {err} (see conf/model/)") from None
        if self.scheduler_factory is None:
            return {"optimizer": optimizer}
        try:
            scheduler = self.scheduler_factory(optimizer=optimizer)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"model.scheduler: {err} (see conf/model/)") from None
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": scheduler,
                "monitor": "val/loss",
                "interval": self.hparams.scheduler_interval,
            },
        }
