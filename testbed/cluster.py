"""The ``cluster`` group and ``launcher=virtual``: their schemas, and what a virtual run refuses.

A cluster describes each worker's compute (testbed.launch.virtual.cluster draws it) and the links
(the simulator's alpha-beta model, testbed.costs, at ``bandwidth`` and ``alpha_us``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from testbed.checks import enum_value, require, resolved_device
from testbed.data import data_kind, spec_for
from testbed.models import build_model
from testbed.network import check_rate
from testbed.paths import in_checkout
from testbed.sim.events import SERVER_LINKS

DISTRIBUTIONS = ("constant", "lognormal", "exponential", "pareto")
# The synchronizers a virtual run computes, by the family whose math it replays (testbed.launch.virtual.families).
FAMILIES = {"allreduce": "lockstep", "ring": "lockstep", "tree": "lockstep", "halving_doubling": "lockstep",
            "ddp": "lockstep", "ps": "parameter_server", "local_sgd": "local_sgd"}


@dataclass
class ClusterComputeConfig:
    ms_per_sample: float | None = None  # forward + backward per sample
    from_job: str | None = None  # a world_size 1 job directory: its steady steps' per-sample times
    flops_per_s: float | None = None  # a device's sustained FLOP/s: per sample, 3x the model's forward FLOPs
    step_ms: float = 0.0  # per step besides the samples: the optimizer, kernel launches
    backward_share: float = 0.67  # of forward + backward, where only their sum is given
    # Each step's compute times a draw of mean 1: constant | lognormal (sigma) | exponential |
    # pareto (shape > 1: a heavy tail, Chen et al. 2016's stragglers).
    distribution: str = "constant"
    sigma: float = 0.5
    shape: float = 3.0
    stragglers: list[int] = field(default_factory=list)  # workers slower by `slowdown` at every step
    slowdown: float = 1.0


@dataclass
class ClusterMembershipConfig:
    # What a membership change costs on the clock (elastic.enabled; testbed.launch.virtual.membership),
    # besides the state it sends over the links. The defaults are this machine's, measured on
    # loopback (docs/elastic.md): a loss's new group some 40 ms after it, a join's rendezvous about
    # 150 ms, a newcomer ready about 3 s after the loss (its process, its imports, its data).
    regroup_ms: float = 40.0  # from a worker's loss to the survivors' new group
    join_ms: float = 150.0  # a join's rendezvous, the members waiting at a step boundary
    start_s: float = 3.0  # from a loss to its newcomer ready to join


@dataclass
class ClusterConfig:
    name: str = "here"
    compute: ClusterComputeConfig = field(default_factory=ClusterComputeConfig)
    membership: ClusterMembershipConfig = field(default_factory=ClusterMembershipConfig)
    bandwidth: str = "10gbit"  # each worker's and each server's link
    alpha_us: float = 50.0  # per message
    # Links measured in place of bandwidth and alpha_us: this calibration's fit of each synchronizer's
    # implementation (python -m testbed.sim.calibrate) on `link`, gRPC's per-message cost included.
    calibration: str | None = None
    link: str = "loopback"
    eval_ms_per_sample: float | None = None  # held-out evaluation, charged to the clock; null: the forward time
    # How a parameter server's NIC serves concurrent transfers: fair (shared equally) or fifo (one at
    # a time, in arrival order; testbed.sim.events).
    server_link: str = "fair"
    # A codec's encode and decode times: this calibration's codec fits (python -m testbed.bench.codecs,
    # measured on this machine's cores) times `codec_time_scale`; 0 costs the wire alone.
    codec_calibration: str = "docs/sim/calibration.json"
    codec_time_scale: float = 1.0


@dataclass
class VirtualLauncherConfig:
    name: str = "virtual"
    # Workers whose gradients are due together are computed in one vectorized call (torch.func.vmap)
    # of at most this many; 1: one at a time, as separate processes would.
    vmap_workers: int = 64
    # A real run's job directory (sync=ps, async or ssp, one shard, this config): its order of pushes
    # and pulls, read from its step logs, in place of the clock's (testbed.launch.virtual.replay).
    replay: str | None = None
    # The all-reduce family only: every step's gradients computed at the parameters of this many
    # steps before, a fixed delay (Dai et al. 2019's simulated staleness); no real synchronizer does it.
    fixed_delay: int = 0


def check_virtual(cfg: Any) -> None:
    """What a virtual run cannot compute, refused before anything runs."""
    require(cfg.get("cluster") is not None, "launcher=virtual needs a cluster: cluster=here (this machine's compute, "
                                            "10 Gbit links), cluster=cpu (1 Gbit) or cluster=gpu (H200s, 100 Gbit)")
    name = cfg.sync.name
    require(name in FAMILIES, f"launcher=virtual runs sync={'|'.join(FAMILIES)}, not sync={name}; run it with "
                              "launcher=local, or predict its step times with python -m testbed.sim")
    require(not (name == "ps" and cfg.compress.get("pull")),
            "launcher=virtual with compress.pull: the virtual shards serve whole parameters; drop compress.pull")
    if cfg.elastic.enabled:
        _check_virtual_elastic(cfg)
    fault = cfg.fault.name
    require(fault == "none" or (fault == "kill_rank" and cfg.elastic.enabled),
            f"launcher=virtual with fault={fault}: a virtual run simulates a worker's loss that the others go on "
            "from (fault=kill_rank with elastic.enabled=true), not a failure; drop fault= or run with launcher=local")
    unsupported = {
        "network": cfg.network.name != "loopback",
        "checkpoint.every": bool(cfg.checkpoint.every), "resume": bool(cfg.resume),
        "stats.noise_scale": bool(cfg.stats.get("noise_scale")), "precision": enum_value(cfg.precision) != "fp32",
        "device": resolved_device(cfg) != "cpu",
    }
    for key, set_ in unsupported.items():
        require(not set_, f"launcher=virtual with {key}={OmegaConf.select(cfg, key)}: a virtual "
                          f"run does not simulate it (the cluster's links are cluster.bandwidth and cluster.alpha_us); "
                          f"drop {key} or run with launcher=local")
    if name == "ps":
        require(not cfg.sync.addresses, "launcher=virtual with sync.addresses: the virtual cluster's servers are "
                                        "simulated in its own process; drop sync.addresses")
    kind = data_kind(cfg.data.name)
    require(kind.in_memory, f"launcher=virtual with data={cfg.data.name}: its workers slice one in-memory data set; "
                            "use data=mnist1d|digits|synthetic|lm")
    train = kind.train_size(cfg.data)
    require(train is None or int(cfg.world_size) <= train,
            f"world_size={cfg.world_size}: more workers than the {train} training samples can give one each; "
            "lower world_size or raise the data's num_samples")
    with torch.device("meta"):  # shapes only
        model = build_model(cfg.model, spec_for(cfg.data))
    random = [type(m).__name__ for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    require(not random and not list(model.buffers()),
            f"launcher=virtual with model={cfg.model.name}: its {'dropout' if random else 'buffers (BatchNorm)'} would "
            "need each worker's own random stream or statistics, which a virtual worker does not keep yet; use a model "
            "without them (model=mlp|cnn1d, or the transformers with dropout 0) or launcher=local")
    replay = cfg.launcher.get("replay")
    if replay is not None:
        sync = cfg.sync
        require(name == "ps" and sync.mode in ("async", "ssp") and int(sync.servers) == 1 and not sync.backup_workers,
                f"launcher.replay={replay}: a real run's order is replayed for sync=ps sync.mode=async|ssp with one "
                "shard (sync.servers=1) and no backup workers")
        logs = [Path(replay) / "metrics" / f"rank{w}.jsonl" for w in range(int(cfg.world_size))]
        missing = [str(log) for log in logs if not log.is_file()]
        require(not missing, f"launcher.replay={replay}: no step log {missing[0] if missing else ''}; name the job "
                             f"directory of a real run of world_size={cfg.world_size}")
    delay = int(cfg.launcher.get("fixed_delay") or 0)
    require(delay >= 0, f"launcher.fixed_delay={delay}: steps, must be >= 0")
    require(not delay or FAMILIES[name] == "lockstep",
            f"launcher.fixed_delay={delay} delays the all-reduce family's gradients; with sync={name} staleness comes "
            "from the clock (sync=ps sync.mode=ssp|async)")
    workers = int(cfg.launcher.vmap_workers)
    require(workers >= 1, f"launcher.vmap_workers={workers}: must be >= 1 (1: one worker at a time)")
    check_cluster(cfg)


def _check_virtual_elastic(cfg: Any) -> None:
    mode = cfg.sync.get("mode", "sync")
    require(mode == "sync",
            f"launcher=virtual with elastic.enabled and sync.mode={mode}: the parameter-server simulation "
            "changes its membership at a step boundary of a synchronous run, and asynchronous workers are never at "
            "one; use sync.mode=sync, or launcher=local")
    require(cfg.elastic.batch == "keep_global",
            f"launcher=virtual with elastic.batch={cfg.elastic.batch}: a virtual membership splits the same global "
            "batch among its workers; use elastic.batch=keep_global, or launcher=local")


def check_cluster(cfg: Any) -> None:
    cluster, compute = cfg.cluster, cfg.cluster.compute
    given = [k for k in ("ms_per_sample", "from_job", "flops_per_s") if compute.get(k) is not None]
    require(len(given) <= 1, f"cluster.compute: {' and '.join(given)} both give the per-sample time; keep one")
    for key in ("ms_per_sample", "flops_per_s"):
        value = compute.get(key)
        require(value is None or value > 0, f"cluster.compute.{key}={value}: must be > 0 (or null)")
    require(compute.step_ms >= 0, f"cluster.compute.step_ms={compute.step_ms}: a time, must be >= 0")
    require(0 < compute.backward_share < 1, f"cluster.compute.backward_share={compute.backward_share}: must be in (0, 1)")
    require(compute.distribution in DISTRIBUTIONS,
            f"cluster.compute.distribution={compute.distribution}: unknown; allowed: {'|'.join(DISTRIBUTIONS)}")
    require(compute.sigma >= 0, f"cluster.compute.sigma={compute.sigma}: must be >= 0")
    calibration = cluster.get("calibration")
    require(calibration is None or in_checkout(calibration).is_file(),
            f"cluster.calibration={calibration}: no such file; name a calibration (docs/sim/calibration.json) or null "
            "for the nominal links")
    require(compute.shape > 1, f"cluster.compute.shape={compute.shape}: a Pareto tail's shape must be > 1 (its mean "
                               "is infinite at 1 or below)")
    require(compute.slowdown > 0, f"cluster.compute.slowdown={compute.slowdown}: a factor on compute, must be > 0")
    n = int(cfg.world_size)
    bad = [w for w in compute.stragglers if not 0 <= w < n]
    require(not bad, f"cluster.compute.stragglers={list(compute.stragglers)}: workers {bad} are not in [0, {n})")
    require(cluster.alpha_us >= 0, f"cluster.alpha_us={cluster.alpha_us}: a latency, must be >= 0")
    eval_ms = cluster.get("eval_ms_per_sample")
    require(eval_ms is None or eval_ms >= 0, f"cluster.eval_ms_per_sample={eval_ms}: a time, must be >= 0 (or null)")
    require(cluster.codec_time_scale >= 0, f"cluster.codec_time_scale={cluster.codec_time_scale}: a factor on the "
                                           "codec times, must be >= 0 (0: the wire alone)")
    check_rate("cluster.bandwidth", str(cluster.bandwidth))
    require(cluster.server_link in SERVER_LINKS,
            f"cluster.server_link={cluster.server_link}: allowed: {'|'.join(SERVER_LINKS)}")
    for key in ("regroup_ms", "join_ms", "start_s"):
        value = cluster.membership[key]
        require(value >= 0, f"cluster.membership.{key}={value}: a time, must be >= 0")


def family_of(cfg: Any) -> str:
    return FAMILIES[cfg.sync.name]
