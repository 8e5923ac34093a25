"""DDP communication choices (``comm=...``, docs/comm.md): every config builds its strategy and fails by name where it
cannot apply; then real 2-process DDP runs on CPU (gloo) through ``python train.py trainer=ddp_cpu comm=...``: each
option trains on digits to a stated accuracy with the sync check finding nothing, and with local SGD the replicas
differ between averaging steps and match right after."""

from __future__ import annotations

import json
import os
from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

import lit_template.utils.resolvers  # noqa: F401  (registers ${lt.*})
from lit_template.distributed.comm import CommDDPStrategy, check_comm_config
from lit_template.errors import ConfigError

TESTS = Path(__file__).resolve().parent
CONF = TESTS.parent / "conf"
COMMS = sorted(p.stem for p in (CONF / "comm").glob("*.yaml"))
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
TIMEOUT = 240
# 3 epochs of digits on 2 ranks (batch 64 per rank: 11 steps an epoch, 33 in all); plain DDP reaches ~0.96 val/acc
RUN = (
    "trainer=ddp_cpu",
    "trainer.max_epochs=3",
    "test=false",
    "callbacks.rich_progress_bar=null",
    "extras.print_config=false",
    "callbacks.early_stopping=null",
    "callbacks.sync_check.every_n_steps=1",
    "+callbacks.comm_hooks._target_=comm_support.RecordCommHook",
)
MIN_VAL_ACC = 0.85
# small enough that compression / local SGD run for most of the 33 steps
POWERSGD_START = 5
LOCAL_SGD_START, LOCAL_SGD_PERIOD = 5, 4


def compose_cfg(*overrides: str) -> DictConfig:
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


# -- configs ------------------------------------------------------------------------------------------------------
def test_comm_list_is_what_the_docs_promise():
    assert {"none", "fp16_compress", "bf16_compress", "powersgd", "local_sgd", "tuned"} <= set(COMMS)


def test_no_comm_leaves_the_ddp_strategy_alone():
    cfg = compose_cfg("trainer=ddp_cpu")
    assert cfg.trainer.strategy._target_ == "lightning.pytorch.strategies.DDPStrategy"
    check_comm_config(cfg.trainer)


@pytest.mark.parametrize("comm", COMMS)
def test_every_comm_config_builds_its_strategy_on_cpu(comm):
    cfg = compose_cfg("trainer=ddp_cpu", f"comm={comm}")
    check_comm_config(cfg.trainer)
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, CommDDPStrategy) and strategy.comm == comm
    # the trainer's DDP options survive the merge
    assert strategy.process_group_backend == "gloo"
    hook = strategy._ddp_comm_hook
    expected = {
        "fp16_compress": "fp16_compress_hook",
        "bf16_compress": "bf16_compress_hook",
        "powersgd": "powerSGD_hook",
        "local_sgd": "post_localSGD_hook",
    }.get(comm)
    # a function object, not the result of calling one
    assert (hook.__name__ if hook else None) == expected
    if comm == "powersgd":
        assert type(strategy._ddp_comm_state).__name__ == "PowerSGDState"
    if comm == "local_sgd":
        assert type(strategy._ddp_comm_state).__name__ == "PostLocalSGDState"
        assert strategy.model_averaging_period == 4
    if comm == "tuned":
        assert strategy._ddp_kwargs["bucket_cap_mb"] == 100 and strategy._ddp_kwargs["static_graph"] is True


@pytest.mark.parametrize("trainer", ["default", "cpu", "gpu", "fsdp"])
@pytest.mark.parametrize("comm", ["fp16_compress", "local_sgd"])
def test_comm_without_a_ddp_trainer_fails_naming_comm(trainer, comm):
    cfg = compose_cfg(f"trainer={trainer}", f"comm={comm}")
    with pytest.raises(ConfigError, match=rf"comm={comm} .*(no DDP strategy|not DDP).*trainer=ddp_cpu"):
        check_comm_config(cfg.trainer)


def test_comm_with_one_ddp_process_fails_naming_comm():
    cfg = compose_cfg("trainer=ddp_cpu", "trainer.devices=1", "comm=powersgd")
    with pytest.raises(ConfigError, match=r"comm=powersgd .*trainer\.devices=1 .*one process"):
        check_comm_config(cfg.trainer)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (("comm=local_sgd", "trainer.strategy.model_averaging_period=1"), r"model_averaging_period=1.*>= 2"),
        (("comm=local_sgd", "trainer.strategy.ddp_comm_state.start_localSGD_iter=0"), r"start_localSGD_iter=0"),
        # subgroup=null groups ranks per GPU machine: no GPUs on trainer=ddp_cpu
        (
            ("comm=local_sgd", "trainer.strategy.ddp_comm_state.post_local_gradient_allreduce=true"),
            r"post_local_gradient_allreduce=true .*accelerator=cpu",
        ),
        (("comm=powersgd", "trainer.strategy.ddp_comm_state.start_powerSGD_iter=1"), r"start_powerSGD_iter=1"),
        (("comm=fp16_compress", "+trainer.strategy.model_averaging_period=4"), r"not a PostLocalSGDState"),
    ],
)
def test_comm_options_that_cannot_work_fail_by_name(overrides, match):
    cfg = compose_cfg("trainer=ddp_cpu", *overrides)
    with pytest.raises(ConfigError, match=match):
        check_comm_config(cfg.trainer)


