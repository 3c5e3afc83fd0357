"""Step times under load imbalance: sampled compute, order statistics, and a parameter-server simulation.

Compute times are drawn with the trainer's own ``Injector`` (same seed, same delays), so a simulated
run sees exactly the stragglers and jitter a real run with that config would.

A synchronous step (all-reduce, or a BSP parameter server) waits for the slowest rank:
``T = max_i T_c,i + T_comm``; ``expected_max`` gives E[max] for i.i.d. jitter by integration.

``simulate_ps`` replays a parameter server event by event, in its three modes: each worker computes,
pushes, waits at the pull gate (sync: the whole round has pushed; ssp: the slowest worker is at most
``staleness`` clocks behind; async: never), pulls, and starts its next step; with backup workers a
sync step's update takes the first n - b gradients, and a late worker pushes nothing and pulls the
newest version. Server links are shared fairly by the transfers in flight, as TCP streams into one
NIC are, so n simultaneous pushes into one server take n times as long as one (incast).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from testbed.imbalance import Injector
from testbed.ps.modes import MODES, staleness_bound

# --- compute times ------------------------------------------------------------------------------


class Delays:
    """The imbalance group's injected delay of every rank, one step after the other, as each rank's
    ``Injector`` draws it in the trainer (same seed, same draws)."""

    def __init__(self, imbalance_cfg: Any, n: int, seed: int) -> None:
        # The injector holds its config as a dataclass: no DictConfig lookups in n x steps draws.
        self.injectors = [Injector(imbalance_cfg, rank, seed) for rank in range(n)]

    def draw(self, last_compute: np.ndarray | None) -> np.ndarray:
        """The next step's delays. Factor-based delays scale ``last_compute``, each rank's compute of
        its previous step, as the trainer scales the previous step's measured compute (which excludes
        the injected wait); None, the first step, has none to scale and gets none."""
        if last_compute is None:
            return np.array([injector.delay_s(None) for injector in self.injectors])
        return np.array([injector.delay_s(float(c)) for injector, c in zip(self.injectors, last_compute)])


def compute_times(imbalance_cfg: Any, n: int, steps: int, base_s: float | Sequence[float], seed: int) -> np.ndarray:
    """Compute time of each rank (columns) at each step (rows): base compute plus the injected delay
    (``Delays``). ``base_s`` is one compute time for all ranks or one per rank."""
    base = np.asarray(base_s, dtype=float)
    if base.ndim == 0:
        base = np.full(n, float(base))
    if base.shape != (n,):
        raise ValueError(f"base_s must be one value or {n} values, got shape {base.shape}")
    delays, times = Delays(imbalance_cfg, n, seed), np.empty((steps, n))
    for step in range(steps):
        times[step] = base + delays.draw(base if step else None)
    return times


def synchronous_steps(compute: np.ndarray, comm_s: float) -> np.ndarray:
    """Step times of a synchronous run: every step waits for its slowest rank, then communicates."""
    return np.asarray(compute, dtype=float).max(axis=1) + comm_s


# --- order statistics ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Jitter:
    """A per-step delay in seconds, distributed as ``Injector`` draws the jitter kind."""

    distribution: str  # normal (clipped at 0) | lognormal | exponential
    mean_s: float
    std_s: float | None = None  # exponential: unused, its std is its mean

    @classmethod
    def from_cfg(cls, cfg: Any) -> Jitter:
        std_ms = cfg.get("std_ms")
        return cls(str(cfg.distribution), float(cfg.mean_ms) / 1e3, None if std_ms is None else float(std_ms) / 1e3)

    def survival(self, x: float) -> float:
        """P(delay > x), for x >= 0; erfc keeps the far tail accurate."""
        if self.distribution == "exponential":
            return math.exp(-x / self.mean_s)
        if self.std_s is None:
            raise ValueError(f"{self.distribution} jitter needs std_s")
        if self.distribution == "normal":  # clipping puts the mass below 0 at 0, which x >= 0 never sees
            return 0.5 * math.erfc((x - self.mean_s) / (self.std_s * math.sqrt(2.0)))
        if self.distribution == "lognormal":
            if x <= 0.0:
                return 1.0
            sigma2 = math.log1p((self.std_s / self.mean_s) ** 2)
            mu = math.log(self.mean_s) - sigma2 / 2
            return 0.5 * math.erfc((math.log(x) - mu) / math.sqrt(2.0 * sigma2))
        raise ValueError(f"unknown distribution {self.distribution!r}; expected normal, lognormal or exponential")


def expected_max(dist: Jitter, n: int) -> float:
    """E[max of n i.i.d. delays] = integral over x >= 0 of 1 - F(x)^n (delays are never negative).

    Below ``lo`` the integrand is 1 to double precision and above ``hi`` it is below 1e-16, so only
    [lo, hi], where it falls, is integrated numerically: quad over [0, inf) could miss a narrow drop.
    """
    from scipy.integrate import quad  # here, not above: every launcher and rank imports this module
    from scipy.optimize import bisect, brentq

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")

    def tail(x: float) -> float:  # 1 - F(x)^n, computed from the survival so it stays exact near 0
        s = dist.survival(x)
        return 1.0 if s >= 1.0 else -math.expm1(n * math.log1p(-s))

    tiny = 1e-16
    top = dist.mean_s + (dist.std_s or dist.mean_s)
    while tail(top) > tiny:
        top *= 2.0

    def crossing(solver: Callable[..., float], a: float, level: float) -> float:
        """Where tail falls to ``level`` in [a, top] (a if it starts below). The integrand is in [0, 1],
        so an error dx here moves the result by at most dx: tiny * mean is below its last digit."""
        return a if tail(a) <= level else solver(lambda x: tail(x) - level, a, top, xtol=tiny * dist.mean_s)

    lo = crossing(bisect, 0.0, 1.0 - tiny)  # tail is exactly 1 up to lo: a step, nothing to interpolate
    hi = crossing(brentq, lo, tiny)  # smooth here, so Brent's method converges fast
    # Heavy tails make [lo, hi] span many decades: a break at each keeps quad from missing the mass near
    # lo, and the limit leaves room to refine beyond those pieces.
    decades = hi / 10.0 ** np.arange(1, 40)
    return lo + quad(tail, lo, hi, epsabs=0.0, epsrel=1e-12, points=decades[decades > lo], limit=200)[0]


def gaussian_max_approx(mean_s: float, std_s: float, n: int) -> float:
    """The cost model's E[max of n i.i.d. normals] ~ mu + sigma sqrt(2 ln n); an upper bound, loose for small n."""
    return mean_s + std_s * math.sqrt(2.0 * math.log(n))


