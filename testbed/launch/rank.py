"""What every rank runs: build the pieces from the resolved config, train, write the results.

Ranks receive the resolved config as a plain dict, never the parent's argv, so Hydra multirun,
torchrun and Slurm all compose.
"""

from __future__ import annotations

import _thread
import hashlib
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from testbed import checkpoint
from testbed.balance import Balancer
from testbed.buffers import BufferSync
from testbed.checks import resolved_backend, resolved_device
from testbed.data import build_data, build_heldout, data_kind, heldout_of
from testbed.elastic.membership import Membership, join_world, joining
from testbed.elastic.regroup import Regrouper
from testbed.eval.config import evaluates
from testbed.eval.evaluate import Evaluator
from testbed.eval.schedule import schedule_of
from testbed.faults import FaultInjector
from testbed.imbalance import Injector, loss_weight, shard_batches
from testbed.memory import model_state_formula, peak_memory, rss_now_peak
from testbed.models import build_model, gradient_bytes, model_heldout, objective_batches, workload_facts
from testbed.models.call import model_call
from testbed.netem import enter_rank_namespace
from testbed.optim import build_optimizer
from testbed.rank_failure import LOST_PEER_GRACE_S, lost_peer, record_failure
from testbed.results.step_log import StepLog, flush_open_logs, metrics_path, read_step_records
from testbed.results.summary import summarize, write_summary
from testbed.results.wandb_run import WandbRun, remove_import_temporaries
from testbed.seeds import rank_seed
from testbed.sim.step import communication_bound_s
from testbed.stall import Arrivals
from testbed.stats.noise_scale import noise_probe
from testbed.step_record import StepRecord
from testbed.sync import Synchronizer, run_label, spec_of
from testbed.timing import fill_wait_from_latest
from testbed.trainer import Trainer
from testbed.world import World, close_world, env_rank_layout, init_world, rank_device

log = logging.getLogger("testbed")
# Which attempt of its job a spawned world is (0, then 1, 2, ... after restarts: testbed.launch.job).
ATTEMPT_ENV = "TESTBED_ATTEMPT"
# A restarted attempt's: when the first attempt's first step began (time.time()), where the run's
# clock started (MLPerf's clock runs through the failure and the restart).
CLOCK_ORIGIN_ENV = "TESTBED_CLOCK_ORIGIN"


def restarted() -> bool:
    return int(os.environ.get(ATTEMPT_ENV, "0")) > 0


