"""The NaN guard's layout (small gradients in one flat buffer, large ones on their own) on one process, in-process.

The multi-process behaviour (every rank stops at the same step, skip on every rank) is in tests/test_reliability.py
and tests/test_model_parallel.py, through train.py.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lit_template.callbacks import nonfinite_guard
from lit_template.callbacks.nonfinite_guard import NonFiniteError, NonFiniteGuard
from lit_template.testing.faults import FaultInjection


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 8)  # weight 32 values, bias 8
        self.b = torch.nn.Linear(8, 2)  # weight 16, bias 2
        self.unused = torch.nn.Linear(2, 2)  # never gets a gradient: counts as zeros

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    tmp_path, guard: NonFiniteGuard | None, fault: FaultInjection | None, accumulate: int = 1, model: Tiny | None = None
) -> Tiny:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = model or Tiny()
    trainer = L.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_steps=5,
        accumulate_grad_batches=accumulate,
        callbacks=[c for c in (fault, guard) if c is not None],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model


def events(tmp_path) -> list[dict]:
    path = tmp_path / "reports" / "nonfinite.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# every gradient in the buffer; a.weight and a.bias in it and b's on their own; every gradient on its own
@pytest.mark.parametrize("flat_max", [nonfinite_guard.FLAT_MAX, 40, 0])
@pytest.mark.parametrize("target", ["a.bias", "b.weight"])
def test_a_nan_gradient_is_named_and_stops_before_its_update_whatever_the_layout(
    tmp_path, monkeypatch, flat_max, target
):
    # one CPU process: checked and read in the step itself (under DDP or on a GPU, one step later:
    # tests/test_reliability.py, tests/test_model_parallel.py)
    monkeypatch.setattr(nonfinite_guard, "FLAT_MAX", flat_max)
    model = Tiny()
    with pytest.raises(NonFiniteError, match=f"non-finite gradient of {target} on rank 0 at step 2; stopping every"):
        fit(tmp_path, NonFiniteGuard(), FaultInjection("nan_grad", rank=0, step=2, target=target), model=model)
    (event,) = events(tmp_path)
    assert event["what"] == "grad" and event["tensor"] == target and event["ranks"] == [0]
    assert event["global_step"] == 2 and event["stopped_at"] == 2
    assert event["loss"]["0"] > 0  # the step's (finite) loss, read back from the buffer
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the bad update never ran


def test_the_check_changes_no_gradient(tmp_path):
    # the fused check multiplies every gradient by 1 in place: the run's parameters are bit for bit those without it
    guarded = fit(tmp_path / "a", NonFiniteGuard(), None)
    plain = fit(tmp_path / "b", None, None)
    for (name, a), b in zip(guarded.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("flat_max", [nonfinite_guard.FLAT_MAX, 0])
def test_a_nan_loss_in_one_micro_batch_of_three_is_reported_as_the_loss(tmp_path, monkeypatch, flat_max):
    monkeypatch.setattr(nonfinite_guard, "FLAT_MAX", flat_max)
    with pytest.raises(NonFiniteError, match="non-finite loss on rank 0 at step 1 \\(loss=nan\\)"):
        fit(tmp_path, NonFiniteGuard(), FaultInjection("nan_loss", rank=0, step=1), accumulate=3)
    (event,) = events(tmp_path)
    assert event["what"] == "loss" and event["loss"] == {"0": "nan"} and event["stopped_at"] == 1


def test_skip_drops_the_steps_update_and_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(nonfinite_guard, "FLAT_MAX", 40)
    model = fit(
        tmp_path, NonFiniteGuard(on_nonfinite="skip"), FaultInjection("nan_grad", rank=0, step=3, target="b.bias")
    )
    (event,) = events(tmp_path)
    assert event["action"] == "skip" and event["tensor"] == "b.bias" and event["global_step"] == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_check_grads_false_lets_a_nan_gradient_through_and_catches_the_loss_it_makes(tmp_path):
    with pytest.raises(NonFiniteError, match="non-finite loss on rank 0 at step 3"):
        fit(tmp_path, NonFiniteGuard(check_grads=False), FaultInjection("nan_grad", rank=0, step=2, target="b.weight"))
    (event,) = events(tmp_path)  # nothing at step 2: the NaN gradient went into the parameters
    assert event["what"] == "loss" and event["global_step"] == 3
