"""The parts of the hang doctor that do not need Lightning: the watchdog thread, the heartbeat files, the diagnosis.

Side channel: every rank's watchdog writes ``<run dir>/hang/heartbeat/rank<R>.json`` (atomically, every
``heartbeat_interval_s`` and at once when it stalls). It needs no collectives, so it works while the process group is
stuck, on one node or many (with a shared run dir), and a test can read it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from lit_template.callbacks.report import say, write_json

# Lightning's subprocess launcher kills the others when a child exits non-zero; a scheduler sees this code.
ABORT_EXIT_CODE = 3
_STACK_LIMIT = 64

# -- where is a thread? -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str

    @property
    def where(self) -> str:
        return f"{short_path(self.filename)}:{self.lineno} {self.function}"


def short_path(filename: str) -> str:
    """A path a reader recognises: relative to the repo (cwd) or to site-packages / the standard library."""
    path = filename.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    cwd = os.getcwd().replace("\\", "/").rstrip("/") + "/"
    if path.startswith(cwd):
        return path[len(cwd):]
    lib = f"/lib/python{sys.version_info.major}.{sys.version_info.minor}/"
    if lib in path:
        return path.split(lib, 1)[1]
    return path


def thread_stack(ident: int | None) -> list[Frame]:
    """The Python stack of one thread, innermost frame first (empty if the thread is gone)."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    stack = []
    while frame is not None and len(stack) < _STACK_LIMIT:
        stack.append(Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return stack


def _in_torch(frame: Frame) -> bool:
    return "/torch/" in frame.filename.replace("\\", "/")


def collective_of(stack: list[Frame], distributed: bool) -> str | None:
    """The collective a thread is blocked in, read from its innermost frames; None if it is not in one.

    Only the innermost run of torch frames counts: a user function called from inside torch (a custom autograd
    backward) that loops forever is stuck, not waiting. With gloo or NCCL, DDP's gradient all-reduce runs inside the
    C++ autograd engine, so a thread of a DDP job blocked there shows only ``_engine_run_backward`` as its innermost
    Python frame: that counts as waiting in the all-reduce (a backward of a model that fits in the step time does not
    take ``stall_timeout_s``).
    """
    if not distributed:
        return None
    for i, frame in enumerate(stack):
        if not _in_torch(frame):
            return None
        path = frame.filename.replace("\\", "/")
        if "/torch/distributed/" in path:
            # the innermost public function of torch.distributed (all_reduce, barrier, ...), not its wrappers
            public = [f for f in stack[i:] if "/torch/distributed/" in f.filename.replace("\\", "/")
                      and not f.function.startswith("_") and f.function != "wrapper"]
            return f"torch.distributed.{(public[0] if public else frame).function}"
        if path.endswith("/torch/nn/parallel/distributed.py"):
            if "broadcast" in frame.function or "buffers" in frame.function:
                return "DDP buffer broadcast in forward"
            return f"DDP {frame.function} in forward"
        if i == 0 and frame.function == "_engine_run_backward":
            return "DDP gradient all-reduce in backward"
    return None


# -- the heartbeat record -----------------------------------------------------------------------------------------


@dataclass
class Heartbeat:
    """One rank's state, as its watchdog last wrote it to ``hang/heartbeat/rank<R>.json``."""

    rank: int
    host: str
    pid: int
    step: int
    phase: str
    where: str | None
    waiting_in: str | None
    stalled: bool
    alive: bool
    no_progress_s: float
    last_progress_unix: float
    time_unix: float
    stack: list[str] = field(default_factory=list)
    # from the flight recorder, on a stall: the last collective this rank enqueued and how many are not done
    collectives: str | None = None
    # the longest time without progress this rank has seen so far (a reported stall included once it ended)
    longest_idle_s: float = 0.0

    @classmethod
    def read(cls, path: Path) -> Heartbeat | None:
        try:
            data = json.loads(path.read_text())
            return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
        except (OSError, ValueError, TypeError):
            return None


@dataclass
class Verdict:
    """Who is stuck, who waits, and the sentence that says so."""

    stuck_ranks: list[int]
    waiting_ranks: list[int]
    silent_ranks: list[int]
    reason: str
    sentence: str
    reporter: int


def diagnose(beats: dict[int, Heartbeat | None], world_size: int, now_unix: float, stale_after_s: float) -> Verdict:
    """Name the odd rank(s) from every rank's heartbeat.

    In order: a rank with no heartbeat (dead, or stuck holding the GIL so its watchdog cannot run) or one that left
    training; else, when some ranks wait in a collective and others do not, the ones that do not (they hold everyone
    up: this breaks the tie of 2 ranks, where "the majority" means nothing); else the ranks whose (step, phase)
    differs from a strict majority; else the ranks furthest behind in step; else every rank is stuck outside a
    collective (all stuck the same way) or none stands out (all wait at the same point).
    """
    ranks = list(range(world_size))
    # a rank that finished training cleanly is neither stuck nor waiting: it is out of the picture
    done = [r for r in ranks if beats.get(r) is not None and not beats[r].alive and beats[r].phase == "stopped"]
    silent = [r for r in ranks if r not in done and (
        beats.get(r) is None or not beats[r].alive
        or (not beats[r].stalled and now_unix - beats[r].time_unix > stale_after_s))]
    live = {r: beats[r] for r in ranks if r not in silent and r not in done}
    waiting = [r for r, b in live.items() if b.waiting_in]
    keys = Counter((b.step, b.phase) for b in live.values())
    if silent:
        stuck, reason = silent, "sent no heartbeat (dead, left training, or stuck holding the GIL)"
    elif world_size == 1:
        stuck, reason = ranks, "the only rank made no progress"
    elif 0 < len(waiting) < len(live):
        stuck, reason = [r for r in live if r not in waiting], "not in a collective while the others wait in one"
    elif keys and keys.most_common(1)[0][1] > len(live) / 2 and len(keys) > 1:
        majority = keys.most_common(1)[0][0]
        stuck = [r for r, b in live.items() if (b.step, b.phase) != majority]
        reason = f"step/phase differs from the majority (step {majority[0]}, {majority[1]})"
    elif len({b.step for b in live.values()}) > 1:
        low = min(b.step for b in live.values())
        stuck, reason = [r for r, b in live.items() if b.step == low], "furthest behind in step"
    elif not waiting:
        stuck, reason = list(live), "every rank is stuck outside a collective"
    else:
        stuck, reason = [], "every rank waits in a collective at the same point: none stands out"
    waiting = [r for r in waiting if r not in stuck]
    others = [r for r in live if r not in stuck]
    reporter = min(others) if others else min(live) if live else 0
    return Verdict(stuck, waiting, silent, reason, _sentence(beats, stuck, waiting, silent, now_unix), reporter)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _sentence(beats: dict[int, Heartbeat | None], stuck: list[int], waiting: list[int], silent: list[int],
              now_unix: float) -> str:
    parts = []
    for r in stuck:
        b = beats.get(r)
        if r in silent:
            age = f" for {now_unix - b.time_unix:.0f} s" if b else ""
            state = f", last seen at step {b.step} in {b.phase}" if b else ""
            parts.append(f"rank {r} sent no heartbeat{age}{state} (dead, left training, or holding the GIL)")
        elif b.where:
            path_line, _, function = b.where.rpartition(" ")
            parts.append(f"rank {r} is stuck at step {b.step} in {function} ({path_line})")
        else:
            parts.append(f"rank {r} is stuck at step {b.step} in phase {b.phase}")
    if not stuck:
        parts.append("no rank stands out")
    if waiting:
        kinds = sorted({beats[r].waiting_in for r in waiting})
        verb = "waits" if len(waiting) == 1 else "wait"
        parts.append(f"{_ranks(waiting)} {verb} in a collective ({'; '.join(kinds)})")
    return "; ".join(parts) + "."


def format_table(beats: dict[int, Heartbeat | None], verdict: Verdict, world_size: int) -> str:
    rows = [("rank", "host", "step", "phase", "idle_s", "where", "waiting in", "collectives")]
    for r in range(world_size):
        b = beats.get(r)
        mark = " <- stuck" if r in verdict.stuck_ranks else ""
        if b is None:
            rows.append((f"{r}{mark}", "?", "?", "no heartbeat", "?", "?", "?", "?"))
        else:
            rows.append((f"{r}{mark}", b.host, str(b.step), b.phase, f"{b.no_progress_s:.1f}", b.where or "?",
                         b.waiting_in or "-", b.collectives or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


# -- the watchdog -------------------------------------------------------------------------------------------------


@dataclass
class WatchdogConfig:
    rank: int
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
        super().__init__(daemon=True, name=f"hang-doctor-rank{config.rank}")
        self.cfg = config
        self.target_ident = target_ident  # the training thread
        self.step_fn = step_fn  # read by this thread when it writes a beat, so marking need not
        self.host = socket.gethostname()
        self.last: tuple[float, str] = (time.monotonic(), "train_start")
        self.longest_idle_s = 0.0
        self.stalls = 0
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
        except Exception:  # a bug here must not take training down; say it once
            say(f"hang doctor: watchdog of rank {self.cfg.rank} failed and stopped:\n{traceback.format_exc()}")

    def _recovered(self, last: tuple[float, str]) -> None:
        """After a reported stall (on_stall=report): say so once the rank makes progress again."""
        t, phase = last
        if self._reported_at is not None and t != self._reported_at:
            say(f"hang doctor: rank {self.cfg.rank} made progress again after {t - self._reported_at:.1f} s "
                f"(step {self._step()}, {phase})")
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
                self.stalls += 1
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
        except Exception:
            return -1

    def _beat(self, stalled: bool, alive: bool = True, phase: str | None = None) -> Heartbeat:
        t, last_phase = self.last
        # called from the training thread itself (at start and stop), its stack would only show this function
        stack = [] if threading.get_ident() == self.target_ident else thread_stack(self.target_ident)
        return Heartbeat(
            rank=self.cfg.rank, host=self.host, pid=os.getpid(), step=self._step(), phase=phase or last_phase,
            where=stack[0].where if stack else None,
            waiting_in=collective_of(stack, self.cfg.world_size > 1),
            stalled=stalled, alive=alive, no_progress_s=round(time.monotonic() - t, 3),
            last_progress_unix=round(t + self._start_unix_offset, 3), time_unix=round(time.time(), 3),
            stack=[f.where for f in stack[:12]], longest_idle_s=round(self.longest_idle_s, 3),
        )

    def _write_beat(self, beat: Heartbeat) -> None:
        try:
            write_json(self.heartbeat_dir / f"rank{self.cfg.rank}.json", dataclasses.asdict(beat))
        except OSError as err:  # a full or flaky filesystem must not kill training
            say(f"hang doctor: rank {self.cfg.rank} could not write its heartbeat: {err}")

    def read_beats(self) -> dict[int, Heartbeat | None]:
        return {r: Heartbeat.read(self.heartbeat_dir / f"rank{r}.json") for r in range(self.cfg.world_size)}

    # the stall
    def _on_stall(self, idle: float) -> None:
        cfg = self.cfg
        beat = self._beat(stalled=True)
        stalled_unix = time.time()
        dump = cfg.hang_dir / f"rank{cfg.rank}.txt"
        write_stack_dump(dump, beat, self.target_ident, cfg)
        for extra in cfg.extra_dumps:
            try:
                beat.collectives = extra() or beat.collectives
            except Exception as err:  # best effort: the stacks are what matters
                say(f"hang doctor: rank {cfg.rank}: {err}")
        self._write_beat(beat)
        say(f"hang doctor: rank {cfg.rank} made no progress for {idle:.1f} s (step {beat.step}, {beat.phase}, "
            f"at {beat.where}); its stacks are in {dump}")

        beats = self._gather(time.monotonic() + cfg.grace_s)
        stale_after_s = 3 * cfg.heartbeat_interval_s + cfg.grace_s + 5
        verdict = diagnose(beats, cfg.world_size, time.time(), stale_after_s)
        summary = cfg.hang_dir / "summary.json"
        if verdict.reporter == cfg.rank or not self._wait_for_summary(summary, stalled_unix - cfg.grace_s):
            self._report(beats, verdict, summary)
        if cfg.on_stall == "abort":
            say(f"hang doctor: aborting rank {cfg.rank} (exit code {cfg.exit_code}): {verdict.sentence}",
                logging.ERROR)
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
        say(f"hang doctor: training stalled (no progress for stall_timeout_s={cfg.stall_timeout_s:g}); "
            f"on_stall={cfg.on_stall}; stack dumps in {cfg.hang_dir}\n{table}\n{verdict.sentence}", logging.ERROR)
        write_json(path, {
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
            "reported_by": cfg.rank,
            "time_unix": round(time.time(), 3),
            "table": [dataclasses.asdict(b) if b else {"rank": r, "phase": "no heartbeat"} for r, b in beats.items()],
        })


def write_stack_dump(path: Path, beat: Heartbeat, target_ident: int, cfg: WatchdogConfig) -> None:
    """Every thread's Python stack, the training thread first, as ``traceback`` prints them (innermost last)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    lines = [
        f"hang doctor: rank {cfg.rank} of {cfg.world_size} on {beat.host} (pid {beat.pid}) made no progress for "
        f"{beat.no_progress_s:.1f} s (stall_timeout_s={cfg.stall_timeout_s:g})",
        f"last progress: step {beat.step}, phase {beat.phase}, at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(beat.last_progress_unix))}",
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
        except Exception:
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


# -- a peer that is gone ------------------------------------------------------------------------------------------

# what gloo and NCCL say when the other end of a collective went away (the process died, or its node)
_LOST_PEER_TEXT = ("connection closed by peer", "connection reset by peer", "broken pipe",
                   "remote process exited", "communicator was aborted")


def lost_peer(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) says a collective lost the rank at its other end."""
    seen = 0
    while error is not None and seen < 8:
        text = str(error).lower()
        if type(error).__name__ == "DistNetworkError" or any(t in text for t in _LOST_PEER_TEXT):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _process_gone(beat: Heartbeat) -> bool:
    """True when the rank ran on this host and its process no longer exists (unknown for other hosts: False)."""
    if beat.host != socket.gethostname():
        return False
    try:
        os.kill(beat.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def silent_ranks(heartbeat_dir: Path, world_size: int, rank: int, interval_s: float, slack_s: float = 1.5,
                 poll_s: float = 0.2, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep) -> dict[int, Heartbeat | None]:
    """The other ranks that stopped writing heartbeats: dead (killed, crashed) or frozen.

    A rank that lives writes its heartbeat every ``interval_s``; one that left training with an error of its own
    writes ``alive: false`` at once. So a rank whose heartbeat is older than ``interval_s + slack_s`` and says
    ``alive: true`` has stopped. Waits at most ``interval_s + slack_s`` for the heartbeats to tell.
    """
    def read(r: int) -> Heartbeat | None:
        return Heartbeat.read(heartbeat_dir / f"rank{r}.json")

    first = {r: read(r) for r in range(world_size) if r != rank}
    undecided, silent = set(first), {}
    deadline = clock() + interval_s + slack_s
    while undecided:
        now = clock()
        for r in sorted(undecided):
            beat = read(r)
            if beat is not None and (not beat.alive or (first[r] is not None and beat.time_unix != first[r].time_unix)):
                undecided.discard(r)  # it left training by itself, or it is still beating
            elif beat is not None and (now - beat.time_unix > interval_s + slack_s or _process_gone(beat)):
                silent[r] = beat
                undecided.discard(r)
            elif now >= deadline:
                silent[r] = beat
                undecided.discard(r)
        if undecided:
            sleep(poll_s)
    return silent


def lost_peer_sentence(rank: int, step: int, error: BaseException, silent: dict[int, Heartbeat | None],
                       now_unix: float) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[.../pair.cc:561] " source location
    parts = []
    for r, beat in sorted(silent.items()):
        if beat is None:
            parts.append(f"global rank {r} is gone (it never wrote a heartbeat)")
            continue
        gone = "its process is gone" if _process_gone(beat) else "it died (killed or crashed) or froze"
        parts.append(f"global rank {r} is gone: its last heartbeat came {now_unix - beat.time_unix:.1f} s ago, at "
                     f"step {beat.step} in {beat.phase}, from pid {beat.pid} on {beat.host}; {gone}")
    if not parts:
        parts.append("every other rank is still beating or left with an error of its own")
    return (f"hang doctor: global rank {rank} lost a peer at step {step} ({type(error).__name__}: {first[:160]}); "
            + "; ".join(parts) + ".")
