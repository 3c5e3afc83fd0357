"""Overlapped buckets average every gradient, those backward reached and those it did not; the
overlap benchmark compares the testbed's all-reduce with DDP on equal work."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import read_json, run_cli, sync_config
from torch import nn

from testbed.launch.spawn import spawn_world
from testbed.sync import build_synchronizer
from testbed.world import World


class Branchy(nn.Module):
    """Uses ``b`` only while ``use_b``: a window whose last micro-step does not reach b's gradients."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.a(x)
        if self.use_b:
            x = x + self.b(x)
        return self.c(x).square().sum()


def window(model: Branchy, rank: int, sync=None) -> None:
    """One accumulation window of two micro-steps, b used in the first only."""
    for micro, use_b in enumerate((True, False)):
        boundary = micro == 1
        model.use_b = use_b
        x = torch.arange(8, dtype=torch.float32).view(2, 4) * (rank + 1) / 8 + micro
        if sync is None:
            model(x).backward()
            continue
        with sync.micro_step(boundary):
            model(x).backward()
        sync.after_backward(0, is_boundary=boundary)


def overlap_rank(names: list[str]) -> dict[str, float]:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    world = World(rank, rank, n, n, torch.device("cpu"), "gloo", 60.0)
    # What every rank's window adds up to, computed here for all of them without communication.
    expected = [torch.zeros_like(p) for p in Branchy().parameters()]
    for r in range(n):
        local = Branchy()
        window(local, r)
        for e, p in zip(expected, local.parameters()):
            e += p.grad / n
    errors = {}
    for name in names:
        model = Branchy()
        cfg = sync_config(name, accumulate=2, bucket_mb=0, overlap=True, chunk_kb=512, double=True)
        sync = build_synchronizer(cfg)
        sync.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), world)
        window(model, rank, sync)
        errors[name] = max(float((p.grad - e).abs().max()) for p, e in zip(model.parameters(), expected))
        sync.close()
    dist.destroy_process_group()
    return errors


@pytest.mark.parametrize("n", [2, 3])
def test_overlap_averages_gradients_backward_did_not_reach(tmp_path: Path, n: int) -> None:
    names = ["allreduce", "ring", "tree", "halving_doubling"]
    results = spawn_world(overlap_rank, (names,), n, tmp_path / "logs")
    for rank, errors in results.items():
        assert set(errors) == set(names)
        for name, error in errors.items():
            assert error < 1e-6, f"rank {rank} {name}: {error}"


def test_overlap_benchmark_compares_equal_work(tmp_path: Path) -> None:
    out = tmp_path / "overlap.json"
    proc = run_cli(["model.hidden=32", "model.depth=2", "data.batch_size=8", "steps=4", "warmup_steps=1",
                    "--repeats", "1", "--bucket-mb", "0.001", "--out", str(out)], cwd=tmp_path, module="testbed.bench.overlap")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = read_json(out)
    assert result["max_param_diff"] < 1e-5  # DDP and the testbed trained the same model
    assert all(len(result["step_s"][name]) == 1 for name in ("allreduce", "ddp")) and result["ratio"] > 0
    assert result["allreduce_describe"]["overlap"] and result["allreduce_describe"]["buckets"] > 1
    assert "ratio" in proc.stdout and "ddp" in proc.stdout
