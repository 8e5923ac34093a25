"""trainer=fsdp2_cpu / model_parallel_cpu: real 2- and 4-process runs of model=gpt over gloo on the CPU.

Every parallel run is compared with one process training the same model on the same global batch for the same steps:
the validation loss after 8 optimizer steps must agree within ``RTOL`` (measured: the same to 6 digits; tensor
parallelism only reorders float sums). The sharded checkpoint must resume exactly: bit-for-bit the same weights and
losses as a run that never stopped.
"""

from __future__ import annotations

import re

import pytest
import torch
from conftest import run_script
from gpt_support import TINY, column, load_sharded, read_metrics, steps

# relative tolerance of the val loss after 8 steps against one process: float reassociation of split matmuls and of
# the gradient reduce-scatter, amplified a little by Adam (measured: TP equal to the last bit, FSDP2 and 2x2 within
# 1.1e-8 relative)
RTOL = 1e-5
GLOBAL_BATCH = ["data.global_batch_size=8"]
STEPS = 8


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("mp")


@pytest.fixture(scope="module")
def single(logs):
    """One process, no strategy: the reference."""
    run = run_script(
        "train.py", *TINY, *GLOBAL_BATCH, *steps(STEPS), "trainer=cpu", log_dir=logs / "single", timeout=90
    )
    return column(read_metrics(run.run_dir()), "val/loss")[STEPS - 1]


@pytest.fixture(scope="module")
def fsdp2(logs):
    """FSDP2 on 2 processes, 4 samples each. Also the run the resume test starts from (its sharded checkpoint after
    step 4, mid-epoch) and compares with (its steps 5 to 8)."""
    return run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=fsdp2_cpu",
        # keep the checkpoint of every 4th step: step_4 and step_8
        "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.save_top_k=-1",
        "+callbacks.model_checkpoint.every_n_train_steps=4",
        "callbacks.model_checkpoint.every_n_epochs=null",
        "callbacks.model_checkpoint.filename='step_{step}'",
        log_dir=logs / "fsdp2",
        timeout=120,
    )


def val_loss(run) -> float:
    return column(read_metrics(run.run_dir()), "val/loss")[STEPS - 1]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_tensor_parallel_on_2_processes_matches_one_process(single, logs):
    run = run_script(
        "train.py", *TINY, *GLOBAL_BATCH, *steps(STEPS), "trainer=model_parallel_cpu", log_dir=logs / "tp", timeout=120
    )
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in run.output
    # both ranks share each batch (data-parallel size 1): 8 samples per step, as the single process
    assert val_loss(run) == pytest.approx(single, rel=RTOL)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_tensor_parallel_with_sequence_parallel_matches_one_process(single, logs):
    run = run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=model_parallel_cpu",
        "model.sequence_parallel=true",
        log_dir=logs / "sp",
        timeout=120,
    )
    assert val_loss(run) == pytest.approx(single, rel=RTOL)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_fsdp2_on_2_processes_matches_one_process_on_the_same_global_batch(single, fsdp2):
    assert val_loss(fsdp2) == pytest.approx(single, rel=RTOL)
    # a sharded checkpoint: one folder, a shard per rank, Lightning's metadata beside them
    ckpt = fsdp2.run_dir() / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir()
    assert {p.name for p in ckpt.iterdir()} >= {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"}
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    assert meta["global_step"] == STEPS


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_2x2_mesh_on_4_processes_trains_and_matches_one_process(single, logs):
    run = run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=model_parallel_cpu",
        "trainer.devices=4",
        "trainer.strategy.tensor_parallel_size=2",
        log_dir=logs / "2x2",
        timeout=240,
    )
    assert "MEMBER: 4/4" in run.output
    # data-parallel size 4 / 2 = 2: 4 samples per data-parallel rank, the global batch stays 8
    assert val_loss(run) == pytest.approx(single, rel=RTOL)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_sharded_checkpoint_resumes_exactly(fsdp2, logs):
    # resume from the folder written after step 4 of 8 (the same LR schedule: it is sized from max_steps)
    ckpt = fsdp2.run_dir() / "checkpoints" / "step_4.ckpt"
    assert torch.load(ckpt / "meta.pt", weights_only=True)["global_step"] == 4
    # tests/gpt_support.py: train.py's ckpt_path takes files only
    resumed = run_script(
        "tests/gpt_support.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=fsdp2_cpu",
        f"+resume_dir={ckpt}",
        log_dir=logs / "resumed",
        timeout=120,
    )
    assert "Restoring states from the checkpoint path" in resumed.output
    whole = read_metrics(fsdp2.run_dir())
    again = read_metrics(resumed.run_dir())
    # the same batches and updates as the run that never stopped: equal losses, step by step, and equal weights
    losses, resumed_losses = column(whole, "train/loss_step"), column(again, "train/loss_step")
    assert sorted(resumed_losses) == list(range(4, STEPS))
    assert all(resumed_losses[s] == losses[s] for s in resumed_losses), (losses, resumed_losses)
    assert column(again, "val/loss")[STEPS - 1] == column(whole, "val/loss")[STEPS - 1]
    a = load_sharded(fsdp2.run_dir() / "checkpoints" / "last.ckpt")
    b = load_sharded(resumed.run_dir() / "checkpoints" / "last.ckpt")
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    # the optimizer state too (Adam's moments)
    assert torch.equal(
        a["optimizer_0"]["state"]["net.blocks.0.mlp.fc.weight"]["exp_avg"],
        b["optimizer_0"]["state"]["net.blocks.0.mlp.fc.weight"]["exp_avg"],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # 2 x 2 is not the world size 2
        (
            ["trainer.strategy.data_parallel_size=2", "trainer.strategy.tensor_parallel_size=2"],
            r"trainer\.strategy\.data_parallel_size=2 x trainer\.strategy\.tensor_parallel_size=2 = 4 is not the "
            r"world size 2",
        ),
        # 2 does not divide 3 processes
        (
            ["trainer.devices=3", "trainer.strategy.tensor_parallel_size=2"],
            r"trainer\.strategy\.tensor_parallel_size=2 does not divide the world size 3",
        ),
        # 3 tensor-parallel ranks cannot split 4 heads
        (
            ["trainer.devices=3"],
            r"trainer\.strategy\.tensor_parallel_size=3 does not divide model\.n_head=4",
        ),
    ],
)
def test_a_mesh_that_does_not_fit_fails_at_start_with_one_line(train, overrides, message):
    run = train(*TINY, *steps(2), "trainer=model_parallel_cpu", *overrides, check=False, timeout=60)
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), run.stderr[-3000:]
    # before any process was started
    assert "Initializing distributed" not in run.output and "Traceback" not in run.output