# --- parameter-server simulation ----------------------------------------------------------------


@dataclass
class PsTrace:
    """When each worker (columns) passed each point of each step (rows) of a simulated run, in seconds."""

    mode: str
    staleness: int
    start: np.ndarray  # compute begins
    pushed: np.ndarray  # the server has the push: the clock advances (a late backup worker: ready to pull)
    released: np.ndarray  # the pull gate opens
    end: np.ndarray  # the pull is done: the step ends
    dropped: np.ndarray  # backup workers: computed, but too late for the step's update (no push)
    sat_out: np.ndarray  # backup workers: not computed, the step's update made without the worker
    # (PUSH or PULL, worker, step) in the order the server saw them: a push landing, a pull released
    # (its parameters are the server's at that moment). Ties in time keep the simulation's order,
    # which a sort by time would lose; a virtual cluster replays the math in it (testbed.launch.virtual).
    order: list[tuple[int, int, int]]

    @property
    def wait_s(self) -> np.ndarray:
        """Time held at the pull gate."""
        return self.released - self.pushed

    @property
    def step_s(self) -> np.ndarray:
        return self.end - self.start

    @property
    def mean_step_s(self) -> np.ndarray:
        """Per worker: its total time over its steps."""
        return self.end[-1] / self.end.shape[0]

    @property
    def throughput_steps_per_s(self) -> float:
        """Steps per second of all workers together, each at its own pace."""
        return float(np.sum(self.end.shape[0] / self.end[-1]))

    @property
    def max_lead(self) -> int:
        """The most clocks a pulling worker was ahead of the slowest one (what SSP bounds by ``staleness``).

        Recomputed from the times, not from the simulation's own counters: at each release, the slowest
        clock is the fewest pushes any worker had landed by then.
        """
        steps, n = self.pushed.shape
        slowest = np.full((steps, n), steps)
        for worker in range(n):
            landed = np.searchsorted(self.pushed[:, worker], self.released, side="right")
            np.minimum(slowest, landed, out=slowest)
        clock = np.arange(1, steps + 1)[:, None]
        return int((clock - slowest).max())


