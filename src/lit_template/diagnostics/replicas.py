"""What the sync check finds, and how it decides it: records and the comparison of gathered values.

No collectives and no Trainer here: the callback gathers one value per tensor and rank (a checksum, or a norm in
tolerance mode; with model parallelism also a replica key per tensor) and these functions say which ranks deviate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lit_template.diagnostics import checksum as cs

WHAT = {
    "grad_mismatch": "gradients differ",
    "param_mismatch": "parameters differ",
    "buffer_mismatch": "buffers differ",
    "no_local_grad": "no gradient from this rank's backward",
}


class ReplicaDivergenceError(RuntimeError):
    """Raised on every rank by ``on_mismatch=raise`` when gradients or parameters differ across ranks."""


@dataclass
class TensorFinding:
    """One tensor that differs across replicas: which ranks disagree with the majority, and by how much."""

    name: str
    shape: list[int]
    dtype: str
    ranks: list[int]
    reference_rank: int
    # max |value - reference| on each deviating rank, worst first; None where not measured (over the report limit)
    max_abs_diff: float | None = None
    max_abs_diff_by_rank: dict[int, float] = field(default_factory=dict)


@dataclass
class Finding:
    """One check that found replicas out of sync: a record of ``reports/sync_check.jsonl``."""

    kind: str
    global_step: int
    where: str
    ranks: list[int]
    tensors: list[TensorFinding]
    num_tensors: int

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def sentence(self) -> str:
        named = ", ".join(
            f"{t.name} on rank {','.join(map(str, t.ranks))}"
            + (f" (max |diff| {t.max_abs_diff:.3g})" if t.max_abs_diff is not None else "")
            for t in self.tensors[:3]
        )
        more = f" and {self.num_tensors - 3} more" if self.num_tensors > 3 else ""
        return (
            f"sync check: {WHAT[self.kind]} across ranks at global step {self.global_step} ({self.where}): "
            f"rank(s) {', '.join(map(str, self.ranks))} deviate in {self.num_tensors} tensor(s): {named}{more}."
        )


@dataclass(frozen=True)
class Deviation:
    """A tensor whose checksum (or norm) differs across ranks, from the gathered values."""

    index: int  # in its group of tensors
    reference_rank: int  # a rank of the majority
    ranks: list[int]  # the ranks that differ from it
    values: list  # the gathered value of every rank


def compare(values: Sequence, exact: bool, rtol: float, keys: Sequence | None = None) -> tuple[int, list[int]]:
    """``(reference_rank, deviating_ranks)`` of one tensor from its value on every rank (``-1, []``: all agree).

    The reference is the majority (see ``checksum.majority``); ``exact``: values must be equal, else within ``rtol``.
    ``keys`` (model parallel): only ranks with the same key hold the same shard, so each such set of ranks is
    compared on its own; a rank alone with its key has nothing to be compared with.
    """
    peers: dict[Any, list[int]] = {}
    for rank, key in enumerate(keys if keys is not None else [0] * len(values)):
        peers.setdefault(key, []).append(rank)
    reference, deviating = -1, []
    for members in peers.values():
        if len(members) < 2:
            continue
        sub = [values[r] for r in members]
        ref, bad = cs.majority(sub) if exact else cs.majority_within(sub, rtol)
        if bad and reference < 0:
            reference = members[ref]
        deviating += [members[b] for b in bad]
    return reference, sorted(deviating)


def has_peers(keys: Sequence) -> bool:
    """Whether at least two ranks hold the same shard (see :func:`compare`)."""
    return len(set(keys)) < len(keys)


# kinds that mean the replicas train different models; the others are warnings and never raise or stop
SEVERE = ("grad_mismatch", "param_mismatch")
METRICS = {
    "grad_mismatch": "sync/grad_mismatches",
    "param_mismatch": "sync/param_mismatches",
    "buffer_mismatch": "sync/buffer_mismatches",
    "no_local_grad": "sync/no_local_grad_params",
}


class Tally:
    """What the sync check found: totals over the run (kept in checkpoints) and the current step's (``sync/*``)."""

    def __init__(self) -> None:
        self.checks = 0
        self.findings = {kind: 0 for kind in WHAT}  # checks that found each kind
        # tensors compared so far, per kind (a check that never ran shows 0 here, not a clean bill)
        self.tensors_checked = {kind: 0 for kind in WHAT}
        self.said: set[str] = set()  # findings already said on the console
        self.step_counts: dict[str, int] = {}
        self.step_ms = 0.0

    def add(self, checked: dict[str, int], findings: list[Finding]) -> list[Finding]:
        """Counts one check (``checked``: tensors per kind); returns the findings not said before, to say now."""
        self.checks += 1
        for kind, n in checked.items():
            self.tensors_checked[kind] += n
        for kind in WHAT:
            self.step_counts.setdefault(kind, 0)
        new = []
        for finding in findings:
            self.step_counts[finding.kind] += finding.num_tensors
            self.findings[finding.kind] += 1
            signature = f"{finding.kind}:{[(t.name, t.ranks) for t in finding.tensors]}"
            if signature not in self.said:  # one sentence per distinct finding; repeats go to the file and metrics
                self.said.add(signature)
                new.append(finding)
        return new

    def take_step(self) -> dict[str, float]:
        """The current step's ``sync/*`` metrics (tensors found per kind, ``sync/check_ms``); starts the next step."""
        metrics = {METRICS[k]: float(v) for k, v in self.step_counts.items()}
        metrics["sync/check_ms"] = self.step_ms
        self.step_counts, self.step_ms = {}, 0.0
        return metrics

    def stopped(self, on_mismatch: str) -> bool:
        return on_mismatch == "stop" and any(self.findings[k] for k in SEVERE)

    def summary(self, step: int, world_size: int, active: bool, options: dict[str, Any]) -> dict[str, Any]:
        """The record of ``reports/sync_check.json``: what was checked and found over the run."""
        return {
            "kind": "sync_check_summary",
            "global_step": step,
            "ranks": list(range(world_size)),
            "active": active,
            **options,
            "checks": self.checks,
            "findings": self.findings,
            "tensors_checked": self.tensors_checked,
            "stopped": self.stopped(options["on_mismatch"]),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "checks": self.checks,
            "findings": dict(self.findings),
            "said": sorted(self.said),
            "tensors_checked": dict(self.tensors_checked),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.checks = state.get("checks", 0)
        self.findings.update(state.get("findings", {}))
        self.tensors_checked.update(state.get("tensors_checked", {}))
        self.said = set(state.get("said", []))
