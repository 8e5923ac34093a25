"""Gradient and parameter sync check: prove data-parallel replicas stay identical, and name what drifted.

Every ``every_n_steps`` optimizer steps, on every rank:

- gradients in ``on_before_optimizer_step`` (after DDP's all-reduce, AMP unscaling and gradient accumulation);
- which trainable parameters got no gradient from this rank's own backward (the unused-parameter case, a warning);
- buffers (BatchNorm running stats) as the step's first forward saw them, just after DDP broadcast them (a warning:
  ``broadcast_buffers=False`` makes them differ on purpose);
- parameters after the optimizer step (``on_train_batch_end``); also at fit start and end if asked.

Local SGD (``comm=local_sgd``: a ``PeriodicModelAverager`` in the DDP strategy): after ``start_localSGD_iter`` steps
the gradients are not all-reduced and the replicas differ on purpose until the next averaging step. Then gradients
are not checked, and a due parameter check waits for the next step that averaged the parameters (the averager's own
step count says which, the same on every rank, so every rank still issues the same collectives).

Model parallel (``ModelParallelStrategy``: FSDP2 and tensor parallel): parameters and gradients are DTensors, and
ranks hold different shards on purpose. Each rank checksums its own shard, and a shard is compared only among the
ranks that hold the same one (``distributed/shards.py``: ranks that differ only along the tensor's ``Replicate``
mesh dimensions, or along world dimensions outside its mesh, such as the tensor-parallel peers of a parameter that
FSDP2 alone shards). A tensor sharded over every rank has no peer and is not compared. The unused-parameter check is
off there (FSDP2 accumulates the gradients itself), and the max |difference| is measured only for full replicas.

Cost: a checksum per tensor on the tensor's own device (see ``checksum.py``), then one all_gather of one checksum per
kind. Only on a mismatch: a second all_gather of the per-tensor checksums to find the tensors, then, for the few
tensors reported, a broadcast of the reference rank's tensor and one all_gather of each rank's max |difference|. The
reference is the majority across ranks. Every rank makes the same decisions from the same gathered data, so every
rank issues the same collectives and acts the same way on a mismatch; on off-steps there are none.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.diagnostics import checksum as cs
from lit_template.diagnostics.local_sgd import LocalSGDSchedule
from lit_template.diagnostics.replicas import (
    WHAT,
    Deviation,
    Finding,
    ReplicaDivergenceError,
    TensorFinding,
    compare,
    has_peers,
)
from lit_template.diagnostics.report import append_jsonl, reports_dir, say, write_json
from lit_template.distributed.shards import local as local_shard
from lit_template.distributed.shards import replica_key
from lit_template.errors import ConfigError
from lit_template.lightning_compat import model_averager

MODES = ("exact", "tolerance")
ON_MISMATCH = ("warn", "raise", "stop")
# kinds that mean the replicas train different models; the others are warnings and never raise or stop
SEVERE = ("grad_mismatch", "param_mismatch")


@dataclass
class TensorGroup:
    """One kind of tensors checked at one point: names, the tensors (None: absent on this rank) and their values."""

    kind: str
    names: list[str]
    tensors: list[torch.Tensor | None]
    values: torch.Tensor  # per-tensor int64 checksums, or float64 norms in tolerance mode
    like: list[torch.Tensor]  # gives shape and dtype (the parameter, for gradients and flags)
    exact: bool = False  # flags are compared exactly whatever the mode
    # model parallel: per tensor, a number equal on the ranks that hold the same shard (shards.replica_key)
    keys: list[int] | None = None


@dataclass(frozen=True)
class _ToMeasure:
    """A reported tensor whose max |difference| to the reference rank's copy is measured (only on a mismatch)."""

    group: TensorGroup
    index: int
    reference_rank: int
    finding: TensorFinding  # filled in with the measured differences


