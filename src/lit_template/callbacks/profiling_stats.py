"""The numbers behind ``ProfilingCallback``: clocks, per-step records, window statistics, the row each rank gathers,
the straggler finder, and the report's Markdown table and plot.

Nothing here touches the Trainer, so the math is tested with a patched clock (tests/test_profiling.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Sequence

import torch

GIB = 1024**3


# -- clocks ----------------------------------------------------------------------------------------------------------
class CpuClock:
    """Host time. ``now`` is injectable so tests can drive it."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now

    def mark(self) -> float:
        return self.now()

    def host_now(self) -> float:
        return self.now()

    def settle(self) -> None:
        pass

    @staticmethod
    def elapsed_s(start: float, end: float) -> float:
        return end - start


class CudaClock:
    """Device time from CUDA events: a mark is an event recorded on the current stream, never a synchronize.

    ``settle`` waits for the newest event once, at a log step; only then are the elapsed times read.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last: torch.cuda.Event | None = None

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._last = event
        return event

    @staticmethod
    def host_now() -> float:
        # the loop's wait for a batch happens on the host; no event is needed (nor meaningful) for it
        return time.perf_counter()

    def settle(self) -> None:
        if self._last is not None:
            self._last.synchronize()

    @staticmethod
    def elapsed_s(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3


# -- one optimizer step ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepRecord:
    """One optimizer step on one rank (all its micro-batches when gradients are accumulated)."""

    step: int  # trainer.global_step after the step
    step_time_s: float  # end of the previous step -> end of this one, validation excluded
    # of which the loop waited for batches: host time inside the training dataloader's next() (Lightning's fetch),
    # plus, for an epoch's first batch, the time to create the iterator (workers starting)
    data_wait_s: float
    # This rank's own time before the gradient sync: step start -> backward of its last micro-batch, less what it
    # waited inside forward for the other ranks (DDP's buffer broadcast). The rank with the most is the one the
    # others wait for.
    pre_sync_s: float
    samples: int
    tokens: int  # 0 when the batches have no sequence dimension


@dataclass
class _MicroBatch:
    wait_from: Any | None  # mark at the previous batch end or epoch start; None after validation (not measured)
    start: Any
    # host seconds spent fetching this batch (None: no fetch was seen, e.g. another loop; the gap counts instead)
    fetch_s: float | None = None
    forward_enter: Any | None = None  # the wrapped (DDP) model's forward called ...
    forward_synced: Any | None = None  # ... and past its collectives, the inner module's forward begins
    before_backward: Any | None = None
    end: Any | None = None


@dataclass
class _PendingStep:
    step: int
    micro: list[_MicroBatch]
    samples: int
    tokens: int


class StepTimer:
    """Marks the loop events of the training batches and turns them into ``StepRecord`` s when asked.

    Marks are resolved only in ``take`` (a log step), so CUDA events are read without a synchronize per batch.
    """

    def __init__(self, clock: CpuClock | CudaClock) -> None:
        self.clock = clock
        self._last_end: Any | None = None
        self._micro: list[_MicroBatch] = []
        self._samples = self._tokens = 0
        self._pending: list[_PendingStep] = []
        # host time fetching since the last batch start; where the epoch began (iterator creation counts as wait)
        self._fetch_s: float | None = None
        self._fetch_from: float | None = None
        self._epoch_start_host: float | None = None

    def resume(self) -> None:
        """Epoch start: the wait for the first batch (iterator and workers starting) counts as data wait."""
        self._last_end = self.clock.mark()
        # on the CPU the mark is host time already (one clock reading, which keeps a ticking test clock simple)
        self._epoch_start_host = self._last_end if isinstance(self.clock, CpuClock) else self.clock.host_now()
        self._micro, self._samples, self._tokens = [], 0, 0
        self._fetch_s = None

    def fetch_start(self) -> None:
        now = self.clock.host_now()
        if self._epoch_start_host is not None:
            # the epoch's first fetch: creating the iterator (starting workers) was waiting for data too
            self._fetch_s = (self._fetch_s or 0.0) + (now - self._epoch_start_host)
            self._epoch_start_host = None
        self._fetch_from = now

    def fetch_end(self) -> None:
        if self._fetch_from is not None:
            self._fetch_s = (self._fetch_s or 0.0) + (self.clock.host_now() - self._fetch_from)
            self._fetch_from = None

    def pause(self) -> None:
        """Validation: the gap until the next training batch (validation, checkpointing) is not measured."""
        self._last_end = None
        self._epoch_start_host = None

    def batch_start(self) -> None:
        self._micro.append(_MicroBatch(wait_from=self._last_end, start=self.clock.mark(), fetch_s=self._fetch_s))
        self._fetch_s = None

    def _open(self) -> _MicroBatch | None:
        return self._micro[-1] if self._micro and self._micro[-1].end is None else None

    def forward_enter(self) -> None:
        mb = self._open()
        if mb is not None and mb.forward_enter is None:
            mb.forward_enter = self.clock.mark()

    def forward_synced(self) -> None:
        mb = self._open()
        if mb is not None and mb.forward_enter is not None and mb.forward_synced is None:
            mb.forward_synced = self.clock.mark()

    def before_backward(self) -> None:
        mb = self._open()
        if mb is not None:
            mb.before_backward = self.clock.mark()

    def batch_end(self, samples: int, tokens: int, stepped: bool, step: int, keep: bool = True) -> None:
        if not self._micro:  # a batch_end without its start: nothing to time
            return
        self._last_end = self._micro[-1].end = self.clock.mark()
        self._samples += samples
        self._tokens += tokens
        if stepped:
            if keep:
                self._pending.append(_PendingStep(step, self._micro, self._samples, self._tokens))
            self._micro, self._samples, self._tokens = [], 0, 0

    def take(self) -> list[StepRecord]:
        """The steps completed since the last call, resolved (one wait on the device when the clock is CUDA)."""
        if not self._pending:
            return []
        self.clock.settle()
        records = [self._resolve(p) for p in self._pending]
        self._pending = []
        return records

    def _resolve(self, pending: _PendingStep) -> StepRecord:
        elapsed = self.clock.elapsed_s
        step_s = wait_s = pre_sync_s = forward_wait_s = 0.0
        for i, mb in enumerate(pending.micro):
            # the gap since the previous batch's end: the fetch, other callbacks' batch-end hooks, logging
            gap = elapsed(mb.wait_from, mb.start) if mb.wait_from is not None else 0.0
            # (clamped to the gap: on a GPU the gap is device time, the fetch host time)
            wait = 0.0 if mb.wait_from is None else gap if mb.fetch_s is None else min(mb.fetch_s, gap)
            busy = elapsed(mb.start, mb.end)
            if mb.forward_enter is not None and mb.forward_synced is not None:
                forward_wait_s += elapsed(mb.forward_enter, mb.forward_synced)
            if i == len(pending.micro) - 1:
                to_backward = elapsed(mb.start, mb.before_backward) if mb.before_backward is not None else busy
                pre_sync_s = step_s + gap + to_backward - forward_wait_s
            step_s += gap + busy
            wait_s += wait
        return StepRecord(pending.step, step_s, wait_s, pre_sync_s, pending.samples, pending.tokens)


# -- statistics ------------------------------------------------------------------------------------------------------
def _ratio(amount: float, per: float) -> float:
    """``amount / per`` (a rate, a share, a mean); NaN when there is nothing to divide by (no steps, no time)."""
    return amount / per if per > 0 else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class WindowStats:
    """One rank's steps between two log steps."""

    steps: int
    time_s: float
    data_wait_s: float
    pre_sync_s: float
    samples: float
    tokens: float
    step_time_s_p50: float
    step_time_s_p90: float
    step_time_s_max: float

    @classmethod
    def from_records(cls, records: Sequence[StepRecord]) -> "WindowStats":
        times = [r.step_time_s for r in records]
        return cls(
            steps=len(records),
            time_s=sum(times),
            data_wait_s=sum(r.data_wait_s for r in records),
            pre_sync_s=sum(r.pre_sync_s for r in records),
            samples=sum(r.samples for r in records),
            tokens=sum(r.tokens for r in records),
            step_time_s_p50=percentile(times, 50),
            step_time_s_p90=percentile(times, 90),
            step_time_s_max=max(times) if times else math.nan,
        )

    @property
    def data_wait_pct(self) -> float:
        return 100.0 * _ratio(self.data_wait_s, self.time_s)

    @property
    def samples_per_s(self) -> float:
        return _ratio(self.samples, self.time_s)

    @property
    def tokens_per_s(self) -> float:
        return _ratio(self.tokens, self.time_s)

    @property
    def step_time_s_mean(self) -> float:
        return _ratio(self.time_s, self.steps)

    @property
    def pre_sync_s_mean(self) -> float:
        return _ratio(self.pre_sync_s, self.steps)


