"""Every use of a private Lightning or torch API in the template, in one place.

Each function says what it reaches into and why, and was checked against the pinned versions below. When you
upgrade Lightning or torch, read these first: a change there shows up here, not all over the package. Two uses are
method overrides rather than calls: ``distributed.comm.CommDDPStrategy`` overrides ``DDPStrategy._register_ddp_hooks``
(its body is ``register_ddp_comm_hook`` below), and ``models.parallel_compat.ModelParallelStrategy`` overrides
``ModelParallelStrategy._configure_launcher`` (to check the mesh before any process starts). ``lean_hooks``
replaces three functions of ``lightning.pytorch.trainer.call`` (the per-step hook dispatch) for the whole process;
they fall back to Lightning's own on any trainer that has a profiler. ``cuda_device_count_cached`` sets torch's
private device-count cache while a CPU trainer runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import torch
from lightning.pytorch.profilers import PassThroughProfiler, Profiler
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

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


@contextlib.contextmanager
def cuda_device_count_cached(trainer: L.Trainer) -> Iterator[None]:
    """While a CPU trainer runs, ``torch.cuda.device_count()`` answers from torch's own cache
    (``torch.cuda._cached_device_count``), not by probing NVML again at every optimizer step.

    Importing Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (lightning/fabric/__init__.py). Under it,
    ``torch.cuda.is_available()`` counts the devices through NVML (``dlopen("libnvidia-ml.so.1")``, init, count), and
    torch caches the count only once CUDA is initialized, which a CPU run never does. Adam's ``step()`` (and
    RMSprop's, RAdam's, ...) asks ``torch.accelerator.current_accelerator(check_available=True)`` every step, so a
    CPU run paid that probe at every step: 395-411 us a step inside ``python train.py`` on a 2-core CPU VM without the
    library (a ``perf_counter`` around the health check, batch 1024), against 32-36 us cached. Here the count is taken
    once, the way torch takes it, and put back to "not cached" afterwards, unless CUDA was initialized
    meanwhile (torch's own cache then holds the same count). A GPU trainer is left alone: its setup initializes CUDA,
    and torch caches the count itself.
    """
    from torch import cuda

    if (
        trainer.strategy.root_device.type != "cpu"
        or cuda.is_initialized()
        or getattr(cuda, "_cached_device_count", 0) is not None
    ):
        yield
        return
    cuda._cached_device_count = cuda.device_count()
    try:
        yield
    finally:
        if not cuda.is_initialized():
            cuda._cached_device_count = None


class NullProfiler(Profiler):
    """``Trainer(profiler=None)`` without its per-use cost: Lightning's ``PassThroughProfiler.profile`` is a generator
    context manager (about 1.4 us a use here, some 150 uses a step with the shipped callbacks); this one hands out
    one shared ``nullcontext``. Set by ``lean_hooks`` only where no profiler was asked for."""

    _NULL = contextlib.nullcontext()

    def start(self, action_name: str) -> None:
        pass

    def stop(self, action_name: str) -> None:
        pass

    def profile(self, action_name: str) -> contextlib.nullcontext:  # type: ignore[override]
        return self._NULL


def lean_hooks(trainer: L.Trainer) -> bool:
    """Take Lightning's avoidable per-step costs out of this trainer's loop; False (and nothing changed) where a
    profiler was asked for or Lightning is not the 2.6 this was read against.

    Lightning 2.6's ``trainer/call.py`` calls every hook of every callback at each step, overridden or not, each inside
    ``trainer.profiler.profile(f"[Callback]{callback.state_key}.{hook}")`` (``ModelCheckpoint.state_key`` alone
    formats a dict repr, ~1.6 us), and sets ``pl_module._current_fx_name`` through ``nn.Module.__setattr__`` twice a
    hook; the training loop's ``_build_kwargs`` runs ``inspect.signature`` on ``training_step`` every batch. Here the
    profiler becomes ``NullProfiler``, the three ``call._call_*_hook`` functions skip a callback hook that is
    ``Callback``'s own no-op and open no profiler context while the profiler is a ``NullProfiler`` (any other
    profiler, e.g. ``debug=profiler``, gets Lightning's functions as they are), and ``_build_kwargs`` remembers the
    signature per ``training_step`` function. Hooks run in the same order with the same arguments.
    """
    if type(trainer.profiler) is not PassThroughProfiler or not L.__version__.startswith("2.6."):
        return False
    from lightning.pytorch.trainer import call

    trainer.profiler = NullProfiler()
    if not getattr(call._call_callback_hooks, "_lit_template_lean", False):
        _lean_call_functions(call)
    loop = trainer.fit_loop.epoch_loop
    takes_batch_idx: dict[Any, bool] = {}

    def build_kwargs(kwargs: Any, batch: Any, batch_idx: int) -> Any:
        kwargs["batch"] = batch
        step = trainer.lightning_module.training_step
        key = getattr(step, "__func__", step)
        if key not in takes_batch_idx:
            takes_batch_idx[key] = is_param_in_hook_signature(step, "batch_idx", min_args=2)
        if takes_batch_idx[key]:
            kwargs["batch_idx"] = batch_idx
        return kwargs

    loop._build_kwargs = build_kwargs  # type: ignore[method-assign]
    return True


def _lean_call_functions(call: Any) -> None:
    """Replace ``call._call_callback_hooks`` / ``_call_lightning_module_hook`` / ``_call_strategy_hook`` (looked up
    by the loops at call time) with versions that do the same work minus the profiler context and the no-op hooks
    when ``trainer.profiler`` is a ``NullProfiler``, and call the originals otherwise."""
    originals = call._call_callback_hooks, call._call_lightning_module_hook, call._call_strategy_hook
    # every hook of lightning's Callback is an empty body (read in 2.6.6)
    no_op = {n: fn for n, fn in vars(L.Callback).items() if n.startswith("on_") or n in ("setup", "teardown")}
    set_plain = object.__setattr__

    def set_fx(pl_module: Any, name: str | None) -> None:
        # _current_fx_name is a plain attribute: nn.Module.__setattr__'s parameter/buffer/module checks are moot
        (set_plain if type(pl_module).__setattr__ is torch.nn.Module.__setattr__ else setattr)(
            pl_module, "_current_fx_name", name
        )

    def callback_hooks(trainer: Any, hook_name: str, *args: Any, monitoring_callbacks: Any = None, **kw: Any) -> None:
        if type(trainer.profiler) is not NullProfiler or monitoring_callbacks is not None:
            return originals[0](trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kw)
        pl_module = trainer.lightning_module
        if pl_module:
            prev = pl_module._current_fx_name
            set_fx(pl_module, hook_name)
        base = no_op.get(hook_name)
        for callback in trainer.callbacks:
            fn = getattr(callback, hook_name)
            if callable(fn) and getattr(fn, "__func__", None) is not base:
                fn(trainer, pl_module, *args, **kw)
        if pl_module:
            set_fx(pl_module, prev)
        return None

    def module_hook(trainer: Any, hook_name: str, *args: Any, pl_module: Any = None, **kw: Any) -> Any:
        pl_module = pl_module or trainer.lightning_module
        if type(trainer.profiler) is not NullProfiler or pl_module is None:
            return originals[1](trainer, hook_name, *args, pl_module=pl_module, **kw)
        fn = getattr(pl_module, hook_name)
        if not callable(fn):
            return None
        prev = pl_module._current_fx_name
        set_fx(pl_module, hook_name)
        output = fn(*args, **kw)
        set_fx(pl_module, prev)
        return output

    def strategy_hook(trainer: Any, hook_name: str, *args: Any, **kw: Any) -> Any:
        if type(trainer.profiler) is not NullProfiler:
            return originals[2](trainer, hook_name, *args, **kw)
        pl_module = trainer.lightning_module
        prev = pl_module._current_fx_name
        set_fx(pl_module, hook_name)
        fn = getattr(trainer.strategy, hook_name)
        if not callable(fn):
            return None
        output = fn(*args, **kw)
        set_fx(pl_module, prev)
        return output

    for lean in (callback_hooks, module_hook, strategy_hook):
        lean._lit_template_lean = True  # type: ignore[attr-defined]
    call._call_callback_hooks, call._call_lightning_module_hook, call._call_strategy_hook = (
        callback_hooks,
        module_hook,
        strategy_hook,
    )
