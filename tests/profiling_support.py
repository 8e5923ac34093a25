"""Test-only support for tests/test_profiling.py: a clock that ticks a fixed amount on every reading.

Given to the callback through the entry point (``PYTHONPATH=tests``):
``+callbacks.profiling.clock._target_=profiling_support.TickClock``. The callback reads its clock exactly at
epoch start, around each training fetch (start, end) and at each batch's start, backward and end, so every
micro-batch takes 5 ticks, 1 of them data wait (2 for an epoch's first: creating the iterator counts too).
"""

from __future__ import annotations


class TickClock:
    def __init__(self, tick_s: float = 0.001) -> None:
        self.tick_s = tick_s
        self.ticks = 0

    def __call__(self) -> float:
        self.ticks += 1
        return self.ticks * self.tick_s
