"""The ``elastic`` config group and its checks (before anything is spawned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testbed.checks import require
from testbed.data.kinds import data_kind
from testbed.imbalance import shard_batches
from testbed.sync import SYNCHRONIZERS


@dataclass
class ElasticConfig:
    # A worker lost (killed, crashed) leaves the run, which goes on with the others in a new process
    # group, without a restart and without reading from disk (testbed.elastic).
    enabled: bool = False
    min_workers: int = 1  # fewer left than this: the run fails, saying so
    # Steps between in-memory commits of parameters and optimizer state: the point the survivors
    # roll back to when a step was interrupted (1: every step, at the cost of one copy a step).
    commit_every: int = 1
    # A lost worker's place is taken by a newcomer, which the launcher starts at once and which joins
    # the run at this step, with the parameters and optimizer state of a peer (null: no newcomer).
    rejoin_step: int | None = None
    # false: the members go on without the newcomer until it is ready (it starts a process and builds
    # its data), and admit it at the next step boundary; true: they wait for it at rejoin_step, a
    # join at exactly that step, which a comparison of runs can repeat.
    rejoin_wait: bool = False
    # What a membership of n workers trains on (testbed.elastic.regroup): keep_global, the same global
    # batch split evenly; keep_local, the same batch per worker, with the learning rate that
    # optim.lr_scaling gives the global batch it makes.
    batch: str = "keep_global"


BATCH_POLICIES = ("keep_global", "keep_local")


def check_elastic(cfg: Any) -> None:
    elastic = cfg.elastic
    if not elastic.enabled:
        return
    n, sync = int(cfg.world_size), cfg.sync.name
    require(n >= 2, f"elastic.enabled with world_size={n}: a world of one has no worker to lose; use world_size >= 2")
    require(1 <= elastic.min_workers <= n,
            f"elastic.min_workers={elastic.min_workers}: must be in [1, world_size={n}]")
    require(elastic.commit_every >= 1, f"elastic.commit_every={elastic.commit_every}: steps between commits, must be >= 1")
    why = SYNCHRONIZERS[sync].inelastic
    require(why is None, f"elastic.enabled with sync={sync}: {why}; use sync="
            + "|".join(name for name, spec in SYNCHRONIZERS.items() if spec.inelastic is None))
    require(not (cfg.network.name == "emulated" and cfg.network.nodes), "elastic.enabled with network.nodes: the "
            "launcher's store has a link of its own on a flat emulated network, and no machine of two levels; use "
            "network.nodes=0")
    require(cfg.launcher.get("max_restarts", 0) == 0 and not (cfg.checkpoint.every or cfg.resume),
            "elastic.enabled with launcher.max_restarts or checkpoint.every/resume: the two are the alternatives "
            "an elastic comparison sets side by side (commits in memory against a restart from disk); run them apart")
    require(cfg.compress.name == "none", f"elastic.enabled with compress={cfg.compress.name}: a codec's per-rank "
            "state (error-feedback residuals) is not committed with the model; use compress=none")
    require(cfg.balance.name == "none" and cfg.imbalance.name != "uneven",
            "elastic.enabled with balance=... or imbalance=uneven: a new membership splits the global batch evenly "
            "among its workers; use balance=none and an even imbalance")
    require(not cfg.stats.noise_scale, "elastic.enabled with stats.noise_scale: the estimate's batches change with "
            "the membership; drop stats.noise_scale")
    require(data_kind(cfg.data.name).resizable, f"elastic.enabled with data={cfg.data.name}: a new membership re-splits "
            "the global batch, and these batches have a fixed size (a DataLoader's); use an in-memory data set "
            "(synthetic|digits|mnist1d|lm)")
    fault = cfg.fault
    require(fault.name in ("none", "kill_rank"), f"elastic.enabled with fault={fault.name}: a leaving worker is "
            "fault=kill_rank (or a real crash)")
    require(fault.name != "kill_rank" or fault.rank != 0, "elastic.enabled with fault.rank=0: worker 0 writes the "
            "run's results and its loss fails the run; lose another (fault.rank >= 1)")
    if elastic.rejoin_step is not None:
        _check_rejoin(cfg)
    require(elastic.batch in BATCH_POLICIES, f"elastic.batch={elastic.batch}: allowed: {'|'.join(BATCH_POLICIES)}")
    if elastic.batch == "keep_local":
        require(SYNCHRONIZERS[sync].servers is None or cfg.optim.lr_scaling == "none",
                f"elastic.batch=keep_local with sync={sync} and optim.lr_scaling={cfg.optim.lr_scaling}: the servers "
                "step with the schedule resolved at the start, for the configured global batch; use "
                "optim.lr_scaling=none or elastic.batch=keep_global")
        return
    # keep_global: every membership the run may reach splits the global batch evenly.
    total = sum(shard_batches(cfg))
    for m in range(int(elastic.min_workers), n + 1):
        require(total % m == 0, f"elastic.min_workers={elastic.min_workers}: a global batch of {total} samples "
                f"(data.batch_size, world_size={n}) does not divide among {m} workers; choose a global batch that "
                f"every size from min_workers to world_size divides, raise elastic.min_workers, or keep each "
                f"worker's batch instead (elastic.batch=keep_local)")


def _check_rejoin(cfg: Any) -> None:
    step, fault = cfg.elastic.rejoin_step, cfg.fault
    require(0 < step < int(cfg.steps), f"elastic.rejoin_step={step}: must be in [1, steps={cfg.steps})")
    require(fault.name != "kill_rank" or (fault.step is not None and fault.step < step),
            f"elastic.rejoin_step={step} with fault.step={fault.step}: the newcomer takes the place of a worker "
            "lost before it joins; set fault.step below elastic.rejoin_step")
