"""Explicit collectives give exact sums for odd sizes and any world size, over real Gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from testbed.collectives import btree, dtree, ring_allreduce_, tree_allreduce_
from testbed.launch.spawn import spawn_world

SIZES = [1, 2, 3, 5, 17, 1000, 4099]


def exactness_rank(sizes: list[int]) -> list[tuple[str, int, bool, int, int]]:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    algorithms = {
        "ring": lambda b: ring_allreduce_(b),
        "tree": lambda b: tree_allreduce_(b, chunk_elems=7),
        "tree-single": lambda b: tree_allreduce_(b, chunk_elems=5, double=False),
        "tree-one-chunk": lambda b: tree_allreduce_(b, chunk_elems=1 << 20),
    }
    out = []
    for numel in SIZES:
        base = torch.arange(numel, dtype=torch.float32) % 1000
        for name, run in algorithms.items():
            buf = base * (rank + 1) + rank  # different on every rank; sums stay exact in float32
            traffic = run(buf)
            expected = base * (n * (n + 1) / 2) + n * (n - 1) / 2
            out.append((name, numel, torch.equal(buf, expected), traffic.sent, traffic.recv))
    dist.destroy_process_group()
    return out


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
        for name in ("ring", "tree", "tree-single"):
            assert total(name, numel, 3) == total(name, numel, 4) > 0  # every byte sent is received
        # Ring: each chunk travels n-1 hops in reduce-scatter and n-1 in all-gather: 2(n-1)/n of the
        # buffer per rank, the bandwidth lower bound.
        assert total("ring", numel, 3) == 2 * (n - 1) * numel * 4
        # A tree moves each element once up and once down each of its n-1 edges; the double tree
        # does that for each half in its own tree.
        for name in ("tree", "tree-single"):
            assert total(name, numel, 3) == 2 * (n - 1) * numel * 4


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
