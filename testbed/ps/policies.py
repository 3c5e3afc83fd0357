"""How a shard serves pushes and pulls in each mode: one policy class per mode.

- ``sync`` (BSP): pushes for a step are staged until all workers have pushed; then their mean is
  applied in one optimizer step and the waiting pulls are released. This is all-reduce training.
  The step runs block by block (a few of the pull's chunks each) on a thread of its own, and a
  pull sends each chunk as soon as it is updated, so the update overlaps the pulls instead of
  delaying them.
- ``async`` (ASP): each push is applied on arrival, scaled by 1/workers so that a round of pushes
  moves the parameters as far as one synchronous step.
- ``ssp``: applied on arrival as in async, but a worker's pull blocks while its clock (pushes made)
  is more than ``--staleness`` ahead of the slowest worker's.
- backup workers (``--backup-workers b``, a sync mode; Chen et al. 2016, "Revisiting Distributed
  Synchronous SGD"): of n workers, each step's update takes the first n - b pushes and the other b
  never push. Who is first is decided once per step for every shard, by the workers (an atomic
  counter in the job's store, testbed.sync.ps), so every shard averages the same workers and the
  update is a true mini-batch mean; here a push beyond the n - b is refused. Workers run ahead of
  a late one, so a pull may still stream an old version when the next update is due: the update
  waits for it rather than tearing it.
- summation-only (``--sums-only``, BytePS's summation service, a sync mode): the shard runs no
  optimizer: it holds the mean of a step's pushes, which the pulls stream back, and the workers
  step their own optimizers with it. Pushes are folded in partition by partition as they arrive,
  and a pull may be open while its worker still pushes: each partition streams back as soon as
  every worker has pushed it, so pushes and pulls share the link's two directions (BytePS's
  pipelining). A summation-only push is therefore not staged whole before it counts: one refused
  mid-stream fails the step for every worker, with its reason.

A policy holds what its mode does differently (whether a pull may proceed, what a push does, what
a pull streams) and the state only its mode has; the rest is the shard's (testbed.ps.shard), which
never asks which mode it runs. A new mode is one class here.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import grpc
import torch

from testbed.ps import parameter_server_pb2 as pb
from testbed.ps.shard_checkpoint import save_if_agreed
from testbed.ps.validation import Refused, receive
from testbed.ps.wire import Chunk, StepNorms

if TYPE_CHECKING:
    from testbed.ps.shard import Shard

log = logging.getLogger(__name__)

NORMS_KEPT = 8  # versions whose update's norms a sync shard keeps for late pulls


class Policy(ABC):
    """The hooks a mode fills in; each is called by the shard, under its lock unless it says not."""

    optimizes: ClassVar[bool] = True  # the shard runs an optimizer (else its values are the mean gradient)
    # Every worker pulls the same parameters at a version: one held copy for all (testbed.ps.held_copies).
    shared_pulls: ClassVar[bool] = False
    pull_lead: ClassVar[int] = 0  # pushes a pull's clock may be ahead of its worker's
    # elastic.enabled: a push or pull of an older membership is refused (a step of the old one is
    # pushed again); where pushes apply on arrival, an old one is as good as any.
    epoch_bound: ClassVar[bool] = False

    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def hold(self) -> None:
        """The shard has just taken its parameters: allocate or start what the mode needs."""

    def check_push(self, worker: int, first: Chunk) -> None:
        """Refuse a push (whose first chunk is ``first``) that the mode does not take now."""

    def push(self, worker: int, first: Chunk, stream: Iterator[Chunk], epoch: int = 0) -> pb.PushReply:
        """(Outside the lock) receive ``worker``'s push of membership ``epoch``, already marked in
        progress: by default the whole stream is validated, then staged and committed (Shard.staged_push)."""
        return self.shard.staged_push(worker, first, stream, epoch)

    def leave(self, worker: int) -> None:
        """(Under the lock) ``worker`` has left the run (elastic.enabled): the shard's members no longer have it."""

    def check_join(self, worker: int, clock: int) -> None:
        """(Under the lock) refuse a newcomer admitted at ``clock`` where the mode cannot take it in."""

    def join(self, worker: int) -> None:
        """(Under the lock) ``worker``, a newcomer, is a member from now on (elastic.rejoin_step)."""

    @abstractmethod
    def commit(self, worker: int, base: int) -> int:
        """``worker``'s push on version ``base`` is staged and counted: apply it, or not yet, and
        record it in the staleness histogram; its staleness."""

    def advance(self, worker: int) -> None:
        """A Clock request moves ``worker``'s clock without a push (a skipped step)."""
        shard = self.shard
        shard.clocks[worker] += 1
        save_if_agreed(shard)

    def check_pull(self, worker: int, clock: int) -> None:
        """Refuse a pull at a clock that ``worker`` could not have reached (it would wait for ever)."""
        shard = self.shard
        if clock > shard.clocks[worker] + self.pull_lead:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"Pull: worker {worker} at clock {clock} has pushed only {shard.clocks[worker]} times")

    def may_pull(self, worker: int, clock: int) -> bool:
        """Whether ``worker``'s pull at ``clock`` (its pushes so far) may proceed."""
        return True

    def pull_version(self, clock: int) -> int:
        return self.shard.version

    @abstractmethod
    def pull_source(self, worker: int) -> torch.Tensor:
        """The parameters ``worker``'s (whole) pull streams from."""

    def stream(self, messages: Iterator[Any], clock: int, version: int) -> Iterator[Any]:
        """(Outside the lock) a pull's messages of parameters at ``version``, one per partition,
        released as the mode allows."""
        return messages


