"""Ring all-reduce: reduce-scatter then all-gather around a ring of n ranks (Patarasuk & Yuan).

Each rank sends and receives 2(n-1)/n of the buffer, the bandwidth lower bound for all-reduce;
latency grows as 2(n-1) messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from testbed.collectives.common import Traffic, chunk_bounds, scratch_for
from testbed.latency import link_delay


def ring_allreduce_(
    buf: torch.Tensor, group: dist.ProcessGroup | None = None, scratch: torch.Tensor | None = None
) -> Traffic:
    """Sum ``buf`` (1-D, contiguous) across ``group`` in place.

    ``scratch`` (at least ceil(numel / n) elements) is reused for received chunks when given.
    """
    traffic = ring_reduce_scatter_(buf, group, scratch)
    traffic += ring_allgather_chunks_(buf, group)
    return traffic


def ring_reduce_scatter_(
    buf: torch.Tensor, group: dist.ProcessGroup | None = None, scratch: torch.Tensor | None = None, shift: int = 1
) -> Traffic:
    """The ring's first half: afterwards rank r of ``group`` holds the full sum of chunk
    ``(r + shift) mod n`` of ``chunk_bounds(numel, n)`` (the other chunks hold partial sums). The
    all-reduce continues from shift 1, where each rank's first send is its own chunk; shift 0 leaves
    rank r its own chunk r (sharded optimizers)."""
    n, rank, right, left = _ring(group)
    traffic = Traffic()
    if n == 1:
        return traffic
    bounds = chunk_bounds(buf.numel(), n)
    tmp_all = scratch_for(scratch, buf, bounds[0][1] - bounds[0][0])
    # At step s rank r passes chunk (r + shift - 1 - s) to the right and adds chunk (r + shift - 2 - s) from the left.
    for s in range(n - 1):
        send_lo, send_hi = bounds[(rank + shift - 1 - s) % n]
        recv_lo, recv_hi = bounds[(rank + shift - 2 - s) % n]
        tmp = tmp_all[: recv_hi - recv_lo]
        _exchange(buf[send_lo:send_hi], right, tmp, left, group, traffic, buf.element_size())
        buf[recv_lo:recv_hi].add_(tmp)
    return traffic


def ring_allgather_chunks_(buf: torch.Tensor, group: dist.ProcessGroup | None = None, shift: int = 1) -> Traffic:
    """The ring's second half: from rank r holding chunk ``(r + shift) mod n`` complete (as the
    reduce-scatter of the same ``shift`` leaves it), pass the completed chunks around, received
    straight into place."""
    n, rank, right, left = _ring(group)
    traffic = Traffic()
    if n == 1:
        return traffic
    bounds = chunk_bounds(buf.numel(), n)
    for s in range(n - 1):
        send_lo, send_hi = bounds[(rank + shift - s) % n]
        recv_lo, recv_hi = bounds[(rank + shift - 1 - s) % n]
        _exchange(buf[send_lo:send_hi], right, buf[recv_lo:recv_hi], left, group, traffic, buf.element_size())
    return traffic


def ring_allgather_(buf: torch.Tensor, group: dist.ProcessGroup | None = None) -> Traffic:
    """Fill ``buf`` (1-D, n equal slots, this rank's own part in slot ``rank``) with every rank's
    part: n - 1 steps around the ring, each passing on the slot received in the step before."""
    n, rank, right, left = _ring(group)
    traffic = Traffic()
    if n == 1:
        return traffic
    slots = buf.view(n, -1)
    for s in range(n - 1):
        _exchange(slots[(rank - s) % n], right, slots[(rank - s - 1) % n], left, group, traffic, buf.element_size())
    return traffic


def _ring(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """(size, this rank, the global ranks to its right and left) of ``group``'s ring."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if group is None:
        return n, rank, (rank + 1) % n, (rank - 1) % n
    return n, rank, dist.get_global_rank(group, (rank + 1) % n), dist.get_global_rank(group, (rank - 1) % n)


def _exchange(
    send: torch.Tensor,
    dst: int,
    recv: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
    traffic: Traffic,
    esize: int,
) -> None:
    # Chunk sizes are known to both ends, so empty chunks (numel < n) are skipped on both sides.
    # The receive is posted first: Gloo holds a send until the peer's receive is posted, and with
    # both ends sending first (n = 2) the two directions of the link took turns, halving busbw.
    works = []
    if recv.numel():
        works.append(dist.irecv(recv, src, group))
        traffic.recv += recv.numel() * esize
    if send.numel():
        link_delay()
        works.append(dist.isend(send, dst, group))
        traffic.sent += send.numel() * esize
    for work in works:
        work.wait()
