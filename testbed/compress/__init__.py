"""Gradient codecs by name: the name is the Hydra option (``compress=topk``); one module each.

Every module of this package with ``SPECS`` (testbed.compress.codec.CodecSpec) declares codecs;
``build_codecs`` makes one per bucket for the synchronizers that carry compression.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import torch

from testbed.checks import ConfigError
from testbed.compress.codec import Codec, CodecSpec, CompressConfig

_INTERNAL = {"codec"}


def _discover() -> dict[str, CodecSpec]:
    modules = (importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)
               if info.name not in _INTERNAL)
    specs = [spec for module in modules for spec in getattr(module, "SPECS", ())]
    return {spec.name: spec for spec in sorted(specs, key=lambda spec: spec.name)}


CODECS: dict[str, CodecSpec] = _discover()


def codec_spec(name: str) -> CodecSpec:
    if name not in CODECS:
        raise ConfigError(f"compress={name}: unknown; allowed: {'|'.join(CODECS)}")
    return CODECS[name]


def label(cfg: Any) -> str:
    """The codec's part of a run's label: '' for none, else e.g. 'topk 1% +ef'."""
    if cfg is None or cfg.get("name", "none") == "none":
        return ""
    return codec_spec(cfg["name"]).label(cfg) + (" +ef" if cfg.get("error_feedback") else "")


def build_codec(cfg: Any, bucket: torch.Tensor, shapes: list[torch.Size], index: int, rank: int, seed: int) -> Codec | None:
    """The codec of bucket ``index`` on ``rank`` (None for compress=none)."""
    if cfg is None:
        return None
    impl = codec_spec(cfg.name).impl
    if impl is None:
        return None
    return impl(cfg, bucket.numel(), bucket.dtype, bucket.device, shapes, index, rank, seed)


__all__ = ["CODECS", "Codec", "CodecSpec", "CompressConfig", "build_codec", "codec_spec", "label"]