class _FairLink:
    """One direction of a server NIC, shared equally by the transfers on it (processor sharing).

    Work is in seconds of exclusive use. With m transfers each gets 1/m of the link, so a shared
    clock ``virtual`` (service each transfer has had since the start) advances at 1/m, and a transfer
    finishes when it reaches its arrival's value plus its work: one heap, no per-transfer updates.
    """

    def __init__(self) -> None:
        self.now, self.virtual, self.version = 0.0, 0.0, 0
        self.jobs: list[tuple[float, int]] = []  # (virtual finish, worker)

    def _advance(self, now: float) -> None:
        if self.jobs:
            self.virtual += (now - self.now) / len(self.jobs)
        self.now = now

    def add(self, now: float, worker: int, work: float) -> None:
        self._advance(now)
        heapq.heappush(self.jobs, (self.virtual + work, worker))
        self.version += 1

    def next_finish(self) -> float | None:
        return self.now + (self.jobs[0][0] - self.virtual) * len(self.jobs) if self.jobs else None

    def finish(self, now: float) -> list[int]:
        """The workers whose transfers are done at ``now``, the time ``next_finish`` gave; ties in worker order."""
        self._advance(now)
        self.virtual = self.jobs[0][0]  # exactly the head's finish: no rounding drift, no missed finish
        done = []
        while self.jobs and self.jobs[0][0] <= self.virtual:
            done.append(heapq.heappop(self.jobs)[1])
        self.version += 1
        return done


class _FifoLink:
    """One direction of a server NIC serving transfers in arrival order: those that arrive together
    share it equally, and one that arrives while others are sending waits for them. This is what
    TCP flows through one shaped queue come close to, measured here over tc's token bucket: pulls
    released together (a synchronous step) end together, and two asynchronous workers, once their
    compute jitter parts them, settle within two steps into one pushing while the other pulls. The
    interface of ``_FairLink``."""

    def __init__(self) -> None:
        self.version, self.started = 0, -1.0
        self.sending = _FairLink()  # the group being served
        self.waiting: deque[tuple[float, list[tuple[int, float]]]] = deque()  # (arrival, [(worker, work)])

    def add(self, now: float, worker: int, work: float) -> None:
        if not self.sending.jobs or now == self.started:
            if not self.sending.jobs:
                self.started = now
            self.sending.add(now, worker, work)
        elif self.waiting and self.waiting[-1][0] == now:
            self.waiting[-1][1].append((worker, work))
        else:
            self.waiting.append((now, [(worker, work)]))
        self.version += 1

    def next_finish(self) -> float | None:
        return self.sending.next_finish()

    def finish(self, now: float) -> list[int]:
        done = self.sending.finish(now)
        if not self.sending.jobs and self.waiting:
            self.started = now
            for worker, work in self.waiting.popleft()[1]:
                self.sending.add(now, worker, work)
        self.version += 1
        return done


SERVER_LINKS = {"fair": _FairLink, "fifo": _FifoLink}  # how a server's NIC shares its transfers

