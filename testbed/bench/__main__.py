"""``python -m testbed.bench``: the all-reduce micro-benchmark (see testbed.bench.collectives).

Example: python -m testbed.bench --world-sizes 2,4 --min-bytes 4K --max-bytes 256M --out bench.json
Over emulated links (root): python -m testbed.bench --bandwidth 1gbit --sizes 16M
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

from testbed.bench.collectives import IMPLS, bench_rank
from testbed.bench.table import format_results, parse_bytes, size_series
from testbed.collectives.registry import TREE_CHUNK_BYTES
from testbed.launch.spawn import RankFailure, spawn_world
from testbed.netem import EmulatedNetwork, NetworkUnavailable, parse_rate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="2,4", help="comma-separated, e.g. 2,4")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--min-bytes", default="4K")
    parser.add_argument("--max-bytes", default="256M")
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between steps")
    parser.add_argument("--sizes", default="", help="explicit comma-separated sizes (overrides min/max/factor)")
    parser.add_argument("--iters", type=int, default=0, help="timed iterations per point (0: by size)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--tree-chunk-kb", type=int, default=TREE_CHUNK_BYTES // 1024)
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--bandwidth", default="", help="emulate links of this rate (e.g. 100mbit, 1gbit): one network namespace per rank")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="with --bandwidth: added per message by the testbed's own senders (not native)")
    parser.add_argument("--out", default="", help="write the JSON records here")
    args = parser.parse_args(argv)

    impls = [s for s in args.impls.split(",") if s]
    bad = sorted(set(impls) - set(IMPLS))
    if bad:
        parser.error(f"--impls: unknown {','.join(bad)}; allowed: {','.join(IMPLS)}")
    world_sizes = [int(s) for s in args.world_sizes.split(",") if s]
    if any(n < 1 for n in world_sizes):
        parser.error("--world-sizes: every world size must be >= 1")
    sizes = (
        [parse_bytes(s) for s in args.sizes.split(",") if s]
        if args.sizes
        else size_series(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes), args.factor)
    )
    if args.bandwidth:
        try:
            parse_rate(args.bandwidth)
        except ValueError as exc:
            parser.error(f"--bandwidth: {exc}")
        if args.backend == "nccl":
            parser.error("--bandwidth emulates TCP links: use --backend gloo")
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="testbed-bench-") as logs:
        for n in world_sizes:
            bench_args = (sizes, impls, args.iters, args.warmup, args.tree_chunk_kb, args.backend)
            network = EmulatedNetwork([f"r{r}" for r in range(n)], args.bandwidth, args.latency_ms) if args.bandwidth else None
            try:
                with network or nullcontext():
                    env = network.rank_env(n) if network else {}
                    result = spawn_world(bench_rank, bench_args, n, Path(logs), env=env)
            except (RankFailure, NetworkUnavailable) as failure:
                print(f"benchmark failed at world_size={n}: {failure}", file=sys.stderr)
                return 1
            for rec in result[0]:
                rec["link"] = args.bandwidth or "loopback"
            records += result[0]
            if args.out:  # written after each world size, so a later failure keeps what was measured
                Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    print(format_results(records, impls))
    return 0 if all(r["correct"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
