"""The ``sim`` group: how ``python -m testbed.sim`` predicts a run (real runs ignore it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SimConfig:
    """How ``python -m testbed.sim`` predicts a run of this config (real runs ignore it)."""

    # Link fits from `python -m testbed.sim.calibrate`; null: a nominal link of `bandwidth` and `alpha_us`.
    calibration: str | None = None
    link: str | None = None  # the calibration's link; null: network.bandwidth when emulated, else loopback
    bandwidth: str | None = None  # nominal rate (e.g. 25gbit); null: network.bandwidth when emulated
    alpha_us: float = 50.0  # nominal per-message latency
    # Two levels (network.nodes): the nominal rate inside a node; null: network.intra_bandwidth.
    intra_bandwidth: str | None = None
    # Compute: the step log of a world_size 1 run of the same model and batch, or explicit times.
    compute_from: str | None = None
    compute_ms_per_sample: float | None = None  # forward + backward
    backward_share: float = 0.67  # of forward + backward (without compute_from)
    optimizer_ms: float = 0.0
    gradient_mb: float | None = None  # a model the testbed does not build (paper-scale presets)
    cores: int | None = None  # ranks share this many cores (one machine); null: each has its own
    # How a parameter server's NIC serves concurrent pushes (and pulls): fair (shared equally) or
    # fifo (one at a time, in arrival order; testbed.sim.events).
    server_link: str = "fair"
    tensors: int = 100  # with gradient_mb: tensors the gradient is split into, for buckets
    # A codec's encode and decode times (the calibration's, measured on the machine that ran
    # python -m testbed.bench.codecs) times this: 0 costs the wire alone.
    codec_time_scale: float = 1.0
    # Codec fits from this calibration in place of `calibration`'s: measured codecs on a nominal link.
    codec_calibration: str | None = None
