"""Finding the checkpoint a run resumes from or evaluates (``ckpt_path=last``, a path, or null)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from lit_template.errors import ConfigError


def resolve_ckpt_path(cfg: DictConfig, option: str = "ckpt_path") -> str | None:
    """``null`` → None; ``last`` → this run dir's last.ckpt, else the newest last.ckpt among earlier runs of the same
    task; anything else must be an existing file."""
    value = cfg.get(option)
    if value in (None, ""):
        return None
    if value == "last":
        own = Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt"
        if own.is_file():
            return str(own)
        # eval looks among the train task's runs (conf/eval.yaml sets ckpt_search_task)
        runs = Path(cfg.paths.log_dir) / str(cfg.get("ckpt_search_task") or cfg.task_name)
        candidates = sorted(runs.glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise ConfigError(
                f"{option}=last but there is no last.ckpt in {own.parent} nor under {runs}: "
                f"give {option}=/path/to/file.ckpt, or null to start fresh"
            )
        return str(candidates[-1])
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise ConfigError(f"{option}={value!r} is not a file: give the path of a .ckpt, or 'last'")
    return str(path.resolve())
