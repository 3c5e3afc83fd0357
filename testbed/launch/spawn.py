"""Spawn a world of local ranks through torch's elastic launcher (the engine behind torchrun).

Standalone c10d rendezvous on ``localhost:0``: the rendezvous store binds a fresh port per call, so
consecutive or concurrent jobs can never join each other's world. ``max_restarts=0``: a failed rank
fails the run, and the agent stops the remaining ranks.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


@dataclass
class RankFailure(Exception):
    """A run whose ranks did not all finish; ``rank`` is the first rank that failed."""

    rank: int
    message: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.message}"


def spawn_world(
    entry: Callable[..., Any],
    args: tuple[Any, ...],
    nproc: int,
    log_dir: Path,
    rendezvous_timeout_s: float = 120.0,
    echo_rank0: bool = False,
    monitor_interval_s: float = 0.1,
    env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``nproc`` fresh processes; return ``{rank: return value}``.

    ``env`` is added to the ranks' environment (and only theirs: it is restored afterwards).

    Rank stdout/stderr go to ``log_dir/<run id>/attempt_0/<rank>/``; rank 0 is echoed to the console
    when ``echo_rank0``. Raises ``RankFailure`` naming the first failed rank.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"testbed-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": int(rendezvous_timeout_s), "join_timeout": int(rendezvous_timeout_s)},
        max_restarts=0,
        monitor_interval=monitor_interval_s,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(
            log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.ALL} if echo_rank0 else Std.NONE
        ),
    )
    try:
        with _launch_environment(log_dir, env or {}):
            return elastic_launch(config, entry)(*args)
    except ChildFailedError as exc:
        # The earliest failure is the cause; the others are usually peers losing their connection.
        rank, failure = min(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
        if failure.exitcode < 0:
            message = f"killed by signal {failure.signal_name()} (pid {failure.pid})"
        else:
            message = _last_line(failure.message) or f"exited with code {failure.exitcode}"
        raise RankFailure(rank, message) from None


@contextmanager
def _launch_environment(log_dir: Path, env: dict[str, str]) -> Iterator[None]:
    """Temporary files of the launch (torch's per-rank error files) go to, and go with, ``log_dir/tmp``;
    ranks start with one OpenMP thread until they size their own pools (threads_per_rank), and
    inherit ``env``."""
    tmp = log_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env}
    # torch's compile cache directory is derived from the temporary directory the first time it is
    # needed (here: when the launcher logs a failed rank) and then pinned in the environment, where
    # every later launch would inherit a path inside this one's removed tmp: restore it too.
    restored = [*env, "TORCHINDUCTOR_CACHE_DIR"]
    saved_tempdir, saved_env = tempfile.tempdir, {key: os.environ.get(key) for key in restored}
    tempfile.tempdir = str(tmp)
    os.environ.update(env)
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(tmp, ignore_errors=True)


def _last_line(message: Any) -> str:
    # The error file of a rank that raised holds {"message": "<Type>: <text>", "extraInfo": {...}}.
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    return text.splitlines()[-1] if text else ""
