"""Injected failures (the ``fault`` group): one fault, at the start of one step, on one rank;
and one change of conditions that is not a failure (``link_slow``).

A fault tests the testbed as much as the training: the run must end ``failed`` within the
configured timeout, name what failed and where, keep the steps done so far, and leave no process,
port, namespace or temporary directory behind. The step is ``fault.step``, or drawn from the run's
seed in [1, steps) so that a sweep over seeds puts the fault at different places reproducibly.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from testbed.checks import Option, options, require
from testbed.network import check_rate
from testbed.rank_failure import RunFailure
from testbed.results.step_log import flush_open_logs
from testbed.schema import typed

# The launcher passes the parameter servers' pids to the ranks for kill_ps (a JSON list).
PS_PIDS_ENV = "TESTBED_PS_PIDS"


@dataclass
class NoFaultConfig:
    name: str = "none"


@dataclass
class KillRankConfig:
    name: str = "kill_rank"
    rank: int = 1
    step: int | None = None  # SIGKILL: no chance to flush or say goodbye


@dataclass
class KillPsConfig:
    name: str = "kill_ps"
    shard: int = 0
    step: int | None = None  # rank 0 SIGKILLs the shard's server process


@dataclass
class LinkDownConfig:
    name: str = "link_down"
    rank: int = 1
    step: int | None = None
    duration_s: float = 60.0  # the rank's emulated link is down this long, then up again


@dataclass
class LinkSlowConfig:
    name: str = "link_slow"
    rank: int = 1
    step: int | None = None
    bandwidth: str = "10mbit"  # the rank's emulated link, both ways, from the start of the step on


@dataclass
class NanLossConfig:
    name: str = "nan_loss"  # not "nan": the override parser reads fault=nan as a float
    rank: int = 0
    step: int | None = None  # the rank's loss becomes NaN, and so do the gradients it shares


def _check_step(cfg: Any) -> None:
    fault, steps = cfg.fault, int(cfg.steps)
    if fault.step is not None:
        require(0 <= fault.step < steps, f"fault.step={fault.step}: must be in [0, steps={steps}) (null: drawn from the seed)")
    else:
        require(steps >= 2, f"fault={fault.name} with fault.step=null draws a step in [1, steps): needs steps >= 2")


def _check_rank(cfg: Any) -> None:
    _check_step(cfg)
    require(0 <= cfg.fault.rank < cfg.world_size, f"fault.rank={cfg.fault.rank}: must be in [0, world_size={cfg.world_size})")


def _check_link_down(cfg: Any) -> None:
    _check_rank(cfg)
    require(cfg.network.name == "emulated", "fault=link_down takes an emulated link down: use network=emulated")
    require(cfg.fault.duration_s > 0, f"fault.duration_s={cfg.fault.duration_s}: must be > 0")


def _check_link_slow(cfg: Any) -> None:
    _check_rank(cfg)
    require(cfg.network.name == "emulated", "fault=link_slow re-shapes a rank's emulated link: use network=emulated")
    require(cfg.network.nodes == 0, "fault=link_slow re-shapes a rank's own link, which two levels "
                                    f"(network.nodes={cfg.network.nodes}) leave unshaped: use network.nodes=0")
    check_rate("fault.bandwidth", cfg.fault.bandwidth)


class NonFiniteLoss(RunFailure, FloatingPointError):
    """A rank's loss is NaN or infinite: training on would spread it to every replica."""

    kind = "nonfinite_loss"


def _kill_self(cfg: Any) -> None:
    # At the start of the step, after the steps before it: their records are on disk, so the step
    # the run is reported to fail at is exact (a real crash may lose up to one flush interval).
    flush_open_logs()
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_server(cfg: Any) -> None:
    os.kill(json.loads(os.environ[PS_PIDS_ENV])[int(cfg.shard)], signal.SIGKILL)


def _link_down(cfg: Any) -> None:
    # This process lives in its emulated host's network namespace: so does `ip`.
    subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
    timer = threading.Timer(float(cfg.duration_s), _link_up)
    timer.daemon = True
    timer.start()


def _link_up() -> None:
    subprocess.run(["ip", "link", "set", "eth0", "up"], check=False)


def _link_slow(cfg: Any) -> None:
    # Both ends of the rank's link: its own eth0 (what it sends; this process is in its namespace)
    # and the bridge port facing it (what it receives). The namespace code only where it runs.
    from testbed.netem.links import INTERFACE, shape
    from testbed.netem.rank import rank_plan

    me = rank_plan()["ranks"][int(os.environ["RANK"])]
    subprocess.run(["tc", "qdisc", "change", "dev", INTERFACE, *shape(cfg.bandwidth)], check=True)
    subprocess.run(["tc", "-n", me["bridge"], "qdisc", "change", "dev", me["port"], *shape(cfg.bandwidth)], check=True)


@dataclass(frozen=True)
class Fault(Option):
    """A fault kind: ``by(cfg)``, the rank that injects it (None: none does); ``strike(cfg)``, what
    that rank does at the start of the fault's step; ``poisons_loss``: it turns that step's loss
    NaN instead."""

    by: Callable[[Any], int | None] = lambda cfg: None
    strike: Callable[[Any], None] = lambda cfg: None
    poisons_loss: bool = False


# One failure, injected at the start of a step (`step`, or drawn from the seed in [1, steps) when
# null), to check that the run fails cleanly: recorded, named, nothing left behind. Which shards
# kill_ps may name depends on the synchronizer, and is checked with the other groups (testbed.config).
FAULTS = options(
    Fault("none", NoFaultConfig),
    Fault("kill_rank", KillRankConfig, _check_rank, by=lambda cfg: cfg.rank, strike=_kill_self),
    # Rank 0 kills the server (any rank could; one must).
    Fault("kill_ps", KillPsConfig, _check_step, by=lambda cfg: 0, strike=_kill_server),
    Fault("link_down", LinkDownConfig, _check_link_down, by=lambda cfg: cfg.rank, strike=_link_down),
    Fault("nan_loss", NanLossConfig, _check_rank, by=lambda cfg: cfg.rank, poisons_loss=True),
    # Not a failure: the network changes under the run, which goes on at the new rate.
    Fault("link_slow", LinkSlowConfig, _check_link_slow, by=lambda cfg: cfg.rank, strike=_link_slow),
)


def fault_step(cfg: Any, seed: int, steps: int) -> int | None:
    """The step at which ``cfg`` strikes (None for no fault)."""
    cfg = typed(FAULTS[cfg.name].schema, cfg)
    if FAULTS[cfg.name].by(cfg) is None:
        return None
    if cfg.step is not None:
        return int(cfg.step)
    return random.Random(seed * 7_919 + 104_729).randrange(1, steps)


class FaultInjector:
    """The fault's part on one rank: called at the start of every step and on every loss."""

    def __init__(self, cfg: Any, rank: int, seed: int, steps: int) -> None:
        self.kind = FAULTS[cfg.name]
        self.cfg = typed(self.kind.schema, cfg)
        self.step = fault_step(cfg, seed, steps)
        self.active = self.step is not None and self.kind.by(cfg) == rank

    def before_step(self, step: int) -> None:
        if self.active and step == self.step:
            self.kind.strike(self.cfg)

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.active and self.kind.poisons_loss and step == self.step:
            return loss * float("nan")
        return loss
