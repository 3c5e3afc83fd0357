"""Synchronizers by name: the name is the Hydra option (``sync=ring``)."""

from __future__ import annotations

from typing import Any, Callable

from testbed.sync.base import FlatGradSynchronizer, Synchronizer, SyncReport

REGISTRY: dict[str, type[Synchronizer]] = {}


def register(name: str) -> Callable[[type[Synchronizer]], type[Synchronizer]]:
    def add(cls: type[Synchronizer]) -> type[Synchronizer]:
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return add


def build_synchronizer(cfg: Any) -> Synchronizer:
    if cfg.name not in REGISTRY:
        raise ValueError(f"sync={cfg.name}: unknown; allowed: {'|'.join(sorted(REGISTRY))}")
    return REGISTRY[cfg.name](cfg)


# Importing the implementations registers them.
from testbed.sync import allreduce, ddp, local_sgd, none, ps, ring, tree  # noqa: E402,F401

__all__ = ["REGISTRY", "FlatGradSynchronizer", "SyncReport", "Synchronizer", "build_synchronizer", "register"]
