"""The profiling callback (on by default), through ``python train.py`` as a user runs it.

Runs shared by several tests are made once per module. Timing that must be exact uses tests/profiling_support.py's
TickClock (``+callbacks.profiling.clock._target_=profiling_support.TickClock``): every reading of the clock is one tick
later, so each micro-batch takes exactly 5 ticks, 1 of them waiting for data (2 for the epoch's first).
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import ROOT, Run, run_script

from lit_template.callbacks.profiling import ProfilingCallback
from lit_template.diagnostics.profiling.stats import ResidentMemory, WindowStats, find_straggler, percentile
from lit_template.diagnostics.profiling.timer import CpuClock, StepTimer
from lit_template.errors import ConfigError

FAST = [
    "trainer.max_epochs=1",
    "++trainer.limit_train_batches=10",
    "++trainer.limit_val_batches=2",
    "test=false",
    "callbacks.early_stopping=null",
]
# One intra-op thread: on a shared 2-core machine, OpenMP spinning otherwise swamps a tiny model's step time.
ENV = {"PYTHONPATH": str(ROOT / "tests"), "OMP_NUM_THREADS": "1"}
TICK = ["+callbacks.profiling.clock._target_=profiling_support.TickClock", "+callbacks.profiling.clock.tick_s=0.001"]
SLOW_DATA = ["data._target_=slow_data.SlowDigits", "+data.sleep_s_per_item=0.001"]
TRAIN_SAMPLES = 1295  # digits: 1797 - 359 for test = 1438, minus 143 for validation


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name, *overrides)``: ``python train.py`` once per name in this module."""
    done: dict[str, Run] = {}

    def _run(name: str, *overrides: str, timeout: float = 150) -> Run:
        if name not in done:
            done[name] = run_script(
                "train.py", *overrides, log_dir=tmp_path_factory.mktemp(name), env=ENV, timeout=timeout
            )
        return done[name]

    return _run


def plain(runs) -> Run:
    return runs("plain", *FAST, "callbacks.profiling.log_every_n_steps=5")


def report(run: Run) -> dict:
    return json.loads((run.run_dir() / "reports" / "profile.json").read_text())


def column(run: Run, name: str) -> list[float]:
    return [float(r[name]) for r in run.metrics() if r.get(name)]


# -- the math, with a patched clock --------------------------------------------------------------------------------
class ListClock:
    def __init__(self, times: list[float]) -> None:
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


def test_step_math_with_a_patched_clock():
    # epoch start 0; step 1: one batch; step 2: two accumulated batches; validation; step 3: one batch
    clock = ListClock(
        [
            0.000,
            0.010,
            0.015,
            0.030,  # wait 10 ms, backward at 15, end at 30
            0.040,
            0.060,  # micro-batch 1 of step 2 (no backward mark: fine)
            0.100,
            0.110,
            0.120,  # micro-batch 2: wait 40 ms, backward at 110
            1.000,
            1.020,
        ]
    )  # after validation: the gap is not measured
    timer = StepTimer(CpuClock(clock))
    timer.resume()
    timer.batch_start(), timer.before_backward(), timer.batch_end(64, 0, stepped=True, step=1)
    timer.batch_start(), timer.batch_end(64, 0, stepped=False, step=1)
    timer.batch_start(), timer.before_backward(), timer.batch_end(40, 0, stepped=True, step=2)
    timer.pause()
    timer.batch_start(), timer.batch_end(64, 0, stepped=True, step=3)
    s1, s2, s3 = timer.take()
    assert (s1.step_time_s, s1.data_wait_s, s1.pre_sync_s, s1.samples) == pytest.approx((0.030, 0.010, 0.015, 64))
    # step 2 = both micro-batches (30 + 60 ms), the waits add up, pre-sync runs to the last micro-batch's backward
    assert (s2.step_time_s, s2.data_wait_s, s2.pre_sync_s, s2.samples) == pytest.approx((0.090, 0.050, 0.080, 104))
    assert (s3.step_time_s, s3.data_wait_s) == pytest.approx((0.020, 0.0))
    w = WindowStats.from_records([s1, s2, s3])
    assert w.step_time_s_p50 == pytest.approx(0.030)
    assert w.step_time_s_p90 == pytest.approx(0.030 + 0.8 * 0.060)  # between 30 and 90 ms, linearly
    assert w.step_time_s_max == pytest.approx(0.090)
    assert w.data_wait_pct == pytest.approx(100 * 0.060 / 0.140)
    assert w.samples_per_s == pytest.approx((64 + 104 + 64) / 0.140)
    assert timer.take() == []
    assert math.isnan(percentile([], 50))


