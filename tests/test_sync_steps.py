"""What synchronizers count and when they meet: DDP's bytes under PowerSGD with frozen parameters
(a real world of two ranks), and local SGD's averaging steps, which the simulator reads too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from testbed.launch.spawn import spawn_world
from testbed.sync import SYNCHRONIZERS, build_synchronizer
from testbed.sync.local_sgd import averages_at
from testbed.world import World, close_world, init_world

POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "min_compression_rate": 2.0,
            "use_error_feedback": True, "warm_start": True}


def ddp_powersgd_steps(steps: int) -> list[tuple[int, int]]:
    """(bytes sent, elements PowerSGD sent) of each step, on this rank, of a model whose first
    layer is frozen (fine-tuning's head-only training)."""
    world = init_world("cpu", "gloo", 30.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    model[0].requires_grad_(False)
    sync = build_synchronizer(OmegaConf.create({"name": "ddp", "accumulate": 1, "bucket_mb": 25.0, "hook": "powersgd",
                                                "powersgd": POWERSGD}))
    sync.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), world)
    counted, before = [], 0
    for step in range(steps):
        sync.module(torch.randn(4, 64)).square().mean().backward()
        report = sync.after_backward(step)
        after = sync.powersgd.total_numel_after_compression
        counted.append((report.bytes_sent, after - before))
        before = after
        sync.zero_grad()
    sync.close()
    dist.barrier()  # as a run ends (its final gather): a group torn down under a peer still in it aborts that peer
    close_world()
    return counted


def test_ddp_powersgd_bytes_count_the_trainable_parameters_only(tmp_path: Path) -> None:
    counted = spawn_world(ddp_powersgd_steps, (4,), 2, tmp_path / "logs")[0]
    compressed = [(sent, elements) for sent, elements in counted if elements]
    assert compressed, counted
    # A ring all-reduce of the compressed elements in fp32 between two ranks: each sends half, 4 bytes each.
    assert all(sent == 2 * (2 - 1) * elements * 4 // 2 for sent, elements in compressed), counted


@pytest.mark.unit
def test_local_sgd_reports_local_steps_where_its_schedule_says(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sync_cfg = OmegaConf.create({"name": "local_sgd", "accumulate": 1, "period": 3, "sync_steps": 2,
                                     "over": "allreduce"})
        model = nn.Linear(4, 2)
        sync = build_synchronizer(sync_cfg)
        sync.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), World(0, 0, 1, 1, torch.device("cpu"), "gloo", 30.0))
        met = []
        for step in range(10):
            model(torch.randn(3, 4)).sum().backward()
            met.append(sync.after_backward(step).replicas_agree is not False)
            sync.zero_grad()
        sync.close()
    finally:
        dist.destroy_process_group()
    assert met == [averages_at(sync_cfg, step) for step in range(10)]
    assert met == [True, True, False, False, True, False, False, True, False, False]  # 2 warm-up steps, then every 3rd
    # The simulator's schedule is the same rule, read from the whole config.
    meets = SYNCHRONIZERS["local_sgd"].sim.meets
    assert [meets(OmegaConf.create({"sync": sync_cfg}), step) for step in range(10)] == met
