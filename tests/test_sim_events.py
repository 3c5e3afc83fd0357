"""Step-time simulation: compute draws identical to the trainer's, order statistics against known
values, and the parameter-server replay against closed forms, Monte Carlo and the SSP bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from testbed.imbalance import Injector
from testbed.sim.events import (
    Jitter,
    compute_times,
    expected_max,
    gaussian_max_approx,
    simulate_ps,
    synchronous_steps,
)

pytestmark = pytest.mark.unit

BASE = 0.010  # s of compute per step
PUSH = PULL = 0.001  # s on a worker's own link


def jitter_cfg(distribution: str, mean_ms: float = 5.0, std_ms: float | None = 5.0) -> OmegaConf:
    return OmegaConf.create(
        {"name": "jitter", "distribution": distribution, "mean_ms": mean_ms, "std_ms": std_ms, "ranks": None}
    )


STRAGGLER = OmegaConf.create({"name": "straggler", "ranks": [1], "slowdown": 1.0, "delay_ms": 0.0})


def sharded(n: int, **kwargs: object) -> dict:
    """k = n shards: each server link carries 1/n of a worker's transfer."""
    return dict(push_s=PUSH, pull_s=PULL, server_in_s=PUSH / n, server_out_s=PULL / n, **kwargs)


# --- compute times ------------------------------------------------------------------------------


def test_compute_times_are_the_injectors_draws() -> None:
    cfg = jitter_cfg("lognormal")
    times = compute_times(cfg, n=3, steps=50, base_s=[0.01, 0.02, 0.03], seed=11)
    for rank, base in enumerate([0.01, 0.02, 0.03]):
        injector = Injector(cfg, rank, seed=11)
        expected = [base + injector.delay_s(base if step else None) for step in range(50)]
        assert times[:, rank].tolist() == expected
    assert np.array_equal(times, compute_times(cfg, 3, 50, [0.01, 0.02, 0.03], seed=11))
    assert not np.array_equal(times, compute_times(cfg, 3, 50, [0.01, 0.02, 0.03], seed=12))


def test_compute_times_scale_the_previous_compute_of_slow_ranks() -> None:
    times = compute_times(STRAGGLER, n=3, steps=5, base_s=BASE, seed=0)
    assert times[0].tolist() == [BASE] * 3  # step 0 has no measured compute to scale
    assert times[1:, 1] == pytest.approx(2 * BASE)  # slowdown 1.0: +100 %
    assert (times[:, [0, 2]] == BASE).all()
    hetero = OmegaConf.create({"name": "heterogeneous", "speeds": [1.0, 0.25]})
    assert compute_times(hetero, 2, 3, BASE, 0)[1:, 1] == pytest.approx(4 * BASE)
    with pytest.raises(ValueError, match="base_s"):
        compute_times(STRAGGLER, 3, 5, [BASE, BASE], 0)


def test_synchronous_steps_wait_for_the_slowest() -> None:
    compute = np.array([[1.0, 3.0, 2.0], [5.0, 4.0, 0.5]])
    assert synchronous_steps(compute, 0.25).tolist() == [3.25, 5.25]


# --- order statistics ---------------------------------------------------------------------------


def test_expected_max_of_one_is_the_mean() -> None:
    assert expected_max(Jitter("exponential", 0.004), 1) == pytest.approx(0.004, rel=1e-8)
    assert expected_max(Jitter("lognormal", 0.005, 0.005), 1) == pytest.approx(0.005, rel=1e-8)
    mu, sigma = 0.002, 0.003  # clipping at 0 raises the mean to mu Phi(mu/sigma) + sigma phi(mu/sigma)
    z = mu / sigma
    clipped = mu * 0.5 * math.erfc(-z / math.sqrt(2)) + sigma * math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    assert expected_max(Jitter("normal", mu, sigma), 1) == pytest.approx(clipped, rel=1e-8)


@pytest.mark.parametrize("n", [2, 10, 1000])
def test_expected_max_of_exponentials_is_the_harmonic_number(n: int) -> None:
    harmonic = sum(1 / i for i in range(1, n + 1))
    assert expected_max(Jitter("exponential", 0.003), n) == pytest.approx(0.003 * harmonic, rel=1e-8)


@pytest.mark.parametrize("n,standard_max", [(2, 1 / math.sqrt(math.pi)), (3, 1.5 / math.sqrt(math.pi))])
def test_expected_max_of_narrow_normals(n: int, standard_max: float) -> None:
    mu, sigma = 1.0, 1e-4
    assert expected_max(Jitter("normal", mu, sigma), n) - mu == pytest.approx(sigma * standard_max, rel=1e-6)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 1024])
