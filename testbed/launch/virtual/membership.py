"""Elastic membership on a virtual cluster: a worker lost (``fault=kill_rank``) and its newcomer
(``elastic.rejoin_step``), on the clock, as testbed.elastic makes them on real processes.

The run is cut into memberships. Each is predicted by the simulator over its own workers (their
own columns of the cluster's draws), which split the same global batch evenly
(``elastic.batch=keep_global``). Between two, the clock charges what the change costs:

- **a loss** at the start of step s: the survivors compute step s and block in its synchronization,
  regroup (``cluster.membership.regroup_ms``) and restore the newest commit, whose holder broadcasts
  parameters and optimizer state (the all-reduce family; a parameter server holds the model, and
  each survivor pulls it). The new membership goes on from the step after the commit: steps done
  since (``elastic.commit_every`` > 1) and step s are done again, and their time is lost;
- **a join**: the newcomer starts when the loss is seen and is ready ``cluster.membership.start_s``
  later. The members admit it at the first step boundary from ``elastic.rejoin_step`` on at which
  it is ready (``elastic.rejoin_wait``: at that step, waiting for it), pausing for the new group
  (``join_ms``) and the state the newcomer receives.

A change's cost is the members' synchronization time in the first step the new membership
completes. Each change is an entry of summary.json's ``membership``, as a real run's; a parameter
server's order gains LEAVE and JOIN events, which the virtual shards take as a real shard takes
Leave and Join.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from testbed.faults import fault_step
from testbed.imbalance import shard_batches
from testbed.netem.links import parse_rate
from testbed.sim.step import Compute, Prediction
from testbed.step_record import StepRecord

LEAVE, JOIN = 2, 3  # a parameter server's order: a worker leaves, or joins, before the events after it

Predict = Callable[[DictConfig, np.ndarray], Prediction]  # one membership's clock: its config, its draws


@dataclass
class Timeline:
    """The clock of a whole run, memberships stitched."""

    records: list[list[StepRecord]]  # per worker, the steps it completed (its rank: the worker)
    sizes: np.ndarray  # each worker's (columns) samples per micro-step at each step (rows); 0: not a member
    ends: np.ndarray  # when each step's last member finished it
    order: list[tuple[int, int, int]] | None  # a parameter server's events (testbed.sim.events.PsTrace.order)
    facts: dict[str, Any]
    membership: list[dict[str, Any]] | None  # summary.json's ``membership``; None: not elastic


@dataclass
class _Segment:
    first: int  # its first step
    members: list[int]
    prediction: Prediction
    pause_s: float = 0.0  # charged to the members' first step: the change that began the membership
    undone_s: float = 0.0  # of it, the steps done before the change and again after it

    def ends(self, start_s: float) -> np.ndarray:
        steps = np.array([[r.t_step for r in rows] for rows in self.prediction.records])
        steps[:, 0] += self.pause_s
        return start_s + np.cumsum(steps, axis=1).max(axis=0)


def timeline(cfg: DictConfig, compute: Compute, paced: np.ndarray, state_bytes: int, predict: Predict) -> Timeline:
    """The run's clock: one membership, or the memberships a loss and a join make. ``paced``: each
    worker's draws (steps × workers); ``state_bytes``: parameters and optimizer state, what a
    restore or a newcomer receives."""
    n, steps = int(cfg.world_size), int(cfg.steps)
    lost_at = fault_step(cfg.fault, int(cfg.seed), steps) if cfg.elastic.enabled else None
    if lost_at is None or lost_at >= steps:
        whole = predict(cfg, paced)
        trace = whole.trace
        entries = [_entry(0, 0, list(range(n)), "start")] if cfg.elastic.enabled else None
        return Timeline(whole.records, whole.batches, _Segment(0, list(range(n)), whole).ends(0.0),
                        trace.order if trace is not None else None, whole.facts, entries)

    lost, members = int(cfg.fault.rank), list(range(n))
    survivors = [w for w in members if w != lost]
    ps = cfg.sync.name == "ps"
    commit_every = 1 if ps else int(cfg.elastic.commit_every)
    resume = lost_at // commit_every * commit_every  # the step after the newest commit
    before = _Segment(0, members, predict(_sized(cfg, n, lost_at), paced[:lost_at]))
    loss_s = float(before.ends(0.0)[-1])
    costs = _Costs(cfg, compute, state_bytes)
    # The survivors' step lost_at on the old split, then the new group and the restored commit.
    interrupted = max(float(paced[lost_at, w]) * costs.compute_s(n) for w in survivors)
    restore = costs.pull_s(len(survivors)) if ps else costs.broadcast_s(len(survivors))
    undone = loss_s - (float(before.ends(0.0)[resume - 1]) if resume else 0.0)  # steps since the commit
    # The lost worker's steps since the commit stay in its log, as a real one's: it completed them.
    completed = before.prediction.records[lost][resume:]
    before = _Segment(0, members, _truncated(before.prediction, resume))
    pause = undone + interrupted + costs.regroup_s + restore
    left = _Segment(resume, survivors, predict(_sized(cfg, len(survivors), steps - resume),
                                               paced[resume:, survivors]), pause, undone)
    segments, changes = [before, left], [_entry(1, resume, survivors, f"fault=kill_rank: worker {lost} killed at "
                                                f"the start of step {lost_at}", lost=[lost])]
    changes[-1].update(interrupted_step=lost_at, rolled_back_steps=lost_at - resume,
                       regroup_s=round(interrupted + costs.regroup_s, 6))
    joined_at = _join_step(cfg, left, loss_s - undone, loss_s + costs.start_s, steps)
    if joined_at is not None:
        at, wait_s = joined_at
        left.prediction = _truncated(left.prediction, at - resume)
        join_pause = wait_s + costs.join_s + (costs.pull_s(1) if ps else costs.broadcast_s(n))
        segments.append(_Segment(at, members, predict(_sized(cfg, n, steps - at), paced[at:]), join_pause))
        changes.append(_entry(2, at, members, f"elastic.rejoin_step={cfg.elastic.rejoin_step}: a newcomer in worker "
                                              f"{lost}'s place", joined=[lost]))
    return _stitched(segments, changes, n, steps, _entry(0, 0, members, "start"), lost, completed)


@dataclass
class _Costs:
    """What a change moves over the cluster's nominal link, and its fixed times."""

    per_sample_s: float
    accumulate: int
    global_batch: int
    alpha_s: float
    beta_s: float  # per byte
    state_bytes: int
    regroup_s: float
    join_s: float
    start_s: float

    def __init__(self, cfg: DictConfig, compute: Compute, state_bytes: int) -> None:
        self.per_sample_s = compute.data_s + compute.forward_s + compute.backward_s
        self.accumulate = int(cfg.sync.get("accumulate", 1))
        self.global_batch = sum(shard_batches(cfg))
        cluster = cfg.cluster
        self.alpha_s, self.beta_s = float(cluster.alpha_us) / 1e6, 8.0 / parse_rate(str(cluster.bandwidth))
        self.state_bytes = state_bytes
        membership = cluster.membership
        self.regroup_s, self.join_s = float(membership.regroup_ms) / 1e3, float(membership.join_ms) / 1e3
        self.start_s = float(membership.start_s)

    def compute_s(self, m: int) -> float:
        """A worker's compute of one step of a membership of ``m``, before its draw."""
        return self.accumulate * self.global_batch / m * self.per_sample_s

    def broadcast_s(self, m: int) -> float:
        """The state from one worker to ``m``: a binomial tree, ceil(log2 m) rounds."""
        return math.ceil(math.log2(max(m, 2))) * (self.alpha_s + self.state_bytes * self.beta_s)

    def pull_s(self, m: int) -> float:
        """``m`` workers pulling the model from the servers at once, through the servers' links."""
        return self.alpha_s + m * self.state_bytes * self.beta_s


