"""A gradient codec in the simulator: its payloads on the wire and its encode and decode time.

Payloads are the codecs' own: each is built over the run's buckets (or parameter-server shards)
on the meta device, so the simulated bytes are those a run sends. Time is the codec's own as
``python -m testbed.bench.codecs`` measured it, encode and decode apart, piecewise linear in the
bucket's bytes (``python -m testbed.sim.calibrate`` keeps it in the calibration's ``codecs``),
times ``sim.codec_time_scale`` (0: free codecs, the wire alone).

How each carries a bucket, as the synchronizers do: a linear codec runs the synchronizer's own
all-reduce over each of its rounds (one payload; PowerSGD's two) and decodes once; a non-linear
one allgathers its payload over a ring and decodes all n payloads.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from testbed.checks import ConfigError
from testbed.compress import build_codec, label
from testbed.sync import spec_of


@dataclass
class CodecFit:
    """Seconds to encode a bucket of ``bytes`` (and to decode one payload of it), measured at the
    sizes of ``bytes``: piecewise linear in between, the end segments' slopes beyond."""

    codec: str  # the codec's label (testbed.compress.label), e.g. 'topk 1% +ef'
    bytes: list[float]
    encode_s: list[float]
    decode_s: list[float]

    def encode_time(self, nbytes: float) -> float:
        return _piecewise(self.bytes, self.encode_s, nbytes)

    def decode_time(self, nbytes: float) -> float:
        return _piecewise(self.bytes, self.decode_s, nbytes)


def _piecewise(xs: list[float], ys: list[float], x: float) -> float:
    """The line through the measured points, extended by its end segments (at least 0 s). Not one
    line for all sizes, as a link's alpha-beta: a codec's time per byte grows with the bucket on a
    CPU (caches; top-k's selection), 2-3x between 1 and 64 MB."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(x, xs, ys))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return max(0.0, ys[i] + slope * (x - xs[i]))


def fit_codec_records(records: list[dict[str, Any]]) -> list[CodecFit]:
    """One CodecFit per codec label of ``python -m testbed.bench.codecs`` records (the median of
    the records at each size), sorted by label."""
    series: dict[str, dict[float, list[dict[str, Any]]]] = {}
    for rec in records:
        series.setdefault(rec.get("label", rec["codec"]), {}).setdefault(float(rec["bytes"]), []).append(rec)
    fits = []
    for name, by_size in sorted(series.items()):
        sizes = sorted(by_size)
        fits.append(CodecFit(name, sizes, *([statistics.median(float(r[key]) for r in by_size[b]) for b in sizes]
                                            for key in ("encode_s", "decode_s"))))
    return fits


def lookup_codec(fits: list[CodecFit], codec_label: str) -> CodecFit | None:
    """The fit of ``codec_label``, else one of the same codec at other settings (its first word)."""
    exact = [f for f in fits if f.codec == codec_label]
    same = [f for f in fits if f.codec.split()[0] == codec_label.split()[0]]
    return (exact or same or [None])[0]


def codec_config(cfg: Any) -> Any | None:
    """The codec a run applies: ``compress``, or the synchronizer's own (DDP's hook); none for a
    synchronizer that never communicates."""
    model = spec_of(cfg.sync.name).sim
    if model is None:
        return None
    if model.codec is not None:
        return model.codec(cfg)
    compress = cfg.get("compress")
    return None if compress is None or compress.name == "none" else compress


@dataclass(frozen=True)
class Compressed:
    """One bucket (or shard) under a codec: the bytes of each of its collectives, and seconds."""

    raw: float
    rounds: tuple[int, ...]
    linear: bool
    encode_s: float
    decode_s: float  # one payload

    @property
    def payload(self) -> int:
        return sum(self.rounds)


@dataclass
class CodecPlan:
    label: str
    parts: list[Compressed]  # per bucket, or per parameter-server shard
    uncompressed_steps: int
    facts: dict[str, Any]


def fits_key(sim: Any) -> str:
    """The ``sim`` key whose calibration file gives the codec fits: ``codec_calibration`` where set."""
    return "codec_calibration" if sim.get("codec_calibration") else "calibration"


def plan(cfg: Any, groups: list[list[torch.Size]], fits: list[CodecFit] | None) -> CodecPlan | None:
    """The run's codec over ``groups`` (the parameter shapes of each bucket or shard; a shard is
    one flat tensor), with its time from ``fits`` (the calibration's; None: payloads only, no
    time); None without a codec."""
    codec_cfg = codec_config(cfg)
    if codec_cfg is None:
        return None
    name = label(codec_cfg)
    scale = 0.0 if fits is None else float(cfg.sim.codec_time_scale)
    fit = lookup_codec(fits, name) if fits is not None and scale else None
    if scale and fit is None:
        key = fits_key(cfg.sim)
        where = f"sim.{key}={cfg.sim[key]} has no codec times" if cfg.sim.get(key) else "no sim.calibration"
        raise ConfigError(
            f"compress={codec_cfg.name}: {where} for {name!r}; add the records of python -m testbed.bench.codecs "
            "(python -m testbed.sim.calibrate bench.json codecs.json --out calibration.json; docs/sim/calibration.json "
            "has this machine's), or set sim.codec_time_scale=0 to cost the wire alone"
        )
    parts, steps = [], 0
    for index, shapes in enumerate(groups):
        numel = sum(s.numel() for s in shapes)
        with torch.device("meta"):  # sizes only
            codec = build_codec(codec_cfg, torch.empty(numel, device="meta"), shapes, index, 0, 0)
        assert codec is not None
        raw = 4.0 * numel
        encode = scale * fit.encode_time(raw) if fit else 0.0
        decode = scale * fit.decode_time(raw) if fit else 0.0
        parts.append(Compressed(raw, tuple(codec.rounds()), codec.linear, encode, decode))
        steps = codec.uncompressed_steps()
    raw, payload = sum(p.raw for p in parts), sum(p.payload for p in parts)
    facts = {"codec": name, "linear": parts[0].linear, "payload_bytes": payload, "ratio": raw / payload,
             "time_scale": scale, "timed_as": fit.codec if fit else None}  # the benchmark's codec label
    return CodecPlan(name, parts, steps, facts)
