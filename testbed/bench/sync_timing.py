"""Is communication timed when it runs? The trainer's ``t_sync`` against synchronize-bracketed time.

On CUDA the trainer times each phase with CUDA events (testbed.timing), because NCCL returns as soon
as a collective is queued. This benchmark checks those events against the plain method: one run of
the trainer as it is, and an identical run in which every synchronization is bracketed by
``torch.cuda.synchronize`` and timed on the host. The codec's ``t_encode`` and ``t_decode`` are
read once the device is done (``testbed.timing.device_seconds``) in both runs. At ``world_size=1``
the all-reduce has no peer, so what is timed is the synchronizer's own work: bucketing, launching
the collective, and a codec's encode and decode. Target: the two runs' medians of ``t_sync`` agree
within 10 % (``ratio`` = events / bracketed). On CPU both are host timers: a baseline of the noise.

Example: python -m testbed.bench.sync_timing device=cuda model=resnet50 data=synthetic_images \\
    precision=bf16 compress=powersgd --steps 30 --out timing.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from testbed.bench.overhead import SingleRank
from testbed.step_record import StepRecord
from testbed.sync.base import SyncReport
from testbed.timing import synchronize
from testbed.trainer import Trainer

WARMUP = 5  # steps left out of the medians: allocator growth, cuDNN's algorithm search, NCCL's setup


class BracketedTrainer(Trainer):
    """The trainer with each synchronization bracketed by device synchronizations and host timers."""

    bracketed: list[float]

    def _synchronize(self, step: int, boundary: bool) -> SyncReport:
        synchronize(self.world.device)
        start = time.perf_counter()
        report = super()._synchronize(step, boundary)
        synchronize(self.world.device)
        self.bracketed.append(time.perf_counter() - start)
        return report


def median_of(records: list[StepRecord], field: str) -> float | None:
    values = [getattr(r, field) for r in records[WARMUP:] if getattr(r, field) is not None]
    return statistics.median(values) if values else None


def measure(overrides: list[str], steps: int) -> dict:
    rank = SingleRank(overrides)
    if steps <= WARMUP:
        raise SystemExit(f"--steps={steps}: must exceed the {WARMUP} warm-up steps")
    if rank.cfg.sync.accumulate != 1:  # the brackets are per synchronization, the medians per step
        raise SystemExit(f"sync.accumulate={rank.cfg.sync.accumulate}: this benchmark times one synchronization per step; use 1")
    owned = not dist.is_initialized()
    if owned:  # one rank, its own store: the collectives run, with no peer
        dist.init_process_group(rank.world.backend, store=dist.HashStore(), rank=0, world_size=1)
    BracketedTrainer.bracketed = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            _, _, events = rank.run_trainer(steps, Path(tmp) / "events.jsonl")
            _, _, bracketed_records = rank.run_trainer(steps, Path(tmp) / "bracketed.jsonl", BracketedTrainer)
    finally:
        if owned:
            dist.destroy_process_group()
    bracketed = statistics.median(BracketedTrainer.bracketed[WARMUP:])
    t_sync = median_of(events, "t_sync")
    return {
        "overrides": overrides, "device": str(rank.device), "steps": steps, "warmup": WARMUP,
        "events": {f: median_of(events, f) for f in ("t_sync", "t_encode", "t_decode", "t_backward", "t_step")},
        "bracketed": {"t_sync": bracketed, **{f: median_of(bracketed_records, f) for f in ("t_encode", "t_decode")}},
        "ratio": t_sync / bracketed if t_sync is not None and bracketed > 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.sync_timing", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. sync=allreduce compress=powersgd")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    result = measure(args.overrides, args.steps)
    ev, br = result["events"], result["bracketed"]
    ms = lambda v: "-" if v is None else f"{1e3 * v:.3f} ms"  # noqa: E731
    print(f"{' '.join(args.overrides) or 'defaults'} on {result['device']}: t_sync events {ms(ev['t_sync'])}, "
          f"bracketed {ms(br['t_sync'])}, ratio {result['ratio'] or float('nan'):.3f}; t_encode {ms(ev['t_encode'])} / "
          f"{ms(br['t_encode'])}, t_decode {ms(ev['t_decode'])} / {ms(br['t_decode'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