def test_gaussian_approximation_bounds_the_max_from_above(n: int) -> None:
    exact = expected_max(Jitter("normal", 1.0, 0.01), n)
    approx = gaussian_max_approx(1.0, 0.01, n)
    assert exact <= approx + 1e-12
    assert approx - exact < 0.01  # and not absurdly: within one sigma up to n = 1024


# --- parameter server ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 8])
def test_bsp_single_server_is_compute_plus_incast_push_and_pull(n: int) -> None:
    server_in, server_out = 0.0009, 0.0007  # M beta on the server NIC; the worker adds alpha
    trace = simulate_ps(np.full((20, n), BASE), push_s=PUSH, pull_s=PULL, server_in_s=server_in,
                        server_out_s=server_out, mode="sync")
    expected = BASE + max(PUSH, n * server_in) + max(PULL, n * server_out)
    assert trace.mean_step_s == pytest.approx(np.full(n, expected), rel=1e-12)
    assert trace.step_s == pytest.approx(np.full((20, n), expected), rel=1e-9)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_latency_passes_before_the_server_link_so_incast_adds_to_it(n: int) -> None:
    alpha, server_in, server_out = 0.0004, 0.0009, 0.0007
    trace = simulate_ps(np.full((20, n), BASE), push_s=alpha + server_in, pull_s=alpha + server_out,
                        server_in_s=server_in, server_out_s=server_out, mode="sync", latency_s=alpha)
    # The calibration's parameter-server cost: 2 alpha + n M beta each way through one server.
    expected = BASE + 2 * alpha + n * (server_in + server_out)
    assert trace.step_s == pytest.approx(np.full((20, n), expected), rel=1e-9)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_bsp_with_one_shard_per_worker_has_no_incast(n: int) -> None:
    trace = simulate_ps(np.full((20, n), BASE), **sharded(n), mode="sync")
    assert trace.mean_step_s == pytest.approx(np.full(n, BASE + PUSH + PULL), rel=1e-12)
    assert trace.wait_s == pytest.approx(0.0, abs=1e-15)  # everyone pushes at once: nobody waits


@pytest.mark.parametrize("distribution,std_ms", [("normal", 2.0), ("exponential", None), ("lognormal", 5.0)])
@pytest.mark.parametrize("n", [4, 32])
def test_jittered_synchronous_steps_average_the_expected_max(distribution: str, std_ms: float | None, n: int) -> None:
    cfg = jitter_cfg(distribution, mean_ms=5.0, std_ms=std_ms)
    compute = compute_times(cfg, n, steps=2000, base_s=BASE, seed=3)
    expected = BASE + expected_max(Jitter.from_cfg(cfg), n) + PUSH + PULL
    steps = synchronous_steps(compute, PUSH + PULL)
    assert abs(steps.mean() - expected) < 4 * steps.std() / math.sqrt(len(steps))
    if distribution != "lognormal":  # the parameter server's rounds, too (only one draw of them: fewer runs)
        trace = simulate_ps(compute, **sharded(n), mode="sync")
        rounds = np.diff(trace.end[:, 0], prepend=0.0)
        assert rounds == pytest.approx(steps, rel=1e-9)  # each round: slowest compute, then push and pull
        assert abs(trace.mean_step_s[0] - expected) < 4 * rounds.std() / math.sqrt(len(rounds))


def test_ssp_with_zero_staleness_is_bsp() -> None:
    compute = compute_times(jitter_cfg("exponential", std_ms=None), 6, 100, BASE, seed=5)
    bsp = simulate_ps(compute, **sharded(6), mode="sync")
    ssp = simulate_ps(compute, **sharded(6), mode="ssp", staleness=0)
    assert np.array_equal(bsp.end, ssp.end) and np.array_equal(bsp.released, ssp.released)


@pytest.mark.parametrize("staleness", [0, 1, 3, 6])
def test_ssp_lead_reaches_but_never_exceeds_the_staleness(staleness: int) -> None:
    straggled = simulate_ps(compute_times(STRAGGLER, 4, 100, BASE, 0), **sharded(4), mode="ssp", staleness=staleness)
    assert straggled.max_lead == staleness  # the fast workers run ahead as far as allowed, no further
    jittered = compute_times(jitter_cfg("lognormal", mean_ms=10.0, std_ms=20.0), 16, 200, BASE, seed=1)
    assert simulate_ps(jittered, **sharded(16), mode="ssp", staleness=staleness).max_lead <= staleness