@dataclass(frozen=True)
class MemoryStats:
    """Sampled at a log step. NaN where it does not apply (GPU figures on the CPU)."""

    rss_gib: float = math.nan
    max_allocated_gib: float = math.nan
    max_reserved_gib: float = math.nan
    alloc_retries: float = math.nan
    ooms: float = math.nan

    @classmethod
    def sample(cls, device: torch.device, process: Any = None) -> "MemoryStats":
        """``process``: a ``psutil.Process`` to reuse (making one reads several files in /proc)."""
        if process is None:
            import psutil

            process = psutil.Process()
        rss = process.memory_info().rss / GIB
        if device.type != "cuda":
            return cls(rss_gib=rss)
        stats = torch.cuda.memory_stats(device)
        return cls(
            rss_gib=rss,
            max_allocated_gib=torch.cuda.max_memory_allocated(device) / GIB,
            max_reserved_gib=torch.cuda.max_memory_reserved(device) / GIB,
            alloc_retries=float(stats.get("num_alloc_retries", 0)),
            ooms=float(stats.get("num_ooms", 0)),
        )


@dataclass(frozen=True)
class RankWindow:
    """What each rank contributes at a log step: one row of floats in one all_gather."""

    global_rank: int
    window: WindowStats
    memory: MemoryStats

    def encode(self) -> list[float]:
        return [float(self.global_rank)] + [float(getattr(self.window, f.name)) for f in fields(WindowStats)] + [
            float(getattr(self.memory, f.name)) for f in fields(MemoryStats)
        ]

    @classmethod
    def decode(cls, row: Sequence[float]) -> "RankWindow":
        n_w = len(fields(WindowStats))
        w_vals, m_vals = row[1 : 1 + n_w], row[1 + n_w :]
        window = WindowStats(**{f.name: (int(v) if f.name == "steps" else float(v))
                                for f, v in zip(fields(WindowStats), w_vals)})
        memory = MemoryStats(**{f.name: float(v) for f, v in zip(fields(MemoryStats), m_vals)})
        return cls(int(row[0]), window, memory)

    @staticmethod
    def width() -> int:
        return 1 + len(fields(WindowStats)) + len(fields(MemoryStats))


