from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Traffic:
    """Bytes one rank sent and received in one collective."""

    sent: int = 0
    recv: int = 0

    def __iadd__(self, other: Traffic) -> Traffic:
        self.sent += other.sent
        self.recv += other.recv
        return self


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``parts`` contiguous ranges; the first ``numel % parts`` get one more."""
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def scratch_for(scratch: torch.Tensor | None, like: torch.Tensor, numel: int) -> torch.Tensor:
    """Reuse ``scratch`` when it is large enough and matches; otherwise allocate (once, by the caller's cache)."""
    if scratch is None or scratch.numel() < numel or scratch.dtype != like.dtype or scratch.device != like.device:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    return scratch
