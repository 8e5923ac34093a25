"""The launch environment of a multi-node job: checked before training, applied before the process group exists."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from omegaconf import DictConfig

from lit_template.errors import ConfigError
from lit_template.utils.parsing import as_int

LAUNCH_HINT = "start each node with scripts/launch_node.sh (torchrun) or scripts/slurm.sbatch (srun)"


def under_torchrun(env: Mapping[str, str] = os.environ) -> bool:
    return "TORCHELASTIC_RUN_ID" in env or ("GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env)


def under_slurm(env: Mapping[str, str] = os.environ) -> bool:
    # Lightning treats a SLURM job as the launcher only when srun started one task per device
    return "SLURM_NTASKS" in env and "SLURM_PROCID" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def trainer_devices_per_node(trainer_cfg: DictConfig) -> int:
    """Processes per node the trainer config asks for (``devices``: a count, a list, or all GPUs)."""
    devices = trainer_cfg.get("devices", "auto")
    accelerator = str(trainer_cfg.get("accelerator", "auto")).lower()
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, (list, tuple)) or (hasattr(devices, "__len__") and not isinstance(devices, str)):
        return len(devices)
    if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def _int_var(env: Mapping[str, str], name: str) -> int:
    number = as_int(env.get(name, ""))
    if number is None:
        raise ConfigError(f"{name}={env.get(name, '')!r} must be a whole number ({LAUNCH_HINT})")
    return number


def check_launch_env(trainer_cfg: DictConfig, env: Mapping[str, str] = os.environ) -> None:
    """For num_nodes > 1: the variables the launcher should have set exist and agree with the trainer config."""
    num_nodes = int(trainer_cfg.get("num_nodes", 1))
    if num_nodes <= 1:
        return
    per_node = trainer_devices_per_node(trainer_cfg)
    expected_world = num_nodes * per_node
    shape = f"trainer.num_nodes={num_nodes} x trainer.devices={per_node} = {expected_world} processes"

    if under_slurm(env) and not under_torchrun(env):
        ntasks = _int_var(env, "SLURM_NTASKS")
        if ntasks != expected_world:
            raise ConfigError(
                f"SLURM_NTASKS={ntasks} but {shape}: ask sbatch for --nodes={num_nodes} "
                f"--ntasks-per-node={per_node}, or change trainer.num_nodes / trainer.devices"
            )
        return

    if not any(k in env for k in ("MASTER_ADDR", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")):
        raise ConfigError(
            f"trainer.num_nodes={num_nodes} but no multi-node launcher is visible (MASTER_ADDR, WORLD_SIZE, NODE_RANK "
            f"and SLURM_NTASKS are unset): {LAUNCH_HINT}, or set trainer.num_nodes=1"
        )
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            raise ConfigError(
                f"{name} is not set: every node needs the address and port of node 0 "
                f"(export {name}=... or {LAUNCH_HINT})"
            )
    _int_var(env, "MASTER_PORT")
    rank_var = "GROUP_RANK" if under_torchrun(env) else "NODE_RANK"
    if rank_var not in env:
        raise ConfigError(f"{rank_var} is not set: each node needs its index 0..{num_nodes - 1} ({LAUNCH_HINT})")
    node_rank = _int_var(env, rank_var)
    if not 0 <= node_rank < num_nodes:
        raise ConfigError(
            f"{rank_var}={node_rank} is out of range for trainer.num_nodes={num_nodes}: use 0..{num_nodes - 1}"
        )
    if "WORLD_SIZE" in env:
        world = _int_var(env, "WORLD_SIZE")
        if world != expected_world:
            raise ConfigError(
                f"WORLD_SIZE={world} but {shape}: make torchrun's --nnodes x --nproc_per_node match, "
                "or set trainer.num_nodes / trainer.devices (or NUM_NODES / GPUS_PER_NODE) to the launch"
            )


# what set_default_env exported (not the user): a later job of a multirun may set these again
_SET_BY_US: dict[str, str] = {}


def set_default_env(name: str, value: str) -> bool:
    """Export ``name=value`` unless the user set ``name`` (a value they exported wins); True if it was set.

    The one way the template exports environment variables: before the process group exists, so it and
    Lightning's per-device children see them.
    """
    if name in os.environ and _SET_BY_US.get(name) != os.environ[name]:
        return False
    os.environ[name] = _SET_BY_US[name] = str(value)
    return True


def apply_env(settings: DictConfig | None) -> dict[str, str]:
    """Export the ``distributed.env`` variables (NCCL settings) unless the user already set them."""
    if not settings:
        return {}
    return {
        name: str(value)
        for name, value in (settings.get("env") or {}).items()
        if value is not None and set_default_env(name, str(value))
    }
