"""The profiling callback's overhead: the same training with it on and off, in one run, as a ratio.

    python scripts/bench_profiling.py                        # digits + MLP on the CPU (the worst case: tiny steps)
    python scripts/bench_profiling.py model=cnn --epochs 81  # any data/model config, as train.py takes them
    python scripts/bench_profiling.py --trace                # the cost of trace mode instead of light mode

One fit, no validation. After a warm-up epoch, the callback's per-step hooks run in every other epoch, in blocks of
four epochs: on, off, off, on (so a slow drift of the machine cancels). The ratio of a block is its on epochs' time
per step over its off epochs'; the figure is the median over blocks. The one-off work (setup, the end-of-fit report)
is not in it. Target: under 2% in light mode. On a shared machine use ``OMP_NUM_THREADS=1``.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import hydra
import lightning as L
from hydra import compose, initialize_config_dir

import lit_template.utils.resolvers  # noqa: F401  (the ${lt.*} resolvers the configs use)
from lit_template.callbacks.profiling import ProfilingCallback

ROOT = Path(__file__).resolve().parents[1]


class EpochClock(L.Callback):
    """Wall time and this thread's CPU time per step, for each training epoch: the figures compared.

    The CPU time of the loop's thread is what the callback adds to on the host; unlike wall time it barely moves when
    other processes share the machine.
    """

    def __init__(self) -> None:
        self.wall_s: list[float] = []
        self.cpu_s: list[float] = []

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._b0 = trainer.fit_loop.epoch_loop.batch_progress.total.completed
        self._t0, self._c0 = time.perf_counter(), time.thread_time()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        wall, cpu = time.perf_counter() - self._t0, time.thread_time() - self._c0
        batches = max(trainer.fit_loop.epoch_loop.batch_progress.total.completed - self._b0, 1)
        self.wall_s.append(wall / batches)
        self.cpu_s.append(cpu / batches)


def profiled(epoch: int) -> bool:
    """Epoch 0 warms up (on); then blocks of four: on, off, off, on."""
    return epoch == 0 or (epoch - 1) % 4 in (0, 3)


class EveryOtherEpoch(L.Callback):
    """Runs the profiling callback's per-step hooks only in the epochs ``profiled`` names (its one-off hooks always),
    and adds up the time spent inside them: the direct cost, which other processes on the machine hardly blur."""

    PER_STEP = (
        "on_train_epoch_start",
        "on_train_batch_start",
        "on_before_backward",
        "on_before_optimizer_step",
        "on_train_batch_end",
    )
    ONE_OFF = ("setup", "on_train_start", "on_train_end", "on_fit_end")

    def __init__(self, inner: ProfilingCallback) -> None:
        self.inner = inner
        self.inside_s = 0.0
        self.steps_on = 0
        for name in self.PER_STEP:
            setattr(self, name, self._per_step(getattr(inner, name)))
        for name in self.ONE_OFF:
            setattr(self, name, getattr(inner, name))

    def _per_step(self, hook):
        def call(trainer, *args):
            if not profiled(trainer.current_epoch):
                return
            t0 = time.perf_counter()
            hook(trainer, *args)
            self.inside_s += time.perf_counter() - t0
            if hook.__name__ == "on_train_batch_end" and trainer.current_epoch > 0:
                self.steps_on += 1

        return call


def run(cfg, trace: bool, epochs: int, out: Path) -> tuple[EpochClock, EveryOtherEpoch]:
    L.seed_everything(cfg.get("seed") or 0, workers=True, verbose=False)
    clock = EpochClock()
    toggle = EveryOtherEpoch(ProfilingCallback(trace={"enabled": True} if trace else None))
    trainer = L.Trainer(
        accelerator=cfg.trainer.get("accelerator", "cpu"),
        devices=1,
        max_epochs=epochs,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[clock, toggle],
        default_root_dir=str(out),
        logger=L.pytorch.loggers.CSVLogger(str(out), name="csv"),
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(hydra.utils.instantiate(cfg.model), datamodule=hydra.utils.instantiate(cfg.data))
    return clock, toggle


def compare(per_step: list[float]) -> tuple[float, float, float, float, float]:
    """(off median, on median, ratio: median over blocks, its lower and upper quartile)."""
    blocks = [per_step[i : i + 4] for i in range(1, len(per_step) - 3, 4)]
    ratios = [(b[0] + b[3]) / (b[1] + b[2]) for b in blocks]
    on = [t for e, t in enumerate(per_step) if e > 0 and profiled(e)]
    off = [t for e, t in enumerate(per_step) if not profiled(e)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return statistics.median(off), statistics.median(on), statistics.median(ratios), q1, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=41, help="1 warm-up + blocks of 4")
    parser.add_argument("--trace", action="store_true", help="measure trace mode (torch.profiler on) instead")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py (data=..., model=...)")
    args = parser.parse_args()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        # no validation here, so no scheduler that watches a validation metric (unless asked for)
        defaults = [] if any(o.startswith("model.scheduler") for o in args.overrides) else ["model.scheduler=null"]
        cfg = compose(config_name="train", overrides=defaults + args.overrides)

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lit_template"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        clock, toggle = run(cfg, args.trace, max(args.epochs, 9), Path(tmp))
    mode = "trace" if args.trace else "light"
    blocks = (len(clock.wall_s) - 1) // 4
    print(
        f"profiling callback, {mode} mode, {cfg.data._target_.rsplit('.', 1)[-1]} + "
        f"{cfg.model.net._target_.rsplit('.', 1)[-1]}, {blocks} blocks of on/off/off/on epochs:"
    )
    for name, per_step in (("wall time", clock.wall_s), ("CPU time of the loop's thread", clock.cpu_s)):
        off, on, ratio, q1, q3 = compare(per_step)
        print(
            f"  {name}: off {off * 1e3:.3f} ms/step, on {on * 1e3:.3f} ms/step; on/off ratio {ratio:.4f} "
            f"(overhead {100 * (ratio - 1):+.2f}%; quartiles {q1:.4f}..{q3:.4f})"
        )
    off = compare(clock.wall_s)[0]
    inside = toggle.inside_s / max(toggle.steps_on, 1)
    print(
        f"  inside the callback's hooks: {inside * 1e6:.1f} us/step, on/off ratio {1 + inside / off:.4f} "
        f"(overhead {100 * inside / off:+.2f}% of the off step time)"
    )


if __name__ == "__main__":
    main()
