"""A Hydra callback that ends every multirun with a table of each job's optimized metric (summary.json/.md)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

RESULT_FILE = "job_result.json"


def _is_multirun(config: DictConfig) -> bool:
    return config.hydra.mode == RunMode.MULTIRUN


DIRECTIONS = ("maximize", "minimize")


FOLD = "data.fold="


def fold_groups(rows: list[dict]) -> list[dict]:
    """k-fold cross-validation (``-m data.fold=0,1,2,3,4``): the jobs that differ only in ``data.fold``, grouped, with
    the mean and the sample standard deviation of the metric over the folds that completed."""
    groups: dict[tuple[str, ...], list[dict]] = {}
    for r in rows:
        if any(o.startswith(FOLD) for o in r["swept"]):
            key = tuple(o for o in r["swept"] if not o.startswith(FOLD))
            groups.setdefault(key, []).append(r)
    result = []
    for key, members in groups.items():
        values = [m["value"] for m in members if m["value"] is not None]
        result.append(
            {
                "overrides": list(key),
                "folds": [next(o for o in m["swept"] if o.startswith(FOLD))[len(FOLD) :] for m in members],
                "jobs": [m["job"] for m in members],
                "n": len(values),
                "mean": statistics.fmean(values) if values else None,
                "std": statistics.stdev(values) if len(values) > 1 else None,
                "failed": [m["job"] for m in members if m["value"] is None],
            }
        )
    return result


def fold_sentence(group: dict, metric: str) -> str:
    where = " ".join(group["overrides"]) or "all jobs"
    if group["mean"] is None:
        return f"{where}: no fold completed"
    spread = f" +- {group['std']:.6g} (sample std)" if group["std"] is not None else ""
    failed = f"; failed: jobs {group['failed']}" if group["failed"] else ""
    return (
        f"{where}: {metric} = {group['mean']:.6g}{spread} over {group['n']} folds ({', '.join(group['folds'])}){failed}"
    )


class SweepSummary(Callback):
    """Each job writes ``<job dir>/job_result.json``; the sweep's process gathers them at the end.

    Files rather than memory, so it works with launchers that run jobs elsewhere (joblib, submitit).
    ``direction`` says which job is best: maximize or minimize ``optimized_metric``; None takes the sweeper's own
    (Optuna's ``direction``), else maximize.
    """

    def __init__(self, direction: str | None = None) -> None:
        if direction is not None and direction not in DIRECTIONS:
            raise ValueError(f"hydra.callbacks.sweep_summary.direction={direction!r}: choose maximize or minimize")
        self.direction = direction

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if not _is_multirun(config):
            return
        value = getattr(job_return, "_return_value", None)
        failed = job_return.status != JobStatus.COMPLETED
        number = float(value) if isinstance(value, (int, float)) else math.nan
        failure = Path(config.hydra.runtime.output_dir) / "failure.json"
        record = {
            "kind": "sweep_job",
            "job": int(config.hydra.job.num),
            "overrides": list(config.hydra.overrides.task),
            "metric": config.get("optimized_metric"),
            "value": None if math.isnan(number) else number,
            "status": "failed" if failed or math.isnan(number) else "completed",
            "error": json.loads(failure.read_text())["message"] if failure.is_file() else None,
            "dir": str(config.hydra.runtime.output_dir),
        }
        Path(record["dir"], RESULT_FILE).write_text(json.dumps(record, indent=2))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = sorted((json.loads(p.read_text()) for p in sweep_dir.glob(f"**/{RESULT_FILE}")), key=lambda r: r["job"])
        if not rows:
            return
        direction = self.direction or str(config.hydra.sweeper.get("direction") or "maximize")
        scored = [r for r in rows if r["value"] is not None]
        best = (max if direction.startswith("max") else min)(scored, key=lambda r: r["value"]) if scored else None
        metric = rows[0]["metric"]
        # show what the sweep varies, not the overrides every job shares
        common = set.intersection(*(set(r["overrides"]) for r in rows)) if len(rows) > 1 else set()
        for r in rows:
            r["swept"] = [o for o in r["overrides"] if o not in common]
        folds = fold_groups(rows)
        summary = {
            "kind": "sweep_summary",
            "metric": metric,
            "direction": direction,
            "jobs": rows,
            "best_job": best["job"] if best else None,
            "failed_jobs": [r["job"] for r in rows if r["status"] == "failed"],
            "folds": folds,
        }
        (sweep_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        lines = [f"| job | overrides | {metric} | status |", "|---|---|---|---|"]
        for r in rows:
            mark = " (best)" if best is r else ""
            value = "" if r["value"] is None else f"{r['value']:.6g}{mark}"
            lines.append(f"| {r['job']} | {' '.join(r['swept'])} | {value} | {r['status']} |")
        for group in folds:
            lines.append(f"\nk-fold: {fold_sentence(group, metric)}")
        (sweep_dir / "summary.md").write_text("\n".join(lines) + "\n")
        self._print(rows, metric, best, sweep_dir)
        if folds:
            from rich.console import Console

            for group in folds:
                Console().print(f"k-fold: {fold_sentence(group, metric)}")

    @staticmethod
    def _print(rows: list[dict], metric: str, best: dict | None, sweep_dir: Path) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"sweep: {metric} per job ({sweep_dir})")
        for col in ("job", "overrides", metric, "status"):
            table.add_column(col)
        for r in rows:
            value = "" if r["value"] is None else f"{r['value']:.6g}"
            style = "bold green" if r is best else ("red" if r["status"] == "failed" else None)
            table.add_row(str(r["job"]), " ".join(r["swept"]), value, r["status"], style=style)
        Console().print(table)
        if best:
            Console().print(f"best: job {best['job']} ({' '.join(best['swept'])}) {metric}={best['value']:.6g}")
