"""The parts of preemption handling that do not need Lightning: recording signals, one vote per step, requeueing.

A signal handler here only notes which signal came; it never runs a collective (a rank in a handler and a rank in
the loop's next collective would wait for each other). What the ranks do about it is decided by
:class:`StepVote`: at every optimizer step each rank adds what it saw to one small all-reduce, and every rank reads
the same result, so they all act at the same step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lit_template.errors import ConfigError


def signal_number(name: str | int, option: str) -> int:
    """``"SIGUSR1"`` / ``"USR1"`` / ``10`` -> 10, or a ConfigError naming ``option``."""
    if isinstance(name, int) and not isinstance(name, bool):
        return int(signal.Signals(name))
    text = str(name).upper()
    text = text if text.startswith("SIG") else f"SIG{text}"
    try:
        return int(signal.Signals[text])
    except KeyError:
        raise ConfigError(f"{option}: {name!r} is not a signal name (e.g. SIGUSR1, SIGTERM)") from None


def signal_name(number: int) -> str:
    return signal.Signals(number).name


class SignalRecorder:
    """Installs handlers that only record the first of ``signals`` this process receives (and when).

    ``uninstall`` puts the previous handlers back. Handlers can only be set from the main thread; elsewhere (a
    notebook's worker thread) nothing is installed and ``installed`` is False.
    """

    def __init__(self, signals: list[int]) -> None:
        self.signals = signals
        self.received: int = 0  # the first signal number received, 0 for none
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            previous = signal.signal(signum, self._record)
            self._previous.setdefault(signum, previous)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.received = signum

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}


class StepVote:
    """One small all-reduce per optimizer step that every rank makes, read one step later.

    Each rank puts its own numbers in its own slots (``slots_per_rank`` ints) and the reduction is a sum, so every
    rank gets every rank's numbers. The collective runs asynchronously on a CPU process group (gloo; a group of its
    own): no host-device sync, and its latency hides behind the next step. ``vote``
    returns the previous step's result, so a decision lands on the same step on every rank, one step after the
    ranks voted. On one process it returns the numbers at once.
    """

    _live: ClassVar[weakref.WeakSet[StepVote]] = weakref.WeakSet()

    def __init__(self, world_size: int, global_rank: int, slots_per_rank: int = 1) -> None:
        self.world_size, self.global_rank, self.slots = world_size, global_rank, slots_per_rank
        StepVote._live.add(self)
        self._group: Any = None
        self._work: Any = None
        # one CPU buffer, reused: a vote is read before the next one is sent. Filled and read through a NumPy view
        # made once, so a step calls no tensor method on it
        self._buffer = torch.zeros(world_size * slots_per_rank, dtype=torch.int64)
        self._view = self._buffer.numpy()
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError("StepVote with world_size > 1 needs an initialised process group")
            # a group of its own (every rank creates it, in the same order): its ops never interleave with DDP's,
            # and the hang doctor's flight recorder of the default group shows only the training's collectives
            self._group = dist.new_group(backend="gloo")

    def vote(self, numbers: list[int]) -> list[list[int]] | None:
        """Send this step's ``numbers``; return the last vote's result per rank (None at the first vote)."""
        if self.world_size == 1:
            return [list(numbers)]
        result = self._collect()  # the buffer is free again once the last vote is read
        self._view[:] = 0
        self._view[self.global_rank * self.slots : (self.global_rank + 1) * self.slots] = numbers
        self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.SUM, group=self._group, async_op=True)
        return result

    def vote_now(self, numbers: list[int]) -> list[list[int]]:
        """Vote and wait for this vote's result (after ``finish``: no vote may be in flight)."""
        self._collect()
        result = self.vote(numbers)
        return result if self.world_size == 1 else self._collect()

    def finish(self) -> list[list[int]] | None:
        """Wait for the vote in flight and return it (at the end of training: nothing may be left pending)."""
        return self._collect()

    @classmethod
    def settle_all(cls) -> None:
        """Wait for every vote in flight, leaving its result to be read as usual.

        torch.profiler must not start or stop while gloo's worker thread runs a collective: kineto then frees the
        thread's event buffers under it, and the process aborts with ``malloc(): unaligned fastbin chunk`` (seen on
        the trace tests). The trace recorder calls this before each profiler step.
        """
        for vote in list(cls._live):
            if vote._work is not None:
                vote._work.wait()

    def _collect(self) -> list[list[int]] | None:
        if self._work is None:
            return None
        self._work.wait()
        values = [int(v) for v in self._view]
        self._work = None
        return [values[r * self.slots : (r + 1) * self.slots] for r in range(self.world_size)]


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job this process belongs to, read from the environment srun/sbatch set."""

    job_id: str  # ``<array job>_<task>`` for an array task: what scontrol requeue takes
    restart_count: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SlurmJob | None:
        if "SLURM_JOB_ID" not in env:
            return None
        array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        job_id = f"{array_job}_{array_task}" if array_job and array_task else env["SLURM_JOB_ID"]
        return cls(job_id, int(env.get("SLURM_RESTART_COUNT", "0") or 0))

    def requeue(self, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> tuple[bool, str]:
        """``scontrol requeue <job id>``: (whether it worked, scontrol's message or the error)."""
        try:
            proc = run(["scontrol", "requeue", self.job_id], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError) as err:
            return False, f"{type(err).__name__}: {err}"
        message = (proc.stdout + proc.stderr).strip()
        return proc.returncode == 0, message or f"exit code {proc.returncode}"


class Preempted(SystemExit):
    """Raised on every rank after the checkpoint of an agreed stop is written: the process exits with ``code``.

    A ``SystemExit``: the task wrapper lets it through (it is not a failure to report), Lightning's hooks still see it
    in ``on_exception``, and a multirun in this process ends with it, as the machine is going away.
    """

    def __init__(self, code: int, sentence: str) -> None:
        super().__init__(code)
        self.sentence = sentence
