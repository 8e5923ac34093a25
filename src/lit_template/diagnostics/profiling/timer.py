"""Step timing for ``ProfilingCallback``: the clocks (CPU, CUDA events) and ``StepTimer``, which turns the loop's marks
into one ``StepRecord`` per optimizer step.

Data wait is defined once, in ``DATA_WAIT`` (``StepRecord.data_wait_s``); the report and docs/profiling.md quote it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# The one definition of data wait, quoted by the report and the docs.
DATA_WAIT = (
    "the host time the training loop spends fetching the next batch from its dataloader (between the loop's "
    "fetch marks, lightning_compat.hook_fetch), plus, for an epoch's first batch, creating the iterator "
    "(workers starting); other callbacks' hooks and logging between batches are step time, not data wait"
)


class CpuClock:
    """Host time. ``now`` is injectable so tests can drive it."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now

    def mark(self) -> float:
        return self.now()

    def host_now(self) -> float:
        return self.now()

    def settle(self) -> None:
        pass

    @staticmethod
    def elapsed_s(start: float, end: float) -> float:
        return end - start


class CudaClock:
    """Device time from CUDA events: a mark is an event recorded on the current stream, never a synchronize.

    ``settle`` waits for the newest event once, at a log step; only then are the elapsed times read.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._last: torch.cuda.Event | None = None

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._last = event
        return event

    @staticmethod
    def host_now() -> float:
        # the loop's wait for a batch happens on the host; no event is needed (nor meaningful) for it
        return time.perf_counter()

    def settle(self) -> None:
        if self._last is not None:
            self._last.synchronize()

    @staticmethod
    def elapsed_s(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3


# -- one optimizer step ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepRecord:
    """One optimizer step on one rank (all its micro-batches when gradients are accumulated)."""

    step: int  # trainer.global_step after the step
    step_time_s: float  # end of the previous step -> end of this one, validation excluded
    data_wait_s: float  # of which the loop waited for batches: see DATA_WAIT
    # This rank's own time before the gradient sync: step start -> backward of its last micro-batch, less what it
    # waited inside forward for the other ranks (DDP's buffer broadcast). The rank with the most is the one the
    # others wait for.
    pre_sync_s: float
    samples: int
    tokens: int  # 0 when the batches have no sequence dimension


@dataclass
class _MicroBatch:
    wait_from: Any | None  # mark at the previous batch end or epoch start; None after validation (not measured)
    start: Any
    # host seconds spent fetching this batch (None: no fetch was seen, e.g. another loop; the gap counts instead)
    fetch_s: float | None = None
    forward_enter: Any | None = None  # the wrapped (DDP) model's forward called ...
    forward_synced: Any | None = None  # ... and past its collectives, the inner module's forward begins
    before_backward: Any | None = None
    end: Any | None = None


@dataclass
class _PendingStep:
    step: int
    micro: list[_MicroBatch]
    samples: int
    tokens: int


class StepTimer:
    """Marks the loop events of the training batches and turns them into ``StepRecord`` s when asked.

    Marks are resolved only in ``take`` (a log step), so CUDA events are read without a synchronize per batch.
    """

    def __init__(self, clock: CpuClock | CudaClock) -> None:
        self.clock = clock
        self._last_end: Any | None = None
        self._micro: list[_MicroBatch] = []
        self._samples = self._tokens = 0
        self._pending: list[_PendingStep] = []
        # host time fetching since the last batch start; where the epoch began (iterator creation counts as wait)
        self._fetch_s: float | None = None
        self._fetch_from: float | None = None
        self._epoch_start_host: float | None = None
        self._handles: list[Any] = []  # attach: forward hooks on the DDP model
        self._unhook_fetch: Callable[[], None] | None = None

    def resume(self) -> None:
        """Epoch start: the wait for the first batch (iterator and workers starting) counts as data wait."""
        self._last_end = self.clock.mark()
        # on the CPU the mark is host time already (one clock reading, which keeps a ticking test clock simple)
        self._epoch_start_host = self._last_end if isinstance(self.clock, CpuClock) else self.clock.host_now()
        self._micro, self._samples, self._tokens = [], 0, 0
        self._fetch_s = None

    def fetch_start(self) -> None:
        now = self.clock.host_now()
        if self._epoch_start_host is not None:
            # the epoch's first fetch: creating the iterator (starting workers) was waiting for data too
            self._fetch_s = (self._fetch_s or 0.0) + (now - self._epoch_start_host)
            self._epoch_start_host = None
        self._fetch_from = now

    def fetch_end(self) -> None:
        if self._fetch_from is not None:
            self._fetch_s = (self._fetch_s or 0.0) + (self.clock.host_now() - self._fetch_from)
            self._fetch_from = None

    def pause(self) -> None:
        """Validation: the gap until the next training batch (validation, checkpointing) is not measured."""
        self._last_end = None
        self._epoch_start_host = None

    def batch_start(self) -> None:
        self._micro.append(_MicroBatch(wait_from=self._last_end, start=self.clock.mark(), fetch_s=self._fetch_s))
        self._fetch_s = None

    def _open(self) -> _MicroBatch | None:
        return self._micro[-1] if self._micro and self._micro[-1].end is None else None

    def forward_enter(self) -> None:
        mb = self._open()
        if mb is not None and mb.forward_enter is None:
            mb.forward_enter = self.clock.mark()

    def forward_synced(self) -> None:
        mb = self._open()
        if mb is not None and mb.forward_enter is not None and mb.forward_synced is None:
            mb.forward_synced = self.clock.mark()

    def before_backward(self) -> None:
        mb = self._open()
        if mb is not None:
            mb.before_backward = self.clock.mark()

    def batch_end(self, samples: int, tokens: int, stepped: bool, step: int, keep: bool = True) -> None:
        if not self._micro:  # a batch_end without its start: nothing to time
            return
        self._last_end = self._micro[-1].end = self.clock.mark()
        self._samples += samples
        self._tokens += tokens
        if stepped:
            if keep:
                self._pending.append(_PendingStep(step, self._micro, self._samples, self._tokens))
            self._micro, self._samples, self._tokens = [], 0, 0

    def attach(self, trainer: Any) -> None:
        """Marks from the loop itself, removed again by ``detach``.

        The training loop's fetch of each batch: that, not the whole gap between two batches (other callbacks'
        hooks, logging), is the data wait (DATA_WAIT); without these marks the whole gap counts (``_resolve``).
        Under DDP, the wrapped model's forward and its inner module's: in between, DDP broadcasts buffers, where a
        fast rank waits for a slow one before the gradient sync. That wait is not the rank's own time.
        """
        from torch.nn.parallel import DistributedDataParallel

        from lit_template.lightning_compat import hook_fetch

        self.detach()
        model = trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            self._handles = [
                model.register_forward_pre_hook(lambda *_: self.forward_enter()),
                model.module.register_forward_pre_hook(lambda *_: self.forward_synced()),
            ]
        self._unhook_fetch = hook_fetch(trainer, self.fetch_start, self.fetch_end)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._unhook_fetch is not None:
            self._unhook_fetch()
        self._unhook_fetch = None

    def take(self) -> list[StepRecord]:
        """The steps completed since the last call, resolved (one wait on the device when the clock is CUDA)."""
        if not self._pending:
            return []
        self.clock.settle()
        records = [self._resolve(p) for p in self._pending]
        self._pending = []
        return records

    def _resolve(self, pending: _PendingStep) -> StepRecord:
        elapsed = self.clock.elapsed_s
        step_s = wait_s = pre_sync_s = forward_wait_s = 0.0
        for i, mb in enumerate(pending.micro):
            # the gap since the previous batch's end: the fetch, other callbacks' batch-end hooks, logging
            gap = elapsed(mb.wait_from, mb.start) if mb.wait_from is not None else 0.0
            # (clamped to the gap: on a GPU the gap is device time, the fetch host time)
            wait = 0.0 if mb.wait_from is None else gap if mb.fetch_s is None else min(mb.fetch_s, gap)
            busy = elapsed(mb.start, mb.end)
            if mb.forward_enter is not None and mb.forward_synced is not None:
                forward_wait_s += elapsed(mb.forward_enter, mb.forward_synced)
            if i == len(pending.micro) - 1:
                to_backward = elapsed(mb.start, mb.before_backward) if mb.before_backward is not None else busy
                pre_sync_s = step_s + gap + to_backward - forward_wait_s
            step_s += gap + busy
            wait_s += wait
        return StepRecord(pending.step, step_s, wait_s, pre_sync_s, pending.samples, pending.tokens)
