"""A rank's side of elastic membership: commits, the next membership's process group, the rollback.

The launcher (testbed.launch.supervisor) announces membership epoch k in its store under
``elastic/epoch/<k>``: the workers that go on, whom they lost and why. A rank learns of it in two
ways. Its collective fails (a peer's socket closed), or, when it waits on a live peer that has
itself stopped on the failure, a watcher thread sees the announcement and shuts this rank's
connections of the old group down. Gloo has no abort that wakes a peer blocked in a receive (a
destroyed or aborted group keeps its sockets open, and that peer waits out the collective timeout),
so shutting the sockets is what wakes it, within milliseconds. The watcher also tells the
parameter servers (Synchronizer.membership_changed), whose refusal wakes a survivor blocked in a
pull that waits for the lost worker's push.

Then every survivor leaves the old group, forms the new one (its keys under ``epoch<k>/``, ranks
renumbered in worker order), and agrees on the newest commit any survivor holds: its holder
broadcasts parameters, buffers and optimizer state, and training goes on from the step after it.
A step that was cut off inside a collective is done again by the new membership.

A newcomer (``elastic.rejoin_step``) takes a lost worker's place: the launcher starts it at once,
and it says when it is ready (``elastic/ready/...``); the launcher passes that on
(``joinable_key``), and worker 0 names the next step (``join_at_key``; with ``elastic.rejoin_wait``,
``rejoin_step`` itself). At that step's boundary (one no worker is past, so none is interrupted)
each member asks the launcher to admit it (``admit_key``) and waits; once every member has asked,
the launcher announces the membership that has it. The members tell the parameter servers, if
any (Synchronizer.membership_changed, as for a loss), form its group, commit the step before it
and broadcast it as above, and the newcomer takes part from the step after the commit. Beside
parameter servers, which hold the model, only the buffers are broadcast, and the newcomer takes
part from the step the servers admitted it at.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from testbed.rank_failure import RunFailure, kind_of, lost_peer
from testbed.world import World, env_rank_layout, form_world, launcher_store

log = logging.getLogger("testbed")


# Set by the launcher on a newcomer: the membership epoch announced when it was started.
JOIN_ENV = "TESTBED_JOIN_AFTER_EPOCH"


def epoch_key(epoch: int) -> str:
    return f"elastic/epoch/{epoch}"


def admit_key(epoch: int) -> str:
    """A counter: the members of membership ``epoch`` asking to admit the newcomers ready."""
    return f"elastic/admit/{epoch}"


def joinable_key(epoch: int) -> str:
    """Set by the launcher once a newcomer is ready to join membership ``epoch``."""
    return f"elastic/joinable/{epoch}"


def join_at_key(epoch: int) -> str:
    """Set by worker 0: the step at whose boundary the members of membership ``epoch`` admit the
    newcomers ready (without elastic.rejoin_wait)."""
    return f"elastic/join_at/{epoch}"


def ready_key(worker: int, after: int) -> str:
    """Posted by the newcomer for ``worker`` started after membership ``after``, once it can join."""
    return f"elastic/ready/{worker}/{after}"


def joining() -> int | None:
    """The membership epoch after which this process was started as a newcomer, or None."""
    after = os.environ.get(JOIN_ENV)
    return None if after is None else int(after)


def is_join(announcement: dict[str, Any]) -> bool:
    return bool(announcement.get("joined")) and not announcement.get("lost")


def newest_announcement(store: dist.Store, epoch: int) -> dict[str, Any]:
    """Membership ``epoch``, announced, or a newer one announced since (several changes at once:
    every worker takes the newest)."""
    while store.check([epoch_key(epoch + 1)]):
        epoch += 1
    return {"epoch": epoch, **json.loads(store.get(epoch_key(epoch)))}


def join_world(device: torch.device, backend: str, timeout_s: float, after: int) -> tuple[World, dict[str, Any]]:
    """A newcomer's world: say it is ready, wait for the membership that admits it, and form its
    group with its peers (who form it at the step boundary they admit it at)."""
    worker = env_rank_layout()[0]
    timeout = timedelta(seconds=timeout_s)
    store = launcher_store(timeout)
    store.set(ready_key(worker, after), str(time.time()))
    epoch = after + 1
    while True:
        try:  # as long as it takes: a newcomer is admitted at elastic.rejoin_step, or stopped at the end
            store.wait([epoch_key(epoch)], timeout)
        except dist.DistStoreError:
            continue
        announced = newest_announcement(store, epoch)
        if worker in announced["members"]:
            break
        epoch = announced["epoch"] + 1
    members = announced["members"]
    world = form_world(store, f"epoch{announced['epoch']}", members.index(worker), len(members), device, backend,
                       timeout_s)
    return world, announced


class MembershipLost(RunFailure):
    """A survivor's collective failed and no new membership was announced within the collective
    timeout (a hung peer, not a lost one), or the membership fell below ``elastic.min_workers``."""

    kind = "membership"


NO_COMMIT = -2  # a newcomer's: older than any commit of its peers


@dataclass
class Commit:
    """The state the survivors roll back to: after ``step`` (-1: before the first)."""

    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]


class Membership:
    """This worker's view of the run's membership: ``worker`` is its rank at the start, its name in
    every file; ``world`` is the current process group's view (rank, size)."""

    def __init__(self, cfg: Any, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 start_step: int, joined: dict[str, Any] | None = None,
                 on_change: Callable[[dict[str, Any]], None] | None = None) -> None:
        """After the synchronizer's setup (its groups exist); commits the state before ``start_step``.
        ``joined``: a newcomer's admitting membership (join_world), whose commit is the peers' to send.
        ``on_change``: told each change (its epoch, lost and joined workers) before this rank goes
        on in it, and each loss as soon as it is seen (Synchronizer.membership_changed)."""
        self.worker, self.world = env_rank_layout()[0], world
        self.model, self.optimizer = model, optimizer
        self.commit_every = int(cfg.elastic.commit_every)
        self.rejoin_step: int | None = cfg.elastic.rejoin_step
        self.rejoin_wait = bool(cfg.elastic.rejoin_wait)
        self._join_at: dict[int, int] = {}  # membership epoch -> the step its members admit newcomers at
        self.world_size = int(cfg.world_size)
        self.epoch, self.members = (0, list(range(world.world_size))) if joined is None else (
            joined["epoch"], joined["members"])
        timeout = timedelta(seconds=float(cfg.timeouts.collective_s))
        self._port = int(os.environ["MASTER_PORT"])
        self._store = launcher_store(timeout)
        self.timeout_s = float(cfg.timeouts.collective_s)
        self.on_change = on_change
        # Epoch 0's timeline entry; one more per change (summary.json's ``membership``).
        self.timeline: list[dict[str, Any]] = [{"epoch": self.epoch, "step": start_step, "world_size": world.world_size,
                                                "members": self.members,
                                                "cause": "start" if joined is None else joined["cause"]}]
        # The changes since the last completed step (a loss, and a join right after it): each one's
        # downtime runs to the next completed step.
        self._resumed: list[dict[str, Any]] = []
        self.commit: Commit | None = None
        self._lock = threading.Lock()
        self._connections: dict[int, str] = {}  # fd -> its socket's inode link, of the current group
        self._severed = -1  # the newest epoch whose group's connections were shut
        self._closing = threading.Event()
        self._news = threading.Event()  # a newer membership is announced
        self._watcher = threading.Thread(target=self._watch, name="testbed-membership", daemon=True)
        self._watcher.start()
        self.save(start_step - 1 if joined is None else NO_COMMIT)

    # --- in the training loop -------------------------------------------------------------------

    def arm(self) -> None:
        """After the group and the synchronizer's own groups exist: note their connections (those a
        newer membership shuts; only where the synchronizer's ranks block in collectives)."""
        with self._lock:
            self._connections = _group_connections(self._port)

    def after_step(self, step: int) -> None:
        """Commit every ``commit_every`` steps; time the first step a new membership completes."""
        for change in self._resumed:
            change["downtime_s"] = round(time.time() - change.pop("detected_at"), 3)
        self._resumed.clear()
        if (step + 1) % self.commit_every == 0:
            self.save(step)

    def save(self, step: int) -> None:
        self.commit = Commit(step, {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                             copy.deepcopy(self.optimizer.state_dict()))

    def recoverable(self, exc: BaseException) -> bool:
        """A failure a new membership may mend: a lost peer, a collective's timeout, or a parameter
        server's refusal of a call of the old membership."""
        message = str(exc)
        if "membership changed" in message:
            return True
        return not isinstance(exc, RunFailure) and (lost_peer(message) or kind_of(exc) == "timeout")

    def due(self, step: int) -> bool:
        """Regroup before ``step``: a newer membership is announced (seen by the watcher), or newcomers
        may take lost workers' places."""
        return self._news.is_set() or self._admitting(step)

    def _admitting(self, step: int) -> bool:
        """From ``elastic.rejoin_step`` on, a membership short of a lost worker admits its newcomer:
        with ``elastic.rejoin_wait``, there, waiting for it; otherwise once it is ready, at the step
        worker 0 names when it sees that: the next one. No member of a synchronous membership can
        be past that step then, since finishing the step before it takes worker 0's part (an
        asynchronous one asks at its first boundary from it on)."""
        if self.rejoin_step is None or step < self.rejoin_step or len(self.members) >= self.world_size:
            return False
        if self.rejoin_wait:
            return True
        epoch = self.epoch
        if epoch not in self._join_at:
            if self.world.rank == 0 and self._store.check([joinable_key(epoch)]):
                self._store.set(join_at_key(epoch), str(step + 1))
            if not self._store.check([join_at_key(epoch)]):
                return False
            self._join_at[epoch] = int(self._store.get(join_at_key(epoch)))
        return step >= self._join_at[epoch]

    def admitted(self, resume: int | None) -> int:
        """A newcomer, after its synchronizer's setup over the admitting membership and its
        ``resume`` step (None: the replicas hold the model): receive the peers' commit, or only their
        buffers; the step to take part from."""
        if resume is None:
            return self._restore() + 1
        self._share_buffers()
        return resume

    def regroup(self, step: int, exc: BaseException | None, rebuild: Callable[[World, int], int | None]) -> int:
        """Wait for the next membership (``exc``: the failure that ``step`` ended in; None: announced
        before ``step`` began), form its group, let ``rebuild(world, epoch)`` set the rank's parts up
        for it, and return the step to go on from: ``rebuild``'s (a parameter server's workers go on
        where the servers are) or, where it returns None, the one after the newest commit, restored.
        Raises ``MembershipLost`` when none is announced in time."""
        asked = time.time()  # a join's pause starts here, at the boundary: the newcomer started long before
        asking = exc is None and self._admitting(step)
        if asking:
            self._store.add(admit_key(self.epoch), 1)
        while True:
            announced = self._announced(exc, asking)
            if is_join(announced):  # every peer is at this boundary: nothing is done again
                self.save(step - 1)
                announced["detected_at"] = asked
            joined = sorted(set(announced["members"]) - set(self.members))  # newcomers, whatever the announcement
            try:
                for epoch in range(self.epoch + 1, announced["epoch"] + 1):  # each change, those skipped included
                    self._tell(epoch, json.loads(self._store.get(epoch_key(epoch))))
                self._form(announced)
                formed = time.time()
                resume = rebuild(self.world, self.epoch)
                if resume is None:
                    resume = self._restore() + 1
                elif joined:  # the servers hold the model: a newcomer needs the buffers
                    self._share_buffers()
            except Exception as again:  # another worker lost while forming this one
                if not self.recoverable(again):
                    raise
                exc = again
                continue
            change = {"epoch": self.epoch, "step": resume, "world_size": len(self.members), "members": self.members,
                      "lost": announced["lost"], "joined": joined, "cause": announced["cause"],
                      "interrupted_step": step if exc is not None else None,
                      "rolled_back_steps": max(0, step - resume),  # completed steps done again
                      "regroup_s": round(formed - announced["detected_at"], 3),
                      "detected_at": announced["detected_at"]}
            self.timeline.append(change)
            self._resumed.append(change)
            log.warning("membership %d: workers %s go on from step %d (%s)", self.epoch, self.members, resume,
                        announced["cause"])
            return resume

    # --- the new membership ---------------------------------------------------------------------

    def _announced(self, exc: BaseException | None, asking: bool) -> dict[str, Any]:
        """The next membership, announced; ``asking``: this worker asked to admit newcomers."""
        try:
            self._store.wait([epoch_key(self.epoch + 1)], timedelta(seconds=self.timeout_s))
        except dist.DistStoreError:
            if asking:
                raise MembershipLost(f"worker {self.worker}: from elastic.rejoin_step={self.rejoin_step} on no "
                                     f"newcomer was admitted within timeouts.collective_s={self.timeout_s:g} (not "
                                     "ready, or a member never reached the step boundary to ask at)") from None
            raise MembershipLost(f"worker {self.worker}: a collective failed ({exc}) and no new membership was "
                                 f"announced within timeouts.collective_s={self.timeout_s:g}") from exc
        return newest_announcement(self._store, self.epoch + 1)

    def _form(self, announced: dict[str, Any]) -> None:
        """Leave the old process group and form the announced membership's."""
        with self._lock:  # the watcher must not shut sockets that the new group may reuse
            self._severed = max(self._severed, self.epoch)
            self._connections = {}
            self._news.clear()
        dist.destroy_process_group()
        self.epoch, self.members = announced["epoch"], announced["members"]
        if self.worker not in self.members:
            raise MembershipLost(f"worker {self.worker} is not in membership {self.epoch}")
        old = self.world
        self.world = form_world(self._store, f"epoch{self.epoch}", self.members.index(self.worker),
                                len(self.members), old.device, old.backend, old.timeout_s)

    def _restore(self) -> int:
        """The newest commit among the survivors, from the lowest rank that holds it; its step."""
        assert self.commit is not None  # saved before the first step
        newest = torch.tensor([self.commit.step], dtype=torch.int64)
        dist.all_reduce(newest, op=dist.ReduceOp.MAX)
        holder = torch.tensor([self.world.rank if self.commit.step == newest.item() else self.world.world_size])
        dist.all_reduce(holder, op=dist.ReduceOp.MIN)
        src = int(holder.item())
        state = [self.commit if self.world.rank == src else None]
        dist.broadcast_object_list(state, src=src)
        commit: Commit = state[0]  # type: ignore[assignment]
        self.model.load_state_dict(commit.model)
        self.optimizer.load_state_dict(copy.deepcopy(commit.optimizer))
        self.commit = commit
        return commit.step

    def _tell(self, epoch: int, announcement: dict[str, Any]) -> None:
        if self.on_change is not None:
            self.on_change({"epoch": epoch, "lost": announcement["lost"], "joined": announcement.get("joined", [])})

    def shared(self, value: Any) -> Any:
        """Worker 0's ``value`` (a picklable object) on every rank: what a newcomer cannot know."""
        values = [value]
        dist.broadcast_object_list(values, src=0)
        return values[0]

    def _share_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm's running statistics) on every rank: where the servers hold the
        parameters, all a newcomer lacks."""
        for buffer in self.model.buffers():
            dist.broadcast(buffer, src=0)

    # --- the watcher ----------------------------------------------------------------------------

    def _watch(self) -> None:
        """Shut this rank's connections of the current group once a newer membership is announced:
        a rank blocked on a live peer that stopped on the failure wakes at once. A membership that
        only admits newcomers wakes no one: its peers form it at ``elastic.rejoin_step``."""
        store = launcher_store(timedelta(seconds=60))
        seen = self.epoch  # the newest announcement read
        while not self._closing.is_set():
            seen = max(seen, self.epoch)
            try:
                store.wait([epoch_key(seen + 1)], timedelta(seconds=1))
            except dist.DistStoreError:
                continue
            seen += 1
            announcement = json.loads(store.get(epoch_key(seen)))
            if is_join(announcement):
                continue
            try:  # a survivor blocked on the servers (a pull waiting for the lost worker's push) wakes
                self._tell(seen, announcement)
            except Exception:  # the main thread tells them again before it goes on, and fails if it must
                log.warning("telling membership %d's change failed", seen, exc_info=True)
            with self._lock:
                if self._severed < self.epoch < seen:
                    self._news.set()
                    _shut(self._connections)
                    self._severed = self.epoch
            self._closing.wait(0.05)  # until the main thread has moved to the new membership

    def describe(self) -> list[dict[str, Any]]:
        """summary.json's ``membership``: the timeline, one entry per membership epoch."""
        return [{k: v for k, v in entry.items() if k != "detected_at"} for entry in self.timeline]

    def close(self) -> None:
        self._closing.set()
        self._watcher.join(timeout=2.0)


def _group_connections(store_port: int) -> dict[int, str]:
    """This process's connected TCP sockets but those to the store: the process group's."""
    inodes = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/self/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
            ports = {int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)}
            if state == "01" and store_port not in ports:  # ESTABLISHED
                inodes[f"socket:[{inode}]"] = True
    connections = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link in inodes:
            connections[int(fd)] = link
    return connections


def _shut(connections: dict[int, str]) -> None:
    """Shut (not close: the group still owns the descriptors) each socket that is still the one
    noted, so that both ends' pending operations fail."""
    for fd, link in connections.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed since (the group dropped a broken pair) and the number reused
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.detach()
