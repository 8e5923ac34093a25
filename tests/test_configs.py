"""Every shipped config composes, and every trainer config either builds a Trainer here or fails by name."""

from __future__ import annotations

from pathlib import Path

import hydra
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, open_dict

import lit_template.utils.resolvers  # noqa: F401
from lit_template.distributed.checks import check_trainer_config
from lit_template.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
TRAINERS = sorted(p.stem for p in (CONF / "trainer").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
DEBUGS = sorted(p.stem for p in (CONF / "debug").glob("*.yaml"))
HAS_GPU = torch.cuda.is_available()
# what a trainer config needs on a machine without GPUs to build a Trainer
CPU_OVERRIDES = [
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "trainer.sync_batchnorm=false",
]
GPU_ONLY = {"gpu", "ddp", "ddp_multinode", "fsdp", "fsdp2", "model_parallel"}


def compose_cfg(*overrides: str, name: str = "train") -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name=name, overrides=list(overrides), return_hydra_config=True)
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/lt-compose"
        cfg.paths.root_dir = str(CONF.parent)
    return cfg


def test_trainer_list_is_what_the_readme_promises():
    assert {"default", "cpu", "gpu", "ddp", "ddp_cpu", "ddp_multinode", "fsdp"} <= set(TRAINERS)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_trainer_config_composes(trainer):
    cfg = compose_cfg(f"trainer={trainer}")
    assert cfg.trainer._target_ == "lightning.pytorch.Trainer"
    if trainer in GPU_ONLY and not HAS_GPU:
        # here it must refuse at start, naming the option, before Lightning's own error
        with pytest.raises(ConfigError, match=r"trainer\.(accelerator|strategy)"):
            check_trainer_config(cfg.trainer)


def test_fsdp_on_cpu_fails_at_start_naming_the_option():
    cfg = compose_cfg("trainer=fsdp", *CPU_OVERRIDES)
    with pytest.raises(ConfigError, match=r"trainer=fsdp .*trainer\.accelerator=cpu"):
        check_trainer_config(cfg.trainer)


@pytest.mark.parametrize("trainer", [t for t in TRAINERS if t != "fsdp" or HAS_GPU])
def test_every_trainer_config_builds_a_trainer_on_cpu(trainer, monkeypatch):
    overrides = [f"trainer={trainer}"]
    if trainer in GPU_ONLY:
        overrides += CPU_OVERRIDES
        if trainer != "gpu":
            overrides.append("trainer.strategy.process_group_backend=gloo")
    if trainer == "ddp_multinode":
        # the launcher would say how many nodes; pretend to be node 0 of 2 as torchrun sets it
        monkeypatch.setenv("NUM_NODES", "1")
    cfg = compose_cfg(*overrides)
    check_trainer_config(cfg.trainer)
    trainer_obj = hydra.utils.instantiate(cfg.trainer, logger=False, enable_progress_bar=False)
    assert trainer_obj.num_devices >= 1
    if trainer in {"ddp", "ddp_cpu", "ddp_multinode"}:
        assert type(trainer_obj.strategy).__name__ == "DDPStrategy"
        assert trainer_obj.strategy.process_group_backend == "gloo"
    if trainer in {"fsdp2", "fsdp2_cpu", "model_parallel", "model_parallel_cpu"}:
        assert type(trainer_obj.strategy).__name__ == "ModelParallelStrategy"


