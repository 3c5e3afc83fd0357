"""One Hydra job = one distributed run: validate, spawn or join the world, record the outcome."""

from __future__ import annotations

import logging
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig
from torch.distributed.elastic.multiprocessing.api import SignalException

from testbed import checkpoint, config
from testbed.launch.existing import in_submitit_job, surrounding_world
from testbed.launch.rank import ATTEMPT_ENV, CLOCK_ORIGIN_ENV, rank_main
from testbed.launch.spawn import RankFailure, spawn_world
from testbed.launch.supervisor import supervise_world
from testbed.netem import LAUNCHER_ENDPOINT, EmulatedNetwork, machines_of
from testbed.preflight import check_free_ports, listeners
from testbed.rank_failure import RunFailure, kind_of, lost_peer, recorded, root_cause
from testbed.results.step_log import read_step_log
from testbed.results.summary import ATTEMPTS, failed_summary, summarize, write_summary
from testbed.results.table import format_table, summary_row
from testbed.results.wandb_run import group_name
from testbed.sweeps import excluded, finished, resumable, set_aside
from testbed.sync import SYNCHRONIZERS, run_label
from testbed.world import DEBUG_ENV

log = logging.getLogger("testbed")


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    hydra_cfg = HydraConfig.get()
    job_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    joined: tuple[int, int, int, int] | None = None
    skipped = excluded(hydra_cfg.overrides.task, cfg.get("sweep_exclude"))
    if skipped is not None:
        log.info("skipped: the sweep excludes %s (sweep_exclude)", ",".join(skipped))
        return None
    if multirun and cfg.get("sweep_resume"):
        plain = config.to_plain(cfg)
        done = finished(job_dir, plain)
        if done is not None:
            log.info("done already: %s is ok with this config (sweep_resume)", job_dir)
            return done
        earlier = set_aside(job_dir)
        if earlier is not None and resumable(earlier, plain):
            cfg.resume = str(earlier)
            log.info("resuming %s from its earlier attempt's checkpoint (sweep_resume)", job_dir)
    try:
        joined = surrounding_world()
        if joined is not None:
            _check_joined(cfg, joined, hydra_cfg, multirun)
        config.validate(cfg, local_world_size=joined[3] if joined else None)
    except config.ConfigError as exc:
        if multirun and joined is not None and joined[0] != 0:  # every rank of the point sees it; rank 0 records it
            print(f"config error: {exc}", file=sys.stderr, flush=True)
            return None
        return _with_overrides(job_dir, _config_failure(cfg, job_dir, str(exc), multirun), hydra_cfg)

    plain = config.to_plain(cfg)
    identity = _identity(plain, hydra_cfg, multirun)
    if joined is not None:
        try:
            summary = rank_main(plain, str(job_dir), identity)  # every rank runs here; rank 0 returns the summary
        except Exception as exc:
            cause = cause_of(exc, joined[0])
            if lost_peer(cause["message"]):
                cause = root_cause(job_dir / "logs") or cause
            _record_failure(job_dir, plain, cause)
            raise  # torchrun/Slurm see the rank fail and stop the others
        if summary is None:
            return None
    elif cfg.launcher.name == "virtual":
        summary = _virtual(cfg, plain, job_dir)
    else:
        summary = _spawn(cfg, plain, job_dir, identity)
    summary = _with_overrides(job_dir, summary, hydra_cfg)
    print(format_table([summary_row(summary)]), flush=True)
    if summary["status"] != "ok" and not multirun:
        sys.exit(1)
    return summary


# Failures a restart cannot mend: a NaN recurs bitwise from the same checkpoint, and a stop is an order.
NOT_RESTARTED = ("nonfinite_loss", "stopped", "config")


