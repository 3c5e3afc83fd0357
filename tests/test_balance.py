"""Balanced batches (balance=static|dynamic): the ranks' shares follow their speeds, the global
batch and its samples do not change, and training still equals one process on the concatenated batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import load_params, read_json, read_jsonl, relative_error, run_cli

from testbed.config import ConfigError
from testbed.data.batches import RankBatches
from testbed.imbalance import apportion
from testbed.preflight import check_command_line


@pytest.mark.unit
def test_resized_shares_take_every_sample_of_the_global_batch_once() -> None:
    x, y = torch.arange(50).float().unsqueeze(1), torch.arange(50)
    single = RankBatches(x, y, [12], rank=0, seed=3)
    shards = [RankBatches(x, y, [4, 4, 4], rank=r, seed=3) for r in range(3)]
    rng = random.Random(0)
    for step in range(12):
        assert torch.equal(torch.cat([s.indices(step) for s in shards]), single.indices(step))
        sizes = apportion(12, [rng.random() for _ in range(3)])
        assert sum(sizes) == 12 and min(sizes) >= 1
        for shard in shards:
            shard.resize(sizes)
    with pytest.raises(ValueError, match="summing to the global batch 12"):
        shards[0].resize([5, 5, 5])


COMMON = ["steps=8", "warmup_steps=1", "data.scaling=strong", "data.batch_size=12", "data.num_samples=40",
          "data.shape=[24]", "model.hidden=32", "launcher.echo_rank0=false"]
# Rank 2 computes at a quarter of rank 0's speed; the batches are re-decided every two steps.
BALANCED = ["world_size=3", "balance=dynamic", "balance.every=2", "imbalance=heterogeneous",
            "imbalance.speeds=[1.0,0.5,0.25]"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ref = tmp_path_factory.mktemp("balance") / "ref"
    assert run_cli(["sync=none", *COMMON, f"hydra.run.dir={ref}"], cwd=ref.parent).returncode == 0
    return ref


@pytest.mark.parametrize("sync", ["allreduce", "ring", "ps"])
def test_balanced_batches_train_the_single_process_model(tmp_path: Path, reference: Path, sync: str) -> None:
    job = tmp_path / "job"
    proc = run_cli([f"sync={sync}", *BALANCED, *COMMON, f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = [read_jsonl(job / "metrics" / f"rank{r}.jsonl") for r in range(3)]
    batches = [[log[step]["samples"] for log in logs] for step in range(8)]
    assert all(sum(b) == 12 for b in batches), batches
    assert batches[0] == [4, 4, 4] and batches[-1][0] > batches[-1][2], batches  # the slow rank's share shrank
    assert read_json(job / "summary.json")["replicas_identical"]
    assert relative_error(load_params(job), load_params(reference)) <= 1e-5


REFUSED = {
    ("balance=dynamic", "world_size=2", "sync=local_sgd"): "a rank's local steps are its own batches'",
    ("balance=dynamic", "world_size=2", "sync=ps", "sync.mode=async"): "sync.mode=async applies each push on arrival",
    ("balance=static", "world_size=3", "sync=ps", "sync.backup_workers=1"): "backup workers leave the late gradients out",
    ("balance=dynamic", "world_size=2", "sync=none"): "nothing is averaged",
    ("balance=dynamic", "world_size=2", "sync=ddp"): "its own speed is not measured",
    ("balance=dynamic", "world_size=2", "data=synthetic_images", "model=resnet18"): "its batches have a fixed size",
    ("balance=dynamic", "world_size=2", "imbalance=uneven"): "use one of them",
    ("balance=dynamic", "world_size=2", "checkpoint.every=5"): "drop one of them",
    ("balance=dynamic", "world_size=2", "balance.every=0"): "balance.every=0",
    ("balance=dynamic", "world_size=4", "data.batch_size=2", "data.scaling=strong"): "data.batch_size=2",
}


@pytest.mark.unit
@pytest.mark.parametrize("args", list(REFUSED), ids=[" ".join(a) for a in REFUSED])
def test_balance_is_refused_where_it_cannot_work(args: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line(list(args))
    assert REFUSED[args] in str(info.value)
