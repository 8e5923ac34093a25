"""Checkpoints written so that a crash during a save never leaves a half-written file under the final name.

The checkpoint goes to a temp file in the same folder (``.<name>.<pid>.tmp``), is flushed and fsynced, and only then
renamed over the target with ``os.replace`` (atomic on POSIX); the folder is fsynced so the rename survives a power
cut. A process killed mid-save leaves the previous ``last.ckpt`` intact and at most a ``*.tmp`` file, which neither
``ckpt_path=last`` nor ``ckpt_path=auto`` ever picks. Remote paths (``s3://``...) go through Lightning's writer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

TMP_SUFFIX = ".tmp"


class AtomicCheckpointIO(TorchCheckpointIO):
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

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        # safe loading unless the caller asks otherwise: tensors and plain values only, no code runs on load
        return super().load_checkpoint(path, map_location=map_location,
                                       weights_only=True if weights_only is None else weights_only)


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