def _spawn(cfg: DictConfig, plain: dict[str, Any], job_dir: Path, identity: dict[str, Any]) -> dict[str, Any]:
    """Run the job's world; after a failure, up to ``launcher.max_restarts`` times again from its
    latest checkpoint. Each restart is a new launch (rendezvous, servers, network), not torchelastic's
    in-agent restart: the agent's rendezvous store is shared across its rounds without a per-round
    prefix (torch 2.13), so a restarted world reads the failed one's Gloo addresses and hangs
    connecting to them (pytorch/pytorch#135712). A failed attempt's files go to ``attempts/<k>``."""
    failures: list[dict[str, Any]] = []
    resume = Path(cfg.resume) if cfg.resume else None
    max_restarts = int(cfg.launcher.get("max_restarts", 0))  # launcher configs from elsewhere may lack it
    origin: float | None = None  # when the first attempt's first step began: the run's clock, through restarts
    while True:
        summary = _attempt(cfg, plain, job_dir, identity, resume, len(failures), origin)
        kind = (summary.get("error") or {}).get("kind")
        if summary["status"] == "ok" or kind in NOT_RESTARTED or len(failures) >= max_restarts:
            break
        earlier = set_aside(job_dir)
        if origin is None and earlier is not None:
            origin = (_first_step(earlier) or (None, None))[0]
        resume = _restart_point(job_dir, plain) or resume
        failures.append({"attempt": len(failures), "dir": str(earlier), "error": summary["error"],
                         "resumed_from_step": checkpoint.checkpoint_step(checkpoint.latest(resume)) if resume else None})
        log.warning("attempt %d failed (%s); restarting (%d of launcher.max_restarts=%d) from %s", len(failures) - 1,
                    kind, len(failures), max_restarts, f"{resume}'s checkpoint" if resume else "the start")
    if max_restarts:
        for failure, nxt in zip(failures, [*failures[1:], None]):
            failure.update(_restart_s(failure, Path(nxt["dir"]) if nxt else job_dir))
        summary["restarts"], summary["attempts"] = len(failures), failures
        write_summary(job_dir, summary)
    return summary


def _virtual(cfg: DictConfig, plain: dict[str, Any], job_dir: Path) -> dict[str, Any]:
    """The job's workers on a simulated clock, in this process (testbed.launch.virtual)."""
    from testbed.launch.virtual.run import run_virtual

    log.info("virtual cluster %s: %d worker(s), sync=%s model=%s data=%s -> %s", cfg.cluster.name, cfg.world_size,
             cfg.sync.name, cfg.model.name, cfg.data.name, job_dir)
    try:
        return run_virtual(cfg, plain, job_dir)
    except Exception as exc:  # the failure is the run's result; the sweep goes on
        log.exception("virtual run failed")
        return _record_failure(job_dir, plain, _launcher_cause(f"{type(exc).__name__}: {exc}", "virtual"))