def test_persistent_straggler_sets_ssp_pace_and_async_spares_the_fast() -> None:
    compute = compute_times(STRAGGLER, 4, 300, BASE, 0)
    bsp = simulate_ps(compute, **sharded(4), mode="sync")
    ssp = simulate_ps(compute, **sharded(4), mode="ssp", staleness=3)
    asp = simulate_ps(compute, **sharded(4), mode="async")
    slow_step = 2 * BASE + PUSH + PULL
    assert bsp.mean_step_s == pytest.approx(np.full(4, slow_step), rel=0.01)
    # Bounded staleness only lets the fast workers finish s steps early: the straggler sets the pace.
    assert ssp.throughput_steps_per_s == pytest.approx(bsp.throughput_steps_per_s, rel=0.03)
    assert ssp.mean_step_s[1] == pytest.approx(slow_step, rel=0.01)
    assert asp.mean_step_s[0] == pytest.approx(BASE + PUSH + PULL, rel=0.01)  # its own pace
    assert asp.mean_step_s[1] == pytest.approx(slow_step, rel=0.01)
    assert asp.wait_s.max() == 0.0 and asp.max_lead > 100
    assert asp.throughput_steps_per_s > 1.5 * bsp.throughput_steps_per_s


def test_ssp_absorbs_transient_jitter_that_bsp_waits_for() -> None:
    compute = compute_times(jitter_cfg("exponential", mean_ms=10.0, std_ms=None), 8, 300, BASE, seed=2)
    bsp = simulate_ps(compute, **sharded(8), mode="sync")
    ssp = simulate_ps(compute, **sharded(8), mode="ssp", staleness=4)
    asp = simulate_ps(compute, **sharded(8), mode="async")
    assert ssp.throughput_steps_per_s > 1.3 * bsp.throughput_steps_per_s
    assert ssp.wait_s.mean() < 0.25 * bsp.wait_s.mean()
    assert asp.throughput_steps_per_s >= ssp.throughput_steps_per_s


def test_single_server_incast_serializes_simultaneous_pushes() -> None:
    # Async, so no gate hides the link: n workers pushing at once through one server NIC all finish
    # after n M beta (fair sharing), while k = n shards finish each after M beta.
    n, m_beta = 8, 0.001
    one = simulate_ps(np.full((1, n), BASE), push_s=m_beta, pull_s=m_beta, server_in_s=m_beta,
                      server_out_s=m_beta, mode="async")
    assert one.pushed[0] == pytest.approx(np.full(n, BASE + n * m_beta), rel=1e-12)
    sharded_trace = simulate_ps(np.full((1, n), BASE), **sharded(n), mode="async")
    assert sharded_trace.pushed[0] == pytest.approx(np.full(n, BASE + PUSH), rel=1e-12)


def test_server_link_is_shared_fairly_by_overlapping_pushes() -> None:
    # 1 ms of server work each, arriving 0.5 ms apart. The first runs alone for 0.5 ms, then at half
    # speed; from +1 ms a third of the link each, so the first is done at +1.75 ms (first-come-first-
    # served: +1 ms). The other two share until the second is done at +2.75 ms, the last at +3 ms.
    compute = np.array([[BASE, BASE + 0.0005, BASE + 0.001]])
    trace = simulate_ps(compute, push_s=1e-6, pull_s=1e-6, server_in_s=0.001, server_out_s=0.0, mode="async")
    assert trace.pushed[0] == pytest.approx([BASE + 0.00175, BASE + 0.00275, BASE + 0.003], rel=1e-12)


def test_a_fifo_server_link_serves_in_arrival_order_and_shares_among_simultaneous_arrivals() -> None:
    # The same arrivals as above: first come, first served (+1, +2, +3 ms) ...
    compute = np.array([[BASE, BASE + 0.0005, BASE + 0.001]])
    trace = simulate_ps(compute, push_s=1e-6, pull_s=1e-6, server_in_s=0.001, server_out_s=0.0, mode="async",
                        server_link="fifo")
    assert trace.pushed[0] == pytest.approx([BASE + 0.001, BASE + 0.002, BASE + 0.003], rel=1e-12)
    # ... and those arriving together share: n simultaneous pushes all land after n M beta.
    n, m_beta = 4, 0.001
    together = simulate_ps(np.full((1, n), BASE), push_s=m_beta, pull_s=m_beta, server_in_s=m_beta,
                           server_out_s=m_beta, mode="async", server_link="fifo")
    assert together.pushed[0] == pytest.approx(np.full(n, BASE + n * m_beta), rel=1e-12)


def test_two_async_workers_on_a_fifo_server_link_settle_into_pushing_while_the_other_pulls() -> None:
    # Measured over tc (docs/virtual.md): once jitter parts them, one worker's push and the other's
    # pull share no link, and a step costs compute + push + pull, not the 2 (push + pull) of lockstep.
    steps, link = 200, 0.048
    compute = 0.002 * np.random.default_rng(0).lognormal(0.0, 0.1, (steps, 2))
    args = dict(push_s=link, pull_s=link, server_in_s=link, server_out_s=link, mode="async")
    fifo = simulate_ps(compute, **args, server_link="fifo").step_s[20:].mean()
    fair = simulate_ps(compute, **args).step_s[20:].mean()
    assert fifo == pytest.approx(0.002 + 2 * link, rel=0.05) and fair == pytest.approx(0.002 + 4 * link, rel=0.05)


