"""The benchmark scripts keep working: scripts/bench_callbacks.py's gate, through train.py and through the script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GATED = ["SyncCheck", "ProfilingCallback", "HangDoctor", "NonFiniteGuard", "RngState", "LastCheckpoint", "Preemption"]


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_callback_gate_takes_the_callbacks_out_in_blocks(train, tmp_path):
    block, phases = 3, 3 + len(GATED)
    out = tmp_path / "gate.json"
    train(
        f"trainer.max_steps={block * phases}",
        "trainer.max_epochs=1",
        "data.train_repeat=20",
        "test=false",
        "callbacks.early_stopping=null",
        "optimized_metric=null",
        "callbacks.rich_progress_bar=null",
        "extras.print_config=false",
        "+callbacks.bench._target_=lit_template.testing.bench.CallbackGate",
        f"+callbacks.bench.classes=[{','.join(GATED)}]",
        f"+callbacks.bench.block_steps={block}",
        f"+callbacks.bench.out={out}",
        "+callbacks.bench.raw=true",
        timeout=180,
    )
    result = json.loads(out.read_text())
    assert result["phases"] == ["raw", "all", "none", *[f"only:{c}" for c in GATED]]
    # one cycle; each block keeps its steps but the first (the very first block also loses step 1: no start yet)
    kept = {phase: [len(b) for b in rows] for phase, rows in result["times"].items()}
    assert kept["raw"] == [block - 2] and all(kept[p] == [block - 1] for p in result["phases"][1:]), kept
    # the raw steps are timed hand-written steps: a fetch, forward, backward and optimizer step each
    assert all(0 < t < 5 for t in result["times"]["raw"][0]), result["times"]["raw"]
    # each callback was in the list for the "all" block and its own block (the last step brings every one back)
    assert all(result["present_steps"][c] in (2 * block, 2 * block + 1) for c in GATED), result["present_steps"]
    assert result["hook_us"]["NonFiniteGuard"] > 0 and result["hook_us"]["ProfilingCallback"] > 0


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_callbacks_prints_the_ratio_and_each_callback():
    proc = subprocess.run(
        [sys.executable, "scripts/bench_callbacks.py", "--batch-size", "64", "--block-steps", "3", "--cycles", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all / none (the template's own callbacks together):" in proc.stdout
    assert "as shipped / raw (b/a):" in proc.stdout and "step time of the hand-written loop (raw):" in proc.stdout
    for cls in GATED:
        assert f"  {cls}" in proc.stdout and "hooks" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_benchmark_py_prints_each_variant_and_lightnings_costs():
    # one short round of every variant: (a) the hand-written loop, (b)-(d), and --lightning-costs' five
    args = ["--batch-size", "64", "--steps", "12", "--skip", "2", "--rounds", "1", "--repeat", "2", "--lightning-costs"]
    proc = subprocess.run(
        [sys.executable, "scripts/benchmark.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for label in ("(a) raw PyTorch loop", "(b) train.py, default callbacks", "(d) train.py, all template callbacks"):
        assert label in proc.stdout, proc.stdout
    assert "wall time: b/a = " in proc.stdout and "b/d (the template's own callbacks together):" in proc.stdout
    assert "Lightning's stock hook dispatch and CUDA probe (extras.lean_hooks=false)" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_callbacks_totals_prints_the_intervals():
    args = ["--batch-size", "64", "--block-steps", "3", "--cycles", "4", "--totals"]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_callbacks.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "all / none (the template's own callbacks together):" in proc.stdout, proc.stdout
    # both ratios with a target (all / none and b/a) get the bootstrap interval of their median
    assert proc.stdout.count("median's 95% interval") == 2, proc.stdout
    assert "as shipped / raw (b/a):" in proc.stdout and "hooks" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_gc_compares_the_schedule_with_pythons_collector():
    args = ["--batch-size", "64", "--steps", "30", "--skip", "2", "--rounds", "1"]
    proc = subprocess.run(
        [sys.executable, "scripts/bench_gc.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    assert "scheduled" in lines and "automatic" in lines, proc.stdout
    assert "automatic / scheduled, mean step:" in proc.stdout, proc.stdout
    # the schedule disables Python's collector during the steps: no generation-0 pass in the scheduled run
    scheduled_counts = lines["scheduled"].rsplit("[", 1)[1].rstrip("]").split(",")
    assert int(scheduled_counts[0]) == 0, lines["scheduled"]
    assert "one-off cost at train start" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_bench_cold_hooks_times_each_hook_warm_cold_and_again():
    proc = subprocess.run(
        [sys.executable, "scripts/bench_cold_hooks.py", "--batch-size", "64", "--steps", "20"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}  # a row: the name, then warm, cold and again in microseconds
    for line in proc.stdout.splitlines():
        for name in ("profiling", "NaN guard", "trainer.global_step"):
            if line.startswith(name):
                rows[name] = [float(v) for v in line.split()[-3:]]
    assert set(rows) == {"profiling", "NaN guard", "trainer.global_step"}, proc.stdout
    # warm, cold and again: three timings in microseconds for each, all measured (positive)
    assert all(len(v) == 3 and all(t > 0 for t in v) for v in rows.values()), proc.stdout
