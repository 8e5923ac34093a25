"""Hang doctor: when a rank gets stuck, every rank says where it is, the odd rank is named, and the job ends.

Every rank runs a watchdog thread (diagnostics/hang/watchdog.py). The training loop marks progress at each loop event;
when a rank has made none for ``stall_timeout_s`` its watchdog writes

- ``<run dir>/hang/rank<R>.txt``: the Python stacks of all its threads,
- ``<run dir>/hang/heartbeat/rank<R>.json``: its step, phase and top frame (the side channel: files, no collectives),
- ``<run dir>/hang/flight_recorder/rank_<R>``: PyTorch's flight recorder (the last collectives of the process group),

then one rank (rank zero, or the lowest rank that is not stuck) prints the table of all ranks, names the odd one and
writes ``<run dir>/hang/summary.json``. With ``on_stall=abort`` every rank then exits with code 3, so a scheduler can
restart the job from its last checkpoint; with ``report`` training keeps waiting. See docs/hang_doctor.md.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from lit_template.diagnostics.hang.heartbeat import lost_peer, lost_peer_sentence, silent_ranks
from lit_template.diagnostics.hang.watchdog import ABORT_EXIT_CODE, Watchdog, WatchdogConfig
from lit_template.diagnostics.report import run_dir, say, write_json
from lit_template.distributed.env import set_default_env
from lit_template.distributed.preemption import SignalRecorder
from lit_template.errors import ConfigError
from lit_template.lightning_compat import flight_recorder_dump, strategy_timeout_s

ON_STALL = ("abort", "report")


class HangDoctor(L.Callback):
    """When a rank makes no progress for ``stall_timeout_s``, every rank dumps its stacks, one rank names the stuck
    rank and where it is, and (``on_stall=abort``) the job ends; a rank whose collective loses its peer names it.

    Args:
        stall_timeout_s: seconds without a progress mark before a rank counts as stalled; kept below the process
            group's timeout (``trainer.strategy.timeout``), else that would end the hang first without a name.
        on_stall: ``abort`` (report, then every rank exits with ``exit_code``) or ``report`` (report and wait).
        heartbeat_interval_s: how often each rank rewrites its heartbeat file while healthy.
        grace_s: how long a stalled rank waits for the others' heartbeats and for the summary.
        exit_code: what every rank exits with on abort.
        flight_recorder: record the last collectives of every process group (PyTorch's flight recorder).
        flight_recorder_entries: how many.
        process_group_backend: the trainer's backend (for the NCCL dump variables).
        output_dir: the run dir (where the NCCL flight recorder dumps on its own timeout).
    """

    def __init__(
        self,
        stall_timeout_s: float = 300.0,
        on_stall: str = "abort",
        heartbeat_interval_s: float = 5.0,
        grace_s: float = 5.0,
        exit_code: int = ABORT_EXIT_CODE,
        flight_recorder: bool = True,
        flight_recorder_entries: int = 2000,
        process_group_backend: str | None = None,
        output_dir: str | None = None,
    ) -> None:
        if on_stall not in ON_STALL:
            raise ConfigError(f"callbacks.hang_doctor.on_stall={on_stall!r}: choose one of {', '.join(ON_STALL)}")
        for name, value in (("stall_timeout_s", stall_timeout_s), ("heartbeat_interval_s", heartbeat_interval_s)):
            if not value or value <= 0:
                raise ConfigError(f"callbacks.hang_doctor.{name}={value!r}: must be a number of seconds > 0")
        if grace_s is None or grace_s < 0:
            raise ConfigError(f"callbacks.hang_doctor.grace_s={grace_s!r}: must be a number of seconds >= 0")
        self.stall_timeout_s, self.on_stall = float(stall_timeout_s), on_stall
        self.heartbeat_interval_s, self.grace_s, self.exit_code = float(heartbeat_interval_s), float(grace_s), exit_code
        self.flight_recorder = flight_recorder and flight_recorder_entries > 0
        self.backend = process_group_backend
        self._watchdog: Watchdog | None = None
        if self.flight_recorder:
            # Read when the process group is created, which is after this (callbacks are built before the Trainer,
            # whose launcher passes the environment on to the processes it starts).
            set_default_env("TORCH_FR_BUFFER_SIZE", str(flight_recorder_entries))
            if process_group_backend == "nccl":
                set_default_env("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
                if output_dir:
                    fr_dir = Path(output_dir) / "hang" / "flight_recorder"
                    fr_dir.mkdir(parents=True, exist_ok=True)
                    set_default_env("TORCH_FR_DUMP_TEMP_FILE", f"{fr_dir}/rank_")
                    set_default_env("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{fr_dir}/rank_")

    # -- start / stop -------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The clock starts here, not at launch: starting processes and building the process group is not a stall.
        hang_dir = run_dir(trainer) / "hang"
        rank = trainer.global_rank
        stall_timeout_s = self._effective_stall_timeout(trainer)
        config = WatchdogConfig(
            global_rank=rank,
            world_size=trainer.world_size,
            hang_dir=hang_dir,
            stall_timeout_s=stall_timeout_s,
            on_stall=self.on_stall,
            heartbeat_interval_s=self.heartbeat_interval_s,
            grace_s=self.grace_s,
            exit_code=self.exit_code,
        )
        if self.flight_recorder:
            config.extra_dumps.append(lambda: _dump_flight_recorder(hang_dir / "flight_recorder" / f"rank_{rank}"))
        self._stop("stopped")
        self._watchdog = Watchdog(config, threading.get_ident(), step_fn=lambda: trainer.global_step)
        self._watchdog.mark("train_start")
        self._watchdog.beat()
        self._watchdog.start()

    def _effective_stall_timeout(self, trainer: L.Trainer) -> float:
        """The stall timeout, below the process group's own timeout: a waiting rank's collective that times out
        first ends the job with gloo's or NCCL's message, which names no rank and no line."""
        pg_timeout_s = strategy_timeout_s(trainer)
        if trainer.world_size < 2 or pg_timeout_s is None or self.stall_timeout_s < pg_timeout_s:
            return self.stall_timeout_s
        used = pg_timeout_s / 2
        if trainer.is_global_zero:
            say(
                f"hang doctor: callbacks.hang_doctor.stall_timeout_s={self.stall_timeout_s:g} is not below "
                f"trainer.strategy.timeout ({pg_timeout_s:g} s), which would end a hang first without naming the rank: "
                f"using {used:g} s",
                logging.INFO,
            )
        return used

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop("stopped")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        watchdog = self._watchdog
        self._stop("exception")
        if watchdog is not None and trainer.world_size > 1 and lost_peer(exception):
            self._name_lost_peers(trainer, watchdog, exception)

    def _name_lost_peers(self, trainer: L.Trainer, watchdog: Watchdog, exception: BaseException) -> None:
        """A collective failed because the rank at its other end went away (SIGKILL, OOM killer, a crash that
        skipped Python, a lost node): name it from the heartbeats, which takes up to one heartbeat interval."""
        # a launcher that saw the rank die (srun --kill-on-bad-exit, torchrun) sends SIGTERM now: finish first
        deferred = SignalRecorder([signal.SIGTERM])
        deferred.install()
        try:
            silent = silent_ranks(
                watchdog.heartbeat_dir, trainer.world_size, trainer.global_rank, self.heartbeat_interval_s
            )
        finally:
            deferred.uninstall()
        now = time.time()
        sentence = lost_peer_sentence(trainer.global_rank, trainer.global_step, exception, silent, now)
        say(sentence, logging.ERROR)
        write_json(
            watchdog.cfg.hang_dir / f"lost_peer.rank{trainer.global_rank}.json",
            {
                "kind": "lost_peer",
                "global_step": trainer.global_step,
                "global_rank": trainer.global_rank,
                "ranks": sorted(silent),
                "error": f"{type(exception).__name__}: {exception}"[:2000],
                "heartbeats": {str(r): dataclasses.asdict(b) if b else None for r, b in silent.items()},
                "sentence": sentence,
                "time_unix": round(now, 3),
            },
        )

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop("stopped")

    def _stop(self, phase: str) -> None:
        if self._watchdog is not None:
            self._watchdog.stop(phase)
            self._watchdog = None

    @property
    def longest_idle_s(self) -> float | None:
        return self._watchdog.longest_idle_s if self._watchdog else None

    # -- progress marks: one tuple assignment each ----------------------------------------------------------------
    def _mark(self, phase: str) -> None:
        if self._watchdog is not None:
            self._watchdog.mark(phase)

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark("train_epoch_start")

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._mark("train_batch_start")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._mark("before_backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark("after_backward")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._mark("before_optimizer_step")

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._mark("train_batch_end")

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark("train_epoch_end")

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark("validation_start")

    def on_validation_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._mark("validation_batch_start")

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._mark("validation_batch_end")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._mark("validation_end")

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._mark("save_checkpoint")


def _dump_flight_recorder(path: Path) -> str | None:
    """Write PyTorch's flight recorder of this rank's process groups (the pickle ``torchfrtrace`` reads); return one
    line on its last collective, e.g. ``#62 gloo:broadcast, 2 not completed``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    dump = flight_recorder_dump(dist.get_backend())
    if dump is None:
        say("hang doctor: this PyTorch has no flight recorder dump; only the stacks are written")
        return None
    data = dump()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return _last_collective(data)


def _last_collective(data: bytes) -> str | None:
    try:
        record = pickle.loads(data)
        entries = [e for e in record.get("entries", []) if not e.get("is_p2p")]
        if not entries:
            return None
        last = max(entries, key=lambda e: e.get("collective_seq_id", 0))
        status = record.get("pg_status", {}).get(str(last.get("pg_id", 0)), {})
        done = status.get("last_completed_collective")
        return f"#{last.get('collective_seq_id')} {last.get('profiling_name')} enqueued, #{done} completed"
    except Exception:  # noqa: BLE001  (a format change must not cost us the rest of the report)
        return None
