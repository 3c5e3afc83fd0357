"""Helpers shared by the tests: run the real CLI in a subprocess, read a job directory, start PS shards."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import DictConfig, OmegaConf

from testbed.ps.client import PsClient
from testbed.ps.launch import LocalServers
from testbed.step_record import FIELDS, StepRecord
from testbed.sync import SYNCHRONIZERS

REPO = Path(__file__).resolve().parent.parent
# Parameter-server shards for the tests: 1 KiB chunks, plain SGD with an exact (power-of-two) step.
CHUNK_BYTES, LR = 1024, 0.5
SGD = {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False}


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"})
    return env


def run_cli(
    args: list[str], cwd: Path, timeout: float = 300, module: str = "testbed", env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess:
    """``python -m testbed <args>`` as a user would type it; output captured.

    Runs pin ``device=cpu`` unless they name a device, so the CPU suite means the same on a GPU machine.
    ``env`` changes the environment (None removes a variable).
    """
    if module == "testbed" and not any(a.startswith(("device=", "--")) for a in args):
        args = [*args, "device=cpu"]
    environ = cli_env()
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout
    )


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def wait_for_steps(job: Path, rank: int = 1, steps: int = 3, timeout_s: float = 120) -> None:
    """Until ``rank`` of the running job at ``job`` has logged ``steps`` steps (or the timeout)."""
    metrics, deadline = job / "metrics" / f"rank{rank}.jsonl", time.time() + timeout_s
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        time.sleep(0.2)


def step_record(**fields: Any) -> StepRecord:
    """A step record of ``fields``, every other field 0."""
    return StepRecord(**{**dict.fromkeys(FIELDS, 0), **fields})


def load_params(job_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(job_dir / "model_final.pt", weights_only=True)


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||a - b||_inf / ||b||_inf (the equivalence tolerance in docs/results.md)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in a)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def servers(tmp_path: Path, mode: str, workers: int, staleness: int = 2, stream_timeout_s: float | None = None) -> LocalServers:
    """One local shard process (not started: use as a context manager)."""
    cfg = {"servers": 1, "mode": mode, "staleness": staleness, "chunk_kb": 1, "host": "127.0.0.1",
           "stream_timeout_s": stream_timeout_s}
    return LocalServers(cfg, SGD, workers, tmp_path / "logs")


def client(ps: LocalServers, worker: int) -> PsClient:
    return PsClient(ps.addresses, ps.token, worker, timeout_s=20.0, chunk_bytes=CHUNK_BYTES)


def rank_pids(job: Path) -> list[int]:
    """The pids the ranks logged at start."""
    return [int(m) for log in job.glob("logs/*/attempt_0/*/stdout.log") for m in re.findall(r"pid (\d+)", log.read_text())]


def assert_nothing_left(job: Path) -> None:
    for pid in rank_pids(job):
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), pid
    servers = subprocess.run(["pgrep", "-f", f"testbed.ps.server.*{job}"], capture_output=True, text=True).stdout
    assert servers.strip() == "", f"parameter servers still running: {servers}"
    assert not (job / "logs" / "tmp").exists()
    if shutil.which("ip"):
        netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not re.search(rf"tb{os.getpid()}n", netns)  # none of this test process's launchers


def sync_config(name: str, **settings: Any) -> DictConfig:
    """sync=``name`` with those of ``settings`` its schema has: one list of settings serves several
    synchronizers (chunk_kb for the tree, ranks_per_node for hierarchical)."""
    known = {f.name for f in fields(SYNCHRONIZERS[name].schema)}
    return OmegaConf.create({"name": name, **{k: v for k, v in settings.items() if k in known}})
