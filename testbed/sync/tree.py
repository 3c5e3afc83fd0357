"""Explicit tree all-reduce, pipelined, optionally a double binary tree (testbed.collectives.tree)."""

from __future__ import annotations

from typing import Any, Optional

import torch

from testbed.collectives import tree_allreduce_
from testbed.collectives.tree import SCRATCH_CHUNKS
from testbed.sync import register
from testbed.sync.base import FlatGradSynchronizer


@register("tree")
class TreeAllReduce(FlatGradSynchronizer):
    def _chunk_elems(self, flat: torch.Tensor) -> int:
        # Capped at half the buffer (each tree's segment), so small gradients get small scratch.
        return max(1, min(self.cfg.chunk_kb * 1024 // flat.element_size(), -(-flat.numel() // 2)))

    def make_scratch(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.empty(SCRATCH_CHUNKS * self._chunk_elems(flat), dtype=flat.dtype, device=flat.device)

    def allreduce_(self, flat: torch.Tensor, scratch: Optional[torch.Tensor]) -> tuple[int, int]:
        traffic = tree_allreduce_(flat, chunk_elems=self._chunk_elems(flat), double=self.cfg.double, scratch=scratch)
        return traffic.sent, traffic.recv

    def describe(self) -> dict[str, Any]:
        kind = "double binary" if self.cfg.double else "binary"
        return {**super().describe(), "tree": kind, "chunk_kb": self.cfg.chunk_kb}
