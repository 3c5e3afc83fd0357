"""One virtual run: the clock from the simulator, the math from the real model, the results contract.

1. The workers' batches, the model and its per-sample compute (testbed.launch.virtual.cluster).
2. The clock: testbed.sim.step.predict for the described cluster (its links as the simulator's
   nominal link, each worker's compute paced by its own draws): every worker's step records and,
   for a parameter server, the order in which its pushes and pulls reached the servers; one clock
   per membership where a worker is lost and a newcomer joins (testbed.launch.virtual.membership).
3. The math: the synchronizer's family (testbed.launch.virtual.families) in that order; held-out
   evaluation when a step is complete, charged to the clock as MLPerf counts it (the evaluated
   share of the held-out split at the forward time per sample).
4. The job directory as a real run writes it: metrics/rank{r}.jsonl per worker, eval.jsonl,
   summary.json (``clock: simulated``, the cluster and its compute) and model_final.pt.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from testbed import batch
from testbed.cluster import family_of
from testbed.data import RankBatches, build_data, build_heldout, data_kind, heldout_of
from testbed.eval.config import evaluates
from testbed.eval.evaluate import Evaluator
from testbed.eval.schedule import schedule_of
from testbed.imbalance import shard_batches
from testbed.launch.rank import buffer_hash, param_hash
from testbed.launch.virtual.cluster import compute_of, pace
from testbed.launch.virtual.families import FAMILY_CLASSES, Outcome, Work
from testbed.launch.virtual.gradients import Gradients
from testbed.launch.virtual.membership import timeline
from testbed.launch.virtual.replay import replayed_order
from testbed.memory import rss_now_peak
from testbed.models import build_model, gradient_bytes, model_heldout, objective_batches, workload_facts
from testbed.models.call import model_call
from testbed.results.step_log import StepLog, metrics_path
from testbed.results.summary import summarize, write_summary
from testbed.sim.step import Compute, predict
from testbed.step_record import StepRecord
from testbed.sync import run_label
from testbed.world import World


def run_virtual(cfg: DictConfig, plain: dict[str, Any], job_dir: Path) -> dict[str, Any]:
    """Run the job on its virtual cluster; its summary (written to ``job_dir``)."""
    n, steps, seed = int(cfg.world_size), int(cfg.steps), int(cfg.seed)
    # One process: torch's own default (the cores, or OMP_NUM_THREADS where set: two threads per
    # process under contention cost 3x here).
    torch.set_num_threads(int(cfg.threads_per_rank) or torch.get_num_threads())
    torch.manual_seed(seed)  # the model's initialization, as every rank of a real run draws it
    sizes = shard_batches(cfg)
    spec, first = build_data(cfg.data, sizes, 0, seed)
    assert isinstance(first, RankBatches)  # in-memory data (checked before: cluster.check_virtual)
    sources = [first if w == 0 else RankBatches(first.inputs, first.targets, sizes, w, seed) for w in range(n)]
    batches = [objective_batches(cfg.model, source, spec, seed, w) for w, source in enumerate(sources)]
    model = build_model(cfg.model, spec)
    evaluated = copy.deepcopy(model)  # the model evaluation and model_final.pt load parameters into
    call = model_call(cfg.model)
    compute, source = compute_of(cfg.cluster, copy.deepcopy(model), call, batches[0].batch(0))

    paced = pace(cfg.cluster.compute, n, steps, seed)
    clock = timeline(clock_config(cfg), compute, paced, state_bytes(cfg.optim, model),
                     lambda sized, draws: predict(sized, compute, draws))

    train_size = data_kind(cfg.data.name).train_size(cfg.data)
    work = Work(batches, sources, clock.sizes, int(cfg.sync.accumulate),
                Gradients(model, call, int(cfg.launcher.vmap_workers)), schedule_of(cfg, train_size))
    outcome = Outcome.empty(steps, n)
    replay = cfg.launcher.get("replay")
    order = replayed_order(Path(replay), n, steps) if replay else clock.order
    family = FAMILY_CLASSES[family_of(cfg)](cfg, plain, work, model, outcome, order)

    # Each step ends, on the clock, when its slowest worker's does; evaluation waits for it.
    ends = clock.ends
    evaluator = _evaluator(cfg, spec, job_dir, first.describe().get("samples"))
    eval_s = _eval_seconds(cfg, compute, evaluator, n)
    last = steps - 1

    def done(step: int, params: Callable[[], torch.Tensor]) -> bool:
        nonlocal last
        last = step
        if evaluator is None or not evaluator.due(step):
            return False
        with _holding(evaluated, params()) as module:
            evaluator.evaluate(module, step, float(ends[step]) + evaluator.t_eval, eval_s)
        return evaluator.stop_now()

    final = family.run(done)
    load_flat(evaluated, final)
    if evaluator is not None:
        if evaluator.at_end and (not evaluator.rows or evaluator.rows[-1]["step"] != last):
            with _holding(evaluated, final) as module:
                evaluator.evaluate(module, last, float(ends[last]) + evaluator.t_eval, eval_s)
        evaluator.close()
    records = _records(clock.records, outcome, work, last)
    for worker, rows in enumerate(records):
        log = StepLog(metrics_path(job_dir, worker))
        for record in rows:
            log.write(record)
        log.close()
    torch.save({k: v.detach().clone() for k, v in evaluated.state_dict().items()}, job_dir / "model_final.pt")

    rss = rss_now_peak()
    facts = {
        "workload": workload_facts(cfg.model, spec, evaluated), "buffers": None, "data": first.describe(),
        "memory": {}, "peak_rss_bytes": rss, "cuda_peak_bytes": None,
        "param_hash": param_hash(evaluated), "buffer_hash": buffer_hash(evaluated),
        "gradient_bytes": gradient_bytes(evaluated), "device": "cpu", "backend": "virtual",
        "eval": evaluator.summary() if evaluator is not None else None, "membership": clock.membership,
    }
    summary = summarize(plain, records, [facts], {**clock.facts, **family.facts()}, label=run_label(plain))
    summary.update(clock="simulated", replicas_identical=None, cluster={
        **plain["cluster"], "compute_per_sample": dataclasses.asdict(compute), "compute_from": source,
        "eval_s": eval_s, "workers": n, "order": f"replayed from {replay}" if replay else "clock"})
    write_summary(job_dir, summary)
    return summary


def clock_config(cfg: DictConfig) -> DictConfig:
    """The run's config as the simulator reads it for the cluster: its nominal link, or its
    calibration's; no cores shared, every rank computing on its own."""
    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cluster = cfg.cluster
    calibration = cluster.get("calibration")
    out.sim = {**OmegaConf.to_container(out.sim), "calibration": calibration,
               "link": str(cluster.link) if calibration else None, "bandwidth": str(cluster.bandwidth),
               "alpha_us": float(cluster.alpha_us), "cores": None, "gradient_mb": None,
               "codec_calibration": str(cluster.codec_calibration), "codec_time_scale": float(cluster.codec_time_scale),
               "server_link": str(cluster.server_link)}
    return out


