"""Lightning's rich progress bar without its per-step costs.

Two things cost on every training step in Lightning 2.6 (checked against 2.6.6) that a small model or a fast GPU
notices:

- A value logged with ``prog_bar=True`` in ``training_step`` is turned into a Python number after every batch, by
  Lightning's loop itself (``_LoggerConnector.on_batch_end`` -> ``_ResultCollection.metrics`` ->
  ``convert_tensors_to_scalars``): on a GPU an ``.item()``, a device-to-host sync, per step, whatever the bar does.
  So the template logs per-step values *without* ``prog_bar`` and this bar shows the ones named in ``step_metrics``
  itself, read at the steps where Lightning logs anyway (every ``trainer.log_every_n_steps``), holding the last
  value in between.
- ``RichProgressBar.refresh_rate`` is redraws per second of a background thread, 100 by default: in a terminal that
  thread renders the whole bar 100 times a second and takes the GIL from the training loop each time.
  ``conf/callbacks/rich_progress_bar.yaml`` sets 10 (``scripts/benchmark.py --tty --lightning-costs`` measures both in
  a pseudo-terminal).

And one that is Python work, not a sync: Lightning's bar rebuilds its metrics column after every batch
(``get_metrics``: the logged values, the version number, a pass over them for tensors), about 1% of a 6 ms step on a
CPU. Those values only change at log steps (and at epoch ends, where Lightning updates the column itself), so this bar
rebuilds the column at log steps and moves the bar after every batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar


class ProgressBar(RichProgressBar):
    """``RichProgressBar`` that shows per-step values read only at log steps.

    Args:
        step_metrics: names logged in ``training_step`` without ``prog_bar`` to show (when logged), e.g.
            ``train/loss_step``; read on the host at log steps only.
        refresh_rate: redraws per second (``0`` hides the bar); the config's default is 10.
        leave: keep each finished epoch's bar on the screen.
        theme: a ``RichProgressBarTheme``.
        console_kwargs: arguments of the ``rich.console.Console``.
    """

    def __init__(self, *args: Any, step_metrics: Sequence[str] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_metrics = tuple(step_metrics)
        self._held: dict[str, float] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = trainer.log_every_n_steps
        if batch_idx == 0 or (every > 0 and trainer.global_step % every == 0):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()  # as Lightning's: a run resumed mid-epoch
        self._update(self.train_progress_bar_id, batch_idx + 1)
        self.refresh()

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        # global_step has counted this batch's optimizer step: it is a log step exactly when Lightning logs this batch
        every = trainer.log_every_n_steps
        if trainer.training and self.step_metrics and every > 0 and trainer.global_step % every == 0:
            logged = trainer.callback_metrics
            self._held = {name: float(logged[name]) for name in self.step_metrics if name in logged}
        return {**metrics, **self._held}
