"""The profiling callback's optional recorders: torch.profiler traces and CUDA memory snapshots, one file per global
rank under ``<run dir>/traces/``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from lit_template.distributed.preemption import StepVote
from lit_template.errors import ConfigError
from lit_template.lightning_compat import dump_memory_snapshot, record_memory_history


@dataclass(frozen=True)
class TraceConfig:
    """torch.profiler window: after ``skip_first`` steps, ``repeat`` cycles (0: until the end) of
    ``wait`` + ``warmup`` + ``active`` steps; one trace file per cycle per global rank."""

    enabled: bool = False
    skip_first: int = 5
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False

    def __post_init__(self) -> None:
        for name in ("skip_first", "wait", "warmup", "repeat"):
            if getattr(self, name) < 0:
                raise ConfigError(f"callbacks.profiling.trace.{name} must be >= 0, got {getattr(self, name)}")
        if self.active < 1:
            raise ConfigError(f"callbacks.profiling.trace.active must be >= 1, got {self.active}")


@dataclass(frozen=True)
class MemorySnapshotConfig:
    """CUDA allocator history, dumped at ``at_step`` (or at the end of fit, or at an OOM) for pytorch.org/memory_viz."""

    enabled: bool = False
    max_entries: int = 100_000
    at_step: int | None = None


def options(cls: type, name: str, given: Mapping[str, Any] | None) -> Any:
    """``cls(**given)``, or a ConfigError naming ``callbacks.profiling.<name>.<key>`` for a key it does not have."""
    given = dict(given or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(
            f"callbacks.profiling.{name}.{unknown[0]} is not an option; the options are: {', '.join(sorted(known))}"
        )
    return cls(**given)


class TraceRecorder:
    """A torch.profiler run over the configured window; each cycle becomes ``rank<R>_step<S>.pt.trace.json``, which
    Perfetto (ui.perfetto.dev) and TensorBoard's profiler plugin open."""

    def __init__(self, config: TraceConfig, device: torch.device, path_for: Callable[[int], Path]) -> None:
        self.config, self.path_for, self.files = config, path_for, []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        c = config
        self._profiler: torch.profiler.profile | None = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                skip_first=c.skip_first, wait=c.wait, warmup=c.warmup, active=c.active, repeat=c.repeat
            ),
            on_trace_ready=self._export,
            record_shapes=c.record_shapes,
            profile_memory=c.profile_memory,
            with_stack=c.with_stack,
        )
        self._profiler.start()

    def step(self) -> None:
        if self._profiler is not None:
            StepVote.settle_all()  # the profiler may start or stop here: no collective may be running under it
            self._profiler.step()

    def stop(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            StepVote.settle_all()
            profiler.stop()

    def _export(self, prof: torch.profiler.profile) -> None:
        path = self.path_for(prof.step_num)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        self.files.append(str(path))


class MemorySnapshots:
    """The CUDA caching allocator's history, recorded from ``start`` and dumped once (``dump``; again after an OOM)."""

    def __init__(self, config: MemorySnapshotConfig) -> None:
        self.config, self.files, self.taken = config, [], False

    def start(self) -> None:
        record_memory_history(self.config.max_entries)

    def stop(self) -> None:
        record_memory_history(None)

    def dump(self, path: Path, again: bool = False) -> None:
        if self.taken and not again:
            return
        self.taken = True
        path.parent.mkdir(parents=True, exist_ok=True)
        dump_memory_snapshot(path)
        self.files.append(str(path))