class Sync(Policy):
    shared_pulls = True  # nothing changes until every worker has pushed again
    epoch_bound = True  # a step's pushes split one global batch among one membership

    def __init__(self, shard: Shard) -> None:
        super().__init__(shard)
        self.needed = shard.workers  # pushes that complete a step
        self.chosen: list[int] = []  # the workers whose pushes the step in progress averages
        self.chosen_sq: list[float | None] = []  # their own squared gradient norms (stats.noise_scale)

    def hold(self) -> None:
        threading.Thread(target=self._update_loop, name=f"ps{self.shard.shard}-update", daemon=True).start()

    def check_push(self, worker: int, first: Chunk) -> None:
        shard = self.shard
        if worker in shard.pending:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker} already pushed step {shard.version}")
        if first.step != shard.version:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"sync push for version {first.step}, but the shard is at version {shard.version}")

    def commit(self, worker: int, base: int) -> int:
        shard = self.shard
        shard.pending.add(worker)
        if len(shard.pending) == self.needed:  # the step is complete: hand it to the update thread
            self.chosen = sorted(shard.pending)  # summed in worker order, whatever the arrival order
            self.chosen_sq = [shard.local_sq[w] for w in self.chosen]
            shard.version += 1
            shard.applied = 0
            shard.pending.clear()
        shard.histogram[0] += 1
        return 0

    def advance(self, worker: int) -> None:
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "sync mode advances clocks only by pushing")

    def leave(self, worker: int) -> None:
        """The step needs the members' pushes from now on. A step still short of its pushes is
        dropped: the survivors push it again over the same global batch, split among fewer of
        them (a completed step, whose update may be running, stands)."""
        shard = self.shard
        self.needed = len(shard.members) - shard.backup_workers
        for w in shard.pending:
            shard.clocks[w] -= 1
            shard.staged[w] = []
        shard.pending.clear()

    def check_join(self, worker: int, clock: int) -> None:
        """A newcomer starts a step: it joins none that a member has pushed."""
        shard = self.shard
        if shard.pending or shard.pushing or clock != shard.version:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"worker {worker} at clock {clock}, but the shard is at version {shard.version} with "
                          f"{len(shard.pending | shard.pushing)} pushes of it in: a newcomer joins at a step boundary")

    def join(self, worker: int) -> None:
        self.needed = len(self.shard.members) - self.shard.backup_workers

    def update_due(self) -> bool:
        """(Under the lock) a completed step waits for its update."""
        return not self.shard.updated()

    def may_pull(self, worker: int, clock: int) -> bool:
        return self.shard.version >= clock

    def pull_source(self, worker: int) -> torch.Tensor:
        assert self.shard.params is not None
        return self.shard.params.detach()

    def stream(self, messages: Iterator[Any], clock: int, version: int) -> Iterator[Any]:
        """Each message generated only once its partition is updated (pull_messages chunks as the
        partitions are cut), so that none reads stale values. A newer step completed meanwhile
        (backup workers) has its update wait for this pull: ``version`` is whole."""
        shard = self.shard

        def ready(part: int) -> bool:
            return shard.applied > part or shard.version > version or bool(shard.refusal)

        for part in range(len(shard.parts)):
            if not ready(part):
                with shard.cond:
                    shard.cond.wait_for(lambda part=part: ready(part))
            shard.check_updating()
            message = next(messages, None)
            if message is None:
                raise Refused(grpc.StatusCode.INTERNAL, f"shard {shard.shard}: pull has fewer messages than partitions")
            yield message
        if next(messages, None) is not None:
            raise Refused(grpc.StatusCode.INTERNAL, f"shard {shard.shard}: pull has more messages than partitions")

    def _update_loop(self) -> None:
        """Each completed step's update, block by block, outside the lock: nothing else touches a
        partition's parameters, gradient or staged pushes until it is done (pulls wait for it,
        pushes for the last one)."""
        shard = self.shard
        while True:
            with shard.cond:
                shard.cond.wait_for(lambda: self.update_due() or bool(shard.refusal))
                if shard.refusal:  # stopping, or a failed update: nothing more to apply
                    return
                step, chosen = shard.version - 1, self.chosen  # the step the chosen workers pushed
                local_sq = self.chosen_sq
            # stats.noise_scale: every push carried its worker's own norm, so the update measures its own
            measure = all(sq is not None for sq in local_sq)
            start, slice_sq = time.perf_counter(), 0.0
            try:
                for block in range(len(shard.blocks)):
                    slice_sq += shard.step_block(block, chosen, step, self.needed, measure)
                    with shard.cond:
                        shard.applied = shard.blocks[block].stop
                        if shard.updated():
                            shard.staged = [[] for _ in range(shard.workers)]  # the received messages can go
                            shard.apply_seconds += time.perf_counter() - start
                            if measure:
                                mean_sq = sum(sq or 0.0 for sq in local_sq) / len(chosen)
                                self._measured(step + 1, StepNorms(mean_sq, slice_sq, len(chosen)))
                            save_if_agreed(shard)
                        shard.cond.notify_all()
            except Exception as exc:  # every later push and pull is refused with it
                log.exception("shard %d: update of version %d failed", shard.shard, shard.version)
                with shard.cond:
                    shard.refusal = f"the update failed: {type(exc).__name__}: {exc}"
                    shard.applied = len(shard.parts)
                    shard.cond.notify_all()
                return

    def _measured(self, version: int, norms: StepNorms) -> None:
        """(Under the lock) keep the norms of the update that made ``version`` for its pulls' trailers;
        a pull streams the newest version or, with backup workers, one of the few before it."""
        shard = self.shard
        shard.norms[version] = norms
        for old in [v for v in shard.norms if v < version - NORMS_KEPT]:
            del shard.norms[old]


