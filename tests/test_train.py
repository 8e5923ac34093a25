"""The README's commands, run as a user runs them: python train.py / eval.py with the shipped configs."""

from __future__ import annotations

import pytest
import torch

FAST = [
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=5",
    "trainer.limit_val_batches=2",
    "trainer.limit_test_batches=2",
]


@pytest.mark.parametrize("model", ["mlp", "cnn", "resnet18"])
def test_fast_dev_run_for_each_model(train, model):
    run = train(f"model={model}", "debug=fdr", timeout=180)
    assert "test/acc" in run.output
    # fast_dev_run writes no checkpoints and no logs
    assert not list(run.log_dir.glob("**/*.ckpt"))


@pytest.mark.slow
def test_default_training_on_digits_reaches_stated_accuracy(train):
    # README: `make train` (`python train.py`, nothing else: MLP, up to 10 epochs) tests the best checkpoint at about
    # 99% accuracy on digits; this asserts >= 97%
    run = train(timeout=240)
    run_dir = run.run_dir()
    test_acc = run.last_value("test/acc")
    assert test_acc >= 0.97, f"test/acc={test_acc}"
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert len(list((run_dir / "checkpoints").glob("epoch_*.ckpt"))) == 1  # best only
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert (run_dir / "config_tree.log").read_text().startswith("CONFIG")
    assert "val/acc_best =" in run.output  # the optimized metric train.py returns


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_ddp_cpu_two_processes_one_output_dir_one_set_of_checkpoints(train):
    run = train("trainer=ddp_cpu", "trainer.max_epochs=2", timeout=280)
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in run.output
    run_dir = run.run_dir()  # exactly one run dir for both ranks
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    assert ckpts == ["epoch_001.ckpt", "last.ckpt"]
    # Hydra's config saved once; no per-rank output dirs or per-rank config copies
    assert len(list(run.log_dir.glob("**/.hydra"))) == 1
    assert len(list(run.log_dir.glob("**/metrics.csv"))) == 1
    assert [p.name for p in run_dir.glob("*.log") if p.name != "config_tree.log"] == ["train.log"]
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)
    # 1295 training images / (2 ranks x 64 per batch) = 11 steps per epoch
    assert ckpt["global_step"] == 2 * 11
    assert run.last_value("test/acc") > 0.8


@pytest.mark.slow
def test_resume_from_last_ckpt_continues_the_run(train, tmp_path):
    first = train("trainer.max_epochs=2", "test=false", timeout=180)
    last = first.run_dir() / "checkpoints" / "last.ckpt"
    step_after_2 = torch.load(last, weights_only=True)["global_step"]
    second = train("trainer.max_epochs=3", "test=false", f"ckpt_path={last}", timeout=180, log_dir=tmp_path / "logs2")
    resumed = torch.load(second.run_dir() / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["epoch"] == 2 and resumed["global_step"] == step_after_2 * 3 // 2
    epochs = {r["epoch"] for r in second.metrics() if r.get("train/loss")}
    assert epochs == {"2"}, f"the resumed run trained epochs {epochs}, expected only the third (2)"


@pytest.mark.slow
def test_ckpt_path_last_finds_the_newest_run_of_the_task(train):
    train("trainer.max_epochs=1", "test=false", timeout=180)
    run = train("trainer.max_epochs=2", "test=false", "ckpt_path=last", timeout=180)
    assert "resuming from" in run.output and "last.ckpt" in run.output
    newest = max(run.run_dirs(), key=lambda p: p.name)
    assert torch.load(newest / "checkpoints" / "last.ckpt", weights_only=True)["epoch"] == 1


@pytest.mark.slow
def test_eval_tests_a_checkpoint(train, evaluate):
    trained = train("trainer.max_epochs=2", "test=false", timeout=180)
    ckpt = trained.run_dir() / "checkpoints" / "last.ckpt"
    run = evaluate(f"ckpt_path={ckpt}", timeout=180)
    assert run.last_value("test/acc", task="eval") > 0.8
    assert f"testing {ckpt}" in run.output
    # another model config than the checkpoint's: one line naming what it was trained with
    wrong = evaluate(f"ckpt_path={ckpt}", "model=cnn", check=False, timeout=180)
    assert wrong.returncode == 2 and "Traceback" not in wrong.output, wrong.output[-3000:]
    assert (
        "the checkpoint's weights do not fit this config (model=cnn data=digits); it was trained with model=mlp "
        "data=digits" in wrong.output
    )


def test_experiment_config_runs(train):
    run = train("experiment=digits_cnn", *FAST, "test=false", timeout=180)
    assert "SmallCNN" in run.output


def test_training_metrics_per_epoch_equal_torchmetrics_updated_every_step(tmp_path):
    """The LitClassifier keeps per-step sums and feeds them to weighted means at epoch end (no torchmetrics update per
    step): the logged train/loss and train/acc are what updating MeanMetric and MulticlassAccuracy every step gives."""
    import hydra
    import lightning as L
    from conftest import ROOT
    from hydra import compose, initialize_config_dir
    from torchmetrics import MeanMetric
    from torchmetrics.classification import MulticlassAccuracy

    from lit_template.models import LitClassifier

    class Checked(LitClassifier):
        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            self.ref_loss, self.ref_acc = MeanMetric(), MulticlassAccuracy(num_classes=10, average="micro")
            self.compared: list[tuple[float, float, float, float]] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            x, y = batch
            self.ref_loss.update(loss.detach())
            with torch.no_grad():
                self.ref_acc.update(self.net(x).argmax(dim=1), y)  # the same weights and batch (dropout off below)
            return loss

        def on_train_epoch_end(self) -> None:
            super().on_train_epoch_end()
            logged = self.trainer.callback_metrics
            self.compared.append(
                (
                    float(logged["train/loss"]),
                    float(self.ref_loss.compute()),
                    float(logged["train/acc"]),
                    float(self.ref_acc.compute()),
                )
            )
            self.ref_loss.reset()
            self.ref_acc.reset()

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["model.net.dropout=0.0", "data.batch_size=100"])
    dm = hydra.utils.instantiate(cfg.data)
    model = Checked(
        **{
            k: hydra.utils.instantiate(v) if k in ("net", "optimizer", "scheduler") else v
            for k, v in cfg.model.items()
            if k != "_target_"
        }
    )
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        limit_train_batches=7,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert len(model.compared) == 2
    for loss, ref_loss, acc, ref_acc in model.compared:
        assert loss == pytest.approx(ref_loss, rel=1e-6) and 0 < acc < 1
        assert acc == pytest.approx(ref_acc, rel=1e-6), model.compared
