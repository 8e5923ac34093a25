"""When data-parallel replicas are meant to be identical under local SGD (``comm=local_sgd``), in one object.

Lightning's DDP strategy with ``model_averaging_period`` runs torch's ``post_localSGD_hook`` and a
``PeriodicModelAverager``: for the first ``warmup_steps`` steps the gradients are all-reduced as usual; after that
each replica steps on its own gradients and the parameters are averaged every ``period`` steps. The averager's own
step count (the same on every rank) says which kind of step was just taken, so every rank decides the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class LocalSGDSchedule:
    """The sync check's view of the averager; ``averager=None`` (plain DDP): every step is synced.

    Also counts what the sync check left out because of it (saved in its summary).
    """

    averager: Any = None
    counts: dict[str, int] = field(
        default_factory=lambda: {"grad_checks_skipped": 0, "param_checks_deferred": 0, "fit_end_check_skipped": 0}
    )

    @property
    def active(self) -> bool:
        return self.averager is not None

    def grads_synced(self) -> bool:
        """Before this step's optimizer step: were its gradients all-reduced across all ranks?"""
        # the post-local SGD hook all-reduces globally for the first start_localSGD_iter backward passes (= optimizer
        # steps: Lightning skips the hook under no_sync while accumulating), as the averager counts its warm-up
        return self.averager is None or self.averager.step < self.averager.warmup_steps

    def params_synced(self) -> bool:
        """After an optimizer step: are the replicas' parameters meant to be identical now?"""
        if self.averager is None:
            return True
        step = self.averager.step - 1  # the averager's count of the step just taken (it counts from 0)
        warmup, period = self.averager.warmup_steps, self.averager.period
        return step < warmup or (step - warmup) % period == 0

    def sentence(self) -> str:
        a = self.averager
        return (
            f"sync check: local SGD (parameters averaged every {a.period} steps after step {a.warmup_steps}): "
            f"gradients are checked only before step {a.warmup_steps}, parameters right after averaging steps"
        )

    def summary(self) -> dict[str, Any] | None:
        if self.averager is None:
            return None
        return {
            "model_averaging_period": self.averager.period,
            "start_localSGD_iter": self.averager.warmup_steps,
            **self.counts,
        }
