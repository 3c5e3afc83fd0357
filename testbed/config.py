"""Structured-config schemas and the semantic checks that run before any process is spawned.

Hydra composes YAML from ``experiments/`` on top of these dataclasses, so a wrong type or an unknown
key fails at composition with the field's full name. ``validate`` adds the checks a schema cannot
express (ranges, divisibility, model/data fit, GPUs per local rank) and raises ``ConfigError`` with
one line that names the field, the allowed values and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from testbed.balance import BALANCES
from testbed.checkpoint import CheckpointConfig, check_checkpoints
from testbed.checks import Backend, ConfigError, Device, Precision, check_devices, enum_value, require, resolved_device
from testbed.cluster import ClusterConfig, VirtualLauncherConfig, check_virtual
from testbed.compress import CODECS
from testbed.data import spec_for
from testbed.data.kinds import DATA_KINDS, check_data, data_kind, heldout_of
from testbed.data.schema import DataConfig
from testbed.elastic.config import ElasticConfig, check_elastic
from testbed.eval.config import EvalConfig, TargetConfig, check_eval
from testbed.eval.metrics import metrics_of
from testbed.eval.schedule import check_schedule
from testbed.faults import FAULTS
from testbed.help import app_help
from testbed.imbalance import IMBALANCES
from testbed.models import MODELS, build_model, check_fits, check_model, model_kind
from testbed.models.call import model_call
from testbed.network import NETWORKS
from testbed.optim import SCHEMAS as OPTIM_SCHEMAS
from testbed.optim import check_optimizer
from testbed.paths import short_dirname
from testbed.results.wandb_run import WandbConfig, check_wandb
from testbed.sim.config import SimConfig
from testbed.stats.config import StatsConfig, check_stats
from testbed.sync import SYNCHRONIZERS
from testbed.tune.config import TuneConfig

BUFFER_POLICIES = ("broadcast", "average", "local")


# --- the launcher group and the job's time limits -------------------------------------------


@dataclass
class LocalLauncherConfig:
    name: str = "local"
    # Rank stdout/stderr go to <job dir>/logs; rank 0 is also echoed to the console.
    echo_rank0: bool = True
    monitor_interval_s: float = 0.1
    # After a failure, start the world again (ranks, parameter servers, emulated network) this many
    # times, from the job's latest checkpoint (from the start without one): testbed.launch.job.
    max_restarts: int = 0


@dataclass
class TimeoutsConfig:
    collective_s: float = 300.0  # every collective and point-to-point wait (process-group timeout)
    rendezvous_s: float = 120.0  # ranks joining the world
    stall_warn_s: float = 60.0  # rank 0 warns, naming them, while ranks are this late to a step


@dataclass
class Config:
    sync: Any = MISSING
    compress: Any = MISSING
    model: Any = MISSING
    data: DataConfig = MISSING
    optim: Any = MISSING
    launcher: Any = MISSING
    imbalance: Any = MISSING
    balance: Any = MISSING
    network: Any = MISSING
    fault: Any = MISSING
    world_size: int = 1
    steps: int = 50
    warmup_steps: int = 5  # excluded from every summary statistic
    seed: int = 0
    device: Device = Device.auto
    backend: Backend = Backend.auto
    precision: Precision = Precision.fp32
    threads_per_rank: int = 0  # 0: the machine's cores divided among the local ranks
    # Buffers (BatchNorm's running statistics) whenever a step leaves the replicas' parameters
    # equal (testbed.buffers): broadcast rank 0's (DDP's default), average them, or keep them local.
    buffers: str = "broadcast"
    sync_bn: bool = False  # CUDA: BatchNorm over the global batch (torch's SyncBatchNorm)
    # Peak FLOP/s of one device for MFU (language models); null: known CUDA devices, none on CPU.
    peak_tflops: float | None = None
    log_every: int = 0  # progress line on rank 0 every n steps; 0: about ten lines per run
    # Points of a sweep not to run, each a list of overrides (e.g. [sync=ps, compress=powersgd]): a
    # job given all of one entry's overrides is skipped, neither checked nor spawned (testbed.sweeps).
    sweep_exclude: list[list[str]] = field(default_factory=list)
    # A sweep run again into its own hydra.sweep.dir: jobs whose summary.json is ok with this very
    # config (its config_hash) are not run again; failed and missing ones are (testbed.sweeps).
    sweep_resume: bool = False
    # torch.distributed's own diagnostics: TORCH_DISTRIBUTED_DEBUG=DETAIL (collective checks and
    # desync reports), C++ logs at INFO, NCCL_DEBUG=INFO and NCCL's desync debug.
    debug: bool = False
    timeouts: TimeoutsConfig = field(default_factory=TimeoutsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resume: str | None = None  # a job directory whose latest checkpoint this run continues
    wandb: WandbConfig = field(default_factory=WandbConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    # launcher=virtual's machines (testbed.launch.virtual): cluster=here|cpu|gpu; null for every other run.
    cluster: Any = None


# Groups whose options declare their schema and checks in their own modules (testbed.checks.Option).
OPTION_GROUPS = {"imbalance": IMBALANCES, "balance": BALANCES, "network": NETWORKS, "fault": FAULTS}


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "sync": {name: spec.schema for name, spec in SYNCHRONIZERS.items()},
    "compress": {name: spec.schema for name, spec in CODECS.items()},
    "model": {name: kind.schema for name, kind in MODELS.items()},
    "data": {name: kind.schema for name, kind in DATA_KINDS.items()},
    "optim": OPTIM_SCHEMAS,
    "launcher": {"local": LocalLauncherConfig, "virtual": VirtualLauncherConfig},
    **{group: {name: option.schema for name, option in opts.items()} for group, opts in OPTION_GROUPS.items()},
}


def register_schemas() -> None:
    """Store the schemas: the root as ``base_config``, each option as ``/schema/<group>/<name>``.

    They live outside the option groups so that Hydra's "available options" lists only real options.
    """
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    cs.store(group="schema/cluster", name="cluster", node=ClusterConfig)  # one schema, every cluster=
    for group, options in GROUP_SCHEMAS.items():
        for name, schema in options.items():
            cs.store(group=f"schema/{group}", name=name, node=schema)
    cs.store(group="hydra/help", name="testbed", node=app_help())


# --- semantic checks --------------------------------------------------------------------------

def validate(cfg: DictConfig, local_world_size: int | None = None, simulated: bool = False) -> None:
    """Raise ConfigError for a config that cannot run; called before any rank is spawned.

    ``local_world_size`` is the number of ranks on this machine (world_size when we spawn them);
    ``simulated``: the config is predicted (python -m testbed.sim), not run.
    """
    require(simulated or cfg.sim.gradient_mb is None,
             f"sim.gradient_mb={cfg.sim.gradient_mb} stands for a model the testbed does not build (a simulator-only "
             f"paper_model such as inception_v3?), but this run measures model={cfg.model.name}; predict it with "
             "python -m testbed.sim, or measure a built model (model=..., or model=custom model.target=...)")
    local = int(cfg.world_size) if local_world_size is None else local_world_size
    for group, options in GROUP_SCHEMAS.items():
        name = cfg[group].name
        require(name in options, f"{group}.name={name}: unknown; allowed: {'|'.join(options)}")
    require(cfg.world_size >= 1, f"world_size={cfg.world_size}: must be an integer >= 1")
    require(cfg.steps >= 1, f"steps={cfg.steps}: must be an integer >= 1")
    require(
        0 <= cfg.warmup_steps < cfg.steps,
        f"warmup_steps={cfg.warmup_steps}: must be in [0, steps={cfg.steps}); lower warmup_steps",
    )
    require(cfg.threads_per_rank >= 0, f"threads_per_rank={cfg.threads_per_rank}: must be >= 0 (0 = auto)")
    require(cfg.timeouts.collective_s > 0, "timeouts.collective_s: must be > 0 seconds")
    require(cfg.timeouts.rendezvous_s > 0, "timeouts.rendezvous_s: must be > 0 seconds")
    require(cfg.buffers in BUFFER_POLICIES, f"buffers={cfg.buffers}: allowed: {'|'.join(BUFFER_POLICIES)}")
    require(not cfg.sync_bn or resolved_device(cfg) == "cuda",
            "sync_bn=true: torch's SyncBatchNorm runs on CUDA only; use buffers=broadcast|average on CPU")
    require(cfg.peak_tflops is None or cfg.peak_tflops > 0, f"peak_tflops={cfg.peak_tflops}: must be > 0 or null")
    check_wandb(cfg.wandb)
    check_optimizer(cfg.optim)

    data = cfg.data
    require(data.batch_size >= 1, f"data.batch_size={data.batch_size}: must be >= 1")
    if enum_value(data.scaling) == "strong":
        require(
            data.batch_size % cfg.world_size == 0,
            f"data.batch_size={data.batch_size} does not divide by world_size={cfg.world_size} under "
            f"data.scaling=strong; use a multiple of {cfg.world_size} or data.scaling=weak",
        )
    check_data(cfg)
    check_schedule(cfg, data_kind(cfg.data.name).train_size(cfg.data))
    _validate_model(cfg)
    bucket = cfg.sync.get("bucket_mb")
    require(bucket is None or bucket >= 0, f"sync.bucket_mb={bucket}: must be >= 0 (0: one bucket per tensor) or null")
    require(cfg.sync.accumulate >= 1, f"sync.accumulate={cfg.sync.accumulate}: must be >= 1 (1 = no accumulation)")
    SYNCHRONIZERS[cfg.sync.name].check(cfg)
    _validate_compress(cfg)
    check_stats(cfg, SYNCHRONIZERS[cfg.sync.name].averaged_gradient(cfg))

    for group, opts in OPTION_GROUPS.items():
        opts[cfg[group].name].check(cfg)
    _validate_across(cfg)
    restarts = cfg.launcher.get("max_restarts", 0)
    require(isinstance(restarts, int) and restarts >= 0,
            f"launcher.max_restarts={restarts}: must be an integer >= 0 (0: a failed run stays failed)")
    check_checkpoints(cfg, to_plain(cfg), SYNCHRONIZERS[cfg.sync.name].sharded_checkpoint)
    check_elastic(cfg)
    if cfg.launcher.name == "virtual":
        check_virtual(cfg)
        local = 1  # every worker is computed in this one process
    else:
        cluster = cfg.get("cluster")
        if cluster is not None:
            raise ConfigError(f"cluster={cluster.name} describes the machines of a virtual run; add launcher=virtual "
                              "(or drop the cluster)")

    check_devices(cfg, local)


def _validate_model(cfg: DictConfig) -> None:
    """The model reads the data (one forward pass fits), and evaluation has what its metrics need."""
    try:
        spec = spec_for(cfg.data)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    reads = model_kind(cfg.model.name).reads
    check_model(cfg, spec, [d for d, data in DATA_KINDS.items() if data.reads == reads])
    check_eval(cfg, heldout_of(cfg.data), metrics_of(spec, model_call(cfg.model).has_logits))
    try:  # last: a forward pass, seconds on the meta device for a large model
        check_fits(cfg.model, spec)
    except ValueError as exc:
        raise ConfigError(f"{exc}") from None
    unshardable = SYNCHRONIZERS[cfg.sync.name].unshardable
    if unshardable is not None:  # once per model, synchronizer and data: a sweep's points share them
        key = json.dumps([cfg.sync.name, OmegaConf.to_container(cfg.model, resolve=True), str(spec)], default=str)
        if key not in _UNSHARDABLE:
            with torch.device("meta"):  # shapes only
                _UNSHARDABLE[key] = unshardable(build_model(cfg.model, spec))
        why = _UNSHARDABLE[key]
        require(why is None, f"sync={cfg.sync.name} with model={cfg.model.name}: {why}")


_UNSHARDABLE: dict[str, str | None] = {}


def _validate_compress(cfg: DictConfig) -> None:
    codec = cfg.compress.name
    if codec == "none":
        return
    CODECS[codec].check(cfg)
    carriers = "|".join(name for name, spec in SYNCHRONIZERS.items() if spec.compresses)
    spec = SYNCHRONIZERS[cfg.sync.name]
    require(spec.compresses, f"compress={codec} with sync={cfg.sync.name}: {spec.no_codec}; use sync={carriers}, or compress=none")
    require(not (cfg.checkpoint.every or cfg.resume),
            f"compress={codec} with checkpoint.every/resume: checkpoints do not hold a codec's state (error-feedback "
            "residuals, step counts), so a resumed run would differ from an uninterrupted one; drop one of them")


def _validate_across(cfg: DictConfig) -> None:
    """The fault and network checks that depend on the synchronizer."""
    spec, fault = SYNCHRONIZERS[cfg.sync.name], cfg.fault
    if cfg.network.name == "emulated":
        from testbed.netem.links import MAX_ENDPOINTS  # the namespace code, only for an emulated network

        endpoints = int(cfg.world_size) + spec.local_servers(cfg)
        require(endpoints <= MAX_ENDPOINTS,
                f"network=emulated: {endpoints} ranks and servers exceed the {MAX_ENDPOINTS} addresses of its /24; use fewer")
    if fault.name == "kill_ps":
        servers = spec.local_servers(cfg)
        require(servers > 0, "fault=kill_ps kills a parameter server the launcher started: use sync=ps (without sync.addresses)")
        require(0 <= fault.shard < servers, f"fault.shard={fault.shard}: must be in [0, sync.servers={servers})")


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python (enums as strings): what ranks receive."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


# Importing this module makes the schemas (and the resolver that config.yaml's sweep subdir uses)
# available to every entry point (app, Compose API, tests).
register_schemas()
OmegaConf.register_new_resolver("short_dirname", short_dirname, replace=True)
# ${div:a,b}: a // b, at least 1 (a preset's machines from its world size: network.nodes=${div:${world_size},8}).
OmegaConf.register_new_resolver("div", lambda a, b: max(1, int(a) // int(b)), replace=True)
