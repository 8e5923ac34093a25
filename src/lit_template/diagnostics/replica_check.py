"""The collectives of one sync check: gather a value per tensor and rank, find what deviates, measure by how much.

``SyncCheck`` builds ``TensorGroup`` s (one kind of tensors at one point of the step) and hands them to
``ReplicaComparer.findings``; the decisions on the gathered values are ``diagnostics/replicas.py``'s.

Cost: a checksum per tensor on the tensor's own device (``checksum.py``), then one all_gather of one checksum per kind.
Only on a mismatch: a second all_gather of the per-tensor checksums to find the tensors, then, for the few tensors
reported, a broadcast of the reference rank's tensor and one all_gather of each rank's max |difference|. Every rank
makes the same decisions from the same gathered data, so every rank issues the same collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lit_template.diagnostics import checksum as cs
from lit_template.diagnostics.replicas import Deviation, Finding, TensorFinding, compare, has_peers
from lit_template.diagnostics.report import say
from lit_template.distributed.shards import local as local_shard
from lit_template.distributed.shards import replica_key


@dataclass
class TensorGroup:
    """One kind of tensors checked at one point: names, the tensors (None: absent on this rank) and their values."""

    kind: str
    names: list[str]
    tensors: list[torch.Tensor | None]
    values: torch.Tensor  # per-tensor int64 checksums, or float64 norms in tolerance mode
    like: list[torch.Tensor]  # gives shape and dtype (the parameter, for gradients and flags)
    exact: bool = False  # flags are compared exactly whatever the mode
    # model parallel: per tensor, a number equal on the ranks that hold the same shard (shards.replica_key)
    keys: list[int] | None = None


@dataclass(frozen=True)
class _ToMeasure:
    """A reported tensor whose max |difference| to the reference rank's copy is measured (only on a mismatch)."""

    group: TensorGroup
    index: int
    reference_rank: int
    finding: TensorFinding  # filled in with the measured differences


