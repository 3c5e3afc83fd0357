"""compress=none: gradients travel as they are (each synchronizer's uncompressed path, unchanged)."""

from __future__ import annotations

from dataclasses import dataclass

from testbed.compress.codec import CodecSpec, CompressConfig


@dataclass
class NoCompressConfig(CompressConfig):
    name: str = "none"


SPECS = (CodecSpec(name="none", schema=NoCompressConfig, impl=None),)
