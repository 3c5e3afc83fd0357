"""The CUDA path (NCCL, CUDA-event timing, bf16 autocast). Skipped without a GPU; run by scripts/gpu_check.sh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_params, read_json, read_jsonl, relative_error, run_cli

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


@pytest.mark.parametrize("model", [["model=mlp"], ["model=cnn"], ["model=transformer", "data=lm"]])
def test_bf16_autocast_trains(tmp_path: Path, model: list[str]) -> None:
    out = tmp_path / "job"
    proc = run_cli(["device=cuda", "precision=bf16", *model, "steps=30", "warmup_steps=5", f"hydra.run.dir={out}"],
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["final_loss"] < summary["loss_first"]


def test_nccl_refuses_more_ranks_than_gpus(tmp_path: Path) -> None:
    ranks = torch.cuda.device_count() + 1
    proc = run_cli(["backend=nccl", f"world_size={ranks}", f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "backend=nccl needs one CUDA GPU per local rank" in proc.stderr
    assert not (tmp_path / "job").exists()
