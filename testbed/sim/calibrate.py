"""Fit link alpha and beta to the testbed's benchmark records, and measure compute per sample.

Each benchmark record (``python -m testbed.bench`` or ``python -m testbed.bench.ps``) is one measured
synchronization time; its cost model (testbed.costs) gives the alpha and beta coefficients, so
one (link, impl) series is a two-unknown linear fit. Residuals are relative (each row divided by its
measured time), so 4 KB and 256 MB points weigh alike.

Records of ``python -m testbed.bench.codecs`` (those with a ``codec``) are fitted apart, one
encode and one decode line per codec (testbed.sim.codecs).

  python -m testbed.sim.calibrate bench.json ps.json codecs.json --out calibration.json
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from testbed.collectives.registry import COLLECTIVES
from testbed.costs import Cost, Link, parameter_server
from testbed.results.step_log import metrics_path, read_step_log
from testbed.sim.codecs import CodecFit, fit_codec_records

DEFAULT_LINK = "loopback"  # records written before the bench kept a link key were all loopback
TREE_CHUNK_BYTES = 1 << 20  # the bench's chunk for records without tree_chunk_kb (written before it was recorded)
# Smaller messages are left out of fits by default: on emulated links they pass wholly or partly
# within the shaper's burst (64 KiB, or rate/500: 250 KB at 1 Gbit/s) at memory speed, which no
# alpha-beta line describes.
MIN_BYTES = 1 << 20
# All-reduces whose fit prices one that has none on the link, in order.
FALLBACK_IMPLS = tuple(name for name, spec in COLLECTIVES.items() if spec.stands_in)


@dataclass
class Fit:
    link: str
    impl: str
    alpha: float  # s per message
    beta: float  # s per byte
    gm_error: float  # geometric-mean relative error: exp(mean |ln(pred / measured)|) - 1
    max_error: float  # exp(max |ln(pred / measured)|) - 1
    points: int

    @property
    def rate_gbit(self) -> float:
        return 8 / self.beta / 1e9 if self.beta > 0 else math.inf

    def to_link(self) -> Link:
        return Link(self.alpha, self.beta)


def model(record: dict[str, Any], tree_chunk_bytes: int = TREE_CHUNK_BYTES) -> Cost | None:
    """Cost coefficients of one record's synchronization; None when it carries no information.

    grpc_raw (n workers streaming to one server that only receives and sends) has the traffic of
    ps_k1, so it gets the same model: its fit is the transport ceiling for the PS fits.
    """
    impl, n, nbytes = record["impl"], int(record["world_size"]), float(record["bytes"])
    if impl in COLLECTIVES:
        chunk = record["tree_chunk_kb"] * 1024 if "tree_chunk_kb" in record else tree_chunk_bytes
        return None if n == 1 else COLLECTIVES[impl].cost(n, nbytes, chunk)  # one rank sends nothing
    if impl == "grpc_raw":
        return parameter_server(n, nbytes, servers=1)
    match = re.fullmatch(r"ps_k(\d+)", impl)
    if match:
        return parameter_server(n, nbytes, servers=int(match.group(1)))  # strict push, then pull
    raise ValueError(f"records: unknown impl {impl!r}; allowed: {', '.join(COLLECTIVES)}, grpc_raw, ps_k<servers>")


def load_records(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """Records of every file (each a JSON list), with ``link`` filled in where missing."""
    records = []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, list):
            raise ValueError(f"paths: {path} holds no list of benchmark records")
        records += [{"link": DEFAULT_LINK, **rec} for rec in data]
    return records


def _fit_series(link: str, impl: str, rows: list[tuple[Cost, float]]) -> Fit:
    from scipy.optimize import nnls  # here, not above: every launcher and rank imports this module

    coef = np.array([[cost.messages, cost.bytes] for cost, _ in rows])
    measured = np.array([t for _, t in rows])
    # Gamma is not fitted: on CPUs the reduction runs inside the measured bandwidth term, and for ring
    # and PS its coefficient is proportional to the bytes one, so it could not be told apart from beta.
    # Least squares over alpha, beta >= 0: a negative alpha (small points under the line) is no link.
    alpha, beta = nnls(coef / measured[:, None], np.ones(len(rows)))[0]
    pred = coef @ np.array([alpha, beta])
    # Log ratios, so that predicting half and predicting double count as the same error.
    log_err = np.abs(np.log(pred / measured)) if np.all(pred > 0) else np.full(len(rows), math.inf)
    gm_error, max_error = math.expm1(float(np.mean(log_err))), math.expm1(float(np.max(log_err)))
    return Fit(link, impl, float(alpha), float(beta), gm_error, max_error, len(rows))


def fit_records(
    records: Iterable[dict[str, Any]], tree_chunk_bytes: int = TREE_CHUNK_BYTES, min_bytes: int = MIN_BYTES
) -> list[Fit]:
    """One Fit per (link, impl), from the records that are correct, carry traffic and have at least
    ``min_bytes``; sorted by key."""
    series: dict[tuple[str, str], list[tuple[Cost, float]]] = {}
    for rec in records:
        cost = model(rec, tree_chunk_bytes)  # raises on an unknown impl, whatever the filters
        if cost is None or not rec.get("correct", True) or rec["bytes"] < min_bytes:
            continue
        if not rec["time_s"] > 0:
            raise ValueError(f"records: time_s must be > 0, got {rec['time_s']} ({rec['impl']}, {rec['bytes']} B)")
        series.setdefault((rec.get("link", DEFAULT_LINK), rec["impl"]), []).append((cost, float(rec["time_s"])))
    return [_fit_series(link, impl, rows) for (link, impl), rows in sorted(series.items())]


def save(fits: list[Fit], path: str | Path, sources: Iterable[str | Path] = (), codecs: Iterable[CodecFit] = ()) -> None:
    doc = {"fits": [asdict(f) for f in fits], "codecs": [asdict(c) for c in codecs], "sources": [str(s) for s in sources]}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def load(path: str | Path) -> list[Fit]:
    return [Fit(**f) for f in json.loads(Path(path).read_text())["fits"]]


def load_codecs(path: str | Path) -> list[CodecFit]:
    """The codec time fits of a calibration (none in one written before codecs)."""
    return [CodecFit(**c) for c in json.loads(Path(path).read_text()).get("codecs", [])]


def lookup(fits: list[Fit], link: str, impl: str) -> Fit:
    """The fit of (link, impl), else that link's native or ring all-reduce fit."""
    by_key = {(f.link, f.impl): f for f in fits}
    for key in [(link, impl)] + [(link, fallback) for fallback in FALLBACK_IMPLS]:
        if key in by_key:
            return by_key[key]
    bandwidth = "" if link == DEFAULT_LINK else f" --bandwidth {link}"
    raise ValueError(
        f"no calibration for link {link!r} (impl {impl!r}, nor {' or '.join(FALLBACK_IMPLS)} on that link); "
        f"produce it with: python -m testbed.bench{bandwidth} --out bench-{link}.json && "
        f"python -m testbed.sim.calibrate bench-{link}.json --out calibration.json"
    )


