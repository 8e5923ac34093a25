"""On a real SLURM cluster (scripts/slurm_cluster.sh: 2 nodes on this host): the shipped scripts/slurm.sbatch and
launcher=slurm, preemption by ``scancel --signal=USR1`` and ``scontrol requeue``, a killed task.

The cluster script needs root (it installs slurm-wlm and munge and starts the daemons): where it cannot run, these
tests skip and say why. ``.ci/run`` starts the cluster before the tests, so CI runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# rank 0 sleeps 0.2 s per step, so a 40-step run lasts long enough to be interrupted mid-run; dropout and a
# deterministic run: the resumed run matches only if weights, RNG state and data position were all restored
EXACT = (
    "test=false",
    "callbacks.rich_progress_bar=null",
    "extras.print_config=false",
    "callbacks.profiling=null",
    "trainer.deterministic=true",
    "model.net.dropout=0.3",
    "callbacks.early_stopping=null",
    "trainer.limit_train_batches=8",
    "trainer.limit_val_batches=2",
    "trainer.max_epochs=5",
    "+callbacks.slow._target_=lit_template.testing.faults.FaultInjection",
    "+callbacks.slow.action=sleep",
    "+callbacks.slow.rank=0",
    "+callbacks.slow.step=0",
    "+callbacks.slow.every_step=true",
    "+callbacks.slow.seconds=0.2",
)
STEPS = 5 * 8
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")


class Cluster:
    def __init__(self, env: dict[str, str], out_dir: Path) -> None:
        self.env, self.out_dir = env, out_dir

    def run(self, *cmd: str, timeout: float = 60) -> str:
        proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    def sbatch(self, *overrides: str, log_dir: Path) -> str:
        return (
            self.run(
                "sbatch",
                "--parsable",
                "--cpus-per-task=1",
                f"--output={self.out_dir}/%j.out",
                "scripts/slurm.sbatch",
                *overrides,
                f"paths.log_dir={log_dir}",
            )
            .strip()
            .split(";")[0]
        )

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (the cluster keeps a finished job for MinJobAge=300 s)."""
        fields = {}
        for item in self.run("scontrol", "show", "job", "-o", job).split():
            key, _, value = item.partition("=")
            fields[key] = value
        return fields

    def output(self, job: str) -> str:
        path = self.out_dir / f"{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, job: str, timeout: float) -> dict[str, str]:
        """Until the job ends; a requeued job waits for its BeginTime (about 2 min): start it now instead."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job)
            if fields["JobState"] in DONE:
                return fields
            if fields["JobState"] == "PENDING" and fields.get("Reason") == "BeginTime":
                self.run("scontrol", "update", f"jobid={job}", "starttime=now")
            time.sleep(1)
        subprocess.run(["scancel", "--signal=KILL", "--full", job], env=self.env, timeout=30)
        pytest.fail(f"SLURM job {job} did not end in {timeout}s: {self.job(job)}\n{self.output(job)[-4000:]}")

    def wait_for(self, path: Path, job: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert self.job(job)["JobState"] in ("PENDING", "RUNNING"), self.output(job)[-4000:]
            assert time.monotonic() < deadline, f"{path} did not appear in {timeout}s\n{self.output(job)[-4000:]}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    script = ROOT / "scripts" / "slurm_cluster.sh"
    proc = subprocess.run([str(script), "start"], capture_output=True, text=True, timeout=600)
    if proc.returncode == 3:
        pytest.skip(f"no SLURM cluster here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"{script} start exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore", "COLUMNS": "200"}
    for line in proc.stdout.splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export ") :].partition("=")
            env[key] = value
    for key in ("LT_RUN_ID", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(key, None)
    return Cluster(env, tmp_path_factory.mktemp("slurm_out"))


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slurm_logs")


@pytest.fixture(scope="module")
def reference(cluster, logs) -> str:
    """An uninterrupted 2-node job the interrupted ones are compared with (submitted once, waited for on use)."""
    return cluster.sbatch(*EXACT, log_dir=logs)


def run_dir(logs: Path, job: str) -> Path:
    return logs / "train" / "runs" / f"slurm_{job}"


def final_state(logs: Path, job: str) -> dict:
    return torch.load(run_dir(logs, job) / "checkpoints" / "last.ckpt", weights_only=True)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a["global_step"] == b["global_step"] == STEPS, (a["global_step"], b["global_step"])
    for name, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][name]), f"{name} differs after the requeue"


def finished_reference(cluster: Cluster, logs: Path, job: str) -> dict:
    fields = cluster.wait(job, timeout=300)
    out = cluster.output(job)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", f"{fields}\n{out[-4000:]}"
    assert fields["NodeList"] == "n[1-2]" and fields["NumTasks"] == "2", fields
    assert "2 nodes x 1 tasks, 0 GPUs per node, trainer=ddp_multinode_cpu" in out, out[-3000:]
    assert sorted(p.name for p in (logs / "train" / "runs").glob(f"slurm_{job}*")) == [f"slurm_{job}"]
    assert sorted(p.name for p in (run_dir(logs, job) / "hang" / "heartbeat").iterdir()) == ["rank0.json", "rank1.json"]
    return final_state(logs, job)


@pytest.mark.timeout(600)
def test_usr1_before_the_time_limit_saves_requeues_and_resumes_to_the_same_weights(cluster, logs, reference):
    job = cluster.sbatch(*EXACT, log_dir=logs)
    cluster.wait_for(run_dir(logs, job) / "checkpoints" / "epoch_000.ckpt", job, timeout=240)
    cluster.run("scancel", "--signal=USR1", job)  # what #SBATCH --signal=SIGUSR1@90 sends before the time limit
    fields = cluster.wait(job, timeout=400)
    out = cluster.output(job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{out[-5000:]}"
    report = json.loads((run_dir(logs, job) / "reports" / "preemption.json").read_text())
    # scancel --signal reaches every task; each rank recorded it, all stopped at one step with last.ckpt at it
    assert report["signals"] == {"0": "SIGUSR1", "1": "SIGUSR1"} and report["requeued"] is True, report
    assert report["slurm_job"] == job and report["global_step"] == report["checkpoint_step"] < STEPS, report
    assert f"requeued SLURM job {job}: it resumes from there" in out
    assert f"slurm.sbatch [job {job}, start 2]" in out and "resuming from" in out
    assert "Terminated" not in out and "Traceback" not in out, out[-5000:]  # every rank exited by itself
    assert_same_weights(finished_reference(cluster, logs, reference), final_state(logs, job))


@pytest.mark.timeout(600)
def test_scontrol_requeue_stops_every_rank_and_the_requeued_job_resumes_to_the_same_weights(cluster, logs, reference):
    job = cluster.sbatch(*EXACT, log_dir=logs)
    cluster.wait_for(run_dir(logs, job) / "checkpoints" / "epoch_000.ckpt", job, timeout=240)
    cluster.run("scontrol", "requeue", job)  # SIGTERM to every task and the batch shell; SLURM requeues the job
    fields = cluster.wait(job, timeout=400)
    out = cluster.output(job)
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", f"{fields}\n{out[-5000:]}"
    report = json.loads((run_dir(logs, job) / "reports" / "preemption.json").read_text())
    assert report["signals"] == {"0": "SIGTERM", "1": "SIGTERM"} and report["requeued"] is False, report
    assert report["global_step"] == report["checkpoint_step"] < STEPS, report
    assert "not requeued (SLURM requeues a preempted job itself" in out
    assert "got SIGTERM; waiting for the tasks to save last.ckpt and exit" in out  # the batch shell waited
    assert f"slurm.sbatch [job {job}, start 2]" in out and "resuming from" in out
    assert_same_weights(finished_reference(cluster, logs, reference), final_state(logs, job))


@pytest.mark.timeout(300)
def test_a_task_killed_mid_run_fails_the_job_and_the_survivor_names_the_dead_rank(cluster, logs):
    job = cluster.sbatch(
        *EXACT,
        "+callbacks.fault._target_=lit_template.testing.faults.FaultInjection",
        "+callbacks.fault.action=kill",
        "+callbacks.fault.rank=1",
        "+callbacks.fault.step=12",
        log_dir=logs,
    )
    fields = cluster.wait(job, timeout=240)
    out = cluster.output(job)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] != "0:0", f"{fields}\n{out[-4000:]}"
    assert "hang doctor: global rank 0 lost a peer at step 12" in out, out[-4000:]
    assert "global rank 1 is gone: its last heartbeat came" in out and "its process is gone" in out
    report = json.loads((run_dir(logs, job) / "hang" / "lost_peer.rank0.json").read_text())
    assert report["ranks"] == [1] and report["global_step"] == 12, report


@pytest.mark.timeout(400)
def test_a_submitit_sweep_of_two_ddp_jobs_on_cpu_nodes_finishes_with_its_summary(cluster, tmp_path):
    cmd = [
        sys.executable,
        "train.py",
        "-m",
        "launcher=slurm",
        "trainer=ddp_multinode_cpu",
        "trainer.num_nodes=2",
        "trainer.devices=1",
        "model.optimizer.lr=0.001,0.01",
        "trainer.max_epochs=1",
        "test=false",
        "callbacks.rich_progress_bar=null",
        "extras.print_config=false",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=null",
        f"paths.log_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=cluster.env, capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    (sweep,) = (tmp_path / "train" / "multiruns").iterdir()
    summary = json.loads((sweep / "summary.json").read_text())
    jobs = summary["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "completed"], summary
    assert all(j["value"] > 0.5 for j in jobs), summary
    # no GPU request for a CPU trainer; each job: 2 nodes, one task each, both ranks of one DDP run
    (script,) = sweep.glob(".submitit/*/*_submission.sh")
    text = script.read_text()
    assert "--nodes=2" in text and "--ntasks-per-node=1" in text and "gpu" not in text, text
    for n in (0, 1):
        logs = "".join(p.read_text() for p in sweep.glob(f".submitit/*_{n}/*_log.out"))
        assert "global_rank=0(2)" in logs and "global_rank=1(2)" in logs, logs[-3000:]