def _restart_point(job_dir: Path, plain: dict[str, Any]) -> Path | None:
    """The newest earlier attempt with a checkpoint to continue from (each attempt starts at or after
    the checkpoint of the one before, so the newest with one has the latest)."""
    attempts = sorted((job_dir / ATTEMPTS).iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
    return next((earlier for earlier in reversed(attempts) if checkpoint.continuable(earlier, plain["steps"])), None)


def _restart_s(failure: dict[str, Any], next_dir: Path) -> dict[str, float | None]:
    """Seconds from the launcher learning of the failure to the first step the next attempt began
    (``restart_s``) and to the first it completed (``downtime_s``, as elastic runs count it)."""
    detected = failure["error"].get("detected_at")
    first = _first_step(next_dir, failure["resumed_from_step"])
    if first is None or not detected:
        return {"restart_s": None, "downtime_s": None}
    return {"restart_s": round(first[0] - detected, 3), "downtime_s": round(first[1] - detected, 3)}


def _first_step(job_dir: Path, after: int | None = None) -> tuple[float, float] | None:
    """When the first step after ``after`` (None: the first of all) of ``job_dir``'s ranks began
    and ended, by the wall clock: the earliest rank's."""
    spans = []
    for log_path in (job_dir / "metrics").glob("rank*.jsonl"):
        records = [r for r in read_step_log(log_path) if after is None or r["step"] > after]
        if records:
            r = records[0]
            begun = r["t_sync_enter"] - sum(r[k] for k in ("t_data", "t_injected", "t_forward", "t_backward"))
            spans.append((begun, r["t_sync_exit"] + r["t_optimizer"]))
    return min(spans) if spans else None


def _attempt(
    cfg: DictConfig, plain: dict[str, Any], job_dir: Path, identity: dict[str, Any], resume: Path | None, attempt: int,
    origin: float | None = None,
) -> dict[str, Any]:
    """Build the emulated network and start the parameter servers when the run needs them, then the
    ranks; take all of it down again, whatever happens. ``origin``: when the run's clock started, in
    an earlier attempt (a restarted run's time to target counts the failure and the restart)."""
    plain["resume"] = str(resume) if resume else None
    log.info("spawning %d rank(s): sync=%s model=%s data=%s -> %s", cfg.world_size, cfg.sync.name,
             cfg.model.name, cfg.data.name, job_dir)
    spec = SYNCHRONIZERS[cfg.sync.name]
    servers = spec.local_servers(cfg)
    env: dict[str, str] = dict(DEBUG_ENV) if cfg.debug else {}  # C++ logging reads its level at import
    env[ATTEMPT_ENV] = str(attempt)
    if origin is not None:
        env[CLOCK_ORIGIN_ENV] = repr(origin)
    try:
        check_free_ports(listeners(cfg))  # a sweep's later job may find the range used up since its start
        with ExitStack() as stack:  # exits in reverse: servers stop before their network goes
            network = None
            if cfg.network.name == "emulated":
                endpoints = [f"r{r}" for r in range(cfg.world_size)] + [f"s{k}" for k in range(servers)]
                if cfg.elastic.enabled:  # the launcher's store, which the ranks' namespaces reach
                    endpoints.append(LAUNCHER_ENDPOINT)
                placed = spec.servers.machines(cfg) if spec.servers and spec.servers.machines and cfg.network.nodes else None
                machines = machines_of(cfg.world_size, servers, cfg.network.nodes, cfg.network.servers, placed)
                network = stack.enter_context(EmulatedNetwork(endpoints, cfg.network.bandwidth, cfg.network.latency_ms,
                                                              machines, cfg.network.intra_bandwidth))
                env.update(network.rank_env(cfg.world_size))
                log.info("emulated network: %s links, namespaces %s-*", cfg.network.bandwidth, network.prefix)
            if servers:
                hosts = [(network.endpoints[f"s{k}"].namespace, network.endpoints[f"s{k}"].address)
                         for k in range(servers)] if network else None
                saving = (job_dir / checkpoint.DIR, int(cfg.checkpoint.every)) if cfg.checkpoint.every else None
                restore = checkpoint.latest(resume) if resume else None
                start = spec.servers.start(plain, cfg.world_size, job_dir / "logs", hosts, saving, restore)
                env.update(stack.enter_context(start))  # writes the servers' addresses into plain["sync"]
                log.info("sync=%s servers up: %s", cfg.sync.name, ", ".join(plain["sync"]["addresses"]))
            launch = (rank_main, (plain, str(job_dir), identity), cfg.world_size, job_dir / "logs")
            if cfg.elastic.enabled:  # ranks that may leave without stopping the others
                results = supervise_world(
                    *launch, int(cfg.elastic.min_workers),
                    rendezvous_timeout_s=cfg.timeouts.rendezvous_s,
                    echo_rank0=cfg.launcher.echo_rank0, monitor_interval_s=cfg.launcher.monitor_interval_s, env=env,
                    rejoin_step=cfg.elastic.rejoin_step,
                    store_host=(network.endpoints[LAUNCHER_ENDPOINT].namespace,
                                network.endpoints[LAUNCHER_ENDPOINT].address) if network else None,
                )
            else:
                results = spawn_world(
                    *launch, rendezvous_timeout_s=cfg.timeouts.rendezvous_s, echo_rank0=cfg.launcher.echo_rank0,
                    monitor_interval_s=cfg.launcher.monitor_interval_s, env=env, fresh_interpreters=bool(cfg.debug),
                )
            summary = results[0]
            if network is not None and network.machines is not None:
                summary["topology"] = network.traffic()
                write_summary(job_dir, summary)
            return summary
    except RankFailure as failure:
        return _record_failure(job_dir, plain, blame(job_dir / "logs", failure), detected_at=time.time())
    except (SignalException, KeyboardInterrupt) as stop:  # told to stop: keep this job's result, end the sweep
        signum = stop.sigval if isinstance(stop, SignalException) else signal.SIGINT
        _record_failure(job_dir, plain, _launcher_cause(f"stopped by {signal.Signals(signum).name}", "stopped"))
        raise SystemExit(128 + int(signum)) from None
    except Exception as exc:  # servers that never came up, a rendezvous timeout, ...: still a result
        return _record_failure(job_dir, plain, _launcher_cause(f"{type(exc).__name__}: {exc}", "launch"))


def _identity(plain: dict[str, Any], hydra_cfg: Any, multirun: bool) -> dict[str, Any]:
    """How W&B names the job: its overrides; its group, the sweep; its job type, the synchronizer."""
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("hydra.")]
    return {
        "overrides": list(hydra_cfg.overrides.task),
        "name": ",".join(overrides) or "defaults",
        "group": _group(plain, hydra_cfg, multirun),
        "job_type": run_label(plain),
    }


