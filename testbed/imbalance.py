"""Load imbalance as a controlled variable: slow ranks, jitter, mixed speeds, uneven shards.

Time-based kinds (straggler, jitter, heterogeneous) make a rank wait before the forward pass of
each step, so its gradients are late exactly as a slow rank's would be, also with overlap. The wait
is recorded as ``t_injected``, apart from the real compute phases. Factors of compute time use the
rank's measured compute (data, forward, backward, optimizer) of its previous step; the first step
has none and gets no factor-based delay (it is warm-up). Draws come from a generator seeded by
``(seed, rank)`` and are made every step whether or not the rank is affected, so the same seed
gives the same delays. On CUDA the wait is on the host: it delays the launch of the step's work.

``uneven`` changes no timing: each rank's batch is proportional to its shard, every rank runs the
same number of steps (a rank that ran out of data would leave its peers' collectives hanging), and
each rank's loss is weighted by ``n * b_r / B`` so the mean of the ranks' gradients is the gradient
of the global batch ``B`` (what single-process training computes).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from testbed.batch import per_rank_batch
from testbed.checks import Option, options, require
from testbed.schema import typed

# Every kind adds time to chosen ranks' steps (recorded as t_injected, apart from real compute),
# except uneven, which changes how many samples each rank computes.

JITTER_DISTRIBUTIONS = ("normal", "lognormal", "exponential")


@dataclass
class NoImbalanceConfig:
    name: str = "none"


@dataclass
class StragglerConfig:
    name: str = "straggler"
    ranks: list[int] = field(default_factory=lambda: [0])  # the slow ranks
    slowdown: float = 1.0  # extra time as a fraction of the rank's measured compute time (1.0 = +100 %)
    delay_ms: float = 0.0  # and/or a fixed extra time per step


@dataclass
class JitterConfig:
    name: str = "jitter"
    distribution: str = "lognormal"  # normal | lognormal | exponential
    mean_ms: float = 5.0  # of the extra time per rank and step
    std_ms: float | None = 5.0  # normal, lognormal; exponential has std = mean (leave null)
    ranks: list[int] | None = None  # null: every rank


@dataclass
class HeterogeneousConfig:
    name: str = "heterogeneous"
    # Relative speed per rank (rank r computes at speeds[r] of full speed: extra time is
    # (1/speed - 1) of its compute); ranks beyond the list run at 1.0, entries beyond world_size
    # are unused (one list serves a sweep over world sizes).
    speeds: list[float] = field(default_factory=lambda: [1.0, 0.5])


@dataclass
class UnevenConfig:
    name: str = "uneven"
    # Shard sizes: rank r holds a share proportional to skew ** (r / (n - 1)), so the largest shard
    # is skew times the smallest; or explicit relative shares (one per rank) when given.
    skew: float = 2.0
    shares: list[float] = field(default_factory=list)


def _check_ranks(cfg: Any) -> None:
    ranks, n = cfg.imbalance.get("ranks"), int(cfg.world_size)
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < n]
        require(not bad, f"imbalance.ranks={list(ranks)}: ranks {bad} do not exist with world_size={n}; use ranks in [0, {n})")


def _check_straggler(cfg: Any) -> None:
    imb = cfg.imbalance
    _check_ranks(cfg)
    require(imb.slowdown >= 0, f"imbalance.slowdown={imb.slowdown}: must be >= 0 (1.0 = +100 % of compute time)")
    require(imb.delay_ms >= 0, f"imbalance.delay_ms={imb.delay_ms}: must be >= 0")


def _check_jitter(cfg: Any) -> None:
    imb = cfg.imbalance
    _check_ranks(cfg)
    dist = imb.distribution
    require(dist in JITTER_DISTRIBUTIONS, f"imbalance.distribution={dist}: allowed: {'|'.join(JITTER_DISTRIBUTIONS)}")
    require(imb.mean_ms > 0, f"imbalance.mean_ms={imb.mean_ms}: must be > 0")
    if dist == "exponential":
        require(
            imb.std_ms is None or imb.std_ms == imb.mean_ms,
            f"imbalance.std_ms={imb.std_ms}: an exponential delay has std = mean; set imbalance.std_ms=null",
        )
    else:
        require(imb.std_ms is not None and imb.std_ms >= 0, f"imbalance.std_ms={imb.std_ms}: {dist} needs a std >= 0")


def _check_heterogeneous(cfg: Any) -> None:
    speeds = list(cfg.imbalance.speeds)
    require(all(0 < s <= 1 for s in speeds), f"imbalance.speeds={speeds}: each speed must be in (0, 1] (1 = full speed)")


def _check_uneven(cfg: Any) -> None:
    imb, n = cfg.imbalance, int(cfg.world_size)
    require(imb.skew >= 1, f"imbalance.skew={imb.skew}: must be >= 1 (largest shard / smallest shard)")
    shares = list(imb.shares)
    require(
        not shares or (len(shares) == n and all(s > 0 for s in shares)),
        f"imbalance.shares={shares}: give one positive share per rank (world_size={n}) or none",
    )
    total = per_rank_batch(cfg) * n
    require(
        total >= n,
        f"imbalance=uneven: a global batch of {total} cannot give each of {n} ranks a sample; raise data.batch_size",
    )


def _straggler_slow(cfg: Any, rank: int) -> tuple[float, float]:
    return float(cfg.slowdown), float(cfg.delay_ms) / 1e3


def _heterogeneous_slow(cfg: Any, rank: int) -> tuple[float, float]:
    speeds = list(cfg.speeds)
    return (1.0 / speeds[rank] - 1.0 if rank < len(speeds) else 0.0), 0.0


def _jitter_draw(cfg: Any, rng: random.Random) -> float:
    mean = float(cfg.mean_ms) / 1e3
    if cfg.distribution == "exponential":
        return rng.expovariate(1.0 / mean)
    if cfg.distribution == "normal":
        return max(0.0, rng.gauss(mean, float(cfg.std_ms) / 1e3))
    # Lognormal with the configured mean and std of the delay itself.
    std = float(cfg.std_ms) / 1e3
    sigma2 = math.log1p((std / mean) ** 2)
    return rng.lognormvariate(math.log(mean) - sigma2 / 2, math.sqrt(sigma2))


def _uneven_shares(cfg: Any, n: int) -> list[float]:
    return list(cfg.shares) or [float(cfg.skew) ** (r / (n - 1)) for r in range(n)]


@dataclass(frozen=True)
class Imbalance(Option):
    """An imbalance kind: ``slow(cfg, rank)``, the (factor of measured compute, fixed seconds) an
    affected rank adds to each step; ``draw(cfg, rng)``, a random extra time per step (drawn on
    every rank, every step, so that a seed gives the same delays); ``shares(cfg, n)``, relative
    shard sizes (None: equal)."""

    slow: Callable[[Any, int], tuple[float, float]] = lambda cfg, rank: (0.0, 0.0)
    draw: Callable[[Any, random.Random], float] | None = None
    shares: Callable[[Any, int], list[float]] | None = None


IMBALANCES = options(
    Imbalance("none", NoImbalanceConfig),
    Imbalance("straggler", StragglerConfig, _check_straggler, slow=_straggler_slow),
    Imbalance("jitter", JitterConfig, _check_jitter, draw=_jitter_draw),
    Imbalance("heterogeneous", HeterogeneousConfig, _check_heterogeneous, slow=_heterogeneous_slow),
    Imbalance("uneven", UnevenConfig, _check_uneven, shares=_uneven_shares),
)


class Injector:
    """Extra time per step for one rank."""

    def __init__(self, cfg: Any, rank: int, seed: int) -> None:
        self.kind = IMBALANCES[cfg.name]
        self.cfg, self.rank = typed(self.kind.schema, cfg), rank
        self.rng = random.Random(seed * 1_000_003 + rank * 7919 + 17)
        ranks = getattr(self.cfg, "ranks", None)  # null or absent: every rank
        self.affected = ranks is None or rank in list(ranks)
        # Extra time per unit of measured compute, and fixed.
        self.factor, self.fixed_s = self.kind.slow(self.cfg, rank) if self.affected else (0.0, 0.0)

    def draw_s(self) -> float:
        """The random extra time of one step (0 for kinds without); advances the generator either way."""
        if self.kind.draw is None:
            return 0.0
        value = self.kind.draw(self.cfg, self.rng)
        return value if self.affected else 0.0

    def delay_s(self, last_compute_s: float | None) -> float:
        jitter = self.draw_s()
        scaled = self.factor * last_compute_s if last_compute_s is not None else 0.0
        return self.fixed_s + scaled + jitter

    def wait(self, last_compute_s: float | None) -> float:
        """Sleep this step's extra time; returns it (seconds)."""
        delay = self.delay_s(last_compute_s)
        if delay > 0:
            time.sleep(delay)
        return delay


