"""Catch a NaN/Inf loss or gradient on any rank, in the step it happens, on every rank at once.

Each rank notes whether its loss (``on_before_backward``) and its gradients (``on_before_optimizer_step``, after
DDP's all-reduce) are finite. Then every rank, at every optimizer step, all-gathers one tiny flags tensor, so all
ranks see the same picture and take the same decision: none waits in a collective the others skipped.

- ``on_nonfinite=stop``: every rank raises ``NonFiniteError`` naming the rank(s) and the step.
- ``on_nonfinite=skip``: every rank drops its gradients, so ``optimizer.step()`` leaves the parameters (and Adam's
  moments) as they were; the run goes on.

Each event is a record in ``<run dir>/reports/nonfinite.jsonl`` and one sentence on the console (rank zero).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.diagnostics.report import append_jsonl, reports_dir, say
from lit_template.distributed.shards import local as local_shard
from lit_template.errors import ConfigError

CHOICES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """A NaN/Inf loss or gradient with ``on_nonfinite=stop``; raised on every rank in the same step."""


@dataclass
class NonFiniteEvent:
    """One non-finite loss or gradient: a record of ``reports/nonfinite.jsonl``."""

    kind: str
    global_step: int
    ranks: list[int]
    what: str  # "loss" | "grad"
    tensor: str | None  # the first parameter whose gradient is not finite (what == "grad")
    loss: dict[str, float]  # rank -> its loss at that step
    action: str  # "stop" | "skip"
    # on_nonfinite=stop: the step every rank stopped at, before its update (the flags are read one step later)
    stopped_at: int | None = None

    def sentence(self) -> str:
        ranks = ", ".join(str(r) for r in self.ranks)
        label = f"rank{'s' if len(self.ranks) > 1 else ''} {ranks}"
        if self.what == "loss":
            losses = ", ".join(f"{self.loss[str(r)]:g}" for r in self.ranks)
            head = f"non-finite loss on {label} at step {self.global_step} (loss={losses})"
        else:
            head = f"non-finite gradient of {self.tensor} on {label} at step {self.global_step}"
        if self.action == "stop":
            when = f" at step {self.stopped_at}" if self.stopped_at is not None else ""
            return f"{head}; stopping every rank{when} (callbacks.nonfinite_guard.on_nonfinite=skip skips such steps)"
        return f"{head}; skipping this optimizer step on every rank"


class PendingHostCopy:
    """One small device tensor copied to the host without waiting, read later: on a GPU the copy goes into pinned
    memory behind a CUDA event, and reading it waits only for that copy (long done by the next step). Read through a
    NumPy view made once, so the per-step read calls no tensor method (tests/test_host_sync.py counts those)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._view: Any = None
        self._event: Any = None
        self._step: int | None = None

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """The host buffer, made once before training (pinned when the tensors come from a GPU)."""
        self._host = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self._view = self._host.numpy()

    def put(self, tensor: torch.Tensor, step: int) -> None:
        on_cuda = tensor.device.type == "cuda"
        if self._host is None or self._host.shape != tensor.shape or self._host.dtype != tensor.dtype:
            self.allocate(tuple(tensor.shape), tensor.dtype, tensor.device)
        self._host.copy_(tensor, non_blocking=on_cuda)
        if on_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._step = step

    def take(self) -> tuple[Any, int] | None:
        """(the host values, the step they were put at), or None when nothing is pending."""
        if self._step is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        step, self._step, self._event = self._step, None, None
        return self._view, step

    def clear(self) -> None:
        self._step, self._event = None, None


