"""Host <-> device copy bandwidth: what staging costs a parameter server's worker on CUDA.

A worker on CUDA copies each shard's gradients down (device to host) before it is pushed and the
pulled parameters up (host to device) after each pull (testbed.sync.ps), through pinned buffers.
Measured here for pinned and pageable host memory at each size, timed on the host between
``torch.cuda.synchronize`` calls; each number is the median of the repeats, in GB/s (1e9 bytes).

Example: python -m testbed.bench.staging --mib 1 16 98 --repeats 20 --out staging.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

# 97.5 MiB: ResNet-50's 25.6 M fp32 parameters, the size one push or pull of it stages.
DEFAULT_MIB = (1.0, 16.0, 97.5)


def copy_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> list[float]:
    dst.copy_(src)  # first use: page-in and the driver's own setup are not bandwidth
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)  # non_blocking so that pinned copies are plain DMA; timed to completion
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def measure(mib: list[float], repeats: int) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("testbed.bench.staging measures host-device copies and needs a CUDA GPU")
    rows = []
    for size in mib:
        numel = int(size * 2**20) // 4
        device_buf = torch.empty(numel, dtype=torch.float32, device="cuda").normal_()
        for pinned in (True, False):
            host = torch.empty(numel, dtype=torch.float32, pin_memory=pinned).normal_()
            for direction, dst, src in (("h2d", device_buf, host), ("d2h", host, device_buf)):
                seconds = statistics.median(copy_seconds(dst, src, repeats))
                rows.append({"mib": size, "pinned": pinned, "direction": direction, "seconds": seconds,
                             "gb_per_s": numel * 4 / seconds / 1e9})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.staging", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, nargs="+", default=list(DEFAULT_MIB))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    rows = measure(args.mib, args.repeats)
    print(f"{'MiB':>8} {'host':>9} {'direction':>9} {'GB/s':>8}")
    for r in rows:
        print(f"{r['mib']:8.1f} {'pinned' if r['pinned'] else 'pageable':>9} {r['direction']:>9} {r['gb_per_s']:8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