# -- real 2-process runs ------------------------------------------------------------------------------------------
def assert_trained_in_sync(run, hook: str | None) -> dict:
    """val/acc >= MIN_VAL_ACC, the sync check ran and found nothing, and both ranks ran ``hook``."""
    assert run.last_value("val/acc") >= MIN_VAL_ACC, run.last_value("val/acc")
    summary = read_json(run.run_dir() / "reports" / "sync_check.json")
    assert summary["active"] and summary["checks"] >= 33, summary
    assert summary["findings"] == {"grad_mismatch": 0, "param_mismatch": 0, "buffer_mismatch": 0, "no_local_grad": 0}, (
        summary
    )
    assert not (run.run_dir() / "reports" / "sync_check.jsonl").exists()
    for rank in (0, 1):
        hooks = read_json(run.run_dir() / "comm_hooks" / f"rank{rank}.json")
        assert hooks["hooks"] == ([hook] if hook else []), hooks
    return summary


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("comm", "hook", "extra"),
    [
        ("fp16_compress", "fp16_compress_hook", ()),
        ("bf16_compress", "bf16_compress_hook", ()),
        ("powersgd", "powerSGD_hook", (f"trainer.strategy.ddp_comm_state.start_powerSGD_iter={POWERSGD_START}",)),
        ("tuned", None, ()),
    ],
)
def test_compressed_and_tuned_ddp_trains_with_identical_replicas(train, comm, hook, extra):
    # compression hooks give every rank the same decompressed gradient: the sync check keeps checking every step
    run = train(*RUN, f"comm={comm}", *extra, env=ENV, timeout=TIMEOUT)
    summary = assert_trained_in_sync(run, hook)
    assert summary["local_sgd"] is None
    if comm == "powersgd":
        # the hook ran every step (its state counts them), compressing after POWERSGD_START
        assert read_json(run.run_dir() / "comm_hooks" / "rank0.json")["state_iters"][0] == 33


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_local_sgd_replicas_differ_between_averaging_steps_and_match_right_after(train):
    import torch

    run = train(
        *RUN,
        "comm=local_sgd",
        f"trainer.strategy.ddp_comm_state.start_localSGD_iter={LOCAL_SGD_START}",
        f"trainer.strategy.model_averaging_period={LOCAL_SGD_PERIOD}",
        "+callbacks.trace._target_=comm_support.SaveRankParamTrace",
        env=ENV,
        timeout=TIMEOUT,
    )
    summary = assert_trained_in_sync(run, "post_localSGD_hook")
    traces = [torch.load(run.run_dir() / "rank_params" / f"rank{r}.pt") for r in (0, 1)]
    steps = traces[0]["steps"]
    assert steps == traces[1]["steps"] == list(range(1, 34))
    # step g is the averager's step g - 1: plain DDP while g - 1 < start, then averaging when (g - 1 - start) % period
    # == 0 (global steps 6, 10, 14, ... here)
    averaged = [g for g in steps if g - 1 < LOCAL_SGD_START or (g - 1 - LOCAL_SGD_START) % LOCAL_SGD_PERIOD == 0]
    assert averaged[:8] == [1, 2, 3, 4, 5, 6, 10, 14]
    for i, g in enumerate(steps):
        max_abs_diff = float((traces[0]["params"][i] - traces[1]["params"][i]).abs().max())
        if g in averaged:
            assert max_abs_diff == 0.0, f"parameters differ right after averaging step {g}: {max_abs_diff}"
        else:
            assert max_abs_diff > 0.0, f"parameters identical at step {g}, between averaging steps"
    local = summary["local_sgd"]
    assert local["model_averaging_period"] == LOCAL_SGD_PERIOD and local["start_localSGD_iter"] == LOCAL_SGD_START
    # gradients checked on the 5 plain-DDP steps only; every other due parameter check waited for an averaging step
    assert local["grad_checks_skipped"] == 33 - LOCAL_SGD_START
    # one deferred parameter check per stretch between averaging steps (7-9, 11-13, ..., 31-33), none failed
    stretches = [g for g in steps if g not in averaged and g - 1 in averaged]
    assert local["param_checks_deferred"] == len(stretches) == 7
    # the last step (33) did not average: the fit-end check is skipped, not failed
    assert local["fit_end_check_skipped"] == 1
