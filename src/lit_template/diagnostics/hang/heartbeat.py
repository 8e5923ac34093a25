"""The heartbeat record every rank writes to ``<run dir>/hang/heartbeat/rank<R>.json``, and what is read from all of
them: who is stuck (``diagnose``) and, after a collective lost its peer, who is gone (``silent_ranks``)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Heartbeat:
    """One rank's state, as its watchdog last wrote it to ``hang/heartbeat/rank<R>.json``."""

    global_rank: int
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
    silent = [
        r
        for r in ranks
        if r not in done
        and (
            beats.get(r) is None
            or not beats[r].alive
            or (not beats[r].stalled and now_unix - beats[r].time_unix > stale_after_s)
        )
    ]
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


def _sentence(
    beats: dict[int, Heartbeat | None], stuck: list[int], waiting: list[int], silent: list[int], now_unix: float
) -> str:
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
            rows.append(
                (
                    f"{r}{mark}",
                    b.host,
                    str(b.step),
                    b.phase,
                    f"{b.no_progress_s:.1f}",
                    b.where or "?",
                    b.waiting_in or "-",
                    b.collectives or "-",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


# -- a peer that is gone ------------------------------------------------------------------------------------------

# what gloo and NCCL say when the other end of a collective went away (the process died, or its node)
_LOST_PEER_TEXT = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "communicator was aborted",
)


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


def silent_ranks(
    heartbeat_dir: Path,
    world_size: int,
    rank: int,
    interval_s: float,
    slack_s: float = 1.5,
    poll_s: float = 0.2,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[int, Heartbeat | None]:
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
            elif (
                beat is not None and (now - beat.time_unix > interval_s + slack_s or _process_gone(beat))
            ) or now >= deadline:
                silent[r] = beat
                undecided.discard(r)
        if undecided:
            sleep(poll_s)
    return silent


def lost_peer_sentence(
    rank: int, step: int, error: BaseException, silent: dict[int, Heartbeat | None], now_unix: float
) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[.../pair.cc:561] " source location
    parts = []
    for r, beat in sorted(silent.items()):
        if beat is None:
            parts.append(f"global rank {r} is gone (it never wrote a heartbeat)")
            continue
        gone = "its process is gone" if _process_gone(beat) else "it died (killed or crashed) or froze"
        parts.append(
            f"global rank {r} is gone: its last heartbeat came {now_unix - beat.time_unix:.1f} s ago, at "
            f"step {beat.step} in {beat.phase}, from pid {beat.pid} on {beat.host}; {gone}"
        )
    if not parts:
        parts.append("every other rank is still beating or left with an error of its own")
    return (
        f"hang doctor: global rank {rank} lost a peer at step {step} ({type(error).__name__}: {first[:160]}); "
        + "; ".join(parts)
        + "."
    )