class ReplicaComparer:
    """Compares tensor groups across the ranks of the default process group.

    Args:
        world_size: ranks in the group.
        mode: ``exact`` (checksums) or ``tolerance`` (per-tensor norms within ``rtol``).
        rtol: the tolerance of ``mode=tolerance``.
        device: where the collectives run (the rank's GPU under NCCL, the CPU under gloo).
        sharded: model parallel: compare a DTensor shard only among the ranks that hold the same one.
        max_reported_tensors: tensors per check whose max |difference| is measured.
    """

    def __init__(
        self, world_size: int, mode: str, rtol: float, device: torch.device, sharded: bool, max_reported_tensors: int
    ) -> None:
        self.world_size, self.mode, self.rtol, self.device = world_size, mode, rtol, device
        self.sharded, self.max_reported_tensors = sharded, max_reported_tensors
        self.collectives = 0  # issued by the last ``findings`` call
        self._said_shards = False

    # -- building groups ----------------------------------------------------------------------------------------------
    def values(self, tensors: list[torch.Tensor | None]) -> torch.Tensor:
        return cs.checksums(tensors, self.device) if self.mode == "exact" else cs.norms(tensors, self.device)

    def group(
        self, kind: str, named: list[tuple[str, torch.Tensor | None]], like: list[torch.Tensor] | None = None
    ) -> TensorGroup:
        tensors = [t for _, t in named]
        # a DTensor is read through its own shard (an op on the DTensor itself could be a collective)
        local = [None if t is None else local_shard(t) for t in tensors]
        return TensorGroup(
            kind,
            [n for n, _ in named],
            local,
            self.values(local),
            like=like if like is not None else tensors,
            keys=[replica_key(t) for t in tensors] if self.sharded else None,
        )

    def snapshot_group(self, kind: str, named: list[tuple[str, torch.Tensor]], values: torch.Tensor) -> TensorGroup:
        """Tensors whose ``values`` were taken earlier (the buffers as the step's first forward saw them)."""
        return TensorGroup(kind, [n for n, _ in named], [t for _, t in named], values, like=[t for _, t in named])

    def flags(self, kind: str, names: list[str], flags: list[int], like: list[torch.Tensor]) -> TensorGroup:
        """0/1 per tensor (e.g. got a gradient from this rank's backward), compared exactly in either mode."""
        dtype = torch.int64 if self.mode == "exact" else torch.float64
        values = torch.tensor(flags, dtype=dtype, device=self.device)
        return TensorGroup(kind, names, [None] * len(names), values, like=like, exact=True)

    # -- comparing ----------------------------------------------------------------------------------------------------
    def findings(self, groups: list[TensorGroup], step: int, where: str) -> list[Finding]:
        """One ``Finding`` per group with deviating tensors, the same list on every rank."""
        self.collectives = 0
        findings: list[Finding] = []
        measured: list[_ToMeasure] = []
        for group, per_tensor in zip(groups, self._find_deviating(groups), strict=True):
            tensors = []
            for dev in per_tensor:
                tensor = self._tensor_finding(group, dev)
                replica = not group.keys or group.keys[dev.index] == 0  # a shard's peers differ in shape: not measured
                if group.kind != "no_local_grad" and replica and len(measured) < self.max_reported_tensors:
                    measured.append(_ToMeasure(group, dev.index, dev.reference_rank, tensor))
                tensors.append(tensor)
            if tensors:
                ranks = sorted({r for t in tensors for r in t.ranks})
                findings.append(Finding(group.kind, step, where, ranks, tensors, len(tensors)))
        if measured:
            self._measure_differences(measured)
        return findings

    @staticmethod
    def _tensor_finding(group: TensorGroup, dev: Deviation) -> TensorFinding:
        like, ranks = group.like[dev.index], dev.ranks
        if group.kind == "no_local_grad":
            # name the ranks without a gradient, whichever side the majority is on
            ranks = [r for r, flag in enumerate(dev.values) if flag == 0]
        dtype = str(like.dtype).removeprefix("torch.")
        return TensorFinding(group.names[dev.index], list(like.shape), dtype, ranks, dev.reference_rank)

    def _find_deviating(self, groups: list[TensorGroup]) -> list[list[Deviation]]:
        """Per group, each tensor that differs across ranks (the decisions: ``diagnostics/replicas.py``)."""
        if self.sharded:
            return self._find_deviating_shards(groups)
        result: list[list[Deviation]] = [[] for _ in groups]
        if self.mode == "exact":
            # One collective for all kinds checked here: one combined checksum per kind and rank.
            gathered = self._all_gather(torch.stack([cs.combine(g.values) for g in groups]))
            differ = [i for i in range(len(groups)) if not bool((gathered[:, i] == gathered[0, i]).all())]
            if not differ:
                return result
            # Only on a mismatch: which tensors (the same groups on every rank, since `gathered` is the same).
            rows = self._all_gather(torch.cat([groups[i].values for i in differ])).tolist()
        else:
            # Tolerance mode: norms do not add up to one exact value, so the one gather carries the per-tensor norms.
            differ = list(range(len(groups)))
            rows = self._all_gather(torch.cat([g.values.to(torch.float64) for g in groups])).tolist()
        offset = 0
        for i in differ:
            exact = self.mode == "exact" or groups[i].exact
            for j in range(len(groups[i].names)):
                column = [row[offset + j] for row in rows]
                reference, ranks = compare(column, exact, self.rtol)
                if ranks:
                    result[i].append(Deviation(j, reference, ranks, column))
            offset += len(groups[i].names)
        return result

    def _find_deviating_shards(self, groups: list[TensorGroup]) -> list[list[Deviation]]:
        """Model parallel: per tensor, compare the ranks holding the same shard (one all_gather of values and keys)."""
        values = torch.cat([g.values for g in groups])
        keys = torch.tensor([k for g in groups for k in g.keys or [0] * len(g.names)], device=values.device)
        rows = self._all_gather(torch.stack([values, keys.to(values.dtype)])).tolist()  # (world, 2, n)
        result: list[list[Deviation]] = []
        offset, compared, total = 0, 0, 0
        for group in groups:
            found = []
            exact = self.mode == "exact" or group.exact
            for j in range(len(group.names)):
                column = [row[0][offset + j] for row in rows]
                key_column = [row[1][offset + j] for row in rows]
                total += 1
                compared += has_peers(key_column)
                reference, ranks = compare(column, exact, self.rtol, key_column)
                if ranks:
                    found.append(Deviation(j, reference, ranks, column))
            result.append(found)
            offset += len(group.names)
        if not self._said_shards:
            self._said_shards = True
            rank_zero_only(say)(
                f"sync check: model parallel: {compared} of {total} tensors have a copy of their shard on another "
                "rank and are compared there; the others are sharded over every rank (nothing to compare)",
                logging.INFO,
            )
        return result

    def _measure_differences(self, measured: list[_ToMeasure]) -> None:
        """Max |value - reference| on every rank for the reported tensors: one broadcast each, then one all_gather."""
        diffs = torch.zeros(len(measured), dtype=torch.float64, device=self.device)
        for k, m in enumerate(measured):
            local = m.group.tensors[m.index]
            local = torch.zeros_like(m.group.like[m.index]) if local is None else local.detach()  # no grad: zeros
            reference = local.clone()
            dist.broadcast(reference, src=m.reference_rank)
            self.collectives += 1
            if local.numel():
                diffs[k] = (local.to(torch.float64) - reference.to(torch.float64)).abs().max().to(diffs.device)
        by_rank = self._all_gather(diffs).tolist()
        for k, m in enumerate(measured):
            found = m.finding
            found.max_abs_diff_by_rank = {r: by_rank[r][k] for r in found.ranks}
            found.max_abs_diff = max(found.max_abs_diff_by_rank.values(), default=0.0)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(world_size, *tensor.shape)``: every rank's tensor."""
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        self.collectives += 1
        return torch.stack(parts)