# --- backup workers -----------------------------------------------------------------------------

OWN_LINKS = dict(push_s=PUSH, pull_s=PULL, server_in_s=0.0, server_out_s=0.0)  # no server link: nothing contends


def test_backup_workers_step_at_the_order_statistic_of_compute() -> None:
    """Three workers, one backup: each update takes the first two gradients, so the fast workers' step
    is the second-fastest compute plus push and pull; the slow worker's gradient never enters. It
    pushes nothing, waits for the update and pulls the newest version, sitting out the steps the
    others have made meanwhile (at once where its parameters hold them, else waiting for them)."""
    fast, second, slow = BASE, 1.3 * BASE, 2 * BASE
    compute = np.tile([fast, second, slow], (300, 1))
    trace = simulate_ps(compute, **OWN_LINKS, mode="sync", backup=1)
    assert trace.step_s[:, :2] == pytest.approx(np.full((300, 2), second + PUSH + PULL), rel=1e-9)
    assert not trace.dropped[:, :2].any() and not trace.sat_out[:, :2].any()
    assert (trace.dropped[:, 2] ^ trace.sat_out[:, 2]).all()  # every step of the slow worker: one or the other
    computed = np.flatnonzero(trace.dropped[:, 2])
    assert trace.step_s[computed, 2] == pytest.approx(slow + PULL, rel=1e-9)  # no push, the update is there already
    waited = np.flatnonzero(trace.sat_out[:, 2] & (trace.step_s[:, 2] > 0))
    skipped = np.flatnonzero(trace.sat_out[:, 2] & (trace.step_s[:, 2] == 0))
    assert len(waited) and len(skipped)
    # Each of its pulls is of a version made after the step it was at: the others' pushes of it landed.
    pulls = np.concatenate([computed, waited])
    assert (trace.released[pulls, 2] >= trace.pushed[pulls, :2].max(axis=1)).all()
    assert trace.end[pulls, 2] - trace.released[pulls, 2] == pytest.approx(PULL, rel=1e-9)
    assert simulate_ps(compute, **OWN_LINKS, mode="sync").step_s == pytest.approx(slow + PUSH + PULL, rel=1e-9)


def test_a_late_worker_sends_nothing_through_the_server() -> None:
    # One server, M beta = 1 ms each way: the two fast pushes share its link (2 ms), and so do their
    # pulls; without backup workers the slow push joins them and all three pulls share the link.
    m_beta, slow = 0.001, 2 * BASE
    links = dict(push_s=m_beta, pull_s=m_beta, server_in_s=m_beta, server_out_s=m_beta)
    compute = np.array([[BASE, BASE, slow]])
    backup = simulate_ps(compute, **links, mode="sync", backup=1)
    assert backup.end[0] == pytest.approx([BASE + 4 * m_beta, BASE + 4 * m_beta, slow + m_beta], rel=1e-12)
    assert backup.dropped[0].tolist() == [False, False, True]
    plain = simulate_ps(compute, **links, mode="sync")
    assert plain.end[0] == pytest.approx(np.full(3, slow + m_beta + 3 * m_beta), rel=1e-12)


def test_no_backup_workers_replay_exactly_as_before_them() -> None:
    """Jitter, incast on one server and latency: the sums of the trace of the simulation as it was
    before backup workers (commit 2c2a952), to the last bit."""
    cfg = OmegaConf.create({"name": "jitter", "distribution": "lognormal", "mean_ms": 3.0, "std_ms": 4.0, "ranks": None})
    compute = compute_times(cfg, 5, 80, [0.01, 0.011, 0.012, 0.02, 0.01], 7)
    trace = simulate_ps(compute, push_s=0.0014, pull_s=0.0012, server_in_s=0.001, server_out_s=0.0009, mode="sync",
                        latency_s=0.0004, backup=0)
    assert trace.end[-1].tolist() == [2.425977111223311] * 5
    assert [trace.end.sum(), trace.pushed.sum(), trace.released.sum()] == [501.921532630108, 496.8027549355994,
                                                                          499.9615326301081]
    assert not trace.dropped.any() and not trace.sat_out.any()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="mode"):
        simulate_ps(np.ones((2, 2)), **sharded(2), mode="bsp")
    with pytest.raises(ValueError, match="staleness"):
        simulate_ps(np.ones((2, 2)), **sharded(2), mode="ssp", staleness=-1)
    for backup, mode in ((2, "sync"), (-1, "sync"), (1, "async")):
        with pytest.raises(ValueError, match="backup"):
            simulate_ps(np.ones((2, 2)), **sharded(2), mode=mode, backup=backup)
    with pytest.raises(ValueError, match="distribution"):
        expected_max(Jitter("uniform", 1.0, 1.0), 2)
