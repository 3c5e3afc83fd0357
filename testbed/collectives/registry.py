"""The all-reduce algorithms the testbed implements, by name: the one place a new one is added.

Each declares the function that runs it, the scratch space it wants and its alpha-beta cost
(testbed.costs). The benchmark (testbed.bench), the link calibration (testbed.sim.calibrate), the
bound (testbed.bench.bound), the tuner (testbed.tune) and sync=hierarchical's ``sync.inter`` read
this table and never list algorithm names of their own (tests/test_collective_registry.py checks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from testbed.collectives.common import Traffic
from testbed.collectives.halving_doubling import halving_doubling_allreduce_, scratch_elems
from testbed.collectives.ring import ring_allreduce_
from testbed.collectives.tree import SCRATCH_CHUNKS, tree_allreduce_
from testbed.costs import Cost, Link, halving_doubling, ring, two_tree_reduce_broadcast

Group = dist.ProcessGroup | None
TREE_CHUNK_BYTES = 512 << 10  # the tree's pipelining chunk where nothing sets one (sync=tree's default)


@dataclass(frozen=True)
class Setting:
    """What an all-reduce may use beside its buffer: the ranks it runs over (None: every rank), a
    second set of connections between the same ranks (the double tree's second tree), and the
    pipelining chunk of algorithms that pipeline."""

    group: Group = None
    second_group: Group = None
    chunk_bytes: int = TREE_CHUNK_BYTES


@dataclass(frozen=True)
class CollectiveSpec:
    """``run(buf, scratch, setting)`` sums the 1-D ``buf`` over the setting's ranks in place and
    returns this rank's traffic; ``scratch_elems(numel, n, setting)``: the scratch (float32
    elements) it reuses when given them; ``cost(n, nbytes, chunk_bytes)``: its cost as run; ``bound(n, nbytes,
    link)``: its best cost on ``link`` over the settings it has (None: ``cost`` at the default
    chunk). ``between_nodes``: sync=hierarchical may run it across nodes (``sync.inter``);
    ``stands_in``: its link fit prices an algorithm the calibration has no fit of (in table order)."""

    name: str
    run: Callable[[torch.Tensor, torch.Tensor | None, Setting], Traffic]
    scratch_elems: Callable[[int, int, Setting], int]
    cost: Callable[[int, float, float], Cost]
    bound: Callable[[int, float, Link], Cost] | None = None
    between_nodes: bool = True
    stands_in: bool = False

    def best(self, n: int, nbytes: float, link: Link) -> Cost:
        return self.bound(n, nbytes, link) if self.bound else self.cost(n, nbytes, TREE_CHUNK_BYTES)


def _native(buf: torch.Tensor, scratch: torch.Tensor | None, setting: Setting) -> Traffic:
    dist.all_reduce(buf, group=setting.group)
    n = dist.get_world_size(setting.group)
    share = 2 * (n - 1) * buf.numel() * buf.element_size() // n  # the ring's traffic, as the benchmark counts it
    return Traffic(share, share)


def _tree_chunk_elems(setting: Setting, element_size: int = 4) -> int:
    return max(1, setting.chunk_bytes // element_size)


def _tree(buf: torch.Tensor, scratch: torch.Tensor | None, setting: Setting) -> Traffic:
    return tree_allreduce_(buf, setting.group, chunk_elems=_tree_chunk_elems(setting, buf.element_size()),
                           scratch=scratch, second_group=setting.second_group)


def best_two_tree(n: int, nbytes: float, link: Link) -> Cost:
    """The two-tree all-reduce at its best chunk size (powers of two from 4 KiB to half the buffer).

    The generic double binary tree formula (2 M beta for large M) holds from n = 4 on; at n = 2 and 3
    no rank has two children and the trees move M beta, as the ring does."""
    chunk, candidates = 4096.0, []
    while True:
        candidates.append(two_tree_reduce_broadcast(n, nbytes, chunk))
        if chunk >= nbytes / 2:
            break
        chunk *= 2
    return min(candidates, key=lambda cost: cost.time(link))


_SPECS = [
    # Gloo's (or NCCL's) own all-reduce; its algorithm on CPU is a ring, and it is costed as one.
    CollectiveSpec("native", run=_native, scratch_elems=lambda numel, n, setting: 0,
                   cost=lambda n, nbytes, chunk: ring(n, nbytes), stands_in=True),
    CollectiveSpec("ring", run=lambda buf, scratch, setting: ring_allreduce_(buf, setting.group, scratch),
                   scratch_elems=lambda numel, n, setting: -(-numel // n),
                   cost=lambda n, nbytes, chunk: ring(n, nbytes), stands_in=True),
    # The double tree's second tree wants its own connections, which only its synchronizer and the
    # benchmark set up; across nodes it is not offered.
    CollectiveSpec("tree", run=_tree, scratch_elems=lambda numel, n, setting: SCRATCH_CHUNKS * _tree_chunk_elems(setting),
                   cost=two_tree_reduce_broadcast, bound=best_two_tree, between_nodes=False),
    CollectiveSpec("halving_doubling",
                   run=lambda buf, scratch, setting: halving_doubling_allreduce_(buf, setting.group, scratch),
                   scratch_elems=lambda numel, n, setting: scratch_elems(numel, n),
                   cost=lambda n, nbytes, chunk: halving_doubling(n, nbytes)),
]
COLLECTIVES: dict[str, CollectiveSpec] = {spec.name: spec for spec in _SPECS}
BETWEEN_NODES = tuple(name for name, spec in COLLECTIVES.items() if spec.between_nodes)


def collective(name: str, what: str = "impl") -> CollectiveSpec:
    """The spec of ``name``; a ValueError naming ``what`` (the field) and the choices otherwise."""
    if name not in COLLECTIVES:
        raise ValueError(f"{what}: unknown all-reduce {name!r}; allowed: {', '.join(COLLECTIVES)}")
    return COLLECTIVES[name]
