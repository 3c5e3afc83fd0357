"""``summary.json``: one object per job, from all ranks' step records (docs/results.md)."""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from testbed import batch
from testbed.results.step_log import metrics_path, read_step_records
from testbed.results.workload import workload_throughput
from testbed.stats.noise_scale import noise_summary
from testbed.step_record import StepRecord
from testbed.timing import PHASES, compute_time, fill_wait, percentile

ATTEMPTS = "attempts"  # a job directory's earlier attempts (testbed.sweeps): not jobs of their own
# Not part of what a run is: how a sweep was resumed, how a tuner searches, and where its launcher
# put the servers.
UNHASHED, UNHASHED_SYNC = ("sweep_resume", "resume", "tune"), ("addresses",)


def config_hash(cfg: dict[str, Any]) -> str:
    """The experiment a config describes: equal for a rerun of it, whatever its servers' ports."""
    # A run without a virtual cluster hashes as it did before the cluster group existed.
    what = {k: v for k, v in cfg.items() if k not in UNHASHED and not (k == "cluster" and v is None)}
    if isinstance(what.get("sync"), dict):
        what["sync"] = {k: v for k, v in what["sync"].items() if k not in UNHASHED_SYNC}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def versions() -> dict[str, str]:
    import grpc
    import hydra

    import testbed

    facts = {
        "testbed": testbed.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "hydra": hydra.__version__,
        "grpcio": grpc.__version__,
    }
    if torch.cuda.is_available():
        facts["cuda"] = str(torch.version.cuda)
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return facts


def _spread(values: list[float]) -> dict[str, float | None]:
    return {"median": percentile(values, 50), "p10": percentile(values, 10), "p90": percentile(values, 90)}


def _imbalance(rows: list[list[StepRecord]], ranks: int) -> dict[str, Any]:
    """Who was slow and what it cost: compute includes injected time (testbed.timing)."""
    compute = [[compute_time(r) for r in row] for row in rows]
    ratios = [max(c) / (sum(c) / len(c)) - 1.0 for c in compute if sum(c) > 0]
    waits = [r.t_wait or 0.0 for row in rows for r in row]
    total = sum(r.t_step for row in rows for r in row)
    slowest = Counter(max(range(len(c)), key=c.__getitem__) for c in compute)
    # Each rank by its name in the records: after an elastic change the survivors' ranks at the start.
    names = [r.rank for r in rows[0]] if rows else []
    per_rank = [
        {
            "rank": names[rank],
            "compute": percentile([c[rank] for c in compute], 50),
            "injected": percentile([row[rank].t_injected for row in rows], 50),
            "wait": percentile([row[rank].t_wait or 0.0 for row in rows], 50),
            "sync": percentile([row[rank].t_sync for row in rows], 50),
        }
        for rank in range(ranks if rows else 0)
    ]
    return {
        "imbalance": percentile(ratios, 50),  # median over steps of max/mean - 1 of compute time
        "imbalance_p10": percentile(ratios, 10),
        "imbalance_p90": percentile(ratios, 90),
        "idle_fraction": (sum(waits) / total) if total else None,  # share of rank-time spent waiting for peers
        "per_rank": per_rank,
        # The ranks that were the slowest most often, with the share of steps they were.
        "slowest_ranks": [{"rank": names[r], "share": c / len(compute)} for r, c in slowest.most_common(3)],
    }