def test_batch_counts_samples_and_tokens():
    import torch

    from lit_template.diagnostics.profiling.stats import batch_counts

    images, labels = torch.zeros(8, 1, 8, 8), torch.zeros(8, dtype=torch.long)
    assert batch_counts((images, labels)) == (8, 0)  # images: no sequence dimension
    ids = torch.zeros(4, 128, dtype=torch.long)
    assert batch_counts((ids, labels[:4])) == (4, 4 * 128)  # token ids (batch, seq): tokens per step
    assert batch_counts({"attention_mask": torch.ones(4, 128), "input_ids": ids}) == (4, 512)
    assert batch_counts(torch.zeros(5, 3)) == (5, 0)


def test_data_wait_is_the_fetch_not_the_whole_gap_between_batches():
    # epoch start 0; fetch 0.001-0.004 (first batch: the 1 ms before the fetch, creating the iterator, counts too);
    # batch 0.005-0.020; other callbacks' hooks and logging until 0.050, fetch 0.050-0.052; batch 0.053-0.060
    clock = ListClock([0.000, 0.001, 0.004, 0.005, 0.010, 0.020, 0.050, 0.052, 0.053, 0.055, 0.060])
    timer = StepTimer(CpuClock(clock))
    timer.resume()
    timer.fetch_start(), timer.fetch_end()
    timer.batch_start(), timer.before_backward(), timer.batch_end(8, 0, stepped=True, step=1)
    timer.fetch_start(), timer.fetch_end()
    timer.batch_start(), timer.before_backward(), timer.batch_end(8, 0, stepped=True, step=2)
    s1, s2 = timer.take()
    assert (s1.step_time_s, s1.data_wait_s) == pytest.approx((0.020, 0.004))
    # the 30 ms of hooks after batch 1 are step time, not data wait
    assert (s2.step_time_s, s2.data_wait_s) == pytest.approx((0.040, 0.002))


def tick_run(runs, accumulate: int) -> Run:
    """A whole epoch of batches of 100 on the tick clock."""
    return runs(
        f"tick_acc{accumulate}",
        "trainer.max_epochs=1",
        "++trainer.limit_val_batches=2",
        "test=false",
        "callbacks.early_stopping=null",
        "data.batch_size=100",
        f"trainer.accumulate_grad_batches={accumulate}",
        "callbacks.profiling.log_every_n_steps=4",
        *TICK,
    )


def test_tick_clock_through_train_py_gives_exact_figures(runs):
    run = tick_run(runs, 1)
    r = report(run)
    # 12 batches of 100 and a last one of 95; every step 5 ticks: the gap since the last batch (fetch start, fetch
    # end, batch start) and the batch (backward, end). Data wait is the fetch: 1 tick, 2 for the epoch's first batch
    # (creating the iterator counts); the gap's 3rd tick (other hooks) is not data wait.
    assert r["steps_measured"] == r["global_step"] == 13
    assert r["step_time_ms"] == pytest.approx({"p50": 5.0, "p90": 5.0, "max": 5.0, "mean": 5.0})
    assert r["data_wait"] == pytest.approx({"ms_per_step": 14 / 13, "pct": 100 * 14 / 65})
    assert r["throughput"]["samples"] == TRAIN_SAMPLES  # the short last batch counted as it is
    assert r["throughput"]["samples_per_s"] == pytest.approx(TRAIN_SAMPLES / (13 * 0.005))
    assert r["per_rank"][0]["pre_sync_ms_mean"] == pytest.approx(4.0)
    assert column(run, "perf/step_time_ms_p50") == pytest.approx([5.0] * 4)  # windows end at steps 4, 8, 12, 13
    assert column(run, "perf/samples_per_s")[0] == pytest.approx(100 / 0.005)


def test_gradient_accumulation_gives_the_same_samples_per_s(runs):
    one, two = report(tick_run(runs, 1)), report(tick_run(runs, 2))
    # 13 micro-batches make 7 optimizer steps, 6 of 2 micro-batches (10 ticks) and the epoch's last of 1 (5 ticks)
    assert two["steps_measured"] == two["global_step"] == 7
    assert (two["step_time_ms"]["p50"], two["step_time_ms"]["mean"]) == pytest.approx((10.0, 65 / 7))
    assert two["throughput"]["samples"] == one["throughput"]["samples"] == TRAIN_SAMPLES
    assert two["throughput"]["samples_per_s"] == pytest.approx(one["throughput"]["samples_per_s"])
    assert two["data_wait"]["pct"] == pytest.approx(one["data_wait"]["pct"])


