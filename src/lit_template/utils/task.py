"""The task wrapper: user errors as one short line, failed sweep jobs reported instead of ending the sweep, and a
failed rank named — whether it raised or was killed — so a multi-process job never dies anonymously."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig

from lit_template.diagnostics.report import say_error, write_json
from lit_template.distributed.launch import forget_job_rendezvous, in_multirun
from lit_template.distributed.preemption import Preempted
from lit_template.errors import ConfigError
from lit_template.lightning_compat import wrap_process_observer
from lit_template.utils.pylogger import RankedLogger

log = RankedLogger(__name__)


def _write_failure(cfg: DictConfig, error: BaseException) -> None:
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "failure.json").write_text(
        json.dumps(
            {
                "kind": "job_failed",
                "error_type": type(error).__name__,
                "message": str(error),
                "traceback": traceback.format_exception(error),
            },
            indent=2,
        )
    )


def _failure_origin(error: BaseException) -> tuple[int, int | None]:
    """(global rank, global step) of the process that raised ``error``: the step from the Trainer found in the
    traceback (Lightning's entry points keep it in their frames), None when it failed before fit started."""
    import lightning as L

    step = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        for name in ("trainer", "self"):
            obj = frame.f_locals.get(name)
            if isinstance(obj, L.Trainer):
                step = obj.global_step
                break
    rank = getattr(rank_zero_only, "rank", None)
    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
    return int(rank), step


def _say_rank_failed(error: BaseException) -> None:
    # In the launching process, a collective that broke is usually a child that died first: name it before this
    # rank's own (secondary) error. Its death can take a moment to be reaped.
    watch = _ACTIVE_WATCH[0]
    if watch is not None and not watch.reported:
        watch.check(wait_s=3.0)
    rank, step = _failure_origin(error)
    where = f" at step {step}" if step is not None else ""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    say_error(f"rank {rank} failed{where}: {type(error).__name__}: {first_line}")


class ChildRankWatch(threading.Thread):
    """In the process Lightning's launcher started its children from (rank 0): notice a child that exits non-zero
    and say which rank it was and how it ended, then call ``on_failure`` (Lightning's own observer, which kills
    every process within its 5 s poll and names only a PID). Started only after the report, that observer cannot
    kill this process before the rank is named."""

    def __init__(
        self, procs: list, run_dir: Path | None, on_failure: Callable[[], None] | None = None, poll_s: float = 0.1
    ) -> None:
        super().__init__(daemon=True, name="lit-template-child-rank-watch")
        self.procs, self.run_dir, self.on_failure, self.poll_s = procs, run_dir, on_failure, poll_s
        self._lock = threading.Lock()
        self.reported = False
        _ACTIVE_WATCH[0] = self

    def run(self) -> None:
        while (failed := self.check()) is None:
            threading.Event().wait(self.poll_s)
        if failed and self.on_failure is not None:
            self.on_failure()

    def check(self, wait_s: float = 0.0) -> bool | None:
        """Poll the children (for up to ``wait_s``): True if one failed (and is now reported), False if all exited
        cleanly, None while they still run."""
        deadline = time.monotonic() + wait_s
        node_rank = int(os.environ.get("NODE_RANK", 0))
        per_node = len(self.procs) + 1
        while True:
            codes = [proc.poll() for proc in self.procs]
            for i, (proc, code) in enumerate(zip(self.procs, codes, strict=True)):
                if code:
                    with self._lock:
                        if not self.reported:
                            self.reported = True
                            self.report(node_rank * per_node + i + 1, proc.pid, code)
                    return True
            if all(code == 0 for code in codes):
                return False
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.1)

    def wait(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the children to exit (after a coordinated stop)."""
        deadline = time.monotonic() + timeout_s
        while any(proc.poll() is None for proc in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)

    def report(self, rank: int, pid: int, code: int) -> None:
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        say_error(f"rank {rank} (pid {pid}) {how}; every other rank of the job is being stopped")
        if self.run_dir is not None:
            try:
                write_json(
                    self.run_dir / "reports" / "rank_failure.json",
                    {
                        "kind": "rank_failed",
                        "global_step": None,
                        "ranks": [rank],
                        "pid": pid,
                        "exit_code": code,
                        "signal": signal.Signals(-code).name if code < 0 else None,
                    },
                )
            except OSError:
                pass


_WATCH_RUN_DIR: list[Path | None] = [None]
_ACTIVE_WATCH: list[ChildRankWatch | None] = [None]


def _install_child_rank_watch(run_dir: Path | None) -> None:
    """Start a ChildRankWatch in place of Lightning's observer whenever its subprocess launcher starts children (the
    watch starts that observer when a child fails). Lightning has no hook there: wrap the one function its launcher
    calls with the children (module attribute, looked up at call time)."""
    _WATCH_RUN_DIR[0] = run_dir

    def launch_observers(child_processes: list, original: Callable[[list], None]) -> None:
        # Lightning's observer starts once a child has failed and been named (it has nothing to do before)
        ChildRankWatch(child_processes, _WATCH_RUN_DIR[0], on_failure=lambda: original(child_processes)).start()

    wrap_process_observer(launch_observers)


def _close_loggers(status: str) -> None:
    # every job ends its logger runs (MLflow, W&B): the next job of a multirun gets runs of its own
    from lit_template.loggers import close_loggers

    close_loggers(status)


def _teardown_distributed() -> None:
    # A multirun runs its jobs in one process: the next job must not find this job's process group or port.
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_job_rendezvous()


def _user_error(error: BaseException) -> ConfigError | None:
    """The ConfigError behind ``error``: itself, or the cause Hydra wrapped when a constructor it instantiated
    (a datamodule, a callback) raised one (``InstantiationException: Error in call to target ...``). Lightning's own
    configuration errors (``MisconfigurationException``: ``trainer.max_epochs=-5``, a monitor that is never logged)
    are user errors too; the Hydra config key that was being instantiated (``full_key: trainer``) names the group."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    outer, seen = error, 0
    while error is not None and seen < 8:
        if isinstance(error, ConfigError):
            return error
        if isinstance(error, MisconfigurationException):
            key = re.search(r"full_key: ([\w.]+)", str(outer))
            where = f"{key.group(1)} (conf/{key.group(1).split('.')[0]}/)" if key else "Lightning"
            return ConfigError(f"{where}: {error}")
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