def test_ddp_multinode_reads_nodes_and_devices_from_the_environment(monkeypatch):
    monkeypatch.setenv("NUM_NODES", "4")
    monkeypatch.setenv("GPUS_PER_NODE", "8")
    cfg = compose_cfg("trainer=ddp_multinode")
    assert cfg.trainer.num_nodes == 4 and cfg.trainer.devices == 8
    assert cfg.trainer.strategy.process_group_backend == "nccl"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        # what srun sets (SLURM_NTASKS_PER_NODE may read "8(x3)")
        ({"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS_PER_NODE": "8(x3)"}, (3, 8)),
        # what torchrun sets in each worker
        ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4"}, (4, 4)),
        # nothing: two nodes of all GPUs
        ({}, (2, -1)),
    ],
)
def test_ddp_multinode_reads_what_srun_and_torchrun_set(monkeypatch, env, expected):
    for key in (
        "NUM_NODES",
        "GPUS_PER_NODE",
        "SLURM_JOB_NUM_NODES",
        "SLURM_NNODES",
        "SLURM_NTASKS_PER_NODE",
        "TORCHELASTIC_RUN_ID",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = compose_cfg("trainer=ddp_multinode")
    assert (cfg.trainer.num_nodes, cfg.trainer.devices) == expected
    # the command line still wins
    cfg = compose_cfg("trainer=ddp_multinode", "trainer.num_nodes=5", "trainer.devices=2")
    assert (cfg.trainer.num_nodes, cfg.trainer.devices) == (5, 2)


# the language model needs data=text (tests/test_gpt.py builds it)
@pytest.mark.parametrize("model", [m for m in MODELS if m != "gpt"])
def test_every_model_config_builds_with_the_default_data(model):
    cfg = compose_cfg(f"model={model}")
    module = hydra.utils.instantiate(cfg.model)
    out = module(torch.zeros(2, *cfg.data.input_shape))
    assert out.shape == (2, cfg.data.num_classes)


@pytest.mark.parametrize("data", ["digits", "mnist", "cifar10"])
def test_every_data_config_builds(data):
    cfg = compose_cfg(f"data={data}")
    dm = hydra.utils.instantiate(cfg.data)
    assert dm.num_classes == 10 and tuple(dm.input_shape) == tuple(cfg.data.input_shape)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment):
    cfg = compose_cfg(f"experiment={experiment}")
    assert cfg.model and cfg.data and cfg.trainer


@pytest.mark.parametrize("debug", DEBUGS)
def test_every_debug_preset_composes(debug):
    cfg = compose_cfg(f"debug={debug}")
    assert cfg.trainer.accelerator == "cpu"


def test_eval_config_requires_a_checkpoint():
    cfg = compose_cfg(name="eval")
    assert cfg.task_name == "eval"
    from omegaconf import OmegaConf

    assert OmegaConf.is_missing(cfg, "ckpt_path")


def test_data_shape_mismatch_is_a_config_error():
    from lit_template.data import DigitsDataModule

    with pytest.raises(ConfigError, match=r"data\.input_shape"):
        DigitsDataModule(input_shape=[1, 28, 28])
    with pytest.raises(ConfigError, match=r"data\.num_classes"):
        DigitsDataModule(num_classes=100)


def test_sync_batchnorm_on_cpu_names_the_option():
    # trainer=ddp syncs BatchNorm (CUDA-only in torch); moved to the CPU it must say so before DDP fails obscurely
    cfg = compose_cfg(
        "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy.process_group_backend=gloo"
    )
    with pytest.raises(ConfigError, match=r"trainer\.sync_batchnorm=true .*trainer\.sync_batchnorm=false"):
        check_trainer_config(cfg.trainer)


def test_devices_checks_name_the_option():
    cfg = compose_cfg("trainer=cpu", "trainer.devices=0")
    with pytest.raises(ConfigError, match=r"trainer\.devices=0"):
        check_trainer_config(cfg.trainer)
    cfg = compose_cfg("trainer=cpu", "trainer.accelerator=tpu")
    with pytest.raises(ConfigError, match=r"trainer\.accelerator='tpu': choose one of cpu, gpu"):
        check_trainer_config(cfg.trainer)
    if not HAS_GPU:
        cfg = compose_cfg("trainer=gpu")
        with pytest.raises(ConfigError, match=r"trainer\.accelerator=gpu .*no CUDA GPU"):
            check_trainer_config(cfg.trainer)


@pytest.mark.parametrize("launcher,target", [("slurm", "submitit"), ("joblib", "joblib")])
def test_launcher_configs_compose(launcher, target):
    cfg = compose_cfg(f"launcher={launcher}", "trainer=ddp_cpu")
    assert target in cfg.hydra.launcher._target_.lower()
    if launcher == "slurm":
        assert cfg.hydra.launcher.nodes == 1 and cfg.hydra.launcher.tasks_per_node == 2


def test_optuna_search_space_composes():
    cfg = compose_cfg("hparams_search=optuna")
    assert "optuna" in cfg.hydra.sweeper._target_.lower()
    assert cfg.hydra.sweeper.direction == "maximize" and cfg.optimized_metric == "val/acc_best"
    assert "model.optimizer.lr" in cfg.hydra.sweeper.params
