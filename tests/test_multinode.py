"""Multi-node DDP: two torchrun "nodes" on 127.0.0.1 through scripts/launch_node.sh, and each launch error."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, kill_group

TESTS = str(Path(__file__).resolve().parent)
CPU = ["trainer.accelerator=cpu", "trainer.strategy.process_group_backend=gloo", "trainer.sync_batchnorm=false"]
TINY = [
    "trainer.max_epochs=2",
    "trainer.limit_train_batches=6",
    "trainer.limit_val_batches=2",
    "test=false",
    "callbacks.rich_progress_bar=null",
    "trainer.strategy.timeout.seconds=90",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.ddp
@pytest.mark.timeout(300)
def test_two_torchrun_nodes_on_one_machine_train_in_sync(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")}
    env.update(
        MASTER_PORT=str(free_port()),
        LT_RUN_ID="two_nodes",
        PYTHON=sys.executable,
        PYTHONPATH=TESTS,
        PYTHONWARNINGS="ignore",
    )
    args = [*CPU, *TINY, f"paths.log_dir={tmp_path}", "+callbacks.weights._target_=support_callbacks.SaveRankWeights"]
    nodes = [
        subprocess.Popen(
            ["bash", "scripts/launch_node.sh", str(rank), "127.0.0.1", "2", "1", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for rank in (0, 1)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=270)[0])
    except subprocess.TimeoutExpired:
        for node in nodes:
            kill_group(node)
        pytest.fail("the two-node job did not finish in 270 s (hang?)")
    for rank, (node, out) in enumerate(zip(nodes, outputs, strict=True)):
        assert node.returncode == 0, f"node {rank} exited {node.returncode}\n{out[-5000:]}"

    run_dirs = list((tmp_path / "train" / "runs").glob("*"))
    assert [p.name for p in run_dirs] == ["two_nodes"], "every node must write into the one run dir"
    run_dir = run_dirs[0]
    weights = [torch.load(run_dir / "rank_weights" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert [w["world_size"] for w in weights] == [2, 2] and weights[0]["global_step"] == 2 * 6
    for name, tensor in weights[0]["state"].items():
        assert torch.equal(tensor, weights[1]["state"][name]), f"{name} differs between node 0 and node 1"
    # one set of checkpoints, one saved Hydra config, one log
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["epoch_001.ckpt", "last.ckpt"]
    assert len(list(tmp_path.glob("**/.hydra"))) == 1
    assert len(list(tmp_path.glob("**/metrics.csv"))) == 1
    assert [p.name for p in run_dir.glob("*.log") if p.name != "config_tree.log"] == ["train.log"]


def multinode(train, *extra, env):
    return train(
        "trainer=ddp_multinode", "trainer.devices=1", "trainer.num_nodes=2", *extra, env=env, check=False, timeout=120
    )


def assert_clean_error(run, *needles):
    assert run.returncode == 2, run.output[-3000:]
    assert "Traceback" not in run.output
    for needle in needles:
        assert needle in run.output, f"{needle!r} not in {run.output[-2000:]}"


def test_missing_master_addr_is_named(train):
    run = multinode(train, *CPU, env={"NODE_RANK": "1"})
    assert_clean_error(run, "MASTER_ADDR is not set")


def test_missing_master_port_is_named(train):
    run = multinode(train, *CPU, env={"NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1"})
    assert_clean_error(run, "MASTER_PORT is not set")


def test_world_size_that_does_not_match_nodes_times_devices(train):
    run = multinode(
        train, *CPU, env={"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "WORLD_SIZE": "3"}
    )
    assert_clean_error(run, "WORLD_SIZE=3", "trainer.num_nodes=2 x trainer.devices=1 = 2")


def test_node_rank_out_of_range(train):
    run = multinode(train, *CPU, env={"NODE_RANK": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"})
    assert_clean_error(run, "NODE_RANK=2 is out of range", "0..1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_nccl_on_a_machine_without_gpu_suggests_gloo(train):
    run = multinode(
        train, "trainer.accelerator=cpu", env={"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    )
    assert_clean_error(run, "process_group_backend=nccl", "gloo", "trainer=ddp_cpu")


def test_launch_script_refuses_a_node_rank_out_of_range():
    proc = subprocess.run(
        ["bash", "scripts/launch_node.sh", "3", "127.0.0.1", "2", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2 and "NODE_RANK=3 is out of range for NNODES=2" in proc.stderr
