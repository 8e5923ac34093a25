"""The predict task: run a checkpoint's ``predict_step`` over one split and write one row per sample.

- Data: :class:`PredictData` wraps the configured datamodule and serves its ``data_<split>`` as
  ``{"index", "input", "target"}`` batches (:class:`IndexedDataset`: the sample's index in the split travels with it),
  sharded over the data-parallel ranks by :class:`~lit_template.data.sampling.EvalSampler`: every sample once, no
  padding.
- Output: :class:`PredictionWriter` (Lightning's ``BasePredictionWriter``) turns what ``predict_step`` returns into
  rows, gathers every rank's rows to global rank zero, which sorts them by index, checks each index appears once, and
  writes ``<run dir>/predictions.csv``. ``predict_step`` returns a dict: ``index`` (optional: else the indices
  Lightning's predict loop tracked), and columns, each a tensor ``[batch]``, a tensor ``[batch, k]`` (``k`` columns
  ``<name>_0..``; ``scores`` gives ``score_0..``) or a list of ``batch`` values (text); or a plain tensor
  (``prediction``).
- Errors: the checkpoint is found and checked like eval's (``ckpt_path``), and one whose weights do not fit the
  model config is the same one line (:func:`~lit_template.checkpoints.load_mismatch`).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

from lit_template.checkpoints import load_mismatch, resolve_ckpt_path
from lit_template.data.sampling import EvalSampler
from lit_template.errors import ConfigError
from lit_template.train import build, log
from lit_template.utils import task_wrapper
from lit_template.utils.rich_utils import print_config_tree

SPLITS = ("test", "val", "train")


class IndexedDataset(Dataset):
    """Sample ``i`` of ``dataset`` as ``{"index": i, "input": x, "target": y}`` (a sample ``(x, y)``, ``(x,)`` or
    ``x``; a dict sample keeps its keys and gains ``index``)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = self.dataset[i]
        if isinstance(sample, Mapping):
            return {**sample, "index": i}
        if isinstance(sample, (tuple, list)):
            item = {"index": i, "input": sample[0]}
            if len(sample) > 1:
                item["target"] = sample[1]
            return item
        return {"index": i, "input": sample}


class PredictData(L.LightningDataModule):
    """The configured datamodule's ``split`` as a predict loader: set up (and downloaded) by the datamodule itself,
    batched like its evaluation loaders, one shard per data-parallel rank (every sample once, in index order)."""

    def __init__(self, datamodule: L.LightningDataModule, split: str = "test") -> None:
        super().__init__()
        if split not in SPLITS:
            raise ConfigError(f"split={split!r}: choose one of {', '.join(SPLITS)}")
        self.datamodule, self.split = datamodule, split
        self.dataset: Dataset | None = None

    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    def setup(self, stage: str) -> None:
        # the datamodule reads the trainer (world size for global_batch_size, the model for data=text's checks)
        self.datamodule.trainer = self.trainer
        self.datamodule.setup(stage)
        dataset = getattr(self.datamodule, f"data_{self.split}", None)
        if dataset is None:
            raise ConfigError(
                f"split={self.split}: {type(self.datamodule).__name__} has no data_{self.split} after setup(); "
                f"choose one of {', '.join(s for s in SPLITS if getattr(self.datamodule, f'data_{s}', None))}"
            )
        self.dataset = dataset

    @property
    def num_samples(self) -> int:
        return len(self.dataset) if self.dataset is not None else 0  # type: ignore[arg-type]

    def predict_dataloader(self) -> DataLoader:
        assert self.dataset is not None, "setup() must run before the loader is asked for"
        inner, hp = self.datamodule, getattr(self.datamodule, "hparams", {})
        if hasattr(inner, "setup_batch_size"):
            inner.setup_batch_size()
        batch_size = int(getattr(inner, "batch_size_per_device", None) or hp.get("batch_size", 64))
        num_workers = int(hp.get("num_workers", 0) or 0)
        options = dict(
            batch_size=batch_size,
            num_workers=num_workers,
            pin_memory=bool(hp.get("pin_memory", False)),
            persistent_workers=num_workers > 0,
        )
        dataset = IndexedDataset(self.dataset)
        shard = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        if shard.get("num_replicas", 1) > 1:
            # a DistributedSampler: Lightning keeps it (and only wraps the batch sampler to track the indices)
            return DataLoader(dataset, sampler=EvalSampler(dataset, shard["num_replicas"], shard["rank"]), **options)
        return DataLoader(dataset, **options)

    def teardown(self, stage: str) -> None:
        self.datamodule.teardown(stage)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    return value


