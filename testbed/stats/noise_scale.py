"""The gradient noise scale B_simple = tr(Σ)/|G|², estimated as data parallelism trains.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training", appendix A.1: a gradient
estimated on a batch of B samples has E|G_B|² = |G|² + tr(Σ)/B. Two batch sizes give two equations:
each rank's local gradient (B_small samples) and the ranks' average (B_big), so

    |G|²  ≈ (B_big |G_big|² − B_small |G_small|²) / (B_big − B_small)
    tr(Σ) ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

are unbiased, and |G_small|² is the mean of the ranks' local squared norms: one scalar all-reduce
a step. Their ratio is not unbiased and is noisy step to step, so numerator and denominator are
averaged separately (exponential moving averages) before dividing, as AdaptDL does.

Ranks with unequal batches b_r (imbalance=uneven) still fit: the mean of E|g_r|² is
|G|² + tr(Σ)·mean(1/b_r), so B_small is the batches' harmonic mean.

Where servers average the gradients (sync=ps), no rank holds the average, and the servers measure
both norms instead, from the pushes, with no message of their own: each push carries its worker's
own squared norm, and each shard returns the mean of those and the squared norm of its slice of
the average with the pull that follows (testbed.ps.wire.StepNorms). With backup workers the
average is over the n - b workers the update took, and so are both norms and B_big.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist


def two_batch(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """Unbiased estimates of (|G|², tr(Σ)) from a batch of ``b_small`` samples' squared gradient
    norm (mean over such batches) and the squared norm of their average over ``b_big``."""
    if not b_big > b_small > 0:
        raise ValueError(f"two-batch estimate needs 0 < B_small ({b_small}) < B_big ({b_big})")
    grad_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


@dataclass
class NoiseScale:
    """Moving averages of |G|² and tr(Σ), bias-corrected as Adam's moments are."""

    ema: float
    grad_sq: float = 0.0
    trace: float = 0.0
    weight: float = 0.0  # 1 - ema^t: the mass the averages have after t updates

    def update(self, grad_sq: float, trace: float) -> None:
        self.grad_sq = self.ema * self.grad_sq + (1 - self.ema) * grad_sq
        self.trace = self.ema * self.trace + (1 - self.ema) * trace
        self.weight = self.ema * self.weight + (1 - self.ema)

    def b_simple(self) -> float | None:
        """tr(Σ)/|G|² over the averages; None before the first update or while |G|² is not positive
        (the noise swamps the signal: the batch is far below B_simple)."""
        if not self.weight or self.grad_sq <= 0:
            return None
        return self.trace / self.grad_sq


def squared_norm(grads: Iterable[torch.Tensor | None]) -> float:
    total = torch.zeros((), dtype=torch.float64)
    for g in grads:
        if g is not None:
            total += g.detach().double().pow(2).sum().cpu()
    return float(total)


@runtime_checkable
class ServerNorms(Protocol):
    """A synchronizer whose servers average the gradients, and so measure both norms (testbed.sync.ps)."""

    def carry_local_sq(self, local_sq: float) -> None:
        """Send this rank's own squared gradient norm with its next push."""

    def step_norms(self) -> tuple[float, float, int] | None:
        """Of the update this rank last pulled: the mean of the averaged ranks' own squared norms,
        the squared norm of their average, and how many ranks it averaged; None if not measured."""


class GradientNoise:
    """A rank's part of the estimate: its local gradient before synchronization, the averaged one
    after. ``batches``: every rank's samples per optimizer step; ``weight``: the factor this rank's
    loss carries (testbed.imbalance.loss_weight), taken off its local gradient; ``servers``: the
    synchronizer, where its servers measure the norms."""

    def __init__(self, params: list[torch.nn.Parameter], batches: list[int], weight: float, ema: float,
                 servers: ServerNorms | None = None) -> None:
        self.params, self.servers = params, servers
        self.resize(batches, weight)
        self.scale = NoiseScale(ema)
        self._local_sq = 0.0

    def resize(self, batches: list[int], weight: float) -> None:
        """The ranks' batches changed (testbed.balance)."""
        self.weight, self.ranks = weight, len(batches)
        self.b_small, self.b_big = statistics.harmonic_mean(batches), float(sum(batches))

    def before_sync(self) -> None:
        self._local_sq = squared_norm(p.grad for p in self.params) / self.weight**2
        if self.servers is not None:
            self.servers.carry_local_sq(self._local_sq)

    def after_sync(self, device: torch.device) -> tuple[float, float, float | None] | None:
        """(|G_small|², |G_big|², B_simple so far): one scalar all-reduce of the local norms, or what
        the servers measured (None where they measured nothing this step)."""
        b_big = self.b_big
        if self.servers is not None:
            measured = self.servers.step_norms()
            if measured is None:
                return None
            small_sq, big_sq, averaged = measured
            b_big *= averaged / self.ranks  # backup workers: the update took n - b equal batches
        else:
            local = torch.tensor([self._local_sq], dtype=torch.float64, device=device)
            dist.all_reduce(local)
            small_sq = float(local) / dist.get_world_size()
            big_sq = squared_norm(p.grad for p in self.params)
        self.scale.update(*two_batch(small_sq, big_sq, self.b_small, b_big))
        return small_sq, big_sq, self.scale.b_simple()


