"""The evaluation task: test a checkpoint on the datamodule's test split."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from lit_template.checkpoints import load_mismatch, resolve_ckpt_path
from lit_template.errors import ConfigError
from lit_template.train import build, log
from lit_template.utils import task_wrapper
from lit_template.utils.rich_utils import print_config_tree


@task_wrapper
def run(cfg: DictConfig) -> dict[str, float]:
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise ConfigError("ckpt_path is required for eval: ckpt_path=/path/to/file.ckpt or ckpt_path=last")
    if cfg.get("extras", {}).get("print_config"):
        print_config_tree(cfg, save_to=f"{cfg.paths.output_dir}/config_tree.log")
    ckpt_path = resolve_ckpt_path(cfg)
    if ckpt_path is None:
        raise ConfigError("ckpt_path=null: eval needs ckpt_path=/path/to/file.ckpt or ckpt_path=last")
    objects = build(cfg)
    log.info(f"testing {ckpt_path}")
    try:
        objects["trainer"].test(model=objects["model"], datamodule=objects["datamodule"], ckpt_path=ckpt_path)
    except RuntimeError as err:
        if mismatch := load_mismatch(cfg, ckpt_path, err):
            raise mismatch from None
        raise
    return {k: float(v) for k, v in objects["trainer"].callback_metrics.items()}
