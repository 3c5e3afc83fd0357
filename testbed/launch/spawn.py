"""Spawn a world of local ranks through torch's elastic launcher (the engine behind torchrun).

Nothing of a local world listens beyond loopback: torch's stores have no authentication, so a
store on every interface would let anyone who reaches the machine join or disturb the run. The
agent's rendezvous is torch's c10d one (torchrun's ``--rdzv_backend=c10d``) over a store on a fresh
loopback port per call, so consecutive or concurrent jobs can never join each other's world; the
ranks' store is rank 0's, on loopback too (testbed.world), and Gloo and NCCL use the loopback
interface unless told otherwise. ``max_restarts=0``: a failed rank fails the run, and the agent
stops the remaining ranks. Ranks are forked from a server that imported torch once
(testbed.launch.rank_server).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    dynamic_rendezvous,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from testbed.launch import rank_server
from testbed.world import LOOPBACK_STORE_ENV, bound_store

LOOPBACK_RENDEZVOUS = "testbed-loopback"


class _LoopbackBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state, kept in a store the caller made, under this backend's name."""

    @property
    def name(self) -> str:
        return LOOPBACK_RENDEZVOUS


def _loopback_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous handler (what ``rdzv_backend="c10d"`` creates) over a store that
    listens on a fresh loopback port instead of every interface."""
    store = bound_store(0, None, timedelta(seconds=params.get_as_int("read_timeout", 60) or 60))
    return create_handler(store, _LoopbackBackend(store, params.run_id), params)


rendezvous_handler_registry.register(LOOPBACK_RENDEZVOUS, _loopback_rendezvous)


def _method_name(depth: int = 2) -> str:
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # a stack shallower than depth, as torch's own says
        return "no_method_name"


# The rendezvous names the method of each of its log records with inspect.stack(), which reads the
# source of every frame on the stack: about 0.3 s of CPU per launch, for a name one frame lookup gives.
dynamic_rendezvous.get_method_name = _method_name


def loopback_env() -> dict[str, str]:
    """The agent does not share its rendezvous store with the ranks (it would serve it to them on
    every interface); rank 0 serves theirs on loopback; the collectives' sockets stay on loopback
    unless the environment names an interface."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", LOOPBACK_STORE_ENV: "1",
            **{key: os.environ.get(key, "lo") for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}}


@dataclass
class RankFailure(Exception):
    """A run whose ranks did not all finish; ``rank`` is the first rank that failed, ``killed``
    whether a signal ended it (then it recorded nothing of its own: testbed.rank_failure)."""

    rank: int
    message: str
    killed: bool = False

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
    if not fresh_interpreters:
        rank_server.start_rank_server(entry.__module__)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"testbed-{uuid.uuid4().hex[:12]}",
        rdzv_backend=LOOPBACK_RENDEZVOUS,
        rdzv_endpoint="127.0.0.1:0",  # for the record: _loopback_rendezvous binds a fresh loopback port
        rdzv_configs={"timeout": int(rendezvous_timeout_s), "join_timeout": int(rendezvous_timeout_s)},
        max_restarts=0,
        monitor_interval=monitor_interval_s,
        start_method="spawn" if fresh_interpreters else "forkserver",
        logs_specs=DefaultLogsSpecs(
            log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.ALL} if echo_rank0 else Std.NONE
        ),
    )
    try:
        with launch_environment(log_dir, {**loopback_env(), **(env or {})}) as environ:
            return elastic_launch(config, _in_environment)(entry, environ, *args)
    except ChildFailedError as exc:
        # The agent reports the first failed rank it finds; when that one only lost a peer, the
        # launcher reads the cause from the ranks' own records (testbed.rank_failure).
        rank, failure = min(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
        if failure.exitcode < 0:
            raise RankFailure(rank, f"killed by signal {failure.signal_name()} (pid {failure.pid})", killed=True) from None
        raise RankFailure(rank, _last_line(failure.message) or f"exited with code {failure.exitcode}") from None


def _in_environment(entry: Callable[..., Any], environ: dict[str, str], *args: Any) -> Any:
    rank_server.adopt_environment(environ)
    return entry(*args)


@contextmanager
def launch_environment(log_dir: Path, env: dict[str, str]) -> Iterator[dict[str, str]]:
    """Temporary files of the launch (torch's per-rank error files) go to, and go with, ``log_dir/tmp``;
    ranks start with one OpenMP thread until they size their own pools (threads_per_rank), and
    get the launcher's environment with ``env`` added, which is yielded."""
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
        yield dict(os.environ)
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
