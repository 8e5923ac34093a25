"""Gradient and parameter sync check: prove data-parallel replicas stay identical, and name what drifted.

Every ``every_n_steps`` optimizer steps, on every rank: gradients after DDP's all-reduce (``on_before_optimizer_step``),
parameters that got no gradient from this rank's backward, buffers as the step's first forward saw them, and
parameters after the optimizer step. Local SGD (``comm=local_sgd``) skips the checks while the replicas differ on
purpose (``diagnostics/local_sgd.py``); under ``ModelParallelStrategy`` each DTensor shard is compared only among the
ranks holding the same one (``distributed/shards.py``). Collectives and cost: ``diagnostics/replica_check.py`` (one
all_gather per check point on a match, none on off-steps). The full story: docs/sync_check.md.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.diagnostics.local_sgd import LocalSGDSchedule
from lit_template.diagnostics.replica_check import ReplicaComparer, TensorGroup
from lit_template.diagnostics.replicas import SEVERE, Finding, ReplicaDivergenceError, Tally
from lit_template.diagnostics.report import append_jsonl, reports_dir, say, write_json
from lit_template.errors import ConfigError
from lit_template.lightning_compat import model_averager

MODES = ("exact", "tolerance")
ON_MISMATCH = ("warn", "raise", "stop")


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
        self.tally = Tally()  # kept across resume
        # one entry per check: (global_step, where, collectives issued); equal on every rank (tests read it)
        self.collective_log: list[tuple[int, str, int]] = []
        self._comparer = ReplicaComparer(1, mode, rtol, torch.device("cpu"), False, max_reported_tensors)
        self._hooks: list[Any] = []
        self._used: set[int] = set()
        self._buffer_values: torch.Tensor | None = None
        self._grad_step: int | None = None
        self._params_due = False
        # local SGD: the strategy's PeriodicModelAverager (None: every step syncs), and what was skipped because of it
        self._local_sgd = LocalSGDSchedule()
        self._sharded = False  # ModelParallelStrategy: compare DTensor shards among the ranks holding the same one
        self._params_deferred = False
        self.last_check_ms = 0.0  # time spent in the last check step's checks (also logged as sync/check_ms)

    # -- lifecycle ------------------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

        self.world_size = trainer.world_size
        self._sharded = isinstance(trainer.strategy, ModelParallelStrategy)
        replicated = isinstance(trainer.strategy, DDPStrategy) and "DeepSpeed" not in type(trainer.strategy).__name__
        self.active = (
            self.world_size > 1 and dist.is_available() and dist.is_initialized() and (replicated or self._sharded)
        )
        # where the collectives run: the process's own GPU under NCCL, the CPU under gloo
        device, tensors = trainer.strategy.root_device, self.max_reported_tensors
        self._comparer = ReplicaComparer(self.world_size, self.mode, self.rtol, device, self._sharded, tensors)
        if self.world_size > 1 and not (replicated or self._sharded):
            rank_zero_only(say)(
                f"sync check: off, {type(trainer.strategy).__name__} does not keep a full replica "
                "on every rank (sharded parameters differ by design)",
                logging.INFO,
            )

    def state_dict(self) -> dict[str, Any]:
        return self.tally.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tally.load_state_dict(state_dict)

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
            groups.append(self._comparer.group("param_mismatch", self._named_params(pl_module, trainable=False)))
        if self.check_buffers:
            groups.append(self._comparer.group("buffer_mismatch", list(pl_module.named_buffers())))
        self._run_check(trainer, groups, "fit_start", start)
        self.tally.take_step()  # the fit-start check is no step's: not logged

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
            self._buffer_values = self._comparer.values([b for _, b in module.named_buffers()])
            self.tally.step_ms += (time.perf_counter() - start) * 1000

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
                self._comparer.group(
                    "grad_mismatch", [(n, p.grad) for n, p in trainable], like=[p for _, p in trainable]
                )
            )
        if self.check_unused and not self._sharded and trainable:
            flags = [1 if i in self._used else 0 for i in range(len(trainable))]
            groups.append(
                self._comparer.flags("no_local_grad", [n for n, _ in trainable], flags, [p for _, p in trainable])
            )
        if self.check_buffers and self._buffer_values is not None:
            groups.append(
                self._comparer.snapshot_group("buffer_mismatch", list(pl_module.named_buffers()), self._buffer_values)
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
        group = self._comparer.group("param_mismatch", self._named_params(pl_module, trainable=False))
        self._run_check(trainer, [group], "after_optimizer_step", start)
        self._log_step(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._remove_hooks()
        if self.active and self.at_fit_end and self.check_params and not self._local_sgd.params_synced():
            self._local_sgd.counts["fit_end_check_skipped"] += 1
        elif self.active and self.at_fit_end and self.check_params:
            start = time.perf_counter()
            group = self._comparer.group("param_mismatch", self._named_params(pl_module, trainable=False))
            self._run_check(trainer, [group], "fit_end", start)
        self._write_summary(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._remove_hooks()

    # -- the check ------------------------------------------------------------------------------------------------
    def _run_check(self, trainer: L.Trainer, groups: list[TensorGroup], where: str, start: float) -> None:
        groups = [g for g in groups if g.names]
        if not groups:
            return
        step = trainer.global_step
        findings = self._comparer.findings(groups, step, where)
        self.collective_log.append((step, where, self._comparer.collectives))
        checked: dict[str, int] = {}
        for group in groups:
            checked[group.kind] = checked.get(group.kind, 0) + len(group.names)
        new = self.tally.add(checked, findings)
        self.tally.step_ms += (time.perf_counter() - start) * 1000
        self._report(trainer, findings, new)

    # -- results --------------------------------------------------------------------------------------------------
    def _report(self, trainer: L.Trainer, findings: list[Finding], new: list[Finding]) -> None:
        """Every finding to the file; the new ones (``new``) also on the console; then stop or raise if asked."""
        for finding in findings:
            self._write_finding(trainer, finding)
        for finding in new:
            rank_zero_only(say)(finding.sentence(), logging.ERROR if finding.kind in SEVERE else logging.WARNING)
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
        options = {"every_n_steps": self.every_n_steps, "mode": self.mode, "on_mismatch": self.on_mismatch}
        summary = self.tally.summary(trainer.global_step, self.world_size, self.active, options)
        write_json(reports_dir(trainer) / "sync_check.json", {**summary, "local_sgd": self._local_sgd.summary()})

    def _log_step(self, pl_module: L.LightningModule) -> None:
        metrics = self.tally.take_step()
        self.last_check_ms = metrics["sync/check_ms"]
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    # -- helpers --------------------------------------------------------------------------------------------------
    @staticmethod
    def _named_params(pl_module: L.LightningModule, trainable: bool) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in pl_module.named_parameters() if p.requires_grad or not trainable]

    def _remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
