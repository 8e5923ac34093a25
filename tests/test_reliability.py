"""Reliability, as a user meets it: a NaN caught on every rank, a dead rank named without a hang, non-checkpoints
refused, checkpoints that survive a crash mid-save, torchrun restarts that resume, and resumes that match."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_command

from lit_template import checkpoints as checkpoint_io
from lit_template.checkpoints import AtomicCheckpointIO, check_checkpoint
from lit_template.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
QUICK = (
    "test=false",
    "callbacks.rich_progress_bar=null",
    "extras.print_config=false",
    "trainer.limit_val_batches=2",
    "logger=csv",
    "callbacks.profiling=null",
)
DDP = ("trainer=ddp_cpu", "trainer.strategy.timeout.seconds=30")
FAULT = "+callbacks.fault._target_=lit_template.testing.faults.FaultInjection"


def fault(action: str, rank: int, step: int) -> tuple[str, ...]:
    return (
        FAULT,
        f"+callbacks.fault.action={action}",
        f"+callbacks.fault.rank={rank}",
        f"+callbacks.fault.step={step}",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / "reports" / name
    assert path.is_file(), f"no {path}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- NaN / Inf ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(200)
def test_nan_loss_on_one_rank_stops_every_rank_in_the_same_step(train):
    run = train(
        *DDP,
        *QUICK,
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=6",
        *fault("nan_loss", 1, 3),
        timeout=150,
        check=False,
    )
    assert run.returncode != 0, run.output[-3000:]
    assert "non-finite loss on rank 1 at step 3 (loss=nan); stopping every rank" in run.output, run.output[-4000:]
    # both ranks raised in the same step: the next one, as the flags are read one step later (no host sync per step)
    assert "stopping every rank at step 4" in run.output
    assert "error: rank 0 failed at step 4: NonFiniteError" in run.output, run.output[-4000:]
    assert "error: rank 1 failed at step 4: NonFiniteError" in run.output, run.output[-4000:]
    (event,) = records(run.run_dir(), "nonfinite.jsonl")
    assert event["kind"] == "nonfinite" and event["global_step"] == 3 and event["ranks"] == [1]
    assert event["stopped_at"] == 4
    assert event["what"] == "loss" and event["action"] == "stop"


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(200)
def test_nan_grad_on_one_rank_with_skip_skips_that_step_and_finishes(train):
    run = train(
        *DDP,
        *QUICK,
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=6",
        *fault("nan_grad", 1, 2),
        "callbacks.nonfinite_guard.on_nonfinite=skip",
        timeout=150,
    )
    assert "skipping this optimizer step on every rank" in run.output
    (event,) = records(run.run_dir(), "nonfinite.jsonl")
    assert event["global_step"] == 2 and event["ranks"] == [1] and event["what"] == "grad"
    assert event["action"] == "skip" and event["tensor"].endswith("weight")
    ckpt = torch.load(run.run_dir() / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 6  # the skipped step still counts as a step; its update is dropped
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


# -- safe loading --------------------------------------------------------------------------------------------------
def test_a_file_that_is_not_a_checkpoint_is_refused_at_start(train, tmp_path):
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint\n")
    run = train(*QUICK, f"ckpt_path={text}", timeout=120, check=False)
    assert run.returncode == 2, run.output[-3000:]
    assert f"ckpt_path={text}" in run.stderr and "is not a checkpoint" in run.stderr
    assert "Traceback" not in run.stderr


class Gadget:  # an arbitrary object: safe loading must refuse to unpickle it
    pass


def test_safe_loading_refuses_random_bytes_arbitrary_pickles_and_non_lightning_files(tmp_path):
    random_bytes = tmp_path / "random.ckpt"
    random_bytes.write_bytes(os.urandom(4096))
    pickled = tmp_path / "pickle.ckpt"
    torch.save({"state_dict": {}, "gadget": Gadget()}, pickled)
    plain = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(3)}, plain)
    good = tmp_path / "good.ckpt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "epoch": 0, "hyper_parameters": {"lr": 0.1}}, good)
    for path, why in (
        (random_bytes, "not a torch.save zip archive"),
        (pickled, "weights_only=True"),
        (plain, "no 'state_dict'"),
    ):
        with pytest.raises(ConfigError, match="ckpt_path=") as err:
            check_checkpoint(path)
        assert why in str(err.value), str(err.value)
    assert check_checkpoint(good) == str(good)


# -- atomic checkpoints --------------------------------------------------------------------------------------------
def _previous_last(path: Path) -> None:
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(10)}, "global_step": 5}, path)


def test_a_save_that_fails_half_way_leaves_the_previous_last_ckpt(tmp_path, monkeypatch):
    last = tmp_path / "checkpoints" / "last.ckpt"
    _previous_last(last)

    def half_then_fail(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint_io.torch, "save", half_then_fail)
    with pytest.raises(OSError, match="No space"):
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(10)}, "global_step": 6}, last)
    monkeypatch.undo()
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # the temp file is gone too
    assert torch.load(check_checkpoint(last), weights_only=True)["global_step"] == 5


def test_a_process_killed_mid_save_leaves_the_previous_last_ckpt(tmp_path):
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    _previous_last(last)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "tests")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "reliability_faults.py"), str(last)],
        env=env,
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILLed inside the save
    assert torch.load(check_checkpoint(last), weights_only=True)["global_step"] == 5
    # what the crash left is a dot-file ending in .tmp, which ckpt_path=last (…/last.ckpt) never matches
    leftovers = [p.name for p in last.parent.iterdir() if p.name != "last.ckpt"]
    assert leftovers and all(n.startswith(".last.ckpt.") and n.endswith(".tmp") for n in leftovers)
    assert sorted(p.name for p in (tmp_path / "run").glob("**/last.ckpt")) == ["last.ckpt"]


# -- a rank that dies ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "action, named",
    [
        ("raise", "error: rank 1 failed at step 3: RuntimeError: fault injection"),
        ("kill", "error: rank 1 (pid"),
    ],
)
def test_a_dead_rank_ends_the_job_non_zero_and_is_named(train, action, named):
    start = time.monotonic()
    run = train(
        *DDP,
        *QUICK,
        "trainer.max_epochs=2",
        "trainer.limit_train_batches=8",
        *fault(action, 1, 3),
        timeout=150,
        check=False,
    )
    elapsed_s = time.monotonic() - start
    assert run.returncode != 0, run.output[-3000:]
    assert named in run.output, run.output[-4000:]
    if action == "kill":
        assert "was killed by SIGKILL" in run.output
        assert (run.run_dir() / "reports" / "rank_failure.json").is_file()
    assert elapsed_s < 120, f"the job took {elapsed_s:.0f}s to end after a rank died"


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_torchrun_restarts_after_a_killed_rank_and_resumes_from_last_ckpt(tmp_path):
    # scripts/launch_node.sh on one "node" with 2 processes and one restart allowed; rank 1 is SIGKILLed at step 6 in
    # the first attempt, torchrun restarts both ranks, and ckpt_path=auto picks up the first attempt's last.ckpt.
    log_dir = tmp_path / "logs"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "tests"),
        "PYTHONWARNINGS": "ignore",
        "LT_RUN_ID": "torchrun-1",
        "MASTER_PORT": str(free_port()),
        "PYTHON": sys.executable,
        "TRAINER": "ddp_cpu",
        "TORCHRUN_ARGS": "--max-restarts=1",
    }
    for key in ("MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(key, None)
    cmd = [
        "bash",
        "scripts/launch_node.sh",
        "0",
        "127.0.0.1",
        "1",
        "2",
        *DDP[1:],
        *QUICK,
        "trainer.max_epochs=3",
        "trainer.limit_train_batches=4",
        "ckpt_path=auto",
        "+callbacks.kill._target_=reliability_faults.KillOnFirstAttempt",
        "+callbacks.kill.step=6",
        f"paths.log_dir={log_dir}",
    ]
    proc = run_command(cmd, env, timeout=280)
    output = proc.stdout + proc.stderr
    errors = "\n".join(line for line in output.splitlines() if "rror" in line)
    assert proc.returncode == 0, f"{errors[-4000:]}\n{output[-3000:]}"
    run_dir = log_dir / "train" / "runs" / "torchrun-1"
    assert "resuming from" in output and str(run_dir / "checkpoints" / "last.ckpt") in output, output[-4000:]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == 2 and ckpt["global_step"] == 3 * 4


# -- deterministic resume ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_killed_mid_epoch_and_resumed_ends_where_an_uninterrupted_run_ends(train, tmp_path):
    # dropout: the resumed run matches only if the RNG state was restored (callbacks.rng_state), not just the weights
    args = (
        *QUICK,
        "trainer.deterministic=true",
        "trainer.max_epochs=4",
        "trainer.limit_train_batches=8",
        "callbacks.early_stopping=null",
        "model.net.dropout=0.3",
    )
    whole = train(*args, log_dir=tmp_path / "whole", timeout=200)
    env = {"LT_RUN_ID": "resumed"}
    killed = train(*args, *fault("kill", 0, 2 * 8 + 3), log_dir=tmp_path / "broken", env=env, timeout=200, check=False)
    assert killed.returncode == -9, killed.output[-3000:]
    resumed = train(*args, "ckpt_path=last", log_dir=tmp_path / "broken", env=env, timeout=200)
    assert "resuming from" in resumed.output
    a = torch.load(whole.run_dir() / "checkpoints" / "last.ckpt", weights_only=True)
    b = torch.load(resumed.run_dir() / "checkpoints" / "last.ckpt", weights_only=True)
    assert a["global_step"] == b["global_step"] == 4 * 8
    for name, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][name]), f"{name} differs after resume"
    assert whole.last_value("val/acc") == resumed.last_value("val/acc")
    assert whole.last_value("val/acc_best") == resumed.last_value("val/acc_best")
