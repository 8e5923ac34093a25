"""logger=mlflow and logger=wandb through ``python train.py``, with no network: metrics read back with MLflow's own
client and from W&B's offline run files; one run under DDP; one closed run per multirun job; a resumed training
continues its run."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

from lit_template.errors import ConfigError

TESTS = str(Path(__file__).resolve().parent)
TINY = (
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=2",
    "test=false",
    "extras.print_config=false",
    "callbacks.rich_progress_bar=null",
    "callbacks.profiling=null",
)
BOTH = "logger=[mlflow,wandb]"
# the loggers' packages are the `loggers` extra (pip install -e ".[loggers]"); without them those tests are skipped
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason='pip install -e ".[loggers]"')
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason='pip install -e ".[loggers]"')


@pytest.fixture
def no_login(tmp_path):
    """No W&B credentials or settings anywhere: a run that tried to log in would fail or prompt."""
    return {
        "WANDB_API_KEY": "",
        "WANDB_MODE": "",
        "NETRC": str(tmp_path / "no-netrc"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "MLFLOW_TRACKING_URI": "",
    }


# -- reading back ---------------------------------------------------------------------------------------------------
def mlflow_runs(log_dir: Path, experiment: str = "train") -> list:
    """Every run of ``experiment`` in the SQLite store conf/logger/mlflow.yaml puts under ``paths.log_dir``."""
    from mlflow.tracking import MlflowClient

    db = log_dir / "mlflow" / "mlflow.db"
    assert db.is_file(), f"no MLflow database at {db}"
    client = MlflowClient(f"sqlite:///{db}")
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r} in {db}"
    return client.search_runs([found.experiment_id])


def mlflow_history(log_dir: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{log_dir / 'mlflow' / 'mlflow.db'}")
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def wandb_records(run_dir: Path) -> list:
    """The records of an offline W&B run (``offline-run-<time>-<id>/run-<id>.wandb``): W&B's LevelDB-style log of
    protobuf ``Record`` messages (32 KiB blocks, 7-byte chunk headers: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # the block's tail is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
        elif kind == 0 and length == 0:
            pending = b""
    return records


def wandb_history(run_dir: Path) -> list[dict]:
    rows = []
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def wandb_exit_code(run_dir: Path) -> int | None:
    """The exit code wandb.finish() wrote, None if the run was never finished."""
    codes = [r.exit.exit_code for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "exit"]
    return codes[-1] if codes else None


def wandb_run_record(run_dir: Path):
    return next(r.run for r in wandb_records(run_dir) if r.WhichOneof("record_type") == "run")


def steps_of(rows: list[dict], key: str) -> list[int]:
    return [int(row["trainer/global_step"]) for row in rows if key in row]


def offline_runs(folder: Path) -> list[Path]:
    return sorted(folder.glob("**/wandb/offline-run-*"))


def logger_runs(run_dir: Path) -> dict:
    return json.loads((run_dir / "logger_runs.json").read_text())


# -- one run each ---------------------------------------------------------------------------------------------------
@needs_mlflow
@pytest.mark.timeout(120)
def test_mlflow_logs_into_a_sqlite_store_under_the_log_dir(train, no_login):
    run = train("logger=mlflow", *TINY, "trainer.max_epochs=2", env=no_login, timeout=100)
    run_dir = run.run_dir()
    runs = mlflow_runs(run.log_dir)
    assert len(runs) == 1, f"{[r.info.run_name for r in runs]}\n{run.output[-3000:]}"
    found = runs[0]
    assert found.info.status == "FINISHED"
    assert found.info.run_name == f"train/runs/{run_dir.name}"
    assert found.info.artifact_uri.startswith(str(run.log_dir / "mlflow" / "artifacts" / "train"))
    assert logger_runs(run_dir)["mlflow"]["run_id"] == found.info.run_id
    history = mlflow_history(run.log_dir, found.info.run_id, "val/acc")
    assert len(history) == 2 and history[0][0] < history[1][0] and all(0 <= v <= 1 for _, v in history), history
    assert found.data.metrics["val/acc"] == history[-1][1]
    assert {"train/loss", "val/loss", "val/acc_best", "epoch"} <= set(found.data.metrics)
    assert found.data.params["model/_target_"] and found.data.params["trainer/max_epochs"] == "2"
    assert not (run.log_dir / "mlruns").exists() and not list(run.log_dir.glob("**/mlruns"))


@needs_wandb
@pytest.mark.timeout(120)
def test_wandb_is_offline_by_default_and_its_run_dir_holds_the_metrics(train, no_login):
    run = train("logger=wandb", *TINY, "trainer.max_epochs=2", env=no_login, timeout=100)
    run_dir = run.run_dir()
    (offline,) = offline_runs(run.log_dir)
    assert offline.parent == run_dir / "wandb"
    run_id = logger_runs(run_dir)["wandb"]["id"]
    assert offline.name.endswith(f"-{run_id}") and (offline / f"run-{run_id}.wandb").is_file()
    record = wandb_run_record(offline)
    assert record.project == "lit-template" and record.display_name == f"train/runs/{run_dir.name}"
    rows = wandb_history(offline)
    val_steps = steps_of(rows, "val/acc")
    assert len(val_steps) == 2 and val_steps[0] < val_steps[1], rows
    assert all(0 <= row["val/acc"] <= 1 for row in rows if "val/acc" in row)
    assert wandb_exit_code(offline) == 0
    assert "wandb sync" in run.output  # W&B's own hint: how to upload the offline run later
    assert "anonymous" not in run.output


# -- errors ---------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_missing_package_is_one_line_naming_the_choice_and_the_extra(train, tmp_path):
    # a module that fails to import, first on the path: as if mlflow were not installed
    fake = tmp_path / "no_mlflow"
    fake.mkdir()
    (fake / "mlflow.py").write_text("raise ImportError(\"No module named 'mlflow'\")\n")
    run = train("logger=mlflow", *TINY, env={"PYTHONPATH": str(fake)}, check=False, timeout=100)
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output
    expected = "error: logger=mlflow needs the `mlflow` package, which does not import (No module named 'mlflow')"
    assert f'{expected}: pip install -e ".[loggers]"' in run.stderr, run.stderr[-3000:]


@pytest.mark.parametrize(
    ("kind", "kwargs", "message"),
    [
        ("mlflow", {"tracking_uri": "file:./mlruns"}, r"logger\.mlflow\.tracking_uri=file:\./mlruns is a folder"),
        ("mlflow", {"tracking_uri": "/tmp/some/folder"}, r"logger\.mlflow\.tracking_uri=/tmp/some/folder is a folder"),
        ("mlflow", {"tracking_uri": "nope://x"}, r"logger\.mlflow\.tracking_uri=nope://x: MLflow cannot use it"),
        ("mlflow", {"tracking_uri": "sqlite://"}, r"logger\.mlflow\.tracking_uri=sqlite://: give a file"),
        ("mlflow", {"resume_run": "yes"}, r"logger\.mlflow\.resume_run='yes': give true or false"),
        ("mlflow", {"experiment_name": ""}, r"logger\.mlflow\.experiment_name=''"),
        ("wandb", {"offline": "sometimes"}, r"logger\.wandb\.offline='sometimes': give true or false"),
        ("wandb", {"log_model": True}, r"logger\.wandb\.log_model=True uploads checkpoints.*logger\.wandb\.offline"),
    ],
)
@needs_mlflow
@needs_wandb
def test_a_bad_option_is_a_config_error_naming_it(kind, kwargs, message, tmp_path, monkeypatch):
    from lit_template import loggers

    for name in ("WANDB_MODE", "WANDB_ERROR_REPORTING", "MLFLOW_DISABLE_TELEMETRY", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)  # restored after the test, whatever the logger sets
    if kind == "mlflow":
        args = {"tracking_uri": f"sqlite:///{tmp_path}/m.db", **kwargs}
        with pytest.raises(ConfigError, match=message):
            loggers.MLflowLogger(experiment_name=args.pop("experiment_name", "x"), **args)
    else:
        with pytest.raises(ConfigError, match=message):
            loggers.WandbLogger(save_dir=str(tmp_path), **kwargs)


def test_the_package_check_names_the_choice(monkeypatch):
    from lit_template import loggers

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ConfigError, match=r'^logger=wandb needs the `wandb` package.*pip install -e "\.\[loggers\]"$'):
        loggers.require("wandb", "logger=wandb")


