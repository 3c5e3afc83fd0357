"""ZeRO stages 1-3 (sync=zero) train the model one process trains on the concatenated batch, hold
exactly the model state ZeRO's formula gives, and move 2Ψ (stages 1, 2) or 3Ψ (stage 3) per step;
torch's references (zero_torch, fsdp) end at the same model; sharded checkpoints resume at another
world size; bad input is refused before spawn.

The synchronizer cases of one world size run in one spawned world: real processes and the ring
over Gloo, checked against a reference each rank computes alone. The checkpoints go through the
command line and the trainer."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import load_params, read_json, read_jsonl, relative_error, run_cli, sync_config
from omegaconf import OmegaConf
from torch import nn

from testbed.checks import ConfigError
from testbed.launch.spawn import spawn_world
from testbed.memory import model_state_bytes, state_per_element, step_counter_bytes, zero_formula
from testbed.preflight import check_command_line
from testbed.sync import spec_of
from testbed.world import World

TOL = 1e-5
TOL_FP16 = 2e-3  # fp16's rounding of each step's mean gradient
VOCAB, WIDTH, BATCH, STEPS = 11, 6, 12, 4


class Tied(nn.Module):
    """Uneven layers (177 elements), a LayerNorm, and an output layer tied to the embedding."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.lin1, self.norm, self.lin2 = nn.Linear(WIDTH, 7), nn.LayerNorm(7), nn.Linear(7, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.lin2(F.relu(self.norm(self.lin1(self.emb(idx)))))
        return F.cross_entropy(self.head(x).view(-1, VOCAB), target.view(-1))


def batch(step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of (step, micro-step): every rank draws the same and takes its slice."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(VOCAB, (BATCH, 3), generator=g), torch.randint(VOCAB, (BATCH, 3), generator=g)


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)


def reference(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    model = Tied(case["tied"])
    opt = optimizer(case["optim"], model.parameters())
    k = case["accumulate"]
    for step in range(STEPS):
        for micro in range(k):
            (model(*batch(step, micro)) / k).backward()
        opt.step()
        opt.zero_grad()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def run_case(case: dict[str, Any], world: World) -> dict[str, Any]:
    rank, n, k = world.rank, world.world_size, case["accumulate"]
    model = Tied(case["tied"])
    opt = optimizer(case["optim"], model.parameters())
    name = case.get("sync", "zero")
    codec = OmegaConf.create({"name": case["compress"], "error_feedback": False}) if "compress" in case else None
    sync = spec_of(name).impl(sync_config(name, stage=case["stage"], bucket_mb=case["bucket_mb"], prefetch=case["prefetch"],
                                          accumulate=k, reshard_after_forward=case.get("reshard", True)), codec, 0)
    sync.setup(model, opt, world)
    part = slice(rank * BATCH // n, (rank + 1) * BATCH // n)
    sent, state, formula = [], None, None
    for step in range(STEPS):
        for micro in range(k):
            idx, target = batch(step, micro)
            with sync.micro_step(micro == k - 1):
                (sync.module(idx[part], target[part]) / k).backward()
            report = sync.after_backward(step, is_boundary=micro == k - 1)
        sent.append(report.bytes_sent)
        if state is None:
            state = model_state_bytes(sync.held())
            formula = zero_formula(sync.sharding(), state_per_element(opt), step_counter_bytes(opt))
        sync.zero_grad()
    sync.finalize()
    expected = reference(case)
    got = {name: p.detach() for name, p in sync.model.named_parameters()}
    digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in got.values())).hexdigest()
    facts = sync.describe()
    sync.close()
    return {"error": relative_error(got, expected), "hash": digest, "state": state, "formula": formula,
            "sent": sent, "psi": sum(p.numel() for p in model.parameters()), "facts": facts}


