"""BatchNorm under data parallelism: one buffer policy for every synchronizer (testbed.buffers).

Each replica normalizes with its own shard's statistics, so the reference is not one process on the
concatenated batch but one process that runs each rank's shard through the model separately
("ghost" batch norm), averages the gradients, and keeps the running statistics the policy says:
rank 0's shard's (broadcast, DDP's default) or the mean over shards (average). After several steps
at n = 3 every rank holds identical parameters and buffers, equal to that reference within 1e-5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_params, read_json, read_jsonl, relative_error, run_cli
from omegaconf import OmegaConf

from testbed.data import build_data
from testbed.models import build_model
from testbed.optim import build_optimizer

N, PER_RANK, STEPS, SEED = 3, 8, 4, 0
MODEL = ["model=resnet18", "model.width=4", "model.layers=[1,1,1,1]", "data.shape=[3,32,32]"]
COMMON = [*MODEL, f"steps={STEPS}", "warmup_steps=1", "data.scaling=strong", f"data.batch_size={N * PER_RANK}",
          "data.num_samples=96", f"world_size={N}", "launcher.echo_rank0=false", "optim.momentum=0.9", "optim.lr=0.01"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("batchnorm")
    sweeps = {
        "broadcast": ["sync=allreduce,ring,ps"],
        "local_sgd_h1": ["sync=local_sgd", "sync.period=1"],  # with SGD, exactly synchronous training
        "average": ["sync=allreduce", "buffers=average"],
        "local_sgd_h2": ["sync=local_sgd", "sync.period=2"],
    }
    jobs = {}
    for name, args in sweeps.items():
        out = root / name
        # Long override lists: the job directories' names are cut (testbed.paths.short_dirname).
        proc = run_cli(["-m", *args, *COMMON, f"hydra.sweep.dir={out}"], cwd=root, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        for summary in out.rglob("summary.json"):
            jobs[f"{read_json(summary)['sync']}-{name}"] = summary.parent
    return jobs


def reference(policy: str) -> dict[str, torch.Tensor]:
    """One process: each rank's shard through the model on its own, gradients averaged, buffers
    from rank 0's shard (broadcast) or averaged over the shards (average)."""
    cfg = OmegaConf.create({"model": {"name": "resnet18", "width": 4, "layers": [1, 1, 1, 1]},
                            "data": {"name": "synthetic", "num_samples": 96, "shape": [3, 32, 32], "num_classes": 10},
                            "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 0.0, "nesterov": False}})
    shards = [build_data(cfg.data, [PER_RANK] * N, r, SEED)[1] for r in range(N)]
    torch.manual_seed(SEED)
    model = build_model(cfg.model, build_data(cfg.data, [PER_RANK], 0, SEED)[0])
    optimizer = build_optimizer(cfg.optim, model.parameters())
    model.train()
    for step in range(STEPS):
        before = [b.clone() for b in model.buffers()]
        updated = []
        for shard in shards:
            for buf, saved in zip(model.buffers(), before):
                buf.copy_(saved)
            x, y = shard.batch(step)
            (torch.nn.functional.cross_entropy(model(x), y) / N).backward()
            updated.append([b.clone() for b in model.buffers()])
        for i, buf in enumerate(model.buffers()):
            if buf.is_floating_point():
                buf.copy_(updated[0][i] if policy == "broadcast" else torch.stack([u[i] for u in updated]).mean(0))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_against(job: Path, ref: dict[str, torch.Tensor]) -> None:
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok", summary.get("error")
    assert summary["replicas_identical"] and summary["buffers_identical"], (summary["param_hash"], summary["buffer_hash"])
    assert summary["buffers"]["synchronized_bytes"] > 0
    got = load_params(job)
    floats = [k for k, v in ref.items() if v.is_floating_point()]
    assert any("running_var" in k for k in floats)
    assert relative_error({k: got[k] for k in floats}, {k: ref[k] for k in floats}) <= 1e-5
    for key in set(ref) - set(floats):  # num_batches_tracked: every rank ran every step
        assert torch.equal(got[key], ref[key]), key


@pytest.mark.parametrize("sync", ["allreduce", "ring", "ps", "local_sgd"])
def test_broadcast_policy_matches_its_reference(runs: dict[str, Path], sync: str) -> None:
    check_against(runs[f"{sync}-local_sgd_h1" if sync == "local_sgd" else f"{sync}-broadcast"], reference("broadcast"))


def test_average_policy_matches_its_reference(runs: dict[str, Path]) -> None:
    check_against(runs["allreduce-average"], reference("average"))
    broadcast = load_params(runs["allreduce-broadcast"])
    averaged = load_params(runs["allreduce-average"])
    assert not torch.equal(broadcast["bn1.running_var"], averaged["bn1.running_var"])  # the policies differ


def test_local_sgd_buffers_agree_after_averaging(runs: dict[str, Path]) -> None:
    """Period 2: buffers are synchronized with the parameters every second step and at the end."""
    summary = read_json(runs["local_sgd-local_sgd_h2"] / "summary.json")
    assert summary["status"] == "ok"
    assert summary["replicas_identical"] and summary["buffers_identical"]
    sent = [r["bytes_sent"] for r in read_jsonl(runs["local_sgd-local_sgd_h2"] / "metrics" / "rank0.jsonl")]
    assert sent[0] == 0 and sent[1] > 0  # a local step moves nothing, an averaging step moves both
