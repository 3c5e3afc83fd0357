"""Two nodes on one machine: two torchrun invocations (one rank each) rendezvous into one world and
run one job, with all-reduce and with parameter servers started apart, as on a cluster."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import SGD, cli_env, read_json, read_jsonl

from testbed.ps.launch import LocalServers
from testbed.ps.wire import TOKEN_ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes=2`` twice, node 0 hosting the rendezvous, both started at once."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id={run_id}", "--rdzv_conf=timeout=120",
             f"--log-dir={cwd / f'node{node}-logs'}", "-m", "testbed", *args],
            cwd=cwd, env={**cli_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def test_two_torchrun_nodes_join_one_world(tmp_path: Path) -> None:
    job = tmp_path / "job"
    nodes = two_nodes(["world_size=2", "sync=ring", "steps=6", "warmup_steps=1", "device=cpu", f"hydra.run.dir={job}"], tmp_path)
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["replicas_identical"]
    assert len(read_jsonl(job / "metrics" / "rank1.jsonl")) == 6  # node 1's rank wrote into the shared job dir


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_nodes_share_parameter_servers_started_apart(tmp_path: Path, mode: str) -> None:
    cfg = {"servers": 2, "mode": mode, "staleness": 2, "chunk_kb": 1024, "host": "127.0.0.1"}
    with LocalServers(cfg, SGD, 2, tmp_path / "ps-logs") as ps:  # as `python -m testbed.ps.server` on a third host
        job = tmp_path / "job"
        nodes = two_nodes(["world_size=2", "sync=ps", f"sync.mode={mode}", "sync.servers=2", "optim.momentum=0",
                           f"optim.lr={SGD['lr']}", f"sync.addresses=[{','.join(ps.addresses)}]", "steps=6",
                           "warmup_steps=1", "device=cpu", f"hydra.run.dir={job}"],
                          tmp_path, env={TOKEN_ENV: ps.token})
    for node in nodes:
        assert node.returncode == 0, node.stderr[-3000:]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2
    shards = summary["sync_facts"]["server_stats"]
    assert [s["pushes"] for s in shards] == [12, 12]  # 2 workers x 6 steps on each shard
    assert [s["rejected"] for s in shards] == [0, 0]
