"""What every image-classification DataModule here shares: split sizes, loaders, and the shape it declares."""

from __future__ import annotations

import os
from collections.abc import Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Subset, random_split

from lit_template.data.sampling import EvalSampler, ResumableDataLoader, ResumableSampler
from lit_template.errors import ConfigError


class ImageDataModule(L.LightningDataModule):
    """Subclasses set ``name``, ``num_classes``, ``input_shape`` and fill ``data_train/val/test`` in ``setup``.

    ``num_classes`` and ``input_shape`` are also constructor arguments so the model yaml can read them as
    ``${data.num_classes}``; a value that does not match the dataset is a config error, not a silent reshape.
    """

    name: str = "dataset"
    dataset_num_classes: int = 0
    dataset_input_shape: tuple[int, ...] = ()

    def __init__(
        self,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        num_classes: int | None = None,
        input_shape: Sequence[int] | None = None,
        val_fraction: float = 0.1,
        split_seed: int = 42,
        global_batch_size: int | None = None,
        num_folds: int | None = None,
        fold: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(logger=False)
        # Plain values, not OmegaConf lists, so checkpoints load with torch.load(weights_only=True).
        if input_shape is not None:
            self.hparams.input_shape = tuple(int(v) for v in input_shape)
        if batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be between 0 and 1, got {val_fraction}")
        if global_batch_size is not None and global_batch_size < 1:
            raise ConfigError(
                f"data.global_batch_size must be >= 1 (or null: data.batch_size per device), got {global_batch_size}"
            )
        if num_folds is not None and (num_folds < 2 or not 0 <= fold < num_folds):
            raise ConfigError(
                f"data.num_folds={num_folds}, data.fold={fold}: use num_folds >= 2 and "
                f"0 <= fold < num_folds (or num_folds=null for the val_fraction split)"
            )
        # per device: data.batch_size, or data.global_batch_size divided over the ranks (set in setup)
        self.batch_size_per_device = batch_size
        self._batch_size_set = False
        if num_classes is not None and num_classes != self.dataset_num_classes:
            raise ConfigError(f"data.num_classes={num_classes} but {self.name} has {self.dataset_num_classes} classes")
        if input_shape is not None and tuple(input_shape) != tuple(self.dataset_input_shape):
            raise ConfigError(
                f"data.input_shape={list(input_shape)} but {self.name} images are {list(self.dataset_input_shape)}"
            )
        self.data_train: Dataset | None = None
        self.data_val: Dataset | None = None
        self.data_test: Dataset | None = None

    @property
    def num_classes(self) -> int:
        return self.dataset_num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.dataset_input_shape

    def setup_batch_size(self) -> None:
        """``data.global_batch_size``: the batch of one optimizer step over every data-parallel rank and accumulated
        micro-batch, divided into the per-device ``batch_size_per_device`` (logged as a hyperparameter). The
        data-parallel ranks are the strategy's sampler replicas: every rank under DDP, ``data_parallel_size`` under
        tensor parallelism (tensor-parallel peers share one batch)."""
        total = self.hparams.global_batch_size
        if total is None or self.trainer is None or self._batch_size_set:
            return
        self._batch_size_set = True
        accumulate = int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1)
        replicas = int((self.trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1))
        parts = replicas * accumulate
        if total % parts:
            raise ConfigError(
                f"data.global_batch_size={total} does not divide over {replicas} data-parallel rank(s) x "
                f"trainer.accumulate_grad_batches={accumulate}: use a multiple of {parts}"
            )
        self.batch_size_per_device = total // parts
        for logger in self.trainer.loggers:
            logger.log_hyperparams(
                {"data/batch_size_per_device": self.batch_size_per_device, "data/global_batch_size": total}
            )

    def split_train_val(self, full: Dataset) -> tuple[Dataset, Dataset]:
        """The same split on every rank and every run: a fixed generator, not the global seed. With
        ``num_folds``, the validation set is fold ``fold`` of a fixed permutation (k-fold cross-validation: sweep
        ``-m data.fold=0,1,2,3,4``; the test split is not part of it)."""
        if self.hparams.num_folds is not None:
            k, fold = self.hparams.num_folds, self.hparams.fold
            if len(full) < k:
                raise ConfigError(f"data.num_folds={k} is more than the {len(full)} training samples")
            order = torch.randperm(len(full), generator=torch.Generator().manual_seed(self.hparams.split_seed))
            folds = order.tensor_split(k)
            val_idx = folds[fold].tolist()
            train_idx = torch.cat([f for i, f in enumerate(folds) if i != fold]).tolist()
            return Subset(full, train_idx), Subset(full, val_idx)
        n_val = max(1, int(len(full) * self.hparams.val_fraction))
        generator = torch.Generator().manual_seed(self.hparams.split_seed)
        train, val = random_split(full, [len(full) - n_val, n_val], generator=generator)
        return train, val

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        assert dataset is not None, "setup() must run before the loaders are asked for"
        self.setup_batch_size()
        options = dict(
            batch_size=self.batch_size_per_device,
            num_workers=self.hparams.num_workers,
            pin_memory=self.hparams.pin_memory,
            persistent_workers=self.hparams.num_workers > 0,
        )
        shard = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        if not shuffle:
            # validation/test under DDP: every sample once across the ranks (Lightning's sampler would pad)
            if shard.get("num_replicas", 1) > 1:
                return DataLoader(
                    dataset, sampler=EvalSampler(dataset, shard["num_replicas"], shard["rank"]), **options
                )
            return DataLoader(dataset, **options)
        # the seed of seed_everything (train.yaml `seed`), else the split seed; sharded by the data-parallel rank
        seed = int(os.environ.get("PL_GLOBAL_SEED", self.hparams.split_seed))
        sampler = ResumableSampler(
            dataset, num_replicas=shard.get("num_replicas", 1), rank=shard.get("rank", 0), shuffle=True, seed=seed
        )
        return ResumableDataLoader(dataset, sampler=sampler, **options)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.data_train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.data_val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.data_test, shuffle=False)
