"""The profile report's Markdown tables and plot."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lit_template.diagnostics.profiling.report import num
from lit_template.diagnostics.profiling.stats import GlobalWindow
from lit_template.diagnostics.profiling.timer import DATA_WAIT
from lit_template.diagnostics.report import say, write_json


# -- report rendering ------------------------------------------------------------------------------------------------
def _fmt(value: Any, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e3 else f"{value:,.0f}"
    return str(value)


def write_profile(out: Path, report: dict[str, Any], plot: Callable[[Path], None] | None) -> Path:
    """Writes ``profile.json``, ``profile.md`` and (``plot`` given) ``profile.png`` under ``out``; returns the
    Markdown's path. The file names go into the report's ``files``."""
    files = {"json": str(out / "profile.json"), "markdown": str(out / "profile.md")}
    if plot is not None:
        try:
            plot(out / "profile.png")
            files["plot"] = str(out / "profile.png")
        except Exception as err:  # noqa: BLE001  (a broken matplotlib install must not fail a finished run)
            say(f"profiling: the plot was not drawn ({type(err).__name__}: {err})")
    report["files"] = files
    write_json(out / "profile.json", report)
    (out / "profile.md").write_text(render_markdown(report))
    return out / "profile.md"


def console_summary(report: dict[str, Any], global_rank: int, world_size: int, markdown: Any) -> str:
    """The report's one sentence on the console. A run that failed before its first measured step has no numbers:
    they print as "nan"/"-", never fail on formatting."""
    st, th = report["step_time_ms"], report["throughput"]
    mfu = f", MFU {num(report['mfu']['mfu_pct'], '.1f')}%" if "mfu" in report else ""
    return (
        f"profile up to global step {report['global_step']} (global rank {global_rank} reporting): "
        f"{report['steps_measured']} steps measured, step time p50 {num(st['p50'], '.2f')} ms (p90 "
        f"{num(st['p90'], '.2f')}, max {num(st['max'], '.2f')}), data wait "
        f"{num(report['data_wait']['pct'], '.1f')}%, "
        f"{num(th['samples_per_s_global'], '.0f')} samples/s over {world_size} rank(s){mfu}; report in {markdown}"
    )


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
        rows += [
            ("tokens/s per device (rank 0)", _fmt(th["tokens_per_s"])),
            ("tokens/s global", _fmt(th["tokens_per_s_global"])),
        ]
    if "mfu" in report:
        rows.append(("MFU (%)", _fmt(report["mfu"]["mfu_pct"])))
    for name, span in report["memory"].items():
        rows.append((f"{name} (min / max over ranks)", f"{_fmt(span['min'])} / {_fmt(span['max'])}"))
    if report.get("stragglers"):
        s = report["stragglers"]
        rows.append(
            (
                "slowest rank (most windows)",
                f"{s['slowest_global_rank']} "
                f"({s['times_slowest'][str(s['slowest_global_rank'])]} of "
                f"{s['windows']} windows)",
            )
        )
        rows.append(("straggler lag mean / max (ms)", f"{_fmt(s['lag_ms_mean'])} / {_fmt(s['lag_ms_max'])}"))
    lines = [
        f"# Profile: {report['ranks']} rank(s) on {report['device']}, {report['global_step']} steps",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in rows]
    lines += [
        "",
        "## Per rank",
        "",
        "| rank | steps | step time mean (ms) | step time p50 (ms) | pre-sync mean (ms) | data wait (%) "
        "| samples/s | RSS max (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["per_rank"]:
        lines.append(
            f"| {r['global_rank']} | {r['steps']} | {_fmt(r['step_time_ms_mean'])} "
            f"| {_fmt(r['step_time_ms_p50'])} | {_fmt(r['pre_sync_ms_mean'])} | {_fmt(r['data_wait_pct'])} "
            f"| {_fmt(r['samples_per_s'])} | {_fmt(r['rss_gib_max'])} |"
        )
    lines += [
        "",
        "Step time runs from one optimizer step's end to the next, validation excluded; data wait is "
        f"{DATA_WAIT}; pre-sync is a rank's own time to the "
        "backward of the step's last micro-batch (less what it waited in forward for other ranks), where the "
        "gradient all-reduce makes every rank wait for the slowest.",
        "",
    ]
    return "\n".join(lines)


def plot_profile(
    path: Any,
    own_steps: Sequence[int],
    own_step_ms: Sequence[float],
    windows: Iterable[GlobalWindow],
    max_ranks_drawn: int = 16,
) -> None:
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
        top.plot(
            xs,
            [p[1].step_time_s_p50 * 1e3 for p in pts],
            color=color,
            marker="o",
            ms=3,
            label=f"rank {rank}, p50 per window",
        )
        top.plot(
            xs,
            [p[1].pre_sync_s_mean * 1e3 for p in pts],
            color=color,
            ls=":",
            lw=1.2,
            label=f"rank {rank}, own time to the gradient sync",
        )
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