class Backup(Sync):
    """Sync with backup workers: a step is complete with the first ``needed`` of its pushes."""

    def __init__(self, shard: Shard) -> None:
        super().__init__(shard)
        self.needed = shard.workers - shard.backup_workers

    def check_push(self, worker: int, first: Chunk) -> None:
        super().check_push(worker, first)
        shard = self.shard
        if len(shard.pending | shard.pushing) >= self.needed:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"worker {worker}: step {shard.version} has its {self.needed} pushes already (in progress or "
                          f"staged); with {shard.backup_workers} backup workers a late worker does not push")

    def check_pull(self, worker: int, clock: int) -> None:
        """A worker that did not push may pull the step after the one it computed; none is further
        ahead than the shard's next version."""
        shard = self.shard
        if clock > shard.version + 1:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"Pull: worker {worker} at clock {clock}; the shard is at "
                                                            f"version {shard.version}")

    def update_due(self) -> bool:
        """...and for the pulls still streaming the version before it: the update would tear them."""
        shard = self.shard
        return not shard.updated() and not shard.reading[shard.version - 1]


class Async(Policy):
    def hold(self) -> None:
        params = self.shard.params
        assert params is not None
        # Each worker's pull streams from a copy: updates may land while it streams.
        self.snapshots = torch.zeros(self.shard.workers, params.numel(), dtype=params.dtype)

    def commit(self, worker: int, base: int) -> int:
        shard = self.shard
        staleness = shard.version - base
        start = time.perf_counter()
        for block in range(len(shard.blocks)):  # 1/members: a round of pushes moves as far as a sync step
            shard.step_block(block, [worker], shard.clocks[worker] - 1, len(shard.members))
        shard.staged[worker] = []
        shard.apply_seconds += time.perf_counter() - start
        shard.version += 1
        shard.histogram[staleness] += 1
        save_if_agreed(shard)
        return staleness

    def pull_source(self, worker: int) -> torch.Tensor:
        assert self.shard.params is not None
        source = self.snapshots[worker]
        source.copy_(self.shard.params.detach())
        return source


class Ssp(Async):
    def may_pull(self, worker: int, clock: int) -> bool:
        shard = self.shard
        return clock - min(shard.clocks[w] for w in shard.members) <= shard.staleness