# -- resume bookkeeping, in process ---------------------------------------------------------------------------------
@needs_mlflow
@needs_wandb
def test_a_resumed_training_points_each_logger_at_the_checkpoints_run(tmp_path, monkeypatch):
    from lit_template import loggers

    for name in ("WANDB_MODE", "WANDB_ERROR_REPORTING", "MLFLOW_DISABLE_TELEMETRY"):
        monkeypatch.delenv(name, raising=False)
    first_dir, second_dir = tmp_path / "train" / "runs" / "a", tmp_path / "train" / "runs" / "b"
    (first_dir / "checkpoints").mkdir(parents=True)
    uri = f"sqlite:///{tmp_path}/db/mlflow.db"
    first = loggers.MLflowLogger(experiment_name="train", tracking_uri=uri, run_dir=str(first_dir))
    run_id = first.run_id  # starts the run and records it
    loggers.close_loggers("success")
    assert first.experiment.get_run(run_id).info.status == "FINISHED"
    runs = logger_runs(first_dir)
    assert runs["mlflow"]["run_id"] == run_id and runs["mlflow"]["run_name"] == "train/runs/a"
    loggers.record_run(first_dir, "wandb", {"id": "abc123", "project": "p"})
    ckpt = str(first_dir / "checkpoints" / "last.ckpt")

    again = loggers.MLflowLogger(experiment_name="train", tracking_uri=uri, run_dir=str(second_dir))
    same_project = loggers.WandbLogger(project="p", save_dir=str(tmp_path / "w"), run_dir=str(second_dir))
    other_project = loggers.WandbLogger(project="q", save_dir=str(tmp_path / "w"), run_dir=str(second_dir))
    fresh = loggers.MLflowLogger(experiment_name="train", tracking_uri=uri, resume_run=False)
    loggers.continue_runs([again, same_project, other_project, fresh], ckpt)
    assert again.run_id == run_id
    assert again.experiment.get_run(run_id).info.status == "RUNNING"  # running again until it is closed
    assert logger_runs(second_dir)["mlflow"]["run_id"] == run_id  # a later resume from the second run finds it too
    assert same_project._wandb_init["id"] == "abc123" and same_project._wandb_init["resume"] == "allow"
    assert other_project._wandb_init["id"] is None
    assert fresh.run_id != run_id
    # params: the first values stay, a changed one becomes a tag (MLflow refuses to change a param)
    again.log_hyperparams({"trainer": {"max_epochs": 1}, "seed": 1})
    again.log_hyperparams({"trainer": {"max_epochs": 2}, "seed": 1})
    data = again.experiment.get_run(run_id).data
    assert data.params["trainer/max_epochs"] == "1" and data.tags["changed/trainer/max_epochs"] == "2"
    loggers.close_loggers("failed")
    assert again.experiment.get_run(run_id).info.status == "FAILED"
    # a checkpoint whose run dir recorded nothing: a new run, said in the log
    lone = loggers.MLflowLogger(experiment_name="train", tracking_uri=uri)
    loggers.continue_runs([lone], str(tmp_path / "elsewhere" / "checkpoints" / "x.ckpt"))
    assert lone._run_id is None
    loggers.close_loggers()


