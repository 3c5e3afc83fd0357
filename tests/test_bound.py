"""Benchmark bounds: the link fit and each algorithm's alpha-beta time, against hand computations."""

from __future__ import annotations

import pytest

from testbed.bench.bound import bound_fraction, fit_link, probe_sizes
from testbed.costs import Link

pytestmark = pytest.mark.unit

MB = 1 << 20
GBIT = Link(alpha=1e-4, beta=8 / 1e9)  # 100 us per message, 1 Gbit/s


def record(impl: str, n: int, nbytes: int, time_s: float) -> dict:
    return {"impl": impl, "world_size": n, "bytes": nbytes, "time_s": time_s}


def test_the_link_fit_recovers_alpha_and_beta() -> None:
    samples = [(float(m * MB), GBIT.alpha + m * MB * GBIT.beta) for m in (1, 4, 16)]
    link = fit_link(samples)
    assert link.alpha == pytest.approx(GBIT.alpha, rel=1e-6) and link.beta == pytest.approx(GBIT.beta, rel=1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        fit_link(samples[:1])


def test_each_algorithm_against_a_hand_computation() -> None:
    m = 16 * MB
    # Ring at n = 4: 2(n-1) messages, 2(n-1)/n M bytes through each NIC.
    ring = 6 * GBIT.alpha + 1.5 * m * GBIT.beta
    assert bound_fraction(record("ring", 4, m, 0.25), GBIT) == pytest.approx(ring / 0.25)
    assert bound_fraction(record("native", 4, m, 0.25), GBIT) == pytest.approx(ring / 0.25)
    # Halving-doubling at n = 4 (a power of two): 2 log2 n messages, the ring's bytes.
    assert bound_fraction(record("halving_doubling", 4, m, 0.25), GBIT) == pytest.approx(
        (4 * GBIT.alpha + 1.5 * m * GBIT.beta) / 0.25)
    # Push then pull, 4 workers, 2 separate servers: each server NIC carries 4 M / 2 per phase.
    assert bound_fraction(record("ps_k2", 4, m, 1.0), GBIT) == pytest.approx(2 * GBIT.alpha + 4 * m * GBIT.beta)
    assert bound_fraction(record("grpc_raw", 1, m, 1.0), GBIT) == pytest.approx(2 * GBIT.alpha + 2 * m * GBIT.beta)
    # Two trees at n = 4 without per-message cost: the smallest chunk (4 KiB) is best; each inner
    # rank sends its half to 2 peers per phase, plus one chunk of pipeline fill: 2 * 2 * (M/2 + 4 KiB).
    bandwidth_only = Link(alpha=0.0, beta=GBIT.beta)
    assert bound_fraction(record("tree", 4, m, 1.0), bandwidth_only) == pytest.approx((2 * m + 16384) * GBIT.beta)
    # At n = 2 no rank has two children: the trees move M, as the ring does.
    assert bound_fraction(record("tree", 2, m, 1.0), bandwidth_only) == pytest.approx(
        bound_fraction(record("ring", 2, m, 1.0), bandwidth_only), rel=1e-3)
    assert bound_fraction(record("ring", 1, m, 1.0), GBIT) is None  # an all-reduce of one rank sends nothing


def test_probe_sizes_start_at_one_mib() -> None:
    assert probe_sizes([4096, 16 * MB]) == [MB, 4 * MB, 16 * MB]