# -- light mode, real clock ----------------------------------------------------------------------------------------
def test_on_by_default_in_light_mode_with_gpu_metrics_absent_on_cpu(runs):
    run = plain(runs)
    r = report(run)
    assert r["ranks"] == [0] and r["world_size"] == 1 and r["device"] == "cpu" and r["steps_measured"] == 10
    assert 0 < r["step_time_ms"]["p50"] <= r["step_time_ms"]["p90"] <= r["step_time_ms"]["max"]
    assert 0 < r["data_wait"]["pct"] < 100
    assert r["throughput"]["samples"] == 10 * 64
    header = set(run.metrics()[0])
    for name in (
        "perf/step_time_ms_p50",
        "perf/step_time_ms_p90",
        "perf/step_time_ms_max",
        "perf/data_wait_ms",
        "perf/data_wait_pct",
        "perf/samples_per_s",
        "perf/samples_per_s_global",
        "perf/rss_gib_max",
    ):
        assert len(column(run, name)) == 2, name  # windows end at steps 5 and 10
    # on the CPU, with no peak given: no MFU and no GPU memory, absent rather than zero; no token counts for images
    assert not [
        h
        for h in header
        if h.startswith("perf/")
        and any(k in h for k in ("mfu", "allocated", "reserved", "retries", "ooms", "tokens", "straggler"))
    ]
    assert "mfu" not in r and set(r["memory"]) == {"rss_gib"} and "tokens" not in r["throughput"]
    assert 0.05 < r["memory"]["rss_gib"]["min"] <= r["memory"]["rss_gib"]["max"] < 64
    # light mode: no trace, no memory snapshot, no straggler check with one process
    assert not (run.run_dir() / "traces").exists()
    assert not (run.run_dir() / "reports" / "stragglers.jsonl").exists()


