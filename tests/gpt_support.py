"""Helpers for the GPT / model-parallel tests: the tiny model's overrides and readers of metrics and checkpoints."""

from __future__ import annotations

import csv
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

# a model small enough that a few steps on 2-4 CPU processes take seconds; dropout 0 so runs compare exactly
TINY = [
    "model=gpt",
    "data=text",
    "model.n_layer=2",
    "model.n_head=4",
    "model.n_embd=32",
    "model.block_size=32",
    "model.dropout=0.0",
    "model.warmup_steps=2",
    "data.max_bytes=200000",
    "trainer.max_epochs=-1",
    "trainer.check_val_every_n_epoch=null",
    "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=4",
    "callbacks.model_checkpoint.monitor=val/loss",
    "callbacks.model_checkpoint.mode=min",
    "callbacks.early_stopping=null",
    "callbacks.rich_progress_bar=null",
    "callbacks.model_summary=null",
    "callbacks.profiling=null",
    "optimized_metric=val/loss",
    "test=false",
]


def steps(n: int, val_every: int | None = None) -> list[str]:
    return [f"trainer.max_steps={n}", f"trainer.val_check_interval={val_every or n}"]


def column(rows: list[dict[str, str]], name: str) -> dict[int, float]:
    """``{step: value}`` of one metric in a metrics.csv."""
    return {int(r["step"]): float(r[name]) for r in rows if r.get(name)}


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    files = sorted(run_dir.glob("csv/version_*/metrics.csv"))
    assert files, f"no metrics.csv in {run_dir}"
    with open(files[-1]) as f:
        return list(csv.DictReader(f))


def load_sharded(path: Path) -> dict[str, Any]:
    """The full state of a distributed checkpoint folder, in one process (torch's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "full.pt"
        dcp_to_torch_save(path, out)
        return torch.load(out, weights_only=True)