class SumsOnly(Sync):
    optimizes = False
    pull_lead = 1  # a pull may be open while its worker's push of that step streams

    def __init__(self, shard: Shard) -> None:
        super().__init__(shard)
        self.delivered = [0] * shard.workers  # partitions each worker has pushed this step
        self.summed = 0  # partitions of the step in progress summed

    def hold(self) -> None:
        """Nothing to start: the pushes are summed as they arrive."""

    def push(self, worker: int, first: Chunk, stream: Iterator[Chunk], epoch: int = 0) -> pb.PushReply:
        """Folded in chunk by chunk: one chunk per partition (elastic runs refuse the summation
        service, so ``epoch`` is always the first)."""
        shard = self.shard
        params = shard.params
        assert params is not None
        with shard.cond:
            shard.pending.add(worker)
        try:
            receive("Push", shard.shard, first, stream, params.numel(), params.dtype, worker_bound=shard.workers,
                    same=("worker", "step"), changed="worker and step must not change mid-stream",
                    take=lambda chunk: self._fold(worker, chunk))
        except Refused as refused:  # partitions of it may be summed already: the step cannot complete
            with shard.cond:
                shard.refusal = f"the update failed: a push of worker {worker} was refused mid-stream ({refused})"
                shard.cond.notify_all()
            raise
        finally:
            with shard.cond:
                shard.pushing.discard(worker)
        with shard.cond:
            shard.clocks[worker] += 1
            shard.stats["pushes"] += 1
            shard.stats["bytes_in"] += params.numel() * params.element_size()
            shard.histogram[0] += 1
            return pb.PushReply(version=shard.version, staleness=0)

    def _fold(self, worker: int, chunk: Chunk) -> None:
        """Stage one partition of ``worker``'s push; sum, in order, every partition all workers have
        now pushed, into the values that pulls stream; the last one completes the step."""
        shard = self.shard
        assert shard.params is not None
        part = self.delivered[worker]
        lo, hi = shard.parts[part]
        if chunk.length != hi - lo:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"Push: a chunk of {chunk.length} elements for partition "
                          f"{part} of {hi - lo}: a summation-only shard takes pushes in its partitions (its --chunk-kb)")
        with shard.cond:
            shard.staged[worker].append(torch.frombuffer(chunk.data, dtype=shard.params.dtype))
            self.delivered[worker] += 1
            start = time.perf_counter()
            everyone = range(shard.workers)
            for ready in range(self.summed, min(self.delivered)):
                shard.gradient(ready, everyone, shard.workers)  # lands in the values
            self.summed = max(self.summed, min(self.delivered))
            shard.apply_seconds += time.perf_counter() - start
            if self.summed == len(shard.parts):
                shard.version += 1
                self.summed, self.delivered = 0, [0] * shard.workers
                shard.staged = [[] for _ in everyone]
                shard.pending.clear()
            shard.cond.notify_all()

    def _summed(self, clock: int, part: int) -> bool:
        """Partition ``part`` holds step ``clock``'s sum."""
        return self.shard.version >= clock or (self.shard.version == clock - 1 and self.summed > part)

    def may_pull(self, worker: int, clock: int) -> bool:
        return self._summed(clock, 0)  # held back until the first partition is summed: the slowest worker's push

    def pull_version(self, clock: int) -> int:
        return clock

    def stream(self, messages: Iterator[Any], clock: int, version: int) -> Iterator[Any]:
        """Each message once its partition holds step ``clock``'s sum."""
        shard = self.shard
        for part in range(len(shard.parts)):
            with shard.cond:
                shard.cond.wait_for(lambda part=part: self._summed(clock, part) or bool(shard.refusal))
                shard.check_updating()
            yield next(messages)


POLICIES: dict[str, type[Policy]] = {"sync": Sync, "async": Async, "ssp": Ssp}


def policy_for(mode: str, sums_only: bool, backup_workers: int = 0) -> type[Policy]:
    """The policy of ``mode`` (testbed.ps.modes.MODES); ``sums_only``: the summation service;
    ``backup_workers``: pushes per step the sync mode goes without."""
    if sums_only or backup_workers:
        if mode != "sync":
            raise ValueError(f"{'a summation-only shard' if sums_only else 'backup workers'} run in sync mode, not {mode}")
        if sums_only and backup_workers:
            raise ValueError("a summation-only shard has no backup workers: every worker steps with the sum")
        return SumsOnly if sums_only else Backup
    return POLICIES[mode]