CASES = [
    # Stages 1 and 2 in units of ~50 elements, so that the units and the chunks in them are uneven.
    *[{"stage": s, "optim": o, "accumulate": 1, "bucket_mb": 0.0002, "prefetch": 1, "tied": True}
      for s in (1, 2, 3) for o in ("sgd", "adamw")],
    {"stage": 1, "optim": "adamw", "accumulate": 1, "bucket_mb": None, "prefetch": 1, "tied": True},
    *[{"stage": s, "optim": "sgd", "accumulate": 2, "bucket_mb": None, "prefetch": p, "tied": True}
      for s, p in ((2, 1), (3, 0), (3, 2))],
    # Untied, for the bytes: a tied layer is gathered once more, by the second module that uses it.
    *[{"stage": s, "optim": "sgd", "accumulate": 1, "bucket_mb": None, "prefetch": 1, "tied": False} for s in (1, 2, 3)],
    # Gradients reduce-scattered in fp16: half their bytes, each mean rounded to 11 bits.
    *[{"stage": s, "optim": "sgd", "accumulate": 1, "bucket_mb": None, "prefetch": 1, "tied": False, "compress": "fp16"}
      for s in (2, 3)],
    # The reference: FSDP2 on the same layers, tied ones in one group.
    *[{"sync": "fsdp", "reshard": r, "stage": 3, "optim": "adamw", "accumulate": a, "bucket_mb": None, "prefetch": 1,
       "tied": True} for r, a in ((True, 1), (False, 2))],
    # And torch's stage 1, whose shards are whole tensors.
    *[{"sync": "zero_torch", "stage": 1, "optim": o, "accumulate": 1, "bucket_mb": None, "prefetch": 1, "tied": True}
      for o in ("sgd", "adamw")],
]
ZERO = [i for i, c in enumerate(CASES) if c.get("sync", "zero") == "zero"]
FORMULA = [i for i, c in enumerate(CASES) if c.get("sync", "zero") in ("zero", "zero_torch")]


def zero_rank(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    world = World(rank, rank, n, n, torch.device("cpu"), "gloo", 60.0)
    results = [run_case(case, world) for case in cases]
    dist.destroy_process_group()
    return results


@pytest.fixture(scope="module", params=[2, 3])
def world_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[int, Any]]:
    n = request.param
    return n, spawn_world(zero_rank, (CASES,), n, tmp_path_factory.mktemp(f"zero{n}"))


@pytest.mark.parametrize("index", range(len(CASES)))
def test_stage_matches_single_process(world_results: tuple[int, dict[int, Any]], index: int) -> None:
    n, results = world_results
    case = [results[r][index] for r in range(n)]
    tolerance = TOL_FP16 if "compress" in CASES[index] else TOL
    assert max(c["error"] for c in case) <= tolerance, (CASES[index], [c["error"] for c in case])
    assert len({c["hash"] for c in case}) == 1, "the gathered replicas differ"


@pytest.mark.parametrize("index", FORMULA)
def test_model_state_is_the_formula(world_results: tuple[int, dict[int, Any]], index: int) -> None:
    n, results = world_results
    stage = CASES[index]["stage"]
    for rank in range(n):
        got = results[rank][index]
        assert got["state"] == got["formula"], (rank, CASES[index])
    # The shards add up to the model: every element is some rank's, once.
    psi, esize = results[0][index]["psi"], 4
    if CASES[index].get("sync") == "zero_torch":  # whole tensors per rank
        assert sum(results[0][index]["facts"]["shard_numel_by_rank"]) == psi
    kinds = {1: ("optimizer",), 2: ("optimizer", "grads"), 3: ("optimizer", "grads", "params")}[stage]
    if "grads" in kinds:
        assert sum(results[r][index]["state"]["grads"] for r in range(n)) == psi * esize
    if stage == 3:
        assert sum(results[r][index]["state"]["params"] for r in range(n)) == psi * esize
    else:
        assert all(results[r][index]["state"]["params"] == psi * esize for r in range(n))


@pytest.mark.parametrize("index", [i for i in ZERO if not CASES[i]["tied"]])
def test_bytes_on_the_wire(world_results: tuple[int, dict[int, Any]], index: int) -> None:
    """Each ring step moves every chunk once: per step the ranks together send (n - 1)Ψ per collective."""
    n, results = world_results
    psi = results[0][index]["psi"]
    # The gathers of parameters in float32 (two in stage 3), the reduce-scatter in the wire's dtype.
    per_psi = (2 if CASES[index]["stage"] == 3 else 1) * 4 + (2 if "compress" in CASES[index] else 4)
    for step in range(STEPS):
        total = sum(results[r][index]["sent"][step] for r in range(n))
        assert total == (n - 1) * psi * per_psi
    for rank in range(n):  # and each rank its share, to the element per unit and collective
        assert results[rank][index]["sent"][0] == pytest.approx((n - 1) / n * psi * per_psi, abs=3 * 4 * 8)