_COMPUTED, _PUSHED, _PULLED, _LINK, _ENTER = range(5)
PUSH, PULL = 0, 1  # PsTrace.order's kinds


def simulate_ps(
    compute: np.ndarray,
    *,
    push_s: float,
    pull_s: float,
    server_in_s: float,
    server_out_s: float,
    mode: str = "sync",
    staleness: int = 0,
    latency_s: float = 0.0,
    backup: int = 0,
    server_link: str = "fair",
) -> PsTrace:
    """Replay workers computing ``compute`` [steps, n] against a parameter server.

    ``push_s`` and ``pull_s`` are a worker's own link time (alpha + M beta); ``server_in_s`` and
    ``server_out_s`` the time one worker's share takes on one server's NIC ((M/k) beta for k shards).
    Every push and pull splits evenly over the k shards at the same instant, so all shards' links
    carry the same transfers and one pair of links stands for all of them. A transfer is done when
    both the worker's link and the server's are: k = 1 with n simultaneous pushes takes n M beta.
    ``latency_s`` (alpha, included in ``push_s`` and ``pull_s``) passes before a transfer reaches
    the server's link, so n simultaneous pushes take alpha + n M beta, as the calibration's
    parameter-server cost has it, not max(alpha + M beta, n M beta).

    ``backup`` workers (sync mode; testbed.sync.ps): a worker whose backward is done takes the step's
    next ticket; the first n - b push, and the step's update is made once their pushes have landed.
    A later one pushes nothing, waits for that update and pulls the newest version; the steps it
    finds made already it sits out, as does a worker that begins a step whose tickets are all taken
    (it waits for that step's update instead of computing).

    ``server_link``: how each direction of a server's NIC serves concurrent transfers: ``fair``
    (shared equally) or ``fifo`` (in arrival order, those arriving together shared equally).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    compute = np.asarray(compute, dtype=float)
    steps, n = compute.shape
    if not 0 <= backup < max(n, 1) or (backup and mode != "sync"):
        raise ValueError(f"backup must be in [0, {n}) and only in sync mode, got {backup} in {mode}")
    start, pushed, released, end = (np.zeros((steps, n)) for _ in range(4))
    dropped, sat_out = np.zeros((steps, n), dtype=bool), np.zeros((steps, n), dtype=bool)
    # A sync pull waits for the round, that is the slowest clock reaching the puller's: ssp with s = 0.
    bound = staleness_bound(mode, staleness)

    events: list[tuple[float, int, int, int, int]] = []  # (time, seq, kind, worker or link, link version)
    order: list[tuple[int, int, int]] = []
    seq = 0

    def at(time: float, kind: int, who: int, version: int = 0) -> None:
        nonlocal seq  # the sequence number breaks ties in time by scheduling order: deterministic
        heapq.heappush(events, (time, seq, kind, who, version))
        seq += 1

    links = (SERVER_LINKS[server_link](), SERVER_LINKS[server_link]())  # server inbound (pushes), outbound (pulls)
    work = (server_in_s, server_out_s)
    own_done = [[0.0] * n, [0.0] * n]  # when each worker's own link finishes its current push / pull
    done_kind = (_PUSHED, _PULLED)

    def transfer(now: float, direction: int, worker: int, own_s: float) -> None:
        own_done[direction][worker] = now + own_s
        if work[direction] <= 0.0:
            at(now + own_s, done_kind[direction], worker)
            return
        if latency_s > 0.0:
            at(now + latency_s, _ENTER, 2 * worker + direction)
        else:
            enter(now, direction, worker)

    def enter(now: float, direction: int, worker: int) -> None:
        link = links[direction]
        link.add(now, worker, work[direction])
        at(link.next_finish(), _LINK, direction, link.version)

    clocks, step = [0] * n, [0] * n
    at_clock = {0: n}  # how many workers have each clock; the slowest is the lowest with any
    slowest = 0
    gate: list[tuple[int, int]] = []  # (slowest clock needed, worker) of pulls held back

    # Backup workers: one decision per step for all shards, from the step's ticket counter.
    needed = n - backup  # the pushes a step's update takes
    tickets, landed = [0] * steps, [0] * steps  # per step: backwards done, pushes the server has
    version = 0  # steps whose update is made
    held, pulling = [0] * n, [0] * n  # the version of each worker's parameters, and of its pull
    awaiting: list[tuple[int, int]] = []  # (version needed, worker) of pulls held back

    def pull(now: float, worker: int) -> None:
        released[step[worker], worker] = now
        order.append((PULL, worker, step[worker]))
        pulling[worker] = version  # the shard streams its newest parameters
        transfer(now, 1, worker, pull_s)

    def pull_at(now: float, worker: int, needed_version: int) -> None:
        if version >= needed_version:
            pull(now, worker)
        else:
            heapq.heappush(awaiting, (needed_version, worker))

    def begin(now: float, worker: int) -> None:
        """The worker's next step: computed, or sat out where its update is made without the worker."""
        while step[worker] < steps:
            s = step[worker]
            start[s, worker] = now
            if backup and held[worker] > s:  # its parameters hold this step's update already: nothing to do
                sat_out[s, worker] = True
                pushed[s, worker] = released[s, worker] = end[s, worker] = now
                step[worker] += 1
            elif backup and tickets[s] >= needed:  # too late to begin: wait for the step's update
                sat_out[s, worker] = True
                pushed[s, worker] = now
                pull_at(now, worker, s + 1)
                return
            else:
                at(now + compute[s, worker], _COMPUTED, worker)
                return

    for worker in range(n):
        begin(0.0, worker)
    while events:
        now, _, kind, who, link_version = heapq.heappop(events)
        if kind == _COMPUTED:  # gradient ready: push it, unless n - b others were first
            s = step[who]
            tickets[s] += 1
            if backup and tickets[s] > needed:  # late: the update goes on without it; no push
                dropped[s, who] = True
                pushed[s, who] = now
                pull_at(now, who, s + 1)
            else:
                transfer(now, 0, who, push_s)
        elif kind == _ENTER:  # past the latency: the transfer reaches the server's link
            enter(now, who % 2, who // 2)
        elif kind == _LINK:  # a server link finished transfers; each is done once its worker's link is too
            link = links[who]
            if link_version != link.version:
                continue  # superseded: a transfer joined or left since this was scheduled
            for worker in link.finish(now):
                at(max(now, own_done[who][worker]), done_kind[who], worker)
            if (finish := link.next_finish()) is not None:
                at(finish, _LINK, who, link.version)
        elif kind == _PUSHED and backup:  # the step's update is made with its first n - b pushes
            s = step[who]
            pushed[s, who] = now
            order.append((PUSH, who, s))
            landed[s] += 1
            if landed[s] == needed:
                version = s + 1
                while awaiting and awaiting[0][0] <= version:
                    pull(now, heapq.heappop(awaiting)[1])
            pull_at(now, who, s + 1)
        elif kind == _PUSHED:  # the server has applied (or staged) the push; the worker wants to pull
            pushed[step[who], who] = now
            order.append((PUSH, who, step[who]))
            at_clock[clocks[who]] -= 1
            clocks[who] += 1
            at_clock[clocks[who]] = at_clock.get(clocks[who], 0) + 1
            while at_clock.get(slowest, 0) == 0:
                slowest += 1
            heapq.heappush(gate, (clocks[who] - bound if bound is not None else -1, who))
            while gate and gate[0][0] <= slowest:  # every pull the slowest worker's clock now allows
                pull(now, heapq.heappop(gate)[1])
        else:  # _PULLED: fresh parameters; the step ends and the next begins
            end[step[who], who] = now
            held[who] = pulling[who]
            step[who] += 1
            begin(now, who)
    return PsTrace(mode, staleness, start, pushed, released, end, dropped, sat_out, order)