@record
def rank_main(plain_cfg: dict[str, Any], job_dir: str, identity: dict[str, Any]) -> dict[str, Any] | None:
    """Train one rank; rank 0 writes summary.json and model_final.pt and returns the summary.

    ``identity`` names the job for W&B: ``name``, ``group``, ``job_type`` and its ``overrides``.
    """
    cfg = OmegaConf.create(plain_cfg)
    _exit_on_sigterm()
    rank = env_rank_layout()[0]
    sync: Synchronizer | None = None
    tracker: WandbRun | None = None
    summary: dict[str, Any] | None = None
    arrivals: Arrivals | None = None
    membership: Membership | None = None
    try:  # from the start, so that every failure of the rank is recorded with its kind
        enter_rank_namespace()  # network=emulated: before any socket exists
        spec = spec_of(cfg.sync.name)
        os.environ.update(spec.rank_env(cfg))  # before the process group: NCCL reads its settings there
        after = joining()  # a newcomer taking a lost worker's place (elastic.rejoin_step)
        built = None  # a newcomer's data, built before it says it is ready: the seconds it takes are not a pause
        if after is None:
            world, joined = init_world(resolved_device(cfg), resolved_backend(cfg), cfg.timeouts.collective_s,
                                       cfg.debug), None
        else:
            device = rank_device(resolved_device(cfg), env_rank_layout()[1])
            built = build_data(cfg.data, shard_batches(cfg), rank, cfg.seed, device)
            world, joined = join_world(device, resolved_backend(cfg), cfg.timeouts.collective_s, after)
        _configure_logging(world.rank)
        log.info("rank %d/%d pid %d device %s backend %s", world.rank, world.world_size, os.getpid(), world.device,
                 world.backend)
        sync = spec.impl(cfg.sync, cfg.compress, int(cfg.seed))
        if world.world_size > 1 and not cfg.elastic.enabled:  # elastic: a missing rank is a lost worker
            arrivals = Arrivals(world.rank, world.world_size, cfg.timeouts.stall_warn_s, world.store)
        threads = cfg.threads_per_rank or max(1, (os.cpu_count() or 1) // world.local_world_size)
        torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed)  # identical initial replicas on every rank
        sizes = shard_batches(cfg)  # a newcomer's, once admitted: the membership's (Regrouper.resumed)
        spec, data = built or build_data(cfg.data, sizes, world.rank, cfg.seed, world.device)
        train_samples = data.describe().get("samples")  # the training split's size, for epochs
        batches = objective_batches(cfg.model, data, spec, cfg.seed, world.rank)
        baseline_rss = rss_now_peak()  # what the process holds before the model: data, libraries
        model = build_model(cfg.model, spec).to(world.device)
        if cfg.sync_bn:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        optimizer = build_optimizer(cfg.optim, model.parameters())
        injector = Injector(cfg.imbalance, world.rank, cfg.seed)
        resumed, earlier, state, whole = 0, [], None, None
        if cfg.resume:  # parameters and optimizer before the synchronizer shares the model
            done, state = checkpoint.load(Path(cfg.resume), world.rank)
            checkpoint.restore_training(state, model, optimizer)
            resumed = done + 1
            # A run resumed at another world size (a sharded checkpoint) records its own steps only.
            if checkpoint.saved_world_size(Path(cfg.resume)) == world.world_size:
                earlier = checkpoint.earlier_records(Path(cfg.resume), world.rank, done)
            whole = checkpoint.load_whole(Path(cfg.resume), model) if spec_of(cfg.sync.name).sharded_checkpoint else None
        buffers = BufferSync(model, "local" if cfg.sync_bn else cfg.buffers, world.world_size)
        sync.setup(model, optimizer, world)
        if whole is not None:  # this rank's shard of what every rank saved
            sync.restore(whole)
            del whole
        if cfg.elastic.enabled:
            membership = Membership(cfg, world, model, optimizer, resumed, joined, sync.membership_changed)
            if sync.replicas_hold_state:
                membership.arm()
            if joined is not None:  # the peers' model and optimizer state, and the step they go on from
                # where the servers hold the model, its pull at the step they admitted it at
                resumed = membership.admitted(None if sync.replicas_hold_state else sync.regroup(world, joined["epoch"]))
                earlier = [r for r in read_step_records(metrics_path(Path(job_dir), rank)) if r.step < resumed]
        # The replicas were built alike from one seed; from here on each rank draws its own
        # randomness (dropout masks), as separate machines would.
        torch.manual_seed(rank_seed(cfg.seed, world.rank))
        if world.is_main:  # the process group and the parameter servers are up
            tracker = WandbRun(cfg.wandb, plain_cfg, Path(job_dir), identity)
        step_log = StepLog(metrics_path(Path(job_dir), rank))
        for record in earlier:
            step_log.write(record)
        evaluator = _evaluator(cfg, spec, world, Path(job_dir), train_samples, sum(sizes) * int(cfg.sync.accumulate),
                               tracker.log_eval if tracker else None)
        weight, schedule = loss_weight(sizes, world.rank), schedule_of(cfg, data_kind(cfg.data.name).train_size(cfg.data))
        regrouper = Regrouper(cfg, membership, sync, data, buffers, evaluator) if membership else None
        if regrouper is not None and joined is not None:  # its batches and schedule from the step it joins at
            weight, schedule = regrouper.resumed(resumed, newcomer=True)
        trainer = Trainer(
            optimizer, sync, batches, world, step_log, cfg.steps,
            bf16=cfg.precision == "bf16", log_every=cfg.log_every, injector=injector,
            call=model_call(cfg.model), loss_weight=weight,
            on_record=tracker.log_step if tracker else None,
            # An injected fault strikes the first attempt only, or every restart would meet it again.
            fault=FaultInjector(cfg.fault, world.rank, cfg.seed, cfg.steps) if not (restarted() or joined) else None,
            arrivals=arrivals,
            start_step=resumed, buffers=buffers if buffers.flats else None,
            after_step=_checkpointer(cfg, Path(job_dir), world.rank, model, optimizer, sync, injector, step_log),
            schedule=schedule,
            evaluator=evaluator,
            noise=noise_probe(cfg, model, sizes, world.rank, sync),
            balancer=(Balancer(cfg.balance, sizes, world.rank, world.device, resumed, data.resize)
                      if cfg.balance.name != "none" else None),
            clock_origin=float(os.environ[CLOCK_ORIGIN_ENV]) if CLOCK_ORIGIN_ENV in os.environ else None,
            membership=membership,
            regrouper=regrouper,
        )
        if state is not None:
            checkpoint.restore_rng(state, injector.rng)
        try:
            records = earlier + trainer.run()
        finally:
            step_log.close()  # everything written before the exchange (or the crash report)
            batches.close()
        measured = peak_memory(world.device)  # training's: before the final model is gathered and evaluated
        if buffers.flats:
            buffers.sync()  # the final model's buffers, whatever the last step was
        sync.finalize()
        model = sync.model  # the final model (a sharding synchronizer's whole copy of it)
        facts = {"workload": workload_facts(cfg.model, spec, model), "buffers": buffers.describe(),
                 "data": batches.describe(),
                 "memory": {"model_state": trainer.model_state, "formula": model_state_formula(cfg.optim, sync),
                            "baseline_rss_bytes": baseline_rss, **measured}}
        if evaluator is not None:
            last = records[-1].step if records else -1
            if evaluator.at_end and (not evaluator.rows or evaluator.rows[-1]["step"] != last):
                evaluator.evaluate(sync, last, time.perf_counter() - trainer.began)
            facts["eval"] = evaluator.summary()
            evaluator.close()
        world = trainer.world  # a new membership renumbers the ranks
        if membership is not None:
            facts["membership"] = membership.describe()
        bound = communication_bound_s(cfg) if world.is_main else None
        summary = _finish(plain_cfg, world, model, sync, step_log, records, Path(job_dir), facts, bound)
        return summary
    except Exception as exc:
        record_failure(Path(job_dir) / "logs", rank, exc)  # before the teardown below closes connections
        if lost_peer(str(exc)):
            time.sleep(LOST_PEER_GRACE_S)  # so that the launch agent finds the peer's death (a signal) first
        raise
    finally:
        if arrivals:
            arrivals.close()
        if membership:
            membership.close()
        if tracker:
            tracker.finish(summary)
            remove_import_temporaries()  # this process ends without the interpreter's exit
        if sync is not None:
            sync.close()
        close_world()


