"""Test-only callbacks, importable by ``python train.py`` when the tests put tests/ on PYTHONPATH."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class SaveRankWeights(L.Callback):
    """Every rank saves its own parameters at the end of fit: ``<run dir>/rank_weights/rank<R>.pt``."""

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out = Path(trainer.default_root_dir) / "rank_weights"
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}
        torch.save(
            {
                "global_rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "global_step": trainer.global_step,
                "state": state,
            },
            out / f"rank{trainer.global_rank}.pt",
        )


class FailAboveLR(L.Callback):
    """Raises at train start when the optimizer's lr is above ``threshold``: a trial that fails, on purpose."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        if lr > self.threshold:
            raise FloatingPointError(f"lr={lr} diverges (test: fails above {self.threshold})")


class HookLog(L.Callback):
    """Writes ``<run dir>/hooks.json``: the trainer's profiler class; per training step, the per-step hooks Lightning
    called on this callback with the LightningModule's ``_current_fx_name`` at each call; and how many times torch
    probed NVML for the CUDA device count between train start and end (``nvml_probes``, over ``steps``)."""

    HOOKS = (
        "on_train_batch_start",
        "on_before_backward",
        "on_after_backward",
        "on_before_optimizer_step",
        "on_before_zero_grad",
        "on_train_batch_end",
    )

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        for hook in self.HOOKS:
            setattr(self, hook, self._recorder(hook))

    def _recorder(self, hook: str):
        def record(trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
            self.calls.append([hook, pl_module._current_fx_name, type(args[0]).__name__ if args else ""])

        return record

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch import cuda

        self.nvml_probes, self._probe = 0, cuda._raw_device_count_nvml

        def counted() -> int:
            self.nvml_probes += 1
            return self._probe()

        cuda._raw_device_count_nvml = counted  # looked up by torch.cuda._device_count_nvml at each call

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from torch import cuda

        cuda._raw_device_count_nvml = self._probe
        self.steps = trainer.global_step

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import json

        payload = {
            "profiler": type(trainer.profiler).__name__,
            "calls": self.calls,
            "nvml_probes": self.nvml_probes,
            "steps": self.steps,
        }
        (Path(trainer.default_root_dir) / "hooks.json").write_text(json.dumps(payload))


class GcProbe(L.Callback):
    """Writes ``<run dir>/gc_probe/rank<R>.json``: per training batch whether Python's automatic collector was on and
    how many objects were frozen, every collection (generation, global step) from train start to train end, and the
    collector's state after fit. Put it after ``garbage_collection`` so its hooks see that callback's work."""

    def __init__(self) -> None:
        self.batches: list[dict] = []
        self.collections: list[dict] = []
        self.epoch_ends: list[int] = []
        self._trainer: L.Trainer | None = None

    def _seen(self, phase: str, info: dict) -> None:
        if phase == "start" and self._trainer is not None:
            # batches: how many training batches had ended (after the last one the collector is back on)
            self.collections.append(
                {
                    "generation": info["generation"],
                    "global_step": self._trainer.global_step,
                    "batches": len(self.batches),
                }
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import gc

        self._trainer = trainer
        gc.callbacks.append(self._seen)

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        import gc

        self.batches.append(
            {"global_step": trainer.global_step, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}
        )

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_ends.append(trainer.global_step)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        import gc
        import json

        gc.callbacks.remove(self._seen)
        out = Path(trainer.default_root_dir) / "gc_probe"
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "batches": self.batches,
            "collections": self.collections,
            "epoch_ends": self.epoch_ends,
            "after_fit": {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()},
        }
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(payload))