def noise_probe(cfg: Any, model: torch.nn.Module, sizes: list[int], rank: int, sync: object) -> GradientNoise | None:
    """This rank's part of the estimate under ``stats.noise_scale``; ``sizes``: each rank's
    samples per micro-step (testbed.imbalance.shard_batches); ``sync``: the run's synchronizer."""
    if not cfg.stats.noise_scale:
        return None
    from testbed.imbalance import loss_weight

    k = int(cfg.sync.accumulate)
    params = [p for p in model.parameters() if p.requires_grad]
    return GradientNoise(params, [b * k for b in sizes], loss_weight(sizes, rank), float(cfg.stats.ema),
                         sync if isinstance(sync, ServerNorms) else None)


def b_simple_over(steps: list[tuple[float, float, float, float]]) -> float | None:
    """B_simple over a stretch of steps, each (|G_small|², |G_big|², B_small, B_big): the ratio of
    the mean estimates, which is how a moving average would see it."""
    if not steps:
        return None
    estimates = [two_batch(*step) for step in steps]
    grad_sq = statistics.fmean(g for g, _ in estimates)
    trace = statistics.fmean(t for _, t in estimates)
    return trace / grad_sq if grad_sq > 0 else None


def statistical_efficiency(noise_scale: float, batch: float, base_batch: float) -> float:
    """Pollux's E = (φ + B₀)/(φ + B): the progress one sample makes at batch B relative to B₀."""
    return (noise_scale + base_batch) / (noise_scale + batch)


def noise_summary(records_by_rank: list[list[Any]], cfg: Any, throughput: float | None) -> dict[str, Any] | None:
    """summary.json's ``noise_scale`` from the step records (every rank that took part in a step
    logs the same norms; the ``samples`` of the ranks its update took give the step's batches), with
    Pollux's statistical efficiency and goodput at the batch the updates took; None without the
    estimate."""
    by_step = [{r.step: r for r in records} for records in records_by_rank]
    steps = []
    for step in sorted(by_step[0]):
        if any(step not in ranks for ranks in by_step):
            continue
        records = [ranks[step] for ranks in by_step]
        measured = next((r for r in records if r.grad_sq_small is not None), None)
        batches = [r.samples for r in records if r.samples > 0]  # backup workers: a late rank's count 0
        if measured is None or len(batches) < 2:
            continue
        steps.append((step, (measured.grad_sq_small, measured.grad_sq_big, statistics.harmonic_mean(batches),
                             float(sum(batches)))))
    if not steps:
        return None
    run = [estimate for _, estimate in steps]
    third = max(1, len(run) // 3)
    steady = [estimate for step, estimate in steps if step >= int(cfg.warmup_steps)] or run
    phi = b_simple_over(steady)
    base = float(cfg.stats.base_batch or int(cfg.data.batch_size) * int(cfg.sync.accumulate))
    b_big = statistics.fmean(big for _, _, _, big in run)  # the global batch, or what backup workers left of it
    efficiency = None if phi is None else statistical_efficiency(phi, b_big, base)
    return {
        "b_simple": phi,  # over the steady steps
        "start": b_simple_over(run[:third]),
        "middle": b_simple_over(run[len(run) // 2 - third // 2:][:third]),
        "end": b_simple_over(run[-third:]),
        "b_small": statistics.fmean(b_small for _, _, b_small, _ in run),  # the harmonic mean of the ranks' batches
        "b_big": b_big,
        "base_batch": base,
        "statistical_efficiency": efficiency,
        "goodput": None if efficiency is None or throughput is None else throughput * efficiency,
    }
