"""Where checkpoints are written, found and loaded: one module.

- Written (:class:`AtomicCheckpointIO`, the trainer's checkpoint plugin): to a temp file in the same folder
  (``.<name>.<pid>.tmp``), flushed and fsynced, then renamed over the target with ``os.replace`` (atomic on POSIX),
  and the folder fsynced; a process killed mid-save leaves the previous file intact and at most a ``*.tmp`` file,
  which no resume path ever picks. Remote paths (``s3://``...) go through Lightning's writer. Which files are written
  when: ``callbacks/last_checkpoint.py`` (``last.ckpt``) and ``conf/callbacks/model_checkpoint.yaml`` (the best).
- Found (:func:`resolve_ckpt_path`): ``ckpt_path=last``, ``auto``, a path, or null.
- Loaded safely (:func:`check_checkpoint`): ``torch.load(weights_only=True)``, and a Lightning checkpoint, before
  Lightning tries to; a checkpoint that does not fit the model config is one line naming what it was trained with
  (:func:`load_mismatch`).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from omegaconf import DictConfig

from lit_template.errors import ConfigError

LAST = "last.ckpt"
SHARDED_META = "meta.pt"  # what Lightning's ModelParallelStrategy writes beside the shards of a distributed checkpoint


def is_sharded(path: Path) -> bool:
    """A distributed (sharded) checkpoint folder as ``trainer=fsdp2``/``model_parallel`` write it: the shards, torch's
    ``.metadata`` (written after every shard) and Lightning's ``meta.pt`` (written last)."""
    return path.is_dir() and (path / ".metadata").is_file() and (path / SHARDED_META).is_file()


def exists(path: Path) -> bool:
    """A checkpoint file or a sharded checkpoint folder."""
    return path.is_file() or is_sharded(path)


