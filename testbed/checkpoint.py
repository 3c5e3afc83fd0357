"""Periodic checkpoints, and resuming a run from the latest one (``checkpoint`` and ``resume``).

A checkpoint after step s holds, per rank, what the steps after s depend on: parameters,
optimizer state and the random generators (torch's, Python's, the imbalance injector's). The data
position needs nothing: a rank's batch is a function of (seed, step) (testbed.data). Every rank
writes its own file; once all have (a barrier), rank 0 writes the step's ``manifest.json`` (the
sha256 of every file there, the shards' too) last and atomically, then removes the oldest beyond
``checkpoint.keep``. A checkpoint is complete when its manifest is there and every file matches it:
one left without a manifest (a run killed while writing) or with a file that no longer matches
(truncated, corrupted) is named with its file and the reason, and resume and restart fall back to
the previous complete one.

``resume=<job dir>`` starts a new job from that directory's latest checkpoint: the step records
before it are copied into the new job's metrics, so the new job's results cover the whole run. For
synchronous modes the resumed run ends bitwise equal to an uninterrupted one (tested). Parameter
servers write their shards' state into the same step directories (ps<shard>.pt, testbed.ps.shard_checkpoint)
and the launcher restarts them from there; in async and SSP modes the barrier below is the point
the shards' snapshot and the workers' checkpoints agree on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from testbed import sharded_checkpoint
from testbed.checks import require
from testbed.results.step_log import metrics_path, read_step_records
from testbed.sharded_checkpoint import Pieces, Whole
from testbed.step_record import StepRecord

log = logging.getLogger(__name__)

DIR, MANIFEST = "checkpoints", "manifest.json"
# Config that may differ between a run and its resumption: how it runs, not what it computes.
RUN_ONLY = ("steps", "warmup_steps", "checkpoint", "resume", "fault", "timeouts", "launcher", "wandb", "debug",
            "log_every", "sim", "tune", "sweep_resume")
RUN_ONLY_SYNC = ("addresses", "host", "tls_cert", "tls_key", "tls_ca")  # where the servers run, and how they are reached


def step_dir(job_dir: Path, step: int) -> Path:
    return job_dir / DIR / f"step{step:07d}"


def latest(job_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``job_dir`` (None if there is none); warns, once per
    process, of each newer one that is not complete."""
    found, problems = scan(job_dir)
    for problem in problems:
        if problem not in _WARNED:
            _WARNED.add(problem)
            log.warning("checkpoint %s; %s", problem,
                        f"falling back to {found.name}" if found else "no earlier complete checkpoint")
    return found


_WARNED: set[str] = set()


def scan(job_dir: Path) -> tuple[Path | None, list[str]]:
    """(the newest complete checkpoint or None, why each newer one is not complete: file and reason)."""
    problems = []
    for path in sorted((p for p in (job_dir / DIR).glob("step*") if p.is_dir()), reverse=True):
        problem = incomplete(path)
        if problem is None:
            return path, problems
        problems.append(problem)
    return None, problems


def incomplete(path: Path) -> str | None:
    """Why the checkpoint in ``path`` cannot be used, naming the file; None when it is complete."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{path}: no {MANIFEST} (the run stopped while writing this checkpoint)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest}: unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(files, dict) or not files:
        return f"{manifest}: lists no files"
    for name, digest in sorted(files.items()):
        if not (path / name).is_file():
            return f"{path / name}: missing (listed in {MANIFEST})"
        if _sha256(path / name) != digest:
            return f"{path / name}: its sha256 differs from {MANIFEST}'s (truncated or corrupted since it was written)"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step"))


def continuable(job_dir: Path, steps: int) -> bool:
    """Whether ``job_dir`` has a complete checkpoint that leaves steps to run in a run of ``steps``."""
    found = latest(job_dir)
    return found is not None and checkpoint_step(found) + 1 < steps


def save(job_dir: Path, step: int, rank: int, keep: int, state: dict[str, Any]) -> None:
    """Write this rank's state after ``step``; collective: every rank calls it at the same step."""
    target = step_dir(job_dir, step)
    target.mkdir(parents=True, exist_ok=True)
    tmp = target / f"rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, target / f"rank{rank}.pt")
    dist.barrier()  # every rank's file is complete, and the parameter servers' (saved before this step ended)
    if rank == 0:
        write_manifest(target)
        for old in sorted(p for p in (job_dir / DIR).glob("step*") if p.is_dir())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)


def write_manifest(target: Path) -> None:
    """The sha256 of every file of the checkpoint in ``target``: written last, atomically, it says
    the checkpoint is complete."""
    files = {p.name: _sha256(p) for p in sorted(target.glob("*.pt"))}
    tmp = target / f"{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"step": checkpoint_step(target), "files": files}, indent=1))
    os.replace(tmp, target / MANIFEST)


