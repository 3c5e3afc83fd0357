"""The math of each family of synchronizers, replayed in one process in the order the clock gave.

- ``lockstep`` (allreduce, ring, tree, halving_doubling, ddp): every worker computes on the same
  parameters; their gradients are averaged in worker order and the trainer's optimizer steps.
- ``local_sgd``: every worker steps its own optimizer on its own replica; the replicas are averaged
  at the steps testbed.sync.local_sgd.averages_at names (gradients averaged before sync_steps).
- ``parameter_server``: real shards (testbed.ps.shard, their policies and optimizers) in this
  process take each push and serve each pull in the order the parameter-server simulation
  (testbed.sim.events.simulate_ps) saw them, so that staleness, SSP's gate and backup workers'
  choice follow from the clock; the shards refuse an order their mode would not allow.

Each family calls ``done(step, params)`` once every worker is past ``step`` (the parameter
server's: once the last push of it has landed), with the run's model at that point as a callable;
``done`` returning True stops the run there (a quality target met, target.stop).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn

from testbed.collectives.common import chunk_bounds
from testbed.compress import build_codec
from testbed.data import BatchSource, RankBatches
from testbed.eval.schedule import LrSchedule, with_schedule
from testbed.imbalance import loss_weight
from testbed.launch.virtual.codecs import VirtualCodecs
from testbed.launch.virtual.gradients import Gradients
from testbed.launch.virtual.membership import JOIN, LEAVE
from testbed.optim import build_optimizer
from testbed.ps import parameter_server_pb2 as pb
from testbed.sim.events import PULL, PUSH
from testbed.sync.base import flat_views
from testbed.sync.local_sgd import averages_at

Done = Callable[[int, Callable[[], torch.Tensor]], bool]


@dataclass
class Work:
    """What every family computes with: each worker's batches and their sizes at every step, the
    gradients, the schedule."""

    batches: list[BatchSource]  # each worker's objective over its samples (testbed.models.objective_batches)
    samples: list[RankBatches]  # each worker's samples, resized to the step's share of the global batch
    # Each worker's (columns) samples per micro-step at each step (rows): the clock's; 0 where the
    # worker is not a member (testbed.launch.virtual.membership).
    sizes: np.ndarray
    accumulate: int
    gradients: Gradients
    schedule: LrSchedule
    # Per distinct split: its members, their sizes and loss weights.
    _splits: dict[bytes, tuple[list[int], list[int], list[float]]] = field(default_factory=dict, init=False)
    _resized: dict[int, bytes] = field(default_factory=dict, init=False)  # the split each worker's samples hold

    def members(self, step: int) -> list[int]:
        """The workers of ``step``'s membership, in worker order."""
        return self._members(step)[0]

    def _members(self, step: int) -> tuple[list[int], list[int], list[float]]:
        key = self.sizes[step].tobytes()
        if key not in self._splits:
            members = [w for w, size in enumerate(self.sizes[step].tolist()) if size]
            sizes = [int(self.sizes[step, w]) for w in members]
            self._splits[key] = members, sizes, [loss_weight(sizes, r) for r in range(len(members))]
        return self._splits[key]

    def _split(self, worker: int, step: int) -> float:
        """Resize ``worker``'s samples to ``step``'s split of the global batch (balanced batches:
        the clock's decision; a new membership: its workers', the worker renumbered among them)
        where it changed; the worker's loss weight. Each distinct split's weights are computed once:
        they change only at a balance decision or a membership change."""
        members, sizes, weights = self._members(step)
        rank = members.index(worker)
        key = self.sizes[step].tobytes()
        if self._resized.get(worker) != key:
            self.samples[worker].resize(sizes, rank)
            self._resized[worker] = key
        return weights[rank]

    def grads(self, params: torch.Tensor, workers: list[int], steps: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradients, losses) of ``workers`` at their ``steps``, at ``params`` (one flat tensor, or a
        row each): summed over the accumulation window's micro-steps, each loss scaled 1/k and
        weighted by its share of the global batch (testbed.imbalance.loss_weight), as the trainer
        does; the loss is the micro-steps' mean."""
        k, total, losses = self.accumulate, None, []
        for micro in range(k):
            weights = [self._split(w, s) / k for w, s in zip(workers, steps)]
            pairs = [self.batches[w].batch(s * k + micro) for w, s in zip(workers, steps)]
            g, loss = self.gradients.compute(params, [x for x, _ in pairs], [y for _, y in pairs], weights)
            total = g if total is None else total.add_(g)
            losses.append(loss)
        assert total is not None
        return total, torch.stack(losses).mean(0) if k > 1 else losses[0]


