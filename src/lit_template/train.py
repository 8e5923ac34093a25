"""The training task: build datamodule, model, callbacks, loggers and trainer from the config; fit; test."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import hydra
import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig

from lit_template.checkpoints import check_checkpoint_callbacks, load_mismatch, resolve_ckpt_path
from lit_template.distributed.checks import check_trainer_config
from lit_template.distributed.comm import check_comm_config
from lit_template.distributed.env import apply_env, check_launch_env
from lit_template.distributed.launch import prepare_job_for_ddp_children
from lit_template.errors import ConfigError
from lit_template.lightning_compat import cuda_device_count_cached, lean_hooks
from lit_template.loggers import continue_runs
from lit_template.utils import RankedLogger, instantiate_callbacks, instantiate_loggers, task_wrapper
from lit_template.utils.rich_utils import print_config_tree

log = RankedLogger(__name__, rank_zero_only=True)


def build(cfg: DictConfig) -> dict[str, Any]:
    """Everything a run needs, instantiated from the config (shared by train and eval)."""
    check_comm_config(cfg.trainer)
    check_trainer_config(cfg.trainer)
    dist_cfg = cfg.get("distributed") or {}
    if dist_cfg.get("check_env", True):
        check_launch_env(cfg.trainer)
    apply_env(dist_cfg)
    prepare_job_for_ddp_children()
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    log.info(f"datamodule <{cfg.data._target_}>")
    datamodule: L.LightningDataModule = hydra.utils.instantiate(cfg.data)
    log.info(f"model <{cfg.model._target_}>")
    model: L.LightningModule = hydra.utils.instantiate(cfg.model)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    check_checkpoint_callbacks(callbacks)
    loggers = instantiate_loggers(cfg.get("logger"))
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)
    lean = bool((cfg.get("extras") or {}).get("lean_hooks", True))
    if lean:
        lean_hooks(trainer)
    return {
        "cfg": cfg,
        "datamodule": datamodule,
        "model": model,
        "callbacks": callbacks,
        "loggers": loggers,
        "trainer": trainer,
        "lean": lean,  # extras.lean_hooks, read once here
    }


@rank_zero_only
def log_hyperparameters(objects: dict[str, Any]) -> None:
    cfg, trainer, model = objects["cfg"], objects["trainer"], objects["model"]
    if not trainer.loggers:
        return
    hparams = {
        "model": cfg.model,
        "data": cfg.data,
        "trainer": cfg.trainer,
        "seed": cfg.get("seed"),
        "ckpt_path": cfg.get("ckpt_path"),
        "task_name": cfg.get("task_name"),
        "tags": cfg.get("tags"),
        "model/params/total": sum(p.numel() for p in model.parameters()),
        "model/params/trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    for logger in trainer.loggers:
        logger.log_hyperparams(hparams)


def optimized_metric(cfg: DictConfig, metrics: dict[str, Any]) -> float | None:
    """The value of ``cfg.optimized_metric`` after the run, for Hydra sweepers; a missing name is a config error."""
    name = cfg.get("optimized_metric")
    if not name:
        return None
    if name not in metrics:
        raise ConfigError(
            f"optimized_metric={name!r} was not logged; logged metrics are: {', '.join(sorted(metrics)) or 'none'}"
        )
    value = float(metrics[name])
    log.info(f"{name} = {value:.6g}")
    return value if math.isfinite(value) else math.nan


def best_checkpoint(trainer: L.Trainer) -> str:
    """The best checkpoint of the first checkpoint callback that monitors a metric ("" if none saved one)."""
    monitoring = [cb for cb in trainer.checkpoint_callbacks if getattr(cb, "monitor", None)]
    return monitoring[0].best_model_path if monitoring else ""


@task_wrapper
def run(cfg: DictConfig) -> float | None:
    if cfg.get("extras", {}).get("print_config"):
        print_config_tree(cfg, save_to=f"{cfg.paths.output_dir}/config_tree.log")
    objects = build(cfg)
    ckpt_path = resolve_ckpt_path(cfg) if cfg.get("train", True) else None
    # before any logger starts its run: a resumed training continues the checkpoint's MLflow / W&B run
    continue_runs(objects["loggers"], ckpt_path)
    log_hyperparameters(objects)

    with cuda_device_count_cached(objects["trainer"]) if objects["lean"] else contextlib.nullcontext():
        metrics = fit_and_test(cfg, objects, ckpt_path)
    return optimized_metric(cfg, metrics)


def fit_and_test(cfg: DictConfig, objects: dict[str, Any], ckpt_path: str | None) -> dict[str, Any]:
    """``trainer.fit`` (unless ``train=false``), then ``trainer.test`` on the best checkpoint (with ``test=true``); the
    callback metrics after them."""
    trainer, model, datamodule = objects["trainer"], objects["model"], objects["datamodule"]
    if cfg.get("train", True):
        if ckpt_path:
            log.info(f"resuming from {ckpt_path}")
        try:
            trainer.fit(model=model, datamodule=datamodule, ckpt_path=ckpt_path)
        except RuntimeError as err:
            if ckpt_path and (mismatch := load_mismatch(cfg, ckpt_path, err)):
                raise mismatch from None
            raise
    metrics = {k: v.item() if hasattr(v, "item") else v for k, v in trainer.callback_metrics.items()}

    if cfg.get("test", False):
        best = best_checkpoint(trainer)
        if not best:
            log.warning("no best checkpoint was saved: testing the weights as they are now")
        trainer.test(model=model, datamodule=datamodule, ckpt_path=best or None)
        metrics.update({k: v.item() if hasattr(v, "item") else v for k, v in trainer.callback_metrics.items()})
        if best:
            log.info(f"best checkpoint: {best}")
    return metrics
