"""The hang doctor: a rank that gets stuck is named with its line, every rank dumps its stacks, and the job ends.

Real runs of ``python train.py trainer=ddp_cpu`` (2 processes, gloo) with one rank made to hang by FaultInjection.
"""

from __future__ import annotations

import inspect
import json
import time

import pytest

from lit_template.callbacks.hang_doctor import HangDoctor
from lit_template.diagnostics.hang.heartbeat import Heartbeat, diagnose
from lit_template.diagnostics.hang.stacks import Frame, collective_of
from lit_template.errors import ConfigError
from lit_template.testing.faults import FaultInjection, stuck_forever

SMALL = (
    "trainer.max_epochs=1",
    "++trainer.limit_train_batches=10",
    "++trainer.limit_val_batches=2",
    "test=false",
    "callbacks.early_stopping=null",
)
DDP = ("trainer=ddp_cpu", *SMALL)
FAULT = f"{FaultInjection.__module__}.{FaultInjection.__name__}"
FAULT_FILE = "src/lit_template/testing/faults.py"


def fault(name: str, **options) -> list[str]:
    return [f"+callbacks.{name}._target_={FAULT}", *(f"+callbacks.{name}.{k}={v}" for k, v in options.items())]


def line_of(function, text: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def summary_of(run) -> dict:
    path = run.run_dir() / "hang" / "summary.json"
    assert path.exists(), f"no {path}\n{run.output[-4000:]}"
    return json.loads(path.read_text())


def rows_of(summary: dict) -> dict[int, dict]:
    return {row["global_rank"]: row for row in summary["table"]}


# -- real runs ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stuck", [1, 0])
def test_stuck_rank_is_named_and_the_job_ends(train, stuck):
    stall_s, waiter = 6, 1 - stuck
    run = train(
        *DDP,
        f"callbacks.hang_doctor.stall_timeout_s={stall_s}",
        *fault("fault", action="hang", rank=stuck, step=3),
        check=False,
        timeout=150,
    )
    ended = time.time()

    assert run.returncode != 0, run.output[-4000:]
    hang = run.run_dir() / "hang"
    assert (hang / "rank0.txt").exists() and (hang / "rank1.txt").exists(), run.output[-4000:]
    assert "stuck_forever" in (hang / f"rank{stuck}.txt").read_text()

    summary = summary_of(run)
    rows = rows_of(summary)
    assert summary["kind"] == "hang" and summary["ranks"] == [0, 1]
    assert summary["stuck_ranks"] == [stuck] and summary["waiting_ranks"] == [waiter]
    # the other rank reports when rank zero is the stuck one
    assert summary["reported_by"] == waiter
    sleep_line = line_of(stuck_forever, "time.sleep")
    assert rows[stuck]["where"] == f"{FAULT_FILE}:{sleep_line} stuck_forever"
    assert rows[stuck]["step"] == 3 and rows[stuck]["phase"] == "train_batch_start"
    assert "DDP" in rows[waiter]["waiting_in"] or "torch.distributed" in rows[waiter]["waiting_in"]
    assert f"rank {stuck} is stuck at step 3 in stuck_forever ({FAULT_FILE}:{sleep_line})" in run.output
    assert f"rank {waiter} waits in a collective" in run.output
    assert f"hang doctor: aborting rank {waiter} (exit code 3): rank {stuck} is stuck" in run.output
    # the flight recorder shows the waiter with collectives enqueued that the stuck rank never joined
    assert (hang / "flight_recorder" / f"rank_{waiter}").exists()
    # ended within the stall timeout plus a few seconds of the stuck rank's last progress (not the 120 s pg timeout)
    assert ended - rows[stuck]["last_progress_unix"] < stall_s + 10


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_slow_validation_and_checkpoint_below_the_timeout_are_no_hang(train):
    # a clean run whose validation (rank 1) and checkpoint save (rank 0) each take 5 s of an 8 s stall timeout
    run = train(
        *DDP,
        "callbacks.hang_doctor.stall_timeout_s=8",
        *fault("slow_val", action="slow_validation", rank=1, step=10, seconds=5),
        *fault("slow_ckpt", action="slow_checkpoint", rank=0, step=10, seconds=5),
        timeout=150,
    )

    hang = run.run_dir() / "hang"
    assert not (hang / "summary.json").exists() and not list(hang.glob("rank*.txt")), run.output[-4000:]
    assert "made no progress" not in run.output
    beats = [Heartbeat.read(hang / "heartbeat" / f"rank{r}.json") for r in (0, 1)]
    assert all(b is not None and not b.alive and b.phase == "stopped" for b in beats), beats
    # the slow phases happened and came close to the timeout
    assert max(b.longest_idle_s for b in beats) >= 4


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(180)
def test_report_mode_dumps_and_keeps_training(train):
    # rank 1 is a straggler for 12 s: with a 5 s stall timeout the doctor reports it, then training goes on
    run = train(
        *DDP,
        "callbacks.hang_doctor.stall_timeout_s=5",
        "callbacks.hang_doctor.on_stall=report",
        *fault("fault", action="sleep", rank=1, step=2, seconds=12),
        timeout=150,
    )

    hang = run.run_dir() / "hang"
    assert "Thread MainThread" in (hang / "rank0.txt").read_text()
    assert "on_train_batch_start" in (hang / "rank1.txt").read_text()
    summary = summary_of(run)
    assert summary["on_stall"] == "report" and summary["ranks"] == [0, 1] and summary["stuck_ranks"] == [1]
    sleep_line = line_of(FaultInjection.on_train_batch_start, "time.sleep")
    assert rows_of(summary)[1]["where"] == f"{FAULT_FILE}:{sleep_line} on_train_batch_start"
    assert f"rank 1 is stuck at step 2 in on_train_batch_start ({FAULT_FILE}:{sleep_line})" in run.output
    assert "made progress again" in run.output and "aborting" not in run.output
    assert (run.run_dir() / "checkpoints" / "last.ckpt").exists()


# -- the diagnosis, on heartbeats as the watchdogs write them ------------------------------------------------------


def test_one_process_is_its_own_stuck_rank():
    verdict = diagnose({0: beat(0)}, 1, now_unix=100.0, stale_after_s=30)
    assert verdict.stuck_ranks == [0] and verdict.waiting_ranks == [] and verdict.reporter == 0
    assert "rank 0 is stuck at step 3" in verdict.sentence


def beat(rank: int, step: int = 3, phase: str = "before_backward", waiting_in: str | None = None, **kw) -> Heartbeat:
    fields = dict(
        global_rank=rank,
        host="h",
        pid=1,
        step=step,
        phase=phase,
        where=f"x.py:{rank} f",
        waiting_in=waiting_in,
        stalled=True,
        alive=True,
        no_progress_s=9.0,
        last_progress_unix=0.0,
        time_unix=100.0,
    )
    return Heartbeat(**{**fields, **kw})


def test_two_ranks_the_one_not_in_a_collective_is_stuck():
    beats = {0: beat(0, waiting_in="DDP gradient all-reduce in backward"), 1: beat(1, phase="train_batch_start")}
    verdict = diagnose(beats, 2, now_unix=100.0, stale_after_s=30)
    assert verdict.stuck_ranks == [1] and verdict.waiting_ranks == [0] and verdict.reporter == 0
    assert verdict.sentence.startswith("rank 1 is stuck at step 3 in f (x.py:1); rank 0 waits in a collective")


def test_the_rank_off_the_majority_is_stuck_when_all_wait():
    wait = "torch.distributed.all_reduce"
    beats = {r: beat(r, waiting_in=wait) for r in range(4)}
    beats[2] = beat(2, phase="validation_end", waiting_in="torch.distributed.barrier")
    verdict = diagnose(beats, 4, now_unix=100.0, stale_after_s=30)
    assert verdict.stuck_ranks == [2] and verdict.reporter == 0


def test_a_rank_without_heartbeat_is_named_and_rank_zero_stuck_is_reported_by_another():
    beats = {0: beat(0, stalled=False, time_unix=10.0), 1: beat(1, waiting_in="torch.distributed.all_reduce")}
    verdict = diagnose(beats, 2, now_unix=100.0, stale_after_s=30)
    assert verdict.stuck_ranks == [0] and verdict.silent_ranks == [0] and verdict.reporter == 1
    assert "rank 0 sent no heartbeat for 90 s" in verdict.sentence


def test_a_rank_that_finished_is_not_blamed():
    beats = {0: beat(0, alive=False, stalled=False, phase="stopped"), 1: beat(1, phase="save_checkpoint")}
    assert diagnose(beats, 2, now_unix=100.0, stale_after_s=30).stuck_ranks == [1]


def test_waiting_is_read_from_the_innermost_torch_frames_only():
    torch_frame = Frame("/v/site-packages/torch/autograd/graph.py", 1, "_engine_run_backward")
    user_frame = Frame("/repo/src/model.py", 5, "backward")
    assert collective_of([torch_frame, user_frame], distributed=True) == "DDP gradient all-reduce in backward"
    # a user autograd function stuck inside backward is stuck, not waiting
    assert collective_of([user_frame, torch_frame], distributed=True) is None
    assert collective_of([torch_frame], distributed=False) is None


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match=r"callbacks\.hang_doctor\.on_stall"):
        HangDoctor(on_stall="sometimes")
    with pytest.raises(ConfigError, match=r"callbacks\.hang_doctor\.stall_timeout_s"):
        HangDoctor(stall_timeout_s=0)
