"""Predicted step times of a run, from the same config as a real run.

The model composes, per rank and step:
- compute: forward, backward and data time per sample (measured on a world_size 1 run, or given)
  times the rank's batch (under ``balance=static|dynamic``, the batch the trainer's rule gives it
  at that step) and accumulation micro-steps, plus the optimizer; ranks sharing ``sim.cores``
  cores slow down in proportion;
- the imbalance group's delays, drawn exactly as the trainer draws them (testbed.sim.events);
- communication: the synchronizer's alpha-beta cost (testbed.costs) per bucket, with the
  link fitted for that synchronizer's implementation (where the run compresses: of the codec's
  payloads, plus its encode and decode time, testbed.sim.codecs); with overlap, buckets start as
  backward produces their gradients (at an even rate, in bucket order) on one communication
  thread, and only what is left after backward is exposed (the iteration model of cost-model.md,
  simulated rather than bounded);
- the barrier: synchronous modes wait for the slowest rank every step, local SGD every ``period``
  steps, and the parameter server's modes (backup workers included) run the worker-clock simulation.

The result is per-rank step records in the trainer's format, summarized by the same code as a real
run, so ``summary.json`` has the same fields (marked ``simulated``).
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from testbed import config
from testbed.balance import SpeedWindow
from testbed.checks import require
from testbed.collectives.common import chunk_bounds
from testbed.costs import ZERO, Cost, Link, allgather
from testbed.data import spec_for
from testbed.imbalance import apportion, shard_batches
from testbed.models import build_model
from testbed.models.call import example_batch, model_call
from testbed.netem import parse_rate
from testbed.paths import in_checkout
from testbed.results.summary import summarize
from testbed.sim import calibrate, codecs
from testbed.sim.codecs import CodecPlan, Compressed
from testbed.sim.events import SERVER_LINKS, Delays, PsTrace, simulate_ps
from testbed.step_record import StepRecord
from testbed.sync import run_label, spec_of
from testbed.sync.flat import bucket_ends
from testbed.sync.spec import ranks_per_node


@dataclass(frozen=True)
class Compute:
    """Seconds per sample (forward, backward, data) and per step (optimizer), on one rank alone."""

    forward_s: float
    backward_s: float
    data_s: float
    optimizer_s: float

    @classmethod
    def from_job(cls, job_dir: str | Path) -> Compute:
        """Medians of a world_size 1 run's steady steps (testbed.sim.calibrate.compute_per_sample)."""
        m = calibrate.compute_per_sample(Path(job_dir))
        samples = m["samples"]
        return cls(m["t_forward"] / samples, m["t_backward"] / samples, m["t_data"] / samples, m["t_optimizer"])

    @classmethod
    def from_sim(cls, sim: Any) -> Compute:
        if sim.compute_from:
            return cls.from_job(sim.compute_from)
        if sim.compute_ms_per_sample is None:
            raise config.ConfigError(
                "sim: no compute time; set sim.compute_from=<job dir of a world_size=1 run> "
                "or sim.compute_ms_per_sample=<forward + backward ms per sample>"
            )
        per_sample = float(sim.compute_ms_per_sample) / 1e3
        share = float(sim.backward_share)
        return cls(per_sample * (1 - share), per_sample * share, 0.0, float(sim.optimizer_ms) / 1e3)


def _workload(cfg: Any) -> str | None:
    """The model and data that fix the gradients, as a key; None for a model the testbed does not
    build (``sim.gradient_mb``). A sweep predicts the same model at many points: it is built and
    profiled once per process."""
    if cfg.sim.gradient_mb is not None:
        return None
    parts = [OmegaConf.to_container(part, resolve=True, enum_to_str=True) for part in (cfg.model, cfg.data)]
    return json.dumps(parts, sort_keys=True)


@functools.lru_cache(maxsize=16)
def _meta_model(workload: str) -> torch.nn.Module:
    model_cfg, data_cfg = (OmegaConf.create(part) for part in json.loads(workload))
    with torch.device("meta"):  # shapes only: no memory, no initialization
        return build_model(model_cfg, spec_for(data_cfg))


