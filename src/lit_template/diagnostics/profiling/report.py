"""The end-of-fit profile (``reports/profile.json``), built from the run as one :class:`GlobalWindow`.

The run's throughput, MFU and per-rank rows come from ``GlobalWindow.merge(windows)``: the same record type and the
same properties as each log window's, so a window's figures and the run's cannot disagree in definition.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_template.diagnostics.profiling.stats import GlobalWindow, RankWindow, percentile

MEMORY_FIELDS = ("rss_gib", "max_allocated_gib", "max_reserved_gib", "alloc_retries", "ooms")


@dataclass(frozen=True)
class RunInfo:
    """What the report says about the run besides the windows."""

    global_step: int
    global_rank: int  # the reporting rank (rank zero)
    world_size: int
    complete: bool
    device: str
    log_every_n_steps: int
    accumulate_grad_batches: int
    flops_from: str  # "model" (its flops_per_token formula) or "counter"
    peak_from: str  # "config" or "lightning"


def build_report(
    info: RunInfo, windows: Sequence[GlobalWindow], own_step_ms: Sequence[float], own_wait_ms: Sequence[float]
) -> dict[str, Any]:
    """The profile as a JSON-ready dict (NaN as None). ``own_step_ms``/``own_wait_ms``: the reporting rank's every
    measured step (its percentiles are exact, not merged from windows)."""
    windows = [w for w in windows if any(r.window.steps for r in w.ranks)]
    run = GlobalWindow.merge(windows)
    own = run.rank(info.global_rank)
    step_ms = list(own_step_ms)
    report: dict[str, Any] = {
        "kind": "profile",
        "global_step": info.global_step,
        "ranks": list(range(info.world_size)),
        "world_size": info.world_size,
        "complete": info.complete,
        "device": info.device,
        "log_every_n_steps": info.log_every_n_steps,
        "accumulate_grad_batches": info.accumulate_grad_batches,
        "steps_measured": len(step_ms),
        "step_time_ms": {
            "p50": percentile(step_ms, 50),
            "p90": percentile(step_ms, 90),
            "max": max(step_ms, default=math.nan),
            "mean": sum(step_ms) / len(step_ms) if step_ms else math.nan,
        },
        "data_wait": {
            "ms_per_step": sum(own_wait_ms) / len(step_ms) if step_ms else math.nan,
            "pct": 100.0 * sum(own_wait_ms) / sum(step_ms) if step_ms else math.nan,
        },
        # per device: the reporting rank's share of the distinct samples (tensor-parallel peers share a batch)
        "throughput": {
            "samples": run.samples,
            "samples_per_s": own.window.samples_per_s / run.replicas if own else math.nan,
            "samples_per_s_global": run.samples_per_s_global,
        },
        "memory": _memory_peaks(run),
        "per_rank": [_rank_row(r) for r in run.ranks],
    }
    if run.tokens:
        report["throughput"].update(
            tokens=run.tokens,
            tokens_per_s=own.window.tokens_per_s / run.replicas if own else math.nan,
            tokens_per_s_global=run.tokens_per_s_global,
        )
    if run.mfu_pct is not None and run.time_s > 0:
        report["mfu"] = {
            "mfu_pct": run.mfu_pct,
            "flops_per_sample": run.flops_per_sample,
            "flops_from": (
                "the model's flops_per_token() formula" if info.flops_from == "model" else "torch FlopCounterMode"
            ),
            "peak_flops_per_device": run.peak_flops,
            "peak_from": info.peak_from,
        }
    stragglers = [w.straggler for w in windows if w.straggler is not None]
    if stragglers:
        report["stragglers"] = _straggler_summary(stragglers)
    return report


def add_files(
    report: dict[str, Any], stragglers_file: str, trace_files: Sequence[str], snapshot_files: Sequence[str]
) -> dict[str, Any]:
    """Names the files the run wrote beside the report: stragglers, rank zero's traces, memory snapshots."""
    if "stragglers" in report:
        report["stragglers"]["file"] = stragglers_file
    if trace_files:
        report["traces_dir"] = str(Path(trace_files[0]).parent)
        report["traces"] = sorted(Path(p).name for p in trace_files)  # rank zero's; each rank writes its own
    if snapshot_files:
        report["memory_snapshots"] = sorted(Path(p).name for p in snapshot_files)
    return report


def _memory_peaks(run: GlobalWindow) -> dict[str, dict[str, float]]:
    """Per memory field, each rank's peak over the run; min and max over the ranks show an imbalance."""
    out = {}
    for name in MEMORY_FIELDS:
        peaks = [v for v in (getattr(r.memory, name) for r in run.ranks) if not math.isnan(v)]
        if peaks:
            out[name] = {"min": min(peaks), "max": max(peaks)}
    return out


def _straggler_summary(stragglers: Sequence[Any]) -> dict[str, Any]:
    """Which rank was slowest how often, and by how much, over the windows that had a straggler."""
    counts = Counter(s.global_rank for s in stragglers)
    return {
        "windows": len(stragglers),
        "slowest_global_rank": counts.most_common(1)[0][0],
        "times_slowest": {str(k): v for k, v in sorted(counts.items())},
        "lag_ms_mean": 1e3 * sum(s.lag_s for s in stragglers) / len(stragglers),
        "lag_ms_max": 1e3 * max(s.lag_s for s in stragglers),
        "lag_pct_mean": sum(s.lag_pct for s in stragglers) / len(stragglers),
    }


def _rank_row(r: RankWindow) -> dict[str, Any]:
    """One rank over the whole fit (its p50 is the median of its window p50s)."""
    w = r.window
    return {
        "global_rank": r.global_rank,
        "steps": w.steps,
        "time_s": w.time_s,
        "step_time_ms_mean": 1e3 * w.step_time_s_mean,
        "step_time_ms_p50": 1e3 * w.step_time_s_p50,
        "step_time_ms_max": 1e3 * w.step_time_s_max,
        "pre_sync_ms_mean": 1e3 * w.pre_sync_s_mean,
        "data_wait_pct": w.data_wait_pct,
        "samples": w.samples,
        "samples_per_s": w.samples_per_s,
        "rss_gib_max": r.memory.rss_gib,
    }


def json_ready(value: Any) -> Any:
    """NaN -> None all through, so the JSON is valid and an absent figure reads as absent."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_ready(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def num(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``n/a`` when there is no number (no step measured)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return format(value, spec)
