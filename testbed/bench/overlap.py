"""Overlapped all-reduce against torch's DDP: the same model, data, buckets and world, side by side.

Both run through the Trainer in one world of ``--world-size`` ranks: ``sync=allreduce
sync.overlap=true`` and ``sync=ddp``, each at ``sync.bucket_mb=--bucket-mb``, from the same initial
model, in pairs that alternate which goes first. Step time = mean ``t_step`` over the steps after
warmup; ratio = testbed / DDP, the median over pairs (target <= 1.05): a shared machine's speed
drifts within a minute, so only runs next to each other in time are compared.

Example: python -m testbed.bench.overlap model.hidden=1024 model.depth=6 data.batch_size=64 --bucket-mb 25
With ``--codec fp16|bf16|powersgd`` the pair is ``compress=<codec>`` against DDP with torch's hook.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed import config
from testbed.checks import resolved_backend, resolved_device
from testbed.data import build_data
from testbed.imbalance import shard_batches
from testbed.launch.spawn import spawn_world
from testbed.models import build_model, gradient_bytes, objective_batches
from testbed.optim import build_optimizer
from testbed.paths import config_dir
from testbed.results.step_log import StepLog
from testbed.sync import spec_of
from testbed.trainer import Trainer
from testbed.world import close_world, init_world

VARIANTS = ("allreduce", "ddp")
PHASES = ("t_data", "t_forward", "t_backward", "t_sync", "t_optimizer")


def compose_cfgs(overrides: list[str], world_size: int, bucket_mb: float, codec: str = "none") -> dict[str, dict[str, Any]]:
    """One validated config per variant, identical but for ``sync`` (and, with ``codec``, the
    testbed's codec against torch's hook of the same name, PowerSGD from the same step)."""
    cfgs = {}
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        for name in VARIANTS:
            extra = ["sync.overlap=true"] if name == "allreduce" else []
            if codec != "none":
                start = "sync.powersgd.start_powerSGD_iter" if name == "ddp" else "compress.start_step"
                extra += [f"sync.hook={codec}"] if name == "ddp" else [f"compress={codec}"]
                extra += [f"{start}=2"] if codec == "powersgd" else []
            cfg = compose(config_name="config", overrides=[
                f"world_size={world_size}", *overrides, f"sync={name}", f"sync.bucket_mb={bucket_mb}", *extra,
            ])
            config.validate(cfg)
            cfgs[name] = OmegaConf.to_container(cfg, resolve=True)
    return cfgs


def bench_rank(plain: dict[str, dict[str, Any]], repeats: int, out_dir: str) -> dict[str, Any] | None:
    """Run in every rank: ``repeats`` pairs of runs; rank 0 returns the step times."""
    cfgs = {name: OmegaConf.create(c) for name, c in plain.items()}
    first = cfgs[VARIANTS[0]]
    world = init_world(resolved_device(first), resolved_backend(first), first.timeouts.collective_s)
    torch.set_num_threads(first.threads_per_rank or max(1, (os.cpu_count() or 1) // world.local_world_size))
    sizes = shard_batches(first)
    step_s: dict[str, list[float]] = {name: [] for name in VARIANTS}
    phases: dict[str, dict[str, list[float]]] = {name: {p: [] for p in PHASES} for name in VARIANTS}
    facts: dict[str, Any] = {}
    final: dict[str, torch.Tensor] = {}
    param_diff = 0.0  # between the two variants' final models: the same work, or no comparison

    def run(name: str, r: int) -> float:
        cfg = cfgs[name]
        torch.manual_seed(cfg.seed)
        spec, data = build_data(cfg.data, sizes, world.rank, cfg.seed, world.device)
        batches = objective_batches(cfg.model, data, spec, cfg.seed, world.rank)
        model = build_model(cfg.model, spec).to(world.device)
        facts["gradient_bytes"] = gradient_bytes(model)
        optimizer = build_optimizer(cfg.optim, model.parameters())
        sync = spec_of(cfg.sync.name).impl(cfg.sync, cfg.compress, int(cfg.seed))
        sync.setup(model, optimizer, world)
        log = StepLog(Path(out_dir) / f"{name}-{r}-rank{world.rank}.jsonl")
        try:
            records = Trainer(optimizer, sync, batches, world, log, cfg.steps, bf16=cfg.precision == "bf16",
                              log_every=10**9).run()
        finally:
            log.close()
            batches.close()
            sync.close()
        facts[f"{name}_describe"] = sync.describe()
        final[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
        timed = records[cfg.warmup_steps:]
        if r:
            for phase in PHASES:
                phases[name][phase].append(statistics.fmean(getattr(rec, phase) for rec in timed))
        return statistics.fmean(rec.t_step for rec in timed)

    try:
        for r in range(repeats + 1):  # round 0 warms up both paths and is discarded
            order = VARIANTS if r % 2 else VARIANTS[::-1]
            times = {name: run(name, r) for name in order}
            param_diff = max(param_diff, float((final[VARIANTS[0]] - final[VARIANTS[1]]).abs().max()))
            if r:
                for name in VARIANTS:
                    step_s[name].append(times[name])
    finally:
        close_world()
    if world.rank:
        return None
    ratios = [a / d for a, d in zip(step_s["allreduce"], step_s["ddp"])]
    return {"step_s": step_s, "phase_s": phases, "ratio": statistics.median(ratios), "ratios": ratios,
            "max_param_diff": param_diff, **facts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.overlap", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.hidden=1024 model.depth=6 steps=30")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--codec", default="none", choices=("none", "fp16", "bf16", "powersgd"),
                        help="compress=<codec> against sync.hook=<codec> (torch's)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    cfgs = compose_cfgs(args.overrides, args.world_size, args.bucket_mb, args.codec)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = spawn_world(bench_rank, (cfgs, args.repeats, tmp), args.world_size, Path(tmp) / "logs")[0]
    result.update(overrides=args.overrides, world_size=args.world_size, bucket_mb=args.bucket_mb, repeats=args.repeats,
                  codec=args.codec)
    ms = {name: 1e3 * statistics.median(times) for name, times in result["step_s"].items()}
    print(
        f"{' '.join(args.overrides) or 'defaults'}, n={args.world_size}, {args.bucket_mb:g} MB buckets"
        f" ({result['gradient_bytes'] / 2**20:.1f} MB of gradients{', ' + args.codec if args.codec != 'none' else ''}):"
        f" allreduce+overlap {ms['allreduce']:.1f} ms,"
        f" ddp {ms['ddp']:.1f} ms per step (medians), ratio {result['ratio']:.3f}"
        f" ({args.repeats} pairs, {time.perf_counter() - started:.0f} s; final models differ by at most"
        f" {result['max_param_diff']:.1e})"
    )
    for name in VARIANTS:
        print(f"  {name:9s} " + "  ".join(
            f"{phase[2:]} {1e3 * statistics.median(result['phase_s'][name][phase]):.1f}" for phase in PHASES) + " ms")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
