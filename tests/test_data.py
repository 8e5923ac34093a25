"""The datamodules' loading code, on tiny files the test writes in torchvision's own on-disk format."""

from __future__ import annotations

import hashlib
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_template.data import CIFAR10DataModule, DigitsDataModule, MNISTDataModule
from lit_template.errors import ConfigError


def write_mnist(root: Path, n_train: int = 64, n_test: int = 32) -> None:
    """The four idx files torchvision.datasets.MNIST reads from <root>/MNIST/raw."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = (np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 50, size=(n, 28, 28), dtype=np.uint8)
        images[np.arange(n), labels * 2 + 4, :] = 255  # a learnable stripe per class
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + labels.tobytes())


def write_cifar10(root: Path, per_batch: int = 10) -> dict[str, str]:
    """cifar-10-batches-py as torchvision.datasets.CIFAR10 reads it; returns each file's md5."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    md5 = {}
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    for name in names:
        entry = {
            "data": rng.integers(0, 255, size=(per_batch, 3072), dtype=np.uint8),
            "labels": [int(v) for v in np.arange(per_batch) % 10],
        }
        (folder / name).write_bytes(pickle.dumps(entry))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))
    for path in folder.iterdir():
        md5[path.name] = hashlib.md5(path.read_bytes()).hexdigest()
    return md5


def test_digits_split_is_fixed_and_disjoint():
    a, b = DigitsDataModule(), DigitsDataModule()
    a.setup(), b.setup()
    assert (len(a.data_train), len(a.data_val), len(a.data_test)) == (1295, 143, 359)
    assert a.data_train.indices == b.data_train.indices  # the same split on every rank
    x, y = next(iter(a.train_dataloader()))
    assert x.shape == (64, 1, 8, 8) and x.dtype == torch.float32 and x.min() >= -1.0 and x.max() <= 1.0
    assert y.dtype == torch.long


def test_mnist_loads_torchvision_files(tmp_path):
    write_mnist(tmp_path)
    dm = MNISTDataModule(data_dir=str(tmp_path), batch_size=8, val_fraction=0.25)
    dm.prepare_data()  # download=false: touches nothing
    dm.setup("fit")
    assert (len(dm.data_train), len(dm.data_val), len(dm.data_test)) == (48, 16, 32)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (8, 1, 28, 28) and y.max() < 10


def test_mnist_missing_without_download_names_the_options(tmp_path):
    dm = MNISTDataModule(data_dir=str(tmp_path / "empty"), download=False)
    with pytest.raises(ConfigError, match=r"data\.data_dir=.*data\.download=false.*data\.download=true"):
        dm.setup("fit")


def test_cifar10_loads_torchvision_files(tmp_path, monkeypatch):
    import torchvision

    md5 = write_cifar10(tmp_path)
    cls = torchvision.datasets.CIFAR10
    # torchvision checks each file's md5 against the real dataset's; point it at the tiny files' sums instead
    monkeypatch.setattr(cls, "train_list", [[f"data_batch_{i}", md5[f"data_batch_{i}"]] for i in range(1, 6)])
    monkeypatch.setattr(cls, "test_list", [["test_batch", md5["test_batch"]]])
    monkeypatch.setattr(cls, "meta", {**cls.meta, "md5": md5["batches.meta"]})
    dm = CIFAR10DataModule(data_dir=str(tmp_path), batch_size=5, num_workers=0, pin_memory=False, val_fraction=0.2)
    dm.setup("fit")
    assert (len(dm.data_train), len(dm.data_val), len(dm.data_test)) == (40, 10, 10)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (5, 3, 32, 32) and y.dtype == torch.long


@pytest.mark.slow
def test_train_py_on_mnist_files(train, tmp_path):
    write_mnist(tmp_path / "data", n_train=256, n_test=64)
    run = train(
        "data=mnist",
        f"data.data_dir={tmp_path / 'data'}",
        "data.num_workers=0",
        "data.pin_memory=false",
        "data.batch_size=32",
        "model=mlp",
        "trainer.max_epochs=2",
        timeout=240,
    )
    # the class is the stripe's row: easy for the MLP, which sees positions (the CNN's global pooling mostly does not);
    # chance is 0.1
    assert run.last_value("test/acc") >= 0.5


