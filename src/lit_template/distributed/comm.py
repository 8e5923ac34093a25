"""DDP communication choices (``conf/comm/*.yaml``): the strategy that applies them and the check that they fit.

Every ``comm=<name>`` config sets ``trainer.strategy._target_`` to :class:`CommDDPStrategy` and ``comm: <name>`` on
top of the trainer's DDP strategy options. Lightning's ``DDPStrategy`` takes ``ddp_comm_state`` / ``ddp_comm_hook`` /
``ddp_comm_wrapper`` but registers the hook only on CUDA and silently ignores it elsewhere, so on CPU (gloo)
compression would not run and local SGD would all-reduce gradients every step while also averaging the model.
:class:`CommDDPStrategy` registers the hook on every device type; on CUDA it does what ``DDPStrategy`` does.

:func:`check_comm_config` runs on the composed config, before the Trainer is built: ``comm=...`` with a trainer that
has no DDP strategy (``trainer=default``, ``cpu``, ``gpu``, ``fsdp``) fails there, naming ``comm``.
See docs/comm.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.strategies import DDPStrategy
from omegaconf import DictConfig

from lit_template.errors import ConfigError
from lit_template.lightning_compat import model_averaging_period, register_ddp_comm_hook
from lit_template.utils.parsing import as_int

DDP_TRAINERS = "trainer=ddp_cpu (CPU, gloo), trainer=ddp or trainer=ddp_multinode"
# keys a comm config (or a documented comm override) may set; a strategy with only these came from no DDP trainer
COMM_KEYS = frozenset(
    {
        "_target_",
        "comm",
        "ddp_comm_state",
        "ddp_comm_hook",
        "ddp_comm_wrapper",
        "model_averaging_period",
        "bucket_cap_mb",
        "gradient_as_bucket_view",
        "static_graph",
    }
)
# options of strategies that are not DDP (FSDP, DeepSpeed): a comm config merged onto them must not turn them into DDP
NOT_DDP_KEYS = frozenset(
    {
        "sharding_strategy",
        "auto_wrap_policy",
        "state_dict_type",
        "activation_checkpointing",
        "activation_checkpointing_policy",
        "cpu_offload",
        "mixed_precision",
        "limit_all_gathers",
        "use_orig_params",
        "device_mesh",
        "zero_optimization",
        "stage",
        "offload_optimizer",
        "offload_parameters",
        "config",
    }
)


class CommDDPStrategy(DDPStrategy):
    """``DDPStrategy`` that registers the DDP communication hook on every device type, not only CUDA.

    ``comm`` is the name of the chosen ``conf/comm`` file, kept for messages and reports; every other argument is
    ``DDPStrategy``'s (and what it passes on to ``DistributedDataParallel``: ``bucket_cap_mb``, ``static_graph``...).
    """

    def __init__(self, comm: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.comm = comm

    def _register_ddp_hooks(self) -> None:
        if self.root_device.type == "cuda":
            return super()._register_ddp_hooks()
        # gloo supports comm hooks (fp16/bf16 all-reduce included); Lightning's CUDA-only guard predates that
        register_ddp_comm_hook(self)
        return None

    @property
    def model_averaging_period(self) -> int | None:
        return model_averaging_period(self)


def _whole_number(name: str, path: str, value: Any, minimum: int, why: str) -> None:
    """``value`` (at ``trainer.strategy.<path>``) must be a whole number >= ``minimum``, else a ConfigError
    naming it."""
    number = as_int(value)
    if number is None or number < minimum:
        raise ConfigError(f"comm={name}: trainer.strategy.{path}={value!r}: use a whole number >= {minimum} ({why})")


def _target(node: Any) -> str:
    return str(node.get("_target_", "")) if isinstance(node, (DictConfig, Mapping)) else ""


def check_comm_config(trainer_cfg: DictConfig) -> None:
    """Fail at start, naming ``comm``, when a ``comm=...`` choice cannot apply to this trainer config.

    Does nothing when no comm config was chosen (``comm: null``, the default).
    """
    strategy = trainer_cfg.get("strategy")
    if not isinstance(strategy, (DictConfig, Mapping)) or "comm" not in strategy:
        return
    name = strategy.get("comm")
    keys = set(strategy.keys())
    foreign = sorted(keys & NOT_DDP_KEYS)
    if foreign:
        raise ConfigError(
            f"comm={name} sets DDP communication options, but the trainer's strategy is not DDP (it has "
            f"{', '.join(foreign)}): use comm with {DDP_TRAINERS}, or drop comm="
        )
    if keys <= COMM_KEYS:
        raise ConfigError(
            f"comm={name} sets DDP communication options, but the trainer config has no DDP strategy "
            f"(trainer.strategy has only what comm={name} set): use {DDP_TRAINERS}, or drop comm="
        )
    devices, num_nodes = as_int(trainer_cfg.get("devices", "auto")), as_int(trainer_cfg.get("num_nodes", 1))
    if devices == 1 and num_nodes == 1:
        raise ConfigError(
            f"comm={name} changes how DDP processes communicate, but trainer.devices=1 and trainer.num_nodes=1 "
            f"run one process: use {DDP_TRAINERS} with 2 or more processes, or drop comm="
        )

    state = strategy.get("ddp_comm_state")
    if "PostLocalSGDState" in _target(state):
        _check_local_sgd(name, strategy, state, trainer_cfg)
    elif strategy.get("model_averaging_period") is not None:
        raise ConfigError(
            f"comm={name}: trainer.strategy.model_averaging_period is set but ddp_comm_state is not a "
            "PostLocalSGDState, so nothing would average the model: use comm=local_sgd"
        )
    if "PowerSGDState" in _target(state):
        _check_power_sgd(name, state)


def _check_local_sgd(name: str, strategy: Any, state: Any, trainer_cfg: DictConfig) -> None:
    """comm=local_sgd: the averaging period, the start step, the hook that goes with the state, and the CPU case."""
    _whole_number(
        name,
        "model_averaging_period",
        strategy.get("model_averaging_period"),
        2,
        "local SGD averages the model every N optimizer steps; 1 is plain DDP",
    )
    _whole_number(
        name,
        "ddp_comm_state.start_localSGD_iter",
        state.get("start_localSGD_iter"),
        1,
        "optimizer steps of plain DDP before local SGD starts",
    )
    if "post_localSGD_hook" not in _target(strategy.get("ddp_comm_hook")) + str(
        (strategy.get("ddp_comm_hook") or {}).get("path", "")
    ):
        raise ConfigError(
            f"comm={name}: a PostLocalSGDState needs trainer.strategy.ddp_comm_hook = "
            "post_localSGD_hook (see conf/comm/local_sgd.yaml)"
        )
    accelerator = str(trainer_cfg.get("accelerator", "auto")).lower()
    if state.get("post_local_gradient_allreduce", True) and state.get("subgroup") is None and accelerator == "cpu":
        raise ConfigError(
            f"comm={name}: trainer.strategy.ddp_comm_state.post_local_gradient_allreduce=true with subgroup=null "
            "groups the ranks per GPU machine, and trainer.accelerator=cpu has no GPUs: set "
            "trainer.strategy.ddp_comm_state.post_local_gradient_allreduce=false (no gradient sync between "
            "averaging steps)"
        )


def _check_power_sgd(name: str, state: Any) -> None:
    """comm=powersgd: the start step and the approximation rank."""
    _whole_number(
        name,
        "ddp_comm_state.start_powerSGD_iter",
        state.get("start_powerSGD_iter"),
        2,
        "PowerSGD's error feedback and warm start need plain all-reduce steps first",
    )
    _whole_number(
        name,
        "ddp_comm_state.matrix_approximation_rank",
        state.get("matrix_approximation_rank"),
        1,
        "the rank of each gradient matrix's approximation",
    )