def _join_step(cfg: DictConfig, left: _Segment, began: float, ready: float, steps: int) -> tuple[int, float] | None:
    """(the step the newcomer joins at, the members' wait for it there), or None: never before the
    run ends. ``left``: the membership it joins, which began at ``began``; ``ready``: when the
    newcomer is."""
    rejoin = cfg.elastic.rejoin_step
    if rejoin is None:
        return None
    first = left.first
    ends = left.ends(began)  # ends[i]: when step first + i ends; the boundary before first + i + 1
    at = max(int(rejoin), first + 1)
    if cfg.elastic.rejoin_wait:
        return (at, max(0.0, ready - float(ends[at - first - 1]))) if at < steps else None
    for step in range(at, steps):
        if ends[step - first - 1] >= ready:
            return step, 0.0
    return None


def _sized(cfg: DictConfig, m: int, steps: int) -> DictConfig:
    """``cfg`` for a membership of ``m`` workers and ``steps`` steps: the same global batch, split evenly."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    out.data.batch_size = sum(shard_batches(cfg)) // m
    out.world_size, out.steps = m, steps
    return out


def _truncated(prediction: Prediction, steps: int) -> Prediction:
    """``prediction``'s first ``steps`` steps (a membership's clock is causal: later steps change no earlier one)."""
    trace = prediction.trace
    order = None if trace is None else [event for event in trace.order if event[2] < steps]
    return dataclasses.replace(
        prediction, records=[rows[:steps] for rows in prediction.records], batches=prediction.batches[:steps],
        trace=None if trace is None else dataclasses.replace(trace, order=order))


def _entry(epoch: int, step: int, members: list[int], cause: str, lost: list[int] | None = None,
           joined: list[int] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"epoch": epoch, "step": step, "world_size": len(members), "members": members,
                             "cause": cause}
    if epoch:
        entry.update(lost=lost or [], joined=joined or [], interrupted_step=None, rolled_back_steps=0)
    return entry


def _stitched(segments: list[_Segment], changes: list[dict[str, Any]], n: int, steps: int, start: dict[str, Any],
              lost: int, completed: list[StepRecord]) -> Timeline:
    """One timeline of the memberships' clocks; ``completed``: the steps the lost worker completed
    that its survivors did again."""
    records: list[list[StepRecord]] = [[] for _ in range(n)]
    sizes = np.zeros((steps, n), dtype=int)
    ends = np.empty(steps)
    order: list[tuple[int, int, int]] | None = [] if segments[0].prediction.trace is not None else None
    began = 0.0
    for i, segment in enumerate(segments):
        prediction, first, members = segment.prediction, segment.first, segment.members
        count = prediction.batches.shape[0]
        sizes[first:first + count, members] = prediction.batches
        ends[first:first + count] = segment.ends(began)
        for local, rows in enumerate(prediction.records):
            for j, row in enumerate(rows):
                extra = segment.pause_s if j == 0 else 0.0
                records[members[local]].append(dataclasses.replace(
                    row, step=row.step + first, rank=members[local], t_sync=row.t_sync + extra,
                    t_wait=(row.t_wait or 0.0) + extra, t_step=row.t_step + extra))
        if i == 0:
            records[lost].extend(completed)
        if order is not None:
            assert prediction.trace is not None
            if i:
                order.append((LEAVE if i == 1 else JOIN, lost, first))
            order.extend((kind, members[w], step + first) for kind, w, step in prediction.trace.order)
        if i:  # from the loss (or the members at the join's step) to the first step completed after it
            changes[i - 1]["downtime_s"] = round(float(ends[first]) - began - segment.undone_s, 6)
        if count:
            began = float(ends[first + count - 1])
    facts = {**segments[0].prediction.facts, "memberships": len(segments)}
    return Timeline(records, sizes, ends, order, facts, [start, *changes])
