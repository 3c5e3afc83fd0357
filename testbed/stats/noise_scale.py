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
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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


class GradientNoise:
    """A rank's part of the estimate: its local gradient before synchronization, the averaged one
    after. ``batches``: every rank's samples per optimizer step; ``weight``: the factor this rank's
    loss carries (testbed.imbalance.loss_weight), taken off its local gradient."""

    def __init__(self, params: list[torch.nn.Parameter], batches: list[int], weight: float, ema: float) -> None:
        self.params, self.weight = params, weight
        self.b_small = statistics.harmonic_mean(batches)
        self.b_big = float(sum(batches))
        self.scale = NoiseScale(ema)
        self._local_sq = 0.0

    def before_sync(self) -> None:
        self._local_sq = squared_norm(p.grad for p in self.params) / self.weight**2

    def after_sync(self, device: torch.device) -> tuple[float, float, float | None]:
        """(|G_small|², |G_big|², B_simple so far): one scalar all-reduce of the local norms."""
        local = torch.tensor([self._local_sq], dtype=torch.float64, device=device)
        dist.all_reduce(local)
        small_sq = float(local) / dist.get_world_size()
        big_sq = squared_norm(p.grad for p in self.params)
        self.scale.update(*two_batch(small_sq, big_sq, self.b_small, self.b_big))
        return small_sq, big_sq, self.scale.b_simple()


def noise_probe(cfg: Any, model: torch.nn.Module, sizes: list[int], rank: int) -> GradientNoise | None:
    """This rank's part of the estimate under ``stats.noise_scale``; ``sizes``: each rank's
    samples per micro-step (testbed.imbalance.shard_batches)."""
    if not cfg.stats.noise_scale:
        return None
    from testbed.imbalance import loss_weight

    k = int(cfg.sync.accumulate)
    params = [p for p in model.parameters() if p.requires_grad]
    return GradientNoise(params, [b * k for b in sizes], loss_weight(sizes, rank), float(cfg.stats.ema))


def b_simple_over(records: list[tuple[float, float]], b_small: float, b_big: float) -> float | None:
    """B_simple over a stretch of steps, each (|G_small|², |G_big|²): the ratio of the mean
    estimates, which is how a moving average would see it."""
    if not records:
        return None
    estimates = [two_batch(s, b, b_small, b_big) for s, b in records]
    grad_sq = statistics.fmean(g for g, _ in estimates)
    trace = statistics.fmean(t for _, t in estimates)
    return trace / grad_sq if grad_sq > 0 else None


def statistical_efficiency(noise_scale: float, batch: float, base_batch: float) -> float:
    """Pollux's E = (φ + B₀)/(φ + B): the progress one sample makes at batch B relative to B₀."""
    return (noise_scale + base_batch) / (noise_scale + batch)


def noise_summary(records: list[Any], cfg: Any, throughput: float | None) -> dict[str, Any] | None:
    """summary.json's ``noise_scale`` from one rank's step records (every rank logs the same
    estimate), with Pollux's statistical efficiency and goodput at the run's global batch; None
    without the estimate."""
    from testbed.batch import global_batch
    from testbed.imbalance import shard_batches

    steps = [(r.step, (r.grad_sq_small, r.grad_sq_big)) for r in records if r.grad_sq_small is not None]
    if not steps:
        return None
    k = int(cfg.sync.accumulate)
    batches = [b * k for b in shard_batches(cfg)]
    b_small, b_big = statistics.harmonic_mean(batches), float(sum(batches))
    pairs = [pair for _, pair in steps]
    third = max(1, len(pairs) // 3)
    steady = [pair for step, pair in steps if step >= int(cfg.warmup_steps)] or pairs
    phi = b_simple_over(steady, b_small, b_big)
    base = float(cfg.stats.base_batch or int(cfg.data.batch_size) * k)
    efficiency = None if phi is None else statistical_efficiency(phi, global_batch(cfg), base)
    return {
        "b_simple": phi,  # over the steady steps
        "start": b_simple_over(pairs[:third], b_small, b_big),
        "middle": b_simple_over(pairs[len(pairs) // 2 - third // 2:][:third], b_small, b_big),
        "end": b_simple_over(pairs[-third:], b_small, b_big),
        "b_small": b_small,
        "b_big": b_big,
        "base_batch": base,
        "statistical_efficiency": efficiency,
        "goodput": None if efficiency is None or throughput is None else throughput * efficiency,
    }
