"""Codec benchmark: encode and decode cost per MB of gradient for every codec, on this machine.

For each size, one bucket of that many bytes of fp32 (split as a model's would be: 1024-wide
matrices plus a bias, so that PowerSGD has matrices to factor) is compressed by each codec with
its config defaults (``--ratio`` for the sparsifiers) and decoded back, the codecs interleaved rep
by rep. ``encode`` is what a rank does before sending (error feedback included, as configured);
``decode`` one payload back into a bucket (a non-linear codec decodes n of them per bucket).
PowerSGD's two factorizations are its encode, its product its decode, measured in a world of one.
The records (``codec, label, bytes, payload_bytes, ratio, encode_s, decode_s``, medians) are what
the simulator's codec times are fitted to (testbed.sim.codecs).

  python -m testbed.bench.codecs --sizes 1M,16M,64M --reps 15 --out codecs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from testbed.bench.table import human, parse_bytes
from testbed.compress import CODECS, build_codec, label
from testbed.compress.codec import Alone, Codec, PayloadCodec
from testbed.results.format import rows_frame, text_table

WIDTH = 1024


def shapes_of(nbytes: int) -> list[torch.Size]:
    numel = nbytes // 4
    rows, rest = divmod(numel, WIDTH)
    return [torch.Size([rows, WIDTH])] * (rows > 0) + [torch.Size([rest])] * (rest > 0)


def _time_codec(codec: Codec, grad: torch.Tensor) -> tuple[float, float]:
    """(encode, decode) seconds of one round of ``codec`` on a copy of ``grad``."""
    bucket = grad.clone()
    if isinstance(codec, PayloadCodec):
        start = time.perf_counter()
        payload = codec.compress(bucket)
        mid = time.perf_counter()
        codec.decode(payload, bucket)
        return mid - start, time.perf_counter() - mid
    moved = codec.reduce_(bucket, Alone())
    return moved.t_encode, moved.t_decode


def bench(sizes: list[int], reps: int, ratio: float) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    records = []
    for nbytes in sizes:
        shapes = shapes_of(nbytes)
        grad = torch.randn(sum(s.numel() for s in shapes))
        codecs, labels = {}, {}
        for name, spec in CODECS.items():
            if spec.impl is None:
                continue
            cfg = OmegaConf.structured(spec.schema)
            if "ratio" in cfg:
                cfg.ratio = ratio
            codecs[name] = build_codec(cfg, grad, shapes, 0, 0, 0)
            labels[name] = label(cfg)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in codecs}
        for rep in range(reps + 1):  # the first round warms up
            for name, codec in codecs.items():
                timed = _time_codec(codec, grad)
                if rep:
                    times[name].append(timed)
        for name, codec in codecs.items():
            payload = codec.payload_bytes()
            records.append({
                "codec": name, "label": labels[name], "linear": codec.linear, "bytes": grad.numel() * 4, "payload_bytes": payload,
                "ratio": grad.numel() * 4 / payload,
                "encode_s": statistics.median(t[0] for t in times[name]),
                "decode_s": statistics.median(t[1] for t in times[name]), "reps": reps,
            })
    return records


def format_records(records: list[dict[str, Any]]) -> str:
    rows = [{"codec": r["codec"], "bytes": human(r["bytes"]), "linear": r["linear"], "ratio": r["ratio"],
             "encode ms/MB": 1e3 * r["encode_s"] / (r["bytes"] / 2**20),
             "decode ms/MB": 1e3 * r["decode_s"] / (r["bytes"] / 2**20)} for r in records]
    keys = list(rows[0])
    formats = {"ratio": lambda v: f"{v:.1f}", "encode ms/MB": lambda v: f"{v:.3f}", "decode ms/MB": lambda v: f"{v:.3f}"}
    return text_table(rows_frame(rows, keys), {k: k for k in keys}, formats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.codecs", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M,64M")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--ratio", type=float, default=0.01, help="topk and randomk")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a rank's)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    if min(sizes) < 4 * WIDTH or args.reps < 1 or not 0 < args.ratio <= 1:
        parser.error(f"--sizes must be >= {4 * WIDTH} bytes, --reps >= 1, --ratio in (0, 1]")
    torch.set_num_threads(args.threads)
    records = bench(sizes, args.reps, args.ratio)
    if args.out:
        Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
    print(format_records(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
