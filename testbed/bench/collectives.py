"""All-reduce micro-benchmark in the style of nccl-tests: native vs ring vs tree vs halving-doubling, one run.

algbw = bytes / time; busbw = algbw * 2(n-1)/n, the per-rank link bandwidth an all-reduce of that
speed needs with any point-to-point algorithm, so it is comparable across n and against the
link's peak (nccl-tests' PERFORMANCE.md). Time is the slowest rank's, median over iterations, each
started after a barrier. ``bound_fraction`` is the algorithm's alpha-beta time on the link,
calibrated in the same run, over the measured time (testbed.bench.bound).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from testbed.bench.bound import bound_fraction, calibrate_link, probe_sizes
from testbed.collectives.registry import COLLECTIVES, Setting
from testbed.netem import enter_rank_namespace
from testbed.timing import synchronize

IMPLS = tuple(COLLECTIVES)


@dataclass
class BenchRecord:
    impl: str
    world_size: int
    bytes: int
    time_s: float  # median over iterations of the slowest rank
    time_min_s: float
    algbw: float  # bytes/s
    busbw: float  # bytes/s
    correct: bool
    iters: int
    bound_fraction: float | None  # the algorithm's time on the calibrated link / time_s; None at n = 1
    link_alpha_s: float | None  # that link: s per message
    link_beta_s: float | None  # s per byte
    tree_chunk_kb: int  # the tree's pipelining chunk (the simulator's calibration models it)


def default_iters(nbytes: int) -> int:
    # Loopback timings on shared cores vary by tens of percent; medians need enough samples.
    if nbytes <= 1 << 20:
        return 50
    if nbytes <= 16 << 20:
        return 20
    if nbytes <= 64 << 20:
        return 10
    return 5


def _runner(name: str, numel: int, device: torch.device, setting: Setting) -> Callable[[torch.Tensor], None]:
    spec = COLLECTIVES[name]
    elems = spec.scratch_elems(numel, dist.get_world_size(setting.group), setting)
    scratch = torch.empty(elems, device=device) if elems else None
    return lambda buf: spec.run(buf, scratch, setting) and None


@record
def bench_rank(
    sizes: list[int], impls: list[str], iters: int, warmup: int, tree_chunk_kb: int, backend: str
) -> list[dict]:
    """Run in every rank; rank 0 returns the records."""
    enter_rank_namespace()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    n, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    torch.set_num_threads(1)
    results: list[dict] = []
    # The tree's second tree on its own connections (testbed.collectives.tree).
    setting = Setting(second_group=dist.new_group(), chunk_bytes=tree_chunk_kb * 1024)
    try:
        link = calibrate_link(probe_sizes(sizes), iters or 5, device) if n > 1 else None
        for nbytes in sizes:
            numel = max(1, nbytes // 4)
            # Small integers keep every sum exact in float32, so correctness is equality, not tolerance.
            pattern = (torch.arange(numel, dtype=torch.float32, device=device) % 997) + rank
            expected = (torch.arange(numel, dtype=torch.float32, device=device) % 997) * n + n * (n - 1) / 2
            buf = torch.empty_like(pattern)
            for name in impls:
                run = _runner(name, numel, device, setting)
                buf.copy_(pattern)
                run(buf)
                correct = torch.equal(buf, expected)
                flag = torch.tensor([0.0 if correct else 1.0], device=device)
                dist.all_reduce(flag)
                count = iters or default_iters(nbytes)
                times = []
                for i in range(warmup + count):
                    buf.copy_(pattern)
                    synchronize(device)
                    dist.barrier()
                    start = time.perf_counter()
                    run(buf)
                    synchronize(device)
                    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    if i >= warmup:
                        times.append(float(elapsed.item()))
                median = statistics.median(times)
                algbw = numel * 4 / median
                measured = {"impl": name, "world_size": n, "bytes": numel * 4, "time_s": median}
                rec = BenchRecord(name, n, numel * 4, median, min(times), algbw, algbw * 2 * (n - 1) / n,
                                  bool(flag.item() == 0), count, link and bound_fraction(measured, link),
                                  link and link.alpha, link and link.beta, tree_chunk_kb)
                results.append(asdict(rec))
    finally:
        dist.destroy_process_group()
    return results if rank == 0 else []
