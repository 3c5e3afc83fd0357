"""Gradient codecs: each codec's own identities in-process, then every codec x all-reduce
synchronizer in one real two-rank world (wire bytes, replicas, exactness at ratio 1), then a run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import read_json, read_jsonl, run_cli, sync_config
from omegaconf import OmegaConf
from torch import nn

from testbed.compress import CODECS, build_codec
from testbed.compress.codec import Alone, PayloadCodec
from testbed.launch.spawn import spawn_world
from testbed.sync import build_synchronizer
from testbed.world import World

SHAPES = [torch.Size([24, 16]), torch.Size([24]), torch.Size([5, 24])]  # a bucket of 3 tensors
NUMEL = sum(s.numel() for s in SHAPES)
DEFAULTS = {name: OmegaConf.structured(spec.schema) for name, spec in CODECS.items()}


def codec_cfg(name: str, **changes: Any) -> Any:
    cfg = DEFAULTS[name].copy()
    for key, value in changes.items():
        cfg[key] = value
    return cfg


def make(name: str, rank: int = 0, seed: int = 0, **changes: Any) -> Any:
    return build_codec(codec_cfg(name, **changes), torch.zeros(NUMEL), SHAPES, 0, rank, seed)


# --- each codec alone --------------------------------------------------------------------------


def test_payload_bytes_follow_each_codecs_formula() -> None:
    k = round(0.01 * NUMEL)
    expected = {
        "fp16": 2 * NUMEL, "bf16": 2 * NUMEL,
        "topk": 4 * k + 4 * k,  # int32 indices, fp32 values (a multiple of 4 already)
        "randomk": 4 * k,
        "qsgd": NUMEL + 4 * math.ceil(NUMEL / 512),  # an int8 per element, a norm per block of 512
        "signsgd": math.ceil(NUMEL / 8) + 4,
        # torch's rule compresses the 24 x 16 matrix ((24 + 16) * 2 < 384) but neither the bias
        # nor the 5 x 24 matrix ((5 + 24) * 2 < 120 holds, so it is compressed too): P and Q at r = 1.
        "powersgd": 4 * (24 + (24 + 16) + (5 + 24)),
    }
    assert set(expected) == set(CODECS) - {"none"}
    for name, nbytes in expected.items():
        assert make(name).payload_bytes() == nbytes, name


@pytest.mark.parametrize("name", ["topk", "randomk"])
def test_sparsifiers_at_ratio_one_send_everything(name: str) -> None:
    codec = make(name, ratio=1.0, error_feedback=False)
    x = torch.randn(NUMEL)
    out = torch.full((NUMEL,), 7.0)
    codec.decode(codec.encode(x), out)
    assert torch.equal(out, x)


@pytest.mark.parametrize("name", ["topk", "randomk", "fp16", "bf16", "signsgd", "qsgd"])
def test_error_feedback_identity(name: str) -> None:
    """What is sent plus the new residual is the input plus the old residual."""
    codec = make(name, error_feedback=True)
    assert isinstance(codec, PayloadCodec)
    torch.manual_seed(1)
    for _ in range(3):
        grad = torch.randn(NUMEL)
        old = codec.residual.clone()
        x = grad.clone()
        payload = codec.compress(x)
        sent = torch.zeros(NUMEL)
        codec.decode(payload, sent)
        # x - decoded is exact where they are within 2x of each other (Sterbenz); the sum then is too.
        assert torch.equal(sent + codec.residual, grad + old) if name not in ("signsgd", "qsgd") else \
            torch.allclose(sent + codec.residual, grad + old, rtol=0, atol=1e-6)
        assert torch.equal(x, grad + old)


def test_randomk_draws_the_same_indices_on_every_rank() -> None:
    codecs = [make("randomk", rank=r, seed=3) for r in range(3)]
    x = torch.randn(NUMEL)
    for _ in range(2):
        for c in codecs:
            c.compress(x.clone())
        assert all(torch.equal(c.chosen, codecs[0].chosen) for c in codecs)
    first = codecs[0].chosen.clone()
    codecs[0].compress(x.clone())
    assert not torch.equal(codecs[0].chosen, first), "each step draws new indices"


def test_qsgd_in_blocks_keeps_a_fed_back_error_from_growing() -> None:
    """A compressed pull's held copy h follows parameters p by h += Q(p - h): the error is fed
    back. With one norm over 300 k elements QSGD's error is larger than what it encodes, so p - h
    grows every step (the divergence a parameter server with compress=qsgd compress.pull=true
    showed); with a norm per block of 512 it stays at the size of one step's update."""
    numel, steps = 300_000, 12
    for block, bounded in ((512, True), (0, False)):
        codec = build_codec(codec_cfg("qsgd", block=block), torch.zeros(numel), [torch.Size([numel])], 0, 0, 0)
        gen = torch.Generator().manual_seed(0)
        params, held, decoded = torch.zeros(numel), torch.zeros(numel), torch.empty(numel)
        for _ in range(steps):
            params += torch.randn(numel, generator=gen) * 1e-3  # one step's update, norm ~0.55
            codec.decode(codec.compress(params - held), decoded)
            held += decoded
        gap = float((params - held).norm())
        assert (gap < 0.55) == bounded, (block, gap)


