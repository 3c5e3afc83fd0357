"""Synchronizers by name: the name is the Hydra option (``sync=ring``); one module each.

Every module of this package with a ``SPEC`` (testbed.sync.spec) is a synchronizer: adding one
means adding its module, its YAML under ``experiments/sync/`` and its tests, nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from testbed.checks import ConfigError
from testbed.compress import label as compress_label
from testbed.sync.base import Synchronizer, SyncReport
from testbed.sync.spec import SyncSpec


def _discover() -> dict[str, SyncSpec]:
    modules = (importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__))
    specs = [module.SPEC for module in modules if isinstance(getattr(module, "SPEC", None), SyncSpec)]
    return {spec.name: spec for spec in sorted(specs, key=lambda spec: spec.name)}


SYNCHRONIZERS: dict[str, SyncSpec] = _discover()


def spec_of(name: str) -> SyncSpec:
    if name not in SYNCHRONIZERS:
        raise ConfigError(f"sync={name}: unknown; allowed: {'|'.join(SYNCHRONIZERS)}")
    return SYNCHRONIZERS[name]


def build_synchronizer(cfg: Any) -> Synchronizer:
    return spec_of(cfg.name).impl(cfg)


def run_label(plain: Mapping[str, Any]) -> str:
    """A run's synchronizer as tables and dashboards name it, with its codec: 'ring topk 1% +ef'."""
    codec = compress_label(plain.get("compress"))
    sync = spec_of(plain["sync"]["name"]).label(plain["sync"])
    return f"{sync} {codec}" if codec else sync


__all__ = ["SYNCHRONIZERS", "SyncReport", "SyncSpec", "Synchronizer", "build_synchronizer", "run_label", "spec_of"]
