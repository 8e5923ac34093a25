"""Exact, on-device checksums of tensors, and the majority vote that names the ranks that differ.

A tensor's checksum is its bytes viewed as integers of the element's width, widened to int64 and summed with odd
position weights (``2 * i + 1``), wrapping modulo 2**64. Flipping bit ``b`` of one element changes the sum by
``2**b * odd``, which is never 0 modulo 2**64, so any single bit flip is caught; moving a value to another position
changes it too. Computed in chunks on the tensor's own device: no CPU copy and bounded scratch memory.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

# int dtype of the same width, to read a tensor's bits as integers
_BITS_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# elements per chunk: bounds the scratch memory to a few times 8 * CHUNK bytes whatever the tensor's size
CHUNK = 1 << 22


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """The position-weighted int64 sum of ``tensor``'s bits, as a 0-dim int64 tensor on its device."""
    flat = tensor.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    flat = flat.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_BITS_DTYPE[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), CHUNK):
        # out of place: for 64-bit dtypes `.to(int64)` is a view of the tensor itself
        chunk = bits[start : start + CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=flat.device).mul_(2).add_(1)
        total += (chunk * weights).sum()
    return total


def combine(checksums: torch.Tensor) -> torch.Tensor:
    """One checksum for a 1-d int64 tensor of per-tensor checksums (order-sensitive, any single change shows)."""
    if checksums.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=checksums.device)
    weights = torch.arange(checksums.numel(), dtype=torch.int64, device=checksums.device).mul_(2).add_(1)
    return (checksums * weights).sum()


def checksums(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Per-tensor checksums as one 1-d int64 tensor on ``device``; a missing tensor (None) counts as 0."""
    out = torch.zeros(len(tensors), dtype=torch.int64, device=device)
    for i, tensor in enumerate(tensors):
        if tensor is not None:
            out[i] = tensor_checksum(tensor).to(device)
    return out


def norms(tensors: Sequence[torch.Tensor | None], device: torch.device) -> torch.Tensor:
    """Per-tensor L2 norms in float64 on ``device`` (tolerance mode); a missing tensor counts as 0."""
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    for i, tensor in enumerate(tensors):
        if tensor is not None:
            out[i] = tensor_norm(tensor).to(device)
    return out


def tensor_norm(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.is_floating_point() or t.is_complex():
        return torch.linalg.vector_norm(t, dtype=torch.complex128 if t.is_complex() else torch.float64).real
    return torch.linalg.vector_norm(t.to(torch.float64))


def majority(values: Sequence) -> tuple[int, list[int]]:
    """``(reference_rank, deviating_ranks)`` for one value per rank.

    The reference is the value most ranks hold (ties go to the value of the lowest rank), so with 3 or more ranks a
    bad rank 0 is the one named; with 2 ranks that disagree, rank 0 is the reference.
    """
    counts = Counter(values)
    best = max(counts.values())
    reference_rank = next(r for r, v in enumerate(values) if counts[v] == best)
    reference = values[reference_rank]
    return reference_rank, [r for r, v in enumerate(values) if v != reference]


def majority_within(values: Sequence[float], rtol: float) -> tuple[int, list[int]]:
    """Like :func:`majority` for norms: values agree when their relative difference is at most ``rtol``."""

    def close(a: float, b: float) -> bool:
        return a == b or abs(a - b) <= rtol * max(abs(a), abs(b))

    support = [sum(close(v, w) for w in values) for v in values]
    reference_rank = support.index(max(support))
    reference = values[reference_rank]
    return reference_rank, [r for r, v in enumerate(values) if not close(v, reference)]