def test_qsgd_is_unbiased_and_signsgd_keeps_signs() -> None:
    x = torch.randn(NUMEL)
    qsgd = make("qsgd", levels=2)
    mean = torch.zeros(NUMEL)
    draws = 2000
    for _ in range(draws):
        out = torch.zeros(NUMEL)
        qsgd.decode(qsgd.compress(x.clone()), out)
        mean += out / draws
    assert float((mean - x).abs().max()) < 0.1 * float(x.norm()) / 2 ** 0.5  # ~5 sigma of the draws' mean
    sign = make("signsgd", error_feedback=False)
    out = torch.zeros(NUMEL)
    sign.decode(sign.compress(x.clone()), out)
    assert torch.equal(out.sign(), torch.where(x >= 0, 1.0, -1.0))
    assert torch.allclose(out.abs(), x.abs().mean().expand(NUMEL))


def test_powersgd_reconstructs_a_rank_r_matrix_at_rank_r() -> None:
    torch.manual_seed(0)
    rows, cols, r = 32, 24, 3
    matrix = torch.randn(rows, r) @ torch.randn(r, cols)
    cfg = codec_cfg("powersgd", rank=r, error_feedback=False, warm_start=False)
    codec = build_codec(cfg, torch.zeros(rows * cols), [torch.Size([rows, cols])], 0, 0, 0)
    bucket = matrix.flatten().clone()
    codec.reduce_(bucket, Alone())
    assert float((bucket.view(rows, cols) - matrix).abs().max()) < 1e-5 * float(matrix.abs().max())


# --- every codec under every all-reduce synchronizer, in one real world ----------------------

SYNCS = ["allreduce", "ring", "tree", "halving_doubling", "hierarchical"]
CODEC_RUNS = {
    "none": {}, "fp16": {}, "bf16": {}, "topk": {"ratio": 0.05}, "randomk": {"ratio": 0.05}, "qsgd": {},
    "signsgd": {}, "powersgd": {"rank": 2}, "topk_all": {"ratio": 1.0}, "randomk_all": {"ratio": 1.0},
    "topk_overlap": {"ratio": 0.05, "overlap": True}, "powersgd_overlap": {"rank": 2, "overlap": True},
}


RAW_BYTES = 4 * (16 * 32 + 32 + 32 * 4 + 4)  # Net's fp32 gradients


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def codec_world(syncs: list[str], runs: dict[str, dict[str, Any]], steps: int) -> dict[str, Any]:
    """Each (sync, codec) trains Net for ``steps`` steps of SGD on this rank's batch; returns per
    pair its wire bytes, the bytes its payloads must take on this synchronizer's own collectives,
    whether the replicas agree, and the final parameters."""
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    world = World(rank, rank, n, n, torch.device("cpu"), "gloo", 60.0)
    out: dict[str, Any] = {}
    for sync_name in syncs:
        for run, changes in runs.items():
            name, changes = run.split("_")[0], dict(changes)
            overlap = changes.pop("overlap", False)
            compress = codec_cfg(name, **changes) if name != "none" else None
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            # Two buckets; two nodes of one.
            cfg = sync_config(sync_name, bucket_mb=0.0005, overlap=overlap, chunk_kb=1, double=True, ranks_per_node=1)
            sync = build_synchronizer(cfg) if compress is None else \
                type(build_synchronizer(cfg))(cfg, compress, seed=5)
            sync.setup(model, optimizer, world)
            gen = torch.Generator().manual_seed(rank)
            sent = []
            for step in range(steps):
                x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
                with sync.micro_step(True):
                    nn.functional.mse_loss(model(x), y).backward()
                sent.append(sync.after_backward(step).bytes_sent)
                optimizer.step()
                sync.zero_grad()
            expected = None
            if sync.codecs is not None:  # the payloads over this synchronizer's own collectives
                expected = 0
                for codec in sync.codecs:
                    if name == "powersgd":
                        parts = [codec.first.numel(), codec.q_memory.numel()]
                        expected += sum(sync.allreduce_payload_(torch.zeros(p))[0] for p in parts if p)
                    elif codec.linear:
                        expected += sync.allreduce_payload_(torch.zeros(codec.payload_numel(), dtype=codec.payload_dtype))[0]
                    else:
                        expected += (n - 1) * codec.payload_bytes()
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            everyone = [torch.empty_like(flat) for _ in range(n)]
            dist.all_gather(everyone, flat)
            out[f"{sync_name}/{run}"] = {
                "sent": sent, "expected": expected, "agree": all(torch.equal(e, flat) for e in everyone),
                "params": flat, "payload": None if sync.codecs is None else sum(c.payload_bytes() for c in sync.codecs),
            }
            sync.close()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def codec_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return spawn_world(codec_world, (SYNCS, CODEC_RUNS, 4), 2, tmp_path_factory.mktemp("codecs") / "logs")[0]


