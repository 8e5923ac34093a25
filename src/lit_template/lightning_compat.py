"""Every use of a private Lightning or torch API in the template, in one place.

Each function says what it reaches into and why, and was checked against the pinned versions below. When you
upgrade Lightning or torch, read these first: a change there shows up here, not all over the package. Two uses are
method overrides rather than calls: ``distributed.comm.CommDDPStrategy`` overrides ``DDPStrategy._register_ddp_hooks``
(its body is ``register_ddp_comm_hook`` below), and ``models.parallel_compat.ModelParallelStrategy`` overrides
``ModelParallelStrategy._configure_launcher`` (to check the mesh before any process starts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning as L
import torch

CHECKED_WITH = {"lightning": "2.6.6", "torch": "2.14.1"}


def disable_lightning_signal_handling(trainer: L.Trainer) -> None:
    """Keep Lightning's own SIGTERM/SIGUSR1 handling out of this fit (the ``preemption`` callback handles both).

    Lightning 2.6's ``_SignalConnector.register_signal_handlers`` installs a SIGTERM handler that runs a
    ``dist.broadcast`` inside the signal handler, and under SLURM a SIGUSR1 handler that saves a checkpoint (a
    barrier) and requeues from the handler: a rank in that handler and a rank in the loop's next collective wait for
    each other forever. Its training loop also broadcasts a "received SIGTERM" flag from rank 0 at every step
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``: a collective and a host sync per step), which is useless once
    its handler is gone. Both are replaced on this trainer's instances only.
    """
    trainer._signal_connector.register_signal_handlers = lambda: None  # type: ignore[method-assign]
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None  # type: ignore[method-assign]


def load_pending_dataloader_state(trainer: L.Trainer) -> bool:
    """Load the training dataloader's checkpointed state if Lightning dropped it; True if it had to.

    Lightning issue #20550 (open in 2.6.6): when ``trainer.estimated_stepping_batches`` is read before the
    checkpoint is restored (a ``configure_optimizers`` that sizes a OneCycle/cosine schedule), the train dataloader
    is built early and the resumed fit never loads its state: a mid-epoch resume silently restarts the epoch's data.
    Here the states still waiting in ``fit_loop._combined_loader_states_to_load`` are loaded and the data fetcher's
    iterator is made again (what PR #21765 proposes). Call at ``on_train_start``, before the first batch.
    """
    fit_loop = trainer.fit_loop
    if not (fit_loop.restarting and fit_loop._combined_loader_states_to_load and fit_loop._combined_loader):
        return False
    fit_loop._load_combined_loader_states()
    if fit_loop._data_fetcher is not None:
        iter(fit_loop._data_fetcher)
    return True


def is_last_batch_of_epoch(trainer: L.Trainer) -> bool:
    """Whether the batch that just ended is the epoch's last (the loop's own flag, set before the batch runs)."""
    return bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)


def strategy_timeout_s(trainer: L.Trainer) -> float | None:
    """The process group's timeout (``trainer.strategy.timeout``), which Lightning keeps only as ``_timeout``."""
    timeout: Any = getattr(getattr(trainer, "strategy", None), "_timeout", None)
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else None


