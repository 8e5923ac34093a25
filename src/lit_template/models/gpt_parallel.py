"""Tensor parallelism and FSDP2 for :class:`~lit_template.models.gpt_net.GPTNet` on a 2-D device mesh.

Lightning's ``ModelParallelStrategy`` builds the mesh ``(data_parallel, tensor_parallel)`` and hands it to
``LightningModule.configure_model``; what to split and how is the model's business, and it is here:

- tensor parallel (inside a node, the fast links): in every block q/k/v and the MLP up-projection are column-parallel
  (each rank computes ``n_head / tp`` heads and ``1 / tp`` of the MLP's hidden units), the attention output
  projection and the MLP down-projection are row-parallel (one all-reduce per sub-layer in the forward, one in the
  backward). The embeddings, LayerNorms and the tied LM head stay whole on every tensor-parallel rank (small, and
  the tying survives). With ``sequence_parallel`` the LayerNorms and residual dropouts work on a slice of the
  sequence instead, and each all-reduce becomes an all-gather + reduce-scatter (less activation memory, the same
  communication volume).
- FSDP2 (``fully_shard``) over the data-parallel dimension: one unit per block and one for the root (embeddings, final
  LayerNorm, head), so only one block's parameters are gathered at a time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from lit_template.errors import ConfigError


def parallelize_gpt(net: nn.Module, mesh: object, n_head: int, sequence_parallel: bool = False) -> nn.Module:
    """Apply tensor parallelism over ``mesh["tensor_parallel"]``, then FSDP2 over ``mesh["data_parallel"]``."""
    from torch.distributed.device_mesh import DeviceMesh

    assert isinstance(mesh, DeviceMesh)
    tp_mesh, dp_mesh = mesh["tensor_parallel"], mesh["data_parallel"]
    tp = tp_mesh.size()
    if n_head % tp:
        raise ConfigError(
            f"trainer.strategy.tensor_parallel_size={tp} does not divide model.n_head={n_head}: tensor parallelism "
            f"gives each rank n_head / tensor_parallel_size heads; use a divisor of {n_head}"
        )
    if tp > 1:
        apply_tensor_parallel(net, tp_mesh, sequence_parallel)
    if dp_mesh.size() > 1:
        apply_fsdp(net, dp_mesh)
    return net


def apply_tensor_parallel(net: nn.Module, tp_mesh: object, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if not sequence_parallel:
        # the block's input and output are whole tensors on every TP rank; only the linears are split
        plan = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }
        for block in net.blocks:
            parallelize_module(block, tp_mesh, plan)
        return
    # sequence parallel: the residual stream between blocks is a DTensor sharded on the sequence (dim 1); each
    # sub-layer gathers the sequence for its column-parallel linears and reduce-scatters back after the row-parallel
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "ln_1": SequenceParallel(),
        "attn": gather,
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ln_2": SequenceParallel(),
        "mlp": gather,
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    for block in net.blocks:
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(
        net,
        tp_mesh,
        {
            # the embeddings' output (whole on every rank) becomes a sequence shard without communication
            "blocks.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=False
            ),
            "ln_f": SequenceParallel(use_local_output=False),
            # the tied head is whole on every rank: gather the sequence back for it
            "lm_head": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        },
    )


def apply_fsdp(net: nn.Module, dp_mesh: object) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block, mesh=dp_mesh)
    # the root unit holds the embeddings, ln_f and the tied head (one parameter for wte and lm_head)
    fully_shard(net, mesh=dp_mesh)


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale gradients so that their global 2-norm is at most ``max_norm``; returns the norm before clipping.

    Works when the gradients are DTensors on different meshes (and plain tensors): each tensor's norm is made a plain
    number first (``full_tensor`` reduces a sharded norm across its mesh), which torch's ``clip_grad_norm_`` cannot
    do because it stacks the DTensor norms together.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    squares = []
    for g in grads:
        n = torch.linalg.vector_norm(g)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        squares.append(n.float() ** 2)
    total = torch.stack(squares).sum().sqrt()
    # no host sync (a GPU would wait): the factor stays a tensor; a non-finite norm leaves non-finite gradients,
    # which the nonfinite_guard callback reports
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            local = g.to_local() if isinstance(g, DTensor) else g
            local.mul_(coef.to(local.device, local.dtype))
    return total
