"""Spawn a world of local ranks through torch's elastic launcher (the engine behind torchrun).

Standalone c10d rendezvous on ``localhost:0``: the rendezvous store binds a fresh port per call, so
consecutive or concurrent jobs can never join each other's world. ``max_restarts=0``: a failed rank
fails the run, and the agent stops the remaining ranks.

Ranks are forked from a server process that imported torch, ``torch._dynamo`` (which the first
optimizer a rank builds imports: seconds of CPU) and the entry's module once per launcher, instead
of each rank importing them afresh: on a small machine a sweep's jobs start in a fraction of a
second instead of ten. A rank gets the launcher's environment either way (see ``_start_method``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
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
    fresh_interpreters: bool = False,
) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``nproc`` new processes; return ``{rank: return value}``.

    ``env`` is added to the ranks' environment (and only theirs: it is restored afterwards).
    ``fresh_interpreters`` starts each rank as a new interpreter, for settings that libraries read
    when they are imported (torch's C++ log level).

    Rank stdout/stderr go to ``log_dir/<run id>/attempt_0/<rank>/``; rank 0 is echoed to the console
    when ``echo_rank0``. Raises ``RankFailure`` naming the first failed rank.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    start_method = "spawn" if fresh_interpreters else _start_method(entry)
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
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(
            log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.ALL} if echo_rank0 else Std.NONE
        ),
    )
    try:
        with _launch_environment(log_dir, env or {}) as rank_env:
            return elastic_launch(config, _with_environment)(entry, rank_env, *args)
    except ChildFailedError as exc:
        # The earliest failure is the cause; the others are usually peers losing their connection.
        rank, failure = min(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
        if failure.exitcode < 0:
            message = f"killed by signal {failure.signal_name()} (pid {failure.pid})"
        else:
            message = _last_line(failure.message) or f"exited with code {failure.exitcode}"
        raise RankFailure(rank, message) from None


_forkserver_environ: dict[str, str] | None = None  # the launcher's environment when its fork server started
_PRELOAD = ["torch", "torch._dynamo"]


def start_rank_server(entry: Callable[..., Any]) -> None:
    """Start the fork server that ranks come from, with torch and ``entry``'s module imported, unless
    it runs already; call it early to overlap its imports with the launcher's own start-up."""
    global _forkserver_environ
    if _forkserver_environ is None:
        multiprocessing.set_forkserver_preload([*_PRELOAD, entry.__module__])
        multiprocessing.forkserver.ensure_running()
        _forkserver_environ = dict(os.environ)


def _start_method(entry: Callable[..., Any]) -> str:
    """``forkserver``; ``spawn`` when the launcher's environment has changed since the server
    started, since a forked rank inherits the server's environment and only ``env`` is passed on."""
    start_rank_server(entry)
    return "forkserver" if dict(os.environ) == _forkserver_environ else "spawn"


def _with_environment(entry: Callable[..., Any], env: dict[str, str], *args: Any) -> Any:
    os.environ.update(env)
    return entry(*args)


@contextmanager
def _launch_environment(log_dir: Path, env: dict[str, str]) -> Iterator[dict[str, str]]:
    """Temporary files of the launch (torch's per-rank error files) go to, and go with, ``log_dir/tmp``;
    ranks start with one OpenMP thread until they size their own pools (threads_per_rank), and
    get ``env``, which is yielded."""
    tmp = log_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **env}
    # The launch leaves its marks in the environment (torch's signal list; its compile cache
    # directory, pinned inside this launch's tmp the first time a failed rank is logged): the
    # launcher's environment is restored whole, so the next launch starts from the same one.
    saved_tempdir, saved_env = tempfile.tempdir, dict(os.environ)
    tempfile.tempdir = str(tmp)
    os.environ.update(env)
    try:
        yield env
    finally:
        tempfile.tempdir = saved_tempdir
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(tmp, ignore_errors=True)


def _last_line(message: Any) -> str:
    # The error file of a rank that raised holds {"message": "<Type>: <text>", "extraInfo": {...}}.
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    return text.splitlines()[-1] if text else ""