def _group(plain: dict[str, Any], hydra_cfg: Any, multirun: bool) -> str:
    return plain["wandb"]["group"] or group_name(Path(hydra_cfg.sweep.dir if multirun else hydra_cfg.run.dir))


def _with_overrides(job_dir: Path, summary: dict[str, Any] | None, hydra_cfg: Any) -> dict[str, Any] | None:
    """Add the job's command-line overrides: within a sweep they say which jobs share a configuration
    (interpolated or run-time values such as server addresses cannot); and the W&B group its sweep's
    analysis logs to."""
    if summary is not None:
        summary["overrides"] = list(hydra_cfg.overrides.task)
        summary["wandb_group"] = _group(summary["config"], hydra_cfg, hydra_cfg.mode == RunMode.MULTIRUN)
        write_summary(job_dir, summary)
    return summary


def _record_failure(
    job_dir: Path, plain: dict[str, Any], cause: dict[str, Any], detected_at: float | None = None
) -> dict[str, Any]:
    error = failure_cause(cause)
    if detected_at is not None:
        error["detected_at"] = detected_at  # when the launcher learned of it (restart cost)
    spec = SYNCHRONIZERS[plain["sync"]["name"]]
    summary = failed_summary(job_dir, plain, error, spec.impl.waits_for_peers, run_label(plain))
    write_summary(job_dir, summary)
    where = "" if error["rank"] is None else f"rank {error['rank']}: "
    log.error("run failed at step %s (%s): %s%s (results so far kept in %s)", error["step"], error["kind"], where,
              error["message"], job_dir)
    return summary


def blame(log_dir: Path, failure: RankFailure) -> dict[str, Any]:
    """The failure record (testbed.rank_failure) of the rank to blame for ``failure``: the one the
    launch agent found, or, when that one only lost a peer, the earliest that did not."""
    if failure.killed:  # a signal leaves no record
        return {"message": failure.message, "rank": failure.rank, "kind": "killed", "facts": {}}
    # Failing that (every rank lost a peer: a parameter server's shard died), its own record; a rank
    # that exited before it could record (its interpreter failed to start) leaves the agent's word.
    cause = (root_cause(log_dir) if lost_peer(failure.message) else None) or recorded(log_dir, failure.rank)
    return cause or {"message": failure.message, "rank": failure.rank, "kind": "error", "facts": {}}


