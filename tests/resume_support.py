"""Test-only model for tests/test_preemption.py (on PYTHONPATH=tests): the classifier, with a configure_optimizers
that reads ``trainer.estimated_stepping_batches`` as a OneCycle or cosine schedule sized in steps does. That builds the
train dataloader before the checkpoint is restored (Lightning #20550)."""

from __future__ import annotations

from typing import Any

from lit_template.models import LitClassifier


class StepsSizedClassifier(LitClassifier):
    def configure_optimizers(self) -> dict[str, Any]:
        self.total_steps = int(self.trainer.estimated_stepping_batches)
        return super().configure_optimizers()
