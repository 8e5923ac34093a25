"""Lightning's ``ModelParallelStrategy`` with its mesh sizes resolved and checked when the Trainer is built.

Checked against lightning 2.6.6 and torch 2.14.1 (``lightning/pytorch/strategies/model_parallel.py``). The strategy
itself runs on the CPU over gloo as it is (it picks gloo for a CPU root device and passes no ``device_id``; FSDP2's
reduce-scatter and the tensor-parallel collectives exist on gloo in torch 2.14), so nothing here is about the CPU.
Two things in 2.6.6 are, and both are fixed here by overriding one private method, ``_configure_launcher``: the
first point at which the accelerator connector has set ``parallel_devices`` and ``num_nodes``, and before any
process is started.

- Sizes are checked only in ``setup_environment``, after the launcher has started every rank: a
  ``data_parallel_size x tensor_parallel_size`` that is not the world size ends as a ``RuntimeError`` traceback on
  each rank. Here it is one ``ConfigError`` naming the option, before any process starts (exit 2).
- ``data_parallel_size="auto"`` means the number of nodes whatever ``tensor_parallel_size`` is, so pure FSDP2
  (``tensor_parallel_size=1``) on ``devices=-1`` cannot be written down. Here ``auto`` is what is left of the world
  size: ``world_size / tensor_parallel_size`` (the same as Lightning's when ``tensor_parallel_size`` is ``auto``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy

from lit_template.errors import ConfigError
from lit_template.lightning_compat import set_threads_per_process

CHECKED_WITH = {"lightning": "2.6.6", "torch": "2.14.1"}


def resolve_mesh(data_parallel_size: Any, tensor_parallel_size: Any, num_nodes: int, devices_per_node: int) -> tuple:
    """``(data_parallel_size, tensor_parallel_size)`` as whole numbers whose product is the world size, or a
    ConfigError that names the option to change."""
    world = num_nodes * devices_per_node
    for name, value in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
        if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"trainer.strategy.{name}={value!r}: use a whole number >= 1 or 'auto'")
    tp = devices_per_node if tensor_parallel_size == "auto" else tensor_parallel_size
    if world % tp:
        raise ConfigError(
            f"trainer.strategy.tensor_parallel_size={tp} does not divide the world size {world} (trainer.num_nodes="
            f"{num_nodes} x trainer.devices={devices_per_node}): use a divisor of {world}"
        )
    dp = world // tp if data_parallel_size == "auto" else data_parallel_size
    if dp * tp != world:
        raise ConfigError(
            f"trainer.strategy.data_parallel_size={dp} x trainer.strategy.tensor_parallel_size={tp} = {dp * tp} is "
            f"not the world size {world} (trainer.num_nodes={num_nodes} x trainer.devices={devices_per_node}): set "
            f"trainer.strategy.data_parallel_size={world // tp} (or auto)"
        )
    return dp, tp


class ModelParallelStrategy(_LightningModelParallelStrategy):
    """``lightning.pytorch.strategies.ModelParallelStrategy`` (FSDP2 x tensor parallel), same arguments; the mesh
    sizes are resolved and checked when the Trainer is built (see the module docstring)."""

    def _configure_launcher(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = resolve_mesh(
            self._data_parallel_size, self._tensor_parallel_size, self.num_nodes, self.num_processes
        )
        super()._configure_launcher()

    def setup_environment(self) -> None:
        # the ranks this process did not start get their share of the CPU threads too (lightning_compat)
        set_threads_per_process(self.num_processes)
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """A sharded checkpoint is written whole or not at all.

        Lightning writes a distributed checkpoint into the existing folder (``last.ckpt`` is rewritten in place every
        time): a rank killed mid-save (preemption) would leave old and new shards mixed. Here every rank writes into
        ``.<name>.tmp``, and after a barrier rank zero swaps it in with two renames; a run stopped in between leaves
        the old folder at ``.<name>.old`` and a complete new one at ``.<name>.tmp``, never a mixed one.
        """
        if not self._save_distributed_checkpoint or "://" in str(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        tmp, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp)  # what a stopped save left behind
        self.barrier("sharded_checkpoint_tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier("sharded_checkpoint_written")
        if self.global_rank == 0:
            if path.is_dir():
                os.replace(path, old)
            elif path.exists():
                path.unlink()
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier("sharded_checkpoint_renamed")
