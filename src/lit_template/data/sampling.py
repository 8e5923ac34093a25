"""A training loader that resumes mid-epoch where it stopped, with the same batches on every rank.

Lightning saves the ``state_dict()`` of a training DataLoader that has one in every checkpoint (the fit loop's
``combined_loader`` state) and loads it back before the resumed epoch's first batch. :class:`ResumableDataLoader`
gives it one: the epoch and the number of batches it has handed to the loop. On resume its
:class:`ResumableSampler` leaves those batches' indices out of that epoch, so the loop gets exactly the batches an
uninterrupted run would have got next; no sample is loaded to be skipped.

The sampler is a ``DistributedSampler`` (shuffled by ``seed + epoch``, sharded by the trainer's data-parallel rank), so
Lightning keeps it instead of putting in its own, and a 1-process run sees the same order as
``torch.randperm(n, seed + epoch)``. The loader draws its base seed from a generator of its own rather than the
global RNG, so building an iterator on resume does not shift the random numbers dropout draws next (the global RNG is
restored by the ``rng_state`` callback).

Exact with ``num_workers=0``, or with workers whose transforms are deterministic per sample: a worker's own RNG
restarts with the iterator.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` whose next iteration of a given epoch can leave out the first indices."""

    def __init__(
        self, dataset: Dataset, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self._resume: tuple[int, int] | None = None  # (epoch, indices to leave out)

    def resume_at(self, epoch: int, consumed: int) -> None:
        """The next iteration, if it is of ``epoch``, starts after its first ``consumed`` indices."""
        self.set_epoch(epoch)
        self._resume = (epoch, consumed)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self._resume is not None:
            epoch, consumed = self._resume
            self._resume = None
            # the checkpoint was taken at an epoch's last batch: Lightning starts the next epoch, whole
            if epoch == self.epoch:
                indices = indices[consumed:]
        return iter(indices)


class ResumableDataLoader(DataLoader):
    """A DataLoader with ``state_dict()``: which epoch, and how many batches it has given the loop in it.

    Takes a :class:`ResumableSampler` as ``sampler`` (and the DataLoader's other arguments); ``drop_last`` must be
    false, so that ``batches * batch_size`` indices is where the next batch starts.
    """

    def __init__(self, dataset: Dataset, *args: Any, sampler: ResumableSampler, **kwargs: Any) -> None:
        if kwargs.get("drop_last"):
            raise ValueError("ResumableDataLoader needs drop_last=False")
        kwargs.setdefault("generator", torch.Generator().manual_seed(sampler.seed))
        super().__init__(dataset, *args, sampler=sampler, **kwargs)
        self._batches = 0  # handed to the loop in the current epoch

    def __iter__(self) -> Iterator[Any]:
        # Lightning's fit loop does not prefetch from a loader with a length: what is handed out is what was used
        resumed = self.sampler._resume is not None and self.sampler._resume[0] == self.sampler.epoch
        self._batches = self.sampler._resume[1] // self.batch_size if resumed else 0
        for batch in super().__iter__():
            self._batches += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": int(self.sampler.epoch), "batches": int(self._batches)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.resume_at(int(state["epoch"]), int(state["batches"]) * int(self.batch_size))


class EvalSampler(DistributedSampler):
    """Validation/test shard of this rank: indices ``rank, rank + world, ...`` in order, without padding.

    Lightning's own ``DistributedSampler`` for evaluation pads the last round with repeated samples so every rank
    gets as many (and warns that ``trainer.test()`` then counts some samples twice). Here every sample is evaluated
    exactly once across the ranks; ranks may get one batch more or less, which is safe because evaluation has no
    gradient all-reduce and the metrics are torchmetrics objects synced once at the epoch's end.
    """

    def __init__(self, dataset: Dataset, num_replicas: int = 1, rank: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = len(range(rank, len(dataset), num_replicas))  # type: ignore[arg-type]
        self.total_size = len(dataset)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total_size, self.num_replicas))