class SyncCheck(L.Callback):
    """Checks that data-parallel replicas hold the same gradients, parameters and buffers, and names what drifted.

    Does nothing on one process. Each finding is one sentence on the console naming the global rank(s), the step and
    the tensor, and a record in ``reports/sync_check.jsonl`` (see docs/sync_check.md).

    Args:
        every_n_steps: check every N optimizer steps; 0 turns the periodic checks off (no collectives on off-steps).
        grads: check gradients after the all-reduce, AMP unscaling and accumulation (``on_before_optimizer_step``).
        params: check parameters after the optimizer step.
        buffers: check buffers (BatchNorm running stats) as the step's first forward saw them (a warning only).
        unused_params: name trainable parameters that got no gradient from some rank's backward (a warning only).
        at_fit_start: also check parameters and buffers when fit starts.
        at_fit_end: also check parameters when fit ends.
        mode: ``exact`` (bit-for-bit checksums) or ``tolerance`` (relative difference of per-tensor norms <= rtol).
        rtol: the tolerance of ``mode=tolerance``.
        on_mismatch: ``warn`` (report only), ``raise`` (an error on every rank) or ``stop`` (every rank stops cleanly
            after this step).
        max_reported_tensors: tensors per check whose max |difference| is measured (only on a mismatch).
    """

    def __init__(
        self,
        every_n_steps: int = 100,
        grads: bool = True,
        params: bool = True,
        buffers: bool = True,
        unused_params: bool = True,
        at_fit_start: bool = True,
        at_fit_end: bool = True,
        mode: str = "exact",
        rtol: float = 1e-6,
        on_mismatch: str = "warn",
        max_reported_tensors: int = 8,
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ConfigError(
                f"callbacks.sync_check.every_n_steps={every_n_steps!r}: use a whole number >= 0 "
                "(0 turns the periodic checks off)"
            )
        if mode not in MODES:
            raise ConfigError(f"callbacks.sync_check.mode={mode!r}: choose one of {', '.join(MODES)}")
        if on_mismatch not in ON_MISMATCH:
            raise ConfigError(
                f"callbacks.sync_check.on_mismatch={on_mismatch!r}: choose one of {', '.join(ON_MISMATCH)}"
            )
        if mode == "tolerance" and not rtol > 0:
            raise ConfigError(f"callbacks.sync_check.rtol={rtol!r}: tolerance mode needs rtol > 0")
        if not isinstance(max_reported_tensors, int) or max_reported_tensors < 1:
            raise ConfigError(f"callbacks.sync_check.max_reported_tensors={max_reported_tensors!r}: use >= 1")
        self.every_n_steps, self.mode, self.rtol, self.on_mismatch = every_n_steps, mode, rtol, on_mismatch
        self.check_grads, self.check_params, self.check_buffers = grads, params, buffers
        self.check_unused, self.at_fit_start, self.at_fit_end = unused_params, at_fit_start, at_fit_end
        self.max_reported_tensors = max_reported_tensors
        self.active = False
        self.world_size = 1
        # kept across resume
        self.checks = 0
        self.findings = {kind: 0 for kind in WHAT}
        # tensors compared so far, per kind (a check that never ran shows 0 here, not a clean bill)
        self.tensors_checked = {kind: 0 for kind in WHAT}
        self._said: set[str] = set()
        # one entry per check: (global_step, where, collectives issued); equal on every rank (tests read it)
        self.collective_log: list[tuple[int, str, int]] = []
        self._collectives = 0
        self._comm_device = torch.device("cpu")
        self._hooks: list[Any] = []
        self._used: set[int] = set()
        self._buffer_values: torch.Tensor | None = None
        self._grad_step: int | None = None
        self._params_due = False
        self._step_counts: dict[str, int] = {}
        self._step_ms = 0.0
        # local SGD: the strategy's PeriodicModelAverager (None: every step syncs), and what was skipped because of it
        self._local_sgd = LocalSGDSchedule()
        self._sharded = False  # ModelParallelStrategy: compare DTensor shards among the ranks holding the same one
        self._said_shards = False
        self._params_deferred = False
        self.last_check_ms = 0.0  # time spent in the last check step's checks (also logged as sync/check_ms)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from lightning.pytorch.strategies import DDPStrategy

        self.world_size = trainer.world_size
        from lightning.pytorch.strategies import ModelParallelStrategy

        self._sharded = isinstance(trainer.strategy, ModelParallelStrategy)
        replicated = isinstance(trainer.strategy, DDPStrategy) and "DeepSpeed" not in type(trainer.strategy).__name__
        self.active = (
            self.world_size > 1 and dist.is_available() and dist.is_initialized() and (replicated or self._sharded)
        )
        # where the collectives run: the process's own GPU under NCCL, the CPU under gloo
        self._comm_device = trainer.strategy.root_device
        if self.world_size > 1 and not (replicated or self._sharded):
            rank_zero_only(say)(
                f"sync check: off, {type(trainer.strategy).__name__} does not keep a full replica "
                "on every rank (sharded parameters differ by design)",
                logging.INFO,
            )

    def state_dict(self) -> dict[str, Any]:
        return {
            "checks": self.checks,
            "findings": dict(self.findings),
            "said": sorted(self._said),
            "tensors_checked": dict(self.tensors_checked),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.checks = state_dict.get("checks", 0)
        self.findings.update(state_dict.get("findings", {}))
        self.tensors_checked.update(state_dict.get("tensors_checked", {}))
        self._said = set(state_dict.get("said", []))

    def _due(self, trainer: L.Trainer) -> bool:
        return (
            self.active
            and self.every_n_steps > 0
            and not trainer.sanity_checking
            and trainer.global_step % self.every_n_steps == 0
        )

    # -- hooks ----------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # built in strategy.setup, after the callbacks' setup
        self._local_sgd = LocalSGDSchedule(model_averager(trainer.strategy) if self.active else None)
        if self._local_sgd.active:
            rank_zero_only(say)(self._local_sgd.sentence(), logging.INFO)
        if not (self.active and self.at_fit_start):
            return
        start = time.perf_counter()
        groups = []
        if self.check_params:
            groups.append(self._group("param_mismatch", self._named_params(pl_module, trainable=False)))
        if self.check_buffers:
            groups.append(self._group("buffer_mismatch", list(pl_module.named_buffers())))
        self._run_check(trainer, groups, "fit_start", start)
        self._step_counts, self._step_ms = {}, 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        # The hooks that watch this step's forward and backward exist only on check steps: off-steps pay nothing.
        if not self._due(trainer) or self._hooks:
            return
        self._used.clear()
        self._buffer_values = None
        if self.check_unused and not self._sharded:
            for i, (_, p) in enumerate(self._named_params(pl_module, trainable=True)):
                self._hooks.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._used.add(i)))
        if self.check_buffers and any(True for _ in pl_module.buffers()):
            self._hooks.append(pl_module.register_forward_pre_hook(self._snapshot_buffers))

    def _snapshot_buffers(self, module: torch.nn.Module, args: Any) -> None:
        # The step's first forward, just after DDP broadcast the buffers: later micro-batches under no_sync do not
        # broadcast them, and this forward is about to update them.
        if self._buffer_values is None:
            start = time.perf_counter()
            self._buffer_values = self._values([b for _, b in module.named_buffers()], self._comm_device)
            self._step_ms += (time.perf_counter() - start) * 1000

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self._due(trainer) or self._grad_step == trainer.global_step:
            return
        start = time.perf_counter()
        self._grad_step = trainer.global_step
        self._remove_hooks()
        trainable = self._named_params(pl_module, trainable=True)
        groups = []
        if self.check_grads and not self._local_sgd.grads_synced():
            self._local_sgd.counts["grad_checks_skipped"] += 1
        elif self.check_grads:
            groups.append(
                self._group("grad_mismatch", [(n, p.grad) for n, p in trainable], like=[p for _, p in trainable])
            )
        if self.check_unused and not self._sharded and trainable:
            flags = [1 if i in self._used else 0 for i in range(len(trainable))]
            dtype = torch.int64 if self.mode == "exact" else torch.float64
            groups.append(
                TensorGroup(
                    "no_local_grad",
                    [n for n, _ in trainable],
                    [None] * len(trainable),
                    torch.tensor(flags, dtype=dtype, device=self._comm_device),
                    like=[p for _, p in trainable],
                    exact=True,
                )
            )
        if self.check_buffers and self._buffer_values is not None:
            named = list(pl_module.named_buffers())
            groups.append(
                TensorGroup(
                    "buffer_mismatch",
                    [n for n, _ in named],
                    [b for _, b in named],
                    self._buffer_values,
                    like=[b for _, b in named],
                )
            )
        self._buffer_values = None
        self._params_due = self.check_params
        self._run_check(trainer, groups, "before_optimizer_step", start)
        if not self._params_due:
            self._log_step(pl_module)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._params_due:
            return
        if not self._local_sgd.params_synced():
            # local SGD between averaging steps: the replicas differ on purpose; check right after the next averaging
            if not self._params_deferred:
                self._params_deferred = True
                self._local_sgd.counts["param_checks_deferred"] += 1
                self._log_step(pl_module)
            return
        start = time.perf_counter()
        self._params_due = self._params_deferred = False
        group = self._group("param_mismatch", self._named_params(pl_module, trainable=False))
        self._run_check(trainer, [group], "after_optimizer_step", start)
        self._log_step(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()
        if self.active and self.at_fit_end and self.check_params and not self._local_sgd.params_synced():
            self._local_sgd.counts["fit_end_check_skipped"] += 1
        elif self.active and self.at_fit_end and self.check_params:
            start = time.perf_counter()
            group = self._group("param_mismatch", self._named_params(pl_module, trainable=False))
            self._run_check(trainer, [group], "fit_end", start)
        self._write_summary(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    # -- the check ------------------------------------------------------------------------------------------------
    def _run_check(self, trainer: L.Trainer, groups: list[TensorGroup], where: str, start: float) -> None:
        groups = [g for g in groups if g.names]
        if not groups:
            return
        self._collectives = 0
        step = trainer.global_step
        findings: list[Finding] = []
        measured: list[_ToMeasure] = []
        for group, per_tensor in zip(groups, self._find_deviating(groups), strict=True):
            tensors = []
            for dev in per_tensor:
                like, ranks = group.like[dev.index], dev.ranks
                if group.kind == "no_local_grad":
                    # name the ranks without a gradient, whichever side the majority is on
                    ranks = [r for r, flag in enumerate(dev.values) if flag == 0]
                tensor = TensorFinding(
                    group.names[dev.index],
                    list(like.shape),
                    str(like.dtype).removeprefix("torch."),
                    ranks,
                    dev.reference_rank,
                )
                replica = not group.keys or group.keys[dev.index] == 0  # a shard's peers differ in shape: not measured
                if group.kind != "no_local_grad" and replica and len(measured) < self.max_reported_tensors:
                    measured.append(_ToMeasure(group, dev.index, dev.reference_rank, tensor))
                tensors.append(tensor)
            if tensors:
                findings.append(
                    Finding(
                        group.kind, step, where, sorted({r for t in tensors for r in t.ranks}), tensors, len(tensors)
                    )
                )
        if measured:
            self._measure_differences(measured)
        self.checks += 1
        for group in groups:
            self.tensors_checked[group.kind] += len(group.names)
        self.collective_log.append((step, where, self._collectives))
        for kind in WHAT:
            self._step_counts.setdefault(kind, 0)
        for finding in findings:
            self._step_counts[finding.kind] += finding.num_tensors
        self._step_ms += (time.perf_counter() - start) * 1000
        self._report(trainer, findings)

    def _find_deviating(self, groups: list[TensorGroup]) -> list[list[Deviation]]:
        """Per group, each tensor that differs across ranks (the decisions: ``diagnostics/replicas.py``)."""
        if self._sharded:
            return self._find_deviating_shards(groups)
        result: list[list[Deviation]] = [[] for _ in groups]
        if self.mode == "exact":
            # One collective for all kinds checked here: one combined checksum per kind and rank.
            gathered = self._all_gather(torch.stack([cs.combine(g.values) for g in groups]))
            differ = [i for i in range(len(groups)) if not bool((gathered[:, i] == gathered[0, i]).all())]
            if not differ:
                return result
            # Only on a mismatch: which tensors (the same groups on every rank, since `gathered` is the same).
            rows = self._all_gather(torch.cat([groups[i].values for i in differ])).tolist()
        else:
            # Tolerance mode: norms do not add up to one exact value, so the one gather carries the per-tensor norms.
            differ = list(range(len(groups)))
            rows = self._all_gather(torch.cat([g.values.to(torch.float64) for g in groups])).tolist()
        offset = 0
        for i in differ:
            exact = self.mode == "exact" or groups[i].exact
            for j in range(len(groups[i].names)):
                column = [row[offset + j] for row in rows]
                reference, ranks = compare(column, exact, self.rtol)
                if ranks:
                    result[i].append(Deviation(j, reference, ranks, column))
            offset += len(groups[i].names)
        return result

    def _find_deviating_shards(self, groups: list[TensorGroup]) -> list[list[Deviation]]:
        """Model parallel: per tensor, compare the ranks holding the same shard (one all_gather of values and keys)."""
        values = torch.cat([g.values for g in groups])
        keys = torch.tensor([k for g in groups for k in g.keys or [0] * len(g.names)], device=values.device)
        rows = self._all_gather(torch.stack([values, keys.to(values.dtype)])).tolist()  # (world, 2, n)
        result: list[list[Deviation]] = []
        offset, compared, total = 0, 0, 0
        for group in groups:
            found = []
            exact = self.mode == "exact" or group.exact
            for j in range(len(group.names)):
                column = [row[0][offset + j] for row in rows]
                key_column = [row[1][offset + j] for row in rows]
                total += 1
                compared += has_peers(key_column)
                reference, ranks = compare(column, exact, self.rtol, key_column)
                if ranks:
                    found.append(Deviation(j, reference, ranks, column))
            result.append(found)
            offset += len(group.names)
        if not self._said_shards:
            self._said_shards = True
            rank_zero_only(say)(
                f"sync check: model parallel: {compared} of {total} tensors have a copy of their shard on another "
                "rank and are compared there; the others are sharded over every rank (nothing to compare)",
                logging.INFO,
            )
        return result

    def _measure_differences(self, measured: list[_ToMeasure]) -> None:
        """Max |value - reference| on every rank for the reported tensors: one broadcast each, then one all_gather."""
        diffs = torch.zeros(len(measured), dtype=torch.float64, device=self._comm_device)
        for k, m in enumerate(measured):
            local = m.group.tensors[m.index]
            local = torch.zeros_like(m.group.like[m.index]) if local is None else local.detach()  # no grad: zeros
            reference = local.clone()
            self._broadcast(reference, m.reference_rank)
            if local.numel():
                diffs[k] = (local.to(torch.float64) - reference.to(torch.float64)).abs().max().to(diffs.device)
        by_rank = self._all_gather(diffs).tolist()
        for k, m in enumerate(measured):
            tensor_finding = m.finding
            tensor_finding.max_abs_diff_by_rank = {r: by_rank[r][k] for r in tensor_finding.ranks}
            tensor_finding.max_abs_diff = max(tensor_finding.max_abs_diff_by_rank.values(), default=0.0)

    # -- results --------------------------------------------------------------------------------------------------
    def _report(self, trainer: L.Trainer, findings: list[Finding]) -> None:
        for finding in findings:
            self.findings[finding.kind] += 1
            self._write_finding(trainer, finding)
            signature = f"{finding.kind}:{[(t.name, t.ranks) for t in finding.tensors]}"
            if signature not in self._said:  # one sentence per distinct finding; repeats go to the file and metrics
                self._said.add(signature)
                level = logging.ERROR if finding.kind in SEVERE else logging.WARNING
                rank_zero_only(say)(finding.sentence(), level)
        severe = [f for f in findings if f.kind in SEVERE]
        if not severe:
            return
        # `severe` comes from gathered data, the same on every rank: every rank stops or raises at this same point.
        if self.on_mismatch == "stop":
            trainer.should_stop = True
            rank_zero_only(say)(
                f"sync check: stopping every rank at global step {trainer.global_step} "
                "(callbacks.sync_check.on_mismatch=stop)",
                logging.ERROR,
            )
        elif self.on_mismatch == "raise":
            self._remove_hooks()
            raise ReplicaDivergenceError(
                f"{severe[0].sentence()} Details: reports/sync_check.jsonl in the run dir "
                "(callbacks.sync_check.on_mismatch=warn only reports, =stop ends the run)"
            )

    @rank_zero_only
    def _write_finding(self, trainer: L.Trainer, finding: Finding) -> None:
        append_jsonl(reports_dir(trainer) / "sync_check.jsonl", finding.record())

    @rank_zero_only
    def _write_summary(self, trainer: L.Trainer) -> None:
        write_json(
            reports_dir(trainer) / "sync_check.json",
            {
                "kind": "sync_check_summary",
                "global_step": trainer.global_step,
                "ranks": list(range(self.world_size)),
                "active": self.active,
                "every_n_steps": self.every_n_steps,
                "mode": self.mode,
                "on_mismatch": self.on_mismatch,
                "checks": self.checks,
                "findings": self.findings,
                "tensors_checked": self.tensors_checked,
                "stopped": bool(self.on_mismatch == "stop" and any(self.findings[k] for k in SEVERE)),
                "local_sgd": self._local_sgd.summary(),
            },
        )

    def _log_step(self, pl_module: L.LightningModule) -> None:
        names = {
            "grad_mismatch": "grad_mismatches",
            "param_mismatch": "param_mismatches",
            "buffer_mismatch": "buffer_mismatches",
            "no_local_grad": "no_local_grad_params",
        }
        metrics = {f"sync/{names[k]}": float(v) for k, v in self._step_counts.items()}
        metrics["sync/check_ms"] = self.last_check_ms = self._step_ms
        self._step_counts, self._step_ms = {}, 0.0
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # -- helpers --------------------------------------------------------------------------------------------------
    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(world_size, *tensor.shape)``: every rank's tensor."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        self._collectives += 1
        return torch.stack(parts)

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, src=src)
        self._collectives += 1

    def _values(self, tensors: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        return cs.checksums(tensors, device) if self.mode == "exact" else cs.norms(tensors, device)

    def _group(
        self, kind: str, named: list[tuple[str, torch.Tensor | None]], like: list[torch.Tensor] | None = None
    ) -> TensorGroup:
        tensors = [t for _, t in named]
        # a DTensor is read through its own shard (an op on the DTensor itself could be a collective)
        local = [None if t is None else local_shard(t) for t in tensors]
        return TensorGroup(
            kind,
            [n for n, _ in named],
            local,
            self._values(local, self._comm_device),
            like=like if like is not None else tensors,
            keys=[replica_key(t) for t in tensors] if self._sharded else None,
        )

    @staticmethod
    def _named_params(pl_module: L.LightningModule, trainable: bool) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad or not trainable]

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
