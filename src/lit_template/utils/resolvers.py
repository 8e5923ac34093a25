"""OmegaConf resolvers the configs use. Imported by the entry points before Hydra composes the config."""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

_START = time.strftime("%Y-%m-%d_%H-%M-%S")


def run_id() -> str:
    """One name for this run's output dir, the same on every process of the job.

    Launchers that start each rank as its own ``python train.py`` (torchrun, srun) would otherwise give each process
    its own timestamp, so scripts/launch_node.sh and scripts/slurm.sbatch export LT_RUN_ID for all of them.
    """
    return os.environ.get("LT_RUN_ID") or _START


def launched_rank() -> int:
    """The global rank the launcher gave this process (0 when started alone)."""
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def rank_zero_value(value: str) -> str | None:
    """``value`` on global rank zero, None on the others: the Hydra config is saved once per job."""
    return value if launched_rank() == 0 else None


def register() -> None:
    if not OmegaConf.has_resolver("lt.run_id"):
        OmegaConf.register_new_resolver("lt.run_id", run_id)
        OmegaConf.register_new_resolver("lt.rank_zero", rank_zero_value)


register()
