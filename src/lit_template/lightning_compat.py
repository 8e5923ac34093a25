"""Every use of a private Lightning or torch API in the template, in one place.

Each function says what it reaches into and why, and was checked against the pinned versions below. When you
upgrade Lightning or torch, read these first: a change there shows up here, not all over the package.
"""

from __future__ import annotations

from typing import Any

import lightning as L

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
    timeout: Any = getattr(trainer.strategy, "_timeout", None)
    return timeout.total_seconds() if hasattr(timeout, "total_seconds") else None
