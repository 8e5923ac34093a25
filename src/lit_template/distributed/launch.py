"""Making Lightning's per-device launcher work inside a Hydra multirun.

Lightning starts DDP's extra ranks by re-running ``sys.argv`` with ``hydra.run.dir=<HydraConfig.run.dir>``. In a
multirun, ``sys.argv`` is the whole sweep (``-m lr=1e-3,1e-2``) and ``run.dir`` is not the job's dir, so each child
would start a sweep of its own. Before a job's Trainer starts, point both at the job; after it, forget its
rendezvous so the next job picks a fresh port and process group.
"""

from __future__ import annotations

import os
import sys

from omegaconf import open_dict, read_write

# Lightning's launcher exports these in the parent and leaves them there; a second job that finds LOCAL_RANK set
# thinks its processes were started externally and waits forever for ranks nobody starts. Each job starts from what
# the user had exported before the sweep (None: unset).
_LAUNCHER_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_USER_ENV = {name: os.environ.get(name) for name in _LAUNCHER_VARS}


def in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def prepare_job_for_ddp_children() -> None:
    """Make the command Lightning re-runs for ranks 1..N-1 this job alone, in this job's dir."""
    if not in_multirun():
        return
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    # hydra.mode=RUN: a config that sets MULTIRUN itself (hparams_search=optuna) is among the job's overrides, and a
    # child composed from it would start a sweep of its own
    sys.argv = [sys.argv[0], *hydra_cfg.overrides.task, "hydra.mode=RUN"]
    with read_write(hydra_cfg), open_dict(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir
    _restore_user_env()


def forget_job_rendezvous() -> None:
    """After a job: no port, rank or world size of it is left for the next job to trip over."""
    if in_multirun():
        _restore_user_env()


def _restore_user_env() -> None:
    for name, value in _USER_ENV.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
