"""Checks run before the Trainer is built: an option this machine or launcher cannot honour fails here, by name."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from lit_template.errors import ConfigError
from lit_template.utils.parsing import as_int

GPU_ACCELERATORS = {"gpu", "cuda"}
# what this template's trainers run on (Lightning also knows tpu/mps/hpu, which need packages or hardware it lacks)
ACCELERATORS = ("cpu", "gpu", "cuda", "mps", "auto")
CPU_HINT = (
    "use trainer=cpu (one process) or trainer=ddp_cpu (DDP over gloo on CPU); for FSDP2 / tensor parallel on CPU, "
    "trainer=fsdp2_cpu or trainer=model_parallel_cpu"
)


def _strategy_backend(strategy: Any) -> str | None:
    if isinstance(strategy, (DictConfig, dict)):
        return strategy.get("process_group_backend")
    return None


def check_trainer_config(trainer_cfg: DictConfig) -> None:
    """Fail at start, naming the option, when the trainer asks for hardware this machine does not have."""
    accelerator = str(trainer_cfg.get("accelerator", "auto")).lower()
    devices = trainer_cfg.get("devices", "auto")
    num_nodes = trainer_cfg.get("num_nodes", 1)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0

    if accelerator not in ACCELERATORS:
        raise ConfigError(f"trainer.accelerator={accelerator!r}: choose one of {', '.join(ACCELERATORS)}")
    if accelerator in GPU_ACCELERATORS and gpus == 0:
        raise ConfigError(f"trainer.accelerator={accelerator} but this machine has no CUDA GPU: {CPU_HINT}")

    n = as_int(devices)
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        if accelerator in GPU_ACCELERATORS and any(int(d) >= gpus for d in devices):
            raise ConfigError(f"trainer.devices={list(devices)} names a GPU index but this machine has {gpus} GPU(s)")
    elif n is not None:
        if n == 0 or n < -1:
            raise ConfigError(f"trainer.devices={n}: use a positive count, -1 (all), or 'auto'")
        if accelerator in GPU_ACCELERATORS and n > gpus:
            raise ConfigError(f"trainer.devices={n} but this machine has {gpus} GPU(s): set trainer.devices<={gpus}")
    elif devices != "auto":
        raise ConfigError(f"trainer.devices={devices!r}: use a positive count, -1 (all), a list of indices or 'auto'")

    strategy = trainer_cfg.get("strategy")
    target = str(strategy.get("_target_", "")) if isinstance(strategy, (DictConfig, dict)) else str(strategy or "")
    if "fsdp" in target.lower() and (accelerator not in GPU_ACCELERATORS or gpus == 0):
        raise ConfigError(
            f"trainer=fsdp (trainer.strategy={target}) shards over CUDA GPUs; trainer.accelerator={accelerator} on a "
            f"machine with {gpus} GPU(s) cannot run it: {CPU_HINT}"
        )

    backend = _strategy_backend(strategy)
    if backend == "nccl" and gpus == 0:
        raise ConfigError(
            "trainer.strategy.process_group_backend=nccl needs CUDA GPUs and this machine has none: "
            f"set trainer.strategy.process_group_backend=gloo and trainer.accelerator=cpu, or {CPU_HINT}"
        )

    if trainer_cfg.get("sync_batchnorm") and accelerator not in GPU_ACCELERATORS:
        # torch's SyncBatchNorm is CUDA-only; DDP would fail later with
        # "SyncBatchNorm layers only work with GPU modules"
        raise ConfigError(
            f"trainer.sync_batchnorm=true needs GPUs (torch's SyncBatchNorm is CUDA-only) but "
            f"trainer.accelerator={accelerator}: add trainer.sync_batchnorm=false, or use trainer=ddp_cpu"
        )

    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigError(f"trainer.num_nodes={num_nodes!r}: must be a whole number >= 1")