class NonFiniteGuard(L.Callback):
    """Stops, or skips the step, when a loss or gradient is NaN/Inf on any rank; every rank decides together.

    Args:
        on_nonfinite: ``stop`` (every rank raises ``NonFiniteError`` naming the rank and step) or ``skip`` (every
            rank drops its gradients, so the optimizer step changes nothing, and the run goes on).
        check_grads: also check the gradients (after DDP's all-reduce), not only the loss.
    """

    def __init__(self, on_nonfinite: str = "stop", check_grads: bool = True) -> None:
        if on_nonfinite not in CHOICES:
            raise ConfigError(
                f"callbacks.nonfinite_guard.on_nonfinite={on_nonfinite!r}: choose one of {', '.join(CHOICES)}"
            )
        self.on_nonfinite, self.check_grads = on_nonfinite, check_grads
        self._pending = PendingHostCopy()
        self._reset()

    def _reset(self) -> None:
        self._losses: list[torch.Tensor] = []

    # No host sync in the hot path (a `bool(tensor)` per check would stall a GPU every micro-batch): the flags are
    # built on the device and read once per optimizer step, after the one all_gather.
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        # Called once per micro-batch: with gradient accumulation one bad micro-batch makes the step bad.
        self._losses.append(loss.detach().float().sum())

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        device = pl_module.device
        # device-side constants are filled on the device (torch.tensor(value, device=...) would be a host copy)
        minus_one = torch.full((), -1.0, dtype=torch.float64, device=device)
        if self._losses:
            losses = torch.stack(self._losses).double()
            loss_bad = ~torch.isfinite(losses)
            # the first non-finite micro-batch loss, else the last one
            loss_value = torch.where(loss_bad.any(), losses[loss_bad.double().argmax()], losses[-1])
        else:
            loss_bad, loss_value = torch.zeros(1, dtype=torch.bool, device=device), minus_one.new_zeros(())
        grad_bad, first_bad = torch.zeros((), dtype=torch.bool, device=device), minus_one
        grads = [p.grad for p in pl_module.parameters()] if self.check_grads else []
        if any(g is not None for g in grads):
            finite = torch.ones((), dtype=torch.bool, device=device)  # what a parameter without a gradient counts as
            # one flag per parameter, in named_parameters() order: the first bad one's position is its index
            # a DTensor gradient (model parallel): this rank's shard; any rank's bad shard shows in the gathered flags
            bad = ~torch.stack([torch.isfinite(local_shard(g)).all() if g is not None else finite for g in grads])
            grad_bad = bad.any()
            first_bad = torch.where(grad_bad, bad.double().argmax(), minus_one)
        local = torch.stack([loss_bad.any().double(), grad_bad.double(), first_bad.double(), loss_value])
        self._reset()
        # every rank, every optimizer step, the same one collective
        flags = trainer.strategy.all_gather(local) if trainer.world_size > 1 else local
        flags = flags.reshape(-1, 4)
        if self.on_nonfinite == "skip":
            # the step's own update must be dropped, so its flags are read now: one host sync per step
            self._act(trainer, pl_module, optimizer, flags.cpu().numpy(), trainer.global_step)
            return
        # stop: this step's flags are copied to the host without waiting and read at the next step (or at train end),
        # so no step waits for the device; every rank reads the same gathered flags and stops at that same step
        self._read_pending(trainer, pl_module, optimizer)
        self._pending.put(flags, trainer.global_step)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending.clear()
        self._pending.allocate((trainer.world_size, 4), torch.float64, pl_module.device)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read_pending(trainer, pl_module, None)  # before validation runs on what the epoch's last step made

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read_pending(trainer, pl_module, None)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._pending.clear()

    def _read_pending(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        taken = self._pending.take()
        if taken is not None:
            self._act(trainer, pl_module, optimizer, *taken)

    def _act(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any, flags: Any, step: int) -> None:
        """Report and stop (or skip) when the gathered ``flags`` (one row per rank, host memory) say so."""
        loss_ranks = [r for r in range(flags.shape[0]) if flags[r, 0] > 0]
        grad_ranks = [r for r in range(flags.shape[0]) if flags[r, 1] > 0]
        if not loss_ranks and not grad_ranks:
            return
        names = [name for name, _ in pl_module.named_parameters()]
        what, ranks = ("loss", loss_ranks) if loss_ranks else ("grad", grad_ranks)
        tensor = names[int(flags[ranks[0], 2])] if what == "grad" else None
        event = NonFiniteEvent(
            kind="nonfinite",
            global_step=step,
            ranks=ranks,
            what=what,
            tensor=tensor,
            loss={str(r): float(flags[r, 3]) for r in range(flags.shape[0])},
            action=self.on_nonfinite,
            stopped_at=trainer.global_step if self.on_nonfinite == "stop" else None,
        )
        self._report(trainer, event)
        if self.on_nonfinite == "stop":
            raise NonFiniteError(event.sentence())
        optimizer.zero_grad(set_to_none=True)
        for param in pl_module.parameters():
            param.grad = None

    @rank_zero_only
    def _report(self, trainer: L.Trainer, event: NonFiniteEvent) -> None:
        append_jsonl(reports_dir(trainer) / "nonfinite.jsonl", _json_safe(asdict(event)))
        say(event.sentence(), logging.ERROR if event.action == "stop" else logging.WARNING)


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN: write the loss values as strings when they are not finite
    record["loss"] = {r: v if math.isfinite(v) else str(v) for r, v in record["loss"].items()}
    return record