@pytest.mark.parametrize("sync", SYNCS)
def test_every_codec_sends_its_payload_and_keeps_replicas_identical(codec_runs: dict[str, Any], sync: str) -> None:
    for run in CODEC_RUNS:
        result = codec_runs[f"{sync}/{run}"]
        assert result["agree"], f"{sync}/{run}: replicas differ"
        assert torch.isfinite(result["params"]).all(), f"{sync}/{run}"
        if run != "none":
            assert result["sent"] == [result["expected"]] * len(result["sent"]), f"{sync}/{run}"
            if not run.endswith("_all"):
                assert result["payload"] < RAW_BYTES, f"{sync}/{run}: no saving"


@pytest.mark.parametrize("sync", SYNCS)
def test_sparsifiers_at_ratio_one_train_exactly_as_uncompressed(codec_runs: dict[str, Any], sync: str) -> None:
    plain = codec_runs[f"{sync}/none"]["params"]
    for run in ("topk_all", "randomk_all"):
        assert torch.equal(codec_runs[f"{sync}/{run}"]["params"], plain), f"{sync}/{run}"


@pytest.mark.parametrize("sync", SYNCS)
def test_overlapped_codecs_train_as_after_backward(codec_runs: dict[str, Any], sync: str) -> None:
    for name in ("topk", "powersgd"):
        assert torch.equal(codec_runs[f"{sync}/{name}_overlap"]["params"], codec_runs[f"{sync}/{name}"]["params"]), name


@pytest.mark.parametrize("sync", SYNCS)
def test_half_precision_tracks_fp32(codec_runs: dict[str, Any], sync: str) -> None:
    plain = codec_runs[f"{sync}/none"]["params"]
    for run in ("fp16", "bf16"):
        params = codec_runs[f"{sync}/{run}"]["params"]
        assert float((params - plain).norm() / plain.norm()) < 1e-3, f"{sync}/{run}"


# --- a run, as a user starts it ----------------------------------------------------------------