def prediction_rows(prediction: Any, batch_indices: Sequence[int] | None) -> list[dict[str, Any]]:
    """One dict per sample of what ``predict_step`` returned for a batch (see the module docstring)."""
    if isinstance(prediction, torch.Tensor):
        prediction = {"prediction": prediction}
    if not isinstance(prediction, Mapping):
        raise TypeError(
            f"predict_step returned a {type(prediction).__name__}: return a dict of columns (tensors [batch] or "
            "[batch, k], or lists of batch values), with the samples' 'index' if the batch has one"
        )
    index = prediction.get("index", batch_indices)
    if index is None or len(index) == 0:
        raise TypeError("predict_step returned no 'index' and the predict loop tracked no batch indices")
    index = [int(i) for i in (index.tolist() if isinstance(index, torch.Tensor) else index)]
    n = len(index)
    columns: dict[str, list[Any]] = {}
    for name, value in prediction.items():
        if name == "index":
            continue
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            if value.dim() == 0 or value.shape[0] != n or value.dim() > 2:
                raise TypeError(
                    f"predict_step's {name!r} has shape {list(value.shape)}: a column is [batch] or [batch, k] "
                    f"(batch={n})"
                )
            if value.dim() == 1:
                columns[name] = value.tolist()
            else:
                stem = name[:-1] if name.endswith("s") and len(name) > 1 else name
                for j in range(value.shape[1]):
                    columns[f"{stem}_{j}"] = value[:, j].tolist()
        elif isinstance(value, (list, tuple)) and len(value) == n:
            columns[name] = [_plain(v) for v in value]
        else:
            raise TypeError(f"predict_step's {name!r} is not a column of {n} values: {type(value).__name__}")
    return [{"index": i, **{name: col[r] for name, col in columns.items()}} for r, i in enumerate(index)]


def _cell(value: Any) -> Any:
    # float32 round-trips with 9 significant digits
    return format(value, ".9g") if isinstance(value, float) else value


