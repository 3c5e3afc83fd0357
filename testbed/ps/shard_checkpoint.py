"""A shard's checkpoints: its state after every ``checkpoint_every``-th step of the workers', written
to <checkpoint_dir>/step<step>/ps<shard>.pt beside the workers' checkpoint of that step
(testbed.checkpoint), and a shard started from one (``--restore``)."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from testbed.ps.validation import Refused

if TYPE_CHECKING:
    from testbed.ps.shard import Shard


def save_if_agreed(shard: Shard) -> None:
    """(Under the lock) save the state if this is a point the workers checkpoint at: every worker
    has pushed the same number c of steps, a multiple of checkpoint_every, and it is all applied.
    Workers meet at a barrier after such a step (testbed.checkpoint.save), so no push of a later
    step can have arrived: the state saved is the state at that step exactly, in async and SSP
    modes too, whatever the interleaving that led there."""
    c = shard.clocks[0]
    if not shard.checkpoint_every or c == 0 or c % shard.checkpoint_every or any(k != c for k in shard.clocks):
        return
    if shard.updated():
        save(shard, c - 1)


def save(shard: Shard, step: int) -> None:
    """The state after the workers' ``step``; the caller holds the lock."""
    assert shard.params is not None and shard.checkpoint_dir is not None
    target = shard.checkpoint_dir / f"step{step:07d}"
    target.mkdir(parents=True, exist_ok=True)
    state = {"shard": shard.shard, "workers": shard.workers, "mode": shard.mode, "params": shard.params.detach().clone(),
             "optimizers": [o.state_dict() for o in shard.optimizers], "version": shard.version,
             "clocks": list(shard.clocks), "histogram": dict(shard.histogram), "stats": dict(shard.stats)}
    tmp = target / f"ps{shard.shard}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, target / f"ps{shard.shard}.pt")


def restore(shard: Shard, path: Path) -> None:
    """Continue ``shard`` (before it serves) from a checkpoint written by its predecessor."""
    state = torch.load(path, weights_only=False)
    mode = state.get("mode", "sync")
    if (state["shard"], state["workers"], mode) != (shard.shard, shard.workers, shard.mode):
        raise SystemExit(f"{path}: a checkpoint of shard {state['shard']} with {state['workers']} workers in mode "
                         f"{mode}; this is shard {shard.shard} with {shard.workers}, mode {shard.mode}")
    with shard.cond:
        try:
            shard.hold(state["params"])
        except Refused as refused:
            raise SystemExit(f"{path}: {refused}") from None
        if len(state.get("optimizers", ())) != len(shard.optimizers):
            raise SystemExit(f"{path}: optimizer state for {len(state.get('optimizers', ()))} blocks, "
                             f"this shard has {len(shard.optimizers)} (same --chunk-kb as the run that wrote it)")
        for optimizer, saved in zip(shard.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)
        shard.version, shard.clocks = state["version"], list(state["clocks"])
        shard.histogram = Counter(state["histogram"])
        shard.stats = Counter(state.get("stats", {}))
