"""``extras.lean_hooks`` (on by default): Lightning's per-step hook dispatch without the profiler contexts and the
no-op callback hooks, and no NVML probe per optimizer step on the CPU. The same hooks run in the same order, the
run computes the same numbers, and a profiler asked for (``debug=profiler``) still sees every hook."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.profilers import PassThroughProfiler, SimpleProfiler

from lit_template.lightning_compat import NullProfiler, cuda_device_count_cached, lean_hooks

TESTS = Path(__file__).parent
RUN = (
    "trainer.max_epochs=1",
    "test=false",
    "extras.print_config=false",
    "+callbacks.hooklog._target_=support_callbacks.HookLog",
)


class Recorder(L.Callback):
    """Records every hook Lightning calls on it, with the arguments' types and the module's current hook name."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def __getattribute__(self, name: str):
        if name.startswith("on_") or name in ("setup", "teardown"):
            calls = object.__getattribute__(self, "calls")

            def record(trainer, pl_module, *args, **kwargs):
                calls.append((name, pl_module._current_fx_name, tuple(type(a).__name__ for a in args)))

            return record
        return object.__getattribute__(self, name)


class RecordingModel(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple] = []

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(("on_train_batch_start", self._current_fx_name))

    def on_before_optimizer_step(self, optimizer):
        self.seen.append(("on_before_optimizer_step", self._current_fx_name))


def fit(tmp_path: Path, lean: bool, profiler=None) -> tuple[L.Trainer, Recorder, RecordingModel]:
    L.seed_everything(0)
    recorder, model = Recorder(), RecordingModel()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=6,
        limit_val_batches=2,
        val_check_interval=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[L.Callback(), recorder],
        profiler=profiler,
    )
    if lean:
        assert lean_hooks(trainer) is (profiler is None)
    trainer.fit(model)
    return trainer, recorder, model


def test_lean_dispatch_calls_the_same_hooks_in_the_same_order_with_the_same_arguments(tmp_path):
    # the reference: a trainer lean_hooks leaves alone because it has a profiler (Lightning's own functions then)
    ref_trainer, ref, ref_model = fit(tmp_path / "ref", lean=True, profiler=SimpleProfiler())
    trainer, lean, lean_model = fit(tmp_path / "lean", lean=True)
    assert isinstance(ref_trainer.profiler, SimpleProfiler) and type(trainer.profiler) is NullProfiler
    assert len(lean.calls) > 50 and lean.calls == ref.calls
    assert (
        lean_model.seen == ref_model.seen
        and ("on_before_optimizer_step", "on_before_optimizer_step") in lean_model.seen
    )
    assert [p.detach().sum().item() for p in lean_model.parameters()] == [
        p.detach().sum().item() for p in ref_model.parameters()
    ]
    # the profiler that was asked for saw the callback hooks (lean_hooks left its path alone)
    assert any(k.startswith("[Callback]") for k in ref_trainer.profiler.recorded_durations)


def test_lean_hooks_leaves_a_trainer_with_a_profiler_or_switched_off_alone(tmp_path):
    trainer = L.Trainer(default_root_dir=tmp_path, profiler="simple", logger=False)
    assert lean_hooks(trainer) is False and isinstance(trainer.profiler, SimpleProfiler)
    trainer, _, _ = fit(tmp_path, lean=False)
    assert type(trainer.profiler) is PassThroughProfiler


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a CPU-only torch build never probes NVML")
def test_a_cpu_trainer_answers_the_cuda_device_count_from_torchs_cache_and_puts_it_back(tmp_path, monkeypatch):
    from torch import cuda

    probes = []
    probe = cuda._raw_device_count_nvml
    monkeypatch.setattr(cuda, "_raw_device_count_nvml", lambda: probes.append(1) or probe())
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # as importing Lightning sets it
    assert not cuda.is_initialized() and cuda._cached_device_count is None
    expected = cuda.device_count()
    trainer = L.Trainer(default_root_dir=tmp_path, accelerator="cpu", logger=False)  # it probes too
    before = len(probes)
    with cuda_device_count_cached(trainer):
        inside = len(probes)
        assert inside == before + 1 and cuda._cached_device_count == expected  # the count, taken once
        for _ in range(50):
            cuda.is_available()
        assert len(probes) == inside  # answered from the cache
    assert cuda._cached_device_count is None
    cuda.is_available()
    assert len(probes) == inside + 1  # uncached again: torch probes NVML as before


def test_a_gpu_trainer_leaves_the_cuda_device_count_to_torch(monkeypatch):
    # a trainer on a CUDA device initializes CUDA at setup and torch caches the count itself: nothing is set here
    from types import SimpleNamespace

    from torch import cuda

    probes = []
    monkeypatch.setattr(cuda, "_raw_device_count_nvml", lambda: probes.append(1) or -1)
    on_gpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    with cuda_device_count_cached(on_gpu):
        assert cuda._cached_device_count is None
    assert cuda._cached_device_count is None and probes == []


def hooks(run) -> dict:
    return json.loads((run.run_dir() / "hooks.json").read_text())


def losses(run) -> list[str]:
    """The epoch's train and validation loss and accuracy, as logged (text: compared exactly)."""
    rows = list(csv.DictReader((next(run.run_dir().rglob("metrics.csv"))).open()))
    keys = ("train/loss", "train/acc", "val/loss", "val/acc")
    return [r[k] for r in rows for k in keys if r.get(k)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_py_runs_lean_by_default_with_the_same_numbers_and_debug_profiler_sees_every_hook(train, tmp_path):
    env = {"PYTHONPATH": str(TESTS)}
    lean = train(*RUN, env=env, log_dir=tmp_path / "lean")
    plain = train(*RUN, "extras.lean_hooks=false", env=env, log_dir=tmp_path / "plain")
    assert hooks(lean)["profiler"] == "NullProfiler" and hooks(plain)["profiler"] == "PassThroughProfiler"
    assert len(hooks(lean)["calls"]) > 100 and hooks(lean)["calls"] == hooks(plain)["calls"]
    # Adam's step asks torch whether CUDA is there: Lightning's stock path probes NVML for it at every step on the
    # CPU, the lean one answers from torch's cache (lightning_compat.cuda_device_count_cached)
    if torch.backends.cuda.is_built():  # a CPU-only torch build has nothing to probe
        assert hooks(plain)["nvml_probes"] >= hooks(plain)["steps"] > 10
    assert hooks(lean)["nvml_probes"] == 0
    assert losses(lean) and losses(lean) == losses(plain)
    profiled = train("debug=profiler", "extras.print_config=false", log_dir=tmp_path / "profiled")
    # Lightning's simple profiler still times each callback's hooks and prints them
    assert "[Callback]NonFiniteGuard.on_before_optimizer_step" in profiled.output, profiled.output[-3000:]