def summarize(
    cfg: dict[str, Any],
    records_by_rank: list[list[StepRecord]],
    per_rank: list[dict[str, Any]] | None = None,
    sync_facts: dict[str, Any] | None = None,
    status: str = "ok",
    error: dict[str, Any] | None = None,
    label: str | None = None,
    comm_bound_s: float | None = None,
) -> dict[str, Any]:
    """Summary statistics over steady-state steps (warm-up excluded) of every rank; ``label`` names
    the synchronizer in tables and dashboards (its spec's label; default: its name);
    ``comm_bound_s``, one synchronizing step's communication at its alpha-beta bound on the link
    (testbed.sim.step.communication_bound_s), is set against the measured busy time."""
    warmup = int(cfg["warmup_steps"])
    world_size = int(cfg["world_size"])
    common = set.intersection(*(set(r.step for r in recs) for recs in records_by_rank)) if records_by_rank else set()
    steady = sorted(s for s in common if s >= warmup)
    by_step = [{r.step: r for r in recs} for recs in records_by_rank]
    rows = [[ranks[s] for ranks in by_step] for s in steady]  # rows[step][rank]

    # A step lasts as long as its slowest rank. Throughput sums each rank's own pace, its samples
    # per step over its mean step: samples per second of wall time, which stays right when ranks do
    # not wait for each other (asynchronous and bounded-staleness PS) and counts communication
    # that happens only every few steps (local SGD), which a median step would leave out.
    step_times = [max(r.t_step for r in row) for row in rows]
    global_batch = batch.global_batch(OmegaConf.create(cfg))
    step_time = percentile(step_times, 50)
    # Each rank's samples per step as a mean: with backup workers a late rank's step takes none.
    per_rank_steps = [(statistics.fmean(r.samples for r in row_r), [r.t_step for r in row_r]) for row_r in zip(*rows)]

    def paced(average: Any) -> float | None:
        return sum(samples / average(times) for samples, times in per_rank_steps) if per_rank_steps else None
    summary: dict[str, Any] = {
        "status": status,
        "error": error,
        "sync": cfg["sync"]["name"],
        "sync_label": label or cfg["sync"]["name"],
        "clock": "wall",  # a virtual cluster's runs are on a simulated one (testbed.launch.virtual)
        "world_size": world_size,
        "steps": len(common),
        "steps_configured": int(cfg["steps"]),
        "warmup_steps": warmup,
        "global_batch": global_batch,
        "throughput": paced(statistics.fmean),
        "throughput_median": paced(statistics.median),  # robust to stray slow steps, blind to periodic ones
        "step_time": step_time,
        "step_time_p10": percentile(step_times, 10),
        "step_time_p90": percentile(step_times, 90),
    }
    names = list(PHASES) + [
        extra for extra in ("wait", "comm", "encode", "decode") if rows and all(getattr(r, f"t_{extra}") is not None for row in rows for r in row)
    ]
    summary["phases"] = {f"t_{p}": _spread([getattr(r, f"t_{p}") for row in rows for r in row]) for p in names}
    summary.update(_imbalance(rows, len(records_by_rank)))
    summary["sync_bound"] = _bound(rows, comm_bound_s)
    # Bytes and loss are unknown (None) in a simulated run's records.
    sent = [sum(r.bytes_sent for r in row) for row in rows if all(r.bytes_sent is not None for r in row)]
    # Per rank of those that ran the steps: fewer than world_size after an elastic loss.
    summary["bytes_per_step"] = (statistics.median(sent) / len(records_by_rank)) if sent else None
    summary["bytes_per_step_total"] = statistics.median(sent) if sent else None
    staleness = Counter(r.staleness for recs in records_by_rank for r in recs if r.staleness is not None)
    if staleness:  # every update applied, warm-up included: index = staleness, value = count
        summary["staleness_histogram"] = [staleness.get(s, 0) for s in range(max(staleness) + 1)]
    if any(r.dropped is not None for recs in records_by_rank for r in recs):  # backup workers, warm-up included
        summary["backup"] = {
            "dropped": [sum(r.dropped or 0 for r in recs) for recs in records_by_rank],  # gradients left out
            # steps begun too late: no samples and no gradient dropped (a simulated record has no loss either way)
            "sat_out": [sum(r.samples == 0 and not r.dropped for r in recs) for recs in records_by_rank],
        }
    noise = noise_summary(records_by_rank, OmegaConf.create(cfg), summary["throughput"]) if records_by_rank else None
    if noise is not None:
        summary["noise_scale"] = noise
    # The first and last steps every rank completed.
    summary["loss_first"] = _mean_loss(by_step, min(common)) if common else None
    summary["final_loss"] = _mean_loss(by_step, max(common)) if common else None
    if per_rank:
        summary["peak_rss_bytes"] = [p["peak_rss_bytes"] for p in per_rank]
        summary["cuda_peak_bytes"] = [p.get("cuda_peak_bytes") for p in per_rank]
        summary["memory"] = _memory([p.get("memory") or {} for p in per_rank])
        hashes = [p["param_hash"] for p in per_rank]
        summary["param_hash"] = hashes
        summary["replicas_identical"] = len(set(hashes)) == 1  # parameters and buffers, bitwise
        summary["buffer_hash"] = [p.get("buffer_hash") for p in per_rank]
        summary["buffers_identical"] = len(set(summary["buffer_hash"])) == 1
        summary["buffers"] = per_rank[0].get("buffers")
        summary["data"] = per_rank[0].get("data")
        if per_rank[0].get("membership"):  # elastic.enabled: the membership timeline (testbed.elastic)
            summary["membership"] = per_rank[0]["membership"]
        summary.update(workload_throughput(summary["throughput"], per_rank[0].get("workload"), cfg, per_rank[0]["device"]))
        # Held-out evaluation (testbed.eval): the metrics are all-reduced, so rank 0's are everyone's.
        summary["eval"] = (per_rank[0].get("eval") or {}).get("eval")
        summary["time_to_target"] = (per_rank[0].get("eval") or {}).get("time_to_target")
        summary["gradient_bytes"] = per_rank[0]["gradient_bytes"]
        summary["device"] = per_rank[0]["device"]
        summary["backend"] = per_rank[0]["backend"]
    summary["sync_facts"] = sync_facts or {}
    # Ranks meet at a barrier after each checkpoint's step: nothing for synchronous synchronizers,
    # a point where async and SSP parameter servers' workers wait for each other.
    summary["checkpoint_barrier_every"] = int((cfg.get("checkpoint") or {}).get("every") or 0) or None
    summary["versions"] = versions()
    summary["config_hash"] = config_hash(cfg)
    summary["config"] = cfg
    return summary


