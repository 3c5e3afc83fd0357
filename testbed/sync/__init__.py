"""Synchronizers by name: the name is the Hydra option (``sync=ring``); one module each.

Every module of this package with a ``SPEC`` (testbed.sync.spec) is a synchronizer: adding one
means adding its module, its YAML under ``experiments/sync/`` and its tests, nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from testbed.checks import ConfigError
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


__all__ = ["SYNCHRONIZERS", "SyncReport", "SyncSpec", "Synchronizer", "build_synchronizer", "spec_of"]