def compute_per_sample(job_dir: Path, warmup: int | None = None) -> dict[str, float]:
    """Medians over the steps of a world_size 1 run after ``warmup`` steps (default: the first 20%, >= 1).

    Compute is data + forward + backward + optimizer; injected delays and sync are left out, and so
    are the steps a backup worker's update took no samples of (testbed.sync.ps).
    """
    records = [r for r in read_step_log(metrics_path(Path(job_dir), 0)) if r["samples"]]
    if warmup is None:
        warmup = max(1, len(records) // 5)
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    steps = records[warmup:]
    if not steps:
        raise ValueError(f"job_dir: {job_dir} has {len(records)} logged steps, none left after warmup={warmup}")
    phases = ("t_data", "t_forward", "t_backward", "t_optimizer")
    out = {name: statistics.median(r[name] for r in steps) for name in phases}
    out["t_compute_per_sample"] = statistics.median(sum(r[p] for p in phases) / r["samples"] for r in steps)
    out["samples"] = statistics.median(r["samples"] for r in steps)
    out["steps"] = len(steps)
    return out


def format_fits(fits: list[Fit]) -> str:
    head = f"{'link':<10} {'impl':<16} {'alpha us':>9} {'Gbit/s':>8} {'GM err %':>9} {'max err %':>9} {'points':>6}"
    lines = [head, "-" * len(head)]
    for f in fits:
        lines.append(
            f"{f.link:<10} {f.impl:<16} {f.alpha * 1e6:>9.1f} {f.rate_gbit:>8.3f} "
            f"{f.gm_error * 100:>9.1f} {f.max_error * 100:>9.1f} {f.points:>6}"
        )
    return "\n".join(lines)


def format_codec_fits(fits: list[CodecFit]) -> str:
    head = f"{'codec':<20} {'sizes':>16} {'encode ms/MB':>13} {'decode ms/MB':>13}"
    lines = [head, "-" * len(head)]
    for f in fits:
        per_mb = [(f.encode_s[-1] / f.bytes[-1], f.decode_s[-1] / f.bytes[-1])]
        sizes = f"{f.bytes[0] / 2**20:g}-{f.bytes[-1] / 2**20:g} MB"
        lines.append(f"{f.codec:<20} {sizes:>16} {per_mb[0][0] * 2**20 * 1e3:>13.3f} {per_mb[0][1] * 2**20 * 1e3:>13.3f}")
    return "\n".join(lines) + "\n(ms/MB at the largest size)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.sim.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("bench", nargs="+", help="JSON records of python -m testbed.bench or testbed.bench.ps")
    parser.add_argument("--out", default="", help="write the fits here (e.g. calibration.json)")
    parser.add_argument("--tree-chunk-kb", type=int, default=TREE_CHUNK_BYTES // 1024, help="as given to the bench, for records that do not say")
    parser.add_argument("--min-kb", type=int, default=MIN_BYTES // 1024, help="leave smaller messages out of the fits")
    args = parser.parse_args(argv)
    if args.tree_chunk_kb < 1:
        parser.error("--tree-chunk-kb must be >= 1")
    records = load_records(args.bench)
    codecs = fit_codec_records([r for r in records if "codec" in r])
    fits = fit_records([r for r in records if "codec" not in r], args.tree_chunk_kb * 1024, args.min_kb * 1024)
    if not fits and not codecs:
        print("no usable records (all failed, or all-reduce over one rank)", file=sys.stderr)
        return 1
    print(format_fits(fits))
    if codecs:
        print(format_codec_fits(codecs))
    if args.out:
        save(fits, args.out, args.bench, codecs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