def shard_batches(cfg: Any) -> list[int]:
    """Samples per rank and step: equal, or proportional to the shards under ``imbalance=uneven``.

    The total is always the global batch of a run without imbalance, so runs compare at equal work.
    """
    n = int(cfg.world_size)
    per_rank = per_rank_batch(cfg)
    kind = IMBALANCES[cfg.imbalance.name]
    if kind.shares is None or n == 1:
        return [per_rank] * n
    return apportion(per_rank * n, kind.shares(typed(kind.schema, cfg.imbalance), n))


def apportion(total: int, shares: list[float]) -> list[int]:
    """``total`` samples split in proportion to ``shares``, at least one each (``total`` >= their
    number): largest-remainder rounding keeps the total exact."""
    n = len(shares)
    exact = [total * s / sum(shares) for s in shares]
    sizes = [max(1, int(x)) for x in exact]
    order = sorted(range(n), key=lambda r: exact[r] - int(exact[r]), reverse=True)
    i = 0
    while sum(sizes) != total:
        r = order[i % n]
        if sum(sizes) < total:
            sizes[r] += 1
        elif sizes[r] > 1:
            sizes[r] -= 1
        i += 1
    return sizes


def loss_weight(sizes: list[int], rank: int) -> float:
    """Factor on rank ``rank``'s mean loss so that the ranks' mean gradient is the global batch's."""
    return len(sizes) * sizes[rank] / sum(sizes)
