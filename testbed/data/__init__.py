"""Data sets and the per-rank batch stream.

Each data kind (testbed.data.kinds) gives a rank its training batches and everyone the same
held-out split. In-memory data sets are tensors materialised once per rank from the seed, so all
ranks hold the same samples and no files are needed; ``RankBatches`` gives each rank its slice of
each global batch. File data sets (image folders, token files) come through a DataLoader with the
same slicing (testbed.data.loader). Either way the concatenation over ranks is exactly the global
batch a single process would draw.
"""

from __future__ import annotations

import torch

from testbed.data.batches import BatchSource, HeldOut, RankBatches
from testbed.data.kinds import DATA_KINDS, build_heldout, data_kind, heldout_of, spec_for
from testbed.data.spec import DataSpec


def build_data(
    cfg: object, sizes: list[int], rank: int, seed: int, device: torch.device | str = "cpu"
) -> tuple[DataSpec, BatchSource]:
    """The data's spec and this rank's batch stream; ``sizes`` holds every rank's samples per step.

    In-memory data sets live on ``device`` (one gather per batch); file data sets come through a
    DataLoader (testbed.data.loader) and are moved by the trainer; synthetic images are one random
    batch made on ``device`` (Horovod's synthetic benchmark), so they measure no input pipeline.
    """
    kind = data_kind(cfg.name)  # type: ignore[attr-defined]
    return kind.spec(cfg), kind.batches(cfg, sizes, rank, seed, torch.device(device))


__all__ = ["DATA_KINDS", "BatchSource", "DataSpec", "HeldOut", "RankBatches", "build_data", "build_heldout",
           "data_kind", "heldout_of", "spec_for"]