def rank_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, injector_rng: random.Random,
               pieces: Pieces | None = None) -> dict[str, Any]:
    """This rank's checkpoint: the model and optimizer whole, or, for a synchronizer that shards
    them, the model's buffers and the rank's ``pieces`` of the rest (testbed.sharded_checkpoint)."""
    if pieces is None:
        state: dict[str, Any] = {"model": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
                                 "optimizer": optimizer.state_dict()}
    else:
        state = {"buffers": {k: v.detach().cpu().clone() for k, v in model.named_buffers()}, "pieces": pieces.as_dict()}
    state |= {
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "injector_rng": injector_rng.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def restore_training(state: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Parameters and optimizer state: before the synchronizer shares the model. A sharded
    checkpoint's buffers only: the synchronizer takes its shard of the rest (``load_whole``)."""
    if "pieces" in state:
        model.load_state_dict(state["buffers"], strict=False)
        return
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def load_whole(resume_dir: Path, model: torch.nn.Module) -> Whole:
    """A sharded checkpoint's model state put together from every rank's pieces."""
    path, _ = scan(resume_dir)
    if path is None:
        raise FileNotFoundError(f"resume={resume_dir}: no complete checkpoint")
    return sharded_checkpoint.load_whole(path, {name: p.numel() for name, p in model.named_parameters()})


def saved_world_size(resume_dir: Path) -> int:
    """The world size of the run ``resume_dir`` holds (its summary's)."""
    return int(json.loads((resume_dir / "summary.json").read_text())["world_size"])


def restore_rng(state: dict[str, Any], injector_rng: random.Random) -> None:
    """The generators: last, where the interrupted run had them before its next step."""
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    injector_rng.setstate(state["injector_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])


def load(resume_dir: Path, rank: int) -> tuple[int, dict[str, Any]]:
    """(the step the checkpoint was taken after, this rank's state)."""
    path, _ = scan(resume_dir)  # the launcher has warned of any newer incomplete one
    if path is None:
        raise FileNotFoundError(f"resume={resume_dir}: no complete checkpoint")
    file = path / f"rank{rank}.pt"
    if not file.exists():  # more ranks than saved it (a sharded checkpoint): rank 0's buffers and generators
        file = path / "rank0.pt"
    try:
        return checkpoint_step(path), torch.load(file, weights_only=False)
    except Exception as exc:  # whatever the unpickler raises: the file and its reason
        raise RuntimeError(f"checkpoint {file}: cannot be read ({type(exc).__name__}: {exc})") from None


def earlier_records(resume_dir: Path, rank: int, upto: int) -> list[StepRecord]:
    """This rank's step records of the resumed run, steps 0..upto."""
    return [r for r in read_step_records(metrics_path(resume_dir, rank)) if r.step <= upto]


def mismatches(cfg: dict[str, Any], resumed: dict[str, Any]) -> list[str]:
    """The config keys (besides RUN_ONLY) in which a run differs from the one it resumes."""

    def what(c: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in c.items() if k not in RUN_ONLY}
        out["sync"] = {k: v for k, v in (c.get("sync") or {}).items() if k not in RUN_ONLY_SYNC}
        return out

    ours, theirs = what(cfg), what(resumed)
    return sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0: none
    keep: int = 2  # newest checkpoints kept


def check_checkpoints(cfg: Any, plain: dict[str, Any], resizes: bool = False) -> None:
    """``checkpoint.*`` and ``resume``: a resumed run has a complete checkpoint, the same config
    (``plain``, the resolved one; ``resizes``: the world size aside, for a synchronizer whose sharded
    checkpoints any number of ranks resumes) and steps left to run."""
    require(cfg.checkpoint.every >= 0, f"checkpoint.every={cfg.checkpoint.every}: must be >= 0 (0: no checkpoints)")
    require(cfg.checkpoint.keep >= 1, f"checkpoint.keep={cfg.checkpoint.keep}: must be >= 1")
    if not cfg.resume:
        return
    resumed = Path(cfg.resume)
    found = latest(resumed)
    require(found is not None, f"resume={cfg.resume}: no complete checkpoint there "
            f"({'; '.join(scan(resumed)[1]) or 'run it with checkpoint.every > 0'})")
    summary = resumed / "summary.json"
    require(summary.exists(), f"resume={cfg.resume}: no summary.json to compare the config with")
    differ = [key for key in mismatches(plain, json.loads(summary.read_text())["config"])
              if not (resizes and key == "world_size")]
    require(not differ, f"resume={cfg.resume}: the config differs in {', '.join(differ)}; resume with the same settings")
    step = checkpoint_step(found)
    require(step + 1 < cfg.steps, f"resume={cfg.resume}: its checkpoint is after step {step}; steps={cfg.steps} leaves nothing to run")
