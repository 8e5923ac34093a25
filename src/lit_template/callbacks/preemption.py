"""Preemption-safe stop: a signal is only recorded; the ranks agree at the next step, save, requeue and exit."""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import lightning as L

from lit_template.callbacks.last_checkpoint import LastCheckpoint
from lit_template.diagnostics.report import reports_dir, say, write_json
from lit_template.distributed.preemption import (
    Preempted,
    SignalRecorder,
    SlurmJob,
    StepVote,
    signal_name,
    signal_number,
)
from lit_template.errors import ConfigError
from lit_template.lightning_compat import disable_lightning_signal_handling, is_last_batch_of_epoch

OPTION = "callbacks.preemption"


@dataclass
class PreemptionRecord:
    """What ``reports/preemption.json`` holds (the report frame: kind, global_step, ranks)."""

    kind: str
    global_step: int
    ranks: list[int]  # the global ranks that received a signal
    signals: dict[str, str]  # global rank -> signal name
    checkpoint: str
    checkpoint_step: int | None
    slurm_job: str | None = None
    requeued: bool = False
    requeue_message: str | None = None
    exit_code: int = 0
    time_unix: float = field(default_factory=lambda: round(time.time(), 3))

    def sentence(self) -> str:
        who = ", ".join(f"global rank {r} got {self.signals[str(r)]}" for r in self.ranks)
        head = (
            f"preemption: {who}; every rank stopped at global step {self.global_step} with "
            f"{self.checkpoint} holding step {self.checkpoint_step}"
        )
        if self.requeued:
            tail = f"requeued SLURM job {self.slurm_job}: it resumes from there (ckpt_path=auto)"
        elif self.slurm_job and self.requeue_message:
            tail = f"scontrol requeue {self.slurm_job} failed: {self.requeue_message}"
        elif self.slurm_job:
            tail = "not requeued (SLURM requeues a preempted job itself; scancel ends it)"
        else:
            tail = "resume with ckpt_path=auto (same LT_RUN_ID) or ckpt_path=last"
        return f"{head}; {tail}; exiting with code {self.exit_code}."