class PredictionWriter(BasePredictionWriter):
    """Collects each batch's rows on its rank; at the end gathers them on global rank zero, which writes ``path``
    (CSV, sorted by index, every index once). ``written`` is the number of rows written (rank zero)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(write_interval="batch")
        self.path = Path(path)
        self.rows: list[dict[str, Any]] = []
        self.written = 0

    def on_predict_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.rows, self.written = [], 0

    def write_on_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        prediction: Any,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self.rows.extend(prediction_rows(prediction, batch_indices))

    def on_predict_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rows = self.gather(trainer, self.rows)
        failure: BaseException | None = None
        if trainer.is_global_zero:
            try:
                self.written = self.write(trainer, rows)
            except Exception as err:  # noqa: BLE001  (re-raised below, after the other ranks have heard of it)
                failure = err
        # every rank learns whether rank zero wrote the file, instead of waiting for it at a barrier
        message = trainer.strategy.broadcast(f"{type(failure).__name__}: {failure}" if failure else None, src=0)
        if failure is not None:
            raise failure
        if message:
            raise RuntimeError(f"global rank 0 could not write the predictions: {message}")

    @staticmethod
    def gather(trainer: L.Trainer, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every rank's rows on global rank zero (the others get an empty list)."""
        import torch.distributed as dist

        if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
            return rows
        parts: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(rows, parts, dst=0)
        return [row for part in parts or [] for row in part]

    def write(self, trainer: L.Trainer, rows: list[dict[str, Any]]) -> int:
        rows = sorted(rows, key=lambda r: r["index"])
        # ranks that share a batch (tensor-parallel peers) predict the same samples: keep one copy of each
        replicas = int((trainer.distributed_sampler_kwargs or {}).get("num_replicas", trainer.world_size) or 1)
        unique, seen, duplicated = [], set(), []
        for row in rows:
            if row["index"] in seen:
                duplicated.append(row["index"])
                continue
            seen.add(row["index"])
            unique.append(row)
        if duplicated and replicas == trainer.world_size:
            raise RuntimeError(f"predictions for the same sample came from several ranks: indices {duplicated[:10]}")
        expected = getattr(trainer.datamodule, "num_samples", None)
        if getattr(trainer, "limit_predict_batches", 1.0) not in (1.0, None):
            expected = None  # asked for part of the split: write what was predicted
        if expected is not None and [r["index"] for r in unique] != list(range(expected)):
            missing = sorted(set(range(expected)) - seen)
            raise RuntimeError(
                f"{len(unique)} predictions for {expected} samples (missing indices {missing[:10]}): a sample was "
                "dropped (a sampler with drop_last?)"
            )
        columns: list[str] = []
        for row in unique:
            columns.extend(k for k in row if k not in columns)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        with open(tmp, "w", newline="") as f:
            out = csv.DictWriter(f, fieldnames=columns)
            out.writeheader()
            for row in unique:
                out.writerow({k: _cell(v) for k, v in row.items()})
        os.replace(tmp, self.path)
        return len(unique)


def has_predict_step(model: L.LightningModule) -> bool:
    return type(model).predict_step is not L.LightningModule.predict_step


@task_wrapper
def run(cfg: DictConfig) -> dict[str, Any]:
    if OmegaConf.is_missing(cfg, "ckpt_path"):
        raise ConfigError("ckpt_path is required for predict: ckpt_path=/path/to/file.ckpt or ckpt_path=last")
    split = str(cfg.get("split") or "test")
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}: choose one of {', '.join(SPLITS)}")
    if cfg.get("extras", {}).get("print_config"):
        print_config_tree(cfg, save_to=f"{cfg.paths.output_dir}/config_tree.log")
    ckpt_path = resolve_ckpt_path(cfg)
    if ckpt_path is None:
        raise ConfigError("ckpt_path=null: predict needs ckpt_path=/path/to/file.ckpt or ckpt_path=last")
    objects = build(cfg)
    model, trainer = objects["model"], objects["trainer"]
    if not has_predict_step(model):
        raise ConfigError(
            f"model <{cfg.model._target_}> has no predict_step: add one that returns a dict of columns "
            "(see lit_template/predict.py)"
        )
    if hasattr(model, "generate") and cfg.get("generate") is not None:
        # read by the model's predict_step (model=gpt): how much of each sample is the prompt, how much to generate
        model.predict_options = OmegaConf.to_container(cfg.generate, resolve=True)
    path = Path(cfg.paths.output_dir) / str(cfg.get("output_file") or "predictions.csv")
    writer = PredictionWriter(path)
    trainer.callbacks.append(writer)
    datamodule = PredictData(objects["datamodule"], split)
    log.info(f"predicting the {split} split with {ckpt_path}")
    try:
        trainer.predict(model=model, datamodule=datamodule, ckpt_path=ckpt_path, return_predictions=False)
    except RuntimeError as err:
        if mismatch := load_mismatch(cfg, ckpt_path, err):
            raise mismatch from None
        raise
    if trainer.is_global_zero:
        log.info(f"wrote {writer.written} predictions ({split} split) to {path}")
    return {"predictions": str(path), "rows": writer.written}
