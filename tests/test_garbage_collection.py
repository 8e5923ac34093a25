"""The garbage_collection callback: Python's collector frozen and off during fit, collections at fixed steps on every
rank, full passes only at epoch ends, the collector put back afterwards (on success and on an exception), forked
workers collecting on their own, and a slow collection said with its rank and step."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_template.callbacks.garbage_collection import GarbageCollection

TESTS = Path(__file__).parent
PROBE = ["+callbacks.gcprobe._target_=support_callbacks.GcProbe", "test=false"]


def probe(run, rank: int = 0) -> dict:
    (path,) = run.run_dir().glob(f"gc_probe/rank{rank}.json")
    return json.loads(path.read_text())


def test_the_default_run_collects_on_its_schedule_and_puts_the_collector_back(train):
    run = train("trainer.max_steps=120", *PROBE, env={"PYTHONPATH": str(TESTS)}, timeout=200)
    seen = probe(run)
    assert seen["batches"] and all(not b["enabled"] for b in seen["batches"]), "automatic collection was on"
    assert min(b["frozen"] for b in seen["batches"]) > 10_000  # torch, Lightning, Hydra: frozen at train start
    during = [c for c in seen["collections"] if c["batches"] < len(seen["batches"])]  # before the collector is back
    by_gen = {g: [c["global_step"] for c in during if c["generation"] == g] for g in (0, 1, 2)}
    assert by_gen[0] == []  # no automatic collection
    assert by_gen[1] == [50, 100]  # every_n_steps: 50
    # one full pass per epoch end (validation end and epoch end share a step); the last one runs after train end
    last = seen["batches"][-1]["global_step"]
    assert sorted(set(by_gen[2])) == sorted(by_gen[2]) == sorted({s for s in seen["epoch_ends"] if s < last})
    assert len(by_gen[2]) >= 4
    assert seen["after_fit"] == {"enabled": True, "frozen": 0}


def test_without_it_python_collects_whenever_its_thresholds_say(train):
    run = train("trainer.max_steps=60", "callbacks.garbage_collection=null", *PROBE, env={"PYTHONPATH": str(TESTS)})
    seen = probe(run)
    assert all(b["enabled"] and b["frozen"] == 0 for b in seen["batches"])
    automatic = [c for c in seen["collections"] if c["generation"] == 0]
    assert len(automatic) >= 5  # the loop and the collate of each batch allocate enough for a few every 10 steps


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_collects_at_the_same_steps_under_ddp(train):
    # full passes at steps 40 and 80 on both ranks, whether or not an epoch ends there
    gc_options = "callbacks.garbage_collection.full_every_n_steps=40"
    run = train(
        "trainer=ddp_cpu", "trainer.max_steps=110", gc_options, *PROBE, env={"PYTHONPATH": str(TESTS)}, timeout=200
    )
    seen = [probe(run, r) for r in (0, 1)]
    ranks = [
        [(c["generation"], c["global_step"]) for c in s["collections"] if c["batches"] < len(s["batches"])]
        for s in seen
    ]
    assert [c for c in ranks[0] if c[0] == 1] == [(1, 50), (1, 100)]
    assert (2, 40) in ranks[0] and (2, 80) in ranks[0]
    assert ranks[0] == ranks[1]


def test_a_slow_collection_is_reported_by_train_py_with_rank_and_step(train):
    # warn_ms this low makes every scheduled collection "slow": the report a user gets when a step leaves many cycles
    run = train("trainer.max_steps=60", "test=false", "callbacks.garbage_collection.warn_ms=0.000001")
    records = [json.loads(line) for line in (run.run_dir() / "reports" / "gc.jsonl").read_text().splitlines()]
    young = [r for r in records if r["generation"] == 1]
    assert [(r["global_rank"], r["global_step"]) for r in young] == [(0, 50)]
    assert young[0]["kind"] == "slow_garbage_collection" and young[0]["took_ms"] > 0
    assert "garbage collection: on global rank 0 at step 50 a generation-1 collection took" in run.output


def test_a_bad_interval_names_the_option(train):
    run = train("callbacks.garbage_collection.every_n_steps=0", check=False, timeout=120)
    assert run.returncode == 2
    assert "error: callbacks.garbage_collection.every_n_steps must be a whole number" in run.output
    assert "Traceback" not in run.output


# -- in-process ------------------------------------------------------------------------------------------------------
class Tiny(L.LightningModule):
    def __init__(self, fail_at: int | None = None, fork_at: int | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.fail_at, self.fork_at = fail_at, fork_at
        self.child_had_gc: bool | None = None

    def training_step(self, batch, batch_idx):
        if batch_idx == self.fail_at:
            raise RuntimeError("boom (test)")
        if batch_idx == self.fork_at:
            self.child_had_gc = fork_and_ask_gc_enabled()
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fork_and_ask_gc_enabled() -> bool:
    """What a forked child (a dataloader worker) sees: is its automatic collection on?"""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.write(write, b"1" if gc.isenabled() else b"0")
        os._exit(0)
    os.close(write)
    answer = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    return answer == b"1"


def fit(tmp_path, callback: GarbageCollection, model: Tiny, steps: int = 12) -> L.Trainer:
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_steps=steps,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    return trainer


def test_an_exception_in_a_step_puts_the_collector_back(tmp_path):
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        fit(tmp_path, GarbageCollection(every_n_steps=5), Tiny(fail_at=3))
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_worker_collects_on_its_own(tmp_path):
    model = Tiny(fork_at=2)
    fit(tmp_path, GarbageCollection(every_n_steps=5), model)
    assert model.child_had_gc is True
    assert gc.isenabled()


def test_without_an_interval_only_the_freeze_applies(tmp_path):
    seen: list[tuple[bool, int]] = []

    class Look(L.Callback):
        def on_train_batch_end(self, *args) -> None:
            seen.append((gc.isenabled(), gc.get_freeze_count()))

    data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        max_steps=3,
        callbacks=[GarbageCollection(every_n_steps=None), Look()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), DataLoader(data, batch_size=4))
    assert seen and all(enabled and frozen > 0 for enabled, frozen in seen)
    assert gc.get_freeze_count() == 0


def test_a_long_epoch_gets_a_full_pass_every_full_every_n_steps(tmp_path):
    callback = GarbageCollection(every_n_steps=2, full_every_n_steps=6, warn_ms=1e-6)  # every collection recorded
    fit(tmp_path, callback, Tiny(), steps=14)  # one epoch of 16 batches: no epoch end before step 14
    records = [json.loads(line) for line in (tmp_path / "reports" / "gc.jsonl").read_text().splitlines()]
    steps = {g: [r["global_step"] for r in records if r["generation"] == g] for g in (1, 2)}
    assert steps[1] == [2, 4, 8, 10, 14]  # step 6 and 12: the full pass instead
    assert steps[2] == [6, 12, 14]  # and the epoch's end (max_steps) at 14


def test_a_slow_collection_is_said_with_rank_step_and_generation(tmp_path, caplog):
    callback = GarbageCollection(every_n_steps=5, warn_ms=1e-6)  # every collection counts as slow
    fit(tmp_path, callback, Tiny(), steps=10)
    records = [json.loads(line) for line in (tmp_path / "reports" / "gc.jsonl").read_text().splitlines()]
    scheduled = [r for r in records if r["generation"] == 1]
    assert [r["global_step"] for r in scheduled] == [5, 10]
    first = scheduled[0]
    assert first["kind"] == "slow_garbage_collection" and first["global_rank"] == 0
    assert first["took_ms"] > 0 and first["unfrozen_objects"] > 0
    assert callback.collections == len(records)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"full_every_n_steps": 2.5}, "full_every_n_steps"),
        ({"warn_ms": 0}, "warn_ms"),
    ],
)
def test_bad_options_name_themselves(options, needle):
    from lit_template.errors import ConfigError

    with pytest.raises(ConfigError, match=f"callbacks.garbage_collection.{needle}"):
        GarbageCollection(**options)