def cause_of(exc: BaseException, rank: int) -> dict[str, Any]:
    """The failure record of an exception this process raised as ``rank`` (inside torchrun/Slurm)."""
    facts = exc.facts() if isinstance(exc, RunFailure) else {}
    return {"message": f"{type(exc).__name__}: {exc}", "rank": rank, "kind": kind_of(exc), "facts": facts}


def _launcher_cause(message: str, kind: str) -> dict[str, Any]:
    return {"message": message, "rank": None, "kind": kind, "facts": {}}


def failure_cause(cause: dict[str, Any]) -> dict[str, Any]:
    """The summary's error for a failure record: ``message``, ``kind`` and the rank to blame (for a
    stall, the first that did not arrive rather than the one that reported it, the ``reporter``; for
    a parameter server, also its ``shard``)."""
    error = {"message": cause["message"], "rank": cause["rank"], "kind": cause["kind"], **cause["facts"]}
    if cause["kind"] == "stall":
        error["rank"], error["reporter"] = cause["facts"]["missing"][0], cause["rank"]
    return error


def _check_joined(cfg: DictConfig, joined: tuple[int, int, int, int], hydra_cfg: Any, multirun: bool) -> None:
    _, _, world_size, _ = joined
    # A submitit job is one sweep point of a multirun, its tasks the ranks; its job dir is the
    # sweep's, resolved once at submission and shared by every task.
    submitit = in_submitit_job()
    if multirun and not submitit:
        raise config.ConfigError("inside torchrun/Slurm one process is one rank: drop -m/--multirun (sweep outside)")
    if cfg.world_size != world_size:
        fix = f"set world_size={world_size}"
        if submitit:
            fix = f"set hydra.launcher.tasks_per_node so that nodes x tasks_per_node = {cfg.world_size}"
        raise config.ConfigError(
            f"world_size={cfg.world_size} but the surrounding torchrun/Slurm world has {world_size} ranks; {fix}"
        )
    if cfg.launcher.name == "virtual":
        raise config.ConfigError("launcher=virtual computes every worker in one process; run it without torchrun/Slurm")
    if cfg.elastic.enabled:
        raise config.ConfigError(
            "elastic.enabled inside torchrun/Slurm: the testbed's elastic launcher forks and watches the ranks "
            "itself; run without torchrun/Slurm (torchrun's own --nnodes=MIN:MAX restarts every worker: docs/elastic.md)"
        )
    if cfg.network.name == "emulated":
        raise config.ConfigError(
            "network=emulated builds its namespaces around ranks it spawns itself; run without torchrun/Slurm"
        )
    spec = SYNCHRONIZERS.get(cfg.sync.name)
    if spec is not None and spec.local_servers(cfg):
        raise config.ConfigError(f"sync={cfg.sync.name} inside torchrun/Slurm: {spec.servers.apart}")
    if world_size > 1 and not submitit and not any(o.startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra):
        raise config.ConfigError(
            "inside torchrun/Slurm every rank must write to one job directory: pass hydra.run.dir=<shared path>"
        )


def _config_failure(cfg: DictConfig, job_dir: Path, message: str, multirun: bool) -> dict[str, Any] | None:
    print(f"config error: {message}", file=sys.stderr, flush=True)
    if not multirun:
        sys.exit(2)
    # In a sweep, one bad point is recorded and the sweep goes on with the next job.
    plain = config.to_plain(cfg)
    error = {"message": f"config error: {message}", "rank": None, "kind": "config", "step": None}
    spec = SYNCHRONIZERS.get(cfg.sync.name)
    summary = summarize(plain, [], status="failed", error=error, label=run_label(plain) if spec else None)
    write_summary(job_dir, summary)
    return summary
