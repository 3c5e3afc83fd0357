"""The collective benchmark runs real worlds and writes nccl-tests-style records."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import read_json, run_cli

from testbed.collectives.registry import COLLECTIVES

FIELDS = {"impl", "world_size", "bytes", "time_s", "algbw", "busbw", "correct"}


def test_benchmark_records_and_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = run_cli(["--world-sizes", "2,3", "--sizes", "4K,256K,1M", "--iters", "2", "--out", str(out)],
                   cwd=tmp_path, module="testbed.bench")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_json(out)
    impls = tuple(COLLECTIVES)  # every registered algorithm, by default
    assert {(r["impl"], r["world_size"], r["bytes"]) for r in records} == {
        (impl, n, size) for impl in impls for n in (2, 3) for size in (4096, 1 << 18, 1 << 20)
    }
    for r in records:
        assert FIELDS <= set(r) and r["correct"] is True
        assert 0 < r["time_min_s"] <= r["time_s"] and r["iters"] == 2
        assert r["bound_fraction"] > 0 and r["link_beta_s"] > 0  # against the link calibrated in the same run
    assert "ring/native" in proc.stdout and "tree/native" in proc.stdout and "tree of bound" in proc.stdout

    # Figure 2 and the alpha-beta fits from these records.
    figures = tmp_path / "fig2"
    proc = run_cli([str(out), "--out", str(figures)], cwd=tmp_path, module="analysis")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (figures / "collectives.png").stat().st_size > 1000 and (figures / "collectives.pdf").exists()
    report = (figures / "report.md").read_text()
    for impl in impls:  # one fit per impl over its 2 (n, size >= 1 MiB) points
        (row,) = [line for line in report.splitlines() if line.startswith(f"| loopback | {impl} |")]
        assert row.rstrip(" |").endswith("| 2"), row


def test_benchmark_rejects_unknown_impl(tmp_path: Path) -> None:
    proc = run_cli(["--impls", "ring,bogus"], cwd=tmp_path, module="testbed.bench")
    assert proc.returncode == 2 and "--impls: unknown bogus" in proc.stderr


def test_ps_benchmark_interleaves_the_raw_stream_and_every_shard_count(tmp_path: Path) -> None:
    out = tmp_path / "ps.json"
    proc = run_cli(["--workers", "2", "--servers", "1,2", "--sizes", "256K", "--iters", "3", "--warmup", "1",
                    "--no-native", "--out", str(out)], cwd=tmp_path, module="testbed.bench.ps")
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = {r["impl"]: r for r in read_json(out)}
    assert set(records) == {"grpc_raw", "ps_k1", "ps_k2"}
    for impl, r in records.items():
        assert FIELDS <= set(r) and r["correct"] is True and r["iters"] == 3 and r["link"] == "loopback"
        assert r["world_size"] == 2 and r["bytes"] == 1 << 18 and r["bound_fraction"] > 0
        # Paired with every other impl of the world, round by round.
        assert set(r["paired"]) == set(records) - {impl} and all(v > 0 for v in r["paired"].values())
    # Push then pull: two workers' M through one server link each way, or M/2 each through each of
    # two; one alpha per phase (the link calibrated in the same run).
    alpha, beta, m = records["ps_k2"]["link_alpha_s"], records["ps_k2"]["link_beta_s"], 1 << 18
    expected = (2 * alpha + 2 * 2 * m * beta) / (2 * alpha + 2 * m * beta)
    assert records["ps_k2"]["bound_scaling"] == pytest.approx(expected) and records["ps_k1"]["bound_scaling"] == 1.0
    assert "ps_k1/grpc_raw" in proc.stdout and "ps_k2 of bound" in proc.stdout
    assert "n=2 256K: ps_k2" in proc.stdout