# -- resume, multirun, DDP through train.py -------------------------------------------------------------------------
@needs_mlflow
@needs_wandb
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["auto", "last"])
def test_a_resumed_training_continues_the_same_mlflow_and_wandb_run(train, no_login, how):
    # auto: the same run dir (a restart with the same LT_RUN_ID); last: a new run dir, the newest earlier last.ckpt
    env = {**no_login, "LT_RUN_ID": "first"}
    first = train(BOTH, *TINY, env=env, timeout=140)
    first_dir = first.run_dir()
    env_second = env if how == "auto" else {**no_login, "LT_RUN_ID": "second"}
    second = train(BOTH, *TINY, "trainer.max_epochs=2", f"ckpt_path={how}", env=env_second, timeout=140)
    assert "resuming from" in second.output and "continuing MLflow run" in second.output
    assert "continuing W&B run" in second.output

    (found,) = mlflow_runs(second.log_dir)  # ONE run, holding both parts
    assert found.info.status == "FINISHED"
    steps = [step for step, _ in mlflow_history(second.log_dir, found.info.run_id, "val/acc")]
    assert len(steps) == 2 and steps[0] < steps[1], steps  # epoch 0 from the first part, epoch 1 from the second
    epochs = [value for _, value in mlflow_history(second.log_dir, found.info.run_id, "epoch")]
    assert {0.0, 1.0} <= set(epochs), epochs
    assert found.data.params["trainer/max_epochs"] == "1" and found.data.tags["changed/trainer/max_epochs"] == "2"

    run_id = logger_runs(first_dir)["wandb"]["id"]
    parts = offline_runs(second.log_dir)
    assert len(parts) == 2 and all(p.name.endswith(f"-{run_id}") for p in parts), parts  # W&B syncs them as one
    if how == "auto":
        assert {p.parent for p in parts} == {first_dir / "wandb"}
    else:
        second_dir = next(d for d in second.run_dirs() if d != first_dir)
        assert logger_runs(second_dir)["wandb"]["id"] == run_id
        assert logger_runs(second_dir)["mlflow"]["run_id"] == found.info.run_id
    before, after = (steps_of(wandb_history(p), "val/acc") for p in parts)
    assert len(before) == 1 and len(after) == 1 and before[0] < after[0], (before, after)
    assert [wandb_exit_code(p) for p in parts] == [0, 0]


