"""MLflow and W&B loggers that need no network, continue their run when training resumes, and close after each job.

- ``logger=mlflow`` (:class:`MLflowLogger`): MLflow's SQLite store, ``sqlite:///<paths.log_dir>/mlflow/mlflow.db``,
  one experiment per ``task_name``. MLflow 3 refuses the plain-folder store (``file:./mlruns``) that Lightning's
  MLFlowLogger still defaults to; MLflow's telemetry is off unless ``MLFLOW_DISABLE_TELEMETRY`` says otherwise.
- ``logger=wandb`` (:class:`WandbLogger`): offline by default, ``<run dir>/wandb/offline-run-<time>-<id>/``, no login,
  no network (W&B's error reporting off too); upload later with ``wandb sync <that dir>``.
- Resume: a logger records its run (MLflow run id, W&B id) in ``<run dir>/logger_runs.json`` when the run starts; a
  run started with ``ckpt_path=auto|last|<path>`` reads that file in the run dir that wrote the checkpoint
  (``<run dir>/checkpoints/x.ckpt``) and continues that run (:func:`continue_runs`).
- Closed at the end of every job (:func:`close_loggers`, from the task wrapper): Lightning never calls
  ``wandb.finish()``, and a second WandbLogger in the same process (the next job of a multirun) would reuse the
  first job's run; an MLflow run a failure left RUNNING is marked FAILED.

Under DDP only global rank zero creates a run or logs (Lightning's ``rank_zero_experiment``/``rank_zero_only``).
The ``mlflow`` / ``wandb`` packages are imported only when their logger is built.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.mlflow import MLFlowLogger as _LightningMLFlowLogger
from lightning.pytorch.loggers.wandb import WandbLogger as _LightningWandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.diagnostics.report import write_json
from lit_template.errors import ConfigError

log = logging.getLogger(__name__)

RUNS_FILE = "logger_runs.json"
EXTRA = 'pip install -e ".[loggers]"'
# the loggers of the current job that have a run to close (see close_loggers)
_OPEN: list[Any] = []


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
    resumable = [lg for lg in loggers if isinstance(lg, (MLflowLogger, WandbLogger))]
    if not ckpt_path or not resumable:
        return
    path, runs = runs_of_checkpoint(ckpt_path)
    for logger in resumable:
        logger.continue_run(runs, path)


def close_loggers(status: str = "success") -> None:
    """End the run of every logger this job built: ``status`` is ``success``, ``failed`` or ``killed``. Never raises
    (the job's own error, if any, is the one to see)."""
    while _OPEN:
        logger = _OPEN.pop()
        try:
            logger.close_run(status)
        except Exception as err:  # noqa: BLE001  (a logger that cannot close must not hide the job's result)
            _warn(f"could not close the {type(logger).__name__} run: {type(err).__name__}: {err}")


# -- MLflow ---------------------------------------------------------------------------------------------------------
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

    ``run_dir``: this run's folder (``logger_runs.json`` goes there; the default run name comes from it).
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


# -- Weights & Biases -----------------------------------------------------------------------------------------------
class WandbLogger(_LightningWandbLogger):
    """Lightning's WandbLogger, offline by default, with a run that a resumed training continues (``resume_run``:
    the same ``id``, ``resume="allow"``) and that ends with the job (``wandb.finish``).

    ``run_dir``: this run's folder (``logger_runs.json`` goes there; the default run name comes from it).
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
