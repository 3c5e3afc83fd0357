"""The vocabulary of configuration checks, below every component that declares its own checks.

A check raises ``ConfigError`` with one line that names the field, the allowed values and the fix;
``testbed.config.validate`` runs them all before any process is spawned.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the field and the fix."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def enum_value(value: Any) -> str:
    return value.value if isinstance(value, enum.Enum) else str(value)


class Device(enum.Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Backend(enum.Enum):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Precision(enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"


def resolved_device(cfg: Any) -> str:
    device = enum_value(cfg.device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolved_backend(cfg: Any) -> str:
    backend = enum_value(cfg.backend)
    if backend == "auto":
        return "nccl" if resolved_device(cfg) == "cuda" else "gloo"
    return backend


def check_devices(cfg: Any, local: int) -> None:
    """The device, the backend and the precision fit the machine's GPUs and ``local`` ranks on it."""
    device = enum_value(cfg.device)
    backend = enum_value(cfg.backend)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    require(
        device != "cuda" or gpus >= 1,
        "device=cuda but no CUDA GPU is visible; use device=cpu or device=auto",
    )
    if backend == "nccl" or (backend == "auto" and resolved_device(cfg) == "cuda"):
        require(
            resolved_device(cfg) == "cuda" and gpus >= local,
            f"backend=nccl needs one CUDA GPU per local rank ({local} local ranks, {gpus} GPUs visible); "
            "use backend=gloo (or device=cpu), or fewer ranks per machine",
        )
    require(
        enum_value(cfg.precision) == "fp32" or resolved_device(cfg) == "cuda",
        "precision=bf16 (autocast) is for CUDA; use precision=fp32 on CPU",
    )


@dataclass(frozen=True)
class Option:
    """One option of a config group (``imbalance=straggler``, ``fault=kill_rank``, ...): its schema
    and ``check(cfg)``, the checks of its own fields given the whole config. Checks that span groups
    stay in testbed.config."""

    name: str
    schema: type
    check: Callable[[Any], None] = lambda cfg: None


OptionT = TypeVar("OptionT", bound=Option)


def options(*specs: OptionT) -> dict[str, OptionT]:
    """A group's options by name, in the order given."""
    return {spec.name: spec for spec in specs}
