"""The gradient and parameter sync check: checksum units, then real 2- and 3-process DDP runs (gloo, CPU) through
``python train.py``, with faults injected on one rank. ``callbacks=sync_check`` picks only this callback so the runs
stay small; ``callbacks=default`` includes it (checked by composing the config)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_template.callbacks.sync_check import SyncCheck
from lit_template.diagnostics import checksum as cs
from lit_template.diagnostics.local_sgd import LocalSGDSchedule
from lit_template.errors import ConfigError
from lit_template.testing.faults import flip_lowest_bit

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
FAULT = "lit_template.testing.faults.FaultInjection"
# a short DDP run with only the sync check, checking every step
TIMEOUT = 200


def small(batches: int = 6) -> tuple[str, ...]:
    """A short DDP run with only the sync check, checking every step."""
    return (
        "trainer=ddp_cpu",
        "trainer.max_epochs=1",
        f"+trainer.limit_train_batches={batches}",
        "+trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
        "test=false",
        "callbacks=sync_check",
        "callbacks.sync_check.every_n_steps=1",
    )


def fault(name: str, action: str, rank: int, step: int, target: str) -> tuple[str, ...]:
    return (
        f"+callbacks.{name}._target_={FAULT}",
        f"+callbacks.{name}.action={action}",
        f"+callbacks.{name}.rank={rank}",
        f"+callbacks.{name}.step={step}",
        f"+callbacks.{name}.target={target}",
    )


def findings(run) -> list[dict]:
    path = run.run_dir() / "reports" / "sync_check.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summary(run) -> dict:
    return json.loads((run.run_dir() / "reports" / "sync_check.json").read_text())


def by_name(finding: dict) -> dict[str, dict]:
    return {t["name"]: t for t in finding["tensors"]}


# -- checksums ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    ],
)
def test_checksum_catches_one_bit_flip_in_every_dtype(dtype):
    base = (torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    before = base.clone()
    reference = int(cs.tensor_checksum(base))
    assert torch.equal(base, before), "the checksum must not touch the tensor"
    assert int(cs.tensor_checksum(base.clone())) == reference
    int_dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[base.element_size()]
    for position in (0, 1, 2, 511, 999):
        for bit in range(1 if dtype == torch.bool else base.element_size() * 8):  # bool: other bits are not bools
            flipped = base.clone()
            word = flipped.view(torch.uint8 if dtype == torch.bool else int_dtype)
            word[position] ^= torch.tensor(1, dtype=word.dtype) << bit
            assert int(cs.tensor_checksum(flipped)) != reference, (dtype, position, bit)


def test_checksum_sees_order_and_the_lowest_bit_flip_of_the_fault_injector():
    t = torch.arange(10, dtype=torch.float32)
    assert int(cs.tensor_checksum(t)) != int(cs.tensor_checksum(t.flip(0)))
    flipped = t.clone()
    flip_lowest_bit(flipped)
    assert int(cs.tensor_checksum(flipped)) != int(cs.tensor_checksum(t))
    per_tensor = cs.checksums([t, None, flipped], torch.device("cpu"))
    assert per_tensor[1] == 0 and int(cs.combine(per_tensor)) != int(cs.combine(per_tensor.flip(0)))
    # chunked sums equal one pass
    big = torch.randn(cs.CHUNK + 7)
    weights = torch.arange(big.numel(), dtype=torch.int64) * 2 + 1
    assert int(cs.tensor_checksum(big)) == int((big.view(torch.int32).to(torch.int64) * weights).sum())


def test_majority_names_a_bad_rank_zero_from_three_ranks():
    assert cs.majority([7, 9, 9]) == (1, [0])
    assert cs.majority([7, 7, 9]) == (0, [2])
    assert cs.majority([7, 9]) == (0, [1])  # two ranks: rank 0 is the reference
    assert cs.majority([1, 2, 3]) == (0, [1, 2])
    assert cs.majority_within([1.0, 1.0 + 1e-9, 1.5], rtol=1e-6) == (0, [2])
    assert cs.majority_within([2.0, 1.0, 1.0], rtol=1e-6) == (1, [0])


def test_bad_options_are_config_errors_naming_the_option():
    with pytest.raises(ConfigError, match=r"callbacks\.sync_check\.on_mismatch"):
        SyncCheck(on_mismatch="explode")
    with pytest.raises(ConfigError, match=r"callbacks\.sync_check\.mode"):
        SyncCheck(mode="close")
    with pytest.raises(ConfigError, match=r"callbacks\.sync_check\.every_n_steps"):
        SyncCheck(every_n_steps=-1)


def test_default_callbacks_include_the_sync_check():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train")
    callback = instantiate(cfg.callbacks.sync_check)
    assert isinstance(callback, SyncCheck) and callback.every_n_steps == 100 and callback.on_mismatch == "warn"


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 4))
        return torch.utils.data.DataLoader(data, batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_one_process_does_nothing_costly_and_never_fails(tmp_path):
    check = SyncCheck(every_n_steps=1)
    trainer = L.Trainer(
        max_steps=3,
        accelerator="cpu",
        devices=1,
        callbacks=[check],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(_Tiny())
    assert not check.active and check.collective_log == [] and trainer.global_step == 3
    report = json.loads((tmp_path / "reports" / "sync_check.json").read_text())
    assert report["kind"] == "sync_check_summary" and report["active"] is False and report["checks"] == 0


# -- real DDP runs --------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_clean_run_with_accumulation_reports_nothing_and_collectives_match(train):
    """2 ranks, gradient accumulation 2, a check every 2 steps: no findings (BatchNorm buffers broadcast by DDP
    agree too), and every rank issued the same collectives, none on off-steps."""
    run = train(
        *small(8),
        "trainer.accumulate_grad_batches=2",
        "callbacks.sync_check.every_n_steps=2",
        "+callbacks.probe._target_=sync_faults.CollectiveProbe",
        env=ENV,
        timeout=TIMEOUT,
    )
    assert findings(run) == []
    report = summary(run)
    assert report["active"] and report["global_step"] == 4 and not any(report["findings"].values())
    # every kind was really compared (BatchNorm running stats among the buffers, broadcast by DDP: no warning)
    assert all(n > 0 for n in report["tensors_checked"].values()), report["tensors_checked"]
    logs = [json.loads((run.run_dir() / f"probe_rank{r}.json").read_text())["collective_log"] for r in (0, 1)]
    assert logs[0] == logs[1], "ranks issued different collectives"
    grad_checks = [step for step, where, _ in logs[0] if where == "before_optimizer_step"]
    param_checks = [step for step, where, _ in logs[0] if where == "after_optimizer_step"]
    assert grad_checks == [0, 2] and param_checks == [1, 3]  # steps 1 and 3 (off-steps) issue nothing
    assert [where for _, where, _ in logs[0]][:: len(logs[0]) - 1] == ["fit_start", "fit_end"]
    assert all(n == 1 for _, _, n in logs[0]), "a clean check is one all_gather"
    assert run.last_value("sync/grad_mismatches") == 0 and run.last_value("sync/check_ms") > 0


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_three_ranks_name_the_perturbed_parameter_and_rank_and_the_unused_parameter(train):
    """3 ranks. Rank 1 perturbs one weight after step 2, rank 0 another after step 4; a side layer is unused on
    rank 2 only (find_unused_parameters). Each drift names its tensor and rank (a bad rank 0 too, by majority);
    the unused layer is reported as such and causes no gradient or parameter mismatch."""
    run = train(
        *small(),
        "trainer.devices=3",
        "trainer.strategy.find_unused_parameters=true",
        "model.net._target_=sync_faults.MLPWithSideBranch",
        "+model.net.skip_on_rank=2",
        *fault("fault_a", "perturb_param", 1, 2, "net.model.1.weight"),
        *fault("fault_b", "perturb_param", 0, 4, "net.model.4.bias"),
        env=ENV,
        timeout=TIMEOUT,
    )
    found = findings(run)
    params = [f for f in found if f["kind"] == "param_mismatch"]
    first = params[0]
    assert first["global_step"] == 3 and first["ranks"] == [1] and first["where"] == "after_optimizer_step"
    weight = by_name(first)["net.model.1.weight"]
    assert weight["ranks"] == [1] and weight["shape"] == [128, 64] and weight["dtype"] == "float32"
    assert weight["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)
    later = [f for f in params if f["global_step"] >= 5 and f["where"] == "after_optimizer_step"]
    assert later, params
    bias = by_name(later[0])["net.model.4.bias"]
    assert (
        bias["ranks"] == [0] and bias["reference_rank"] != 0 and bias["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)
    )
    assert by_name(later[0])["net.model.1.weight"]["ranks"] == [1]
    unused = [f for f in found if f["kind"] == "no_local_grad"]
    assert unused and all(set(by_name(f)) == {"net.side.weight", "net.side.bias"} and f["ranks"] == [2] for f in unused)
    assert not [f for f in found if f["kind"] == "grad_mismatch"], "unused on one rank must not look like drift"
    assert not any(name.startswith("net.side") for f in params for name in by_name(f))
    assert (
        "parameters differ across ranks at global step 3" in run.output and "net.model.1.weight on rank 1" in run.output
    )


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_one_ulp_flip_is_caught_and_stop_ends_every_rank_cleanly(train):
    run = train(
        *small(8),
        "trainer.min_epochs=0",
        "callbacks.sync_check.on_mismatch=stop",
        *fault("flip", "flip_bit_param", 1, 2, "net.model.7.weight"),
        env=ENV,
        timeout=TIMEOUT,
    )
    (first, *_) = [f for f in findings(run) if f["kind"] == "param_mismatch"]
    flipped = by_name(first)["net.model.7.weight"]
    assert first["global_step"] == 3 and flipped["ranks"] == [1] and 0 < flipped["max_abs_diff"] < 1e-6
    report = summary(run)
    assert report["stopped"] and report["global_step"] == 3  # stopped after step 3 of 8, on both ranks, exit 0
    assert "stopping every rank at global step 3" in run.output


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_gradient_changed_after_the_all_reduce_raises_on_every_rank(train):
    run = train(
        *small(),
        "callbacks.sync_check.on_mismatch=raise",
        *fault("grad", "perturb_grad", 1, 2, "net.model.4.weight"),
        env=ENV,
        timeout=TIMEOUT,
        check=False,
    )
    assert run.returncode != 0
    assert "ReplicaDivergenceError" in run.output and "gradients differ across ranks at global step 2" in run.output
    (grad,) = [f for f in findings(run) if f["kind"] == "grad_mismatch"]
    tensor = by_name(grad)["net.model.4.weight"]
    assert grad["global_step"] == 2 and grad["where"] == "before_optimizer_step" and tensor["ranks"] == [1]
    assert tensor["max_abs_diff"] == pytest.approx(1e-3, rel=1e-2)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_no_sync_gradients_and_unbroadcast_buffers_are_flagged_in_tolerance_mode(train):
    """Every rank runs step 2's backward under DDP's no_sync(), so each keeps its own data's gradient; with
    broadcast_buffers=False the BatchNorm running stats differ: a buffer warning."""
    run = train(
        *small(),
        "+trainer.strategy.broadcast_buffers=false",
        "callbacks.sync_check.mode=tolerance",
        "+callbacks.nosync._target_=sync_faults.NoSyncStep",
        "+callbacks.nosync.step=2",
        env=ENV,
        timeout=TIMEOUT,
    )
    found = findings(run)
    grads = [f for f in found if f["kind"] == "grad_mismatch"]
    assert [f["global_step"] for f in grads] == [2]
    assert {"net.model.1.weight", "net.model.7.bias"} <= set(by_name(grads[0])) and grads[0]["ranks"] == [1]
    buffers = [f for f in found if f["kind"] == "buffer_mismatch"]
    assert buffers and "net.model.2.running_mean" in by_name(buffers[-1])
    assert "buffers differ across ranks" in run.output


def test_local_sgd_mode_checks_gradients_in_warmup_and_parameters_right_after_averaging_steps():
    """The rule the check reads off torch's own PeriodicModelAverager (a real one, on a 1-process gloo group); the
    2-process runs with comm=local_sgd are in tests/test_comm.py."""
    import torch.distributed as dist
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        averager = PeriodicModelAverager(period=4, warmup_steps=5)
        schedule = LocalSGDSchedule(averager)
        param = torch.nn.Parameter(torch.ones(3))
        param.grad = torch.zeros(3)
        grads_checked, params_checked = [], []
        for global_step in range(1, 19):
            if schedule.grads_synced():
                grads_checked.append(global_step)
            averager.average_parameters([param])  # what DDPStrategy.optimizer_step does after the step
            if schedule.params_synced():
                params_checked.append(global_step)
        assert grads_checked == [1, 2, 3, 4, 5]
        assert params_checked == [1, 2, 3, 4, 5, 6, 10, 14, 18]
        plain = LocalSGDSchedule(None)  # plain DDP: every step
        assert plain.grads_synced() and plain.params_synced() and plain.summary() is None
        assert schedule.summary()["model_averaging_period"] == 4
    finally:
        dist.destroy_process_group()


def test_compare_takes_the_majority_and_with_keys_only_among_ranks_holding_the_same_shard():
    from lit_template.diagnostics.replicas import compare, has_peers

    assert compare([7, 7, 7, 7], exact=True, rtol=0.0) == (-1, [])
    assert compare([7, 7, 9, 7], exact=True, rtol=0.0) == (0, [2])
    assert compare([1.0, 1.0 + 1e-9, 1.0], exact=False, rtol=1e-6) == (-1, [])
    # a 2x2 mesh: ranks 0,1 hold shard A, ranks 2,3 shard B; shards differ on purpose, rank 3 drifted from rank 2
    assert compare([5, 5, 8, 9], exact=True, rtol=0.0, keys=[1, 1, 2, 2]) == (2, [3])
    # sharded over every rank: no peers, nothing to compare
    assert compare([1, 2, 3, 4], exact=True, rtol=0.0, keys=[1, 2, 3, 4]) == (-1, [])
    assert has_peers([1, 1, 2, 2]) and not has_peers([1, 2, 3, 4])