def state_bytes(optim: DictConfig, model: nn.Module) -> int:
    """What a restored commit or a newcomer receives: the parameters and the optimizer's state of them
    (SGD's momentum buffer, AdamW's two moments)."""
    slots = {"sgd": 1 if float(optim.get("momentum", 0.0)) else 0, "adamw": 2}[optim.name]
    return gradient_bytes(model) * (1 + slots)


def _evaluator(cfg: DictConfig, spec: Any, job_dir: Path, train_samples: int | None) -> Evaluator | None:
    if not evaluates(cfg, heldout_of(cfg.data)):
        return None
    heldout = model_heldout(cfg.model, build_heldout(cfg.data, int(cfg.seed)), spec, int(cfg.seed))
    (job_dir / "metrics").mkdir(parents=True, exist_ok=True)
    # One process evaluates the whole split; the clock is charged for the workers' shares of it.
    world = World(0, 0, 1, 1, torch.device("cpu"), "virtual", float(cfg.timeouts.collective_s))
    global_batch = batch.global_batch(cfg)
    return Evaluator(cfg, heldout, spec, world, job_dir, global_batch, train_samples, None)


def _eval_seconds(cfg: DictConfig, compute: Compute, evaluator: Evaluator | None, n: int) -> float:
    """An evaluation's time on the clock: each worker's slice of the held-out samples (testbed.eval
    splits it over the ranks) at the cluster's forward time per sample."""
    if evaluator is None:
        return 0.0
    per_sample = cfg.cluster.get("eval_ms_per_sample")
    per_sample_s = compute.forward_s if per_sample is None else float(per_sample) / 1e3
    return per_sample_s * math.ceil(evaluator.total / n)


def _records(predicted: list[list[StepRecord]], outcome: Outcome, work: Work, last: int) -> list[list[StepRecord]]:
    """The clock's step records up to step ``last``, with the loss, staleness and learning rate the
    math gave each worker."""
    out = []
    for worker, rows in enumerate(predicted):
        out.append([dataclasses.replace(
            record,
            loss=None if math.isnan(outcome.loss[record.step, worker]) else float(outcome.loss[record.step, worker]),
            staleness=None if outcome.staleness[record.step, worker] < 0 else int(outcome.staleness[record.step, worker]),
            lr=work.schedule.lr_at(record.step),
        ) for record in rows if record.step <= last])
    return out


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy flat parameters (testbed.sync.base.flat_views' order) into ``model``'s."""
    offset = 0
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


class _Evaluated:
    """What the evaluator asks of a synchronizer: the run's model, and which one it is."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    @contextmanager
    def evaluated(self) -> Iterator[tuple[nn.Module, dict[str, Any]]]:
        yield self.model, {"model": "virtual"}


@contextmanager
def _holding(model: nn.Module, flat: torch.Tensor) -> Iterator[_Evaluated]:
    load_flat(model, flat)
    yield _Evaluated(model)
