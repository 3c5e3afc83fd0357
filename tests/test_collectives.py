"""Explicit collectives give exact sums for odd sizes and any world size, over real Gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from testbed.collectives import btree, dtree, halving_doubling_allreduce_, ring_allreduce_, tree_allreduce_
from testbed.collectives.halving_doubling import schedule, scratch_elems
from testbed.launch.spawn import spawn_world

SIZES = [1, 2, 3, 5, 17, 1000, 4099]


def exactness_rank(sizes: list[int]) -> list[tuple[str, int, bool, int, int]]:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    second = dist.new_group()
    algorithms = {
        "ring": lambda b: ring_allreduce_(b),
        "tree": lambda b: tree_allreduce_(b, chunk_elems=7),
        "tree-two-groups": lambda b: tree_allreduce_(b, chunk_elems=7, second_group=second),
        "tree-single": lambda b: tree_allreduce_(b, chunk_elems=5, double=False),
        "tree-one-chunk": lambda b: tree_allreduce_(b, chunk_elems=1 << 20),
        "halving_doubling": lambda b: halving_doubling_allreduce_(b),
    }
    out = []
    for numel in SIZES:
        base = torch.arange(numel, dtype=torch.float32) % 1000
        for name, run in algorithms.items():
            buf = base * (rank + 1) + rank  # different on every rank; sums stay exact in float32
            traffic = run(buf)
            expected = base * (n * (n + 1) / 2) + n * (n - 1) / 2
            out.append((name, numel, torch.equal(buf, expected), traffic.sent, traffic.recv))
    # Halving-doubling at sizes around n and one large odd size, through one scratch reused for all
    # of them (left dirty by the previous call) and sized by scratch_elems for the largest.
    scratch = torch.full((scratch_elems(HD_LARGE, n),), float("nan"))
    for numel in hd_sizes(n):
        base = torch.arange(numel, dtype=torch.float32) % 1000
        buf = base * (rank + 1) + rank
        traffic = halving_doubling_allreduce_(buf, scratch=scratch)
        expected = base * (n * (n + 1) / 2) + n * (n - 1) / 2
        out.append(("halving_doubling-scratch", numel, torch.equal(buf, expected), traffic.sent, traffic.recv))
    dist.destroy_process_group()
    return out


HD_LARGE = 1000003


def hd_sizes(n: int) -> list[int]:
    return sorted({0, n - 1, n + 1, 2 * n - 1, HD_LARGE})


def hd_bytes(n: int, rank: int, numel: int) -> int:
    """Bytes halving-doubling sends (and receives) at ``rank`` when p divides numel."""
    p = 1 << (n.bit_length() - 1)
    r = n - p
    share = 2 * (p - 1) * numel // p
    if rank < 2 * r:
        return 4 * (numel if rank % 2 == 0 else numel + share)
    return 4 * share


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_exact_sums(tmp_path: Path, n: int) -> None:
    results = spawn_world(exactness_rank, (SIZES,), n, tmp_path / "logs")
    assert len(results) == n
    for rank, rows in results.items():
        wrong = [(name, numel) for name, numel, ok, _, _ in rows if not ok]
        assert not wrong, f"rank {rank}: inexact sums for {wrong}"
    def total(name: str, numel: int, field: int) -> int:
        return sum(r[field] for rows in results.values() for r in rows if r[0] == name and r[1] == numel)

    for numel in SIZES:
        for name in ("ring", "tree", "tree-single", "halving_doubling"):
            assert total(name, numel, 3) == total(name, numel, 4) > 0  # every byte sent is received
        # Ring: each chunk travels n-1 hops in reduce-scatter and n-1 in all-gather: 2(n-1)/n of the
        # buffer per rank, the bandwidth lower bound.
        assert total("ring", numel, 3) == 2 * (n - 1) * numel * 4
        # A tree moves each element once up and once down each of its n-1 edges; the double tree
        # does that for each half in its own tree.
        for name in ("tree", "tree-single"):
            assert total(name, numel, 3) == 2 * (n - 1) * numel * 4
        # Halving-doubling moves the same in total (folding adds 2r buffers, the power-of-two part
        # 2(p-1)), but unevenly when n is not a power of two: the folded pairs carry the extra.
        assert total("halving_doubling", numel, 3) == 2 * (n - 1) * numel * 4
        p = 1 << (n.bit_length() - 1)
        if numel % p == 0:
            for rank, rows in results.items():
                (row,) = [r for r in rows if r[:2] == ("halving_doubling", numel)]
                assert row[3] == row[4] == hd_bytes(n, rank, numel), (rank, numel, row)
    for numel in hd_sizes(n):
        assert total("halving_doubling-scratch", numel, 3) == total("halving_doubling-scratch", numel, 4)
        assert total("halving_doubling-scratch", numel, 3) == 2 * (n - 1) * numel * 4


def simulate_halving_doubling(n: int, numel: int) -> tuple[list[list[int]], dict[int, int]]:
    """Run every rank's schedule on Python lists, each exchange once both ends have reached it (a
    deadlock or a size mismatch fails); return the final buffers and each rank's largest reduced chunk."""
    steps = [schedule(numel, n, rank) for rank in range(n)]
    for rank in range(n):  # exchanges with nothing either way are skipped by the implementation too
        steps[rank] = [s for s in steps[rank] if s.send[1] > s.send[0] or s.recv[1] > s.recv[0]]
    bufs = [[(i % 1000) * (rank + 1) + rank for i in range(numel)] for rank in range(n)]
    at, largest = [0] * n, {rank: 0 for rank in range(n)}
    while any(at[r] < len(steps[r]) for r in range(n)):
        progressed = False
        for a in range(n):
            if at[a] == len(steps[a]):
                continue
            sa = steps[a][at[a]]
            b = sa.peer
            if b <= a or at[b] == len(steps[b]) or steps[b][at[b]].peer != a:
                continue
            sb = steps[b][at[b]]
            assert sa.send[1] - sa.send[0] == sb.recv[1] - sb.recv[0], (n, numel, a, sa, b, sb)
            assert sb.send[1] - sb.send[0] == sa.recv[1] - sa.recv[0], (n, numel, a, sa, b, sb)
            to_b, to_a = bufs[a][slice(*sa.send)], bufs[b][slice(*sb.send)]
            for rank, step, data in ((a, sa, to_a), (b, sb, to_b)):
                lo, hi = step.recv
                if step.reduce:
                    largest[rank] = max(largest[rank], hi - lo)
                    data = [x + y for x, y in zip(bufs[rank][lo:hi], data)]
                bufs[rank][lo:hi] = data
            at[a] += 1
            at[b] += 1
            progressed = True
        assert progressed, f"n={n}, numel={numel}: deadlock at steps {at}"
    return bufs, largest


