"""What the trainer and the evaluator read: a rank's batch stream, and a held-out split."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.utils.data import Dataset


class BatchSource(Protocol):
    """What the trainer reads: batch ``i`` of the run (step * accumulate + micro-step), in order."""

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class RankBatches:
    """This rank's batch of every step.

    The sample order is a concatenation of per-epoch permutations drawn from ``seed``; global batch
    ``t`` is positions ``[t*G, (t+1)*G)`` of that order, ``G = sum(sizes)``, and rank ``r`` takes
    the ``sizes[r]`` positions after those of ranks ``0..r-1`` (equal sizes unless the shards are
    uneven). Batches may straddle epochs, so every step has a full batch. A global batch that
    changes (elastic.batch=keep_local) starts a segment: from its first batch on, the batches of
    the new size continue the order where the old ones left it.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, sizes: list[int], rank: int, seed: int) -> None:
        self.inputs, self.targets = inputs, targets
        self.rank, self.seed = rank, seed
        # (first batch, its first position, global batch) of each segment, in order
        self.segments: list[tuple[int, int, int]] = [(0, 0, sum(sizes))]
        self.resize(sizes)
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def global_batch(self) -> int:
        """The current segment's: samples per step over all ranks."""
        return self.segments[-1][2]

    def resize(self, sizes: list[int], rank: int | None = None) -> None:
        """From the next batch on, every rank's samples per step are ``sizes`` (balance=..., or a new
        membership, where this rank is ``rank`` of ``len(sizes)``): the ranks' shares change, the
        global batch and its samples do not, so no sample is taken twice or left out."""
        if rank is not None:
            self.rank = rank
        if sum(sizes) != self.global_batch or min(sizes) < 1:
            raise ValueError(f"batch sizes {sizes}: each >= 1, summing to the global batch {self.global_batch}")
        self.per_rank, self.offset = sizes[self.rank], sum(sizes[: self.rank])

    def rebatch(self, first: int, sizes: list[int], rank: int) -> None:
        """From batch ``first`` on, every rank's samples per step are ``sizes`` and this rank is
        ``rank`` of ``len(sizes)``, whatever the global batch becomes (elastic.batch=keep_local).
        Segments from ``first`` on are replaced (a membership that rolled back redoes them), so the
        order goes on from batch ``first``'s position, with no sample taken twice or left out."""
        start = self.position(first)
        self.segments = [s for s in self.segments if s[0] < first] + [(first, start, sum(sizes))]
        self.resize(sizes, rank)

    def position(self, i: int) -> int:
        """Where global batch ``i`` begins in the sample order."""
        first, start, size = next(s for s in reversed(self.segments) if s[0] <= i)
        return start + (i - first) * size

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs unless it exceeds the data set
                self._orders.pop(min(self._orders))
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders[epoch] = torch.randperm(len(self.inputs), generator=gen)
        return self._orders[epoch]

    def indices(self, step: int) -> torch.Tensor:
        n = len(self.inputs)
        pos = self.position(step) + self.offset
        end = pos + self.per_rank
        parts = []
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(end - pos, n - offset)
            parts.append(self._order(epoch)[offset : offset + take])
            pos += take
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def to(self, device: torch.device) -> RankBatches:
        """Keep the data set on ``device`` (it is small), so a batch is one gather with no host copy."""
        self.inputs, self.targets = self.inputs.to(device), self.targets.to(device)
        return self

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.indices(step).to(self.inputs.device, non_blocking=True)
        return self.inputs[idx], self.targets[idx]

    def describe(self) -> dict[str, Any]:
        # Batches straddle epochs here, so an epoch is a fractional number of steps.
        return {"samples": len(self.inputs), "steps_per_epoch": len(self.inputs) / self.global_batch}

    def close(self) -> None:
        """Nothing to release: the data set is two tensors."""


class HeldOut(Protocol):
    """A held-out split: its size, and the samples at some positions, stacked."""

    def __len__(self) -> int: ...

    def take(self, positions: range) -> tuple[torch.Tensor, torch.Tensor]: ...


class TensorHeldOut:
    """An in-memory held-out split: two tensors."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __len__(self) -> int:
        return len(self.inputs)

    def take(self, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[positions.start : positions.stop], self.targets[positions.start : positions.stop]


class DatasetHeldOut:
    """A held-out split read from files (a map-style data set), sample by sample."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def take(self, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = zip(*(self.dataset[i] for i in positions))
        return torch.stack(inputs), torch.as_tensor(targets) if not torch.is_tensor(targets[0]) else torch.stack(targets)