def gradient_tensors(cfg: Any) -> list[int]:
    """Bytes of each gradient in the order backward produces them (the reverse of definition)."""
    workload = _workload(cfg)
    if workload is None:
        count = int(cfg.sim.tensors)
        return [float(cfg.sim.gradient_mb) * 2**20 / count] * count
    return [p.numel() * p.element_size() for p in _gradients(workload)]


def gradient_shapes(cfg: Any) -> list[torch.Size]:
    """The shapes of ``gradient_tensors`` (flat fp32 tensors for ``sim.gradient_mb``)."""
    workload = _workload(cfg)
    if workload is None:
        return [torch.Size([round(b / 4)]) for b in gradient_tensors(cfg)]
    return [p.shape for p in _gradients(workload)]


def _gradients(workload: str) -> list[torch.nn.Parameter]:
    return [p for p in reversed(list(_meta_model(workload).parameters())) if p.requires_grad]


def gradient_ready(cfg: Any) -> list[float] | None:
    """For each gradient of ``gradient_tensors``, the share of backward done when it is complete.

    Backward visits the layers in reverse forward order, each taking time in proportion to its
    forward FLOPs (counted on the meta device); a parameter's gradient is complete once backward
    has passed the first layer that uses it. Where bytes and FLOPs sit apart (VGG-16: 90 % of the
    bytes in the fully connected layers, whose gradients come first; nearly all FLOPs in the
    convolutions after them), an even rate of bytes over backward would place most communication
    late. None for a model the testbed does not build (``sim.gradient_mb``).
    """
    workload = _workload(cfg)
    return None if workload is None else list(_ready_shares(workload))


@functools.lru_cache(maxsize=16)
def _ready_shares(workload: str) -> tuple[float, ...]:
    model_cfg, data_cfg = (OmegaConf.create(part) for part in json.loads(workload))
    model, spec = _meta_model(workload), spec_for(data_cfg)
    with torch.device("meta"):
        first_use: dict[str, int] = {}

        def seen(name: str) -> Callable[..., None]:
            return lambda *_: None if name in first_use else first_use.update({name: len(first_use)})

        leaves = [(name, m) for name, m in model.named_modules() if not list(m.children())]
        hooks = [m.register_forward_hook(seen(name)) for name, m in leaves]
        with FlopCounterMode(display=False) as counter:
            # Called as the trainer calls it: a model that computes its own loss gets the targets too
            # (nanoGPT's forward without them reads the last position alone).
            model_call(model_cfg)(model, *example_batch(spec, 1, "meta"))
    for hook in hooks:
        hook.remove()
    counts = counter.get_flop_counts()
    root = type(model).__name__
    flops = [float(sum(counts.get(f"{root}.{name}", {}).values())) for name in sorted(first_use, key=first_use.get)]
    total = sum(flops) or 1.0
    done_after = list(itertools.accumulate(reversed(flops)))[::-1]  # backward work once layer i is done
    ready: dict[int, float] = {}
    for name, module in leaves:
        if name in first_use:
            for p in module.parameters(recurse=False):
                ready[id(p)] = max(ready.get(id(p), 0.0), done_after[first_use[name]] / total)
    return tuple(ready.get(id(p), 1.0) for p in reversed(list(model.parameters())) if p.requires_grad)


def link_for(cfg: Any, impl: str) -> tuple[Link, dict[str, Any]]:
    """The link for ``impl``: the calibration's fit, or the nominal rate and latency; with its source."""
    sim, network = cfg.sim, cfg.network
    emulated = network.name == "emulated"
    if sim.calibration:
        name = sim.link or (str(network.bandwidth) if emulated else calibrate.DEFAULT_LINK)
        try:
            fit = calibrate.lookup(calibrate.load(in_checkout(sim.calibration)), name, impl)
        except (OSError, ValueError) as exc:
            raise config.ConfigError(f"sim.calibration={sim.calibration}: {exc}") from None
        return fit.to_link(), {"source": "calibration", **asdict(fit)}
    rate = sim.bandwidth or (str(network.bandwidth) if emulated else None)
    if rate is None:
        raise config.ConfigError(
            "sim: no link; set sim.calibration=<fits of python -m testbed.sim.calibrate> or sim.bandwidth=<rate, e.g. 25gbit>"
        )
    try:
        bits = parse_rate(str(rate))
    except ValueError as exc:
        raise config.ConfigError(f"sim.bandwidth={rate}: {exc}") from None
    return Link(float(sim.alpha_us) / 1e6, 8.0 / bits), {"source": "nominal", "rate": rate, "alpha_us": sim.alpha_us}


