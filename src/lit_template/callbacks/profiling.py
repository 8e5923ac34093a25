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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.diagnostics.profiling.flops import FlopMeter
from lit_template.diagnostics.profiling.render import console_summary, plot_profile, write_profile
from lit_template.diagnostics.profiling.report import RunInfo, add_files, build_report, json_ready
from lit_template.diagnostics.profiling.stats import (
    GlobalWindow,
    MemoryStats,
    RankWindow,
    ResidentMemory,
    WindowStats,
    batch_counts,
    find_straggler,
)
from lit_template.diagnostics.profiling.timer import CpuClock, CudaClock, StepTimer
from lit_template.diagnostics.profiling.traces import (
    MemorySnapshotConfig,
    MemorySnapshots,
    TraceConfig,
    TraceRecorder,
    options,
)
from lit_template.diagnostics.profiling.windows import (
    MemoryAlarms,
    OwnSeries,
    gather_ranks,
    straggler_record,
    straggler_sentence,
    window_metrics,
)
from lit_template.diagnostics.report import append_jsonl, reports_dir, run_dir, say
from lit_template.distributed.shards import same_batch_ranks
from lit_template.errors import ConfigError
from lit_template.lightning_compat import compute_dtype

OPTION = "callbacks.profiling"


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
        self.trace = options(TraceConfig, "trace", trace)
        self.memory_snapshot = options(MemorySnapshotConfig, "memory_snapshot", memory_snapshot)
        self.log_every_n_steps = log_every_n_steps
        self.peak_flops = float(peak_flops) if peak_flops is not None else None
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
        self._flops = FlopMeter(self.mfu, self.peak_flops, self._say_rank_zero)
        self._replicas = 1
        self._traces: TraceRecorder | None = None
        self._snapshots = MemorySnapshots(self.memory_snapshot)
        self._windows: list[GlobalWindow] = []  # rank zero: every rank's row at every log step
        self._own = OwnSeries()  # this rank's steps, for the plot and the exact percentiles
        self._reported = False
        self._memory_alarms = MemoryAlarms()
        self._trainer: L.Trainer | None = None
        self._resident: ResidentMemory | None = None

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
        self._resident = ResidentMemory()
        self._flops.find_peak(self._device, compute_dtype(trainer), OPTION)

    # -- the loop -----------------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_global_step = trainer.global_step
        self._last_emit_window = trainer.global_step // self._every
        self._timer.attach(trainer)
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
        self._flops.batch_start(pl_module, batch)
        self._timer.batch_start()

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._timer is not None:
            self._timer.before_backward()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._flops.stop()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._flops.stop()
        step = trainer.global_step
        stepped = step != self._last_global_step
        self._last_global_step = step
        samples, tokens = batch_counts(batch)
        # The step whose FLOPs were counted ran slower under the counter: it is not timed.
        self._timer.batch_end(samples, tokens, stepped, step, keep=not self._flops.untimed_step)
        if not stepped:
            return
        self._flops.untimed_step = False
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
        self._timer.detach()
        self._stop_trace()
        if self.memory_snapshot.enabled:
            self._snapshots.dump(self._snapshot_path())
            self._snapshots.stop()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write_report(trainer, complete=True)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # No collectives here: the other ranks may be gone. Keep what this rank has.
        self._flops.stop()
        if self._timer is not None:
            self._timer.detach()
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
    def _emit(self, trainer: L.Trainer) -> None:
        records = self._timer.take()
        self._own.extend(records)
        memory = MemoryStats.sample(self._device, self._resident)
        mine = RankWindow(self._global_rank, WindowStats.from_records(records), memory)
        ranks = gather_ranks(trainer.strategy, mine, self._world_size, self._device)
        if trainer.is_global_zero:
            step, flops = trainer.global_step, self._flops
            straggler = find_straggler(step, ranks)
            window = GlobalWindow(
                step, ranks, straggler, flops.flops_per_sample or None, flops.peak_flops, self._replicas
            )
            self._on_window(trainer, window)

    def _on_window(self, trainer: L.Trainer, window: GlobalWindow) -> None:
        """Rank zero: keep the window, log its figures, say what needs saying."""
        self._windows.append(window)
        metrics = window_metrics(window, self._global_rank, self._replicas)
        if not metrics:
            return
        if window.straggler is not None:
            append_jsonl(reports_dir(trainer) / "stragglers.jsonl", straggler_record(window, self._world_size))
            if window.straggler.lag_pct >= self.straggler_warn_pct:
                say(straggler_sentence(window))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        for sentence in self._memory_alarms.sentences(window):
            say(sentence)

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
        markdown = write_profile(reports_dir(trainer), report, self._plot if self.plot else None)
        say(console_summary(report, self._global_rank, self._world_size, markdown), level=logging.INFO)

    def _plot(self, path: Path) -> None:
        plot_profile(path, self._own.steps, self._own.step_ms, self._windows)

    def _build_report(self, trainer: L.Trainer, complete: bool) -> dict[str, Any]:
        info = RunInfo(
            global_step=trainer.global_step,
            global_rank=self._global_rank,
            world_size=self._world_size,
            complete=complete,
            device=str(self._device.type if self._device.type != "cuda" else torch.cuda.get_device_name(self._device)),
            log_every_n_steps=self._every,
            accumulate_grad_batches=trainer.accumulate_grad_batches,
            flops_from=self._flops.flops_from,
            peak_from=self._flops.peak_from,
        )
        report = build_report(info, self._windows, self._own.step_ms, self._own.wait_ms)
        traces = self._traces.files if self._traces is not None else []
        stragglers = str(reports_dir(trainer) / "stragglers.jsonl")
        return json_ready(add_files(report, stragglers, traces, self._snapshots.files))