@dataclass(frozen=True)
class Straggler:
    """The rank that reached the gradient sync last in a window, and by how much."""

    step: int
    global_rank: int
    lag_s: float  # its pre-sync time minus the median of the other ranks'
    lag_pct: float  # of the median step time: the share of every step the other ranks spent waiting for it
    wait_for_slowest_s_mean: float  # the mean over ranks of (slowest pre-sync - own pre-sync)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def find_straggler(step: int, ranks: Sequence[RankWindow]) -> Straggler | None:
    """The slowest rank of a window, or None with one rank or no steps."""
    live = [r for r in ranks if r.window.steps > 0]
    if len(live) < 2:
        return None
    pre_sync = {r.global_rank: r.window.pre_sync_s_mean for r in live}
    slowest = max(pre_sync, key=pre_sync.get)
    others = [v for k, v in pre_sync.items() if k != slowest]
    lag = pre_sync[slowest] - median(others)
    step_time = median([r.window.step_time_s_mean for r in live])
    waits = [pre_sync[slowest] - v for v in pre_sync.values()]
    return Straggler(step, slowest, lag, 100.0 * lag / step_time if step_time > 0 else math.nan,
                     sum(waits) / len(waits))


@dataclass
class GlobalWindow:
    """All ranks' rows at one log step, and what is derived from them."""

    step: int
    ranks: list[RankWindow]
    straggler: Straggler | None = None
    flops_per_sample: float | None = None
    peak_flops: float | None = None

    @property
    def samples(self) -> float:
        return sum(r.window.samples for r in self.ranks)

    @property
    def tokens(self) -> float:
        return sum(r.window.tokens for r in self.ranks)

    @property
    def time_s(self) -> float:
        # the slowest rank's wall time: synchronous ranks finish a window together, so this is the job's time
        return max((r.window.time_s for r in self.ranks), default=0.0)

    @property
    def samples_per_s_global(self) -> float:
        return _ratio(self.samples, self.time_s)

    @property
    def tokens_per_s_global(self) -> float:
        return _ratio(self.tokens, self.time_s)

    @property
    def mfu_pct(self) -> float | None:
        if not self.flops_per_sample or not self.peak_flops:
            return None
        return mfu_pct(self.flops_per_sample, self.samples_per_s_global / len(self.ranks), self.peak_flops)


