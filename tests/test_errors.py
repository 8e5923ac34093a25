"""Bad input gets one clear message naming the option, and no traceback."""

from __future__ import annotations

import pytest
import torch


def assert_clean_error(run, *needles):
    assert run.returncode != 0
    assert "Traceback" not in run.output, run.output[-3000:]
    for needle in needles:
        assert needle in run.output, f"{needle!r} not in:\n{run.output[-3000:]}"


def test_unknown_config_option(train):
    run = train("trainer.max_epoch=3", check=False, timeout=120)
    assert_clean_error(run, "max_epoch")


def test_unknown_config_group_choice(train):
    run = train("model=transformer9000", check=False, timeout=120)
    assert_clean_error(run, "transformer9000")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # raised inside a constructor Hydra instantiates: Hydra wraps it, the entry point unwraps it
        ("data.batch_size=0", "error: data.batch_size must be >= 1, got 0"),
        # torch's own check, when Lightning builds the optimizer
        ("model.optimizer.lr=-1", "error: model.optimizer: Invalid learning rate: -1"),
        # Lightning's own MisconfigurationException, raised while Hydra builds the Trainer
        ("trainer.max_epochs=-5", "error: trainer (conf/trainer/): `max_epochs` must be a non-negative integer or -1"),
    ],
)
def test_bad_values_inside_constructors_are_one_line(train, override, message):
    run = train(override, "extras.print_config=false", check=False, timeout=120)
    assert_clean_error(run, message)
    assert run.returncode == 2
    assert "InstantiationException" not in run.output


def test_missing_data_dir_without_download(train, tmp_path):
    run = train("data=mnist", f"data.data_dir={tmp_path / 'nowhere'}", "data.download=false", check=False, timeout=120)
    assert_clean_error(run, "data.data_dir=", "data.download=true")
    assert run.returncode == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_gpu_trainer_without_gpu(train):
    run = train("trainer=gpu", check=False, timeout=120)
    assert_clean_error(run, "trainer.accelerator=gpu", "trainer=cpu")


def test_devices_that_do_not_exist(train):
    run = train("trainer.devices=0", check=False, timeout=120)
    assert_clean_error(run, "trainer.devices=0")


def test_num_nodes_without_a_launcher(train):
    run = train("trainer.num_nodes=2", check=False, timeout=120)
    assert_clean_error(run, "trainer.num_nodes=2", "scripts/launch_node.sh")


def test_eval_without_checkpoint(evaluate):
    run = evaluate(check=False, timeout=120)
    assert_clean_error(run, "ckpt_path")


def test_eval_with_a_missing_checkpoint(evaluate, tmp_path):
    run = evaluate(f"ckpt_path={tmp_path / 'nope.ckpt'}", check=False, timeout=120)
    assert_clean_error(run, "ckpt_path=", "is not a file")


def test_comm_option_without_ddp(train):
    # comm=... only means something to DDP: on one CPU process it fails at start, naming comm and the way out
    run = train("trainer=cpu", "comm=powersgd", check=False, timeout=120)
    assert_clean_error(run, "comm=powersgd", "trainer=ddp_cpu")
    assert run.returncode == 2


def test_config_group_set_to_null(train):
    # Hydra's own answer is a traceback ("Config group override must be a string or a list. Got NoneType")
    run = train("logger=null", check=False, timeout=60)
    assert_clean_error(run, "error: logger=null: logger is a config group", "write ~logger")
    assert run.returncode == 2
    # a value inside a group may be null as before
    run = train(
        "callbacks.rich_progress_bar=null",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        "test=false",
        timeout=120,
    )
    assert run.returncode == 0
