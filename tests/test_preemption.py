"""Checkpoints that follow training, exact mid-epoch resume, and preemption-safe stops, through ``python train.py``.

The SLURM side (sbatch, scancel --signal, scontrol requeue) is in tests/test_slurm.py, on a real local cluster.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from lit_template.distributed.preemption import SignalRecorder, SlurmJob, StepVote, signal_number
from lit_template.errors import ConfigError

QUICK = ("test=false", "callbacks.rich_progress_bar=null", "extras.print_config=false", "callbacks.profiling=null")
# dropout: a resumed run matches only if the RNG state and the data position were restored, not just the weights
EXACT = (
    *QUICK,
    "trainer.deterministic=true",
    "model.net.dropout=0.3",
    "callbacks.early_stopping=null",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=2",
    "trainer.max_epochs=3",
)
DDP = ("trainer=ddp_cpu", "trainer.strategy.timeout.seconds=60")
FAULT = "+callbacks.fault._target_=lit_template.testing.faults.FaultInjection"


def fault(action: str, rank: int, step: int, *extra: str) -> tuple[str, ...]:
    return (
        FAULT,
        f"+callbacks.fault.action={action}",
        f"+callbacks.fault.rank={rank}",
        f"+callbacks.fault.step={step}",
        *extra,
    )


def last_ckpt(run) -> dict:
    return torch.load(run.run_dir() / "checkpoints" / "last.ckpt", weights_only=True)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"], (a["global_step"], b["global_step"])
    for name, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][name]), f"{name} differs after resume"


# -- last.ckpt follows training -------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_last_ckpt_follows_training_when_the_monitored_metric_plateaus(train):
    # lr=0, no BatchNorm: val/acc never improves after epoch 0, so the best checkpoint stays epoch_000 (Lightning 2.6's
    # save_last=True would have left last.ckpt there too)
    run = train(
        *QUICK,
        "model.optimizer.lr=0.0",
        "model.net.batch_norm=false",
        "model.scheduler=null",
        "callbacks.early_stopping=null",
        "trainer.max_epochs=4",
        "trainer.limit_train_batches=5",
        "trainer.limit_val_batches=2",
        timeout=150,
    )
    ckpts = sorted(p.name for p in (run.run_dir() / "checkpoints").iterdir())
    assert ckpts == ["epoch_000.ckpt", "last.ckpt"], ckpts
    last = last_ckpt(run)
    assert last["epoch"] == 3 and last["global_step"] == 4 * 5


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launch", [(), DDP], ids=["1-process", "ddp_cpu"])
def test_sigkill_after_a_mid_epoch_step_checkpoint_resumes_to_the_same_weights(train, tmp_path, launch):
    # every 5 steps: step 10 of 8-batch epochs is mid-epoch; rank 0 is SIGKILLed before step 15, the next save
    args = (*launch, *EXACT, "callbacks.last_checkpoint.every_n_train_steps=5")
    whole = train(*args, log_dir=tmp_path / "whole", timeout=250)
    env = {"LT_RUN_ID": "killed"}
    killed = train(*args, *fault("kill", 0, 14), log_dir=tmp_path / "broken", env=env, timeout=250, check=False)
    assert killed.returncode != 0, killed.output[-3000:]
    saved = last_ckpt(killed)
    assert saved["global_step"] == 10 and saved["global_step"] % 8 != 0, saved["global_step"]  # mid-epoch
    resumed = train(*args, "ckpt_path=auto", log_dir=tmp_path / "broken", env=env, timeout=250)
    assert f"resuming from {killed.run_dir() / 'checkpoints' / 'last.ckpt'}" in resumed.output
    assert "not resumable" not in resumed.output  # Lightning's warning for a loader without state
    assert_same_weights(last_ckpt(whole), last_ckpt(resumed))
    assert whole.last_value("val/acc") == resumed.last_value("val/acc")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mid_epoch_resume_is_exact_when_configure_optimizers_reads_estimated_stepping_batches(train, tmp_path):
    # Lightning #20550: reading trainer.estimated_stepping_batches there builds the train loader before the restore,
    # and Lightning then never loads its position; last_checkpoint loads it at train start
    args = (
        *EXACT,
        "model._target_=resume_support.StepsSizedClassifier",
        "trainer.max_epochs=2",
        "callbacks.last_checkpoint.every_n_train_steps=5",
    )
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    whole = train(*args, log_dir=tmp_path / "whole", env=env, timeout=200)
    env_killed = {**env, "LT_RUN_ID": "killed"}
    killed = train(*args, *fault("kill", 0, 12), log_dir=tmp_path / "broken", env=env_killed, timeout=200, check=False)
    assert killed.returncode != 0 and last_ckpt(killed)["global_step"] == 10
    resumed = train(*args, "ckpt_path=auto", log_dir=tmp_path / "broken", env=env_killed, timeout=200)
    assert_same_weights(last_ckpt(whole), last_ckpt(resumed))
    assert "loaded the train dataloader's position from the checkpoint, which Lightning had skipped" in resumed.output


# -- preemption: a signal, one agreed stop, resume ------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
# the signal comes at the start of step `step`; that step's vote is read at the end of the next one (stop_step)
@pytest.mark.parametrize(
    "sig, step, stop_step",
    [("SIGUSR1", 3, 5), ("SIGTERM", 6, 8)],
    ids=["SIGUSR1-mid-epoch", "SIGTERM-at-an-epochs-last-batch"],
)
def test_a_signal_to_one_rank_stops_every_rank_at_one_step_and_the_resumed_run_matches(
    train, tmp_path, sig, step, stop_step
):
    args = (*DDP, *EXACT)
    whole = train(*args, log_dir=tmp_path / "whole", timeout=250)
    env = {"LT_RUN_ID": "preempted"}
    stopped = train(
        *args,
        *fault("signal", 1, step, f"+callbacks.fault.signal={sig}"),
        log_dir=tmp_path / "broken",
        env=env,
        timeout=250,
    )
    report = json.loads((stopped.run_dir() / "reports" / "preemption.json").read_text())
    assert report["kind"] == "preemption" and report["ranks"] == [1] and report["signals"] == {"1": sig}
    # mid-epoch: saved right there; at an epoch's last batch: the epoch's own save, after its validation
    assert report["global_step"] == report["checkpoint_step"] == stop_step
    if stop_step % 8 == 0:
        assert [r["epoch"] for r in stopped.metrics() if r.get("val/acc")] == ["0"]
    assert f"preemption: global rank 1 got {sig}; every rank stopped at global step {stop_step}" in stopped.output
    assert last_ckpt(stopped)["global_step"] == stop_step
    assert "test/acc" not in stopped.output  # nothing after the stop
    resumed = train(*args, "ckpt_path=auto", log_dir=tmp_path / "broken", env=env, timeout=250)
    assert "resuming from" in resumed.output
    assert_same_weights(last_ckpt(whole), last_ckpt(resumed))
    assert whole.last_value("val/acc_best") == resumed.last_value("val/acc_best")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_signal_on_one_process_stops_at_once_and_exits_with_the_configured_code(train):
    run = train(
        *EXACT,
        *fault("signal", 0, 5, "+callbacks.fault.signal=SIGTERM"),
        "callbacks.preemption.exit_code=75",
        timeout=150,
        check=False,
    )
    assert run.returncode == 75, run.output[-3000:]
    report = json.loads((run.run_dir() / "reports" / "preemption.json").read_text())
    # one process: no vote to wait for, the stop is at the end of the step that got the signal
    assert report["global_step"] == report["checkpoint_step"] == 6 and report["exit_code"] == 75
    assert "Traceback" not in run.stderr


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_n_minutes_saves_mid_epoch_on_rank_zeros_clock(train):
    # 1e-5 min (0.6 ms): due at every step on rank zero's clock; the vote makes it a save one step later on both
    # ranks, from step 2 on; rank 0 is SIGKILLed at the start of step 7, after step 6's save
    run = train(
        *DDP,
        *EXACT,
        "trainer.max_epochs=1",
        "callbacks.last_checkpoint.every_n_minutes=0.00001",
        *fault("kill", 0, 6),
        timeout=150,
        check=False,
    )
    assert run.returncode != 0
    assert last_ckpt(run)["global_step"] in (5, 6), last_ckpt(run)["global_step"]


# -- config errors ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_preemption_without_last_checkpoint_and_two_writers_of_last_ckpt_are_one_line_errors(train):
    run = train(*QUICK, "callbacks.last_checkpoint=null", "trainer.max_epochs=1", timeout=120, check=False)
    assert run.returncode == 2 and "callbacks.preemption saves through callbacks.last_checkpoint" in run.stderr
    run = train(*QUICK, "callbacks.model_checkpoint.save_last=true", "trainer.max_epochs=1", timeout=120, check=False)
    assert run.returncode == 2 and "has save_last=True" in run.stderr and "Traceback" not in run.stderr
    run = train(*QUICK, "callbacks.preemption.signals=[SIGFOO]", timeout=120, check=False)
    assert run.returncode == 2 and "'SIGFOO' is not a signal name" in run.stderr


def test_bad_last_checkpoint_options_name_the_option():
    from lit_template.callbacks.last_checkpoint import LastCheckpoint

    with pytest.raises(ConfigError, match="every_n_train_steps=-1"):
        LastCheckpoint("ckpts", every_n_train_steps=-1)
    with pytest.raises(ConfigError, match="every_n_minutes=0"):
        LastCheckpoint("ckpts", every_n_minutes=0)


# -- the pieces ---------------------------------------------------------------------------------------------------
def test_the_signal_recorder_only_records_and_puts_the_old_handler_back():
    previous = signal.getsignal(signal.SIGUSR1)
    recorder = SignalRecorder([signal_number("USR1", "x"), signal_number("SIGUSR2", "x")])
    recorder.install()
    signal.raise_signal(signal.SIGUSR2)
    signal.raise_signal(signal.SIGUSR1)
    assert recorder.received == signal.SIGUSR2  # the first one counts
    recorder.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_a_vote_on_one_process_returns_at_once():
    vote = StepVote(world_size=1, global_rank=0)
    assert vote.vote([10]) == [[10]] and vote.vote_now([0]) == [[0]] and vote.finish() is None


def test_the_slurm_job_id_of_an_array_task_is_what_scontrol_requeue_takes():
    assert SlurmJob.from_env({}) is None
    job = SlurmJob.from_env(
        {"SLURM_JOB_ID": "41", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3", "SLURM_RESTART_COUNT": "2"}
    )
    assert job.job_id == "40_3" and job.restart_count == 2
    assert SlurmJob.from_env({"SLURM_JOB_ID": "41"}).job_id == "41"
