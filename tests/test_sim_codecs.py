"""The simulator's codecs: payloads as the codecs build them, their time from the codec benchmark,
and each synchronizer's way of carrying them, against hand computations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from testbed.checks import ConfigError
from testbed.compress import build_codec
from testbed.costs import Link, allgather, ring
from testbed.paths import config_dir
from testbed.sim import calibrate
from testbed.sim.codecs import CodecFit, fit_codec_records
from testbed.sim.step import communication_bound_s, gradient_shapes, gradient_tensors, simulate
from testbed.sync.flat import bucket_ends

BETA = 8 / 1e9
ALPHA = 50e-6
COMPUTE = 64 * 0.1e-3
# A nominal 1 Gbit link and 0.1 ms per sample; codecs free unless a test gives them time.
NOMINAL = ["sim.bandwidth=1gbit", "sim.alpha_us=50", "sim.compute_ms_per_sample=0.1", "data.batch_size=64",
           "steps=12", "warmup_steps=2", "sim.codec_time_scale=0"]
LINK = Link(ALPHA, BETA)


def cfg_of(overrides: list[str]):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=NOMINAL + overrides)


@pytest.mark.parametrize("codec", ["fp16", "topk", "randomk", "qsgd", "signsgd", "powersgd"])
def test_simulated_payloads_are_the_codecs_own_over_the_runs_buckets(codec: str) -> None:
    """The plan builds each bucket's codec on the meta device; a run builds it on real gradients."""
    cfg = cfg_of(["sync=ring", "world_size=4", f"compress={codec}", "sync.bucket_mb=0.2"])
    sizes, shapes = gradient_tensors(cfg), gradient_shapes(cfg)
    ends = bucket_ends(sizes, 0.2 * 2**20)
    real = 0
    for index, (a, b) in enumerate(zip([0, *ends], ends)):
        bucket = torch.randn(sum(s.numel() for s in shapes[a:b]))
        real += sum(build_codec(cfg.compress, bucket, shapes[a:b], index, 0, 0).rounds())
    facts = simulate(cfg)["sync_facts"]["compress"]
    assert len(ends) > 1 and facts["payload_bytes"] == real
    assert facts["ratio"] == pytest.approx(sum(sizes) / real)


def test_a_linear_codec_all_reduces_its_payload_and_a_non_linear_one_allgathers_it() -> None:
    n = 4
    for codec, linear in (("randomk", True), ("topk", False)):
        cfg = cfg_of(["sync=ring", f"world_size={n}", f"compress={codec}"])
        summary = simulate(cfg)
        payload = summary["sync_facts"]["compress"]["payload_bytes"]
        wire = ring(n, payload) if linear else allgather(n, payload)
        assert summary["step_time"] == pytest.approx(COMPUTE + wire.time(LINK), rel=1e-6), codec
    # The allgather's traffic grows with n, the all-reduce's does not.
    assert allgather(64, 1.0).bytes / allgather(4, 1.0).bytes == 21
    assert ring(64, 1.0).bytes / ring(4, 1.0).bytes == pytest.approx(1.32, rel=1e-2)


def test_powersgd_runs_two_all_reduces_after_its_uncompressed_steps() -> None:
    cfg = cfg_of(["sync=allreduce", "world_size=4", "compress=powersgd", "compress.start_step=5", "steps=10",
                  "warmup_steps=0"])
    summary = simulate(cfg)
    plain = COMPUTE + ring(4, sum(gradient_tensors(cfg))).time(LINK)
    facts = summary["sync_facts"]["compress"]
    compressed = summary["step_time_p10"] - COMPUTE
    # The two factors' all-reduces: twice the messages of one, the payload's bytes.
    assert compressed == pytest.approx(2 * 6 * ALPHA + 2 * 3 / 4 * facts["payload_bytes"] * BETA, rel=1e-6)
    assert summary["step_time_p90"] == pytest.approx(plain, rel=1e-6)  # steps 0-4 send everything


def test_ddp_hooks_are_costed_as_the_codecs_they_stand_for() -> None:
    hook = simulate(cfg_of(["sync=ddp", "world_size=4", "sync.hook=fp16"]))
    plain = simulate(cfg_of(["sync=ddp", "world_size=4"]))
    assert hook["sync_facts"]["compress"]["codec"] == "fp16"
    assert hook["sync_facts"]["compress"]["ratio"] == 2.0 and hook["step_time"] < plain["step_time"]


def test_a_synchronizer_that_never_communicates_is_simulated_with_no_codec() -> None:
    alone = simulate(cfg_of(["sync=none", "world_size=2"]))
    assert alone["step_time"] == pytest.approx(COMPUTE) and alone["phases"]["t_sync"]["median"] == 0.0
    assert "compress" not in alone["sync_facts"]