class TrialFailed(RuntimeError):
    """A failed job of an Optuna sweep: raised so the sweeper records the trial as failed and goes on."""


def _optuna_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return "optuna" in str(HydraConfig.get().sweeper.get("_target_", "")).lower()


def _failed_job(message: str) -> float:
    """What a failed multirun job returns. The basic sweeper takes NaN (the summary shows the job as failed); the
    Optuna sweeper (hydra-optuna-sweeper 1.3 with optuna 2.x) crashes the whole study on a NaN (it tells the trial
    twice), but records a raised exception as a failed trial and goes on (with ``max_failure_rate: 1.0``)."""
    if _optuna_sweep():
        raise TrialFailed(message)
    return math.nan


def task_wrapper(task: Callable[[DictConfig], Any]) -> Callable[[DictConfig], Any]:
    """Wrap ``run(cfg)``.

    - ConfigError: a short message naming the option, exit code 2, no traceback.
    - In a multirun, any failure is written to ``<job dir>/failure.json``, logged, and the job returns NaN so the
      basic sweep goes on with the next job; under Optuna the job raises ``TrialFailed`` instead, which the sweeper
      records as a failed trial (a NaN metric, e.g. a diverged run, fails the trial the same way).
    - Any other failure: one line ``rank R failed at step S: ...`` on every rank that fails, then the traceback.
      A child rank that dies (SIGKILL, crash) is named by the parent (ChildRankWatch).
    """

    @functools.wraps(task)
    def wrapped(cfg: DictConfig) -> Any:
        try:
            run_dir = cfg.paths.output_dir
        except Exception:  # noqa: BLE001  (a config without paths, e.g. in a unit test)
            run_dir = None
        _install_child_rank_watch(Path(run_dir) if run_dir else None)
        status = "failed"  # how the job's logger runs end (close_loggers)
        try:
            value = task(cfg)
            status = "success"
        except Preempted:
            status = "killed"
            # every rank stopped at the same step with last.ckpt saved; the launching rank lets its children finish
            watch = _ACTIVE_WATCH[0]
            if watch is not None:
                watch.wait(timeout_s=60.0)
            raise
        except Exception as err:
            user_error = _user_error(err)
            if user_error is not None:
                if in_multirun():
                    log.error(f"job failed: {user_error}")
                    _write_failure(cfg, user_error)
                    return _failed_job(f"job failed: {user_error}")
                say_error(str(user_error))
                raise SystemExit(2) from None
            if not in_multirun():
                _say_rank_failed(err)
                raise
            log.exception(f"job failed with {type(err).__name__}: {err} (the sweep goes on)")
            _write_failure(cfg, err)
            return _failed_job(f"job failed with {type(err).__name__}: {err}")
        finally:
            _close_loggers(status)
            _teardown_distributed()
        if isinstance(value, float) and math.isnan(value) and in_multirun():
            return _failed_job(
                f"the optimized metric is NaN (diverged, or never logged): {cfg.get('optimized_metric')}"
            )
        return value

    return wrapped