def resolve_ckpt_path(cfg: DictConfig, option: str = "ckpt_path") -> str | None:
    """``null`` → None; ``last`` → this run dir's last.ckpt, else the newest last.ckpt among earlier runs of the same
    task; ``auto`` → this run dir's last.ckpt if it exists, else None (start fresh); anything else must be an
    existing file or sharded checkpoint folder. Whatever is found must load with ``torch.load(weights_only=True)``
    and hold a ``state_dict`` (a sharded folder: its ``meta.pt``)."""
    value = cfg.get(option)
    if value in (None, ""):
        return None
    own = Path(cfg.paths.output_dir) / "checkpoints" / LAST
    if value == "auto":
        # a torchrun restart with a fixed LT_RUN_ID finds the first attempt's last.ckpt; a first start has none
        return check_checkpoint(own, option, value) if exists(own) else None
    if value == "last":
        if exists(own):
            return check_checkpoint(own, option, value)
        # eval looks among the train task's runs (conf/eval.yaml sets ckpt_search_task)
        runs = Path(cfg.paths.log_dir) / str(cfg.get("ckpt_search_task") or cfg.task_name)
        found = [p for p in runs.glob(f"**/checkpoints/{LAST}") if exists(p)]
        candidates = sorted(found, key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise ConfigError(
                f"{option}=last but there is no last.ckpt in {own.parent} nor under {runs}: "
                f"give {option}=/path/to/file.ckpt, or null to start fresh"
            )
        return check_checkpoint(candidates[-1], option, value)
    path = Path(str(value)).expanduser()
    if path.is_dir() and not is_sharded(path):
        raise ConfigError(
            f"{option}={value!r} is a folder but not a sharded checkpoint (no .metadata and {SHARDED_META} in it: a "
            "save that did not finish?): give a .ckpt file or a checkpoint folder written by trainer=fsdp2 or "
            "trainer=model_parallel"
        )
    if not exists(path):
        raise ConfigError(f"{option}={value!r} is not a file: give the path of a .ckpt, 'last' or 'auto'")
    return check_checkpoint(path.resolve(), option, value)


def check_checkpoint_callbacks(callbacks: list[Any]) -> None:
    """One writer per checkpoint file: a ``ModelCheckpoint(save_last=True)`` beside ``last_checkpoint`` in the same
    folder would overwrite ``last.ckpt`` with an older state whenever its metric improves."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lit_template.callbacks.last_checkpoint import LastCheckpoint

    owners = {str(cb.dirpath) for cb in callbacks if isinstance(cb, LastCheckpoint)}
    for cb in callbacks:
        if (
            isinstance(cb, ModelCheckpoint)
            and not isinstance(cb, LastCheckpoint)
            and cb.save_last
            and str(cb.dirpath) in owners
        ):
            raise ConfigError(
                f"a ModelCheckpoint (monitor={cb.monitor!r}) has save_last={cb.save_last!r} in "
                f"{cb.dirpath}, where callbacks.last_checkpoint writes {LAST}: set its save_last=false "
                "(last_checkpoint keeps last.ckpt current), or callbacks.last_checkpoint=null"
            )


def check_checkpoint(path: Path, option: str = "ckpt_path", value: object = None) -> str:
    """Open ``path`` the safe way (``weights_only=True``: tensors and plain values only, no code runs; ``mmap``: no
    tensor is read) and require a Lightning checkpoint dict. Returns the path as a string."""
    shown = f"{option}={value if value is not None else path}"
    if is_sharded(path):
        return _check_sharded(path, shown)
    if not zipfile.is_zipfile(path):
        # torch.save has written zip archives since torch 1.6; text, random bytes or a plain pickle are not one
        raise ConfigError(
            f"{shown}: {path} is not a checkpoint (not a torch.save zip archive: text, a plain pickle or a truncated "
            f"file?); give a .ckpt written by train.py, or null to start fresh"
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001  (torch raises many types for a file that is not its own)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "weights_only" in str(err) or "Weights only load failed" in str(err):
            reason = (
                "it holds objects other than tensors and plain values, which safe loading (weights_only=True) "
                "refuses to unpickle"
            )
        raise ConfigError(
            f"{shown}: {path} is not a checkpoint this template can load safely ({reason}); "
            f"give a .ckpt written by train.py, or null to start fresh"
        ) from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        found = (
            f"a dict with keys {sorted(map(str, checkpoint))[:6]}"
            if isinstance(checkpoint, dict)
            else type(checkpoint).__name__
        )
        raise ConfigError(
            f"{shown}: {path} is a torch file but not a Lightning checkpoint (no 'state_dict'; found {found}); "
            f"give a .ckpt written by train.py"
        )
    return str(path)


def _check_sharded(path: Path, shown: str) -> str:
    """A sharded checkpoint folder: its ``meta.pt`` (the loops' state, the callbacks', the hyperparameters) must load
    safely; the shards are read by the strategy that resumes (any world size: torch.distributed.checkpoint reshards)."""
    try:
        meta = torch.load(path / SHARDED_META, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{shown}: {path / SHARDED_META} does not load safely ({reason})") from None
    if not isinstance(meta, dict) or "global_step" not in meta:
        raise ConfigError(f"{shown}: {path} is a folder of shards but {SHARDED_META} is not Lightning's metadata")
    return str(path)


def trained_with(ckpt_path: str) -> dict[str, str]:
    """The config choices (model, data, ...) of the run that wrote ``ckpt_path``, read from that run's saved Hydra
    config (``<run dir>/.hydra/hydra.yaml``); empty when the checkpoint is not inside a run dir."""
    from omegaconf import OmegaConf

    hydra_yaml = Path(ckpt_path).resolve().parent.parent / ".hydra" / "hydra.yaml"
    if not hydra_yaml.is_file():
        return {}
    try:
        choices = OmegaConf.load(hydra_yaml).hydra.runtime.choices
        return {group: str(choices[group]) for group in ("model", "data") if choices.get(group) is not None}
    except Exception:  # noqa: BLE001  (an old or hand-edited file: the error below still names the options)
        return {}


def load_mismatch(cfg: DictConfig, ckpt_path: str, error: BaseException) -> ConfigError | None:
    """A checkpoint whose weights do not fit the model built from the config (another ``model=`` or ``data=``): a
    ConfigError that says which choices the checkpoint was trained with. None for any other error."""
    if "Error(s) in loading state_dict" not in str(error):
        return None
    from hydra.core.hydra_config import HydraConfig

    now = dict(HydraConfig.get().runtime.choices) if HydraConfig.initialized() else {}
    then = trained_with(ckpt_path)
    current = " ".join(f"{g}={now[g]}" for g in ("model", "data") if g in now)
    if then:
        fix = f"it was trained with {' '.join(f'{g}={v}' for g, v in then.items())}: add those overrides"
    else:
        fix = "pass the model=... and data=... (and any model.* overrides) the checkpoint was trained with"
    return ConfigError(f"ckpt_path={ckpt_path}: the checkpoint's weights do not fit this config ({current}); {fix}")


TMP_SUFFIX = ".tmp"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch.save writer, made atomic (see the module docstring), and safe loading by default."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if "://" in str(path) and not str(path).startswith("file://"):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint does not take storage_options")
        target = Path(str(path).removeprefix("file://"))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}{TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(target.parent)

    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        # safe loading unless the caller asks otherwise: tensors and plain values only, no code runs on load
        return super().load_checkpoint(
            path, map_location=map_location, weights_only=True if weights_only is None else weights_only
        )


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not fsync directories
    finally:
        os.close(fd)
