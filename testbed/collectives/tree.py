"""Tree all-reduce: reduce to a root, then broadcast, pipelined in chunks.

With ``double=True`` two complementary binary trees each carry half of the buffer (NCCL's double
binary tree, Sanders et al. 2009): a rank that is an inner node in one tree is a leaf in the other,
so per-rank traffic stays close to the ring's while latency grows with log2(n), not n. Chunking
pipelines the levels: a rank forwards chunk c while its children send chunk c + 1, so time is
about 2(h + C)(alpha + beta M / C) for height h and C chunks instead of 2 h M beta.

Two ranks that are parent and child in one tree are often child and parent in the other, so both
directions of their connection carry a stream of chunks at once. Gloo sends a message only once
the receiver has said its receive is posted, and that word travels on the same TCP connection as
the data going the other way: queued behind megabytes of the other tree's chunks, it stalled the
sender for tens of milliseconds at a time, and the two trees took turns on the links (n = 4 over
1 Gbit: 0.69-0.82 of the bound). Given ``second_group`` (a process group over the same ranks,
hence its own connections), the second tree's messages travel there, as NCCL gives each tree its
own channel (0.80-0.88 of the bound). Running reduce and broadcast at once, as NCCL does, was
measured too and lost (0.66-0.78): from one thread, a wait for a broadcast chunk holds up the
reduce behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from testbed.collectives.common import Traffic, chunk_bounds, scratch_for
from testbed.latency import link_delay


def btree(n: int, rank: int) -> tuple[int, list[int]]:
    """(parent, children) of ``rank`` in NCCL's in-order binary tree over n ranks; root 0, parent -1.

    Odd ranks are leaves; rank r's level is its lowest set bit.
    """
    if n == 1:
        return -1, []
    bit = 1
    while bit < n and not bit & rank:
        bit <<= 1
    if rank == 0:
        return -1, [bit >> 1]
    parent = (rank ^ bit) | (bit << 1)
    if parent >= n:
        parent = rank ^ bit
    low = bit >> 1
    children = [rank - low] if low else []
    while low:
        if rank + low < n:
            children.append(rank + low)
            break
        low >>= 1
    return parent, children


def dtree(n: int, rank: int) -> list[tuple[int, list[int]]]:
    """The two trees of a double binary tree: the in-order tree, and its mirror (even n) or shift (odd n)."""
    first = btree(n, rank)
    if n % 2:
        relabel = lambda r: -1 if r == -1 else (r + 1) % n  # noqa: E731
        parent, children = btree(n, (rank - 1) % n)
    else:
        relabel = lambda r: -1 if r == -1 else n - 1 - r  # noqa: E731
        parent, children = btree(n, n - 1 - rank)
    return [first, (relabel(parent), [relabel(c) for c in children])]


# Scratch chunks: two trees x two children x two buffers (the chunk being added, the next arriving).
SCRATCH_CHUNKS = 8


@dataclass
class _Lane:
    """One tree carrying one segment of the buffer."""

    parent: int
    children: list[int]
    segment: torch.Tensor
    chunks: list[tuple[int, int]]
    tag: int  # reduce uses tag, broadcast tag + 1, so lanes and phases never match each other's messages
    group: dist.ProcessGroup | None


def tree_allreduce_(
    buf: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    chunk_elems: int = 1 << 18,
    double: bool = True,
    scratch: torch.Tensor | None = None,
    second_group: dist.ProcessGroup | None = None,
) -> Traffic:
    """Sum ``buf`` (1-D, contiguous) across ``group`` in place.

    ``scratch`` needs ``SCRATCH_CHUNKS * chunk_elems`` elements and is reused when given;
    ``second_group`` (same ranks as ``group``, see the module's docstring) carries the second tree.
    """
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    traffic = Traffic()
    if n == 1:
        return traffic
    glob = (lambda r: r if r < 0 else dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    trees = dtree(n, rank) if double and buf.numel() >= 2 else [btree(n, rank)]
    segments = [buf[lo:hi] for lo, hi in chunk_bounds(buf.numel(), len(trees))]
    lanes = []
    for i, ((parent, children), segment) in enumerate(zip(trees, segments)):
        count = max(1, -(-segment.numel() // chunk_elems))
        lane_group = second_group if i and second_group is not None else group
        lanes.append(_Lane(glob(parent), [glob(c) for c in children], segment, chunk_bounds(segment.numel(), count), 2 * i, lane_group))
    chunk_elems = min(chunk_elems, max(1, -(-buf.numel() // len(trees))))  # no chunk beyond a segment
    scratch = scratch_for(scratch, buf, SCRATCH_CHUNKS * chunk_elems)
    esize = buf.element_size()
    rounds = max(len(lane.chunks) for lane in lanes)
    # Chunks in the order every rank processes them: round-robin over the lanes.
    order = [(li, c) for c in range(rounds) for li, lane in enumerate(lanes) if c < len(lane.chunks)]
    order = [(li, c) for li, c in order if lanes[li].chunks[c][1] > lanes[li].chunks[c][0]]
    pending: list[dist.Work] = []

    def part(li: int, c: int) -> torch.Tensor:
        lo, hi = lanes[li].chunks[c]
        return lanes[li].segment[lo:hi]

    def post_reduce_recvs(li: int, c: int) -> list[tuple[dist.Work, torch.Tensor]]:
        # Double-buffered: chunk c lands in slot parity c % 2, so chunk c + 1 can arrive while c is added.
        size = part(li, c).numel()
        posted = []
        for k, child in enumerate(lanes[li].children):
            slot = scratch[((li * 2 + k) * 2 + c % 2) * chunk_elems :][:size]
            posted.append((dist.irecv(slot, child, lanes[li].group, tag=lanes[li].tag), slot))
            traffic.recv += size * esize
        return posted

    # A rank is a leaf in one tree and an inner node in the other: its leaf chunks are its own data,
    # ready now, so they all go up at once. Were they interleaved with the inner lane's waits, each
    # rank's leaf sends would wait on its peer's, and the two trees would take turns on the links.
    inner = [(li, c) for li, c in order if lanes[li].children]
    for li, c in order:
        if not lanes[li].children:
            link_delay()
            pending.append(dist.isend(part(li, c), lanes[li].parent, lanes[li].group, tag=lanes[li].tag))
            traffic.sent += part(li, c).numel() * esize

    # Reduce: add the children's chunk, pass it up without waiting for the send; the next chunk's
    # receives are posted before this one is waited for, so the links never idle between chunks.
    posted = post_reduce_recvs(*inner[0]) if inner else []
    for i, (li, c) in enumerate(inner):
        following = post_reduce_recvs(*inner[i + 1]) if i + 1 < len(inner) else []
        target = part(li, c)
        for work, slot in posted:
            work.wait()
            target.add_(slot)
        if lanes[li].parent >= 0:
            link_delay()
            pending.append(dist.isend(target, lanes[li].parent, lanes[li].group, tag=lanes[li].tag))
            traffic.sent += target.numel() * esize
        posted = following
    for work in pending:
        work.wait()
    pending.clear()

    # Broadcast: every chunk is received straight into place, so all receives are posted at once;
    # each inner chunk goes down to the children as soon as it has arrived; leaf chunks are only
    # waited for at the end, for the same reason as above.
    arriving = {}
    for li, c in order:
        if lanes[li].parent >= 0:
            arriving[li, c] = dist.irecv(part(li, c), lanes[li].parent, lanes[li].group, tag=lanes[li].tag + 1)
            traffic.recv += part(li, c).numel() * esize
    for li, c in inner:
        if (li, c) in arriving:
            arriving.pop((li, c)).wait()
        for child in lanes[li].children:
            link_delay()
            pending.append(dist.isend(part(li, c), child, lanes[li].group, tag=lanes[li].tag + 1))
            traffic.sent += part(li, c).numel() * esize
    for work in [*arriving.values(), *pending]:
        work.wait()
    return traffic
