"""In-process tests of the pieces every run goes through: the trainer in a world of one, flat
gradient buffers and their buckets, backward's readiness hooks, and the summary's arithmetic."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import step_record
from omegaconf import OmegaConf
from torch import nn

from testbed.data import RankBatches
from testbed.netem.links import machines_of
from testbed.results.step_log import StepLog, read_step_log
from testbed.results.summary import summarize
from testbed.step_record import StepRecord
from testbed.sync import build_synchronizer
from testbed.sync.base import GradReadiness
from testbed.sync.flat import bucket_ends, busy_time
from testbed.trainer import Trainer
from testbed.world import World

pytestmark = pytest.mark.unit

MB = 2**20


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """A real Gloo process group of one rank, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield World(0, 0, 1, 1, torch.device("cpu"), "gloo", 30.0)
    dist.destroy_process_group()


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))


def data(samples: int = 64) -> RankBatches:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(samples, 6, generator=generator)
    return RankBatches(inputs, torch.randint(0, 4, (samples,), generator=generator), [8], 0, seed=0)


def sync_cfg(name: str, **extra: object) -> object:
    return OmegaConf.create({"name": name, **extra})  # the rest: the schema's defaults


def train(world: World, tmp_path: Path, name: str, steps: int, **extra: object) -> tuple[nn.Module, list[StepRecord]]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = build_synchronizer(sync_cfg(name, **extra))
    sync.setup(model, optimizer, world)
    log = StepLog(tmp_path / f"{name}.jsonl")
    records = Trainer(optimizer, sync, data(), world, log, steps).run()
    log.close()
    sync.close()
    return model, records


def plain_loop(steps: int, accumulate: int = 1) -> nn.Module:
    """The reference: PyTorch's own loop on the same batches, no testbed in between."""
    model, batches = mlp(), data()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        for micro in range(accumulate):
            inputs, targets = batches.batch(step * accumulate + micro)
            (nn.functional.cross_entropy(model(inputs), targets) / accumulate).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("name", ["allreduce", "ring", "none"])
def test_trainer_in_a_world_of_one_is_the_plain_loop(world: World, tmp_path: Path, name: str) -> None:
    model, records = train(world, tmp_path, name, steps=5)
    reference = plain_loop(5)
    for (key, p), q in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(p, q), key  # bitwise: the same kernels on the same batches
    assert [r.step for r in records] == list(range(5)) and all(r.samples == 8 for r in records)
    # The step log is what the trainer returned.
    assert read_step_log(tmp_path / f"{name}.jsonl") == [r.to_json() for r in records]
    for r in records:
        phases = r.t_data + r.t_injected + r.t_forward + r.t_backward + r.t_sync + r.t_optimizer
        assert phases == pytest.approx(r.t_step, rel=1e-6, abs=1e-6)  # the phases tile the step


def test_accumulation_in_a_world_of_one_averages_the_window(world: World, tmp_path: Path) -> None:
    model, records = train(world, tmp_path, "allreduce", steps=3, accumulate=2)
    reference = plain_loop(3, accumulate=2)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert all(r.samples == 16 for r in records)  # two micro-batches per step


def test_flat_buffers_view_the_gradients_in_buckets(world: World) -> None:
    model = nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 512), nn.Linear(512, 10))  # 4 MB of gradients
    sync = build_synchronizer(sync_cfg("ring", bucket_mb=1.5))
    sync.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), world)
    (flat,) = sync.buffers
    params = list(model.parameters())
    # Reverse registration order (backward's), every grad a view into the one buffer, no gaps.
    offset = 0
    for p in reversed(params):
        assert p.grad.data_ptr() == flat[offset:].data_ptr() and p.grad.shape == p.shape
        offset += p.numel()
    assert offset == flat.numel()
    ends = bucket_ends([p.numel() * 4 for p in reversed(params)], 1.5 * MB)
    assert [len(b.params) for b in sync.buckets] == [b - a for a, b in zip([0, *ends], ends)] and len(ends) > 1
    assert sum(b.view.numel() for b in sync.buckets) == flat.numel()
    model(torch.ones(2, 256)).sum().backward()
    assert flat.abs().sum() > 0  # backward wrote into the buffer
    sync.zero_grad()
    assert flat.abs().sum() == 0 and all(p.grad is not None for p in params)  # still views
    assert sync.describe()["buckets"] == len(sync.buckets)


