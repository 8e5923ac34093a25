"""Test-only faults for tests/test_reliability.py (on PYTHONPATH=tests)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning as L


class KillOnFirstAttempt(L.Callback):
    """SIGKILL rank ``rank`` at ``step``, only in torchrun's first attempt: the restart must run clean."""

    def __init__(self, rank: int = 1, step: int = 7) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (
            os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
            and trainer.global_rank == self.rank
            and trainer.global_step == self.step
        ):
            os.kill(os.getpid(), signal.SIGKILL)


def kill_during_save(ckpt: str) -> None:
    """Save a checkpoint over ``ckpt`` with AtomicCheckpointIO and SIGKILL this process mid-save, after the new bytes
    are written but before they are renamed into place (the window a crash would hit)."""
    import torch

    from lit_template import checkpoints as checkpoint_io

    def fsync_then_die(fd: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    checkpoint_io.os.fsync = fsync_then_die  # type: ignore[attr-defined]
    checkpoint_io.AtomicCheckpointIO().save_checkpoint(
        {"state_dict": {"w": torch.full((1000,), 7.0)}, "global_step": 999}, Path(ckpt)
    )


if __name__ == "__main__":
    kill_during_save(sys.argv[1])
