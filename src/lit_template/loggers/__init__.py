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

Modules: ``runs.py`` (the ``logger_runs.json`` record, resuming, closing), ``mlflow.py`` and ``wandb.py`` (one logger
each; absolute imports, so ``import mlflow`` / ``import wandb`` inside them still mean the real packages).
"""

from lit_template.loggers.mlflow import MLflowLogger, check_tracking_uri
from lit_template.loggers.runs import (
    EXTRA,
    RUNS_FILE,
    close_loggers,
    continue_runs,
    record_run,
    require,
    run_label,
    runs_of_checkpoint,
)
from lit_template.loggers.wandb import WandbLogger

__all__ = [
    "EXTRA",
    "RUNS_FILE",
    "MLflowLogger",
    "WandbLogger",
    "check_tracking_uri",
    "close_loggers",
    "continue_runs",
    "record_run",
    "require",
    "run_label",
    "runs_of_checkpoint",
]
