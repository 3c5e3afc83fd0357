"""Alpha-beta-gamma costs against hand-computed values, and calibration on synthetic benchmark records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from testbed.costs import (
    Cost,
    Link,
    algbw,
    best_chunks,
    binomial_tree,
    busbw,
    double_binary_tree,
    halving_doubling,
    parameter_server,
    pipelined_tree,
    recursive_doubling,
    ring,
    two_tree_reduce_broadcast,
)
from testbed.sim import calibrate

pytestmark = pytest.mark.unit

LINK = Link(alpha=1e-5, beta=1e-9, gamma=1e-10)
MIB = 2**20
NO_GAMMA = Link(alpha=1e-5, beta=1e-9)


# --- formulas at hand-computed points -------------------------------------------------------------


def test_ring_formula():
    # 6 alpha + 1.5e6 beta = 6e-5 + 1.5e-3
    assert ring(4, 1e6).time(NO_GAMMA) == pytest.approx(1.56e-3, rel=1e-12)
    # + 0.75e6 gamma = 7.5e-5
    assert ring(4, 1e6).time(LINK) == pytest.approx(1.635e-3, rel=1e-12)
    assert ring(4, 1e6) == Cost(6, 1.5e6, 0.75e6)


def test_recursive_doubling_formula():
    # n=8: h=3 -> 3 (1e-5 + 1e-3 + 1e-4) = 3.33e-3
    assert recursive_doubling(8, 1e6).time(LINK) == pytest.approx(3.33e-3, rel=1e-12)
    # n=5: h=ceil(log2 5)=3, same
    assert recursive_doubling(5, 1e6) == Cost(3, 3e6, 3e6)


def test_halving_doubling_formula():
    # n=8 (power of 2): 6 alpha + 1.75e6 beta + 0.875e6 gamma = 6e-5 + 1.75e-3 + 8.75e-5
    assert halving_doubling(8, 1e6).time(LINK) == pytest.approx(1.8975e-3, rel=1e-12)
    # n=6: floor(lg 6)=2 -> 6 alpha; (10/6 + 2) M beta; (1 + 5/6) M gamma
    assert halving_doubling(6, 1e6).time(LINK) == pytest.approx(6e-5 + 11 / 3 * 1e-3 + 11 / 6 * 1e-4, rel=1e-12)
    assert halving_doubling(3, 1.2e6) == Cost(4, pytest.approx(1.2e6 * (4 / 3 + 2)), pytest.approx(2e6))


def test_binomial_tree_formula():
    # n=4: h=2 -> 4 (1e-5 + 1e-3) + 2e-4 = 4.24e-3
    assert binomial_tree(4, 1e6).time(LINK) == pytest.approx(4.24e-3, rel=1e-12)


def test_pipelined_tree_formula():
    # n=8 h=3, c=10: 2 * 13 * (1e-5 + 1e-4) + 1e6 gamma = 2.86e-3 + 1e-4
    assert pipelined_tree(8, 1e6, 10).time(LINK) == pytest.approx(2.96e-3, rel=1e-12)
    assert pipelined_tree(8, 1e6, 10) == Cost(26, pytest.approx(2.6e6), 1e6)


def test_parameter_server_formula():
    # k=1, n=4: 2 alpha + 2 * 4e6 beta + 4e6 gamma = 2e-5 + 8e-3 + 4e-4
    assert parameter_server(4, 1e6).time(LINK) == pytest.approx(8.42e-3, rel=1e-12)
    # overlapped push and pull: one phase of 4e6
    assert parameter_server(4, 1e6, overlap_push_pull=True) == Cost(2, 4e6, 4e6)
    # k=8 > n=4: worker NIC (M) is the busiest
    assert parameter_server(4, 1e6, servers=8) == Cost(2, 2e6, 0.5e6)
    # colocated k=n=4: ring's bandwidth term, 2 * 3/4 M
    assert parameter_server(4, 1e6, servers=4, colocated=True) == Cost(2, 1.5e6, 1e6)
    # a lone worker still pushes to and pulls from its server, unless it is the server
    assert parameter_server(1, 1e6) == Cost(2, 2e6, 1e6)
    assert parameter_server(1, 1e6, overlap_push_pull=True) == Cost(2, 1e6, 1e6)
    assert parameter_server(1, 1e6, servers=1, colocated=True) == Cost(0, 0, 0)


def test_double_binary_tree_picks_closed_form_optimum():
    # c* = sqrt(h M beta / alpha) = sqrt(3 * 1e6 * 1e-9 / 1e-5) = sqrt(300) = 17.32 -> 17 or 18
    assert best_chunks(8, 1e6, NO_GAMMA) == 17
    t = double_binary_tree(8, 1e6, NO_GAMMA).time(NO_GAMMA)
    assert t == pytest.approx(2 * 20 * (1e-5 + 1e-3 / 17), rel=1e-12)
    # close to 2h alpha + 2M beta + 4 sqrt(h alpha M beta)
    assert t == pytest.approx(6e-5 + 2e-3 + 4 * math.sqrt(3e-5 * 1e-3), rel=1e-3)


def test_double_binary_tree_chunk_limits():
    free = Link(alpha=0.0, beta=1e-9)
    assert best_chunks(4, 4000, free) == 1000  # one float per chunk
    assert best_chunks(4, 2, free) == 1
    assert best_chunks(4, 1e6, Link(alpha=1e-5, beta=0.0)) == 1
    assert best_chunks(4, 40, Link(alpha=1e-9, beta=1e-6)) == 10  # c* ~ 283, capped at M/4


# --- properties -----------------------------------------------------------------------------------


def test_ring_busbw_independent_of_n():
    link = Link(alpha=0.0, beta=1 / 1.25e9)
    values = [busbw(1e8, ring(n, 1e8).time(link), n) for n in (2, 4, 64, 1024)]
    assert values == pytest.approx([1.25e9] * 4, rel=1e-12)
    assert algbw(1e8, 0.5) == 2e8


def test_ps_scaling_in_n():
    link = Link(alpha=1e-5, beta=1e-9)
    single = [parameter_server(n, 1e6).time(link) for n in range(1, 10)]
    steps = np.diff(single)
    assert steps == pytest.approx([2e-3] * 8, rel=1e-9)
    sharded = [parameter_server(n, 1e6, servers=n).time(link) for n in range(1, 10)]
    assert sharded == pytest.approx([2e-5 + 2e-3] * 9, rel=1e-12)


def test_pipelined_tree_approaches_bandwidth_bound():
    link = Link(alpha=1e-12, beta=1e-9)
    times = [pipelined_tree(16, 1e8, c).time(link) for c in (1, 10, 1000, 100000)]
    assert times == sorted(times, reverse=True)
    assert times[0] == pytest.approx(2 * 5 * 0.1, rel=1e-6)  # unpipelined: 2(h + 1) M beta
    assert times[-1] == pytest.approx(2 * 1e8 * 1e-9, rel=1e-3)


@pytest.mark.parametrize("n,nbytes", [(2, 4e3), (8, 1e6), (13, 3e7), (1024, 1e9)])
def test_double_binary_tree_beats_every_fixed_chunk_count(n, nbytes):
    best = double_binary_tree(n, nbytes, LINK).time(LINK)
    for c in (1, 2, 7, 50, 1000, 10**5):
        assert best <= pipelined_tree(n, nbytes, c).time(LINK) * (1 + 1e-12)


ALLREDUCES = {
    "ring": lambda n: ring(n, 1e6),
    "recursive_doubling": lambda n: recursive_doubling(n, 1e6),
    "halving_doubling": lambda n: halving_doubling(n, 1e6),
    "binomial_tree": lambda n: binomial_tree(n, 1e6),
    "pipelined_tree": lambda n: pipelined_tree(n, 1e6, 4),
    "double_binary_tree": lambda n: double_binary_tree(n, 1e6, LINK),
    "two_tree_reduce_broadcast": lambda n: two_tree_reduce_broadcast(n, 1e6, 1 << 16),
}


@pytest.mark.parametrize("algorithm", ALLREDUCES)
def test_one_rank_allreduce_is_free(algorithm):
    assert ALLREDUCES[algorithm](1) == Cost(0, 0, 0)
    assert ALLREDUCES[algorithm](4).time(LINK) > 0


def test_double_binary_tree_is_the_pipelined_tree_at_its_best_chunk_count():
    assert double_binary_tree(8, 1e6, NO_GAMMA) == pipelined_tree(8, 1e6, 17)


# --- bad inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,name",
    [
        (lambda: ring(0, 1e6), "n"),
        (lambda: halving_doubling(4, -1), "nbytes"),
        (lambda: pipelined_tree(4, 1e6, 0), "chunks"),
        (lambda: parameter_server(4, 1e6, servers=0), "servers"),
        (lambda: parameter_server(4, 1e6, servers=2, colocated=True), "servers"),
        (lambda: Link(alpha=-1.0, beta=1e-9), "alpha"),
        (lambda: Link(alpha=0.0, beta=float("nan")), "beta"),
        (lambda: busbw(1e6, 0.0, 4), "time_s"),
        (lambda: busbw(1e6, 1.0, 0), "n"),
    ],
)
def test_bad_inputs_name_the_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}\b|\b{name} "):
        call()


# --- calibration ----------------------------------------------------------------------------------

ALPHA, BETA = 50e-6, 8 / 1e9  # 50 us, 1 Gbit/s
SIZES = [4096 * 4**i for i in range(9)]  # 4 KiB .. 256 MiB


def synthetic(noise: float = 0.0, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    link = Link(ALPHA, BETA)
    records = []

    def add(impl: str, n: int, nbytes: int, cost: Cost, **extra) -> None:
        t = cost.time(link) * (1 + noise * rng.standard_normal())
        records.append({"impl": impl, "world_size": n, "bytes": nbytes, "time_s": t, "correct": True, **extra})

    for n in (1, 2, 4, 8):
        for m in SIZES:
            add("ring", n, m, ring(n, m), link="1gbit")
            add("tree", n, m, two_tree_reduce_broadcast(n, m, 1 << 20), link="1gbit")
            for k in (1, 2):
                add(f"ps_k{k}", n, m, parameter_server(n, m, servers=k))  # no link key: loopback
    return records


def test_calibration_recovers_noiseless_alpha_beta():
    fits = calibrate.fit_records(synthetic(), min_bytes=0)
    assert [(f.link, f.impl, f.points) for f in fits] == [
        ("1gbit", "ring", 27),  # n = 1 rows carry no traffic
        ("1gbit", "tree", 27),
        ("loopback", "ps_k1", 36),
        ("loopback", "ps_k2", 36),
    ]
    for f in fits:
        assert f.alpha == pytest.approx(ALPHA, rel=1e-6)
        assert f.beta == pytest.approx(BETA, rel=1e-6)
        assert f.rate_gbit == pytest.approx(1.0, rel=1e-6)
        assert f.gm_error < 1e-9 and f.max_error < 1e-9
        assert f.to_link() == Link(f.alpha, f.beta)


def test_calibration_with_noise():
    fits = calibrate.fit_records(synthetic(noise=0.05, seed=1), min_bytes=0)
    for f in fits:
        assert f.alpha == pytest.approx(ALPHA, rel=0.05)
        assert f.beta == pytest.approx(BETA, rel=0.05)
        assert 0.01 < f.gm_error < 0.08
        assert f.max_error > f.gm_error


def test_calibration_skips_failed_records_and_keeps_alpha_nonnegative():
    records = synthetic()
    records.append({"impl": "ring", "world_size": 2, "bytes": 4096, "time_s": 100.0, "correct": False, "link": "1gbit"})
    ring_fit = next(f for f in calibrate.fit_records(records, min_bytes=0) if f.impl == "ring")
    assert ring_fit.alpha == pytest.approx(ALPHA, rel=1e-6)
    # pure bandwidth data whose small points fall below the line: the unconstrained alpha is negative
    flat = [
        {"impl": "ring", "world_size": 2, "bytes": m, "time_s": m * BETA * (0.5 if m < 1e5 else 1.0)} for m in SIZES
    ]
    (fit,) = calibrate.fit_records(flat, min_bytes=0)
    assert fit.alpha == 0.0 and fit.beta > 0
    assert fit.link == "loopback"


def test_calibration_leaves_small_messages_out_by_default():
    # Messages within an emulated link's burst pass at memory speed, far under the line.
    records = [dict(r, time_s=r["time_s"] / 20) if r["bytes"] < calibrate.MIN_BYTES else r for r in synthetic()]
    ring_fit = next(f for f in calibrate.fit_records(records) if f.impl == "ring")
    assert ring_fit.points == 15  # 5 sizes >= 1 MiB at n = 2, 4, 8
    assert ring_fit.beta == pytest.approx(BETA, rel=1e-6) and ring_fit.gm_error < 1e-9
    skewed = next(f for f in calibrate.fit_records(records, min_bytes=0) if f.impl == "ring")
    assert skewed.gm_error > 0.1


def test_calibration_rejects_unknown_impl():
    with pytest.raises(ValueError, match="records: unknown impl 'mystery'"):
        calibrate.fit_records([{"impl": "mystery", "world_size": 2, "bytes": 4, "time_s": 1.0, "correct": True}])


def test_calibration_models_halving_doubling():
    rec = {"impl": "halving_doubling", "world_size": 6, "bytes": 1 << 20, "correct": True}
    assert calibrate.model(rec) == halving_doubling(6, 1 << 20)
    assert calibrate.model({**rec, "world_size": 1}) is None  # nothing sent
    link = Link(ALPHA, BETA)
    records = [{**rec, "world_size": n, "bytes": m, "time_s": halving_doubling(n, m).time(link)}
               for n in (1, 2, 3, 4, 6, 8) for m in SIZES]
    (fit,) = calibrate.fit_records(records, min_bytes=0)
    assert (fit.impl, fit.points) == ("halving_doubling", 5 * len(SIZES))
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-6) and fit.beta == pytest.approx(BETA, rel=1e-6)
    with pytest.raises(ValueError, match="allowed: native, ring, tree, halving_doubling, grpc_raw"):
        calibrate.model({**rec, "impl": "recursive_halving"})


def test_lookup_fallback_and_error():
    fits = calibrate.fit_records(synthetic(), min_bytes=0)
    assert calibrate.lookup(fits, "1gbit", "tree").impl == "tree"
    assert calibrate.lookup(fits, "1gbit", "ps_k4").impl == "ring"  # no PS series on that link
    with pytest.raises(ValueError, match=r"'loopback'.*python -m testbed.bench --out") as info:
        calibrate.lookup(fits, "loopback", "tree")
    assert "--bandwidth" not in str(info.value)
    with pytest.raises(ValueError, match=r"'100mbit'.*python -m testbed.bench --bandwidth 100mbit --out"):
        calibrate.lookup(fits, "100mbit", "ring")


def test_load_records_save_load_round_trip(tmp_path):
    bench, ps = tmp_path / "bench.json", tmp_path / "ps.json"
    records = synthetic()
    bench.write_text(json.dumps([r for r in records if "link" in r]))
    ps.write_text(json.dumps([r for r in records if "link" not in r]))
    loaded = calibrate.load_records([bench, ps])
    assert len(loaded) == len(records)
    assert {r["link"] for r in loaded} == {"1gbit", "loopback"}
    fits = calibrate.fit_records(loaded, min_bytes=0)
    out = tmp_path / "calibration.json"
    calibrate.save(fits, out, [bench, ps])
    assert calibrate.load(out) == fits
    assert json.loads(out.read_text())["sources"] == [str(bench), str(ps)]


def test_cli_prints_and_writes(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(synthetic()))
    out = tmp_path / "cal.json"
    assert calibrate.main([str(bench), "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "1gbit      ring" in table and "50.0" in table and "1.000" in table
    assert len(calibrate.load(out)) == 4


# --- compute calibration --------------------------------------------------------------------------


def write_steps(tmp_path, steps: list[dict]) -> None:
    (tmp_path / "metrics").mkdir()
    lines = [json.dumps(s) for s in steps]
    (tmp_path / "metrics" / "rank0.jsonl").write_text("\n".join(lines) + "\n")


def step(i: int, scale: float) -> dict:
    return {"step": i, "samples": 32, "t_data": 0.001 * scale, "t_injected": 0.5, "t_forward": 0.004 * scale,
            "t_backward": 0.008 * scale, "t_sync": 0.0, "t_optimizer": 0.003 * scale, "t_step": 0.016 * scale}


def test_compute_per_sample(tmp_path):
    # 10 steps: the first 2 (20%) slow warm-up steps, then 1x, 1x, 1x, 1x, 2x, 1x, 1x, 1x
    scales = [50, 50, 1, 1, 1, 1, 2, 1, 1, 1]
    write_steps(tmp_path, [step(i, s) for i, s in enumerate(scales)])
    got = calibrate.compute_per_sample(tmp_path)
    assert got["steps"] == 8
    assert got["samples"] == 32
    assert got["t_compute_per_sample"] == pytest.approx(0.016 / 32)
    assert got["t_forward"] == pytest.approx(0.004)
    assert got["t_backward"] == pytest.approx(0.008)
    assert got["t_optimizer"] == pytest.approx(0.003)
    assert got["t_data"] == pytest.approx(0.001)
    assert calibrate.compute_per_sample(tmp_path, warmup=1)["steps"] == 9
    with pytest.raises(ValueError, match="warmup"):
        calibrate.compute_per_sample(tmp_path, warmup=10)
    with pytest.raises(ValueError, match="warmup must be >= 0"):
        calibrate.compute_per_sample(tmp_path, warmup=-1)


def test_compute_per_sample_warmup_default_is_at_least_one(tmp_path):
    write_steps(tmp_path, [step(i, s) for i, s in enumerate([50, 50, 1, 1])])
    got = calibrate.compute_per_sample(tmp_path)  # 20% of 4 rounds to 0: one step is skipped anyway
    assert got["steps"] == 3 and got["t_forward"] == pytest.approx(0.004)
    # nothing skipped: the median of four falls between the slow and the fast steps
    assert calibrate.compute_per_sample(tmp_path, warmup=0)["t_forward"] == pytest.approx(0.004 * 25.5)


def test_compute_per_sample_without_log(tmp_path):
    with pytest.raises(ValueError, match="job_dir"):
        calibrate.compute_per_sample(tmp_path)


def test_the_testbeds_two_tree_all_reduce():
    # n = 2: every rank is a root or a leaf (k = 1), h = 1: 8 chunk steps per phase, each way once.
    assert two_tree_reduce_broadcast(2, 16 * MIB, MIB) == Cost(16, 16 * MIB, 8 * MIB)
    # n = 4: an inner node has k = 2 children, h = 2: 9 steps per phase of 2 chunks on its link.
    assert two_tree_reduce_broadcast(4, 16 * MIB, MIB) == Cost(18, 36 * MIB, 16 * MIB)
    # Large M: about M beta at n = 2 and 2 M beta from n = 4 on, whatever n.
    for n in (4, 64, 1024):
        t = two_tree_reduce_broadcast(n, 1e9, MIB).time(Link(0.0, 1e-9))
        assert 2.0 <= t <= 2.05
    assert two_tree_reduce_broadcast(1, 16 * MIB, MIB) == Cost(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        two_tree_reduce_broadcast(4, 16 * MIB, 0)


def test_calibration_models_the_tree_at_the_chunk_its_record_names():
    record = {"impl": "tree", "world_size": 4, "bytes": 16 << 20}
    older = calibrate.model(record)  # written before records carried the chunk: the bench's 1 MiB then
    assert older == two_tree_reduce_broadcast(4, 16 << 20, 1 << 20)
    assert calibrate.model({**record, "tree_chunk_kb": 256}) == two_tree_reduce_broadcast(4, 16 << 20, 256 << 10)
    assert calibrate.model({**record, "tree_chunk_kb": 256}) != older


def test_hierarchical_costs_the_nodes_ring_and_the_shards_all_reduce() -> None:
    """2 nodes x 4 ranks, 8 MB: the node's ring (2 (L - 1) messages, 2 (L - 1)/L M bytes) and the
    ring across nodes over a quarter (2 (N - 1) messages, 2 (N - 1)/N M/L bytes)."""
    from testbed.sync.hierarchical import SPEC

    cfg = OmegaConf.create({"world_size": 8, "sync": {"ranks_per_node": 4, "inter": "ring"}, "network": {"name": "loopback"}})
    cost = SPEC.sim.cost(cfg)(8e6)
    assert (cost.messages, cost.bytes) == (2 * 3 + 2 * 1, pytest.approx(2 * 3 / 4 * 8e6 + 2 * 1 / 2 * 2e6))
