"""Injected failures (the ``fault`` group): one fault, at the start of one step, on one rank.

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
from typing import Any

import torch

from testbed.rank_failure import RunFailure
from testbed.results.step_log import flush_open_logs

# The launcher passes the parameter servers' pids to the ranks for kill_ps (a JSON list).
PS_PIDS_ENV = "TESTBED_PS_PIDS"


class NonFiniteLoss(RunFailure, FloatingPointError):
    """A rank's loss is NaN or infinite: training on would spread it to every replica."""

    kind = "nonfinite_loss"


def fault_step(cfg: Any, seed: int, steps: int) -> int | None:
    """The step at which ``cfg`` strikes (None for no fault)."""
    if cfg.name == "none":
        return None
    if cfg.get("step") is not None:
        return int(cfg.step)
    return random.Random(seed * 7_919 + 104_729).randrange(1, steps)


class FaultInjector:
    """The fault's part on one rank: called at the start of every step and on every loss."""

    def __init__(self, cfg: Any, rank: int, seed: int, steps: int) -> None:
        self.cfg, self.rank = cfg, rank
        self.step = fault_step(cfg, seed, steps)
        # kill_ps is done by rank 0 (any rank could; one must); the others by the chosen rank.
        mine = (cfg.name == "kill_ps" and rank == 0) or (cfg.name != "kill_ps" and cfg.get("rank") == rank)
        self.active = self.step is not None and mine

    def before_step(self, step: int) -> None:
        if not self.active or step != self.step:
            return
        name = self.cfg.name
        if name == "kill_rank":
            # At the start of the step, after the steps before it: their records are on disk, so
            # the step the run is reported to fail at is exact (a real crash may lose up to one
            # flush interval of records).
            flush_open_logs()
            os.kill(os.getpid(), signal.SIGKILL)
        elif name == "kill_ps":
            pid = json.loads(os.environ[PS_PIDS_ENV])[int(self.cfg.shard)]
            os.kill(pid, signal.SIGKILL)
        elif name == "link_down":
            # This process lives in its emulated host's network namespace: so does `ip`.
            subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
            timer = threading.Timer(float(self.cfg.duration_s), _link_up)
            timer.daemon = True
            timer.start()

    def loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.active and self.cfg.name == "nan_loss" and step == self.step:
            return loss * float("nan")
        return loss


def _link_up() -> None:
    subprocess.run(["ip", "link", "set", "eth0", "up"], check=False)
