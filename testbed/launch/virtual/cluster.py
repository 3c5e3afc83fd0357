"""A described cluster's compute: each worker's time per sample, and its draws step by step.

A worker's compute time per step is its batch times a per-sample time, plus a per-step time, times
a draw of mean 1 from ``compute.distribution`` (and ``compute.slowdown`` on the ``stragglers``).
The per-sample time is, in this order of preference: ``compute.ms_per_sample``; the steady steps
of a world_size 1 job (``compute.from_job``); a device's sustained FLOP/s against the model's
FLOPs (``compute.flops_per_s``); else measured here, on the run's model, before it trains: once per
model, batch and thread count in a process, so that the jobs of one sweep run on the same cluster
(a measurement per job would put its noise between the synchronizers compared). Every worker draws
from a random stream of its own, so adding a worker changes no other worker's draws.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from testbed.models.call import ModelCall
from testbed.sim.step import Compute

STREAM = 0x636C  # a virtual cluster's compute draws, apart from every other use of the seed


def pace(compute: Any, n: int, steps: int, seed: int) -> np.ndarray:
    """Each worker's (columns) factor on its mean compute at each step (rows): its own stream's draws."""
    out = np.empty((steps, n))
    slow = set(compute.stragglers)
    for worker in range(n):
        rng = np.random.default_rng([int(seed), STREAM, worker])
        out[:, worker] = _draws(rng, compute, steps) * (float(compute.slowdown) if worker in slow else 1.0)
    return out


def _draws(rng: np.random.Generator, compute: Any, steps: int) -> np.ndarray:
    kind = compute.distribution
    if kind == "lognormal":
        sigma = float(compute.sigma)
        return rng.lognormal(-sigma * sigma / 2, sigma, steps)
    if kind == "exponential":
        return rng.exponential(1.0, steps)
    if kind == "pareto":  # Pareto of scale (a - 1) / a: mean 1 (numpy's pareto is Lomax, x_m = 1 shifted to 0)
        a = float(compute.shape)
        return (rng.pareto(a, steps) + 1.0) * (a - 1.0) / a
    return np.ones(steps)


def compute_of(cluster: Any, model: nn.Module, call: ModelCall, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[Compute, str]:
    """Seconds per sample of one worker (and per step: ``step_ms``), and where they came from.
    ``batch``: one worker's, for the measurement or the FLOP count."""
    compute, step_s = cluster.compute, float(cluster.compute.step_ms) / 1e3
    share = float(compute.backward_share)
    if compute.from_job is not None:
        known = Compute.from_job(compute.from_job)
        return Compute(known.forward_s, known.backward_s, known.data_s, known.optimizer_s + step_s), f"job {compute.from_job}"
    if compute.ms_per_sample is not None:
        per_sample = float(compute.ms_per_sample) / 1e3
        return Compute(per_sample * (1 - share), per_sample * share, 0.0, step_s), "cluster.compute.ms_per_sample"
    inputs, targets = batch
    if compute.flops_per_s is not None:
        with FlopCounterMode(display=False) as counter:
            call(model, inputs, targets)
        forward = counter.get_total_flops() / len(inputs) / float(compute.flops_per_s)
        return Compute(forward, 2 * forward, 0.0, step_s), "model FLOPs at cluster.compute.flops_per_s"
    key = (repr(model), tuple(inputs.shape), inputs.dtype, torch.get_num_threads())
    if key not in _MEASURED:
        _MEASURED[key] = _measured(model, call, inputs, targets)
    forward_s, backward_s = _MEASURED[key]
    return Compute(forward_s, backward_s, 0.0, step_s), "measured here"


_MEASURED: dict[tuple[Any, ...], tuple[float, float]] = {}  # this process's measurements (compute_of)


def _measured(model: nn.Module, call: ModelCall, inputs: torch.Tensor, targets: torch.Tensor,
              repeats: int = 12) -> tuple[float, float]:
    """Median forward and backward seconds per sample of ``model`` on one worker's batch, here; the
    gradients it leaves are cleared."""
    forward, backward = [], []
    for i in range(repeats + 3):  # three to warm up
        began = time.perf_counter()
        loss = call(model, inputs, targets).loss
        mid = time.perf_counter()
        loss.backward()
        done = time.perf_counter()
        if i >= 3:
            forward.append(mid - began)
            backward.append(done - mid)
    model.zero_grad(set_to_none=True)
    return statistics.median(forward) / len(inputs), statistics.median(backward) / len(inputs)