def hook_fetch(trainer: L.Trainer, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``before``/``after`` around each fetch of a training batch; returns the undo, or None if not possible.

    Lightning's training epoch loop brackets each ``next()`` on the dataloader with its private ``_on_before_fetch``
    / ``_on_after_fetch`` and has no public hook there. They are wrapped on this fit's loop instance; the undo drops
    the instance attributes, so the class's methods show through again.
    """
    loop = trainer.fit_loop.epoch_loop
    names = ("_on_before_fetch", "_on_after_fetch")
    if not all(callable(getattr(loop, name, None)) for name in names):
        return None
    loop_before, loop_after = loop._on_before_fetch, loop._on_after_fetch

    def on_before_fetch() -> None:
        before()
        loop_before()

    def on_after_fetch() -> None:
        loop_after()
        after()

    loop._on_before_fetch, loop._on_after_fetch = on_before_fetch, on_after_fetch  # type: ignore[method-assign]

    def undo() -> None:
        for name in names:
            loop.__dict__.pop(name, None)

    return undo


def compute_dtype(trainer: L.Trainer) -> torch.dtype:
    """The dtype the precision plugin computes in (for the peak FLOP/s of MFU), through the ThroughputMonitor's
    private ``_plugin_to_compute_dtype``; float32 if that is gone."""
    try:
        from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype

        return _plugin_to_compute_dtype(trainer.precision_plugin)
    except (ImportError, AttributeError, TypeError, ValueError):
        return torch.float32


def model_averager(strategy: Any) -> Any | None:
    """The local-SGD ``PeriodicModelAverager`` Lightning's DDPStrategy builds in ``setup`` (``_model_averager``)."""
    return getattr(strategy, "_model_averager", None)


def wrap_process_observer(wrapper: Callable[[list, Callable[[list], None]], None]) -> None:
    """Make Lightning's subprocess launcher call ``wrapper(child_processes, original)`` where it starts the observer
    of its child processes (the module function ``_launch_process_observer``, looked up at call time). Idempotent."""
    from lightning.pytorch.strategies.launchers import subprocess_script as launcher

    original = launcher._launch_process_observer
    if getattr(original, "_lit_template_wrapped", False):
        return

    def launch(child_processes: list) -> None:
        wrapper(child_processes, original)

    launch._lit_template_wrapped = True  # type: ignore[attr-defined]
    launcher._launch_process_observer = launch


def register_ddp_comm_hook(strategy: Any) -> None:
    """Register the strategy's DDP comm hook on any device. Lightning's ``DDPStrategy._register_ddp_hooks`` does it
    on CUDA only, a guard older than gloo's support for comm hooks (fp16/bf16 all-reduce included)."""
    from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook

    _register_ddp_comm_hook(
        model=strategy.model,
        ddp_comm_state=strategy._ddp_comm_state,
        ddp_comm_hook=strategy._ddp_comm_hook,
        ddp_comm_wrapper=strategy._ddp_comm_wrapper,
    )


def model_averaging_period(strategy: Any) -> int | None:
    """The local-SGD period given to ``DDPStrategy(model_averaging_period=...)`` (kept only as a private field)."""
    return getattr(strategy, "_model_averaging_period", None)


def flight_recorder_dump(backend: str) -> Callable[[], bytes] | None:
    """PyTorch's flight recorder dump for this process's groups (the pickle ``torchfrtrace`` reads): torch exposes it
    only as ``torch._C._distributed_c10d._dump_nccl_trace`` (NCCL) / ``_dump_fr_trace`` (any backend). None if
    absent."""
    from torch._C import _distributed_c10d as c10d

    if backend == "nccl" and hasattr(c10d, "_dump_nccl_trace"):
        return c10d._dump_nccl_trace
    return getattr(c10d, "_dump_fr_trace", None)


def record_memory_history(max_entries: int | None) -> None:
    """Start (``max_entries``) or stop (None) the CUDA allocator's history:
    ``torch.cuda.memory._record_memory_history``, the documented but underscored API of pytorch.org/memory_viz."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_memory_snapshot(path: Any) -> None:
    """Write the allocator history (``torch.cuda.memory._dump_snapshot``) for pytorch.org/memory_viz."""
    torch.cuda.memory._dump_snapshot(str(path))


def set_threads_per_process(num_processes: int) -> None:
    """Give this process its share of the CPU threads, as Lightning's launcher does for DDP ranks.

    ``lightning.fabric.utilities.distributed._set_num_threads_if_needed`` (cores / processes per node, unless
    ``OMP_NUM_THREADS`` is set) runs in ``_SubprocessScriptLauncher.launch``. DDPStrategy makes that launcher on every
    rank, but ModelParallelStrategy (2.6.6) only where it starts the processes: its other ranks kept torch's default,
    every core, so on 2 cores rank 1 ran 2 threads beside rank 0's 1 (oversubscribed, and its CPU reductions summed
    in another order: tensor-parallel peers' replicated LayerNorm gradients differed by ~1e-10).
    """
    from lightning.fabric.utilities.distributed import _set_num_threads_if_needed

    _set_num_threads_if_needed(num_processes=num_processes)
