"""Test-only callback for tests/test_comm.py, importable by ``python train.py`` when tests/ is on PYTHONPATH."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch


class SaveRankParamTrace(L.Callback):
    """Every rank keeps its flattened parameters after every optimizer step and saves them at fit end, rank-local:
    ``<run dir>/rank_params/rank<R>.pt`` = ``{"global_rank", "steps": [global_step...], "params": (steps, n)}``."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.params: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        # after the strategy's optimizer_step, so after any model averaging of this step
        self.steps.append(trainer.global_step)
        self.params.append(torch.cat([p.detach().reshape(-1).cpu() for p in pl_module.parameters()]))

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out = Path(trainer.default_root_dir) / "rank_params"
        out.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"global_rank": trainer.global_rank, "steps": self.steps, "params": torch.stack(self.params)},
            out / f"rank{trainer.global_rank}.pt",
        )


class RecordCommHook(L.Callback):
    """Every rank writes which DDP communication hook its model ran, and the hook state's step count, at train end
    (on_fit_end is too late: the strategy has unwrapped the DDP model by then):
    ``<run dir>/comm_hooks/rank<R>.json`` = ``{"global_rank", "hooks": [name...], "states": [...], "state_iters"}``."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        hooks = getattr(trainer.strategy.model, "_comm_hooks", [])
        out = Path(trainer.default_root_dir) / "comm_hooks"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{trainer.global_rank}.json").write_text(
            json.dumps(
                {
                    "global_rank": trainer.global_rank,
                    "hooks": [getattr(hook, "__name__", type(hook).__name__) for hook, _ in hooks],
                    "states": [type(state).__name__ for _, state in hooks],
                    "state_iters": [getattr(state, "iter", None) for _, state in hooks],
                }
            )
        )
