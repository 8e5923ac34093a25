"""Profiling: step time, data wait, throughput, MFU, memory and stragglers per optimizer step; traces; a report.

On by default in light mode (cheap timers, one small all_gather per log interval, no trace). See docs/profiling.md.

    python train.py trainer=ddp_cpu callbacks.profiling.trace.enabled=true    # + a torch.profiler trace per rank
    python train.py callbacks.profiling=null                                   # off

Per optimizer step (all micro-batches of an accumulated step together; sanity check and validation excluded):
step time, data wait (DATA_WAIT in diagnostics/profiling/timer.py), samples (and tokens), time to the gradient sync.
Every ``log_every_n_steps`` each rank's window is gathered; rank zero logs ``perf/*``, names the slowest rank
(``reports/stragglers.jsonl``), and at the end of fit writes ``reports/profile.{json,md,png}``.
"""

from __future__ import annotations

import logging
import math
import time
from array import array
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.diagnostics.profiling.render import plot_profile, render_markdown
from lit_template.diagnostics.profiling.report import RunInfo, build_report, json_ready, num
from lit_template.diagnostics.profiling.stats import (
    GlobalWindow,
    MemoryStats,
    RankWindow,
    WindowStats,
    batch_counts,
    find_straggler,
)
from lit_template.diagnostics.profiling.timer import CpuClock, CudaClock, StepTimer
from lit_template.diagnostics.profiling.traces import MemorySnapshotConfig, MemorySnapshots, TraceConfig, TraceRecorder
from lit_template.diagnostics.report import append_jsonl, reports_dir, run_dir, say, write_json
from lit_template.errors import ConfigError
from lit_template.lightning_compat import compute_dtype, hook_fetch

OPTION = "callbacks.profiling"


def _options(cls: type, name: str, given: Mapping[str, Any] | None) -> Any:
    given = dict(given or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"{OPTION}.{name}.{unknown[0]} is not an option; the options are: {', '.join(sorted(known))}")
    return cls(**given)


