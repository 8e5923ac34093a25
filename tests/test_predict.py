"""python predict.py: a checkpoint's predict_step over one split, written to <run dir>/predictions.csv in dataset order,
on one process and under DDP (every sample once), with eval's one-line errors for a bad checkpoint."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning as L
import pytest
import torch
from conftest import run_script

from lit_template.errors import ConfigError
from lit_template.predict import IndexedDataset, PredictData, PredictionWriter, prediction_rows

DIGITS_TEST = 359  # int(1797 * 0.2): the digits test split, odd, so 2 ranks get 180 and 179 samples


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def predictions(run) -> list[dict[str, str]]:
    path = run.run_dir("predict") / "predictions.csv"
    assert path.is_file(), f"no predictions.csv\n{run.output[-3000:]}"
    return read_csv(path)


def assert_classifier_csv(rows: list[dict[str, str]], n: int, num_classes: int = 10) -> None:
    assert len(rows) == n
    assert [int(r["index"]) for r in rows] == list(range(n))  # each sample once, in dataset order
    assert list(rows[0]) == ["index", "prediction", *(f"score_{c}" for c in range(num_classes))]
    for r in rows:
        scores = [float(r[f"score_{c}"]) for c in range(num_classes)]
        assert sum(scores) == pytest.approx(1.0, abs=1e-5)
        assert int(r["prediction"]) == max(range(num_classes), key=scores.__getitem__)


# -- fast: the pieces, in this process ------------------------------------------------------------------------------


def test_prediction_rows_from_what_predict_step_returns():
    out = {"index": torch.tensor([4, 2]), "prediction": torch.tensor([1, 0]), "scores": torch.tensor([[0.2, 0.8]] * 2)}
    assert prediction_rows(out, None) == [
        {"index": 4, "prediction": 1, "score_0": pytest.approx(0.2), "score_1": pytest.approx(0.8)},
        {"index": 2, "prediction": 0, "score_0": pytest.approx(0.2), "score_1": pytest.approx(0.8)},
    ]
    # no index of its own: the indices Lightning's predict loop tracked; text columns; a plain tensor
    assert prediction_rows({"text": ["ab", "cd"]}, [7, 8]) == [{"index": 7, "text": "ab"}, {"index": 8, "text": "cd"}]
    assert prediction_rows(torch.tensor([3.0]), [0]) == [{"index": 0, "prediction": 3.0}]
    with pytest.raises(TypeError, match=r"'scores' has shape \[2, 2, 1\]"):
        prediction_rows({"index": [0, 1], "scores": torch.zeros(2, 2, 1)}, None)
    with pytest.raises(TypeError, match="no 'index'"):
        prediction_rows({"text": ["a"]}, None)


def stub_trainer(n: int, world_size: int = 1, replicas: int | None = None) -> Any:
    return SimpleNamespace(
        world_size=world_size,
        distributed_sampler_kwargs={"num_replicas": replicas or world_size, "rank": 0},
        datamodule=SimpleNamespace(num_samples=n),
    )


def test_writer_sorts_by_index_and_refuses_duplicates_or_gaps(tmp_path):
    writer = PredictionWriter(tmp_path / "p.csv")
    rows = [{"index": i, "text": f"t{i}"} for i in (2, 0, 1)]
    assert writer.write(stub_trainer(3), rows) == 3
    assert read_csv(tmp_path / "p.csv") == [{"index": str(i), "text": f"t{i}"} for i in range(3)]
    with pytest.raises(RuntimeError, match="several ranks"):
        writer.write(stub_trainer(3, world_size=2), [*rows, {"index": 1, "text": "again"}])
    # tensor-parallel peers (2 ranks, 1 data-parallel shard) predict the same samples: one copy is kept
    assert writer.write(stub_trainer(3, world_size=2, replicas=1), rows + rows) == 3
    with pytest.raises(RuntimeError, match=r"missing indices \[1\]"):
        writer.write(stub_trainer(3), [rows[0], rows[1]])


def test_indexed_dataset_carries_the_index():
    data = IndexedDataset(torch.utils.data.TensorDataset(torch.arange(3.0), torch.arange(3)))
    item = data[2]
    assert item["index"] == 2 and item["input"] == 2.0 and item["target"] == 2


def test_predict_in_process_writes_every_test_sample(tmp_path):
    # the task's pieces with a real Trainer and the classifier's predict_step, untrained weights, no checkpoint
    from lit_template.data import DigitsDataModule
    from lit_template.models import MLP, LitClassifier

    model = LitClassifier(MLP(input_shape=(1, 8, 8), num_classes=10), optimizer=torch.optim.Adam, num_classes=10)
    writer = PredictionWriter(tmp_path / "predictions.csv")
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[writer], enable_progress_bar=False)
    trainer.predict(model, datamodule=PredictData(DigitsDataModule(batch_size=50), "test"), return_predictions=False)
    assert writer.written == DIGITS_TEST
    assert_classifier_csv(read_csv(tmp_path / "predictions.csv"), DIGITS_TEST)
    with pytest.raises(ConfigError, match="split='dev'"):
        PredictData(DigitsDataModule(), "dev")


def test_predict_without_a_checkpoint_is_one_line(tmp_path):
    missing = run_script("predict.py", log_dir=tmp_path, check=False, timeout=120)
    assert missing.returncode == 2 and "Traceback" not in missing.output, missing.output[-3000:]
    assert "ckpt_path is required for predict: ckpt_path=/path/to/file.ckpt or ckpt_path=last" in missing.output
    nofile = run_script("predict.py", f"ckpt_path={tmp_path / 'nope.ckpt'}", log_dir=tmp_path, check=False, timeout=120)
    assert nofile.returncode == 2 and "Traceback" not in nofile.output, nofile.output[-3000:]
    assert f"ckpt_path='{tmp_path / 'nope.ckpt'}' is not a file" in nofile.output  # eval's wording


# -- slow: train, then python predict.py ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_checkpoint(tmp_path_factory) -> Path:
    logs = tmp_path_factory.mktemp("predict_train")
    run = run_script("train.py", "trainer.max_epochs=2", "test=false", log_dir=logs, timeout=180)
    return run.run_dir() / "checkpoints" / "last.ckpt"


@pytest.mark.slow
@pytest.mark.ddp
def test_predict_one_process_and_ddp_write_the_same_csv(mlp_checkpoint, tmp_path):
    one = run_script("predict.py", f"ckpt_path={mlp_checkpoint}", log_dir=tmp_path / "one", timeout=180)
    rows = predictions(one)
    assert_classifier_csv(rows, DIGITS_TEST)
    assert f"wrote {DIGITS_TEST} predictions (test split)" in one.output
    # a trained model: the predictions are mostly right (the digits labels are not in the CSV: compare with them)
    from lit_template.data import DigitsDataModule

    dm = DigitsDataModule()
    dm.setup()
    labels = dm.data_test.tensors[1].tolist()
    assert sum(int(r["prediction"]) == y for r, y in zip(rows, labels, strict=True)) / DIGITS_TEST > 0.8

    ddp = run_script(
        "predict.py", f"ckpt_path={mlp_checkpoint}", "trainer=ddp_cpu", log_dir=tmp_path / "ddp", timeout=240
    )
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in ddp.output
    ddp_rows = predictions(ddp)
    assert_classifier_csv(ddp_rows, DIGITS_TEST)  # 180 + 179 samples gathered: none twice, none lost
    for a, b in zip(rows, ddp_rows, strict=True):
        assert a["prediction"] == b["prediction"]
        for c in range(10):
            assert float(a[f"score_{c}"]) == pytest.approx(float(b[f"score_{c}"]), abs=1e-6)


@pytest.mark.slow
def test_predict_other_split_and_a_checkpoint_of_another_model(mlp_checkpoint, tmp_path):
    val = run_script("predict.py", f"ckpt_path={mlp_checkpoint}", "split=val", log_dir=tmp_path / "val", timeout=180)
    assert_classifier_csv(predictions(val), 143)  # int((1797 - 359) * 0.1)
    wrong = run_script(
        "predict.py", f"ckpt_path={mlp_checkpoint}", "model=cnn", log_dir=tmp_path / "wrong", check=False, timeout=180
    )
    assert wrong.returncode == 2 and "Traceback" not in wrong.output, wrong.output[-3000:]
    # eval's message, word for word
    assert (
        f"error: ckpt_path={mlp_checkpoint}: the checkpoint's weights do not fit this config (model=cnn data=digits); "
        "it was trained with model=mlp data=digits: add those overrides" in wrong.output
    )


@pytest.mark.slow
def test_predict_gpt_writes_generated_text(tmp_path):
    from gpt_support import TINY, steps

    from lit_template.data.text import TextDataModule

    small = [o for o in TINY if not o.startswith("data.max_bytes=")] + ["data.max_bytes=100000"]
    trained = run_script("train.py", *small, *steps(3), log_dir=tmp_path / "train", timeout=240)
    ckpt = trained.run_dir() / "checkpoints" / "last.ckpt"
    model_data = [o for o in small if o.split("=")[0].split(".")[0] in ("model", "data")]
    run = run_script(
        "predict.py",
        f"ckpt_path={ckpt}",
        *model_data,
        "generate.prompt_bytes=8",
        "generate.max_new_tokens=4",
        log_dir=tmp_path / "predict",
        timeout=240,
    )
    dm = TextDataModule(max_bytes=100000, block_size=32)
    dm.setup()
    rows = predictions(run)
    assert len(rows) == len(dm.data_test) > 100
    assert [int(r["index"]) for r in rows] == list(range(len(rows)))
    assert set(rows[0]) >= {"index", "text"}
    # the text continues each window: greedy bytes, 4 of them (a multi-byte character may decode to fewer chars)
    assert all(1 <= len(r["text"]) <= 4 for r in rows)
    first = bytes(dm.data_test[0][0][:8].tolist()).decode("utf-8", errors="replace")
    assert rows[0]["prompt"] == first