def _memory(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """testbed.memory's facts, each a list by rank: the model state counted and by ZeRO's formula
    (bytes by kind), and the memory measured."""
    keys = dict.fromkeys(key for facts in per_rank for key in facts)
    return {key: [facts.get(key) for facts in per_rank] for key in keys}


def _mean_loss(by_step: list[dict[int, StepRecord]], step: int) -> float | None:
    """Over the ranks that computed a loss at ``step`` (a backup worker may sit a step out; a
    simulated run computes none)."""
    losses = [ranks[step].loss for ranks in by_step if ranks[step].loss is not None]
    return statistics.fmean(losses) if losses else None


def _bound(rows: list[list[StepRecord]], bound_s: float | None) -> dict[str, float] | None:
    """The bound over the median busy communication (``t_comm``) of the steps that communicated,
    less a codec's encoding and decoding (the bound is of its payloads on the wire); None without a
    bound or where the synchronizer cannot see its communication (DDP)."""
    busy = [r.t_comm - (r.t_encode or 0.0) - (r.t_decode or 0.0) for row in rows for r in row if r.t_comm]
    if bound_s is None or not busy:
        return None
    measured = statistics.median(busy)
    return {"bound_s": bound_s, "measured_s": measured, "fraction": bound_s / measured}


def failed_summary(
    job_dir: Path, cfg: dict[str, Any], error: dict[str, Any], waits_for_peers: bool, label: str | None = None
) -> dict[str, Any]:
    """Summary of a run that did not finish, from whatever step records its ranks wrote; ``error``
    gains ``step``, the step in progress when it failed (the steps every rank completed).
    ``waits_for_peers``: the synchronizer's (testbed.timing.fill_wait)."""
    records = [read_step_records(metrics_path(job_dir, r)) for r in range(int(cfg["world_size"]))]
    records = [recs for recs in records if recs]
    if records:
        fill_wait(records, waits_for_peers=waits_for_peers)
    summary = summarize(cfg, records, status="failed", error=error, label=label)
    error["step"] = summary["steps"]
    return summary


def write_summary(job_dir: Path, summary: dict[str, Any]) -> Path:
    path = job_dir / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    tmp.replace(path)
    return path


def load_summaries(roots: list[Path]) -> list[dict[str, Any]]:
    """The summary of every job directory under ``roots`` (a root may itself be a job directory)."""
    summaries = []
    for root in roots:
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such directory")
        for path in sorted(root.rglob("summary.json")):
            if ATTEMPTS in path.relative_to(root).parts[:-1]:
                continue
            summary = json.loads(path.read_text())
            summary["job_dir"] = str(path.parent)
            summaries.append(summary)
    return summaries
