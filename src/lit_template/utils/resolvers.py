"""OmegaConf resolvers the configs use. Imported by the entry points before Hydra composes the config."""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

from lit_template.utils.parsing import as_int, launcher_count

_START = time.strftime("%Y-%m-%d_%H-%M-%S")


def run_id() -> str:
    """One name for this run's output dir, the same on every process of the job.

    Launchers that start each rank as its own ``python train.py`` (torchrun, srun) would otherwise give each process
    its own timestamp, so scripts/launch_node.sh and scripts/slurm.sbatch export LT_RUN_ID for all of them.
    """
    return os.environ.get("LT_RUN_ID") or _START


def launch_dir() -> str:
    """The folder the run was launched from: Hydra's ``runtime.cwd``, or the current directory before Hydra has set
    its config. A sweeper resolves ``hydra.sweep.dir`` (below ``paths.log_dir``) then: hydra-optuna-sweeper 1.3 does
    in ``setup``, where ``${hydra:runtime.cwd}`` raises "HydraConfig was not set" (hydra-core 1.3.8). Hydra does not
    change the working directory of a job (``hydra.job.chdir`` is false), so both name the same folder."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        return str(HydraConfig.get().runtime.cwd)
    return os.getcwd()


def launched_rank() -> int:
    """The global rank the launcher gave this process (0 when started alone)."""
    for key in ("RANK", "SLURM_PROCID"):
        if (rank := as_int(os.environ.get(key))) is not None and rank >= 0:
            return rank
    return 0


def rank_zero_value(value: str) -> str | None:
    """``value`` on global rank zero, None on the others: the Hydra config is saved once per job."""
    return value if launched_rank() == 0 else None


def num_nodes(default: int) -> int:
    """Nodes of this job: NUM_NODES (the launch scripts), else what SLURM or torchrun set, else ``default``."""
    env = os.environ
    for value in (env.get("NUM_NODES"), env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")):
        if nodes := launcher_count(value):
            return nodes
    world, local = launcher_count(env.get("WORLD_SIZE")), launcher_count(env.get("LOCAL_WORLD_SIZE"))
    if "TORCHELASTIC_RUN_ID" in env and world and local:
        return max(world // local, 1)
    return default


def launched_devices_per_node(default: int) -> int:
    """Processes (GPUs) per node: GPUS_PER_NODE, else SLURM's tasks per node, else torchrun's LOCAL_WORLD_SIZE."""
    for name in ("GPUS_PER_NODE", "SLURM_NTASKS_PER_NODE", "LOCAL_WORLD_SIZE"):
        if devices := launcher_count(os.environ.get(name)):
            return devices
    return default


def gpus_per_node(accelerator: str, devices: int) -> int | None:
    """GPUs a SLURM job asks for per node (conf/launcher/slurm.yaml): ``devices`` for a GPU trainer, else None (no
    GPU request, which a cluster without GPUs would refuse)."""
    return devices if str(accelerator).lower() in ("gpu", "cuda") else None


def register() -> None:
    if not OmegaConf.has_resolver("lt.run_id"):
        OmegaConf.register_new_resolver("lt.run_id", run_id)
        OmegaConf.register_new_resolver("lt.rank_zero", rank_zero_value)
        OmegaConf.register_new_resolver("lt.launch_dir", launch_dir)
        OmegaConf.register_new_resolver("lt.num_nodes", num_nodes)
        OmegaConf.register_new_resolver("lt.devices_per_node", launched_devices_per_node)
        OmegaConf.register_new_resolver("lt.gpus_per_node", gpus_per_node)


register()
