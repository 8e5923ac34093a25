"""Catch a NaN/Inf loss or gradient on any rank, in the step it happens, on every rank at once.

Each rank keeps its micro-batches' losses (``on_before_backward``) and, after DDP's all-reduce
(``on_before_optimizer_step``), copies its gradients and those losses into one flat buffer and sums it in float64 (a
NaN/Inf anywhere makes the sum non-finite). Then every rank, at every optimizer step, all-gathers that short vector,
so all ranks see the same picture and take the same decision: none waits in a collective the others skipped. Only
when a value is not finite does a rank read its buffer to say which loss or gradient it was. With
``on_nonfinite=stop`` the vector is read on the host one step later (no host sync per step): every rank stops at that
same step, before its update. On one CPU process there is nothing to wait for or agree on: one fused op checks the
step's gradients and losses, read in that step, so the guard stops before the bad update itself.

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
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch._utils import _flatten_dense_tensors

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
        self._flat: Any = None  # the same memory as one row: all_finite() reads it without NumPy's ufuncs
        self._event: Any = None
        self._tag: Any = None  # what put() was given with the pending copy; None: nothing pending
        self._work: Any = None  # put_gathering: the async all_gather and the rows it fills
        self._rows: list[torch.Tensor] = []

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """The host buffer, made once before training (pinned when the tensors come from a GPU)."""
        self._host = torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")
        self._view = self._host.numpy()
        self._flat = self._view.reshape(-1)

    def put(self, tensor: torch.Tensor, tag: Any) -> None:
        """Copies ``tensor``, rows of values or one row as a 1-D tensor (to a new host buffer only if its size or
        dtype changed); ``take`` gives ``tag`` back."""
        on_cuda = tensor.is_cuda
        if self._host is None or self._host.numel() != tensor.numel() or self._host.dtype != tensor.dtype:
            self.allocate((tensor.numel() // tensor.shape[-1], tensor.shape[-1]), tensor.dtype, tensor.device)
        self._host.copy_(tensor, non_blocking=on_cuda)  # a 1-D row broadcasts into the (1, n) buffer
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

    def all_finite(self) -> bool:
        """Whether every value ``take`` returned is finite: a Python sum of the floats is NaN/Inf exactly when one
        of them is (float64 sums of float32 or narrower values, far from float64's range), and costs under a
        microsecond where NumPy's isfinite + all costs 5-20 here."""
        return math.isfinite(sum(self._flat.tolist()))

    def clear(self) -> None:
        # a gather in flight is dropped, not waited for: after a failure the other ranks may never send
        self._tag, self._event, self._work, self._rows = None, None, None, []


# The small gradients (up to this many values in all) are copied into one flat tensor per step and summed in one op;
# larger ones are summed one by one. 2**22 float32 values: a 16 MiB copy, beside gradients that are far larger.
FLAT_MAX = 2**22


class _Layout:
    """Where one optimizer's gradients go each step, fixed at its first step (a parameter's shape does not change).

    The step's vector is ``[sum of the flat copy, each large gradient's sum]``, float64: the flat copy holds the
    small gradients, then the step's micro-batch losses, so one sum covers them all (a NaN/Inf anywhere makes it
    non-finite; float64 does not overflow on float32/bf16 values). The copy is kept until the next step's, which is
    made after the guard has read this step's vector, so when a value is not finite, ``locate`` reads it to say
    which loss or gradient it was. A missing gradient counts as zeros.
    """

    def __init__(self, params: list[torch.Tensor], device: torch.device) -> None:
        self.dtensor = any(local_shard(p) is not p for p in params)
        self.small: list[tuple[int, torch.Tensor]] = []  # (position in params, parameter)
        self.large: list[tuple[int, torch.Tensor]] = []
        self.spans: list[tuple[int, int]] = []  # where each small gradient lies in the flat copy
        numel = 0
        for i, p in enumerate(params):
            size = local_shard(p).numel()
            if numel + size <= FLAT_MAX:
                self.small.append((i, p))
                self.spans.append((numel, numel + size))
                numel += size
            else:
                self.large.append((i, p))
        self.params, self.numel, self.device = params, numel, device
        self.zeros: dict[int, torch.Tensor] = {}
        self.flat: torch.Tensor | None = None  # the last step's copy

    def step_vector(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The step's float64 vector, from device ops only (one copy and one sum, plus a sum per large gradient)."""
        if self.dtensor:
            parts = [self._zero(i) if p.grad is None else local_shard(p.grad) for i, p in self.small]
        else:  # no call per parameter: the common case, inline
            parts = [self._zero(i) if (g := p.grad) is None else g for i, p in self.small]
        parts += losses
        self.flat = None  # the last step's copy is read by now: not two alive at once
        # torch's own (DDP's, the coalesced collectives'): the views and the cat in one call, not one op per tensor
        self.flat = _flatten_dense_tensors(parts) if parts else torch.zeros(0, device=self.device)
        if not self.large:  # shape (1,): no reshape after it
            return self.flat.sum(0, dtype=torch.float64, keepdim=True)
        total = self.flat.sum(dtype=torch.float64)
        return torch.stack([total, *(self._grad_sum(p.grad) for _, p in self.large)])

    def grads(self) -> list[torch.Tensor]:
        """The gradients there are (a missing one is zeros: nothing to check)."""
        return [g for p in self.params if (g := p.grad) is not None]

    def _zero(self, i: int) -> torch.Tensor:
        # a parameter without a gradient (unused in this step): zeros in its place, made once
        if i not in self.zeros:
            self.zeros[i] = torch.zeros(local_shard(self.params[i]).numel(), device=self.device)
        return self.zeros[i]

    def _grad_sum(self, grad: torch.Tensor | None) -> torch.Tensor:
        if grad is None:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return local_shard(grad).sum(dtype=torch.float64)

    def locate(self, row: Any) -> tuple[list[float], int | None]:
        """This rank's micro-batch losses at the step and the position (in the optimizer's parameters) of its first
        non-finite gradient, or None. ``row`` is this rank's vector on the host. The failure path: it reads the
        flat copy on the host (one device sync, once)."""
        flat = self.flat.detach().cpu()
        values = flat[self.numel :].double().tolist()
        bad = [i for (i, _), (a, b) in zip(self.small, self.spans, strict=True) if not flat[a:b].isfinite().all()]
        bad += [i for (i, _), v in zip(self.large, row[1:], strict=True) if not math.isfinite(float(v))]
        return values, min(bad, default=None)


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
        self._world = 1  # trainer.world_size (a property of the strategy, read per step otherwise), set at start
        self._on_cpu = True
        self._layouts: dict[int, _Layout] = {}  # id(optimizer) -> where its gradients go
        self._losses: list[torch.Tensor] = []
        # one CPU process (_check_now): the flag the fused check sets, read through a NumPy view, and its scale
        self._found = torch.zeros(1)
        self._found_flag = self._found.numpy()
        self._one = torch.ones(1)

    # No host sync in the hot path (a `bool(tensor)` per check would stall a GPU every micro-batch): per step the
    # device makes one small vector (one sum over the losses and the small gradients, one per large gradient), every
    # rank gathers it, and the host reads it one step later and decides there. Few device ops: on the CPU each small
    # op costs microseconds (a sum per parameter cost ~35 us a step at the default model, one flatten and sum ~14).
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        # Called once per micro-batch: with gradient accumulation one bad micro-batch makes the step bad.
        loss = loss.detach()
        self._losses.append(loss if loss.dim() == 0 else loss.sum())

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        losses, self._losses = self._losses, []
        layout = self._layouts.get(id(optimizer))
        if layout is None:
            layout = self._layouts[id(optimizer)] = self._layout(optimizer, pl_module)
        if not losses and not layout.params:
            return
        if self._world == 1 and self._on_cpu and not layout.dtensor:
            self._check_now(trainer, pl_module, optimizer, layout, losses)
            return
        # the last step's values are read (stop mode) before this step's flat copy replaces the one that says which
        # loss or gradient was bad
        if self.on_nonfinite == "stop":
            self._read_pending(trainer, pl_module, optimizer)
        # what _act needs to make sense of the values
        tag = (layout, trainer.global_step)
        local = layout.step_vector(losses)
        # every rank, every optimizer step, the same one collective
        if self.on_nonfinite == "stop" and self._world > 1 and not local.is_cuda:
            # gloo blocks the host for the whole all_gather (about 1 ms a step on 2 CPU processes here): issued
            # asynchronously, it runs behind the next step and is waited for when read, one step later
            rows = [torch.empty_like(local) for _ in range(self._world)]
            self._pending.put_gathering(rows, dist.all_gather(rows, local, async_op=True), tag)
            return
        # one process: the vector as it is (put() takes a 1-D vector as one row)
        values = trainer.strategy.all_gather(local).reshape(self._world, -1) if self._world > 1 else local
        if self.on_nonfinite == "skip":
            # the step's own update must be dropped, so its values are read now: one host sync per step
            host = values.cpu().reshape(self._world, -1).numpy()
            if not math.isfinite(sum(host.ravel().tolist())):
                self._act(trainer, pl_module, optimizer, host, tag)
            return
        # stop: copied to the host without waiting and read at the next step (or at train end), so no step waits
        # for the device; every rank reads the same gathered values and stops at that step
        self._pending.put(values, tag)

    def _check_now(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        optimizer: torch.optim.Optimizer,
        layout: _Layout,
        losses: list[torch.Tensor],
    ) -> None:
        """One CPU process: no device to wait for and no rank to agree with, so the step is checked and read now,
        before its update, in both modes. One op over the gradients and the losses: torch.amp.GradScaler's own
        check, at a scale of 1 (a multiply by 1 changes no value), which sets a flag when a value is NaN/Inf. No
        flat copy (about 45 us a step less than ``step_vector`` at the default model): it is made only when the flag
        is set, from the gradients still there, to say which one was bad."""
        tensors = layout.grads()
        if losses:  # stacked, so the op does not write into the training step's loss
            tensors.append(torch.stack(losses))
        if not tensors:
            return
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, self._found, self._one)
        if self._found_flag[0]:  # a NumPy view of the flag: no tensor call per step
            self._found_flag[0] = 0
            values = layout.step_vector(losses).numpy().reshape(1, -1)
            self._act(trainer, pl_module, optimizer, values, (layout, trainer.global_step))

    def _layout(self, optimizer: torch.optim.Optimizer, pl_module: L.LightningModule) -> _Layout:
        # The parameters this optimizer steps: its param groups are a list (pl_module.parameters() walks every
        # submodule, torchmetrics' hashing included: ~0.2 ms a step here). A DTensor gradient (model parallel): this
        # rank's shard.
        return _Layout(_optimized(optimizer) if self.check_grads else [], pl_module.device)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._pending.clear()
        self._world = trainer.world_size
        self._on_cpu = pl_module.device.type == "cpu"
        self._losses = []
        self._layouts = {}
        self._found_flag[0] = 0
        large = 0
        if trainer.optimizers:  # the buffers, made here rather than in a step
            layout = self._layouts[id(trainer.optimizers[0])] = self._layout(trainer.optimizers[0], pl_module)
            large = len(layout.large)
        self._pending.allocate((self._world, 1 + large), torch.float64, pl_module.device)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read_pending(trainer, pl_module, None)  # before validation runs on what the epoch's last step made

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read_pending(trainer, pl_module, None)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._pending.clear()

    def _read_pending(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        taken = self._pending.take()
        if taken is not None and not self._pending.all_finite():
            self._act(trainer, pl_module, optimizer, *taken)

    def _act(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any, values: Any, tag: tuple) -> None:
        """Report and stop (or skip): the gathered ``values`` (one row per rank, host memory) hold a NaN/Inf.

        Every rank is here, at the same step (they all read the same values): each reads its own buffer to say
        which of its losses or gradients was bad, and the ranks gather what they found (the failure path)."""
        layout, step = tag
        rank = trainer.global_rank
        mine = layout.locate(values[rank])
        found = [mine]
        if self._world > 1:
            found = [None] * self._world
            dist.all_gather_object(found, mine)
        loss_ranks = [r for r, (ls, _) in enumerate(found) if not all(map(math.isfinite, ls))]
        grad_ranks = [r for r, (_, first) in enumerate(found) if first is not None]
        what, ranks = ("loss", loss_ranks) if loss_ranks else ("grad", grad_ranks)
        tensor = None
        if what == "grad":
            first = found[ranks[0]][1]  # the first parameter whose gradient is not finite
            names = {id(p): name for name, p in pl_module.named_parameters()}
            tensor = names.get(id(layout.params[first]), f"parameter {first} of the optimizer")
        event = NonFiniteEvent(
            kind="nonfinite",
            global_step=step,
            ranks=ranks,
            what=what,
            tensor=tensor,
            loss={str(r): _step_loss(ls) for r, (ls, _) in enumerate(found)},
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


def _step_loss(losses: list[float]) -> float:
    """A rank's loss at the step: its first non-finite micro-batch loss, else the last one (-1: none recorded)."""
    if not losses:
        return -1.0
    return next((v for v in losses if not math.isfinite(v)), losses[-1])


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    # JSON has no NaN: write the loss values as strings when they are not finite
    record["loss"] = {r: v if math.isfinite(v) else str(v) for r, v in record["loss"].items()}
    return record
