"""The hang doctor's watchdog: one thread per rank that notices when the training loop stops making progress.

Side channel: every rank's watchdog writes ``<run dir>/hang/heartbeat/rank<R>.json`` (atomically, every
``heartbeat_interval_s`` and at once when it stalls; see ``heartbeat.py``). It needs no collectives, so it works while
the process group is stuck, on one node or many (with a shared run dir), and a test can read it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lit_template.diagnostics.hang.heartbeat import Heartbeat, Verdict, diagnose, format_table
from lit_template.diagnostics.hang.stacks import collective_of, thread_stack
from lit_template.diagnostics.report import say, write_json

# Lightning's subprocess launcher kills the others when a child exits non-zero; a scheduler sees this code.
ABORT_EXIT_CODE = 3

# -- the watchdog -------------------------------------------------------------------------------------------------


@dataclass
class WatchdogConfig:
    global_rank: int
    world_size: int
    hang_dir: Path
    stall_timeout_s: float
    on_stall: str  # "report" | "abort"
    heartbeat_interval_s: float
    grace_s: float
    exit_code: int = ABORT_EXIT_CODE
    # called on stall, before this rank's heartbeat is written: e.g. dump PyTorch's flight recorder; a returned
    # string becomes the heartbeat's `collectives`
    extra_dumps: list[Callable[[], str | None]] = field(default_factory=list)


class Watchdog(threading.Thread):
    """One per rank. The training loop calls ``mark``; the thread notices when marks stop for ``stall_timeout_s``.

    ``mark`` is one tuple assignment (atomic under the GIL): no lock, no I/O, no collective in the hot path.
    """

    def __init__(self, config: WatchdogConfig, target_ident: int, step_fn: Callable[[], int]) -> None:
        super().__init__(daemon=True, name=f"hang-doctor-rank{config.global_rank}")
        self.cfg = config
        self.target_ident = target_ident  # the training thread
        self.step_fn = step_fn  # read by this thread when it writes a beat, so marking need not
        self.host = socket.gethostname()
        self.last: tuple[float, str] = (time.monotonic(), "train_start")
        self.longest_idle_s = 0.0
        self._stop_event = threading.Event()
        self._reported_at: float | None = None  # the mark time of the stall that was reported
        self._start_unix_offset = time.time() - time.monotonic()
        self.heartbeat_dir = config.hang_dir / "heartbeat"
        self.poll_s = max(0.05, min(1.0, config.stall_timeout_s / 8))

    # hot path
    def mark(self, phase: str) -> None:
        self.last = (time.monotonic(), phase)

    def stop(self, phase: str = "stopped") -> None:
        """Stop watching; the last heartbeat says this rank left training (``alive: false``, phase ``stopped`` or
        ``exception``)."""
        if self._stop_event.is_set():
            return
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self.poll_s + 1.0)  # its last write must not land after ours
        self._recovered(self.last)  # training may have gone on and ended between two polls
        self.longest_idle_s = max(self.longest_idle_s, time.monotonic() - self.last[0])
        self._write_beat(self._beat(stalled=False, alive=False, phase=phase))

    # thread
    def run(self) -> None:
        try:
            self._loop()
        except Exception:  # noqa: BLE001  (a bug here must not take training down; say it once)
            say(f"hang doctor: watchdog of rank {self.cfg.global_rank} failed and stopped:\n{traceback.format_exc()}")

    def _recovered(self, last: tuple[float, str]) -> None:
        """After a reported stall (on_stall=report): say so once the rank makes progress again."""
        t, phase = last
        if self._reported_at is not None and t != self._reported_at:
            say(
                f"hang doctor: rank {self.cfg.global_rank} made progress again after {t - self._reported_at:.1f} s "
                f"(step {self._step()}, {phase})"
            )
            self.longest_idle_s = max(self.longest_idle_s, t - self._reported_at)
            self._reported_at = None

    def _loop(self) -> None:
        last_beat = 0.0
        while not self._stop_event.wait(self.poll_s):
            last = self.last
            self._recovered(last)
            now = time.monotonic()
            idle = now - last[0]
            if self._reported_at is None:
                self.longest_idle_s = max(self.longest_idle_s, idle)
            if self._reported_at is None and idle >= self.cfg.stall_timeout_s:
                self._reported_at = last[0]
                self._on_stall(idle)
                last_beat = time.monotonic()
            elif now - last_beat >= self.cfg.heartbeat_interval_s:
                self._write_beat(self._beat(stalled=self._reported_at is not None))
                last_beat = now

    # heartbeats
    def _step(self) -> int:
        try:
            return int(self.step_fn())
        except Exception:  # noqa: BLE001  (read from another thread: the trainer may be mid-teardown)
            return -1

    def beat(self) -> None:
        """Write a heartbeat now (the first one, before the thread starts, so every rank has one at once)."""
        self._write_beat(self._beat(stalled=False))

    def _beat(self, stalled: bool, alive: bool = True, phase: str | None = None) -> Heartbeat:
        t, last_phase = self.last
        # called from the training thread itself (at start and stop), its stack would only show this function
        stack = [] if threading.get_ident() == self.target_ident else thread_stack(self.target_ident)
        return Heartbeat(
            global_rank=self.cfg.global_rank,
            host=self.host,
            pid=os.getpid(),
            step=self._step(),
            phase=phase or last_phase,
            where=stack[0].where if stack else None,
            waiting_in=collective_of(stack, self.cfg.world_size > 1),
            stalled=stalled,
            alive=alive,
            no_progress_s=round(time.monotonic() - t, 3),
            last_progress_unix=round(t + self._start_unix_offset, 3),
            time_unix=round(time.time(), 3),
            stack=[f.where for f in stack[:12]],
            longest_idle_s=round(self.longest_idle_s, 3),
        )

    def _write_beat(self, beat: Heartbeat) -> None:
        try:
            write_json(self.heartbeat_dir / f"rank{self.cfg.global_rank}.json", dataclasses.asdict(beat))
        except OSError as err:  # a full or flaky filesystem must not kill training
            say(f"hang doctor: rank {self.cfg.global_rank} could not write its heartbeat: {err}")

    def read_beats(self) -> dict[int, Heartbeat | None]:
        return {r: Heartbeat.read(self.heartbeat_dir / f"rank{r}.json") for r in range(self.cfg.world_size)}

    # the stall
    def _on_stall(self, idle: float) -> None:
        cfg = self.cfg
        beat = self._beat(stalled=True)
        stalled_unix = time.time()
        dump = cfg.hang_dir / f"rank{cfg.global_rank}.txt"
        write_stack_dump(dump, beat, self.target_ident, cfg)
        for extra in cfg.extra_dumps:
            try:
                beat.collectives = extra() or beat.collectives
            except Exception as err:  # noqa: BLE001  (best effort: the stacks are what matters)
                say(f"hang doctor: rank {cfg.global_rank}: {err}")
        self._write_beat(beat)
        say(
            f"hang doctor: rank {cfg.global_rank} made no progress for {idle:.1f} s (step {beat.step}, {beat.phase}, "
            f"at {beat.where}); its stacks are in {dump}"
        )

        beats = self._gather(time.monotonic() + cfg.grace_s)
        stale_after_s = 3 * cfg.heartbeat_interval_s + cfg.grace_s + 5
        verdict = diagnose(beats, cfg.world_size, time.time(), stale_after_s)
        summary = cfg.hang_dir / "summary.json"
        if verdict.reporter == cfg.global_rank or not self._wait_for_summary(summary, stalled_unix - cfg.grace_s):
            self._report(beats, verdict, summary)
        if cfg.on_stall == "abort":
            say(
                f"hang doctor: aborting rank {cfg.global_rank} (exit code {cfg.exit_code}): {verdict.sentence}",
                logging.ERROR,
            )
            _flush_all()
            os._exit(cfg.exit_code)

    def _gather(self, deadline: float) -> dict[int, Heartbeat | None]:
        """Everyone's heartbeat, once every rank has stalled or left (they all stall within a poll of each other
        in synchronous training), or at the deadline."""
        while True:
            beats = self.read_beats()
            settled = all(b is not None and (b.stalled or not b.alive) for b in beats.values())
            if settled or time.monotonic() >= deadline:
                return beats
            time.sleep(0.2)

    def _wait_for_summary(self, path: Path, newer_than_unix: float) -> bool:
        deadline = time.monotonic() + self.cfg.grace_s
        while time.monotonic() < deadline:
            try:
                if json.loads(path.read_text()).get("time_unix", 0) >= newer_than_unix:
                    return True
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        return False

    def _report(self, beats: dict[int, Heartbeat | None], verdict: Verdict, path: Path) -> None:
        cfg = self.cfg
        table = format_table(beats, verdict, cfg.world_size)
        steps = [b.step for b in beats.values() if b is not None]
        say(
            f"hang doctor: training stalled (no progress for stall_timeout_s={cfg.stall_timeout_s:g}); "
            f"on_stall={cfg.on_stall}; stack dumps in {cfg.hang_dir}\n{table}\n{verdict.sentence}",
            logging.ERROR,
        )
        write_json(
            path,
            {
                "kind": "hang",
                "global_step": min(steps) if steps else None,
                "ranks": list(range(cfg.world_size)),
                "stuck_ranks": verdict.stuck_ranks,
                "waiting_ranks": verdict.waiting_ranks,
                "silent_ranks": verdict.silent_ranks,
                "reason": verdict.reason,
                "sentence": verdict.sentence,
                "on_stall": cfg.on_stall,
                "stall_timeout_s": cfg.stall_timeout_s,
                "reported_by": cfg.global_rank,
                "time_unix": round(time.time(), 3),
                "table": [
                    dataclasses.asdict(b) if b else {"global_rank": r, "phase": "no heartbeat"}
                    for r, b in beats.items()
                ],
            },
        )


def write_stack_dump(path: Path, beat: Heartbeat, target_ident: int, cfg: WatchdogConfig) -> None:
    """Every thread's Python stack, the training thread first, as ``traceback`` prints them (innermost last)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    lines = [
        f"hang doctor: rank {cfg.global_rank} of {cfg.world_size} on {beat.host} (pid {beat.pid}) made no progress for "
        f"{beat.no_progress_s:.1f} s (stall_timeout_s={cfg.stall_timeout_s:g})",
        f"last progress: step {beat.step}, phase {beat.phase}, at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(beat.last_progress_unix))}",
        f"where: {beat.where}",
        f"waiting in: {beat.waiting_in or '-'}",
        "",
    ]
    order = sorted(frames, key=lambda ident: ident != target_ident)
    for ident in order:
        label = " (training thread)" if ident == target_ident else ""
        lines.append(f"Thread {names.get(ident, '?')} (ident {ident}){label}, most recent call last:")
        lines.extend(line.rstrip("\n") for line in traceback.format_stack(frames[ident]))
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _flush_all() -> None:
    for handler in logging.getLogger().handlers + logging.getLogger("lit_template").handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001  (about to exit: a handler that cannot flush is no reason to stop)
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
