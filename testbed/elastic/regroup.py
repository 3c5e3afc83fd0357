"""What a rank rebuilds for a new membership (testbed.elastic.membership), and its batches after it.

``elastic.batch`` says what a membership of n workers trains on:
- ``keep_global``: the same global batch, split evenly (every size from ``elastic.min_workers`` to
  ``world_size`` must divide it), so the run is the uninterrupted run's, within float tolerance;
- ``keep_local``: the same batch per worker, so the global batch follows the membership and the
  learning rate follows the scaling rule (``optim.lr_scaling``) for it.

Either way the sample order goes on where the last membership left it (testbed.data.batches), so
no sample is taken twice or left out.
"""

from __future__ import annotations

from typing import Any

from testbed.batch import per_rank_batch
from testbed.buffers import BufferSync
from testbed.data import data_kind
from testbed.elastic.membership import Membership
from testbed.eval.evaluate import Evaluator
from testbed.eval.schedule import LrSchedule, schedule_of
from testbed.imbalance import loss_weight
from testbed.sync import Synchronizer
from testbed.world import World


class Regrouper:
    """A rank's parts that follow the membership: the synchronizer over the new group, the
    buffers' and the evaluation's view of the world, and the batches."""

    def __init__(self, cfg: Any, membership: Membership, sync: Synchronizer, data: Any, buffers: BufferSync,
                 evaluator: Evaluator | None) -> None:
        self.cfg, self.membership, self.sync, self.data = cfg, membership, sync, data
        self.buffers, self.evaluator = buffers, evaluator
        self.world = membership.world

    def rebuild(self, world: World, epoch: int) -> int | None:
        """Set the parts up over membership ``epoch``'s group; the synchronizer's step to go on from
        (None: the one after the commit the members restore)."""
        self.world = world
        resume = self.sync.regroup(world, epoch)
        if self.sync.replicas_hold_state:
            self.membership.arm()
        self.buffers.world_size = world.world_size
        if self.evaluator is not None:
            self.evaluator.world = world
        return resume

    def resumed(self, step: int, newcomer: bool = False) -> tuple[float, LrSchedule]:
        """The batches from ``step`` on, the new membership's first; this rank's loss weight and the
        learning-rate schedule. Where the membership admitted newcomers (``newcomer``: this rank is
        one), worker 0 hands them the sample order's segments so far."""
        if newcomer or self.membership.timeline[-1].get("joined"):
            self.data.segments = self.membership.shared(self.data.segments)
        return batches_from(self.cfg, self.data, self.world, step)


def batches_from(cfg: Any, data: Any, world: World, step: int) -> tuple[float, LrSchedule]:
    """``world``'s batches from ``step`` on (elastic.batch), this rank's loss weight, and the
    schedule: under keep_local the scaling rule's for the global batch it makes."""
    n, k = world.world_size, int(cfg.sync.accumulate)
    sizes = [per_rank_batch(cfg)] * n if cfg.elastic.batch == "keep_local" else even_shares(
        per_rank_batch(cfg) * int(cfg.world_size), n)
    data.rebatch(step * k, sizes, world.rank)
    schedule = schedule_of(cfg, data_kind(cfg.data.name).train_size(cfg.data), global_batch=sum(sizes) * k)
    return loss_weight(sizes, world.rank), schedule


def even_shares(global_batch: int, n: int) -> list[int]:
    """A membership's batches under keep_global: the global batch split evenly among its ``n`` workers."""
    return [global_batch // n] * n
