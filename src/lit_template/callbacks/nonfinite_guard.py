"""Catch a NaN/Inf loss or gradient on any rank, in the step it happens, on every rank at once.

Each rank keeps its micro-batches' losses (``on_before_backward``) and the sum of each gradient
(``on_before_optimizer_step``, after DDP's all-reduce; a NaN/Inf anywhere makes the float64 sum non-finite). Then
every rank, at every optimizer step, all-gathers that one small vector, so all ranks see the same picture and take
the same decision: none waits in a collective the others skipped. With ``on_nonfinite=stop`` the vector is read on
the host one step later (no host sync per step): every rank stops at that same step, before its update.

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
import numpy as np
import torch
import torch.distributed as dist
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
    # on_nonfinite=stop: the step every rank stopped at, before its update (the values are read one step later)
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
    memory behind a CUDA event, and reading it waits only for that copy (long done by the next step). Or, on the CPU
    under gloo, the rows of an all_gather still in flight (``put_gathering``), waited for when read. Read through a
    NumPy view made once, so the per-step read calls no tensor method (tests/test_host_sync.py counts those)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None
        self._view: Any = None
        self._event: Any = None
        self._tag: Any = None  # what put() was given with the pending copy; None: nothing pending
        self._work: Any = None  # put_gathering: the async all_gather and the rows it fills
        self._rows: list[torch.Tensor] = []

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """The host buffer, made once before training (pinned when the tensors come from a GPU)."""
        self._host = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self._view = self._host.numpy()

    def put(self, tensor: torch.Tensor, tag: Any) -> None:
        """Copies ``tensor`` (to a new host buffer only if its shape or dtype changed); ``take`` gives ``tag`` back."""
        on_cuda = tensor.device.type == "cuda"
        if self._host is None or self._host.shape != tensor.shape or self._host.dtype != tensor.dtype:
            self.allocate(tuple(tensor.shape), tensor.dtype, tensor.device)
        self._host.copy_(tensor, non_blocking=on_cuda)
        if on_cuda:
            self._event = torch.cuda.Event()
            self._event.record()
        self._tag = tag

    def put_gathering(self, rows: list[torch.Tensor], work: Any, tag: Any) -> None:
        """An all_gather into ``rows`` (CPU tensors, one per rank) issued with ``async_op=True``: ``take`` waits."""
        if self._host is None or self._host.shape != (len(rows), *rows[0].shape) or self._host.dtype != rows[0].dtype:
            self.allocate((len(rows), *rows[0].shape), rows[0].dtype, rows[0].device)
        self._rows, self._work, self._tag = rows, work, tag

    def take(self) -> tuple[Any, Any] | None:
        """(the host values, the tag they were put with), or None when nothing is pending."""
        if self._tag is None:
            return None
        if self._event is not None:
            self._event.synchronize()
        if self._work is not None:
            self._work.wait()
            torch.stack(self._rows, out=self._host)
        tag, self._tag, self._event, self._work, self._rows = self._tag, None, None, None, []
        return self._view, tag

    def clear(self) -> None:
        # a gather in flight is dropped, not waited for: after a failure the other ranks may never send
        self._tag, self._event, self._work, self._rows = None, None, None, []


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

    # No host sync in the hot path (a `bool(tensor)` per check would stall a GPU every micro-batch): per step the
    # device makes one small vector (each micro-batch's loss, each gradient's sum), every rank gathers it, and the
    # host reads it one step later and decides there. Few device ops: on the CPU each small op costs microseconds.
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        # Called once per micro-batch: with gradient accumulation one bad micro-batch makes the step bad.
        # float64 now: one dtype makes the step's torch.stack several times cheaper than a mixed one
        loss = loss.detach()
        self._losses.append((loss if loss.dim() == 0 else loss.sum()).to(torch.float64))

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        parts, losses, params = self._losses, len(self._losses), []
        self._reset()
        if self.check_grads:
            # A gradient holds a NaN/Inf exactly when its float64 sum is not finite (float64 does not overflow on
            # float32/bf16 values). A DTensor gradient (model parallel): this rank's shard; a parameter without a
            # gradient counts as finite. One value per parameter this optimizer steps: its param groups are a list
            # (pl_module.parameters() walks every submodule, torchmetrics' hashing included: ~0.2 ms a step here)
            params = _optimized(optimizer)
            for p in params:
                if p.grad is not None:
                    parts.append(local_shard(p.grad).sum(dtype=torch.float64))
                else:
                    parts.append(torch.zeros((), dtype=torch.float64, device=pl_module.device))
        if not parts:
            return
        # [the micro-batches' losses..., the gradients' sums...], float64: the same length on every rank
        local = torch.stack(parts)
        # every rank, every optimizer step, the same one collective
        layout = (losses, trainer.global_step, params)
        if self.on_nonfinite == "stop" and trainer.world_size > 1 and local.device.type == "cpu":
            # gloo blocks the host for the whole all_gather (about 1 ms a step on 2 CPU processes here): issued
            # asynchronously, it runs behind the next step and is waited for when read, one step later
            self._read_pending(trainer, pl_module, optimizer)
            rows = [torch.empty_like(local) for _ in range(trainer.world_size)]
            self._pending.put_gathering(rows, dist.all_gather(rows, local, async_op=True), layout)
            return
        values = trainer.strategy.all_gather(local) if trainer.world_size > 1 else local
        values = values.reshape(trainer.world_size, -1)
        if self.on_nonfinite == "skip":
            # the step's own update must be dropped, so its values are read now: one host sync per step
            self._act(trainer, pl_module, optimizer, values.cpu().numpy(), layout)
            return
        # stop: this step's values are copied to the host without waiting and read at the next step (or at train
        # end), so no step waits for the device; every rank reads the same gathered values and stops at that step
        self._read_pending(trainer, pl_module, optimizer)
        self._pending.put(values, layout)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending.clear()
        # the host buffer, made here rather than in a step: a step's micro-batches and one value per parameter
        params = len(_optimized(trainer.optimizers[0])) if self.check_grads and trainer.optimizers else 0
        self._pending.allocate(
            (trainer.world_size, trainer.accumulate_grad_batches + params), torch.float64, pl_module.device
        )

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

    def _act(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any, values: Any, layout: tuple
    ) -> None:
        """Report and stop (or skip) when the gathered ``values`` (one row per rank, host memory: the step's
        micro-batch losses, then each of ``params``' gradient sums) hold a NaN/Inf."""
        losses, step, params = layout
        finite = np.isfinite(values)
        if finite.all():
            return
        loss_ranks = [r for r in range(values.shape[0]) if not finite[r, :losses].all()]
        grad_ranks = [r for r in range(values.shape[0]) if not finite[r, losses:].all()]
        what, ranks = ("loss", loss_ranks) if loss_ranks else ("grad", grad_ranks)
        tensor = None
        if what == "grad":
            first = int(np.argmin(finite[ranks[0], losses:]))  # the first parameter whose gradient is not finite
            names = {id(p): name for name, p in pl_module.named_parameters()}
            tensor = names.get(id(params[first]), f"parameter {first} of the optimizer")
        event = NonFiniteEvent(
            kind="nonfinite",
            global_step=step,
            ranks=ranks,
            what=what,
            tensor=tensor,
            loss={str(r): _step_loss(values[r, :losses], finite[r, :losses]) for r in range(values.shape[0])},
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


def _optimized(optimizer: Any) -> list[torch.Tensor]:
    """The parameters ``optimizer`` steps, in its param groups' order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _step_loss(losses: Any, finite: Any) -> float:
    """A rank's loss at the step: its first non-finite micro-batch loss, else the last one (-1: none recorded)."""
    if not len(losses):
        return -1.0
    return float(losses[int(np.argmin(finite))] if not finite.all() else losses[-1])


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN: write the loss values as strings when they are not finite
    record["loss"] = {r: v if math.isfinite(v) else str(v) for r, v in record["loss"].items()}
    return record