def test_bucket_plan() -> None:
    # A bucket closes once it holds the cap, the first one too.
    assert bucket_ends([MB // 2] * 8, 2 * MB) == [4, 8]
    assert bucket_ends([MB // 2] * 9, 2 * MB) == [4, 8, 9]
    assert bucket_ends([MB // 2] * 8, None) == [8]  # one bucket
    assert bucket_ends([10, 20, 30], 0) == [1, 2, 3]  # one per tensor
    assert bucket_ends([3 * MB, 10, 3 * MB], 2 * MB) == [1, 3]  # a tensor over the cap closes its bucket


def test_bucket_plan_is_ddps(world: World) -> None:
    """torch's DDP given the same cap rebuilds its buckets after the first step into the same ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.Linear(512, 3))
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1.5, gradient_as_bucket_view=True)
    for _ in range(3):  # rebuilt in the forward of the second step, reported after the third
        ddp(torch.ones(2, 64)).sum().backward()
    rebuilt = [int(size) for size in ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(",")]
    sizes = [p.numel() * 4 for p in reversed(list(model.parameters()))]
    ends = bucket_ends(sizes, 1.5 * MB)
    assert [sum(sizes[a:b]) for a, b in zip([0, *ends], ends)] == rebuilt and len(rebuilt) > 1


def test_busy_time_is_the_union_of_flights() -> None:
    assert busy_time([]) == 0.0
    assert busy_time([(0.0, 1.0), (1.0, 3.0)]) == 3.0  # one after another: the sum
    assert busy_time([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]) == 4.0  # two in flight at once count once
    assert busy_time([(0.0, 4.0), (1.0, 2.0)]) == 4.0


def test_readiness_fires_each_group_once_in_backward_order() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    params = list(model.parameters())
    group = {id(p): [i // 2] for i, p in enumerate(params)}  # a layer's weight and bias per group
    fired: list[int] = []
    readiness = GradReadiness(params, lambda p: group[id(p)], 3, fired.append)
    model(torch.ones(1, 4)).sum().backward()
    assert fired == []  # not armed: accumulation micro-steps cost nothing
    for _ in range(2):
        with readiness.armed():
            model(torch.ones(1, 4)).sum().backward()
        assert fired == [2, 1, 0] and readiness.remaining == [0, 0, 0]
        fired.clear()


def record(step: int, rank: int, t_step: float, samples: int = 8) -> StepRecord:
    return step_record(step=step, rank=rank, samples=samples, loss=1.0 / (step + 1), t_forward=t_step / 2,
                       t_backward=t_step / 4, t_sync=t_step / 4, t_wait=0.0, t_comm=t_step / 8, t_step=t_step,
                       bytes_sent=100 * (rank + 1), t_encode=None, t_decode=None)


def test_summary_arithmetic() -> None:
    cfg = {"warmup_steps": 1, "world_size": 2, "steps": 4, "sync": {"name": "ring", "accumulate": 1},
           "data": {"batch_size": 8, "scaling": "weak"}}
    # Rank 1 takes twice as long per step: throughput sums each rank's own pace.
    records = [[record(s, 0, 0.1) for s in range(4)], [record(s, 1, 0.2) for s in range(4)]]
    summary = summarize(cfg, records, label="ring")
    assert summary["steps"] == 4 and summary["global_batch"] == 16
    assert summary["throughput"] == pytest.approx(8 / 0.1 + 8 / 0.2)
    assert summary["step_time"] == pytest.approx(0.2)  # a step lasts as long as its slowest rank
    assert summary["bytes_per_step"] == pytest.approx(150) and summary["bytes_per_step_total"] == 300
    assert summary["loss_first"] == 1.0 and summary["final_loss"] == 0.25
    assert summary["imbalance"] == pytest.approx(0.2 / 0.15 - 1)  # max / mean - 1 of compute
    assert summary["phases"]["t_forward"]["median"] == pytest.approx(0.075)  # warm-up step left out
    assert summary["sync_label"] == "ring" and summary["sync_bound"] is None  # no link known
    # t_comm is t_step / 8 (warm-up step 0 left out): rank 0's 0.0125 s, rank 1's 0.025 s.
    bound = summarize(cfg, records, comm_bound_s=0.01)["sync_bound"]
    assert bound == {"bound_s": 0.01, "measured_s": pytest.approx(0.01875), "fraction": pytest.approx(0.01 / 0.01875)}
    # Steps a rank did not finish are not counted for anyone.
    summary = summarize(cfg, [records[0], records[1][:3]])
    assert summary["steps"] == 3 and summary["final_loss"] == pytest.approx(1 / 3)


def test_machines_hold_contiguous_ranks_and_shards_apart_or_on_the_nodes() -> None:
    assert machines_of(4, 2, 0, "separate") is None  # flat: a link per endpoint
    assert machines_of(4, 2, 2, "separate") == {"r0": 0, "r1": 0, "r2": 1, "r3": 1, "s0": 2, "s1": 3}
    assert machines_of(6, 3, 3, "colocated") == {"r0": 0, "r1": 0, "r2": 1, "r3": 1, "r4": 2, "r5": 2, "s0": 0, "s1": 1, "s2": 2}
