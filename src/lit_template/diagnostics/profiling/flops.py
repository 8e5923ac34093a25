"""FLOPs per sample and the device's peak FLOP/s: the two numbers behind MFU (``ProfilingCallback``).

FLOPs per sample come from the LightningModule's own ``flops_per_token()`` formula when it has one (GPT: 6N plus
attention), else from ``torch.utils.flop_counter.FlopCounterMode`` wrapped around the first real training batch's
forward and backward; that step ran slower under the counter, so it is not timed (``untimed_step``). The peak is
``callbacks.profiling.peak_flops`` when set, else Lightning's table for the GPU and dtype; a CPU has no table, and
MFU is then absent rather than a made-up number.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lit_template.diagnostics.profiling.stats import batch_counts


class FlopMeter:
    """Finds the peak FLOP/s once and the FLOPs per sample from the first training batch.

    Args:
        enabled: ``callbacks.profiling.mfu``; off: neither number is looked for.
        peak_override: ``callbacks.profiling.peak_flops`` (FLOP/s of one device), or None.
        tell: prints a sentence on rank zero (why MFU is not reported).
    """

    def __init__(self, enabled: bool, peak_override: float | None, tell: Callable[[str], None]) -> None:
        self.enabled = enabled
        self.peak_override = peak_override
        self._tell = tell
        self.peak_flops: float | None = None
        self.flops_per_sample: float | None = None
        self.flops_from = "counter"  # or "model": the LightningModule's flops_per_token() formula
        self.untimed_step = False  # the step just counted ran under FlopCounterMode: not timed
        self._counter: Any | None = None
        self._samples = 0

    @property
    def peak_from(self) -> str:
        return "config" if self.peak_override is not None else "lightning"

    def find_peak(self, device: torch.device, dtype: torch.dtype, option: str) -> None:
        """Called at setup; ``dtype`` is the precision plugin's compute dtype."""
        if not self.enabled:
            self.peak_flops = None
        elif self.peak_override is not None:
            self.peak_flops = self.peak_override
        elif device.type != "cuda":
            self.peak_flops = None
        else:
            from lightning.fabric.utilities.throughput import get_available_flops

            peak = get_available_flops(device, dtype)
            if peak is None:
                self._tell(
                    f"profiling: MFU is not reported: Lightning has no peak FLOP/s for "
                    f"{torch.cuda.get_device_name(device)!r} in {dtype}; set {option}.peak_flops"
                )
            self.peak_flops = float(peak) if peak else None

    def batch_start(self, pl_module: Any, batch: Any) -> None:
        """Before a training batch: take the model's formula, or start counting this one batch."""
        if not self.peak_flops or self.flops_per_sample is not None:
            return
        formula = getattr(pl_module, "flops_per_token", None)
        if callable(formula):
            # the model states its FLOPs per token: no counting, no untimed step
            samples, tokens = batch_counts(batch)
            self.flops_per_sample = float(formula()) * tokens / max(samples, 1)
            self.flops_from = "model"
        elif self._counter is None:
            from torch.utils.flop_counter import FlopCounterMode

            # Count this one real batch's forward and backward, rather than run the model again on the side.
            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
            self._samples = batch_counts(batch)[0]

    def stop(self) -> None:
        """Before the optimizer step (or at the batch's end, or on an exception): stop counting, if counting."""
        if self._counter is None:
            return
        counter, self._counter = self._counter, None
        self.untimed_step = True
        counter.__exit__(None, None, None)
        total = counter.get_total_flops()
        self.flops_per_sample = total / max(self._samples, 1) if total else 0.0
        if not total:
            self._tell("profiling: MFU is not reported: the FLOP counter saw no matmuls or convolutions")
