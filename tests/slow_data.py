"""Test-only data: the digits with a sleep in the training dataset's ``__getitem__``, a loader that makes the loop wait.

Used through the entry point: ``PYTHONPATH=tests python train.py data._target_=slow_data.SlowDigits
+data.sleep_s_per_item=0.001``.
"""

from __future__ import annotations

import time
from typing import Any

from torch.utils.data import Dataset

from lit_template.data import DigitsDataModule


class SleepyDataset(Dataset):
    def __init__(self, inner: Dataset, sleep_s_per_item: float) -> None:
        self.inner, self.sleep_s_per_item = inner, sleep_s_per_item

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        time.sleep(self.sleep_s_per_item)
        return self.inner[index]


class SlowDigits(DigitsDataModule):
    """The digits, with ``sleep_s_per_item`` seconds of sleep per training sample (validation and test as they are)."""

    def __init__(self, sleep_s_per_item: float = 0.001, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sleep_s_per_item = sleep_s_per_item

    def setup(self, stage: str | None = None) -> None:
        already = self.data_train is not None
        super().setup(stage)
        if not already:
            self.data_train = SleepyDataset(self.data_train, self.sleep_s_per_item)
