"""Each benchmarked implementation beside its algorithm's alpha-beta bound on the same link.

The link is calibrated in the same run, independently of every implementation: ranks 0 and 1
time one-way transfers (``probe_link``), and a line through time against bytes gives alpha and
beta (``fit_link``). An implementation's bound is its algorithm's cost on that link
(testbed.collectives.registry): the ring for ``native`` and ``ring`` (the bandwidth-optimal all-reduce, which
Gloo's own runs on CPU), the two binary trees of ``tree``, link by link, at their best chunk size,
Rabenseifner's halving-doubling for ``halving_doubling``, push then pull through k separate servers
for ``ps_k<k>`` and ``grpc_raw``. ``fraction = bound / measured``: 1 for an implementation that
reaches its algorithm's bound, below 1 by what it leaves on the table; a slow implementation shows
as its own number, not as a verdict on its algorithm.
"""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from scipy.optimize import nnls

from testbed.collectives.registry import collective
from testbed.costs import Cost, Link, parameter_server
from testbed.netem.rank import enter_rank_namespace

PROBE_MIN_BYTES = 1 << 20  # smaller transfers pass within an emulated link's burst (testbed.sim.calibrate)
# Medians of fewer transfers let one slow 1 MiB sample outweigh 4 MiB on a busy machine (beta fit 0).
PROBE_MIN_ITERS = 5


def algorithm_cost(impl: str, n: int, nbytes: float, link: Link) -> Cost | None:
    """The cost of ``impl``'s algorithm; None where nothing crosses a link (an all-reduce of one rank)."""
    server = re.fullmatch(r"ps_k(\d+)", impl)
    if server or impl == "grpc_raw":
        return parameter_server(n, nbytes, servers=int(server.group(1)) if server else 1)
    spec = collective(impl)
    return None if n == 1 else spec.best(n, nbytes, link)


def bound_fraction(record: dict[str, Any], link: Link) -> float | None:
    """The algorithm's time on ``link`` over the record's measured (median) time."""
    cost = algorithm_cost(record["impl"], int(record["world_size"]), float(record["bytes"]), link)
    return None if cost is None else cost.time(link) / float(record["time_s"])


def fit_link(samples: list[tuple[float, float]]) -> Link:
    """alpha and beta (>= 0) of ``time = alpha + bytes * beta`` through (bytes, seconds) samples,
    residuals relative to each time so that small and large transfers weigh alike."""
    if len({nbytes for nbytes, _ in samples}) < 2:
        raise ValueError("fit_link needs transfers of at least two sizes")
    coef = np.array([[1.0, nbytes] for nbytes, _ in samples])
    times = np.array([t for _, t in samples])
    alpha, beta = nnls(coef / times[:, None], np.ones(len(samples)))[0]
    return Link(float(alpha), float(beta))


def probe_sizes(sizes: list[int]) -> list[int]:
    """The benchmark's sizes from 1 MiB up, and at least 1 and 4 MiB."""
    return sorted({PROBE_MIN_BYTES, 4 * PROBE_MIN_BYTES, *(s for s in sizes if s >= PROBE_MIN_BYTES)})


def probe_link(sizes: list[int], iters: int, device: torch.device) -> list[tuple[float, float]]:
    """Median one-way transfer time (of at least PROBE_MIN_ITERS) from rank 0 to rank 1 per size,
    on every rank as (bytes, seconds); ranks beyond 1 only meet the barriers. One-way: rank 0 reads the clock before it
    sends, rank 1 when the last byte has arrived. ``perf_counter`` is CLOCK_MONOTONIC, one clock for
    every process of a machine, and the benchmark's ranks are local."""
    rank = dist.get_rank()
    samples = []
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4, device=device)
        times = []
        for _ in range(max(iters, PROBE_MIN_ITERS) + 1):  # the first sets up the pair's connection
            stamps = torch.zeros(2, dtype=torch.float64)
            dist.barrier()
            if rank == 0:
                stamps[0] = time.perf_counter()
                dist.send(buf, 1)
            elif rank == 1:
                dist.recv(buf, 0)
                stamps[1] = time.perf_counter()
            dist.all_reduce(stamps)
            times.append(float(stamps[1] - stamps[0]))
        samples.append((float(nbytes), statistics.median(times[1:])))
    return samples


def calibrate_link(sizes: list[int], iters: int, device: torch.device, attempts: int = 3) -> Link:
    """The link's fit from ``probe_link``, probed again while it comes out with beta = 0: larger
    transfers that were not slower than smaller ones (a busy machine's noise), which no link does.
    Every rank fits the same samples, so all take the same branch."""
    for _ in range(attempts - 1):
        link = fit_link(probe_link(sizes, iters, device))
        if link.beta > 0:
            return link
    return fit_link(probe_link(sizes, iters, device))


def probe_world_rank(sizes: list[int], iters: int) -> tuple[float, float]:
    """A two-rank world that only calibrates the link (for benchmarks whose own worlds may hold one
    rank): returns (alpha, beta), over the emulated link when the launcher made a network."""
    enter_rank_namespace()
    dist.init_process_group("gloo")
    try:
        link = calibrate_link(sizes, iters, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    return link.alpha, link.beta