def _finish(
    plain_cfg: dict[str, Any], world: World, model: torch.nn.Module, sync: Any,
    step_log: StepLog, records: list[StepRecord], job_dir: Path, run_facts: dict[str, Any],
    comm_bound_s: float | None,
) -> dict[str, Any] | None:
    """After the last step: one all-reduce of enter times (for t_wait), then rank 0 gathers the records."""
    facts = {
        **run_facts,
        "peak_rss_bytes": run_facts["memory"]["peak_rss_bytes"],
        "cuda_peak_bytes": run_facts["memory"].get("cuda_peak_bytes"),
        "param_hash": param_hash(model),
        "buffer_hash": buffer_hash(model),
        "gradient_bytes": gradient_bytes(model),
        "device": str(world.device),
        "backend": world.backend,
    }
    # By step: after a new membership a rank may lack the step it skipped to the restored commit.
    latest = torch.full((int(plain_cfg["steps"]),), -math.inf, dtype=torch.float64, device=world.device)
    for r in records:
        latest[r.step] = r.t_sync_enter
    dist.all_reduce(latest, op=dist.ReduceOp.MAX)
    by_step = latest.tolist()
    fill_wait_from_latest(records, [by_step[r.step] for r in records], sync.waits_for_peers)
    step_log.rewrite(records)
    gathered: list[Any] | None = [None] * world.world_size if world.is_main else None
    dist.gather_object((records, facts), gathered, dst=0)
    if gathered is None:
        return None
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, job_dir / "model_final.pt")
    label = run_label(plain_cfg)
    summary = summarize(plain_cfg, [g[0] for g in gathered], [g[1] for g in gathered], sync.describe(), label=label,
                        comm_bound_s=comm_bound_s)
    write_summary(job_dir, summary)
    return summary


