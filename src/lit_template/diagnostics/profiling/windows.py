"""Each log window: gathering every rank's row, then what rank zero does with it (the ``perf/*`` metrics, the
straggler record, memory alarms).

Apart from ``gather_ranks`` (one all_gather), pure functions of a ``GlobalWindow`` (no Trainer): ``ProfilingCallback``
logs what they return and writes the records.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from lit_template.diagnostics.profiling.stats import GlobalWindow, RankWindow
from lit_template.diagnostics.profiling.timer import StepRecord


def gather_ranks(strategy: Any, mine: RankWindow, world_size: int, device: torch.device) -> list[RankWindow]:
    """Every rank's window, in rank order: one all_gather of a float64 row per rank (every rank must call it)."""
    if world_size == 1:
        return [mine]
    row = torch.tensor(mine.encode(), dtype=torch.float64, device=device)
    gathered = strategy.all_gather(row).reshape(world_size, RankWindow.width())
    return [RankWindow.decode(r) for r in gathered.cpu().tolist()]


class OwnSeries:
    """This rank's every measured step (for the plot and the report's exact percentiles), in compact arrays."""

    def __init__(self) -> None:
        self.steps, self.step_ms, self.wait_ms = array("l"), array("d"), array("d")

    def extend(self, records: Sequence[StepRecord]) -> None:
        for r in records:
            self.steps.append(r.step)
            self.step_ms.append(r.step_time_s * 1e3)
            self.wait_ms.append(r.data_wait_s * 1e3)


def _present(window: GlobalWindow, name: str) -> list[float]:
    """Each rank's memory figure ``name``, without the ranks that cannot measure it (NaN: no CUDA)."""
    return [v for v in (getattr(r.memory, name) for r in window.ranks) if not math.isnan(v)]


def window_metrics(window: GlobalWindow, global_rank: int, replicas: int) -> dict[str, float]:
    """The ``perf/*`` metrics of one window, as rank ``global_rank`` logs them; empty if it made no step."""
    own = window.rank(global_rank)
    w = own.window if own is not None else None
    if w is None or w.steps == 0:
        return {}
    metrics = {
        "perf/step_time_ms_p50": w.step_time_s_p50 * 1e3,
        "perf/step_time_ms_p90": w.step_time_s_p90 * 1e3,
        "perf/step_time_ms_max": w.step_time_s_max * 1e3,
        "perf/data_wait_ms": w.data_wait_s / w.steps * 1e3,
        "perf/data_wait_pct": w.data_wait_pct,
        # per device: this rank's share of the distinct samples (tensor-parallel peers share their batch)
        "perf/samples_per_s": w.samples_per_s / replicas,
        "perf/samples_per_s_global": window.samples_per_s_global,
    }
    if window.tokens:
        metrics["perf/tokens_per_s"] = w.tokens_per_s / replicas
        metrics["perf/tokens_per_s_global"] = window.tokens_per_s_global
    if window.mfu_pct is not None:
        metrics["perf/mfu_pct"] = window.mfu_pct
    for name in ("rss_gib", "max_allocated_gib", "max_reserved_gib"):
        values = _present(window, name)
        if values:
            metrics[f"perf/{name}_min"], metrics[f"perf/{name}_max"] = min(values), max(values)
    for name in ("alloc_retries", "ooms"):
        values = _present(window, name)
        if values:
            metrics[f"perf/{name}"] = sum(values)
    if window.straggler is not None:
        metrics["perf/straggler_global_rank"] = float(window.straggler.global_rank)
        metrics["perf/straggler_lag_ms"] = window.straggler.lag_s * 1e3
    return metrics


def straggler_record(window: GlobalWindow, world_size: int) -> dict[str, Any]:
    """The line of ``reports/stragglers.jsonl`` for a window that has a straggler."""
    s = window.straggler
    return {
        "kind": "straggler",
        "global_step": window.step,
        "ranks": [s.global_rank],
        "world_size": world_size,
        "slowest_global_rank": s.global_rank,
        "lag_ms": s.lag_s * 1e3,
        "lag_pct": s.lag_pct,
        "wait_for_slowest_ms_mean": s.wait_for_slowest_s_mean * 1e3,
        "pre_sync_ms_mean": {str(r.global_rank): r.window.pre_sync_s_mean * 1e3 for r in window.ranks},
        "step_time_ms_p50": {str(r.global_rank): r.window.step_time_s_p50 * 1e3 for r in window.ranks},
    }


def straggler_sentence(window: GlobalWindow) -> str:
    s = window.straggler
    return (
        f"straggler: global rank {s.global_rank} was the slowest rank up to step {window.step}: it reached the "
        f"gradient sync {s.lag_s * 1e3:.1f} ms ({s.lag_pct:.0f}% of a step) after the median of the other "
        f"ranks, who waited for it."
    )


class MemoryAlarms:
    """Says once per window when CUDA allocation retries or out-of-memory errors (summed over ranks) went up."""

    def __init__(self) -> None:
        self.retries_seen = 0.0
        self.ooms_seen = 0.0

    def sentences(self, window: GlobalWindow) -> list[str]:
        retries, ooms = sum(_present(window, "alloc_retries")), sum(_present(window, "ooms"))
        said = []
        if retries > self.retries_seen:
            said.append(
                f"memory: {retries - self.retries_seen:.0f} CUDA allocation retries (cache flushes) up to step "
                f"{window.step}, summed over ranks: memory is near its limit or fragmented."
            )
        if ooms > self.ooms_seen:
            said.append(
                f"memory: {ooms - self.ooms_seen:.0f} CUDA out-of-memory errors up to step {window.step}, summed "
                "over ranks."
            )
        self.retries_seen, self.ooms_seen = max(retries, self.retries_seen), max(ooms, self.ooms_seen)
        return said
