"""Overhead of the sync check at its default interval versus off, measured in the same DDP run.

    python scripts/bench_sync_check.py                      # 2 processes, gloo, the default model and data
    python scripts/bench_sync_check.py --steps 2400 -- trainer.devices=3 model=cnn

One ``train.py`` run; every block of ``2 * every_n_steps`` optimizer steps the check is switched on (at its default
interval) or off (every_n_steps=0), on every rank at the same step, so machine noise falls on both alike. Prints the
mean step time of each and their ratio, plus the check's own time (``sync/check_ms``) per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L

ROOT = Path(__file__).resolve().parents[1]


class AlternatingTimer(L.Callback):
    """Switches the SyncCheck on and off in blocks and times every step on each rank (rank 0 writes the result)."""

    def __init__(self, block_steps: int, out: str) -> None:
        self.block_steps, self.out = block_steps, out
        self.times: dict[str, list[float]] = {"on": [], "off": []}
        self.check_ms: list[float] = []
        self._last: float | None = None
        self._check: Any = None
        self._default_every = 0

    def _phase(self, step: int) -> str:
        return "on" if (step // self.block_steps) % 2 == 0 else "off"

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        from lit_template.callbacks.sync_check import SyncCheck

        self._check = next(c for c in trainer.callbacks if isinstance(c, SyncCheck))
        self._default_every = self._check.every_n_steps

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 0:  # an epoch boundary is not a step
            self._last = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        done = trainer.global_step - 1  # the step that just finished
        if self._last is not None and done >= self.block_steps:  # the first block warms up
            self.times[self._phase(done)].append(now - self._last)
        if self._phase(done) == "on" and done % self._default_every == 0 and done >= self.block_steps:
            self.check_ms.append(self._check.last_check_ms)
        # the next step's setting, the same on every rank
        self._check.every_n_steps = self._default_every if self._phase(trainer.global_step) == "on" else 0
        self._last = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            Path(self.out).write_text(
                json.dumps(
                    {
                        "times": self.times,
                        "check_ms": self.check_ms,
                        "every_n_steps": self._default_every,
                        "world_size": trainer.world_size,
                    }
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1600, help="optimizer steps in all (default 1600)")
    parser.add_argument("overrides", nargs="*", help="extra train.py overrides (after --)")
    args = parser.parse_args()
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        every = int(compose(config_name="train").callbacks.sync_check.every_n_steps)
    if every < 1:
        sys.exit(
            f"callbacks.sync_check.every_n_steps={every} in conf/callbacks/sync_check.yaml: the check is off, "
            "there is no overhead to measure"
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            "trainer=ddp_cpu",
            "callbacks=sync_check",
            "model.scheduler=null",
            "optimized_metric=null",
            "test=false",
            f"trainer.max_steps={args.steps}",
            "trainer.max_epochs=1000",
            "trainer.min_epochs=0",
            "trainer.limit_val_batches=0",
            "+trainer.enable_progress_bar=false",
            "data.batch_size=16",
            f"paths.log_dir={tmp}/logs",
            "+callbacks.bench._target_=bench_sync_check.AlternatingTimer",
            f"+callbacks.bench.block_steps={2 * every}",
            f"+callbacks.bench.out={out}",
            *args.overrides,
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")])),
        }
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    on, off = result["times"]["on"], result["times"]["off"]
    mean_on_ms, mean_off_ms = statistics.fmean(on) * 1000, statistics.fmean(off) * 1000
    check_ms = statistics.fmean(result["check_ms"]) if result["check_ms"] else float("nan")
    print(f"sync check at every_n_steps={every}, {result['world_size']} ranks: {len(on)} steps on, {len(off)} off")
    print(
        f"step time mean: on {mean_on_ms:.3f} ms, off {mean_off_ms:.3f} ms; "
        f"median: on {statistics.median(on) * 1000:.3f} ms, off {statistics.median(off) * 1000:.3f} ms"
    )
    print(f"overhead ratio (on / off, mean step time): {mean_on_ms / mean_off_ms:.4f}")
    print(
        f"check time: {check_ms:.3f} ms per check step = {check_ms / every:.4f} ms per step "
        f"= {100 * check_ms / every / mean_off_ms:.2f}% of the step time off"
    )


if __name__ == "__main__":
    main()
