"""``logger=mlflow``: Lightning's MLFlowLogger on a checked tracking URI (a SQLite file by default), continuing the
checkpoint's run on resume, and :func:`check_tracking_uri`.

Named after the logger it holds; the real ``mlflow`` package is still what ``import mlflow`` means here (absolute
imports), and it is imported only when an :class:`MLflowLogger` is built.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.mlflow import MLFlowLogger as _LightningMLFlowLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.errors import ConfigError
from lit_template.loggers.runs import _OPEN, _bool, _info, _rank, _warn, record_run, require, run_label


def _truthy(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def check_tracking_uri(uri: Any) -> str:
    """Check and normalise ``logger.mlflow.tracking_uri``: a SQLite file (its folder created), or a server."""
    option = "logger.mlflow.tracking_uri"
    if uri in (None, ""):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            raise ConfigError(
                f"{option} is empty and MLFLOW_TRACKING_URI is not set: give sqlite:///path/to/mlflow.db "
                "(conf/logger/mlflow.yaml puts one under paths.log_dir) or an http(s):// tracking server"
            )
    uri = str(uri)
    if uri.startswith("sqlite:"):
        if not uri.startswith("sqlite:///") or uri in ("sqlite:///", "sqlite:///:memory:"):
            raise ConfigError(f"{option}={uri}: give a file, sqlite:///relative/path.db or sqlite:////absolute/path.db")
        path = Path(os.path.normpath(uri[len("sqlite:///") :])).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"{option}={uri}: cannot create {path.parent} ({err})") from None
        return f"sqlite:///{path}"
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if uri.startswith("file:") or not scheme:
        folder = uri.removeprefix("file://").removeprefix("file:")
        if folder.endswith(".db"):  # a plain path to a database file
            return check_tracking_uri(f"sqlite:///{os.path.abspath(os.path.expanduser(folder))}")
        if not _truthy(os.environ.get("MLFLOW_ALLOW_FILE_STORE")):
            raise ConfigError(
                f"{option}={uri} is a folder (MLflow's file store), which MLflow 3 refuses: give "
                "sqlite:///path/to/mlflow.db (the default: sqlite:///<paths.log_dir>/mlflow/mlflow.db), an http(s):// "
                "server, or set MLFLOW_ALLOW_FILE_STORE=true to use the folder anyway"
            )
    return uri


class MLflowLogger(_LightningMLFlowLogger):
    """Lightning's MLFlowLogger with a checked tracking URI (SQLite by default, see conf/logger/mlflow.yaml), a run
    that a resumed training continues (``resume_run``), params that may differ on resume, and telemetry off.

    Args:
        run_dir: this run's folder (``logger_runs.json`` goes there; the default run name comes from it).
        resume_run: a training resumed from a checkpoint continues the checkpoint's MLflow run; false: a new run.
        Every other argument is Lightning's MLFlowLogger's.
    """

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        tracking_uri: str | None = None,
        run_name: str | None = None,
        tags: dict[str, Any] | None = None,
        artifact_location: str | None = None,
        run_id: str | None = None,
        run_dir: str | None = None,
        resume_run: bool = True,
        **kwargs: Any,
    ) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        require("mlflow", "logger=mlflow")
        if not experiment_name or not isinstance(experiment_name, str):
            raise ConfigError(f"logger.mlflow.experiment_name={experiment_name!r}: give a name")
        self._lt_resume = _bool(resume_run, "logger.mlflow.resume_run")
        self._lt_run_dir = run_dir
        self._lt_continued = False
        self._lt_started = False
        uri = check_tracking_uri(tracking_uri)
        if artifact_location and "://" not in str(artifact_location):
            artifact_location = os.path.normpath(os.path.abspath(os.path.expanduser(str(artifact_location))))
        tags = dict(tags or {})
        if run_dir:
            tags.setdefault("lit_template.run_dir", str(run_dir))
        from mlflow.exceptions import MlflowException

        try:
            super().__init__(
                experiment_name=experiment_name,
                run_name=run_name or run_label(run_dir),
                tracking_uri=uri,
                tags=tags or None,
                artifact_location=artifact_location,
                run_id=run_id,
                **kwargs,
            )
        except MlflowException as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"logger.mlflow.tracking_uri={uri}: MLflow cannot use it: {first}") from None
        _OPEN.append(self)

    def continue_run(self, runs: dict[str, Any], path: Path) -> None:
        """Log into the MLflow run recorded in ``runs`` (read from ``path``), if it is still in this tracking URI."""
        if not self._lt_resume or self._run_id is not None or _rank() != 0:
            return
        record = runs.get("mlflow") or {}
        run_id = record.get("run_id")
        if not run_id:
            _info(f"no MLflow run recorded in {path}: a new MLflow run")
            return
        if record.get("tracking_uri") != self._tracking_uri:
            _warn(
                f"the checkpoint's MLflow run {run_id} is in {record.get('tracking_uri')}, not in {self._tracking_uri} "
                "(logger.mlflow.tracking_uri): a new MLflow run"
            )
            return
        from mlflow.exceptions import MlflowException

        try:
            run = self._mlflow_client.get_run(run_id)
        except MlflowException:
            _warn(f"the checkpoint's MLflow run {run_id} is not in {self._tracking_uri}: a new MLflow run")
            return
        if run.info.lifecycle_stage != "active":
            _warn(f"the checkpoint's MLflow run {run_id} was deleted: a new MLflow run")
            return
        self._run_id = run_id
        self._lt_continued = True
        _info(f"continuing MLflow run {run_id} ({record.get('run_name') or run.info.run_name})")

    @property
    def experiment(self) -> Any:
        client = super().experiment
        if not self._lt_started and _rank() == 0 and self._initialized:
            self._lt_started = True
            if self._lt_continued:
                client.update_run(self._run_id, status="RUNNING")
            record_run(
                self._lt_run_dir,
                "mlflow",
                {
                    "run_id": self._run_id,
                    "experiment_id": self._experiment_id,
                    "tracking_uri": self._tracking_uri,
                    "run_name": self._run_name,
                },
            )
        return client

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        # MLflow refuses to change a logged param; a resumed run logs its config again (more epochs, ckpt_path):
        # params already logged with the same value are skipped, a changed one becomes the tag `changed/<key>`
        from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
        from mlflow.entities import Param, RunTag

        values = {k: str(v)[:250] for k, v in _flatten_dict(_convert_params(params)).items()}
        logged = self.experiment.get_run(self.run_id).data.params
        new = [Param(key=k, value=v) for k, v in values.items() if k not in logged]
        changed = {k: v for k, v in values.items() if k in logged and logged[k] != v}
        if changed:
            _info(
                f"MLflow run {self.run_id}: {len(changed)} param(s) differ from the run's first values and are logged "
                f"as tags changed/<key> (MLflow params cannot change): {', '.join(sorted(changed)[:6])}"
            )
            tags = [RunTag(key=f"changed/{k}", value=v) for k, v in changed.items()]
            for i in range(0, len(tags), 100):
                self.experiment.log_batch(run_id=self.run_id, tags=tags[i : i + 100], **self._log_batch_kwargs)
        for i in range(0, len(new), 100):
            self.experiment.log_batch(run_id=self.run_id, params=new[i : i + 100], **self._log_batch_kwargs)

    def close_run(self, status: str) -> None:
        """Terminate the run if nothing did (Lightning finalizes it after fit and test; a failure elsewhere did not)."""
        if not self._initialized or _rank() != 0 or self._run_id is None:
            return
        if self._mlflow_client.get_run(self._run_id).info.status == "RUNNING":
            self.finalize({"success": "FINISHED", "failed": "FAILED", "killed": "KILLED"}.get(status, "FAILED"))
