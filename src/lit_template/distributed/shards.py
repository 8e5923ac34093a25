"""What a rank holds of a tensor under model parallelism (DTensors), for the checks that read tensors.

Under Lightning's ``ModelParallelStrategy`` parameters and gradients are ``DTensor``s: FSDP2 shards them over the
data-parallel mesh dimension, tensor parallelism over the tensor-parallel one. A check must read the rank's own shard
(``to_local()``, no communication; an op on the DTensor itself may redistribute it, a collective only some ranks
would enter), and may compare a shard only with the ranks that hold the same shard.
"""

from __future__ import annotations

import torch


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: the local shard of a DTensor, else the tensor itself.

    Called per gradient per step (the NaN guard): the plain-tensor case costs one type check, no import statement.
    """
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def replica_key(tensor: torch.Tensor | None) -> int:
    """A number equal on exactly the ranks that must hold the same bytes of ``tensor``.

    0 for a plain tensor (a full replica on every rank). For a DTensor, 1 + this rank's coordinate along the mesh
    dimensions where it is sharded or partial: ranks that differ only along ``Replicate`` dimensions (or along
    dimensions of the world outside the tensor's mesh, e.g. the tensor-parallel peers of a parameter that only FSDP2
    shards) hold the same shard. The same tensor has the same placements on every rank, so every rank computes its
    own key the same way and the keys can be gathered and compared.
    """
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return 0
    coordinate = tensor.device_mesh.get_coordinate() or []
    sharded = [dim for dim, placement in enumerate(tensor.placements) if not isinstance(placement, Replicate)]
    if not sharded:
        return 0
    key, stride = 0, 1
    for dim in sharded:
        key += coordinate[dim] * stride
        stride *= tensor.device_mesh.size(dim)
    return 1 + key


def same_batch_ranks(strategy: object) -> int:
    """How many ranks train on each batch: the tensor-parallel size under ModelParallelStrategy, else 1."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return int(strategy.device_mesh["tensor_parallel"].size())
    return 1