# -- every sample once under DDP, global batch size, k-fold ---------------------------------------------------------
@pytest.mark.parametrize("n, world", [(359, 2), (10, 3), (5, 4), (1, 2)])
def test_eval_sampler_gives_every_sample_to_exactly_one_rank(n, world):
    from lit_template.data.sampling import EvalSampler

    shards = [list(EvalSampler(list(range(n)), world, rank)) for rank in range(world)]
    assert sorted(i for shard in shards for i in shard) == list(range(n))  # no sample twice, none left out
    assert [len(EvalSampler(list(range(n)), world, r)) for r in range(world)] == [len(s) for s in shards]


def test_k_folds_partition_the_training_pool_and_leave_the_test_split_alone():
    vals, tests = [], []
    for fold in range(3):
        dm = DigitsDataModule(num_folds=3, fold=fold)
        dm.setup()
        vals.append({tuple(x.flatten().tolist()) for x, _ in dm.data_val})
        train = {tuple(x.flatten().tolist()) for x, _ in dm.data_train}
        assert not train & vals[-1]
        tests.append(len(dm.data_test))
    assert not (vals[0] & vals[1] or vals[0] & vals[2] or vals[1] & vals[2])
    plain = DigitsDataModule()
    plain.setup()
    assert len(set().union(*vals)) == len(plain.data_train) + len(plain.data_val)  # the folds cover the pool
    assert tests == [len(plain.data_test)] * 3
    with pytest.raises(ConfigError, match=r"data\.num_folds=3, data\.fold=3"):
        DigitsDataModule(num_folds=3, fold=3)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_ddp_test_counts_every_sample_once_and_matches_one_process(train, evaluate, tmp_path):
    # the digits test split has 359 samples: not divisible by 2 ranks (Lightning's sampler would pad one)
    trained = train("trainer.max_epochs=1", "test=false", "extras.print_config=false", timeout=180)
    ckpt = trained.run_dir() / "checkpoints" / "last.ckpt"
    one = evaluate(f"ckpt_path={ckpt}", log_dir=tmp_path / "one", timeout=180)
    two = evaluate(f"ckpt_path={ckpt}", "trainer=ddp_cpu", log_dir=tmp_path / "two", timeout=180)
    assert "replicates some samples" not in two.output  # Lightning's warning for its padded sampler
    assert one.last_value("test/acc", task="eval") == two.last_value("test/acc", task="eval")


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_global_batch_size_is_divided_over_the_ranks_and_logged(train):
    run = train(
        "trainer=ddp_cpu",
        "data.global_batch_size=128",
        "trainer.max_epochs=1",
        "test=false",
        "extras.print_config=false",
        timeout=200,
    )
    hparams = (run.run_dir() / "csv" / "version_0" / "hparams.yaml").read_text()
    assert "data/batch_size_per_device: 64" in hparams and "data/global_batch_size: 128" in hparams
    # 1,294 training samples, 647 per rank, in batches of 64: 11 steps
    ckpt = torch.load(run.run_dir() / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 11, ckpt["global_step"]
    bad = train("trainer=ddp_cpu", "data.global_batch_size=127", timeout=200, check=False)
    assert bad.returncode == 2, bad.output[-3000:]
    assert "data.global_batch_size=127 does not divide over 2 data-parallel rank(s)" in bad.output


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_k_fold_sweep_reports_the_mean_and_std_over_folds(train):
    run = train(
        "-m",
        "data.num_folds=3",
        "data.fold=0,1,2",
        "trainer.max_epochs=2",
        "test=false",
        "extras.print_config=false",
        "callbacks.rich_progress_bar=null",
        timeout=380,
    )
    (sweep,) = (run.log_dir / "train" / "multiruns").iterdir()
    summary = json.loads((sweep / "summary.json").read_text())
    (group,) = summary["folds"]
    values = [j["value"] for j in summary["jobs"]]
    assert group["folds"] == ["0", "1", "2"] and group["n"] == 3
    assert group["mean"] == pytest.approx(sum(values) / 3)
    assert group["std"] == pytest.approx(float(np.std(values, ddof=1)))
    assert "k-fold: data.num_folds=3" not in run.output  # shared overrides are not what the folds differ in
    assert f"k-fold: all jobs: val/acc_best = {group['mean']:.6g}" in run.output