def test_compressed_run_records_codec_facts_and_phases(tmp_path: Path) -> None:
    job = tmp_path / "job"
    proc = run_cli(["world_size=2", "sync=ring", "compress=topk", "compress.ratio=0.1", "steps=6", "warmup_steps=1",
                    f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_json(job / "summary.json")
    facts = summary["sync_facts"]["compress"]
    assert facts["codec"] == "topk" and not facts["linear"]
    assert summary["sync_label"] == "ring topk 10% +ef"
    assert summary["bytes_per_step"] == facts["payload_bytes"]  # n = 2: one allgather slot each way
    assert 4.5 < facts["ratio"] < 5.5  # 10 % of the values, each with its index
    assert summary["phases"]["t_encode"]["median"] > 0 and summary["phases"]["t_decode"]["median"] > 0
    records = read_jsonl(job / "metrics" / "rank0.jsonl")
    assert all(r["residual_norm"] > 0 for r in records)


# --- torch's DDP hooks as the reference ----------------------------------------------------------


def hook_world(steps: int) -> dict[str, Any]:
    """The same Net trained by DDP with torch's hook and by the native all-reduce with the
    testbed's codec (one bucket each: with several, torch's PowerSGD hook over Gloo hung here,
    its callback waiting on an all-reduce queued behind it): bytes and loss per step of each."""
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    world = World(rank, rank, n, n, torch.device("cpu"), "gloo", 60.0)
    pairs = {
        "fp16": ({"hook": "fp16"}, codec_cfg("fp16")),
        "powersgd": ({"hook": "powersgd", "powersgd": {"matrix_approximation_rank": 2, "start_powerSGD_iter": 2}},
                     codec_cfg("powersgd", rank=2, start_step=2)),
    }
    out: dict[str, Any] = {}
    for name, (hook, codec) in pairs.items():
        for side in ("torch", "testbed"):
            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            if side == "torch":
                sync = build_synchronizer(OmegaConf.create({"name": "ddp", "bucket_mb": 25, **hook}))
            else:
                cfg = OmegaConf.create({"name": "allreduce", "bucket_mb": 25, "overlap": False})
                sync = type(build_synchronizer(cfg))(cfg, codec, seed=0)
            sync.setup(model, optimizer, world)
            gen = torch.Generator().manual_seed(rank)
            sent, losses = [], []
            for step in range(steps):
                x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
                with sync.micro_step(True):
                    loss = nn.functional.mse_loss(sync.module(x), y)
                    loss.backward()
                sent.append(sync.after_backward(step).bytes_sent)
                optimizer.step()
                sync.zero_grad()
                losses.append(float(loss))
            out[f"{name}/{side}"] = {"sent": sent, "losses": losses}
            sync.close()
    dist.destroy_process_group()
    return out


def test_codecs_match_torchs_ddp_hooks(tmp_path: Path) -> None:
    results = spawn_world(hook_world, (8,), 2, tmp_path / "logs")[0]
    for name in ("fp16", "powersgd"):
        ours, theirs = results[f"{name}/testbed"], results[f"{name}/torch"]
        assert ours["sent"] == theirs["sent"], name  # the same bytes per step, uncompressed steps included
        for a, b in zip(ours["losses"], theirs["losses"]):
            assert abs(a - b) <= 0.05 * abs(b), (name, ours["losses"], theirs["losses"])
    assert results["powersgd/testbed"]["sent"][2] < results["powersgd/testbed"]["sent"][0] / 2  # compressed from step 2


def test_codec_benchmark_records_every_codec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from testbed.bench import codecs

    out = tmp_path / "codecs.json"
    assert codecs.main(["--sizes", "64K", "--reps", "2", "--out", str(out)]) == 0
    records = read_json(out)
    assert {r["codec"] for r in records} == set(CODECS) - {"none"}
    for r in records:
        assert r["bytes"] == 64 * 1024 and r["encode_s"] > 0 and r["decode_s"] > 0
        assert r["ratio"] == pytest.approx(r["bytes"] / make_payload_bytes(r["codec"], r["bytes"] // 4))
    assert "encode ms/MB" in capsys.readouterr().out


def make_payload_bytes(name: str, numel: int) -> int:
    from testbed.bench.codecs import shapes_of

    cfg = codec_cfg(name, **({"ratio": 0.01} if "ratio" in DEFAULTS[name] else {}))
    return build_codec(cfg, torch.zeros(numel), shapes_of(4 * numel), 0, 0, 0).payload_bytes()


# --- the parameter server: compressed pushes ----------------------------------------------------


def test_ps_with_topk_equals_a_hand_computed_step(tmp_path: Path) -> None:
    """Two workers push top-k payloads to a real shard; the pulled parameters are the hand step:
    p - lr * (decode(topk(g0)) + decode(topk(g1))) / 2, exactly (lr a power of two)."""
    from conftest import LR, SGD, client

    from testbed.ps.launch import LocalServers

    numel = 3000  # several 1 KiB chunks: the payload crosses chunk boundaries
    cfg = codec_cfg("topk", ratio=0.1)
    torch.manual_seed(0)
    start, grads = torch.randn(numel), [torch.randn(numel), torch.randn(numel)]
    sync_cfg = {"servers": 1, "mode": "sync", "staleness": 0, "chunk_kb": 1, "host": "127.0.0.1"}
    with LocalServers(sync_cfg, SGD, 2, tmp_path / "logs", compress=OmegaConf.to_container(cfg), seed=0) as ps:
        workers = [client(ps, w) for w in range(2)]
        workers[0].init_params([start.clone()])
        decoded = []
        for w, c in enumerate(workers):
            codec = build_codec(cfg, grads[w], [grads[w].shape], 0, w, 0)
            payload = codec.compress(grads[w].clone())
            dense = torch.zeros(numel)
            codec.decode(payload, dense)
            decoded.append(dense)
            c.push_shard(0, payload, 0)
        params = torch.zeros(numel)
        workers[1].pull([params], 1)
        stats = workers[0].stats()[0]
        for c in workers:
            c.close()
    mean = decoded[0].clone().add_(decoded[1]).div_(2)
    assert torch.equal(params, start - LR * mean)
    assert (decoded[0] != 0).sum() == 300 and not torch.equal(decoded[0], grads[0])
    assert stats.bytes_in == numel * 4 + 2 * (8 * 300)  # the initial parameters, then two payloads


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ps_compressed_pull_sends_the_encoded_update(tmp_path: Path, mode: str) -> None:
    """compress.pull: after a full first pull, a worker gets topk(new - held) and adds it, step
    after step; the shard's held copy moves by what each pull carried, so what was left out is
    sent later from the difference itself, once (no residual on top, which would send it twice)."""
    from conftest import LR, SGD, client

    from testbed.ps.launch import LocalServers

    numel, steps = 3000, 2
    cfg = codec_cfg("topk", ratio=0.1, pull=True)
    torch.manual_seed(0)
    start = torch.randn(numel)
    grads = [[torch.randn(numel), torch.randn(numel)] for _ in range(steps)]
    sync_cfg = {"servers": 1, "mode": mode, "staleness": 0, "chunk_kb": 1, "host": "127.0.0.1"}
    with LocalServers(sync_cfg, SGD, 2, tmp_path / "logs", compress=OmegaConf.to_container(cfg), seed=0) as ps:
        workers = [client(ps, w) for w in range(2)]
        workers[0].init_params([start.clone()])
        params = torch.zeros(numel)
        workers[0].pull([params], 0, full=True)
        assert torch.equal(params, start)
        codecs = [build_codec(cfg, start, [start.shape], 0, w, 0) for w in range(2)]
        decoder = build_codec(cfg, params, [params.shape], 0, 0, 0)
        server = start.clone()
        for step in range(steps):
            sent = []
            for w, c in enumerate(workers):
                payload = codecs[w].compress(grads[step][w].clone())
                sent.append(torch.zeros(numel))
                codecs[w].decode(payload, sent[w])
                c.push_shard(0, payload, step)
            if mode == "sync":  # one step with the mean
                server = server - LR * sent[0].clone().add_(sent[1]).div_(2)
            else:  # each push applied on arrival, divided by the workers
                server = (server - LR * (sent[0] / 2)) - LR * (sent[1] / 2)
            held = params.clone()
            workers[0].pull([params], step + 1, decoders=[decoder])
            change = server - held  # what the worker lacks: more than the pull's top 10 % carries
            kept = torch.zeros(numel)
            top = torch.topk(change.abs(), 300).indices
            kept[top] = change[top]
            assert torch.allclose(params, held + kept, rtol=0, atol=1e-6), step
            assert int((params != held).sum()) == 300 < int((change != 0).sum())
        stats = workers[0].stats()[0]
        for c in workers:
            c.close()
    assert stats.bytes_out == numel * 4 + steps * 8 * 300  # the full first pull, then one payload a step


PS_CODECS = ["topk", "randomk", "signsgd"]


@pytest.fixture(scope="module")
def ps_codec_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One sweep: a parameter server under each codec."""
    sweep = tmp_path_factory.mktemp("ps_codecs")
    proc = run_cli(["-m", "world_size=2", "sync=ps", f"compress={','.join(PS_CODECS)}", "steps=4", "warmup_steps=1",
                    "launcher.echo_rank0=false", f"hydra.sweep.dir={sweep}"], cwd=sweep)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {read_json(p)["config"]["compress"]["name"]: p.parent for p in sweep.glob("*/summary.json")}


@pytest.mark.parametrize("codec", PS_CODECS)
def test_ps_run_with_a_codec_pushes_its_payload(ps_codec_runs: dict[str, Path], codec: str) -> None:
    summary = read_json(ps_codec_runs[codec] / "summary.json")
    facts = summary["sync_facts"]["compress"]
    assert summary["bytes_per_step"] == facts["payload_bytes"] < summary["gradient_bytes"] / 10
    assert summary["replicas_identical"] and summary["sync_facts"]["server_stats"][0]["rejected"] == 0
