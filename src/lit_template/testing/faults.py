"""Fault injection: make one rank misbehave at one step, to prove the checks catch it.

Used by the tests through ``python train.py +callbacks.fault=...`` and useful to anyone who wants to see what the
template reports before it happens for real. Never on by default. Example:

    python train.py trainer=ddp_cpu +callbacks.fault._target_=lit_template.testing.faults.FaultInjection \
        +callbacks.fault.action=perturb_param +callbacks.fault.rank=1 +callbacks.fault.step=3

``step`` is ``trainer.global_step`` (optimizer steps done) when the hook fires.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import lightning as L
import torch

from lit_template.distributed.shards import local as local_shard
from lit_template.errors import ConfigError

# action -> the loop event it happens at
ACTIONS = {
    "sleep": "batch_start",  # sleep `seconds` (a straggler; with every_step, at every step from `step` on)
    "hang": "batch_start",  # sleep forever: alive but stuck
    "raise": "batch_start",  # raise RuntimeError
    "kill": "batch_start",  # SIGKILL this process
    # send this process `signal` (SIGUSR1, SIGTERM: what a scheduler sends before it stops a job)
    "signal": "batch_start",
    "nan_loss": "batch_start",  # the next loss becomes NaN (inputs scaled by NaN)
    "perturb_grad": "after_backward",  # add `amount` to one gradient after the all-reduce
    "nan_grad": "after_backward",  # one gradient element becomes NaN after the all-reduce
    "perturb_param": "batch_end",  # add `amount` to one parameter after the optimizer step
    "flip_bit_param": "batch_end",  # flip the lowest bit of one element of one parameter (one ulp)
    "perturb_buffer": "batch_end",  # add `amount` to one buffer (BatchNorm running stats)
    "slow_validation": "validation_start",  # sleep `seconds` at validation start
    "slow_checkpoint": "save_checkpoint",  # sleep `seconds` while a checkpoint is saved
}


class FaultInjection(L.Callback):
    def __init__(
        self,
        action: str,
        rank: int = 1,
        step: int = 2,
        target: str | None = None,
        amount: float = 1e-3,
        seconds: float = 1.0,
        every_step: bool = False,
        signal: str = "SIGTERM",
    ) -> None:
        if action not in ACTIONS:
            raise ConfigError(f"callbacks.fault.action={action!r}: choose one of {', '.join(ACTIONS)}")
        self.action, self.rank, self.step, self.target = action, rank, step, target
        self.amount, self.seconds, self.every_step = amount, seconds, every_step
        self.signal = signal
        self.fired = 0

    # -- when -----------------------------------------------------------------------------------------------------
    def _due(self, trainer: L.Trainer, event: str) -> bool:
        if ACTIONS[self.action] != event or trainer.global_rank != self.rank or trainer.sanity_checking:
            return False
        if self.every_step:
            return trainer.global_step >= self.step
        return trainer.global_step == self.step and self.fired == 0

    def _tensor(self, pl_module: L.LightningModule, kind: str) -> tuple[str, torch.Tensor]:
        named = dict(pl_module.named_parameters() if kind == "param" else pl_module.named_buffers())
        if kind == "buffer":
            named = {k: v for k, v in named.items() if v.is_floating_point()}
        if not named:
            raise ConfigError(f"callbacks.fault.action={self.action}: the model has no {kind}s")
        name = self.target or next(iter(named))
        if name not in named:
            raise ConfigError(
                f"callbacks.fault.target={name!r} is not a {kind} of the model; some are: {', '.join(list(named)[:8])}"
            )
        return name, named[name]

    # -- what -----------------------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._due(trainer, "batch_start"):
            return
        self.fired += 1
        if self.action == "sleep":
            time.sleep(self.seconds)
        elif self.action == "hang":
            stuck_forever()
        elif self.action == "raise":
            raise RuntimeError(f"fault injection: rank {trainer.global_rank} raised at step {trainer.global_step}")
        elif self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "signal":
            os.kill(os.getpid(), signal.Signals[self.signal])
        elif self.action == "nan_loss":
            batch[0].mul_(float("nan"))

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._due(trainer, "after_backward"):
            return
        _, param = self._tensor(pl_module, "param")
        if param.grad is None:
            return
        self.fired += 1
        grad = local_shard(param.grad)  # a DTensor's own shard: an op on the DTensor could be a collective
        with torch.no_grad():
            if self.action == "perturb_grad":
                grad.view(-1)[0] += self.amount
            else:
                grad.view(-1)[0] = float("nan")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._due(trainer, "batch_end"):
            return
        self.fired += 1
        kind = "buffer" if self.action == "perturb_buffer" else "param"
        _, tensor = self._tensor(pl_module, kind)
        tensor = local_shard(tensor)
        with torch.no_grad():
            if self.action == "flip_bit_param":
                flip_lowest_bit(tensor)
            else:
                tensor.view(-1)[0] += self.amount

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._due(trainer, "validation_start"):
            self.fired += 1
            time.sleep(self.seconds)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self._due(trainer, "save_checkpoint"):
            self.fired += 1
            time.sleep(self.seconds)


def stuck_forever() -> None:
    """Alive but making no progress, as a deadlocked loader or an endless loop would be."""
    while True:
        time.sleep(0.5)


def flip_lowest_bit(tensor: torch.Tensor) -> None:
    """Flip the least significant bit of the first element in place: the smallest change a value can have."""
    flat = tensor.detach().view(-1)
    int_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[flat.element_size()]
    bits = flat[:1].view(int_dtype)
    bits ^= 1
