"""Alpha-beta-gamma cost of one gradient synchronization (Thakur et al. 2005; Patarasuk & Yuan 2009; nccl-tests).

A cost is kept as coefficients (messages, bytes, reduced) rather than seconds, so that
``time = messages * alpha + bytes * beta + reduced * gamma`` for any link, and calibration can fit
alpha and beta by linear least squares over the very coefficients the simulator uses.

Notation: n workers, M (``nbytes``) gradient bytes per worker, h = ceil(log2 n), beta per byte in one
direction of one full-duplex NIC; bytes are those crossing the busiest NIC in one direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """alpha: s per message; beta: s per byte (one direction of one NIC); gamma: s per byte reduced."""

    alpha: float
    beta: float
    gamma: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            if not getattr(self, name) >= 0:  # also rejects NaN
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class Cost:
    """Coefficients of alpha, beta and gamma on the critical path."""

    messages: float
    bytes: float
    reduced: float

    def time(self, link: Link) -> float:
        return self.messages * link.alpha + self.bytes * link.beta + self.reduced * link.gamma

    def __add__(self, other: Cost) -> Cost:
        """Two operations one after the other."""
        return Cost(self.messages + other.messages, self.bytes + other.bytes, self.reduced + other.reduced)


ZERO = Cost(0.0, 0.0, 0.0)


def slower(a: Link, b: Link) -> Link:
    """The link a flow through both ``a`` and ``b`` runs at: the larger of each coefficient."""
    return Link(max(a.alpha, b.alpha), max(a.beta, b.beta), max(a.gamma, b.gamma))


def ring_two_level(n: int, nodes: int, nbytes: float, intra: Link, inter: Link) -> float:
    """Seconds of a ring over n ranks numbered node by node: in each of its steps every node has
    one flow out across its uplink and the rest inside, so a step goes at the slower link's pace;
    on one machine, the intra link's."""
    return ring(n, nbytes).time(slower(intra, inter) if nodes > 1 else intra)


def shared(cost: Cost, flows: int) -> Cost:
    """``cost`` when ``flows`` operations like it cross one link at once (a node's ranks behind its
    NIC): the link carries every flow's bytes."""
    return Cost(cost.messages, cost.bytes * flows, cost.reduced)


def _check(n: int, nbytes: float) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")


def _height(n: int) -> int:
    """ceil(log2 n), exact for integers."""
    return (n - 1).bit_length()


def ring(n: int, nbytes: float) -> Cost:
    """Reduce-scatter + all-gather ring (Patarasuk & Yuan): 2(n-1) steps of M/n each."""
    _check(n, nbytes)
    share = (n - 1) / n * nbytes
    return Cost(2 * (n - 1), 2 * share, share)


def ring_allgather(n: int, nbytes: float) -> Cost:
    """The ring's all-gather alone: n-1 steps of M/n each, nothing reduced (ZeRO-3's parameter gathers)."""
    _check(n, nbytes)
    share = (n - 1) / n * nbytes
    return Cost(n - 1, share, 0.0)


def recursive_doubling(n: int, nbytes: float) -> Cost:
    """h exchanges of the whole buffer, each followed by a full reduction."""
    _check(n, nbytes)
    h = _height(n)
    return Cost(h, h * nbytes, h * nbytes)


def halving_doubling(n: int, nbytes: float) -> Cost:
    """Rabenseifner: recursive-halving reduce-scatter + recursive-doubling all-gather.

    For n not a power of 2, MPICH first folds the surplus ranks into a power of 2 and unfolds them at
    the end, one extra message and one extra full buffer each way (Thakur et al. 2005).
    """
    _check(n, nbytes)
    if n == 1:
        return ZERO
    share = (n - 1) / n * nbytes
    if n & (n - 1) == 0:
        return Cost(2 * _height(n), 2 * share, share)
    floor_lg = n.bit_length() - 1
    return Cost(2 * floor_lg + 2, 2 * share + 2 * nbytes, nbytes + share)


def binomial_tree(n: int, nbytes: float) -> Cost:
    """Binomial reduce then binomial broadcast of the whole buffer, unpipelined."""
    _check(n, nbytes)
    h = _height(n)
    return Cost(2 * h, 2 * h * nbytes, h * nbytes)


def pipelined_tree(n: int, nbytes: float, chunks: int) -> Cost:
    """Double binary tree pipelined in ``chunks`` pieces: 2(h + c)(alpha + beta M / c).

    Reduce and broadcast each take h + c - 1 chunk steps (pipeline fill, then one chunk per step);
    the cost-model document rounds that to h + c. Every element is added once on its way up.
    """
    _check(n, nbytes)
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    if n == 1:
        return ZERO
    steps = 2 * (_height(n) + chunks)
    return Cost(steps, steps * nbytes / chunks, nbytes)


