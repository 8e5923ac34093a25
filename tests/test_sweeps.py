"""Hydra multirun: a grid, Optuna, and sweeps of DDP jobs, each through python train.py -m."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

TESTS = str(Path(__file__).resolve().parent)
TINY = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=2",
    "test=false",
    "extras.print_config=false",
    "callbacks.rich_progress_bar=null",
]


def sweep_dir(run) -> Path:
    dirs = sorted((run.log_dir / "train" / "multiruns").glob("*"))
    assert len(dirs) == 1, dirs
    return dirs[0]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_grid_sweep_2x2_runs_four_jobs_and_summarises_them(train):
    run = train("-m", "model.optimizer.lr=1e-3,1e-2", "data.batch_size=32,64", *TINY, timeout=380)
    root = sweep_dir(run)
    summary = json.loads((root / "summary.json").read_text())
    assert [j["job"] for j in summary["jobs"]] == [0, 1, 2, 3]
    assert all(j["status"] == "completed" and 0.0 <= j["value"] <= 1.0 for j in summary["jobs"])
    assert {tuple(j["swept"]) for j in summary["jobs"]} == {
        ("model.optimizer.lr=0.001", "data.batch_size=32"),
        ("model.optimizer.lr=0.001", "data.batch_size=64"),
        ("model.optimizer.lr=0.01", "data.batch_size=32"),
        ("model.optimizer.lr=0.01", "data.batch_size=64"),
    }
    for job in range(4):
        assert (root / str(job) / "checkpoints" / "last.ckpt").is_file()
    assert "best: job" in run.output and (root / "summary.md").is_file()
    best = max(summary["jobs"], key=lambda j: j["value"])
    assert summary["direction"] == "maximize" and summary["best_job"] == best["job"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_failed_job_is_reported_and_the_sweep_goes_on_in_parallel_jobs(train):
    # launcher=joblib: the two jobs run at once in worker processes; results still reach the summary (through files)
    run = train(
        "-m",
        "launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "model.optimizer.lr=0.001,5.0",
        "+callbacks.fail._target_=support_callbacks.FailAboveLR",
        "+callbacks.fail.threshold=1.0",
        *TINY,
        env={"PYTHONPATH": TESTS},
        timeout=380,
    )
    assert "Joblib.Parallel(n_jobs=2" in run.output
    jobs = json.loads((sweep_dir(run) / "summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "failed"]
    assert "diverges" in jobs[1]["error"]
    assert json.loads((sweep_dir(run) / "1" / "failure.json").read_text())["error_type"] == "FloatingPointError"


def test_summary_direction_picks_the_best_job(tmp_path):
    from omegaconf import OmegaConf

    from lit_template.utils.sweep_summary import RESULT_FILE, SweepSummary

    for job, value in enumerate([0.5, 0.2, 0.9]):
        (tmp_path / str(job)).mkdir()
        (tmp_path / str(job) / RESULT_FILE).write_text(
            json.dumps(
                {"job": job, "overrides": [f"seed={job}"], "metric": "val/loss", "value": value, "status": "completed"}
            )
        )
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}, "sweeper": {}}})
    SweepSummary(direction="minimize").on_multirun_end(config)
    assert json.loads((tmp_path / "summary.json").read_text())["best_job"] == 1
    SweepSummary().on_multirun_end(config)  # a grid sweeper has no direction: maximize
    assert json.loads((tmp_path / "summary.json").read_text())["best_job"] == 2
    with pytest.raises(ValueError, match=r"sweep_summary\.direction='lowest'"):
        SweepSummary(direction="lowest")


def test_slurm_launcher_with_all_gpus_fails_before_submitting(train):
    run = train("-m", "launcher=slurm", "trainer=ddp_multinode", check=False, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.output, run.output[-3000:]
    assert "trainer.devices=-1: set trainer.devices to a count" in run.output


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_optuna_sweep_returns_the_best_value(train):
    run = train(
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.sampler.seed=5",
        "hydra.sweeper.sampler.n_startup_trials=2",
        *TINY,
        timeout=480,
    )
    root = sweep_dir(run)
    results = yaml.safe_load((root / "optimization_results.yaml").read_text())
    values = [j["value"] for j in json.loads((root / "summary.json").read_text())["jobs"]]
    assert len(values) == 3
    assert results["best_value"] == pytest.approx(max(values))
    assert set(results["best_params"]) == {"model.optimizer.lr", "data.batch_size", "model.net.dropout"}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_optuna_sweep_with_the_shipped_paths(train, tmp_path):
    # The sweeper resolves hydra.sweep.dir (below paths.log_dir, below the launch folder) before Hydra has set its
    # config: with ${hydra:runtime.cwd} there this failed ("HydraConfig was not set") unless paths.log_dir was given.
    # With and without -m (conf/hparams_search/optuna.yaml sets hydra.mode=MULTIRUN).
    for flags in (["-m"], []):
        launch = tmp_path / f"launch{len(flags)}"
        launch.mkdir()
        run = train(*flags, "hparams_search=optuna", "hydra.sweeper.n_trials=1", *TINY, launch_dir=launch, timeout=140)
        root = sweep_dir(run)
        assert root.parent == launch / "logs" / "train" / "multiruns"
        assert yaml.safe_load((root / "optimization_results.yaml").read_text())["best_value"] > 0


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_optuna_counts_a_failed_trial_as_failed_and_goes_on(train):
    # The shipped search (TPE: its first trials sample at random) with lr narrowed to two values; the test callback
    # fails lr=5.0, which seed 5 draws first. The study records the failed trial and goes on.
    run = train(
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.sampler.seed=5",
        "hydra.sweeper.params={model.optimizer.lr:'choice(0.001, 5.0)'}",
        "+callbacks.fail._target_=support_callbacks.FailAboveLR",
        "+callbacks.fail.threshold=1.0",
        *TINY,
        env={"PYTHONPATH": TESTS},
        timeout=480,
    )
    root = sweep_dir(run)
    jobs = json.loads((root / "summary.json").read_text())["jobs"]
    statuses = [j["status"] for j in jobs]
    assert len(statuses) == 3 and "completed" in statuses and "failed" in statuses, statuses
    results = yaml.safe_load((root / "optimization_results.yaml").read_text())
    assert results["best_params"]["model.optimizer.lr"] == 0.001  # the other searched params stay as shipped


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_optuna_sweep_of_ddp_trials(train):
    # hparams_search=optuna sets hydra.mode=MULTIRUN in its config: rank 1 of each trial, which Lightning starts by
    # re-running the job's overrides, must run that one trial, not a study of its own
    run = train(
        "-m",
        "hparams_search=optuna",
        "hydra.sweeper.n_trials=2",
        "trainer=ddp_cpu",
        "trainer.strategy.timeout.seconds=60",
        *TINY,
        timeout=280,
    )
    root = sweep_dir(run)
    jobs = json.loads((root / "summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "completed"], jobs
    assert run.output.count("Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2") == 2
    assert yaml.safe_load((root / "optimization_results.yaml").read_text())["best_value"] == pytest.approx(
        max(j["value"] for j in jobs)
    )
    assert sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.isdigit()) == ["0", "1"]
    assert not list(run.log_dir.glob("train/runs/*")) and len(list(run.log_dir.glob("train/multiruns/*"))) == 1


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(500)
def test_multirun_of_ddp_jobs_each_with_its_own_process_group(train):
    run = train("-m", "trainer=ddp_cpu", "seed=1,2", "trainer.strategy.timeout.seconds=60", *TINY, timeout=480)
    root = sweep_dir(run)
    jobs = json.loads((root / "summary.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["completed", "completed"]
    # both ranks of both jobs joined (each job its own rendezvous), each job wrote into its own dir only
    assert run.output.count("Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2") == 2
    for job in ("0", "1"):
        assert (root / job / "checkpoints" / "last.ckpt").is_file()
    assert not list(run.log_dir.glob("train/runs/*")), "a DDP child wrote a run dir of its own"