class ProfilingCallback(L.Callback):
    """Step time, data wait, throughput, MFU, memory and the straggler rank, per optimizer step, on every rank.

    Rank zero logs ``perf/*`` every window, names the slowest rank (``reports/stragglers.jsonl``) and writes
    ``reports/profile.{json,md,png}`` at the end of fit (see docs/profiling.md).

    Args:
        log_every_n_steps: steps per window (percentiles, throughput, the straggler check); None: the trainer's.
        peak_flops: peak FLOP/s of one device for MFU; None: Lightning's table on a GPU, no MFU on the CPU.
        mfu: count the FLOPs of the first batch (that step is then not timed) and report MFU where a peak is known.
        straggler_warn_pct: say on the console when the slowest rank lags by this share of a step.
        plot: draw ``reports/profile.png``.
        trace: ``TraceConfig`` options: a torch.profiler trace per global rank (off by default).
        memory_snapshot: ``MemorySnapshotConfig`` options: the CUDA allocator history (GPU only, off by default).
        clock: the host clock (tests patch it).
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        peak_flops: float | None = None,
        mfu: bool = True,
        straggler_warn_pct: float = 10.0,
        plot: bool = True,
        trace: Mapping[str, Any] | None = None,
        memory_snapshot: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ConfigError(
                f"{OPTION}.log_every_n_steps must be >= 1 (or null: the trainer's), got {log_every_n_steps}"
            )
        if peak_flops is not None and not peak_flops > 0:
            raise ConfigError(f"{OPTION}.peak_flops must be a positive FLOP/s per device (or null), got {peak_flops}")
        self.trace = _options(TraceConfig, "trace", trace)
        self.memory_snapshot = _options(MemorySnapshotConfig, "memory_snapshot", memory_snapshot)
        t = self.trace
        for name in ("skip_first", "wait", "warmup", "repeat"):
            if getattr(t, name) < 0:
                raise ConfigError(f"{OPTION}.trace.{name} must be >= 0, got {getattr(t, name)}")
        if t.active < 1:
            raise ConfigError(f"{OPTION}.trace.active must be >= 1, got {t.active}")
        self.log_every_n_steps = log_every_n_steps
        self.peak_flops_override = float(peak_flops) if peak_flops is not None else None
        self.mfu = mfu
        self.straggler_warn_pct = straggler_warn_pct
        self.plot = plot
        self._now = clock
        self._reset()

    def _reset(self) -> None:
        self._timer: StepTimer | None = None
        self._device = torch.device("cpu")
        self._every = 1
        self._world_size = 1
        self._global_rank = 0
        self._last_global_step = 0
        self._last_emit_window = 0
        self._peak_flops: float | None = None
        self._flops_per_sample: float | None = None
        self._flops_from = "counter"  # or "model": the LightningModule's flops_per_token() formula
        self._flop_counter: Any | None = None
        self._replicas = 1
        self._flop_samples = 0
        self._untimed_step = False
        self._traces: TraceRecorder | None = None
        self._snapshots = MemorySnapshots(self.memory_snapshot)
        self._windows: list[GlobalWindow] = []  # rank zero: every rank's row at every log step
        self._own_steps = array("l")  # this rank's steps, for the plot and the exact percentiles
        self._own_step_ms = array("d")
        self._own_wait_ms = array("d")
        self._reported = False
        self._retries_seen = 0.0
        self._ooms_seen = 0.0
        self._trainer: L.Trainer | None = None
        self._hooks: list[Any] = []
        self._unhook_fetch_fn: Callable[[], None] | None = None
        self._process: Any = None

    # -- setup --------------------------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        self._trainer = trainer
        self._device = trainer.strategy.root_device
        self._world_size, self._global_rank = trainer.world_size, trainer.global_rank
        self._replicas = same_batch_ranks(trainer.strategy)
        self._every = self.log_every_n_steps or trainer.log_every_n_steps or 50
        on_cuda = self._device.type == "cuda"
        if self.memory_snapshot.enabled and not on_cuda:
            raise ConfigError(
                f"{OPTION}.memory_snapshot.enabled=true needs a CUDA device; this run is on "
                f"{self._device.type}: set it to false or use a GPU trainer"
            )
        self._timer = StepTimer(CudaClock(self._device) if on_cuda else CpuClock(self._now))
        import psutil

        self._process = psutil.Process()
        self._peak_flops = self._find_peak_flops(trainer) if self.mfu else None

    def _find_peak_flops(self, trainer: L.Trainer) -> float | None:
        if self.peak_flops_override is not None:
            return self.peak_flops_override
        if self._device.type != "cuda":  # no table for CPUs: MFU is absent rather than a made-up number
            return None
        from lightning.fabric.utilities.throughput import get_available_flops

        dtype = compute_dtype(trainer)
        peak = get_available_flops(self._device, dtype)
        if peak is None:
            self._say_rank_zero(
                f"profiling: MFU is not reported: Lightning has no peak FLOP/s for "
                f"{torch.cuda.get_device_name(self._device)!r} in {dtype}; set {OPTION}.peak_flops"
            )
        return float(peak) if peak else None

    # -- the loop -----------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_global_step = trainer.global_step
        self._last_emit_window = trainer.global_step // self._every
        self._hook_forward(trainer)
        self._hook_fetch(trainer)
        if self.trace.enabled:
            self._traces = TraceRecorder(self.trace, self._device, self._trace_path)
        if self.memory_snapshot.enabled:
            self._snapshots.start()

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._timer.resume()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking and self._timer is not None:
            self._timer.pause()

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        formula = getattr(pl_module, "flops_per_token", None)
        if self._peak_flops and self._flops_per_sample is None and callable(formula):
            # the model states its FLOPs per token (a formula, e.g. 6N + attention): no counting, no untimed step
            samples, tokens = batch_counts(batch)
            self._flops_per_sample = float(formula()) * tokens / max(samples, 1)
            self._flops_from = "model"
        if self._peak_flops and self._flops_per_sample is None and self._flop_counter is None:
            from torch.utils.flop_counter import FlopCounterMode

            # Count this one real batch's forward and backward, rather than run the model again on the side.
            self._flop_counter = FlopCounterMode(display=False)
            self._flop_counter.__enter__()
            self._flop_samples = batch_counts(batch)[0]
        self._timer.batch_start()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._timer is not None:
            self._timer.before_backward()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._stop_flop_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._flop_counter is not None:
            self._stop_flop_counter()
        step = trainer.global_step
        stepped = step != self._last_global_step
        self._last_global_step = step
        samples, tokens = batch_counts(batch)
        # The step whose FLOPs were counted ran slower under the counter: it is not timed.
        self._timer.batch_end(samples, tokens, stepped, step, keep=not self._untimed_step)
        if not stepped:
            return
        self._untimed_step = False
        if self._traces is not None:
            self._traces.step()
        snap = self.memory_snapshot
        if snap.enabled and snap.at_step is not None and step >= snap.at_step:
            self._snapshots.dump(self._snapshot_path())
        if step // self._every > self._last_emit_window:
            self._last_emit_window = step // self._every
            self._emit(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The last, partial window. Every rank has made the same steps, so all or none gather here.
        if trainer.global_step > self._last_emit_window * self._every:
            self._last_emit_window = math.ceil(trainer.global_step / self._every)
            self._emit(trainer)
        self._unhook_forward()
        self._unhook_fetch()
        self._stop_trace()
        if self.memory_snapshot.enabled:
            self._snapshots.dump(self._snapshot_path())
            self._snapshots.stop()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write_report(trainer, complete=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # No collectives here: the other ranks may be gone. Keep what this rank has.
        self._stop_flop_counter()
        self._unhook_forward()
        self._unhook_fetch()
        self._stop_trace()
        if self.memory_snapshot.enabled and isinstance(exception, torch.OutOfMemoryError):
            self._snapshots.dump(self._snapshot_path(), again=True)
        # a run that failed before its first training step has nothing to report
        if self._timer is not None and trainer.state.fn == "fit" and trainer.global_step > 0:
            try:
                self._write_report(trainer, complete=False)
            except Exception as err:  # noqa: BLE001  the run's own exception is the one the user must see
                say(f"profiling: no partial report after the failure ({type(err).__name__}: {err})")

    # -- measuring ----------------------------------------------------------------------------------------------------
    def _hook_forward(self, trainer: L.Trainer) -> None:
        """Under DDP, mark the wrapped model's forward and its inner module's: in between, DDP broadcasts buffers,
        where a fast rank waits for a slow one before the gradient sync. That wait is not the rank's own time."""
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            self._hooks = [
                model.register_forward_pre_hook(lambda *_: self._timer.forward_enter()),
                model.module.register_forward_pre_hook(lambda *_: self._timer.forward_synced()),
            ]

    def _hook_fetch(self, trainer: L.Trainer) -> None:
        """Time the training loop's fetch of each batch: that, not the whole gap between two batches (other
        callbacks' hooks, logging), is the data wait (DATA_WAIT). Without the loop's fetch marks the timer counts
        the whole gap as data wait (StepTimer._resolve)."""
        self._unhook_fetch_fn = hook_fetch(trainer, self._timer.fetch_start, self._timer.fetch_end)

    def _unhook_fetch(self) -> None:
        if self._unhook_fetch_fn is not None:
            self._unhook_fetch_fn()
            self._unhook_fetch_fn = None

    def _unhook_forward(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _stop_flop_counter(self) -> None:
        if self._flop_counter is None:
            return
        counter, self._flop_counter = self._flop_counter, None
        self._untimed_step = True
        counter.__exit__(None, None, None)
        total = counter.get_total_flops()
        self._flops_per_sample = total / max(self._flop_samples, 1) if total else 0.0
        if not total:
            self._say_rank_zero("profiling: MFU is not reported: the FLOP counter saw no matmuls or convolutions")

    def _emit(self, trainer: L.Trainer) -> None:
        records = self._timer.take()
        for r in records:
            self._own_steps.append(r.step)
            self._own_step_ms.append(r.step_time_s * 1e3)
            self._own_wait_ms.append(r.data_wait_s * 1e3)
        memory = MemoryStats.sample(self._device, self._process)
        mine = RankWindow(self._global_rank, WindowStats.from_records(records), memory)
        if self._world_size > 1:
            row = torch.tensor(mine.encode(), dtype=torch.float64, device=self._device)
            gathered = trainer.strategy.all_gather(row).reshape(self._world_size, RankWindow.width())
            ranks = [RankWindow.decode(r) for r in gathered.cpu().tolist()]
        else:
            ranks = [mine]
        if trainer.is_global_zero:
            straggler = find_straggler(trainer.global_step, ranks)
            self._on_window(
                trainer,
                GlobalWindow(
                    trainer.global_step,
                    ranks,
                    straggler,
                    self._flops_per_sample or None,
                    self._peak_flops,
                    self._replicas,
                ),
            )

    def _on_window(self, trainer: L.Trainer, window: GlobalWindow) -> None:
        """Rank zero: keep the window, log its figures, say what needs saying."""
        self._windows.append(window)
        own = next(r for r in window.ranks if r.global_rank == self._global_rank)
        w = own.window
        if w.steps == 0:
            return
        metrics = {
            "perf/step_time_ms_p50": w.step_time_s_p50 * 1e3,
            "perf/step_time_ms_p90": w.step_time_s_p90 * 1e3,
            "perf/step_time_ms_max": w.step_time_s_max * 1e3,
            "perf/data_wait_ms": w.data_wait_s / w.steps * 1e3,
            "perf/data_wait_pct": w.data_wait_pct,
            "perf/samples_per_s": w.samples_per_s / self._replicas,
            "perf/samples_per_s_global": window.samples_per_s_global,
        }
        if window.tokens:
            # per device: this rank's share of the distinct tokens (tensor-parallel peers share their batch)
            metrics["perf/tokens_per_s"] = w.tokens_per_s / self._replicas
            metrics["perf/tokens_per_s_global"] = window.tokens_per_s_global
        if window.mfu_pct is not None:
            metrics["perf/mfu_pct"] = window.mfu_pct
        for name in ("rss_gib", "max_allocated_gib", "max_reserved_gib"):
            values = [getattr(r.memory, name) for r in window.ranks if not math.isnan(getattr(r.memory, name))]
            if values:
                metrics[f"perf/{name}_min"], metrics[f"perf/{name}_max"] = min(values), max(values)
        for name in ("alloc_retries", "ooms"):
            values = [getattr(r.memory, name) for r in window.ranks if not math.isnan(getattr(r.memory, name))]
            if values:
                metrics[f"perf/{name}"] = sum(values)
        s = window.straggler
        if s is not None:
            metrics["perf/straggler_global_rank"] = float(s.global_rank)
            metrics["perf/straggler_lag_ms"] = s.lag_s * 1e3
            self._report_straggler(trainer, window)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        self._say_memory_problems(window)

    def _report_straggler(self, trainer: L.Trainer, window: GlobalWindow) -> None:
        s = window.straggler
        record = {
            "kind": "straggler",
            "global_step": window.step,
            "ranks": [s.global_rank],
            "world_size": self._world_size,
            "slowest_global_rank": s.global_rank,
            "lag_ms": s.lag_s * 1e3,
            "lag_pct": s.lag_pct,
            "wait_for_slowest_ms_mean": s.wait_for_slowest_s_mean * 1e3,
            "pre_sync_ms_mean": {str(r.global_rank): r.window.pre_sync_s_mean * 1e3 for r in window.ranks},
            "step_time_ms_p50": {str(r.global_rank): r.window.step_time_s_p50 * 1e3 for r in window.ranks},
        }
        append_jsonl(reports_dir(trainer) / "stragglers.jsonl", record)
        if s.lag_pct >= self.straggler_warn_pct:
            say(
                f"straggler: global rank {s.global_rank} was the slowest rank up to step {window.step}: it reached the "
                f"gradient sync {s.lag_s * 1e3:.1f} ms ({s.lag_pct:.0f}% of a step) after the median of the other "
                f"ranks, who waited for it."
            )

    def _say_memory_problems(self, window: GlobalWindow) -> None:
        retries = sum(r.memory.alloc_retries for r in window.ranks if not math.isnan(r.memory.alloc_retries))
        ooms = sum(r.memory.ooms for r in window.ranks if not math.isnan(r.memory.ooms))
        if retries > self._retries_seen:
            say(
                f"memory: {retries - self._retries_seen:.0f} CUDA allocation retries (cache flushes) up to step "
                f"{window.step}, summed over ranks: memory is near its limit or fragmented."
            )
        if ooms > self._ooms_seen:
            say(
                f"memory: {ooms - self._ooms_seen:.0f} CUDA out-of-memory errors up to step {window.step}, summed over "
                f"ranks."
            )
        self._retries_seen, self._ooms_seen = max(retries, self._retries_seen), max(ooms, self._ooms_seen)

    # -- traces -------------------------------------------------------------------------------------------------------
    def _trace_path(self, prof_step: int) -> Path:
        step = self._trainer.global_step if self._trainer is not None else prof_step
        return run_dir(self._trainer) / "traces" / f"rank{self._global_rank}_step{step}.pt.trace.json"

    def _snapshot_path(self) -> Path:
        step = self._trainer.global_step if self._trainer is not None else 0
        return run_dir(self._trainer) / "traces" / f"memory_rank{self._global_rank}_step{step}.pickle"

    def _stop_trace(self) -> None:
        if self._traces is not None:
            self._traces.stop()

    # -- the report ---------------------------------------------------------------------------------------------------
    @rank_zero_only
    def _say_rank_zero(self, message: str) -> None:
        say(message)

    @rank_zero_only
    def _write_report(self, trainer: L.Trainer, complete: bool) -> None:
        if self._reported:
            return
        self._reported = True
        report = self._build_report(trainer, complete)
        out = reports_dir(trainer)
        files = {"json": str(out / "profile.json"), "markdown": str(out / "profile.md")}
        if self.plot:
            try:
                plot_profile(out / "profile.png", self._own_steps, self._own_step_ms, self._windows)
                files["plot"] = str(out / "profile.png")
            except Exception as err:  # noqa: BLE001  (a broken matplotlib install must not fail a finished run)
                say(f"profiling: the plot was not drawn ({type(err).__name__}: {err})")
        report["files"] = files
        write_json(out / "profile.json", report)
        (out / "profile.md").write_text(render_markdown(report))
        st, th = report["step_time_ms"], report["throughput"]
        mfu = f", MFU {num(report['mfu']['mfu_pct'], '.1f')}%" if "mfu" in report else ""
        # A run that failed before its first measured step has no numbers: say so, never fail on formatting them.
        say(
            f"profile up to global step {trainer.global_step} (global rank {trainer.global_rank} reporting): "
            f"{report['steps_measured']} steps measured, step time p50 {num(st['p50'], '.2f')} ms (p90 "
            f"{num(st['p90'], '.2f')}, max {num(st['max'], '.2f')}), data wait "
            f"{num(report['data_wait']['pct'], '.1f')}%, "
            f"{num(th['samples_per_s_global'], '.0f')} samples/s over {self._world_size} rank(s){mfu}; report in "
            f"{out / 'profile.md'}",
            level=logging.INFO,
        )

    def _build_report(self, trainer: L.Trainer, complete: bool) -> dict[str, Any]:
        info = RunInfo(
            global_step=trainer.global_step,
            global_rank=self._global_rank,
            world_size=self._world_size,
            complete=complete,
            device=str(self._device.type if self._device.type != "cuda" else torch.cuda.get_device_name(self._device)),
            log_every_n_steps=self._every,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            flops_from=self._flops_from,
            peak_from="config" if self.peak_flops_override is not None else "lightning",
        )
        report = build_report(info, self._windows, self._own_step_ms, self._own_wait_ms)
        if "stragglers" in report:
            report["stragglers"]["file"] = str(reports_dir(trainer) / "stragglers.jsonl")
        trace_files = self._traces.files if self._traces is not None else []
        if trace_files:
            report["traces_dir"] = str(Path(trace_files[0]).parent)
            report["traces"] = sorted(Path(p).name for p in trace_files)  # rank zero's; each rank writes its own
        if self._snapshots.files:
            report["memory_snapshots"] = sorted(Path(p).name for p in self._snapshots.files)
        return json_ready(report)


def same_batch_ranks(strategy: Any) -> int:
    """How many ranks train on each batch: the tensor-parallel size under ModelParallelStrategy, else 1."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return int(strategy.device_mesh["tensor_parallel"].size())
    return 1