def test_codec_times_run_through_the_benchmarks_medians() -> None:
    fit = CodecFit("topk 1% +ef", [2**20, 2**22], [1e-3, 5e-3], [1e-4, 3e-4])
    assert fit.encode_time(2**21) == pytest.approx(7 / 3 * 1e-3)  # between the points
    assert fit.encode_time(2**23) == pytest.approx(5e-3 + 16 / 3 * 1e-3)  # the last segment's slope beyond
    assert fit.decode_time(0) == pytest.approx(1e-4 / 3)  # the first segment's intercept: a fixed cost
    assert fit.encode_time(0) == 0.0  # never below zero
    records = [{"codec": "topk", "label": "topk 1% +ef", "bytes": b, "encode_s": e, "decode_s": d}
               for b, e, d in [(2**22, 5e-3, 3e-4), (2**20, 1e-3, 1e-4), (2**20, 3e-3, 1e-4), (2**20, 2e-3, 1e-4)]]
    assert fit_codec_records(records) == [CodecFit("topk 1% +ef", [2**20, 2**22], [2e-3, 5e-3], [1e-4, 3e-4])]


def test_the_calibration_keeps_codec_times_and_the_step_pays_them(tmp_path: Path) -> None:
    bench = tmp_path / "codecs.json"
    bench.write_text(json.dumps([{"codec": "topk", "label": "topk 1% +ef", "bytes": b, "encode_s": b * 1e-9,
                                  "decode_s": b * 1e-10} for b in (2**20, 2**24)]))
    out = tmp_path / "cal.json"
    assert calibrate.main([str(bench), "--out", str(out)]) == 0
    assert calibrate.load(out) == [] and calibrate.load_codecs(out)[0].codec == "topk 1% +ef"
    base = ["sync=ring", "world_size=4", "compress=topk", f"sim.calibration={out}", "sim.codec_time_scale=1"]
    cfg = cfg_of([*base, "sim.link=1gbit"])
    with pytest.raises(ConfigError, match="no calibration for link"):  # codec times only: no link fit
        simulate(cfg)
    cfg = cfg_of(base[:3] + ["sim.codec_time_scale=2"])
    cfg.sim.calibration = None
    with pytest.raises(ConfigError, match="sim.codec_time_scale=0"):  # the fix is named
        simulate(cfg)


def test_a_compressed_step_pays_encode_and_n_decodes(tmp_path: Path) -> None:
    fits = tmp_path / "cal.json"
    calibrate.save([calibrate.Fit("1gbit", "ring", ALPHA, BETA, 0.0, 0.0, 2)], fits, codecs=[
        CodecFit("topk 1% +ef", [2**20, 2**24], [1e-3, 16e-3], [1e-4, 16e-4])])
    n = 4
    cfg = cfg_of(["sync=ring", f"world_size={n}", "compress=topk", f"sim.calibration={fits}", "sim.link=1gbit",
                  "sim.codec_time_scale=0.5"])
    summary = simulate(cfg)
    raw, payload = sum(gradient_tensors(cfg)), summary["sync_facts"]["compress"]["payload_bytes"]
    encode = 0.5 * (1e-3 + (raw - 2**20) * 15e-3 / (2**24 - 2**20))
    decode = 0.5 * (1e-4 + (raw - 2**20) * 15e-4 / (2**24 - 2**20))
    expected = COMPUTE + encode + allgather(n, payload).time(LINK) + n * decode
    assert summary["step_time"] == pytest.approx(expected, rel=1e-6)
    assert summary["phases"]["t_encode"]["median"] == pytest.approx(encode)
    assert summary["phases"]["t_decode"]["median"] == pytest.approx(n * decode)


def test_the_parameter_server_pushes_payloads_and_pulls_them_only_when_asked() -> None:
    # alpha = 0: one server, sync: n pushes, then n pulls, through the server's link.
    n = 4
    args = ["sync=ps", f"world_size={n}", "sim.alpha_us=0", "compress=topk"]
    push_only, both = simulate(cfg_of(args)), simulate(cfg_of([*args, "compress.pull=true"]))
    raw, payload = sum(gradient_tensors(cfg_of(args))), push_only["sync_facts"]["compress"]["payload_bytes"]
    assert push_only["step_time"] == pytest.approx(COMPUTE + n * (payload + raw) * BETA, rel=1e-6)
    assert both["step_time"] == pytest.approx(COMPUTE + 2 * n * payload * BETA, rel=1e-6)


def test_the_bound_of_a_compressed_run_is_its_payloads_wire() -> None:
    cfg = cfg_of(["sync=ring", "world_size=4", "compress=qsgd", "network=emulated", "network.bandwidth=1gbit",
                  "network.latency_ms=0.05"])
    payload = simulate(cfg)["sync_facts"]["compress"]["payload_bytes"]
    assert communication_bound_s(cfg) == pytest.approx(allgather(4, payload).time(LINK), rel=1e-9)
