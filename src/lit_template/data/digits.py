"""scikit-learn's bundled 8x8 handwritten digits: the default data, embedded, no network."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import ConcatDataset, TensorDataset

from lit_template.data.base import ImageDataModule


class DigitsDataModule(ImageDataModule):
    """1,797 grey 8x8 images of the digits 0-9 shipped inside scikit-learn; test is a fixed ``test_fraction``."""

    name = "digits"
    dataset_num_classes = 10
    dataset_input_shape = (1, 8, 8)

    def __init__(self, test_fraction: float = 0.2, train_repeat: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.test_fraction = test_fraction
        # the training split seen this many times per epoch: longer epochs for benchmarks, same data
        self.train_repeat = train_repeat

    def setup(self, stage: str | None = None) -> None:
        if self.data_train is not None:
            return
        from sklearn.datasets import load_digits

        digits = load_digits()
        # Pixel values are 0..16; scale to [0, 1] and centre like the torchvision datasets' Normalize would.
        x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        x = (x - 0.5) / 0.5
        y = torch.tensor(digits.target, dtype=torch.long)
        generator = torch.Generator().manual_seed(self.hparams.split_seed)
        order = torch.randperm(len(y), generator=generator)
        n_test = int(len(y) * self.test_fraction)
        test_idx, rest_idx = order[:n_test], order[n_test:]
        self.data_test = TensorDataset(x[test_idx], y[test_idx])
        self.data_train, self.data_val = self.split_train_val(TensorDataset(x[rest_idx], y[rest_idx]))
        if self.train_repeat > 1:
            self.data_train = ConcatDataset([self.data_train] * self.train_repeat)
