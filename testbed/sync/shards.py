"""Model state cut into units, each partitioned evenly by elements over the ranks (ZeRO).

A unit is a group of parameters laid out in one flat buffer, reduce-scattered and all-gathered as
one collective: a bucket of the model's parameters for ZeRO stages 1 and 2, a layer for stage 3.
Rank r owns chunk r of every unit (``chunk_bounds``: sizes differ by at most one element), so a
rank's shard is the same share of every unit and no single large tensor unbalances the ranks.
Collectives are the testbed's ring, so emulated links and their costs apply.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from testbed.collectives.common import Traffic, chunk_bounds
from testbed.collectives.ring import ring_allgather_chunks_, ring_reduce_scatter_

OWN = 0  # ring shift: the reduce-scatter leaves rank r chunk r, the all-gather starts from it


@dataclass
class Unit:
    """Parameters reduced and gathered together: ``params[i]`` is elements ``offsets[i]`` to
    ``offsets[i + 1]`` of the unit's flat layout, of which this rank owns ``own``."""

    params: list[nn.Parameter]
    offsets: list[int]
    own: tuple[int, int]
    shard: nn.Parameter | None = None  # what this rank's optimizer steps (None: an empty chunk)
    full: torch.Tensor | None = field(default=None, repr=False)  # the unit's flat parameters
    at: int = 0  # where the unit starts in the model's flat buffers (stages 1 and 2)

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    @property
    def shard_numel(self) -> int:
        return self.own[1] - self.own[0]


def make_unit(params: list[nn.Parameter], rank: int, world_size: int) -> Unit:
    offsets = list(itertools.accumulate((p.numel() for p in params), initial=0))
    return Unit(params, offsets, chunk_bounds(offsets[-1], world_size)[rank])


def stage_grads(unit: Unit) -> torch.Tensor:
    """The unit's gradients copied into one new flat buffer (zeros for a parameter backward did not
    reach), and each parameter's own gradient freed: from here the unit's is the only copy."""
    staged = torch.empty(unit.numel, dtype=unit.params[0].dtype, device=unit.params[0].device)
    for p, lo, hi in zip(unit.params, unit.offsets, unit.offsets[1:]):
        if p.grad is None:
            staged[lo:hi].zero_()
        else:
            staged[lo:hi].copy_(p.grad.reshape(-1))
            p.grad = None
    return staged


def reduce_scatter_(flat: torch.Tensor, scratch: torch.Tensor | None = None) -> Traffic:
    """Sum ``flat`` across ranks into this rank's own chunk (the others hold partial sums)."""
    return ring_reduce_scatter_(flat, scratch=scratch, shift=OWN)


def all_gather_(flat: torch.Tensor) -> Traffic:
    """Fill ``flat`` with every rank's chunk, from this rank's own chunk in place."""
    return ring_allgather_chunks_(flat, shift=OWN)


def free_(tensor: torch.Tensor) -> None:
    """Give back the memory of ``tensor``'s storage; every view of it stays, and is filled again by
    ``refill_``."""
    tensor.untyped_storage().resize_(0)


def refill_(tensor: torch.Tensor) -> None:
    """Give ``tensor``'s storage its memory back (its contents undefined until written)."""
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


def is_free(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().nbytes() == 0


@dataclass
class Moved:
    """One collective: bytes this rank sent and received, and when it ran (time.perf_counter)."""

    sent: int
    recv: int
    start: float
    end: float


class Comm:
    """Where the collectives run, in the order they are issued, each timed: on one communication
    thread, so that one may be issued ahead of its use (a prefetch) while the step goes on, or
    inline. ``drain`` hands over what ran since the last drain."""

    def __init__(self, thread: bool) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero-comm") if thread else None
        self._moved: list[Moved] = []

    def run(self, job: Callable[[], Traffic]) -> Future[None]:
        if self._pool is not None:
            return self._pool.submit(self._timed, job)
        done: Future[None] = Future()
        done.set_result(self._timed(job))
        return done

    def _timed(self, job: Callable[[], Traffic]) -> None:
        start = time.perf_counter()
        traffic = job()
        self._moved.append(Moved(traffic.sent, traffic.recv, start, time.perf_counter()))

    def drain(self) -> list[Moved]:
        moved, self._moved = self._moved, []
        return moved

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