def test_report_files_are_written_once_at_the_end_of_fit(runs):
    run = plain(runs)
    reports = run.run_dir() / "reports"
    assert sorted(p.name for p in reports.glob("profile*")) == ["profile.json", "profile.md", "profile.png"]
    r = report(run)
    assert r["kind"] == "profile" and r["global_step"] == 10 and r["complete"] is True
    sentence = "profile up to global step 10 (global rank 0 reporting): 10 steps measured, step time p50"
    assert run.output.count(sentence) == 1
    md = (reports / "profile.md").read_text()
    assert "| step time p50 / p90 / max (ms) |" in md and "| 0 | 10 |" in md
    assert (reports / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sleep_in_the_dataset_raises_the_data_wait_and_mfu_comes_from_the_peak_override(runs):
    base = report(plain(runs))
    run = runs(
        "slow_data", *FAST, *SLOW_DATA, "callbacks.profiling.log_every_n_steps=5", "callbacks.profiling.peak_flops=1e12"
    )
    slow = report(run)
    # 64 items x 1 ms of sleep each, waited for between batches
    assert slow["data_wait"]["ms_per_step"] >= 64 * 1.0
    assert slow["data_wait"]["pct"] > max(50.0, base["data_wait"]["pct"] + 20), (slow["data_wait"], base["data_wait"])
    # MFU from the given peak on the CPU: the first step's FLOPs counted (that step not timed), the rest timed
    assert slow["steps_measured"] == 9
    mfu = slow["mfu"]
    assert mfu["peak_flops_per_device"] == 1e12 and mfu["peak_from"] == "config"
    # the MLP 64 -> 128 -> 64 -> 10, forward (2 flops a multiply-add) and backward (input and weight grads; no
    # input grad for the first layer)
    assert mfu["flops_per_sample"] == 2 * (64 * 128 + 128 * 64 + 64 * 10) + 2 * (2 * 640 + 2 * 8192 + 8192)
    expected = 100 * mfu["flops_per_sample"] * slow["throughput"]["samples_per_s_global"] / 1e12
    assert mfu["mfu_pct"] == pytest.approx(expected)
    logged = column(run, "perf/mfu_pct")
    assert len(logged) == 2 and all(0 < v < 100 for v in logged)


# -- two processes -------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_sleep_on_rank_1_makes_it_the_straggler_and_each_rank_writes_its_traces(runs):
    run = runs(
        "ddp",
        "trainer=ddp_cpu",
        *FAST,
        "callbacks.profiling.log_every_n_steps=3",
        "+callbacks.fault._target_=lit_template.testing.faults.FaultInjection",
        "+callbacks.fault.action=sleep",
        "+callbacks.fault.rank=1",
        "+callbacks.fault.step=0",
        "+callbacks.fault.every_step=true",
        "+callbacks.fault.seconds=0.1",
        "callbacks.profiling.trace.enabled=true",
        "callbacks.profiling.trace.skip_first=1",
        "callbacks.profiling.trace.wait=0",
        "callbacks.profiling.trace.warmup=1",
        "callbacks.profiling.trace.active=1",
        "callbacks.profiling.trace.repeat=2",
        timeout=220,
    )
    run_dir = run.run_dir()
    records = [json.loads(line) for line in (run_dir / "reports" / "stragglers.jsonl").read_text().splitlines()]
    # windows end at steps 3, 6, 9 and 10 (the partial last one): every one names rank 1, ~100 ms behind
    assert [rec["global_step"] for rec in records] == [3, 6, 9, 10]
    assert {rec["slowest_global_rank"] for rec in records} == {1}
    assert all(
        rec["lag_ms"] > 50 and rec["kind"] == "straggler" and rec["ranks"] == [1] and rec["world_size"] == 2
        for rec in records
    )
    assert "straggler: global rank 1 was the slowest rank up to step 3" in run.output
    r = report(run)
    assert r["ranks"] == [0, 1] and [p["global_rank"] for p in r["per_rank"]] == [0, 1]
    assert r["stragglers"]["slowest_global_rank"] == 1 and r["stragglers"]["times_slowest"] == {"1": 4}
    # counts summed over ranks: each rank saw its own 10 batches of 64
    assert r["throughput"]["samples"] == 2 * 10 * 64
    assert run.output.count("(global rank 0 reporting): 10 steps measured, step time p50") == 1  # rank zero only
    # one trace per cycle per global rank: repeat=2 stops after 2 cycles though 10 steps had room for 4
    traces = sorted(p.name for p in (run_dir / "traces").glob("*.pt.trace.json"))
    by_rank = {rank: [t for t in traces if t.startswith(f"rank{rank}_step")] for rank in (0, 1)}
    assert len(by_rank[0]) == len(by_rank[1]) == 2, traces
    assert [t.replace("rank0", "") for t in by_rank[0]] == [t.replace("rank1", "") for t in by_rank[1]]
    for name in traces:
        assert "traceEvents" in json.loads((run_dir / "traces" / name).read_text())
    assert r["traces"] == by_rank[0] and r["traces_dir"] == str(run_dir / "traces")  # rank zero lists its own


def test_find_straggler_names_the_rank_that_reaches_the_sync_last():
    from lit_template.diagnostics.profiling.stats import MemoryStats, RankWindow

    def rank(r: int, pre_sync_s: float) -> RankWindow:
        w = WindowStats(
            steps=10,
            time_s=1.0,
            data_wait_s=0.1,
            pre_sync_s=10 * pre_sync_s,
            samples=640,
            tokens=0,
            step_time_s_p50=0.1,
            step_time_s_p90=0.1,
            step_time_s_max=0.1,
        )
        return RankWindow(r, w, MemoryStats(rss_gib=1.0))

    rows = [rank(0, 0.02), rank(1, 0.021), rank(2, 0.07), rank(3, 0.019)]
    s = find_straggler(30, [RankWindow.decode(r.encode()) for r in rows])  # through the gathered-row encoding
    assert s.global_rank == 2 and s.step == 30
    assert s.lag_s == pytest.approx(0.05)  # behind the median of the others (20 ms)
    assert s.lag_pct == pytest.approx(50.0)  # of a 100 ms step
    assert find_straggler(30, rows[:1]) is None


def test_an_unknown_option_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match=r"callbacks.profiling.trace.actve is not an option"):
        ProfilingCallback(trace={"actve": 2})
    with pytest.raises(ConfigError, match=r"callbacks.profiling.trace.active must be >= 1"):
        ProfilingCallback(trace={"active": 0})


def test_a_memory_snapshot_on_the_cpu_fails_at_start_naming_the_option(train):
    run = train(*FAST, "callbacks.profiling.memory_snapshot.enabled=true", check=False, env=ENV)
    assert run.returncode == 2, run.output[-2000:]
    assert "callbacks.profiling.memory_snapshot.enabled=true needs a CUDA device" in run.output
    assert "Traceback" not in run.output


def test_resident_memory_reads_what_psutil_reads_and_follows_a_fork():
    import os

    import psutil

    resident = ResidentMemory()
    # the same /proc field psutil parses; the process may grow a page between the two reads
    assert abs(resident.bytes() - psutil.Process().memory_info().rss) < 16 * 2**20
    ballast = bytearray(64 * 2**20)  # 64 MiB touched: the figure follows the process, it is not read once
    ballast[::4096] = b"x" * len(ballast[::4096])
    assert abs(resident.bytes() - psutil.Process().memory_info().rss) < 16 * 2**20
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's own figure, not the parent's through the inherited descriptor
        ok = abs(resident.bytes() - psutil.Process().memory_info().rss) < 16 * 2**20
        os.write(write, b"1" if ok and resident._pid == os.getpid() else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    del ballast