def mfu_pct(flops_per_sample: float, samples_per_s_per_device: float, peak_flops_per_device: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak, in percent."""
    return 100.0 * flops_per_sample * samples_per_s_per_device / peak_flops_per_device


# -- batches ---------------------------------------------------------------------------------------------------------
def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"]
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for item in batch:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def batch_counts(batch: Any) -> tuple[int, int]:
    """(samples, tokens) of a batch: samples from the first tensor's first dim; tokens when that tensor holds
    integer ids with a sequence dim (``(batch, seq, ...)``, or ``input_ids`` in a dict), else 0."""
    x = _first_tensor(batch)
    if x is None or x.ndim == 0:
        return 1, 0
    samples = int(x.shape[0])
    is_ids = not (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool)
    tokens = samples * int(x.shape[1]) if is_ids and x.ndim >= 2 else 0
    return samples, tokens


# -- report rendering ------------------------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e3 else f"{value:,.0f}"
    return str(value)


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a summary table and a per-rank table."""
    st, th = report["step_time_ms"], report["throughput"]
    rows = [
        ("steps measured", report["steps_measured"]),
        ("step time p50 / p90 / max (ms)", f"{_fmt(st['p50'])} / {_fmt(st['p90'])} / {_fmt(st['max'])}"),
        ("data wait per step (ms)", _fmt(report["data_wait"]["ms_per_step"])),
        ("data wait (% of step time)", _fmt(report["data_wait"]["pct"])),
        ("samples/s per device (rank 0)", _fmt(th["samples_per_s"])),
        ("samples/s global", _fmt(th["samples_per_s_global"])),
    ]
    if "tokens_per_s_global" in th:
        rows += [("tokens/s per device (rank 0)", _fmt(th["tokens_per_s"])),
                 ("tokens/s global", _fmt(th["tokens_per_s_global"]))]
    if "mfu" in report:
        rows.append(("MFU (%)", _fmt(report["mfu"]["mfu_pct"])))
    for name, span in report["memory"].items():
        rows.append((f"{name} (min / max over ranks)", f"{_fmt(span['min'])} / {_fmt(span['max'])}"))
    if report.get("stragglers"):
        s = report["stragglers"]
        rows.append(("slowest rank (most windows)", f"{s['slowest_global_rank']} "
                                                    f"({s['times_slowest'][str(s['slowest_global_rank'])]} of "
                                                    f"{s['windows']} windows)"))
        rows.append(("straggler lag mean / max (ms)", f"{_fmt(s['lag_ms_mean'])} / {_fmt(s['lag_ms_max'])}"))
    lines = [f"# Profile: {report['ranks']} rank(s) on {report['device']}, {report['global_step']} steps", "",
             "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "## Per rank", "",
              "| rank | steps | step time mean (ms) | step time p50 (ms) | pre-sync mean (ms) | data wait (%) "
              "| samples/s | RSS max (GiB) |", "|---|---|---|---|---|---|---|---|"]
    for r in report["per_rank"]:
        lines.append(f"| {r['global_rank']} | {r['steps']} | {_fmt(r['step_time_ms_mean'])} "
                     f"| {_fmt(r['step_time_ms_p50'])} | {_fmt(r['pre_sync_ms_mean'])} | {_fmt(r['data_wait_pct'])} "
                     f"| {_fmt(r['samples_per_s'])} | {_fmt(r['rss_gib_max'])} |")
    lines += ["", "Step time runs from one optimizer step's end to the next, validation excluded; data wait is the "
              "time between a batch's end and the next batch's start; pre-sync is a rank's own time to the "
              "backward of the step's last micro-batch (less what it waited in forward for other ranks), where the "
              "gradient all-reduce makes every rank wait for the slowest.", ""]
    return "\n".join(lines)


def plot_profile(path: Any, own_steps: Sequence[int], own_step_ms: Sequence[float], windows: Iterable[GlobalWindow],
                 max_ranks_drawn: int = 16) -> None:
    """Step time over steps per rank (top) and the data-wait share (bottom), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows = list(windows)
    ranks = sorted({r.global_rank for w in windows for r in w.ranks})
    if len(ranks) > max_ranks_drawn:  # the extremes tell the story; a legend of 512 lines does not
        ranks = ranks[: max_ranks_drawn // 2] + ranks[-max_ranks_drawn // 2 :]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, height_ratios=[2, 1])
    if own_steps:
        top.plot(own_steps, own_step_ms, color="0.7", lw=0.8, label="rank 0, each step")
    for i, rank in enumerate(ranks):
        color = f"C{i % 10}"
        pts = [(w.step, r.window) for w in windows for r in w.ranks if r.global_rank == rank and r.window.steps]
        if not pts:
            continue
        xs = [p[0] for p in pts]
        top.plot(xs, [p[1].step_time_s_p50 * 1e3 for p in pts], color=color, marker="o", ms=3,
                 label=f"rank {rank}, p50 per window")
        top.plot(xs, [p[1].pre_sync_s_mean * 1e3 for p in pts], color=color, ls=":", lw=1.2,
                 label=f"rank {rank}, own time to the gradient sync")
        bottom.plot(xs, [p[1].data_wait_pct for p in pts], color=color, marker="o", ms=3, label=f"rank {rank}")
    top.set_ylabel("step time (ms)")
    top.set_ylim(bottom=0)
    top.set_title("Step time per rank (validation excluded)")
    top.legend(fontsize=7, ncol=2)
    bottom.set_ylabel("data wait (% of step)")
    bottom.set_ylim(0, 100)
    bottom.set_xlabel("optimizer step")
    bottom.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