@dataclass
class Outcome:
    """What the math adds to the clock's step records: each step's (rows) loss and staleness per
    worker (columns); NaN and -1 where a worker computed nothing or nothing stale."""

    loss: np.ndarray
    staleness: np.ndarray

    @classmethod
    def empty(cls, steps: int, n: int) -> Outcome:
        return cls(np.full((steps, n), np.nan), np.full((steps, n), -1, dtype=int))


def _mean(rows: torch.Tensor) -> torch.Tensor:
    """The rows' mean, summed in row (worker) order."""
    total = rows[0].clone()
    for row in rows[1:]:
        total.add_(row)
    return total.div_(len(rows))


class Family(ABC):
    def __init__(self, cfg: Any, plain: dict[str, Any], work: Work, model: nn.Module, outcome: Outcome,
                 order: list[tuple[int, int, int]] | None) -> None:
        """``order``: a parameter server's pushes and pulls (testbed.sim.events.PsTrace.order, or a
        real run's, testbed.launch.virtual.replay)."""
        self.cfg, self.plain, self.work, self.model = cfg, plain, work, model
        self.outcome, self.order = outcome, order
        self.n, self.steps = int(cfg.world_size), int(cfg.steps)

    @abstractmethod
    def run(self, done: Done) -> torch.Tensor:
        """Train; the final model's flat parameters (rank 0's, as a real run saves)."""

    def facts(self) -> dict[str, Any]:
        return {}


class Lockstep(Family):
    """With ``launcher.fixed_delay`` = s, every step's gradients are computed at the parameters of s
    steps before (the first steps' at the initial ones): staleness as a fixed delay (Dai et al. 2019),
    which no real synchronizer makes. With a codec, every worker's real codecs reduce the gradients
    (testbed.launch.virtual.codecs)."""

    def run(self, done: Done) -> torch.Tensor:
        params, grads = flat_views(self.model, torch.device("cpu"))
        optimizer = build_optimizer(self.cfg.optim, self.model.parameters())
        delay = int(self.cfg.launcher.get("fixed_delay") or 0)
        codecs = None
        if self.cfg.compress.name != "none":
            codecs = VirtualCodecs(self.cfg.compress, self.cfg.sync.get("bucket_mb"), self.model, self.n,
                                   int(self.cfg.seed), float(self.cfg.timeouts.collective_s))
        try:
            return self._steps(done, params, grads, optimizer, delay, codecs)
        finally:
            if codecs is not None:
                codecs.close()

    def _steps(self, done: Done, params: torch.Tensor, grads: torch.Tensor, optimizer: torch.optim.Optimizer,
               delay: int, codecs: VirtualCodecs | None) -> torch.Tensor:
        earlier = deque([params.clone()] * delay)  # the parameters of the last `delay` steps, oldest first
        for step in range(self.steps):
            _set_lr(optimizer, self.work.schedule.lr_at(step))
            if delay:
                earlier.append(params.clone())
            at = earlier.popleft() if delay else params
            members = self.work.members(step)  # everyone, but after a loss (elastic.enabled)
            g, losses = self.work.grads(at, members, [step] * len(members))
            if delay:
                self.outcome.staleness[step] = min(step, delay)
            grads.copy_(_mean(g) if codecs is None else codecs.mean(g))
            optimizer.step()
            self.outcome.loss[step, members] = losses.numpy()
            if done(step, lambda: params):
                break
        return params