def test_fsdp_matches_zero_stage_3(world_results: tuple[int, dict[int, Any]]) -> None:
    """The reference and the testbed's stage 3 end at the same model, and hold the same state but
    for FSDP's padding of each parameter's first dimension to a multiple of the ranks."""
    n, results = world_results
    fsdp = next(i for i, c in enumerate(CASES) if c.get("sync") == "fsdp" and c["accumulate"] == 1)
    zero = next(i for i in ZERO if CASES[i]["stage"] == 3 and CASES[i]["optim"] == "adamw")
    for rank in range(n):
        ours, theirs = results[rank][zero], results[rank][fsdp]
        assert abs(ours["error"] - theirs["error"]) <= TOL  # both against the one reference
        assert theirs["state"]["optimizer"] == theirs["formula"]["optimizer"]  # its moments are unpadded
        for kind in ("params", "grads"):
            assert 0 <= theirs["state"][kind] - ours["state"][kind] <= 4 * 8 * n  # a few rows of padding


@pytest.mark.parametrize("args,expected", [
    (["sync=zero", "sync.stage=4"], "sync.stage=4: allowed: 1|2|3"),
    (["sync=zero", "sync.stage=3", "compress=topk"], "compress=topk with sync=zero sync.stage=3: the reduce-scatter"),
    (["sync=zero", "compress=fp16", "compress.error_feedback=true"], "its residual is not kept"),
    (["sync=fsdp", "model=custom", "model.target=custom_models.Tempered", "+model.kwargs.in_features=32",
      "+model.kwargs.hidden=8", "data.shape=[32]"],
     "sync=fsdp with model=custom: fully_shard cannot shard scalar parameters (temperature)"),
    (["sync=zero", "stats.noise_scale=true"], "ZeRO keeps only this rank's shard of the averaged gradient"),
])
def test_bad_input_is_refused_before_spawn(args: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_command_line(["world_size=2", *args])
    assert expected in str(info.value)


RESHARD = ["steps=8", "warmup_steps=1", "data.scaling=strong", "data.batch_size=60", "data.num_samples=120",
           "data.shape=[24]", "model.hidden=32", "optim=adamw", "launcher.echo_rank0=false"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 8 steps one process trains on the global batch: every resharded run must end there."""
    job = tmp_path_factory.mktemp("reshard") / "ref"
    proc = run_cli(["sync=none", "world_size=1", *RESHARD, f"hydra.run.dir={job}"], cwd=job.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(job / "summary.json")  # one process holds it all: DDP's row of ZeRO's table
    state = summary["memory"]["model_state"]
    assert state == summary["memory"]["formula"] and state[0]["params"] == state[0]["grads"] == summary["gradient_bytes"]
    return job


@pytest.mark.parametrize("sync,saved,resumed", [
    (["sync=zero", "sync.stage=3"], 4, 2),
    (["sync=zero", "sync.stage=1", "sync.bucket_mb=0.002"], 2, 3),  # units of ~500 elements
    (["sync=fsdp"], 3, 2),
    (["sync=zero_torch"], 2, 2),
], ids=["zero3-4to2", "zero1-2to3", "fsdp-3to2", "zero_torch-2to2"])
def test_sharded_checkpoint_resumes_at_another_world_size(
    tmp_path: Path, one_process: Path, sync: list[str], saved: int, resumed: int,
) -> None:
    """Saved by ``saved`` ranks after step 3 (each its pieces), resumed by ``resumed`` ranks from
    there: the run ends at the model of one process that was never interrupted."""
    first, second = tmp_path / "saved", tmp_path / "resumed"
    proc = run_cli([*sync, f"world_size={saved}", *RESHARD, "checkpoint.every=4", f"hydra.run.dir={first}"],
                   cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = first / "checkpoints" / "step0000003"
    assert sorted(p.name for p in step.glob("rank*.pt")) == [f"rank{r}.pt" for r in range(saved)]
    assert "pieces" in torch.load(step / "rank0.pt", weights_only=False)
    proc = run_cli([*sync, f"world_size={resumed}", *RESHARD, f"resume={first}", f"hydra.run.dir={second}"],
                   cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(second / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"]
    assert relative_error(load_params(second), load_params(one_process)) <= TOL
    memory = summary["memory"]  # counted through the trainer, each rank's beside the formula
    assert len(memory["model_state"]) == resumed
    if sync[0] != "sync=fsdp":  # FSDP pads its rows
        assert memory["model_state"] == memory["formula"]
    assert all(p >= b > 0 for p, b in zip(memory["peak_rss_bytes"], memory["baseline_rss_bytes"]))
    steps = [r["step"] for r in read_jsonl(second / "metrics" / "rank0.jsonl")]
    assert steps == (list(range(8)) if saved == resumed else list(range(4, 8)))  # earlier steps: same world only
