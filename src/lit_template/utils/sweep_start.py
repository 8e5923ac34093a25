"""A Hydra callback run once when a multirun starts, before any job is sent anywhere: it checks the launcher against
the trainer and pins the sweep's run id for the processes that will run the jobs."""

from __future__ import annotations

import os
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from lit_template.diagnostics.report import say_error
from lit_template.utils.resolvers import run_id


def slurm_shape_problem(config: DictConfig) -> str | None:
    """hydra-submitit-launcher asks SLURM for ``trainer.num_nodes`` nodes and ``trainer.devices`` tasks and GPUs per
    node (conf/launcher/slurm.yaml): those must be counts, not ``-1`` ("all GPUs", which means nothing on the machine
    that submits)."""
    for option in ("num_nodes", "devices"):
        value = config.trainer.get(option)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return (
                f"launcher=slurm asks SLURM for trainer.num_nodes nodes of trainer.devices GPUs each, but "
                f"trainer.{option}={value!r}: set "
                f"trainer.{option} to a count (e.g. trainer.num_nodes=2 trainer.devices=8), or export "
                f"NUM_NODES / GPUS_PER_NODE"
            )
    return None


class SweepStart(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = str(config.hydra.launcher.get("_target_", ""))
        problem = slurm_shape_problem(config) if "submitit" in launcher.lower() else None
        if problem:
            # Hydra prints any exception raised here with its own traceback: a user error is one line instead
            say_error(problem)
            raise SystemExit(2)
        # Jobs resolve hydra.sweep.dir (${lt.run_id:}) again in the process that runs them: a joblib worker or a
        # SLURM job has a start time of its own. The id this process resolved goes to them in the environment.
        os.environ.setdefault("LT_RUN_ID", run_id())
