"""What the hang doctor costs per training step: ``python scripts/bench_hang_doctor.py [--steps 200] [--repeats 3]``.

Trains the default model (digits MLP, conf/model/mlp.yaml, batch size 64) on one CPU process, alternating
runs with the callback off, with an empty callback (Lightning's own cost of one more callback) and with the hang doctor
on, and prints the median step time of each and their ratios; then times the progress
marks alone (the only work the callback adds to the training thread) against the step time. The watchdog thread wakes
once a second and writes a heartbeat every heartbeat_interval_s; it issues no collectives.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lit_template.callbacks.hang_doctor import HangDoctor  # noqa: E402
from lit_template.data import DigitsDataModule  # noqa: E402


class BatchEndTimes(L.Callback):
    """Wall time between consecutive train batch ends, first steps (warm-up) dropped."""

    def __init__(self, warmup: int = 20) -> None:
        self.warmup, self.times_ms, self._last = warmup, [], None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        if self._last is not None and trainer.global_step > self.warmup:
            self.times_ms.append((now - self._last) * 1e3)
        self._last = now


def default_model_config() -> DictConfig:
    """The default model's config as train.py composes it (model/optimizer and model/scheduler included), with the
    digits' shape, so that only the model config is read."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        model = compose(config_name="train", overrides=["model=mlp"]).model
    return OmegaConf.create(
        {"data": {"num_classes": 10, "input_shape": [1, 8, 8]}, "model": OmegaConf.to_container(model)}
    )


def default_model() -> L.LightningModule:
    """The default model, without its ReduceLROnPlateau scheduler: that needs validation, which would only add noise."""
    cfg = default_model_config()
    cfg.model.scheduler = None
    return hydra.utils.instantiate(cfg.model)


def bare_trainer(steps: int, callbacks: list[L.Callback], root: str) -> L.Trainer:
    """One CPU process, no validation, logger, checkpoint, progress bar or summary: only the given callbacks."""
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )


def median_step_ms(steps: int, extra: str, root: str) -> float:
    datamodule = DigitsDataModule(batch_size=64, num_workers=0)
    model = default_model()
    timer = BatchEndTimes()
    # "empty": a callback that does nothing, to tell Lightning's cost of calling one more callback's hooks apart
    extras = {"off": [], "empty": [L.Callback()], "on": [HangDoctor(stall_timeout_s=300, flight_recorder=False)]}
    trainer = bare_trainer(steps, [timer] + extras[extra], root)
    trainer.fit(model, datamodule=datamodule)
    return statistics.median(timer.times_ms)


def mark_cost_us(n: int = 200_000) -> float:
    """The marks of one training step (batch start, backward, optimizer step, batch end) with the watchdog armed."""
    with tempfile.TemporaryDirectory() as root:
        doctor = HangDoctor(stall_timeout_s=300, flight_recorder=False)
        trainer = type("T", (), {"default_root_dir": root, "global_rank": 0, "world_size": 1, "global_step": 0})()
        doctor.on_train_start(trainer, None)
        t0 = time.perf_counter()
        for _ in range(n):
            doctor.on_train_batch_start(trainer, None, None, 0)
            doctor.on_before_backward(trainer, None, None)
            doctor.on_after_backward(trainer, None)
            doctor.on_before_optimizer_step(trainer, None, None)
            doctor.on_train_batch_end(trainer, None, None, None, 0)
        cost = (time.perf_counter() - t0) / n * 1e6
        doctor.on_train_end(trainer, None)
        return cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    torch.set_num_threads(1)  # a tiny model: more threads only add contention noise on a shared machine

    times: dict[str, list[float]] = {"off": [], "empty": [], "on": []}
    with tempfile.TemporaryDirectory() as root:
        for _ in range(args.repeats):  # alternate, so a busy machine slows all alike
            for extra in times:
                times[extra].append(median_step_ms(args.steps, extra, root))
    step_off, step_empty, step_on = (statistics.median(times[k]) for k in ("off", "empty", "on"))
    marks_us = mark_cost_us()
    print(
        f"step_time_ms off={step_off:.3f} empty_callback={step_empty:.3f} on={step_on:.3f} "
        f"ratio_on_off={step_on / step_off:.4f} ratio_on_empty={step_on / step_empty:.4f} "
        f"({args.repeats} alternating runs of {args.steps} steps, median)"
    )
    print(f"marks_us_per_step={marks_us:.2f} = {100 * marks_us / 1e3 / step_off:.3f}% of the step time")


if __name__ == "__main__":
    main()
