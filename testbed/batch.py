"""Batch sizes from the config: what one rank computes per micro-step, and what one step averages."""

from __future__ import annotations

from typing import Any

from testbed.checks import enum_value


def per_rank_batch(cfg: Any) -> int:
    """Weak scaling: data.batch_size per rank; strong: data.batch_size split over the ranks."""
    if enum_value(cfg.data.scaling) == "strong":
        return int(cfg.data.batch_size) // int(cfg.world_size)
    return int(cfg.data.batch_size)


def global_batch(cfg: Any) -> int:
    """Samples per optimizer step over all ranks and accumulation micro-steps."""
    return per_rank_batch(cfg) * int(cfg.world_size) * int(cfg.sync.accumulate)
