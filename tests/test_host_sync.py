"""No host-device sync per training step at the defaults: on a GPU every ``.item()``, ``.tolist()``, ``.cpu()``,
``bool(tensor)`` of a device tensor waits for the device. Counted on the CPU by wrapping those tensor methods
(tests/host_reads.py) over 100+ optimizer steps of ``python train.py``, as shipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).parent
RUN = (
    "trainer.max_epochs=5",
    "trainer.limit_val_batches=2",
    "test=false",
    "extras.print_config=false",
    "callbacks.early_stopping=null",
    "+callbacks.hostreads._target_=host_reads.HostReads",
)


# model=gpt logs its step loss for the progress bar (prog_bar=True, on_step=True): the bar must not read it per step
GPT = ("experiment=gpt_tiny", "trainer.max_steps=110", "data.max_bytes=300000", "optimized_metric=null")


def reads(train, tmp_path, *overrides: str) -> dict:
    out = tmp_path / "reads.json"
    train(*RUN, f"+callbacks.hostreads.out={out}", *overrides, env={"PYTHONPATH": str(TESTS)}, timeout=200)
    data = json.loads(out.read_text())
    assert data["steps"] >= 100, data["steps"]
    return data


def outside_log_steps(data: dict, owner: str, every: int = 100) -> dict[int, int]:
    """Reads per step, at steps where Lightning does not log; the sync check's own cadence (every 100 steps, at
    ``global_step % 100 == 0``) is not a per-step cost either."""
    allowed = set(data["log_steps"]) | set(range(0, data["steps"] + 1, every))
    counts = {int(k.split(":")[0]): v for k, v in data["per_step"].items() if k.endswith(f":{owner}")}
    return {step: n for step, n in counts.items() if step not in allowed}


@pytest.mark.slow
@pytest.mark.timeout(300)
# each rank has half the data under ddp_cpu: twice the epochs for 100+ steps
@pytest.mark.parametrize(
    "launch",
    [(), ("trainer=ddp_cpu", "trainer.max_epochs=10"), GPT],
    ids=["1-process", "ddp_cpu", "gpt"],
)
def test_no_host_read_per_step_outside_log_steps_at_the_defaults(train, tmp_path, launch):
    data = reads(train, tmp_path, *launch)
    where = sorted(data["where"].items(), key=lambda kv: -kv[1])
    assert outside_log_steps(data, "template") == {}, where  # the shipped callbacks and the LightningModule
    assert outside_log_steps(data, "lightning") == {}, where  # Lightning's loop with the shipped configs


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_counter_sees_the_one_read_per_step_that_nan_skipping_needs(train, tmp_path):
    # on_nonfinite=skip must decide before the step's own update, so under DDP (and on a GPU) it reads the gathered
    # flags in the step (documented). One CPU process reads its flag through a NumPy view: no tensor call to count.
    data = reads(
        train, tmp_path, "trainer=ddp_cpu", "trainer.max_epochs=10", "callbacks.nonfinite_guard.on_nonfinite=skip"
    )
    per_step = outside_log_steps(data, "template")
    assert len(per_step) >= 80 and set(per_step.values()) == {2}, per_step  # .cpu() and .numpy(), every step
    assert any("nonfinite_guard.py" in where for where in data["where"]), data["where"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_step_value_logged_for_the_progress_bar_is_read_every_step_by_lightning(train, tmp_path):
    # why model=gpt logs train/loss_step without prog_bar (the template's bar shows it, read at log steps): with
    # prog_bar=True, as Lightning's docs show it, Lightning's own loop reads it on the host after every batch
    data = reads(train, tmp_path, *GPT, "model._target_=host_reads.GPTLossOnBar")
    per_step = outside_log_steps(data, "lightning")
    assert len(per_step) >= 80, (per_step, data["where"])
    assert any("apply_func.py" in where and "to_item" in where for where in data["where"]), data["where"]


def sync_debug(train, tmp_path, *overrides: str) -> dict:
    out = tmp_path / "sync_debug.json"
    train(
        *RUN[:-1],  # not the host-read counter: its wrappers are Python, not CUDA calls
        "+callbacks.syncdebug._target_=host_reads.CudaSyncDebug",
        f"+callbacks.syncdebug.out={out}",
        *overrides,
        env={"PYTHONPATH": str(TESTS)},
        timeout=280,
    )
    data = json.loads(out.read_text())
    assert data["steps"] >= 100 and len(data["checked"]) >= 70, data
    return data


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.set_sync_debug_mode)")
def test_no_synchronising_cuda_call_outside_log_steps_on_a_gpu(train, tmp_path):
    # a synchronising call in a checked step raises inside the run, which then fails; bf16-mixed: 16-mixed's
    # GradScaler reads its found-inf flag on the host once a step (torch.amp's own .item())
    sync_debug(train, tmp_path, "trainer=gpu", "trainer.precision=bf16-mixed")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_sync_debug_window_leaves_out_log_steps_and_the_sync_checks_steps(train, tmp_path):
    # what the GPU test above checks, on the CPU (where set_sync_debug_mode needs a driver): the steps it covers
    checked = sync_debug(train, tmp_path)["checked"]
    assert not [s for s in checked if (s + 1) % 10 == 0 or s % 100 == 0 or (s + 1) % 100 == 0 or s < 3], checked
