"""Finding the checkpoint a run resumes from or evaluates (``ckpt_path=last``, ``auto``, a path, or null), and
refusing a file that is not a checkpoint before Lightning tries to load it."""

from __future__ import annotations

import zipfile
from pathlib import Path

import torch
from omegaconf import DictConfig

from lit_template.errors import ConfigError


def resolve_ckpt_path(cfg: DictConfig, option: str = "ckpt_path") -> str | None:
    """``null`` → None; ``last`` → this run dir's last.ckpt, else the newest last.ckpt among earlier runs of the same
    task; ``auto`` → this run dir's last.ckpt if it exists, else None (start fresh); anything else must be an
    existing file. Whatever is found must load with ``torch.load(weights_only=True)`` and hold a ``state_dict``."""
    value = cfg.get(option)
    if value in (None, ""):
        return None
    own = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
    if value == "auto":
        # a torchrun restart with a fixed LT_RUN_ID finds the first attempt's last.ckpt; a first start has none
        return check_checkpoint(own, option, value) if own.is_file() else None
    if value == "last":
        if own.is_file():
            return check_checkpoint(own, option, value)
        # eval looks among the train task's runs (conf/eval.yaml sets ckpt_search_task)
        runs = Path(cfg.paths.log_dir) / str(cfg.get("ckpt_search_task") or cfg.task_name)
        candidates = sorted(runs.glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise ConfigError(
                f"{option}=last but there is no last.ckpt in {own.parent} nor under {runs}: "
                f"give {option}=/path/to/file.ckpt, or null to start fresh"
            )
        return check_checkpoint(candidates[-1], option, value)
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{option}={value!r} is not a file: give the path of a .ckpt, 'last' or 'auto'")
    return check_checkpoint(path.resolve(), option, value)


def check_checkpoint(path: Path, option: str = "ckpt_path", value: object = None) -> str:
    """Open ``path`` the safe way (``weights_only=True``: tensors and plain values only, no code runs; ``mmap``: no
    tensor is read) and require a Lightning checkpoint dict. Returns the path as a string."""
    shown = f"{option}={value if value is not None else path}"
    if not zipfile.is_zipfile(path):
        # torch.save has written zip archives since torch 1.6; text, random bytes or a plain pickle are not one
        raise ConfigError(
            f"{shown}: {path} is not a checkpoint (not a torch.save zip archive: text, a plain pickle or a truncated "
            f"file?); give a .ckpt written by train.py, or null to start fresh"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001  (torch raises many types for a file that is not its own)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights_only" in str(err) or "Weights only load failed" in str(err):
            reason = ("it holds objects other than tensors and plain values, which safe loading (weights_only=True) "
                      "refuses to unpickle")
        raise ConfigError(
            f"{shown}: {path} is not a checkpoint this template can load safely ({reason}); "
            f"give a .ckpt written by train.py, or null to start fresh"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        found = f"a dict with keys {sorted(map(str, checkpoint))[:6]}" if isinstance(checkpoint, dict) else \
            type(checkpoint).__name__
        raise ConfigError(
            f"{shown}: {path} is a torch file but not a Lightning checkpoint (no 'state_dict'; found {found}); "
            f"give a .ckpt written by train.py"
        )
    return str(path)
