"""``logger=wandb``: Lightning's WandbLogger, offline by default, continuing the checkpoint's run on resume and
finished with the job.

Named after the logger it holds; the real ``wandb`` package is still what ``import wandb`` means here (absolute
imports), and it is imported only when a :class:`WandbLogger` is built.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.wandb import WandbLogger as _LightningWandbLogger

from lit_template.errors import ConfigError
from lit_template.loggers.runs import _OPEN, _bool, _info, _rank, _warn, record_run, require, run_label


class WandbLogger(_LightningWandbLogger):
    """Lightning's WandbLogger, offline by default, with a run that a resumed training continues (``resume_run``:
    the same ``id``, ``resume="allow"``) and that ends with the job (``wandb.finish``).

    Args:
        run_dir: this run's folder (``logger_runs.json`` goes there; the default run name comes from it).
        resume_run: a training resumed from a checkpoint continues the checkpoint's W&B run; false: a new run.
        Every other argument is Lightning's WandbLogger's (and ``wandb.init``'s).
    """

    def __init__(
        self,
        name: str | None = None,
        save_dir: str = ".",
        offline: bool = True,
        project: str | None = None,
        run_dir: str | None = None,
        resume_run: bool = True,
        **kwargs: Any,
    ) -> None:
        offline = _bool(offline, "logger.wandb.offline")
        self._lt_resume = _bool(resume_run, "logger.wandb.resume_run")
        if offline:
            # nothing may reach the network: no sync, no error reports (W&B's Sentry), no login prompt
            os.environ["WANDB_MODE"] = "offline"
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
        require("wandb", "logger=wandb")
        if kwargs.get("log_model") and offline:
            raise ConfigError(
                f"logger.wandb.log_model={kwargs['log_model']!r} uploads checkpoints, which an offline run cannot: "
                "set logger.wandb.log_model=false, or logger.wandb.offline=false (after `wandb login`)"
            )
        if save_dir:
            try:
                Path(save_dir).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"logger.wandb.save_dir={save_dir}: cannot create it ({err})") from None
        if kwargs.get("tags") is not None:
            kwargs["tags"] = [str(tag) for tag in kwargs["tags"]]
        self._lt_run_dir = run_dir
        self._lt_started = False
        self._lt_closed = False
        super().__init__(name=name or run_label(run_dir), save_dir=save_dir, offline=offline, project=project, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)  # wandb 0.2x warns about the setting even when it is None
        _OPEN.append(self)

    def continue_run(self, runs: dict[str, Any], path: Path) -> None:
        """Resume the W&B run recorded in ``runs`` (read from ``path``), if it is in this logger's project."""
        if not self._lt_resume or self._id or self._experiment is not None:
            return
        record = runs.get("wandb") or {}
        run_id = record.get("id")
        if not run_id:
            _info(f"no W&B run recorded in {path}: a new W&B run")
            return
        if record.get("project") != self._project:
            _warn(
                f"the checkpoint's W&B run {run_id} is in project {record.get('project')!r}, not "
                f"{self._project!r} (logger.wandb.project): a new W&B run"
            )
            return
        self._id = self._wandb_init["id"] = run_id
        self._wandb_init["resume"] = "allow"
        _info(f"continuing W&B run {run_id} (project {self._project})")

    @property
    def experiment(self) -> Any:
        run = super().experiment
        if not self._lt_started and _rank() == 0 and self._experiment is not None:
            self._lt_started = True
            record_run(
                self._lt_run_dir,
                "wandb",
                {
                    "id": self._experiment.id,
                    "project": self._project,
                    "offline": self._offline,
                    "dir": str(Path(self._experiment.dir).parent),
                },
            )
        return run

    def close_run(self, status: str) -> None:
        """``wandb.finish`` this logger's run (exit code 0 on success, 1 otherwise)."""
        if self._lt_closed or _rank() != 0 or self._experiment is None:
            return
        self._lt_closed = True
        finish = getattr(self._experiment, "finish", None)
        if finish is not None:
            finish(exit_code=0 if status == "success" else 1)
