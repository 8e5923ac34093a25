"""Shared test helpers: run the real entry points as a user would, in a temp dir, with a hard timeout."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Under pytest-xdist (make test: the fast half on -n auto, a worker per core; the slow half on 2), every process a test
# starts gets one intra-op thread unless OMP_NUM_THREADS is set: each worker would otherwise run torch with a thread
# per core, and on 2 cores the oversubscribed threads made runs 3-12x slower (a GPT host-sync test: 11 s alone, 134 s
# beside another test, under 24 s beside another test with one thread).
# DDP ranks already had one here (Lightning's launcher gives each cores / processes threads, torchrun gives 1).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    log_dir: Path

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def run_dirs(self, task: str = "train") -> list[Path]:
        return sorted((self.log_dir / task / "runs").glob("*"))

    def run_dir(self, task: str = "train") -> Path:
        dirs = self.run_dirs(task)
        assert len(dirs) == 1, f"expected one run dir, found {dirs}\n{self.output[-3000:]}"
        return dirs[0]

    def metrics(self, task: str = "train") -> list[dict[str, str]]:
        files = sorted(self.run_dir(task).glob("csv/version_*/metrics.csv"))
        assert files, f"no metrics.csv in {self.run_dir(task)}"
        with open(files[-1]) as f:
            return list(csv.DictReader(f))

    def last_value(self, name: str, task: str = "train") -> float:
        values = [float(r[name]) for r in self.metrics(task) if r.get(name)]
        assert values, f"{name} was never logged"
        return values[-1]


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_command(cmd: list[str], env: dict, timeout: float, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``cmd`` from the repo root (or ``cwd``) in its own process group: on a timeout every process it started
    (DDP ranks, sweep jobs) is killed with it, and the test fails."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s (hang?)\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def run_script(
    script: str,
    *overrides: str,
    log_dir: Path,
    timeout: float = 180,
    env: dict | None = None,
    check: bool = True,
    launch_dir: Path | None = None,
) -> Run:
    """``python <script> <overrides>`` from the repo root, writing below ``log_dir``; a hang fails at ``timeout``.

    ``launch_dir``: run from that folder with the shipped paths instead (no ``paths.log_dir`` given: its ``logs/``).
    """
    cmd = [sys.executable, str(ROOT / script), *overrides]
    if launch_dir is None:
        cmd.append(f"paths.log_dir={log_dir}")
    else:
        log_dir = launch_dir / "logs"
    full_env = {**os.environ, "PYTHONWARNINGS": "ignore", "COLUMNS": "200", **(env or {})}
    for key in ("LT_RUN_ID", "MASTER_PORT", "MASTER_ADDR", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        if env is None or key not in env:
            full_env.pop(key, None)
    proc = run_command(cmd, full_env, timeout, cwd=launch_dir or ROOT)
    run = Run(proc.returncode, proc.stdout, proc.stderr, log_dir)
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n"
            f"{proc.stderr[-6000:]}"
        )
    return run


@pytest.fixture
def train(tmp_path):
    """``train("trainer=ddp_cpu", ...)`` runs ``python train.py`` with those overrides, logs under tmp_path."""

    def _train(*overrides: str, **kwargs) -> Run:
        return run_script("train.py", *overrides, log_dir=kwargs.pop("log_dir", tmp_path / "logs"), **kwargs)

    return _train


@pytest.fixture
def evaluate(tmp_path):
    def _evaluate(*overrides: str, **kwargs) -> Run:
        return run_script("eval.py", *overrides, log_dir=kwargs.pop("log_dir", tmp_path / "logs"), **kwargs)

    return _evaluate
