"""Every synchronizer trains the same model as one process on the concatenated batch.

Tolerance: relative error max_tensor ||theta_n - theta_1||_inf / ||theta_1||_inf <= 1e-5 after
6 SGD-with-momentum steps (float32; only the summation order differs). All ranks must hold
bitwise-identical replicas (equal parameter hashes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import load_params, read_json, relative_error, run_cli

TOL = 1e-5
# Strong scaling with a global batch of 60: world sizes 2 to 5 all split the same batches, so
# every run must match the single world_size=1 reference.
COMMON = [
    "steps=6", "warmup_steps=1", "data.scaling=strong", "data.batch_size=60", "data.num_samples=120",
    "data.shape=[24]", "model.hidden=32", "launcher.echo_rank0=false",
]


def job_dirs(sweep: Path) -> dict[str, Path]:
    out = {}
    for d in sweep.iterdir():
        if (d / "summary.json").exists():
            s = read_json(d / "summary.json")
            out[f"{s['sync']}-{s['world_size']}"] = d
    return out


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("equivalence")
    runs = {
        "ref": ["sync=none", "world_size=1"],
        "collectives": ["-m", "sync=allreduce,ring", "world_size=2,3,4"],
        # 5 and 3 are not powers of two: their surplus ranks fold in and out.
        "halving_doubling": ["-m", "sync=halving_doubling", "world_size=2,3,4,5"],
        # 1 KiB chunks: the ~4.5 KB gradient is pipelined through each tree in several chunks.
        "tree": ["-m", "sync=tree", "sync.chunk_kb=1", "sync.double=true,false", "world_size=2,3,4"],
        # Nodes x ranks: 2 x 2 and 3 x 2 with the ring and halving-doubling across, 2 x 3 natively.
        "hierarchical": ["-m", "sync=hierarchical", "sync.ranks_per_node=2", "sync.inter=ring,halving_doubling",
                         "world_size=4,6"],
        "hierarchical_3": ["sync=hierarchical", "sync.ranks_per_node=3", "sync.inter=native", "world_size=6"],
        # BytePS-style: 2 x 2 with two server machines and with the servers on the nodes (1 KB partitions:
        # a pull streams while pushes go on); 3 x 2 with one.
        "byteps": ["-m", "sync=byteps", "sync.ranks_per_node=2", "sync.servers=0,2", "sync.partition_kb=1", "world_size=4"],
        "byteps_3": ["sync=byteps", "sync.ranks_per_node=2", "sync.servers=1", "world_size=6"],
    }
    dirs = {}
    for name, args in runs.items():
        out = root / name
        key = "hydra.sweep.dir" if "-m" in args else "hydra.run.dir"
        proc = run_cli([*args, *COMMON, f"{key}={out}"], cwd=root, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        dirs[name] = out
    return dirs


@pytest.mark.parametrize("sync", ["allreduce", "ring"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_collective_matches_single_process(sweeps: dict[str, Path], sync: str, n: int) -> None:
    job = job_dirs(sweeps["collectives"])[f"{sync}-{n}"]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok"
    assert summary["replicas_identical"], summary["param_hash"]
    assert relative_error(load_params(job), load_params(sweeps["ref"])) <= TOL


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_halving_doubling_matches_single_process(sweeps: dict[str, Path], n: int) -> None:
    job = job_dirs(sweeps["halving_doubling"])[f"halving_doubling-{n}"]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"], summary["param_hash"]
    assert relative_error(load_params(job), load_params(sweeps["ref"])) <= TOL
    # Folding moves more on the paired ranks, but the world's total is the ring's 2(n-1) gradients.
    assert summary["bytes_per_step"] == pytest.approx(2 * (n - 1) / n * summary["gradient_bytes"], rel=0.01)


def test_tree_matches_single_process(sweeps: dict[str, Path]) -> None:
    jobs = [d for d in sweeps["tree"].iterdir() if (d / "summary.json").exists()]
    assert len(jobs) == 6  # double and single tree at n = 2, 3, 4
    for job in jobs:
        summary = read_json(job / "summary.json")
        assert summary["status"] == "ok" and summary["replicas_identical"], job.name
        assert relative_error(load_params(job), load_params(sweeps["ref"])) <= TOL, job.name


def test_hierarchical_matches_single_process(sweeps: dict[str, Path]) -> None:
    jobs = [d for d in sweeps["hierarchical"].iterdir() if (d / "summary.json").exists()] + [sweeps["hierarchical_3"]]
    assert len(jobs) == 5
    for job in jobs:
        summary = read_json(job / "summary.json")
        assert summary["status"] == "ok" and summary["replicas_identical"], job.name
        assert relative_error(load_params(job), load_params(sweeps["ref"])) <= TOL, job.name
        # Per rank: the node's ring, 2 (L - 1)/L of the gradient, and across nodes 2 (N - 1)/N of its 1/L.
        facts, grad = summary["sync_facts"], summary["gradient_bytes"]
        per_node, nodes = facts["ranks_per_node"], facts["nodes"]
        assert per_node * nodes == summary["world_size"]
        expected = 2 * (per_node - 1) / per_node * grad + 2 * (nodes - 1) / nodes * grad / per_node
        assert summary["bytes_per_step"] == pytest.approx(expected, rel=0.01), job.name


def test_byteps_matches_single_process(sweeps: dict[str, Path]) -> None:
    jobs = [d for d in sweeps["byteps"].iterdir() if (d / "summary.json").exists()] + [sweeps["byteps_3"]]
    assert len(jobs) == 3
    for job in jobs:
        summary = read_json(job / "summary.json")
        assert summary["status"] == "ok" and summary["replicas_identical"], job.name
        assert relative_error(load_params(job), load_params(sweeps["ref"])) <= TOL, job.name
        # Per rank: the node's ring, 2 (L - 1)/L of the gradient, and its chunk's push, 1/L of it;
        # rank 0's shards (one per server machine) received every node's piece of its chunk each step,
        # and their sizes once.
        facts, grad = summary["sync_facts"], summary["gradient_bytes"]
        per_node, nodes, machines = facts["ranks_per_node"], facts["nodes"], facts["server_machines"]
        assert per_node * nodes == summary["world_size"] and machines == (summary["config"]["sync"]["servers"] or nodes)
        assert summary["bytes_per_step"] == pytest.approx(2 * (per_node - 1) / per_node * grad + grad / per_node, rel=0.01)
        stats = facts["server_stats"]
        steps = summary["steps_configured"]
        assert len(stats) == machines and all(s["pushes"] == nodes * steps for s in stats)
        assert sum(s["bytes_in"] for s in stats) == pytest.approx((nodes * steps + 1) * grad / per_node, rel=0.01)


def test_traffic_accounting(sweeps: dict[str, Path]) -> None:
    """Ring moves 2(n-1)/n of the gradient per rank (the bandwidth lower bound)."""
    jobs = job_dirs(sweeps["collectives"])
    for n in (2, 3, 4):
        s = read_json(jobs[f"ring-{n}"] / "summary.json")
        grad = s["gradient_bytes"]
        assert s["bytes_per_step"] == pytest.approx(2 * (n - 1) / n * grad, rel=0.01)


@pytest.mark.parametrize(
    "model_args",
    [
        ["model=cnn", "data.shape=[3,8,8]", "model.width=4", "sync=ring"],
        ["model=transformer", "data=lm", "data.seq_len=8", "data.vocab_size=32", "model.d_model=16",
         "model.n_head=2", "sync=tree", "sync.chunk_kb=4"],
    ],
    ids=["cnn-ring", "transformer-tree"],
)
def test_other_models_match_single_process(tmp_path: Path, model_args: list[str]) -> None:
    common = [a for a in COMMON if not a.startswith(("data.shape", "model.hidden"))]
    ref, par = tmp_path / "ref", tmp_path / "par"
    for out, n in ((ref, 1), (par, 3)):
        proc = run_cli([*model_args, *common, f"world_size={n}", f"hydra.run.dir={out}"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_json(par / "summary.json")["replicas_identical"]
    assert relative_error(load_params(par), load_params(ref)) <= TOL
