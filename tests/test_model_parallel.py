"""trainer=fsdp2_cpu / model_parallel_cpu: real 2- and 4-process runs of model=gpt over gloo on the CPU.

Every parallel run is compared with one process training the same model on the same global batch for the same steps:
the validation loss after 8 optimizer steps must agree within ``RTOL`` (measured: the same to 6 digits; tensor
parallelism only reorders float sums). The sharded checkpoint must resume exactly: bit-for-bit the same weights and
losses as a run that never stopped.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import run_script
from gpt_support import TINY, column, load_sharded, read_metrics, steps

# relative tolerance of the val loss after 8 steps against one process: float reassociation of split matmuls and of
# the gradient reduce-scatter, amplified a little by Adam (measured: TP equal to the last bit, FSDP2 and 2x2 within
# 1.1e-8 relative)
RTOL = 1e-5
GLOBAL_BATCH = ["data.global_batch_size=8"]
STEPS = 8


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("mp")


@pytest.fixture(scope="module")
def single(logs):
    """One process, no strategy: the reference."""
    run = run_script(
        "train.py", *TINY, *GLOBAL_BATCH, *steps(STEPS), "trainer=cpu", log_dir=logs / "single", timeout=90
    )
    return column(read_metrics(run.run_dir()), "val/loss")[STEPS - 1]


@pytest.fixture(scope="module")
def fsdp2(logs):
    """FSDP2 on 2 processes, 4 samples each. Also the run the resume test starts from (its sharded checkpoint after
    step 4, mid-epoch) and compares with (its steps 5 to 8)."""
    return run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=fsdp2_cpu",
        # keep the checkpoint of every 4th step: step_4 and step_8
        "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.save_top_k=-1",
        "+callbacks.model_checkpoint.every_n_train_steps=4",
        "callbacks.model_checkpoint.every_n_epochs=null",
        "callbacks.model_checkpoint.filename='step_{step}'",
        log_dir=logs / "fsdp2",
        timeout=120,
    )


def val_loss(run) -> float:
    return column(read_metrics(run.run_dir()), "val/loss")[STEPS - 1]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_tensor_parallel_on_2_processes_matches_one_process(single, logs):
    run = run_script(
        "train.py", *TINY, *GLOBAL_BATCH, *steps(STEPS), "trainer=model_parallel_cpu", log_dir=logs / "tp", timeout=120
    )
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in run.output
    # both ranks share each batch (data-parallel size 1): 8 samples per step, as the single process
    assert val_loss(run) == pytest.approx(single, rel=RTOL)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_tensor_parallel_with_sequence_parallel_matches_one_process(single, logs):
    run = run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=model_parallel_cpu",
        "model.sequence_parallel=true",
        log_dir=logs / "sp",
        timeout=120,
    )
    assert val_loss(run) == pytest.approx(single, rel=RTOL)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_fsdp2_on_2_processes_matches_one_process_on_the_same_global_batch(single, fsdp2):
    assert val_loss(fsdp2) == pytest.approx(single, rel=RTOL)
    # a sharded checkpoint: one folder, a shard per rank, Lightning's metadata beside them
    ckpt = fsdp2.run_dir() / "checkpoints" / "last.ckpt"
    assert ckpt.is_dir()
    assert {p.name for p in ckpt.iterdir()} >= {".metadata", "meta.pt", "__0_0.distcp", "__1_0.distcp"}
    meta = torch.load(ckpt / "meta.pt", weights_only=True)
    assert meta["global_step"] == STEPS


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_2x2_mesh_on_4_processes_trains_and_matches_one_process(single, logs):
    run = run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=model_parallel_cpu",
        "trainer.devices=4",
        "trainer.strategy.tensor_parallel_size=2",
        log_dir=logs / "2x2",
        timeout=240,
    )
    assert "MEMBER: 4/4" in run.output
    # data-parallel size 4 / 2 = 2: 4 samples per data-parallel rank, the global batch stays 8
    assert val_loss(run) == pytest.approx(single, rel=RTOL)


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_sharded_checkpoint_resumes_exactly(fsdp2, logs):
    # resume from the folder written after step 4 of 8 (the same LR schedule: it is sized from max_steps)
    ckpt = fsdp2.run_dir() / "checkpoints" / "step_4.ckpt"
    assert torch.load(ckpt / "meta.pt", weights_only=True)["global_step"] == 4
    # through train.py's ckpt_path (a sharded checkpoint folder; checkpoints.resolve_ckpt_path checks its meta.pt)
    resumed = run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=fsdp2_cpu",
        f"ckpt_path={ckpt}",
        log_dir=logs / "resumed",
        timeout=120,
    )
    assert "Restoring states from the checkpoint path" in resumed.output
    whole = read_metrics(fsdp2.run_dir())
    again = read_metrics(resumed.run_dir())
    # the same batches and updates as the run that never stopped: equal losses, step by step, and equal weights
    losses, resumed_losses = column(whole, "train/loss_step"), column(again, "train/loss_step")
    assert sorted(resumed_losses) == list(range(4, STEPS))
    assert all(resumed_losses[s] == losses[s] for s in resumed_losses), (losses, resumed_losses)
    assert column(again, "val/loss")[STEPS - 1] == column(whole, "val/loss")[STEPS - 1]
    a = load_sharded(fsdp2.run_dir() / "checkpoints" / "last.ckpt")
    b = load_sharded(resumed.run_dir() / "checkpoints" / "last.ckpt")
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for name, tensor in a["state_dict"].items():
        assert torch.equal(tensor, b["state_dict"][name]), name
    # the optimizer state too (Adam's moments)
    assert torch.equal(
        a["optimizer_0"]["state"]["net.blocks.0.mlp.fc.weight"]["exp_avg"],
        b["optimizer_0"]["state"]["net.blocks.0.mlp.fc.weight"]["exp_avg"],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # 2 x 2 is not the world size 2
        (
            ["trainer.strategy.data_parallel_size=2", "trainer.strategy.tensor_parallel_size=2"],
            r"trainer\.strategy\.data_parallel_size=2 x trainer\.strategy\.tensor_parallel_size=2 = 4 is not the "
            r"world size 2",
        ),
        # 2 does not divide 3 processes
        (
            ["trainer.devices=3", "trainer.strategy.tensor_parallel_size=2"],
            r"trainer\.strategy\.tensor_parallel_size=2 does not divide the world size 3",
        ),
        # 3 tensor-parallel ranks cannot split 4 heads
        (
            ["trainer.devices=3"],
            r"trainer\.strategy\.tensor_parallel_size=3 does not divide model\.n_head=4",
        ),
    ],
)
def test_a_mesh_that_does_not_fit_fails_at_start_with_one_line(train, overrides, message):
    run = train(*TINY, *steps(2), "trainer=model_parallel_cpu", *overrides, check=False, timeout=60)
    assert run.returncode == 2, run.output[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), run.stderr[-3000:]
    # before any process was started
    assert "Initializing distributed" not in run.output and "Traceback" not in run.output


# -- the template's callbacks on the 2 x 2 mesh (4 processes: ranks 0,1 and 2,3 are tensor-parallel pairs) ---------
MESH_2X2 = ["trainer=model_parallel_cpu", "trainer.devices=4", "trainer.strategy.tensor_parallel_size=2"]
FAULT = "lit_template.testing.faults.FaultInjection"


def fault(name: str, **options) -> list[str]:
    return [f"+callbacks.{name}._target_={FAULT}", *(f"+callbacks.{name}.{k}={v}" for k, v in options.items())]


def records(run, name: str) -> list[dict]:
    path = run.run_dir() / "reports" / name
    assert path.exists(), f"no {path}\n{run.output[-4000:]}"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_sync_check_names_a_perturbed_shard_and_nan_guard_stops_every_rank_on_the_2x2_mesh(logs):
    run = run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(8),
        *MESH_2X2,
        "callbacks.sync_check.every_n_steps=1",
        # exact checksums (the default): the replicated copies of tensor-parallel peers are bit-identical
        # rank 1's shard of ln_f's gradient, after the reduce-scatter (FSDP2 shards ln_f over the data-parallel
        # ranks; tensor-parallel peers 0 and 1 hold the same shard)
        *fault("fault", action="perturb_grad", rank=1, step=3, target="net.ln_f.weight"),
        *fault("nan", action="nan_grad", rank=2, step=5),
        log_dir=logs / "callbacks_2x2",
        check=False,
        timeout=240,
    )
    assert run.returncode != 0, run.output[-4000:]
    assert "16 of 36 tensors have a copy of their shard on another rank" in run.output, run.output[-4000:]
    findings = records(run, "sync_check.jsonl")
    assert findings and min(f["global_step"] for f in findings) >= 3, findings[:2]  # nothing before the fault
    first = findings[0]
    assert first["kind"] == "grad_mismatch" and first["global_step"] == 3 and first["ranks"] == [1], first
    (tensor,) = first["tensors"]
    assert tensor["name"] == "net.ln_f.weight" and tensor["ranks"] == [1] and tensor["reference_rank"] == 0
    assert "gradients differ across ranks at global step 3" in run.output
    assert "net.ln_f.weight on rank 1" in run.output
    # from then on rank 1 trains another model: its parameters differ too
    assert any(f["kind"] == "param_mismatch" and 1 in f["ranks"] for f in findings)
    # the NaN gradient in rank 2's shard: every rank stops, at the next step (read one step later, no host sync)
    (event,) = records(run, "nonfinite.jsonl")
    assert event["what"] == "grad" and event["ranks"] == [2] and event["global_step"] == 5, event
    assert event["stopped_at"] == 6
    assert "stopping every rank at step 6" in run.output


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_hang_doctor_names_the_stuck_rank_on_the_2x2_mesh(logs):
    run = run_script(
        "train.py",
        *TINY,
        *GLOBAL_BATCH,
        *steps(8),
        *MESH_2X2,
        "callbacks.hang_doctor.stall_timeout_s=6",
        *fault("fault", action="hang", rank=3, step=3),
        log_dir=logs / "hang_2x2",
        check=False,
        timeout=240,
    )
    assert run.returncode != 0, run.output[-4000:]
    summary = json.loads((run.run_dir() / "hang" / "summary.json").read_text())
    assert summary["kind"] == "hang" and summary["ranks"] == [0, 1, 2, 3]
    assert summary["stuck_ranks"] == [3] and summary["waiting_ranks"] == [0, 1, 2], summary
    assert "rank 3 is stuck at step 3 in stuck_forever" in run.output
    assert "stuck_forever" in (run.run_dir() / "hang" / "rank3.txt").read_text()


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(240)
def test_profiling_counts_distinct_tokens_and_mfu_from_the_formula_under_tensor_parallel(logs):
    peak = 1e11  # a stated peak FLOP/s per device: a CPU has no table
    run = run_script(
        "train.py",
        *[o for o in TINY if not o.startswith("callbacks.profiling")],
        *GLOBAL_BATCH,
        *steps(STEPS),
        "trainer=model_parallel_cpu",
        "callbacks.profiling.log_every_n_steps=2",
        f"callbacks.profiling.peak_flops={peak}",
        log_dir=logs / "profile_tp",
        timeout=180,
    )
    report = json.loads((run.run_dir() / "reports" / "profile.json").read_text())
    th = report["throughput"]
    # both tensor-parallel ranks train on the same 8 x 32 tokens per step: counted once
    assert th["samples"] == STEPS * 8 and th["tokens"] == STEPS * 8 * 32, th
    assert th["tokens_per_s"] == pytest.approx(th["tokens_per_s_global"] / 2, rel=0.2)
    # MFU from GPT.flops_per_token() = 6 N + 12 L T d, N counted here from the network itself
    from lit_template.models.gpt_net import GPTNet

    net = GPTNet(256, 32, 2, 4, 32, 0.0, True)
    n = sum(p.numel() for p in net.parameters()) - net.wpe.weight.numel()
    flops_per_sample = (6 * n + 12 * 2 * 32 * 32) * 32
    mfu = report["mfu"]
    assert mfu["flops_per_sample"] == flops_per_sample and "flops_per_token" in mfu["flops_from"]
    assert mfu["mfu_pct"] == pytest.approx(100 * flops_per_sample * th["samples_per_s_global"] / 2 / peak)


def test_ckpt_path_last_and_auto_find_a_sharded_folder_and_refuse_an_unfinished_one(tmp_path):
    from omegaconf import OmegaConf

    from lit_template.checkpoints import resolve_ckpt_path
    from lit_template.errors import ConfigError

    run = tmp_path / "logs" / "train" / "runs" / "1"
    folder = run / "checkpoints" / "last.ckpt"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"shard")
    cfg = OmegaConf.create(
        {"paths": {"output_dir": str(tmp_path / "new"), "log_dir": str(tmp_path / "logs")}, "task_name": "train"}
    )
    # no .metadata / meta.pt yet: a save that did not finish is no checkpoint
    cfg.ckpt_path = "auto"
    assert resolve_ckpt_path(cfg) is None
    cfg.ckpt_path = str(folder)
    with pytest.raises(ConfigError, match=r"ckpt_path=.* is a folder but not a sharded checkpoint"):
        resolve_ckpt_path(cfg)
    (folder / ".metadata").write_bytes(b"")
    torch.save({"global_step": 4, "epoch": 0}, folder / "meta.pt")
    assert resolve_ckpt_path(cfg) == str(folder)
    cfg.ckpt_path = "last"  # the newest last.ckpt among the task's runs
    assert resolve_ckpt_path(cfg) == str(folder)
    cfg.paths.output_dir = str(run)
    cfg.ckpt_path = "auto"  # a restarted job in its own run dir
    assert resolve_ckpt_path(cfg) == str(folder)
    torch.save(["not", "lightning"], folder / "meta.pt")
    with pytest.raises(ConfigError, match=r"meta\.pt is not Lightning's metadata"):
        resolve_ckpt_path(cfg)
