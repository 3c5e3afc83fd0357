"""Data sets and the per-rank batch stream.

The synthetic and digits data sets are pairs of tensors materialised once per rank from the seed,
so all ranks hold the same samples and no files are needed; ``RankBatches`` gives each rank its
slice of each global batch. File data sets (image folders, token files) come through a DataLoader
with the same slicing (testbed.data.loader). Either way the concatenation over ranks is exactly
the global batch a single process would draw.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from testbed.data.datasets import load_dataset, spec_for
from testbed.data.loader import ImageFolder, LoaderBatches, SyntheticImageBatches, TokenFile
from testbed.data.spec import DataSpec


class RankBatches:
    """This rank's batch of every step.

    The sample order is a concatenation of per-epoch permutations drawn from ``seed``; global batch
    ``t`` is positions ``[t*G, (t+1)*G)`` of that order, ``G = sum(sizes)``, and rank ``r`` takes
    the ``sizes[r]`` positions after those of ranks ``0..r-1`` (equal sizes unless the shards are
    uneven). Batches may straddle epochs, so every step has a full batch.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, sizes: list[int], rank: int, seed: int) -> None:
        self.inputs, self.targets = inputs, targets
        self.per_rank, self.rank, self.seed = sizes[rank], rank, seed
        self.global_batch, self.offset = sum(sizes), sum(sizes[:rank])
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs unless it exceeds the data set
                self._orders.pop(min(self._orders))
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders[epoch] = torch.randperm(len(self.inputs), generator=gen)
        return self._orders[epoch]

    def indices(self, step: int) -> torch.Tensor:
        n = len(self.inputs)
        pos = step * self.global_batch + self.offset
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


class BatchSource(Protocol):
    """What the trainer reads: batch ``i`` of the run (step * accumulate + micro-step), in order."""

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def build_data(
    cfg: Any, sizes: list[int], rank: int, seed: int, device: torch.device | str = "cpu"
) -> tuple[DataSpec, BatchSource]:
    """The data's spec and this rank's batch stream; ``sizes`` holds every rank's samples per step.

    In-memory data sets live on ``device`` (one gather per batch); file data sets come through a
    DataLoader (testbed.data.loader) and are moved by the trainer; synthetic images are one random
    batch made on ``device`` (Horovod's synthetic benchmark), so they measure no input pipeline.
    """
    spec = spec_for(cfg)
    if cfg.name == "synthetic_images":
        shape = (3, cfg.image_size, cfg.image_size)
        return spec, SyntheticImageBatches(shape, cfg.num_classes, sizes[rank], rank, seed, torch.device(device))
    if cfg.name in ("image_folder", "tokens"):
        dataset = ImageFolder(cfg.root, cfg.image_size) if cfg.name == "image_folder" else TokenFile(cfg.path, cfg.seq_len, cfg.dtype)
        pipeline = {k: cfg[k] for k in ("shuffle", "drop_last", "num_workers", "pin_memory", "persistent_workers",
                                        "prefetch_factor", "worker_start")}
        return spec, LoaderBatches(dataset, sizes, rank, seed, **pipeline)
    inputs, targets, spec = load_dataset(cfg, seed)
    return spec, RankBatches(inputs, targets, sizes, rank, seed).to(device)


__all__ = ["BatchSource", "DataSpec", "RankBatches", "build_data", "spec_for"]
