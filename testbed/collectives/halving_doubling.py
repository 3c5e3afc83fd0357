"""Halving-doubling all-reduce: recursive-halving reduce-scatter, then recursive-doubling all-gather.

Rabenseifner's algorithm as MPICH runs it (Thakur, Rabenseifner & Gropp 2005, "Optimization of
collective communication operations in MPICH", section 4.4). For n a power of two each rank sends
and receives 2(n-1)/n of the buffer, as in the ring, in 2 log2 n messages instead of 2(n-1).

Other n fold first: with p the largest power of two <= n and r = n - p, ranks 2i and 2i+1 (i < r)
pair up, the even one sends its whole buffer to the odd one, which adds it; the odd ranks and the
last n - 2r ranks run the power-of-two algorithm, and the odd ranks send the result back to their
even neighbour at the end. That is 2 log2 p + 2 messages on the critical path and one extra buffer
each way for the 2r folded ranks (testbed.costs.halving_doubling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from testbed.collectives.common import Traffic, chunk_bounds, scratch_for
from testbed.latency import link_delay


@dataclass(frozen=True)
class Step:
    """One exchange with ``peer`` (a group rank): send ``buf[send]``, receive into ``buf[recv]``,
    or, with ``reduce``, into scratch and add it there. Empty ranges are skipped on both ends."""

    peer: int
    send: tuple[int, int]
    recv: tuple[int, int]
    reduce: bool


def _fold(n: int) -> tuple[int, int]:
    """(p, r): the largest power of two <= n and the surplus n - p."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p


def schedule(numel: int, n: int, rank: int) -> list[Step]:
    """The exchanges ``rank`` makes, in order; both ends of each agree on the sizes."""
    if n == 1:
        return []
    p, r = _fold(n)
    none, whole = (0, 0), (0, numel)
    if rank < 2 * r and rank % 2 == 0:  # folded out: hand the buffer over, get the result back
        return [Step(rank + 1, whole, none, False), Step(rank + 1, none, whole, False)]
    vrank = rank // 2 if rank < 2 * r else rank - r  # rank among the p that run the power-of-two part
    real = lambda v: 2 * v + 1 if v < r else v + r  # noqa: E731
    blocks = chunk_bounds(numel, p)  # vrank ends the reduce-scatter owning blocks[vrank]
    span = lambda lo, hi: (blocks[lo][0], blocks[hi - 1][1])  # noqa: E731  element range of blocks lo..hi-1
    lo, hi, mask, halving = 0, p, p >> 1, []
    while mask:  # distance halving: the partner differs in bit log2(mask); keep the half on our side
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if vrank & mask else ((lo, mid), (mid, hi))
        halving.append(Step(real(vrank ^ mask), span(*give), span(*keep), True))
        lo, hi = keep
        mask >>= 1
    # All-gather: the same partners in reverse order, each sending what it holds of the pair's segment.
    doubling = [Step(s.peer, s.recv, s.send, False) for s in reversed(halving)]
    steps = halving + doubling
    if rank < 2 * r:
        steps = [Step(rank - 1, none, whole, True), *steps, Step(rank - 1, whole, none, False)]
    return steps


def scratch_elems(numel: int, n: int) -> int:
    """Scratch elements the all-reduce needs at ``n`` ranks: the largest chunk any rank receives to
    add, half the buffer (rounded up to whole blocks) for powers of two, the whole buffer otherwise."""
    if n == 1:
        return 0
    p, r = _fold(n)
    return numel if r else chunk_bounds(numel, p)[p // 2 - 1][1]


def halving_doubling_allreduce_(
    buf: torch.Tensor, group: dist.ProcessGroup | None = None, scratch: torch.Tensor | None = None
) -> Traffic:
    """Sum ``buf`` (1-D, contiguous) across ``group`` in place.

    ``scratch`` (at least ``scratch_elems(numel, n)`` elements) is reused for received chunks when given.
    """
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    traffic = Traffic()
    if n == 1:
        return traffic
    glob = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    tmp_all = scratch_for(scratch, buf, scratch_elems(buf.numel(), n))
    esize = buf.element_size()
    for step in schedule(buf.numel(), n, rank):
        send, target = buf[step.send[0] : step.send[1]], buf[step.recv[0] : step.recv[1]]
        recv = tmp_all[: target.numel()] if step.reduce else target
        works = []
        # Receive posted first: Gloo holds a send until the peer's receive is posted (see ring.py).
        if recv.numel():
            works.append(dist.irecv(recv, glob(step.peer), group))
            traffic.recv += recv.numel() * esize
        if send.numel():
            link_delay()
            works.append(dist.isend(send, glob(step.peer), group))
            traffic.sent += send.numel() * esize
        for work in works:
            work.wait()
        if step.reduce and recv.numel():
            target.add_(recv)
    return traffic
