"""The CUDA path (NCCL, CUDA-event timing, bf16 autocast). Skipped without a GPU; run by scripts/gpu_check.sh."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import load_params, read_json, read_jsonl, relative_error, run_cli
from omegaconf import OmegaConf
from torch import nn

from testbed.sync import build_synchronizer
from testbed.timing import stamp, stamp_seconds
from testbed.world import World

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SMALL = ["steps=8", "warmup_steps=2", "model.hidden=64", "data.num_samples=256", "launcher.echo_rank0=false"]


def test_cuda_run_with_nccl_matches_cpu(tmp_path: Path) -> None:
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    for out, device in ((gpu, "cuda"), (cpu, "cpu")):
        proc = run_cli([f"device={device}", "sync=allreduce", *SMALL, f"hydra.run.dir={out}"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(gpu / "summary.json")
    assert summary["backend"] == "nccl" and summary["device"].startswith("cuda")
    assert summary["cuda_peak_bytes"][0] > 0
    # Kernels differ between CPU and GPU (summation order), not the training: a loose tolerance.
    assert relative_error(load_params(gpu), load_params(cpu)) < 1e-3
    for r in read_jsonl(gpu / "metrics" / "rank0.jsonl"):
        assert all(r[f"t_{p}"] >= 0 for p in ("data", "forward", "backward", "sync", "optimizer"))


# Each on data it learns within 30 steps at the default learning rate (the CNN on the default
# synthetic data does not, on CPU either), so that the loss's fall is a signal, not noise.
@pytest.mark.parametrize("model", [["model=mlp"], ["model=cnn", "data=digits"], ["model=transformer", "data=lm"]])
def test_bf16_autocast_trains(tmp_path: Path, model: list[str]) -> None:
    out = tmp_path / "job"
    proc = run_cli(["device=cuda", "precision=bf16", *model, "steps=30", "warmup_steps=5", f"hydra.run.dir={out}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["final_loss"] < summary["loss_first"]


def test_nccl_refuses_more_ranks_than_gpus(tmp_path: Path) -> None:
    ranks = torch.cuda.device_count() + 1
    proc = run_cli(["device=cuda", "backend=nccl", f"world_size={ranks}", f"hydra.run.dir={tmp_path / 'job'}"],
                   cwd=tmp_path)
    assert proc.returncode == 2
    assert "backend=nccl needs one CUDA GPU per local rank" in proc.stderr
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("shards", [[], ["sync.servers=2", "sync.overlap=true"]], ids=["one_shard", "two_shards_overlap"])
def test_ps_shares_one_gpu_between_two_ranks_and_matches_cpu(tmp_path: Path, shards: list[str]) -> None:
    """More ranks than GPUs: NCCL is refused (above), but the parameter server stages through host
    memory, so two ranks share the GPU under gloo and train the model the CPU run trains."""
    gpu, cpu = tmp_path / "gpu", tmp_path / "cpu"
    for out, device in ((gpu, "cuda"), (cpu, "cpu")):
        args = [f"device={device}", "backend=gloo", "sync=ps", "world_size=2", *shards, *SMALL, f"hydra.run.dir={out}"]
        proc = run_cli(args, cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"})  # one GPU, however many there are
        assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(gpu / "summary.json")
    assert summary["status"] == "ok" and summary["device"].startswith("cuda")
    assert summary["replicas_identical"] is True
    assert relative_error(load_params(gpu), load_params(cpu)) < 1e-3


def sleep_cycles(device: torch.device, seconds: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spends in about ``seconds``."""
    torch.cuda._sleep(1000)  # loaded before it is timed
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    torch.cuda._sleep(10_000_000)
    torch.cuda.synchronize(device)
    return int(seconds * 10_000_000 / (time.perf_counter() - began))


def test_communication_is_timed_when_it_runs_not_when_it_is_queued() -> None:
    """Under NCCL a collective's call, its future and work.wait() return once it is queued. A
    bucket's all-reduce queued behind 0.2 s of other GPU work (backward's, when overlap launches
    it) starts when that work is done and ends after it: its stamps agree with times bracketed by
    torch.cuda.synchronize, where host timers would put both at the moment it was queued."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = nn.Linear(1024, 1024, device=device)
        sync = build_synchronizer(OmegaConf.create({"name": "allreduce", "accumulate": 1, "bucket_mb": None,
                                                    "overlap": False}))
        sync.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), World(0, 0, 1, 1, device, "nccl", 60.0))
        dist.all_reduce(torch.zeros(1, device=device))  # NCCL's communicator starts at the first collective
        cycles = sleep_cycles(device, 0.2)

        # The stamps alone, around GPU work: the work's duration, however soon the host moved on.
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        before = stamp(device)
        torch.cuda._sleep(cycles)
        after = stamp(device)
        queued = time.perf_counter() - began
        torch.cuda.synchronize(device)
        ended = time.perf_counter()
        start, end = stamp_seconds(device, [before, after])
        assert queued < 0.25 * (ended - began), "the sleep must outlast its queueing for this test to tell"
        assert began - 1e-3 <= start <= end <= ended + 1e-3
        assert end - start == pytest.approx(ended - began, rel=0.1, abs=5e-3)

        # A bucket's all-reduce launched behind that much work, as backward launches it.
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        torch.cuda._sleep(cycles)
        traffic = sync.launch(0).result()
        queued = time.perf_counter() - began
        torch.cuda.synchronize(device)
        ended = time.perf_counter()
        start, end = stamp_seconds(device, [traffic.start, traffic.end])
        slept = ended - began
        assert queued < 0.25 * slept
        assert start >= began + 0.8 * slept, (start - began, slept)  # it ran after the work queued before it
        assert start <= end <= ended + 1e-3
        sync.close()
    finally:
        dist.destroy_process_group()
