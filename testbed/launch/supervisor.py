"""The elastic launcher: local ranks that may be lost without stopping the others (``elastic.enabled``).

torch's launch agent stops every rank when one fails and can only restart them all; this one lets
the rest go on. It forks the ranks from the same rank server as testbed.launch.spawn, serves their
store itself on loopback (so that it outlives any rank), and watches them. A worker whose process
ends by a signal or without recording a failure of its own (SIGKILL, the OOM killer, a segfault) is
lost: the launcher announces the next membership in the store (testbed.elastic.membership), and
the survivors regroup. With ``elastic.rejoin_step`` it starts a newcomer in the lost worker's place
at once, and announces the membership that admits it when the workers reach that step and ask. A
rank that records an exception (a NaN loss, a timeout, a bug) fails the run as it would without
elastic: it would fail again. So does losing worker 0, which writes the run's results, or falling
below ``elastic.min_workers``.

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

from testbed.elastic.membership import JOIN_ENV, admit_key, epoch_key, joinable_key, ready_key
from testbed.launch import rank_server
from testbed.launch.spawn import RankFailure, launch_environment, loopback_env
from testbed.netem.rank import namespace_store
from testbed.rank_failure import recorded
from testbed.world import LAUNCHER_STORE_ENV, bound_store

log = logging.getLogger("testbed")
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL: a rank flushes its metrics on SIGTERM (testbed.launch.rank)


def supervise_world(
    entry: Callable[..., Any],
    args: tuple[Any, ...],
    nproc: int,
    log_dir: Path,
    min_workers: int,
    rendezvous_timeout_s: float = 120.0,
    echo_rank0: bool = False,
    monitor_interval_s: float = 0.1,
    env: dict[str, str] | None = None,
    rejoin_step: int | None = None,
    store_host: tuple[str, str] | None = None,
) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``nproc`` ranks that may leave; return ``{0: worker 0's return value}``.
    ``rejoin_step``: a newcomer is started in each lost worker's place, and admitted from that step
    on. ``store_host``: (network namespace, address) where the ranks' store listens, on an emulated
    network; by default loopback. Raises ``RankFailure`` naming the worker whose failure ended the run."""
    log_dir.mkdir(parents=True, exist_ok=True)
    rank_server.start_rank_server(entry.__module__)
    context = multiprocessing.get_context("forkserver")
    timeout = timedelta(seconds=rendezvous_timeout_s)
    store = bound_store(0, None, timeout) if store_host is None else namespace_store(*store_host, timeout)
    host = "127.0.0.1" if store_host is None else store_host[1]
    run_dir = log_dir / f"testbed-{uuid.uuid4().hex[:12]}" / "attempt_0"
    launch_env = {**loopback_env(), LAUNCHER_STORE_ENV: "1", **(env or {})}
    ranks: dict[int, tuple[multiprocessing.process.BaseProcess, Connection]] = {}
    # Told to stop, the launcher stops its ranks first (the job records it: testbed.launch.job).
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        port = store.port
        with launch_environment(log_dir, launch_env) as environ:

            def start(rank: int, extra: dict[str, str]) -> None:
                layout = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                          "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": host, "MASTER_PORT": str(port)}
                receive, send = context.Pipe(duplex=False)
                process = context.Process(target=_rank, name=f"rank{rank}",
                                          args=(entry, {**environ, **layout, **extra}, run_dir / str(rank), send, args))
                process.start()
                send.close()
                if rank in ranks:  # a newcomer in a lost worker's place
                    ranks[rank][1].close()
                ranks[rank] = (process, receive)

            for rank in range(nproc):
                start(rank, {})
            echo = _Echo(run_dir / "0" / "stdout.log") if echo_rank0 else None
            newcomers = (lambda worker, epoch: start(worker, {JOIN_ENV: str(epoch)})) if rejoin_step is not None else None
            return _Watch(ranks, store, min_workers, newcomers, log_dir, echo).run(monitor_interval_s)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop([process for process, _ in ranks.values()])
        for _, receive in ranks.values():
            receive.close()
        del store  # its server thread and port go with it