def communication_bound_s(cfg: Any) -> float | None:
    """The busy communication of one synchronizing step at the synchronizer's own alpha-beta cost on
    the configured emulated link (alpha: its latency; beta: its rate), bucket by bucket where it
    buckets: what a run's measured busy time is set against (summary.json's ``sync_bound``). None
    where the link is not known (loopback, a real network), nothing is communicated, or a step's
    communication is not one worker's to bound: a parameter server's push queues behind the other
    workers' at the server (its bound is in the PS benchmark, testbed.bench.ps), or the ranks share
    machines' links (``network.nodes``), which a flat cost does not bound."""
    if cfg.network.name != "emulated" or cfg.network.get("nodes"):
        return None
    spec = spec_of(cfg.sync.name)
    if spec.sim is None or spec.sim.schedule == "clocks" or int(cfg.world_size) == 1:
        return None
    link = Link(float(cfg.network.latency_ms) / 1e3, 8.0 / parse_rate(str(cfg.network.bandwidth)))
    cost = spec.sim.cost(cfg)
    tensors = gradient_tensors(cfg)
    ends = _bucket_ends(cfg, tensors) if spec.sim.schedule == "buckets" else [len(tensors)]
    bounds = list(zip([0, *ends], ends))
    if codecs.codec_config(cfg) is None:
        return sum(cost(sum(tensors[a:b])).time(link) for a, b in bounds)
    # A codec's wire, its payloads; its encoding and decoding are the codec's, not the link's.
    shapes = gradient_shapes(cfg)
    plan = codecs.plan(cfg, [shapes[a:b] for a, b in bounds], None)
    assert plan is not None
    return sum(_wire(part, cost, int(cfg.world_size)).time(link) for part in plan.parts)


def _wire(part: Compressed, cost: Callable[[float], Cost], n: int) -> Cost:
    """A compressed bucket's communication: the synchronizer's own all-reduce of each round of a
    linear codec, a ring allgather of a non-linear one's payload."""
    if not part.linear:
        return allgather(n, part.payload)
    return sum((cost(nbytes) for nbytes in part.rounds), ZERO)


def _bucket_s(part: Compressed, cost: Callable[[float], Cost], link: Link, n: int) -> float:
    """Seconds of one compressed bucket: encode, its wire, and decode (n payloads when gathered)."""
    return part.encode_s + _wire(part, cost, n).time(link) + part.decode_s * (1 if part.linear else n)


def _nodes(cfg: Any) -> int:
    return int(cfg.network.get("nodes") or 0) if cfg.network.name == "emulated" else 0


def _intra_link(cfg: Any, costing: Any, coded: bool) -> Link:
    """The link inside a node of a two-level network, once the synchronizer is known to be costed
    there: sim.intra_bandwidth's, else network.intra_bandwidth's nominal rate."""
    name = cfg.sync.name
    if costing.schedule == "clocks":
        require(cfg.network.servers == "separate" and not coded,
                       f"sync={name} on two levels is costed with its shards on machines of their own and no codec: "
                       "network.servers=separate, compress=none")
    else:
        require(costing.two_level is not None and costing.schedule == "buckets" and not coded,
                       f"sync={name}{' with a codec' if coded else ''}: the simulator does not cost it on two levels "
                       "(network.nodes); predict it with network.nodes=0, or simulate ring, allreduce, ddp, "
                       "hierarchical, byteps or ps")
    rate = cfg.sim.intra_bandwidth or cfg.network.get("intra_bandwidth")
    require(rate is not None, "network.intra_bandwidth is unshaped: give the simulator the rate inside a node, "
                                     "sim.intra_bandwidth=<rate> (an emulated machine's bridge carries a few gbit; "
                                     "NVLink about 1000gbit)")
    try:
        bits = parse_rate(str(rate))
    except ValueError as exc:
        raise config.ConfigError(f"sim.intra_bandwidth={rate}: {exc}") from None
    return Link(float(cfg.sim.alpha_us) / 1e6, 8.0 / bits)