@needs_mlflow
@needs_wandb
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_multirun_job_gets_its_own_run_closed_at_the_job_end(train, no_login):
    # job 1 fails at train start (lr above the threshold); job 2 still gets a new run of its own
    run = train(
        "-m",
        BOTH,
        "model.optimizer.lr=0.001,5.0,0.002",
        "+callbacks.fail._target_=support_callbacks.FailAboveLR",
        "+callbacks.fail.threshold=1.0",
        *TINY,
        env={**no_login, "PYTHONPATH": TESTS},
        timeout=240,
    )
    (sweep,) = sorted((run.log_dir / "train" / "multiruns").glob("*"))
    runs = {r.info.run_name: r for r in mlflow_runs(run.log_dir)}
    names = [f"train/multiruns/{sweep.name}/{job}" for job in range(3)]
    assert sorted(runs) == names, sorted(runs)
    assert [runs[n].info.status for n in names] == ["FINISHED", "FAILED", "FINISHED"]
    assert [runs[n].data.params["model/optimizer/lr"] for n in names] == ["0.001", "5.0", "0.002"]
    assert "val/acc" in runs[names[0]].data.metrics and "val/acc" in runs[names[2]].data.metrics
    ids = []
    for job in range(3):
        (offline,) = offline_runs(sweep / str(job))
        ids.append(logger_runs(sweep / str(job))["wandb"]["id"])
        assert offline.name.endswith(f"-{ids[-1]}")
        assert wandb_exit_code(offline) == (1 if job == 1 else 0)
    assert len(set(ids)) == 3
    assert "wandb run already in progress" not in run.output


@needs_mlflow
@needs_wandb
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_under_ddp_only_rank_zero_logs(train, no_login):
    run = train("trainer=ddp_cpu", "trainer.strategy.timeout.seconds=60", BOTH, *TINY, env=no_login, timeout=240)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in run.output
    (found,) = mlflow_runs(run.log_dir)
    assert found.info.status == "FINISHED" and "val/acc" in found.data.metrics
    assert len(mlflow_history(run.log_dir, found.info.run_id, "val/acc")) == 1
    (offline,) = offline_runs(run.log_dir)
    assert len(steps_of(wandb_history(offline), "val/acc")) == 1 and wandb_exit_code(offline) == 0
    assert len(list(run.log_dir.glob("**/logger_runs.json"))) == 1