class _Watch:
    """The launcher's loop: each rank's exit, each newcomer's readiness, and the memberships they make."""

    def __init__(self, ranks: dict[int, tuple[Any, Connection]], store: Any, min_workers: int,
                 newcomers: Callable[[int, int], None] | None, log_dir: Path, echo: _Echo | None) -> None:
        """``newcomers(worker, epoch)``: start a newcomer in lost ``worker``'s place, after membership
        ``epoch`` (elastic.rejoin_step)."""
        self.ranks, self.store, self.min_workers = ranks, store, min_workers
        self.newcomers, self.log_dir, self.echo = newcomers, log_dir, echo
        self.members = set(ranks)  # the workers of the newest membership (announced)
        self.waiting: dict[int, int] = {}  # newcomer -> the epoch it was started after, until admitted
        self.results: dict[int, Any] = {}
        self.epoch = 0
        self.joinable = -1  # the newest epoch told that a newcomer is ready

    def run(self, interval_s: float) -> dict[int, Any]:
        live = set(self.ranks)
        while live & self.members:  # a newcomer never admitted is stopped at the end
            time.sleep(interval_s)
            if self.echo is not None:
                self.echo.pump()
            for rank in sorted(live):
                process, receive = self.ranks[rank]
                _receive(self.results, rank, receive)  # before the exit: a large result would block the send
                if process.exitcode is None:
                    continue
                _receive(self.results, rank, receive)  # sent between the two looks
                live.discard(rank)
                if process.exitcode != 0:
                    self._lost(rank, process)
                    if self.newcomers is not None:
                        self.newcomers(rank, self.epoch)
                        self.waiting[rank] = self.epoch
                        live.add(rank)
            self._admit()
        if self.echo is not None:
            self.echo.close()
        return {0: self.results.get(0)}

    def _lost(self, rank: int, process: Any) -> None:
        detected_at = time.time()
        record = recorded(self.log_dir, rank)
        if process.exitcode < 0:
            cause = f"killed by signal {signal.Signals(-process.exitcode).name} (pid {process.pid})"
        elif record is None:
            cause = f"exited with code {process.exitcode} without recording a failure"
        else:  # an exception of its own: it would recur, as it does without elastic
            raise RankFailure(rank, record["message"])
        if rank in self.waiting:
            raise RankFailure(rank, f"the newcomer in worker {rank}'s place ended before it joined: {cause}",
                              killed=process.exitcode < 0)
        self.members.discard(rank)
        survivors = sorted(self.members)
        if rank == 0:
            raise RankFailure(0, f"{cause}; worker 0 writes the run's results, so its loss ends the run",
                              killed=process.exitcode < 0)
        if len(survivors) < self.min_workers:
            raise RankFailure(rank, f"{cause}; {len(survivors)} workers left, below elastic.min_workers="
                                    f"{self.min_workers}", killed=process.exitcode < 0)
        self.epoch += 1
        self._announce({"members": survivors, "lost": [rank], "joined": [], "cause": cause, "detected_at": detected_at})
        log.warning("worker %d lost (%s): membership %d goes on with workers %s", rank, cause, self.epoch, survivors)

    def _admit(self) -> None:
        """Once a newcomer is ready, say so (the members choose the step they admit it at), and once
        every member has asked (each waits at that step's boundary), announce the membership that
        admits the newcomers ready; one ready too late waits until the run ends, never admitted."""
        if not self.waiting:
            return
        ready = sorted(w for w, after in self.waiting.items() if self.store.check([ready_key(w, after)]))
        if not ready:
            return
        if self.joinable < self.epoch:  # worker 0 names the step the members admit it at
            self.store.set(joinable_key(self.epoch), "1")
            self.joinable = self.epoch
        if not self.store.check([admit_key(self.epoch)]) or self.store.add(admit_key(self.epoch), 0) < len(self.members):
            return
        for worker in ready:
            del self.waiting[worker]
        self.members.update(ready)
        self.epoch += 1
        cause = f"worker{'s' if len(ready) > 1 else ''} {', '.join(map(str, ready))} joined (a newcomer in a lost place)"
        self._announce({"members": sorted(self.members), "lost": [], "joined": ready, "cause": cause,
                        "detected_at": time.time()})
        log.warning("%s: membership %d admits it", cause, self.epoch)

    def _announce(self, membership: dict[str, Any]) -> None:
        self.store.set(epoch_key(self.epoch), json.dumps(membership))


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