@pytest.mark.parametrize("n", list(range(1, 18)))
def test_halving_doubling_schedule(n: int) -> None:
    # In-process: the schedule alone, for world sizes the Gloo test does not spawn (6, 7, 9 ...).
    p = 1 << (n.bit_length() - 1)
    for numel in sorted({0, 1, n - 1, n, n + 1, 2 * p + 3, 100}):
        bufs, largest = simulate_halving_doubling(n, numel)
        expected = [(i % 1000) * n * (n + 1) // 2 + n * (n - 1) // 2 for i in range(numel)]
        assert all(b == expected for b in bufs), (n, numel)
        assert max(largest.values()) == (scratch_elems(numel, n) if numel else 0), (n, numel, largest)
        messages = max(len(schedule(numel, n, r)) for r in range(n))
        log_p = p.bit_length() - 1
        assert messages == 2 * log_p + (2 if n > p else 0)


@pytest.mark.parametrize("n", list(range(1, 40)))
def test_binary_tree_is_a_tree(n: int) -> None:
    nodes = {r: btree(n, r) for r in range(n)}
    roots = [r for r, (parent, _) in nodes.items() if parent == -1]
    assert roots == [0]
    for r, (parent, children) in nodes.items():
        assert len(children) <= 2 and len(set(children)) == len(children)
        for c in children:
            assert nodes[c][0] == r, f"n={n}: {c} lists parent {nodes[c][0]}, not {r}"
        if parent != -1:
            assert r in nodes[parent][1]
    depth = {0: 0}
    frontier = [0]
    while frontier:
        r = frontier.pop()
        for c in nodes[r][1]:
            depth[c] = depth[r] + 1
            frontier.append(c)
    assert len(depth) == n  # connected
    assert max(depth.values()) <= max(1, (n - 1).bit_length())  # logarithmic height


@pytest.mark.parametrize("n", list(range(2, 40)))
def test_double_tree_trees_are_complementary(n: int) -> None:
    trees = [dtree(n, r) for r in range(n)]
    for t in (0, 1):
        nodes = {r: trees[r][t] for r in range(n)}
        assert sum(1 for p, _ in nodes.values() if p == -1) == 1
        for r, (_, children) in nodes.items():
            for c in children:
                assert nodes[c][0] == r
    inner_both = [r for r in range(n) if trees[r][0][1] and trees[r][1][1]]
    # NCCL's construction: no rank is an inner node of both trees, except, for odd n, rank 0, the
    # root of the first tree, which has a single child there.
    assert set(inner_both) <= ({0} if n % 2 else set()), (n, inner_both)