class Preemption(L.Callback):
    """Stops every rank cleanly, at the same step, when the job is told to stop, with ``last.ckpt`` saved.

    A signal (``signals``) is only recorded by the handler. At every optimizer step the ranks share what they
    received in one small vote (an asynchronous all-reduce on a CPU process group, read one step later); when any
    rank got a signal, every rank saves ``last.ckpt`` together (the ``last_checkpoint`` callback), rank zero requeues
    the SLURM job if the signal is in ``requeue_on`` (``scontrol requeue $SLURM_JOB_ID``: the requeued job has the
    same id, so the same run dir, and resumes with ``ckpt_path=auto``), writes ``reports/preemption.json`` and says
    so in one sentence, and every rank exits with ``exit_code``. At an epoch's last batch the stop waits for the
    epoch's own save after validation and happens before the next batch, so the resumed run repeats nothing.

    Lightning's own signal handling is switched off for the fit (it runs collectives inside the handler and can
    deadlock a DDP job; see ``lightning_compat``): with this callback off, Lightning's comes back. Outside ``fit``
    (test, predict) signals act as usual.

    Args:
        signals: what means "stop soon": SIGUSR1 (``#SBATCH --signal=SIGUSR1@90``: before the time limit) and
            SIGTERM (SLURM preemption, ``scontrol requeue``, ``scancel``, torchrun's agent, ``docker stop``).
        requeue_on: the signals after which rank zero requeues the SLURM job. SIGTERM is left out by default: SLURM
            requeues a preempted or ``scontrol requeue``-d job itself, and the SIGTERM of ``scancel`` means stop.
        exit_code: what every rank exits with. 0, as Lightning does: launchers that kill every rank when one exits
            non-zero (Lightning's, ``srun --kill-on-bad-exit``) then leave the others to finish. Use 75 (EX_TEMPFAIL)
            for a scheduler that re-runs only failed jobs.

    Example::

        sbatch scripts/slurm.sbatch          # SIGUSR1 90 s before the time limit: save, requeue, resume
        kill -TERM <pid of rank 0>           # any launcher: save at the next step and exit
    """

    def __init__(
        self, signals: list[str] = ("SIGUSR1", "SIGTERM"), requeue_on: list[str] = ("SIGUSR1",), exit_code: int = 0
    ) -> None:
        self.signals = [signal_number(s, f"{OPTION}.signals") for s in signals]
        self.requeue_on = {signal_number(s, f"{OPTION}.requeue_on") for s in requeue_on}
        if not self.signals:
            raise ConfigError(f"{OPTION}.signals is empty: list signals (SIGUSR1, SIGTERM) or use {OPTION}=null")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) or not 0 <= exit_code <= 255:
            raise ConfigError(f"{OPTION}.exit_code={exit_code!r}: use a whole number 0-255")
        self.exit_code = exit_code
        self._recorder = SignalRecorder(self.signals)
        self._vote: StepVote | None = None
        self._last: LastCheckpoint | None = None
        self._step_seen = -1
        self._agreed: dict[int, int] = {}  # global rank -> signal, once the ranks agreed to stop
        self._exit_before_next_batch = False

    # -- set-up ------------------------------------------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        found = [cb for cb in trainer.callbacks if isinstance(cb, LastCheckpoint)]
        if not found:
            raise ConfigError(
                f"{OPTION} saves through callbacks.last_checkpoint, which is off: turn it on, or set "
                f"{OPTION}=null (then Lightning's own signal handling applies)"
            )
        self._last = found[0]
        disable_lightning_signal_handling(trainer)
        # before Lightning would have registered its handlers, so a signal during set-up or the sanity check counts
        self._recorder.install()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._vote = StepVote(trainer.world_size, trainer.global_rank)
        self._step_seen = trainer.global_step
        self._agreed, self._exit_before_next_batch = {}, False

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._recorder.uninstall()

    # -- the step boundary -------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._exit_before_next_batch:
            return
        # a stop agreed at the previous epoch's last batch: the epoch's save (after validation) is what resumes
        self._exit_before_next_batch = False
        if self._last.saved_at_step == trainer.global_step:
            self._exit(trainer)
        else:  # no epoch save happened (validation every n epochs): save here, before the batch runs
            self._save_and_exit(trainer)

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._step_seen or self._agreed:
            return
        self._step_seen = step
        if not self._agree(self._vote.vote([self._recorder.received])):
            return
        if is_last_batch_of_epoch(trainer):
            self._exit_before_next_batch = True
            return
        self._save_and_exit(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the last step's vote, and one more for a signal during it: every rank gets here after the same steps
        if self._vote is None:
            return
        if not self._agree(self._vote.finish()):
            self._agree(self._vote.vote_now([self._recorder.received]))
        self._vote = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # training ended with a stop agreed (at its last batch or just after): last_checkpoint saved the final
        # state at train end; skip what would follow (the test) and exit
        if self._agreed:
            self._exit(trainer)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # after an agreed stop the handlers stay until the process exits: the SIGTERM that `scontrol requeue` (or
        # the launcher) sends next would otherwise kill a rank while it shuts down
        if not isinstance(exception, Preempted):
            self._recorder.uninstall()

    # -- acting --------------------------------------------------------------------------------------------------
    def _agree(self, result: list[list[int]] | None) -> bool:
        if result and not self._agreed:
            self._agreed = {rank: numbers[0] for rank, numbers in enumerate(result) if numbers[0]}
        return bool(self._agreed)

    def _save_and_exit(self, trainer: L.Trainer) -> None:
        self._last.save_now(trainer)
        self._exit(trainer)

    def _exit(self, trainer: L.Trainer) -> None:
        if self._vote is not None:
            self._vote.finish()  # the vote in flight, made by every rank: nothing is left pending
            self._vote = None
        ranks = sorted(self._agreed)
        record = PreemptionRecord(
            kind="preemption",
            global_step=trainer.global_step,
            ranks=ranks,
            signals={str(r): signal_name(self._agreed[r]) for r in ranks},
            checkpoint=str(self._last.path),
            checkpoint_step=self._last.saved_at_step,
            exit_code=self.exit_code,
        )
        if trainer.is_global_zero:
            job = SlurmJob.from_env()
            if job is not None:
                record.slurm_job = job.job_id
                if any(self._agreed[r] in self.requeue_on for r in ranks):
                    record.requeued, message = job.requeue()
                    record.requeue_message = None if record.requeued else message
            write_json(reports_dir(trainer) / "preemption.json", asdict(record))
            say(record.sentence(), logging.WARNING)
        raise Preempted(self.exit_code, record.sentence())
