"""The record of each logger's run (``<run dir>/logger_runs.json``), for resuming it, and the closing of every run a
job opened; with the helpers the MLflow and W&B loggers share (rank-zero logging, the package check, option checks).

A logger records its run when the run starts (:func:`record_run`); a training resumed from a checkpoint reads the
record of the run dir that wrote it (:func:`runs_of_checkpoint`) and points each logger at its run
(:func:`continue_runs`); the task wrapper ends every run of the job (:func:`close_loggers`).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.diagnostics.report import write_json
from lit_template.errors import ConfigError

log = logging.getLogger(__name__)

RUNS_FILE = "logger_runs.json"
EXTRA = 'pip install -e ".[loggers]"'
# the loggers of the current job that have a run to close (see close_loggers); each logger appends itself when built
_OPEN: list[Any] = []


# -- helpers shared by the loggers ----------------------------------------------------------------------------------
def _rank() -> int:
    return int(getattr(rank_zero_only, "rank", 0) or 0)


def _info(message: str) -> None:
    if _rank() == 0:
        log.info(message)


def _warn(message: str) -> None:
    if _rank() == 0:
        log.warning(message)


def require(module: str, choice: str) -> None:
    """Import ``module`` or fail with one line naming the config choice and the pip extra."""
    try:
        importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"{choice} needs the `{module}` package, which does not import ({err}): {EXTRA}") from None


def _bool(value: Any, option: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{option}={value!r}: give true or false")
    return value


def run_label(run_dir: str | os.PathLike | None) -> str | None:
    """A readable run name from the run dir: ``train/runs/<id>`` or ``train/multiruns/<id>/<job>``."""
    if not run_dir:
        return None
    parts = Path(run_dir).parts
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] in ("runs", "multiruns"):
            return "/".join(parts[i - 1 :])
    return Path(run_dir).name


# -- the record of each logger's run, for resuming ------------------------------------------------------------------
def record_run(run_dir: str | os.PathLike | None, key: str, info: dict[str, Any]) -> None:
    """Add ``{key: info}`` to ``<run_dir>/logger_runs.json`` (rank zero; written atomically)."""
    if not run_dir:
        return
    path = Path(run_dir) / RUNS_FILE
    runs = _read(path)
    runs[key] = info
    try:
        write_json(path, runs)
    except OSError as err:
        _warn(f"could not write {path} ({err}): a run resumed from this run's checkpoints will start a new {key} run")


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        _warn(f"{path} is unreadable ({err}): ignored")
        return {}
    return runs if isinstance(runs, dict) else {}


def runs_of_checkpoint(ckpt_path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The logger runs of the run dir that wrote ``ckpt_path`` (``<run dir>/checkpoints/<file>``)."""
    path = Path(ckpt_path).resolve().parent.parent / RUNS_FILE
    return path, _read(path)


def continue_runs(loggers: list[Any], ckpt_path: str | None) -> None:
    """Before any logger starts its run: when training resumes from ``ckpt_path``, point each logger that can
    continue a run at the run recorded for that checkpoint (a new run where none was recorded)."""
    # imported here: both logger modules import this one at their top
    from lit_template.loggers.mlflow import MLflowLogger
    from lit_template.loggers.wandb import WandbLogger

    resumable = [lg for lg in loggers if isinstance(lg, (MLflowLogger, WandbLogger))]
    if not ckpt_path or not resumable:
        return
    path, runs = runs_of_checkpoint(ckpt_path)
    for logger in resumable:
        logger.continue_run(runs, path)


# -- the end of the job ---------------------------------------------------------------------------------------------
def close_loggers(status: str = "success") -> None:
    """End the run of every logger this job built: ``status`` is ``success``, ``failed`` or ``killed``. Never raises
    (the job's own error, if any, is the one to see)."""
    while _OPEN:
        logger = _OPEN.pop()
        try:
            logger.close_run(status)
        except Exception as err:  # noqa: BLE001  (a logger that cannot close must not hide the job's result)
            _warn(f"could not close the {type(logger).__name__} run: {type(err).__name__}: {err}")
