"""The elastic launcher: local ranks that may be lost without stopping the others (``elastic.enabled``).

torch's launch agent stops every rank when one fails and can only restart them all; this one lets
the rest go on. It forks the ranks from the same rank server as testbed.launch.spawn, serves their
store itself on loopback (so that it outlives any rank), and watches them. A worker whose process
ends by a signal or without recording a failure of its own (SIGKILL, the OOM killer, a segfault) is
lost: the launcher announces the next membership in the store (testbed.elastic.membership), and
the survivors regroup. A rank that records an exception (a NaN loss, a timeout, a bug) fails the
run as it would without elastic: it would fail again. So does losing worker 0, which writes the
run's results, or falling below ``elastic.min_workers``.

Logs keep torch's layout: ``log_dir/<run id>/attempt_0/<rank>/{stdout,stderr}.log``.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TextIO

from torch.distributed.elastic.multiprocessing.api import SignalException

from testbed.elastic.membership import epoch_key
from testbed.launch import rank_server
from testbed.launch.spawn import RankFailure, launch_environment, loopback_env
from testbed.rank_failure import recorded
from testbed.world import LAUNCHER_STORE_ENV, loopback_store

log = logging.getLogger("testbed")
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL: a rank flushes its metrics on SIGTERM (testbed.launch.rank)


def supervise_world(
    entry: Callable[..., Any],
    args: tuple[Any, ...],
    nproc: int,
    log_dir: Path,
    min_workers: int,
    on_lost: Callable[[int, int], None] | None = None,
    rendezvous_timeout_s: float = 120.0,
    echo_rank0: bool = False,
    monitor_interval_s: float = 0.1,
    env: dict[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``nproc`` ranks that may leave; return ``{0: worker 0's return value}``.
    ``on_lost(worker, epoch)`` tells the rest of the job (parameter servers) of a lost worker before
    membership ``epoch`` is announced. Raises ``RankFailure`` naming the worker whose failure ended
    the run."""
    log_dir.mkdir(parents=True, exist_ok=True)
    rank_server.start_rank_server(entry.__module__)
    context = multiprocessing.get_context("forkserver")
    store = loopback_store(0, None, timedelta(seconds=rendezvous_timeout_s))
    run_dir = log_dir / f"testbed-{uuid.uuid4().hex[:12]}" / "attempt_0"
    launch_env = {**loopback_env(), LAUNCHER_STORE_ENV: "1", **(env or {})}
    ranks: dict[int, tuple[multiprocessing.process.BaseProcess, Connection]] = {}
    # Told to stop, the launcher stops its ranks first (the job records it: testbed.launch.job).
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        with launch_environment(log_dir, launch_env) as environ:
            for rank in range(nproc):
                layout = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                          "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=_rank, name=f"rank{rank}",
                                          args=(entry, {**environ, **layout}, run_dir / str(rank), send, args))
                process.start()
                send.close()
                ranks[rank] = (process, receive)
            echo = _Echo(run_dir / "0" / "stdout.log") if echo_rank0 else None
            return _watch(ranks, store, min_workers, on_lost, log_dir, monitor_interval_s, echo)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop([process for process, _ in ranks.values()])
        for _, receive in ranks.values():
            receive.close()
        del store  # its server thread and port go with it


def _watch(ranks: dict[int, tuple[Any, Connection]], store: Any, min_workers: int,
           on_lost: Callable[[int, int], None] | None, log_dir: Path, interval_s: float,
           echo: _Echo | None) -> dict[int, Any]:
    live, results, epoch = set(ranks), {}, 0
    while live:
        time.sleep(interval_s)
        if echo is not None:
            echo.pump()
        for rank in sorted(live):
            process, receive = ranks[rank]
            _receive(results, rank, receive)  # before the exit: a large result would block the rank's send
            if process.exitcode is None:
                continue
            _receive(results, rank, receive)  # sent between the two looks
            live.discard(rank)
            if process.exitcode == 0:
                continue
            detected_at = time.time()
            record = recorded(log_dir, rank)
            if process.exitcode < 0:
                cause = f"killed by signal {signal.Signals(-process.exitcode).name} (pid {process.pid})"
            elif record is None:
                cause = f"exited with code {process.exitcode} without recording a failure"
            else:  # an exception of its own: it would recur, as it does without elastic
                raise RankFailure(rank, record["message"])
            survivors = sorted(live)
            if rank == 0:
                raise RankFailure(0, f"{cause}; worker 0 writes the run's results, so its loss ends the run",
                                  killed=process.exitcode < 0)
            if len(survivors) < min_workers:
                raise RankFailure(rank, f"{cause}; {len(survivors)} workers left, below elastic.min_workers="
                                        f"{min_workers}", killed=process.exitcode < 0)
            epoch += 1
            if on_lost is not None:
                try:
                    on_lost(rank, epoch)
                except Exception as exc:
                    raise RankFailure(rank, f"{cause}; the servers could not drop it: {exc}") from exc
            store.set(epoch_key(epoch), json.dumps({"members": survivors, "lost": [rank], "cause": cause,
                                                    "detected_at": detected_at}))
            log.warning("worker %d lost (%s): membership %d goes on with workers %s", rank, cause, epoch, survivors)
    if echo is not None:
        echo.close()
    return {0: results.get(0)}


def _raise_stop(signum: int, frame: Any) -> None:
    raise SignalException(f"launcher got {signal.Signals(signum).name}", sigval=signal.Signals(signum))


def _receive(results: dict[int, Any], rank: int, receive: Connection) -> None:
    if rank not in results and receive.poll():
        try:
            results[rank] = receive.recv()
        except EOFError:  # the rank ended without sending (killed)
            results[rank] = None


def _rank(entry: Callable[..., Any], environ: dict[str, str], out_dir: Path, send: Connection,
          args: tuple[Any, ...]) -> None:
    """One rank: the launch's environment, output into its log files, and its result sent back."""
    os.environ.clear()
    os.environ.update(environ)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stream, name in ((sys.stdout, "stdout.log"), (sys.stderr, "stderr.log")):
        stream.flush()
        with open(out_dir / name, "ab", buffering=0) as file:
            os.dup2(file.fileno(), stream.fileno())
    send.send(entry(*args))
    send.close()


def _stop(processes: list[Any]) -> None:
    """SIGTERM the ranks still running, SIGKILL those still there after the grace, reap them all."""
    running = [p for p in processes if p.exitcode is None]
    for process in running:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in running:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()


class _Echo:
    """Copies rank 0's output to the console as it is written (torch's agent tees it so)."""

    def __init__(self, path: Path) -> None:
        self.path, self._file = path, None
        self._out: TextIO = sys.stdout

    def pump(self) -> None:
        if self._file is None:
            if not self.path.exists():
                return
            self._file = open(self.path, errors="replace")
        text = self._file.read()
        if text:
            self._out.write(text)
            self._out.flush()

    def close(self) -> None:
        self.pump()
        if self._file is not None:
            self._file.close()
