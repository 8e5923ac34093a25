"""The numbers behind ``ProfilingCallback``: window statistics, the row each rank gathers, the straggler finder, MFU.

Nothing here touches the Trainer, so the math is tested with a patched clock (tests/test_profiling.py).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from lit_template.diagnostics.profiling.timer import StepRecord

GIB = 1024**3


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
    def from_records(cls, records: Sequence[StepRecord]) -> WindowStats:
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

    @classmethod
    def merge(cls, parts: Sequence[WindowStats]) -> WindowStats:
        """Several windows of one rank as one (the whole run): sums add up; p50 and p90 are the medians of the
        windows' (the step times themselves are not kept), max is the max."""
        parts = [p for p in parts if p.steps]
        return cls(
            steps=sum(p.steps for p in parts),
            time_s=sum(p.time_s for p in parts),
            data_wait_s=sum(p.data_wait_s for p in parts),
            pre_sync_s=sum(p.pre_sync_s for p in parts),
            samples=sum(p.samples for p in parts),
            tokens=sum(p.tokens for p in parts),
            step_time_s_p50=percentile([p.step_time_s_p50 for p in parts], 50),
            step_time_s_p90=percentile([p.step_time_s_p90 for p in parts], 50),
            step_time_s_max=max((p.step_time_s_max for p in parts), default=math.nan),
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


def _max(values: Sequence[float]) -> float:
    present = [v for v in values if not math.isnan(v)]
    return max(present) if present else math.nan


class ResidentMemory:
    """This process's resident set size in bytes. On Linux one ``pread`` of ``/proc/self/statm`` kept open (a few
    microseconds; ``psutil.Process().memory_info()`` opens and parses the file each time, about 100 us a call inside
    a training step here); elsewhere psutil. Reopened in a forked child (the file names the process that opened it)."""

    def __init__(self) -> None:
        self._pid = -1
        self._fd: int | None = None
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._psutil: Any = None

    def bytes(self) -> int:
        if self._pid != os.getpid():
            self._open()
        if self._fd is None:
            return self._psutil.memory_info().rss
        # statm: size resident shared text lib data dt, in pages
        return int(os.pread(self._fd, 128, 0).split()[1]) * self._page

    def _open(self) -> None:
        self.close()
        self._pid = os.getpid()
        try:
            self._fd = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:  # not Linux
            import psutil

            self._psutil = psutil.Process()

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class MemoryStats:
    """Sampled at a log step. NaN where it does not apply (GPU figures on the CPU)."""

    rss_gib: float = math.nan
    max_allocated_gib: float = math.nan
    max_reserved_gib: float = math.nan
    alloc_retries: float = math.nan
    ooms: float = math.nan

    @classmethod
    def merge(cls, parts: Sequence[MemoryStats]) -> MemoryStats:
        """The highest of each figure (memory peaks, counters that only grow)."""
        return cls(**{f.name: _max([getattr(p, f.name) for p in parts]) for f in fields(cls)})

    @classmethod
    def sample(cls, device: torch.device, resident: ResidentMemory | None = None) -> MemoryStats:
        """``resident``: a ``ResidentMemory`` to reuse (one per process)."""
        rss = (resident or ResidentMemory()).bytes() / GIB
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
        return (
            [float(self.global_rank)]
            + [float(getattr(self.window, f.name)) for f in fields(WindowStats)]
            + [float(getattr(self.memory, f.name)) for f in fields(MemoryStats)]
        )

    @classmethod
    def decode(cls, row: Sequence[float]) -> RankWindow:
        n_w = len(fields(WindowStats))
        w_vals, m_vals = row[1 : 1 + n_w], row[1 + n_w :]
        window = WindowStats(
            **{
                f.name: (int(v) if f.name == "steps" else float(v))
                for f, v in zip(fields(WindowStats), w_vals, strict=True)
            }
        )
        memory = MemoryStats(**{f.name: float(v) for f, v in zip(fields(MemoryStats), m_vals, strict=True)})
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
    return Straggler(
        step, slowest, lag, 100.0 * lag / step_time if step_time > 0 else math.nan, sum(waits) / len(waits)
    )


@dataclass
class GlobalWindow:
    """All ranks' rows at one log step, and what is derived from them."""

    step: int
    ranks: list[RankWindow]
    straggler: Straggler | None = None
    flops_per_sample: float | None = None
    peak_flops: float | None = None
    # ranks that train on the same batch (tensor-parallel peers): the global counts are of distinct samples
    replicas: int = 1

    @classmethod
    def merge(cls, windows: Sequence[GlobalWindow]) -> GlobalWindow:
        """The whole run as one window: each rank's windows merged, so the run's throughput and MFU are computed by
        the same properties as a window's. Its step is the last window's; it has no straggler of its own."""
        per_rank: dict[int, list[RankWindow]] = {}
        for w in windows:
            for r in w.ranks:
                per_rank.setdefault(r.global_rank, []).append(r)
        ranks = [
            RankWindow(rank, WindowStats.merge([r.window for r in rows]), MemoryStats.merge([r.memory for r in rows]))
            for rank, rows in sorted(per_rank.items())
        ]
        last = windows[-1] if windows else None
        return cls(
            last.step if last else 0,
            ranks,
            None,
            last.flops_per_sample if last else None,
            last.peak_flops if last else None,
            last.replicas if last else 1,
        )

    def rank(self, global_rank: int) -> RankWindow | None:
        return next((r for r in self.ranks if r.global_rank == global_rank), None)

    @property
    def samples(self) -> float:
        return sum(r.window.samples for r in self.ranks) / self.replicas

    @property
    def tokens(self) -> float:
        return sum(r.window.tokens for r in self.ranks) / self.replicas

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