def _evaluator(cfg: Any, spec: Any, world: World, job_dir: Path, train_samples: int | None,
               global_batch: int, on_row: Callable[[dict[str, Any]], None] | None) -> Evaluator | None:
    """Held-out evaluation, where the data has a held-out split and the run asks for any."""
    if not evaluates(cfg, heldout_of(cfg.data)):
        return None
    heldout = model_heldout(cfg.model, build_heldout(cfg.data, cfg.seed), spec, cfg.seed)
    autocast = torch.autocast(device_type=world.device.type, dtype=torch.bfloat16) if cfg.precision == "bf16" else None
    return Evaluator(cfg, heldout, spec, world, job_dir, global_batch, train_samples, autocast, on_row)


def _checkpointer(
    cfg: Any, job_dir: Path, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync: Synchronizer,
    injector: Injector, step_log: StepLog,
) -> Callable[[int], None] | None:
    """Saves a checkpoint after every ``checkpoint.every`` steps but the last (the run's end is its
    result), with the step records up to it flushed: a resumed run takes them over. A synchronizer
    that shards the model state saves this rank's pieces of it."""
    every, keep, steps = int(cfg.checkpoint.every), int(cfg.checkpoint.keep), int(cfg.steps)
    sharded = spec_of(cfg.sync.name).sharded_checkpoint
    if not every:
        return None

    def after(step: int) -> None:
        if (step + 1) % every == 0 and step + 1 < steps:
            step_log.flush()
            pieces = sync.pieces() if sharded else None
            checkpoint.save(job_dir, step, rank, keep, checkpoint.rank_state(model, optimizer, injector.rng, pieces))

    return after


def _exit_on_sigterm(grace_s: float = 1.0) -> None:
    """The launcher stops surviving ranks with SIGTERM when one fails. A rank running Python exits
    through its finally blocks, which flush its metrics; one blocked in a collective cannot run a
    Python handler before the collective times out, so a watcher flushes its metrics and ends it
    after ``grace_s``. Called before any other thread starts: they all inherit the blocked signal,
    which only the watcher receives."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def watch() -> None:
        signal.sigwait({signal.SIGTERM})
        _thread.interrupt_main(signal.SIGTERM)  # runs the handler above in the main thread
        time.sleep(grace_s)
        flush_open_logs()
        os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="testbed-sigterm", daemon=True).start()


def param_hash(model: torch.nn.Module) -> str:
    """Bitwise fingerprint of the parameters and buffers: equal hashes on all ranks mean identical replicas."""
    return _hash(model.state_dict().items())


def buffer_hash(model: torch.nn.Module) -> str | None:
    """Bitwise fingerprint of the buffers alone (BatchNorm's statistics); None for a model without any."""
    named = list(model.named_buffers())
    return _hash(named) if named else None


def _hash(named: Any) -> str:
    digest = hashlib.sha256()
    for name, tensor in named:
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"[rank {rank}] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stdout,
        force=True,
    )