def _bucket_ends(cfg: Any, tensors: list[int]) -> list[int]:
    cap = cfg.sync.get("bucket_mb")
    return bucket_ends(tensors, None if cap is None else float(cap) * 2**20)


def exposed_comm(
    buckets: list[float], times: list[float], backward_s: float, overlap: bool, ready: list[float] | None = None,
) -> float:
    """Communication time not hidden behind backward, of buckets of ``buckets`` bytes that take
    ``times`` seconds each.

    Without overlap every bucket runs after backward. With it, bucket j is ready once backward has
    done ``ready[j]`` of its work (default: once it has produced bucket j's share of the bytes, an
    even rate), and one thread runs the buckets in order.
    """
    if not overlap:
        return sum(times)
    if ready is None:
        total = sum(buckets)
        ready = [produced / total for produced in itertools.accumulate(buckets)]
    finish = 0.0
    for share, t in zip(ready, times):
        finish = max(finish, backward_s * share) + t
    return max(0.0, finish - backward_s)


def _barrier(compute: np.ndarray, meet: np.ndarray, comm_s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(wait, comm) per step and rank when ranks meet at the steps where ``meet``: each waits for
    the slowest rank's clock, then all communicate for ``comm_s``; in between each keeps its pace."""
    steps, n = compute.shape
    clocks = np.zeros(n)
    wait, comm = np.zeros((steps, n)), np.zeros((steps, n))
    for t in range(steps):
        clocks += compute[t]
        if meet[t]:
            wait[t] = clocks.max() - clocks
            comm[t] = comm_s[t]
            clocks[:] = clocks.max() + comm_s[t]
    return wait, comm


def batches(cfg: Any, per_sample_s: float, optimizer_s: float, accumulate: int,
            pace: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(batch, injected delay) of each rank (columns) at each step (rows); ``pace``: the factor on
    each rank's compute at each step (a virtual cluster's draws; none: 1).

    Batches are the shards' (testbed.imbalance.shard_batches) or, under ``balance=static|dynamic``,
    decided from the ranks' simulated speeds, pace and delays included: a rank of the heterogeneous
    kind at speed s takes 1/s as long per sample, so it is given a share of the global batch in
    proportion to s. The delays are drawn step by step, as the trainer draws them, since a
    factor-based delay scales the rank's previous compute, whose batch a decision may have changed.
    """
    n, steps = int(cfg.world_size), int(cfg.steps)
    balance = cfg.get("balance")  # absent in the configs of runs from before balanced batches
    balanced = balance is not None and balance.name != "none"
    window = SpeedWindow(int(balance.every), balance.name == "static", 0) if balanced else None
    draws = Delays(cfg.imbalance, n, int(cfg.seed))
    pace = np.ones((steps, n)) if pace is None else pace
    sizes = np.array(shard_batches(cfg))
    batch, delay = np.empty((steps, n), dtype=int), np.empty((steps, n))
    for t in range(steps):
        batch[t] = sizes
        delay[t] = draws.draw(pace[t - 1] * (accumulate * batch[t - 1] * per_sample_s + optimizer_s) if t else None)
        micro = accumulate * sizes
        if window is not None and window.add(t, micro, pace[t] * micro * per_sample_s + delay[t]):
            sizes = np.array(apportion(int(sizes.sum()), window.take().tolist()))
    return batch, delay


@dataclass
class _Sync:
    """Synchronization's part of each step (rows) of each rank (columns), in seconds, and with backup
    workers whose gradient was left out."""

    wait: np.ndarray
    comm: np.ndarray
    encode: np.ndarray | None = None
    decode: np.ndarray | None = None
    dropped: np.ndarray | None = None  # backup workers: computed too late for the step's update
    sat_out: np.ndarray | None = None  # backup workers: not computed, the update made without the rank
    trace: PsTrace | None = None  # the parameter server's simulation


@dataclass
class Prediction:
    records: list[list[StepRecord]]  # per rank, per step
    facts: dict[str, Any]  # what the prediction assumed
    batches: np.ndarray  # each rank's (columns) samples per micro-step at each step (rows)
    trace: PsTrace | None = None  # a parameter server's worker clocks and the order of its events


def predict(cfg: Any, compute: Compute | None = None, pace: np.ndarray | None = None) -> Prediction:
    """``compute``: the per-sample times (default: the sim group's); ``pace``: a factor on each
    rank's (columns) compute at each step (rows), a virtual cluster's draws (testbed.launch.virtual)."""
    n, steps, sync = int(cfg.world_size), int(cfg.steps), cfg.sync
    accumulate = int(sync.get("accumulate", 1))
    compute = compute or Compute.from_sim(cfg.sim)
    threads = max(1, int(cfg.threads_per_rank))
    slowdown = max(1.0, n * threads / cfg.sim.cores) if cfg.sim.cores else 1.0
    per_sample = [slowdown * x for x in (compute.data_s, compute.forward_s, compute.backward_s)]
    optimizer_s = slowdown * compute.optimizer_s
    pace = np.ones((steps, n)) if pace is None else pace
    sizes, delays = batches(cfg, sum(per_sample), optimizer_s, accumulate, pace)
    work = pace * (accumulate * sizes * sum(per_sample) + optimizer_s) + delays  # [steps, n]

    tensors = gradient_tensors(cfg)
    gradient_bytes = sum(tensors)
    spec = spec_of(sync.name)
    coded = codecs.codec_config(cfg) is not None  # a codec changes the gradients even alone
    costing = spec.sim if spec.sim is not None and (n > 1 or spec.communicates_alone or coded) else None
    facts: dict[str, Any] = {"gradient_bytes": gradient_bytes, "compute": asdict(compute), "slowdown": slowdown}
    if costing is None:  # nobody to talk to: every rank keeps its own pace
        alone = _Sync(np.zeros_like(work), np.zeros_like(work))
        return Prediction(_records(sizes, per_sample, optimizer_s, accumulate, delays, alone, pace), facts, sizes)
    link, facts["link"] = link_for(cfg, costing.series(cfg))
    facts["impl"] = costing.series(cfg)
    cost = costing.cost(cfg)
    intra = _intra_link(cfg, costing, coded) if _nodes(cfg) else None
    two_level = costing.two_level(cfg) if intra is not None and costing.two_level is not None else None

    def cost_s(nbytes: float) -> float:
        return two_level(nbytes, intra, link) if two_level is not None else cost(nbytes).time(link)

    if intra is not None:
        facts.update(nodes=_nodes(cfg), intra_link=asdict(intra))
    if costing.schedule == "clocks":
        numel = round(gradient_bytes / 4)
        plan = _plan(cfg, [[torch.Size([hi - lo])] for lo, hi in chunk_bounds(numel, int(sync.servers))])
        timing = _parameter_server(cfg, work, gradient_bytes, link, plan, intra)
    elif costing.schedule == "average":  # the whole model, at the steps the ranks meet
        plan = None
        meet = np.array([costing.meets(cfg, t) for t in range(steps)])
        timing = _Sync(*_barrier(work, meet, np.where(meet, cost_s(gradient_bytes), 0.0)))
    else:  # buckets, every step
        ends = _bucket_ends(cfg, tensors)
        bounds = list(zip([0, *ends], ends))
        buckets = [sum(tensors[a:b]) for a, b in bounds]
        overlap = costing.overlap(cfg)
        shares = gradient_ready(cfg) if overlap else None
        ready = [max(shares[a:b]) for a, b in bounds] if shares else None
        facts.update(buckets=len(buckets), overlap=overlap, ready_from="flops" if ready else "bytes")
        shapes = gradient_shapes(cfg)
        plan = _plan(cfg, [shapes[a:b] for a, b in bounds]) if coded else None
        times = {False: [cost_s(b) for b in buckets]}
        coded_steps = np.zeros(steps, dtype=bool)
        if plan is not None:
            coded_steps = np.arange(steps) >= plan.uncompressed_steps
            times[True] = [_bucket_s(part, cost, link, n) for part in plan.parts]

        @functools.cache
        def exposed_at(batch: int, coded_step: bool) -> float:  # behind the backward of the largest batch
            return exposed_comm(buckets, times[coded_step], per_sample[2] * batch, overlap, ready)

        exposed = np.array([exposed_at(int(b), bool(c)) for b, c in zip(sizes.max(axis=1), coded_steps)])
        timing = _Sync(*_barrier(work, np.full(steps, True), exposed))
        if plan is not None:
            per_step = np.where(coded_steps, 1.0, 0.0)[:, None] * np.ones(n)
            timing.encode = per_step * sum(p.encode_s for p in plan.parts)
            timing.decode = per_step * sum(p.decode_s * (1 if p.linear else n) for p in plan.parts)
    if plan is not None:
        facts["compress"] = plan.facts
    records = _records(sizes, per_sample, optimizer_s, accumulate, delays, timing, pace)
    return Prediction(records, facts, sizes, timing.trace)


def _plan(cfg: Any, groups: list[list[torch.Size]]) -> CodecPlan | None:
    """The run's codec over ``groups``, timed by the calibration's codec fits."""
    codec = codecs.codec_config(cfg)
    if cfg.sim.gradient_mb is not None and codec is not None and codec.name == "powersgd":
        raise config.ConfigError(f"sim.gradient_mb={cfg.sim.gradient_mb}: PowerSGD factors the model's matrices, "
                                 "which a gradient size does not give; simulate a model the testbed builds (+paper_model=...)")
    fits = []
    key = codecs.fits_key(cfg.sim)
    if cfg.sim.get(key):
        try:
            fits = calibrate.load_codecs(in_checkout(cfg.sim[key]))
        except (OSError, ValueError) as exc:
            raise config.ConfigError(f"sim.{key}={cfg.sim[key]}: {exc}") from None
    return codecs.plan(cfg, groups, fits)


def _parameter_server(
    cfg: Any, work: np.ndarray, nbytes: float, link: Link, plan: CodecPlan | None, intra: Link | None = None,
) -> _Sync:
    """Wait at the pull gate, transfer, encode and decode per step and rank from the worker-clock
    simulation; with a codec, a worker encodes every shard before it pushes, each shard decodes
    every push, and compressed pulls are encoded by the shard (once per version in sync mode, for
    each worker otherwise) and decoded by the worker. On two levels (``intra``: the link inside a
    node; ``link``: the uplinks) a node's workers push and pull through one uplink at once, and each
    shard has a machine of its own. With ``sync.backup_workers`` (testbed.sim.events.simulate_ps), a
    step a worker sits out is neither computed nor pushed: it waits for the update and pulls."""
    k, mode = int(cfg.sync.servers), str(cfg.sync.mode)
    push, pull = nbytes, nbytes
    server_in = server_out = nbytes / k * link.beta  # what each push (or pull) puts on every server's link
    if intra is not None:
        link = Link(max(intra.alpha, link.alpha), max(intra.beta, ranks_per_node(cfg) * link.beta), link.gamma)
    own_extra = 0.0
    encode = decode = None
    if plan is not None:
        widest = max(plan.parts, key=lambda part: part.raw)
        push = sum(part.payload for part in plan.parts)
        server_in = widest.payload * link.beta + widest.decode_s
        encode = np.full_like(work, sum(part.encode_s for part in plan.parts))
        decode = np.zeros_like(work)
        if cfg.compress.get("pull"):
            pull = push
            decode += sum(part.decode_s for part in plan.parts)
            server_out = widest.payload * link.beta + (0.0 if mode == "sync" else widest.encode_s)
            own_extra = decode[0, 0] + (widest.encode_s if mode == "sync" else 0.0)
        work = work + encode
    backup = int(cfg.sync.get("backup_workers") or 0)
    server_link = str(cfg.sim.get("server_link", "fair"))
    if server_link not in SERVER_LINKS:
        raise config.ConfigError(f"sim.server_link={server_link}: allowed: {'|'.join(SERVER_LINKS)}")
    trace = simulate_ps(work, push_s=link.alpha + push * link.beta, pull_s=link.alpha + pull * link.beta + own_extra,
                        server_in_s=server_in, server_out_s=server_out, mode=mode,
                        staleness=int(cfg.sync.staleness), latency_s=link.alpha, backup=backup,
                        server_link=server_link)
    wait, computed = trace.wait_s, np.where(trace.sat_out, 0.0, work)
    comm = trace.step_s - computed - wait + (encode if encode is not None else 0.0)
    return _Sync(wait, comm, encode, decode, *((trace.dropped, trace.sat_out) if backup else (None, None)), trace=trace)


def _records(
    sizes: np.ndarray, per_sample: list[float], optimizer_s: float, accumulate: int, delays: np.ndarray, timing: _Sync,
    pace: np.ndarray,
) -> list[list[StepRecord]]:
    """The trainer's step records, with what only a run knows left None (testbed.step_record); a
    codec's encode and decode (busy, as a run's) are inside the sync time. With backup workers a
    dropped gradient's samples count 0, and a step sat out has no compute, as in a run. ``pace``
    scales each rank's compute at each step."""
    data_s, forward_s, backward_s = per_sample
    steps, n = delays.shape
    dropped = timing.dropped if timing.dropped is not None else np.zeros((steps, n), dtype=bool)
    sat_out = timing.sat_out if timing.sat_out is not None else np.zeros((steps, n), dtype=bool)
    out = []
    for rank in range(n):
        rows = []
        for t in range(steps):
            micro = 0 if sat_out[t, rank] else accumulate * int(sizes[t, rank])
            f = float(pace[t, rank])
            phases = {"t_data": f * micro * data_s, "t_forward": f * micro * forward_s,
                      "t_backward": f * micro * backward_s, "t_optimizer": 0.0 if sat_out[t, rank] else f * optimizer_s}
            injected = 0.0 if sat_out[t, rank] else float(delays[t, rank])
            sync_s = float(timing.wait[t, rank] + timing.comm[t, rank])
            rows.append(StepRecord(
                step=t, rank=rank, samples=0 if dropped[t, rank] else micro, loss=None, **phases,
                t_injected=injected, t_sync=sync_s, t_wait=float(timing.wait[t, rank]),
                t_comm=float(timing.comm[t, rank]), t_step=sum(phases.values()) + injected + sync_s,
                bytes_sent=None, bytes_recv=None, t_sync_enter=None, t_sync_exit=None,
                t_encode=None if timing.encode is None else float(timing.encode[t, rank]),
                t_decode=None if timing.decode is None else float(timing.decode[t, rank]),
                lr=None, dropped=None if timing.dropped is None else int(dropped[t, rank]),
            ))
        out.append(rows)
    return out


def simulate(cfg: Any) -> dict[str, Any]:
    """The summary a run of ``cfg`` is predicted to produce (config.ConfigError for a bad config)."""
    # Every rank is simulated and none spawned: no network to build, no GPU per rank to find.
    plain = config.to_plain(cfg)
    config.validate(OmegaConf.create({**plain, "network": {"name": "loopback"}}), local_world_size=1, simulated=True)
    prediction = predict(cfg)
    summary = summarize(plain, prediction.records, label=run_label(plain))
    summary.update(simulated=True, gradient_bytes=prediction.facts["gradient_bytes"], sync_facts=prediction.facts)
    return summary