def best_chunks(n: int, nbytes: float, link: Link) -> int:
    """Chunk count minimizing pipelined_tree time on ``link``, at least 1, at most one float per chunk.

    T(c) = 2(h + c)(alpha + M beta / c) is convex in c with minimum at c* = sqrt(h M beta / alpha);
    the best integer is the floor or the ceiling of c*.
    """
    _check(n, nbytes)
    most = max(1, math.floor(nbytes / 4))
    h = _height(n)
    if link.alpha == 0:
        # Without per-message cost more chunks only shorten the pipeline fill.
        return most if link.beta > 0 else 1
    ideal = math.sqrt(h * nbytes * link.beta / link.alpha)
    candidates = {min(most, max(1, c)) for c in (math.floor(ideal), math.ceil(ideal))}
    return min(sorted(candidates), key=lambda c: pipelined_tree(n, nbytes, c).time(link))


def double_binary_tree(n: int, nbytes: float, link: Link) -> Cost:
    """pipelined_tree with the chunk count best for ``link``: about 2h alpha + 2M beta + 4 sqrt(h alpha M beta)."""
    return pipelined_tree(n, nbytes, best_chunks(n, nbytes, link))


def two_tree_reduce_broadcast(n: int, nbytes: float, chunk_bytes: float) -> Cost:
    """The testbed's tree all-reduce (testbed.collectives.tree), link by link.

    Two complementary binary trees each carry half of the buffer; the reduce runs to the end, then
    the broadcast, each pipelined in chunks of ``chunk_bytes``. A rank is an inner node in one tree
    only, with k = 2 children from n = 4 on (1 below): per phase that rank's link carries its half
    k times in one direction, and the pipeline adds h - 1 chunk steps of filling. So for large M,
    2 k (M/2 + (h - 1) s) beta: about M beta at n = 2 and 2 M beta from n = 4, against the ring's
    2 (n-1)/n M beta.
    """
    _check(n, nbytes)
    if not chunk_bytes > 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    if n == 1:
        return ZERO
    half = nbytes / 2
    size = min(chunk_bytes, half) or 1.0
    steps = _height(n) - 1 + math.ceil(half / size)
    k = 2 if n >= 4 else 1
    return Cost(2 * steps, 2 * k * steps * size, k * half)


def allgather(n: int, nbytes: float) -> Cost:
    """Ring allgather of ``nbytes`` from every rank: n - 1 steps, each passing one rank's piece on.

    A non-linear codec's payloads travel this way (GRACE's allgather communicator): (n - 1) M
    bytes through each NIC, growing with n where an all-reduce's 2 (n-1)/n M does not.
    """
    _check(n, nbytes)
    return Cost(n - 1, (n - 1) * nbytes, 0.0)


def parameter_server(
    n: int, nbytes: float, servers: int = 1, colocated: bool = False, overlap_push_pull: bool = False,
    partitions: int | None = None,
) -> Cost:
    """Every worker pushes M and pulls M, split over ``servers`` (k) shards of M/k.

    Separate server machines: each server NIC carries n M / k each way, each worker NIC M, so the
    busiest NIC moves max(M, n M / k) per phase; push then pull costs two phases, overlapping them
    (BytePS, full duplex) one; overlapped over a shard's P ``partitions``, 1 + 1/P (the first
    partition's push and the last one's pull have nothing beside them; P = 1 is no overlap).
    Each server sums the n M / k bytes it receives.

    Colocated (k == n, every worker serves one shard): each NIC carries (n-1)/n M per phase each way,
    ring's bandwidth term; overlapping does not help because both phases already use both directions.
    A lone colocated worker moves nothing.
    """
    _check(n, nbytes)
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    reduced = n * nbytes / servers
    if colocated:
        if servers != n:
            raise ValueError(f"servers must equal n ({n}) when colocated, got {servers}")
        if n == 1:
            return ZERO
        return Cost(2, 2 * (n - 1) / n * nbytes, reduced)
    phases = (1 + 1 / partitions if partitions else 1) if overlap_push_pull else 2
    return Cost(2, phases * max(nbytes, n * nbytes / servers), reduced)


def algbw(nbytes: float, time_s: float) -> float:
    """Bytes per second of the operation as the user sees it (nccl-tests)."""
    if not time_s > 0:
        raise ValueError(f"time_s must be > 0, got {time_s}")
    return nbytes / time_s


def busbw(nbytes: float, time_s: float, n: int) -> float:
    """algbw * 2(n-1)/n: the per-NIC bandwidth an all-reduce this fast needs, comparable across n."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return algbw(nbytes, time_s) * 2 * (n - 1) / n
