"""The datamodules' loading code, on tiny files the test writes in torchvision's own on-disk format."""

from __future__ import annotations

import hashlib
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