class LocalSgd(Family):
    def run(self, done: Done) -> torch.Tensor:
        sync = self.cfg.sync
        replicas = self.work.gradients.initial().repeat(self.n, 1)
        own = [nn.Parameter(replicas[w]) for w in range(self.n)]  # views: each optimizer steps its row
        optimizers = [build_optimizer(self.cfg.optim, [p]) for p in own]
        everyone = list(range(self.n))
        for step in range(self.steps):
            lr = self.work.schedule.lr_at(step)
            g, losses = self.work.grads(replicas, everyone, [step] * self.n)
            mean = _mean(g) if step < int(sync.sync_steps) else None  # post-local SGD's synchronous start
            for w, (p, optimizer) in enumerate(zip(own, optimizers)):
                p.grad = mean if mean is not None else g[w]
                _set_lr(optimizer, lr)
                optimizer.step()
            if mean is None and averages_at(sync, step):
                replicas.copy_(_mean(replicas).expand_as(replicas))
            self.outcome.loss[step] = losses.numpy()
            if done(step, lambda: _mean(replicas)):  # between averages the run's model is the replicas' mean
                break
        return replicas[0]


class ParameterServer(Family):
    def run(self, done: Done) -> torch.Tensor:
        from testbed.data import data_kind  # the shards' optimizer follows the run's schedule
        from testbed.ps.shard import Shard

        sync, n = self.cfg.sync, self.n
        initial = self.work.gradients.initial()
        self.bounds = chunk_bounds(initial.numel(), int(sync.servers))
        optim = OmegaConf.create(with_schedule(self.plain, data_kind(self.cfg.data.name).train_size(self.cfg.data)))
        backup, seed = int(sync.backup_workers), int(self.cfg.seed)
        compress = self.cfg.compress if self.cfg.compress.name != "none" else None
        self.shards = [Shard(i, n, str(sync.mode), int(sync.staleness), optim, int(sync.chunk_kb) * 1024, compress,
                             seed, False, backup) for i in range(len(self.bounds))]
        # Each worker's codec of each shard's range, as a real worker holds them (testbed.sync.ps):
        # its error-feedback residual, its draws.
        self.codecs = [[build_codec(compress, initial[lo:hi], [torch.Size([hi - lo])], i, w, seed)
                        for i, (lo, hi) in enumerate(self.bounds)] for w in range(n)] if compress is not None else None
        for shard, (lo, hi) in zip(self.shards, self.bounds):
            with shard.cond:
                shard.hold(initial[lo:hi].clone())
        try:
            return self._replay(done, initial)
        finally:
            for shard in self.shards:
                shard.close()

    def _replay(self, done: Done, initial: torch.Tensor) -> torch.Tensor:
        assert self.order is not None
        order, n, k = self.order, self.n, len(self.shards)
        held = [initial] * n  # the parameters each worker holds, and their version on each shard
        versions = [(0,) * k] * n
        ahead: list[deque[tuple[int, int]]] = [deque() for _ in range(n)]  # each worker's events to come
        expected = np.zeros(self.steps, dtype=int)  # pushes each step takes
        for kind, worker, step in order:
            if kind in (PUSH, PULL):
                ahead[worker].append((kind, step))
            if kind == PUSH:
                expected[step] += 1
        landed, complete, epoch = np.zeros(self.steps, dtype=int), 0, 0
        computed: dict[int, tuple[torch.Tensor, float]] = {}
        for kind, worker, step in order:
            if kind in (LEAVE, JOIN):  # a membership change (testbed.launch.virtual.membership), at a step boundary
                epoch += 1
                for shard in self.shards:
                    if kind == LEAVE:
                        shard.leave(pb.LeaveRequest(worker=worker, epoch=epoch))
                    else:
                        shard.join(pb.JoinRequest(worker=worker, epoch=epoch))
                if kind == JOIN:  # the newcomer pulls the model, at the members' clock
                    pulled = [shard.pull_local(worker, step) for shard in self.shards]
                    held[worker] = torch.cat([params for params, _ in pulled])
                    versions[worker] = tuple(version for _, version in pulled)
                continue
            ahead[worker].popleft()
            if kind != PUSH:  # a pull released: the servers' parameters now
                pulled = [shard.pull_local(worker, step + 1) for shard in self.shards]
                held[worker] = torch.cat([params for params, _ in pulled])
                versions[worker] = tuple(version for _, version in pulled)
                continue
            if worker not in computed:
                computed.update(self._compute_ready(ahead, held, versions, worker, step))
            grad, loss = computed.pop(worker)
            staleness = max(shard.push_local(worker, versions[worker][i], self._payload(worker, i, grad[lo:hi].clone()))
                            for i, (shard, (lo, hi)) in enumerate(zip(self.shards, self.bounds)))
            self.outcome.loss[step, worker], self.outcome.staleness[step, worker] = loss, staleness
            landed[step] += 1
            while complete < self.steps and landed[complete] == expected[complete]:
                complete += 1
                if done(complete - 1, self._current):
                    return self._current()
        return self._current()

    def _payload(self, worker: int, shard: int, gradient: torch.Tensor) -> torch.Tensor:
        """What ``worker`` pushes of ``shard``'s range: the gradient, or its codec's payload."""
        return gradient if self.codecs is None else self.codecs[worker][shard].compress(gradient)

    def _compute_ready(self, ahead: list[deque[tuple[int, int]]], held: list[torch.Tensor],
                       versions: list[tuple[int, ...]], worker: int, step: int) -> dict[int, tuple[torch.Tensor, float]]:
        """The gradients of ``worker`` at ``step`` and of every other worker whose next event is a push
        (its parameters are known and will not change before it): those holding one version in one
        vectorized call each, the others in one over their rows."""
        ready = {worker: step} | {w: q[0][1] for w, q in enumerate(ahead) if w != worker and q and q[0][0] == PUSH}
        by_version: dict[tuple[int, ...], list[int]] = {}
        for w in ready:
            by_version.setdefault(versions[w], []).append(w)
        groups = [(held[ws[0]], ws) for ws in by_version.values() if len(ws) > 1]
        alone = [ws[0] for ws in by_version.values() if len(ws) == 1]
        if alone:
            groups.append((torch.stack([held[w] for w in alone]) if len(alone) > 1 else held[alone[0]], alone))
        out = {}
        for params, workers in groups:
            grads, losses = self.work.grads(params, workers, [ready[w] for w in workers])
            out.update({w: (grads[i], float(losses[i])) for i, w in enumerate(workers)})
        return out

    def _current(self) -> torch.Tensor:
        """The servers' parameters, once any update in progress is applied."""
        parts = []
        for shard in self.shards:
            with shard.cond:
                shard.cond.wait_for(shard.settled)
                shard.check_updating()
                assert shard.params is not None
                parts.append(shard.params.detach().clone())
        return torch.cat(parts)

    def facts(self) -> dict[str, Any]:
        histogram: dict[int, int] = {}
        for shard in self.shards:
            for staleness, count in shard.histogram.items():
                histogram[staleness] = histogram.get(staleness, 0) + count
        return {"shards": len(self.shards), "server_staleness_histogram":
                [histogram.get(s, 0) for s in range(max(histogram, default=-1) + 1)]}


def _set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


FAMILY_CLASSES: dict[str, type[Family]] = {"lockstep": Lockstep, "local_sgd": LocalSgd,
                                           "parameter_server": ParameterServer}
