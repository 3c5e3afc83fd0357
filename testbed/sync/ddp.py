"""torch's DistributedDataParallel behind the common interface: the industry reference.

DDP buckets gradients (``sync.bucket_mb``), all-reduces each bucket during backward as soon as it
is ready, and skips communication inside ``no_sync()``, which wraps the non-boundary micro-steps
of an accumulation window. Its communication therefore happens inside ``t_backward``; ``t_sync``
is only the end of the step, and ``t_wait`` is 0 (DDP does not expose what it waited for).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from testbed.checks import require
from testbed.compress import CODECS
from testbed.models import gradient_bytes
from testbed.sync.allreduce import NATIVE
from testbed.sync.base import Synchronizer, SyncReport
from testbed.sync.spec import SimModel, SyncBase, SyncSpec
from testbed.world import World

HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass
class PowerSgdHookConfig:
    """torch's PowerSGDState, by its own names (sync.hook=powersgd)."""

    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 2  # noqa: N815 (torch's name); > 1 with error feedback or warm start
    min_compression_rate: float = 2.0
    use_error_feedback: bool = True
    warm_start: bool = True


@dataclass
class DdpSyncConfig(SyncBase):
    name: str = "ddp"
    bucket_mb: float = 25.0  # DistributedDataParallel's bucket_cap_mb
    # torch's own communication hook (torch.distributed.algorithms.ddp_comm_hooks): the reference
    # the testbed's codecs (compress=fp16|bf16|powersgd) are measured against.
    hook: str = "none"
    powersgd: PowerSgdHookConfig = field(default_factory=PowerSgdHookConfig)


class DdpSync(Synchronizer):
    waits_for_peers = False

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        self.module = DistributedDataParallel(
            model,
            device_ids=[world.device.index] if world.device.type == "cuda" else None,
            bucket_cap_mb=float(self.cfg.bucket_mb),
            gradient_as_bucket_view=True,  # no copy between the buckets and p.grad
            broadcast_buffers=False,
        )
        n = world.world_size
        self.powersgd = None
        hook = self.cfg.hook
        if hook in ("fp16", "bf16"):
            self.module.register_comm_hook(None, getattr(default_hooks, f"{hook}_compress_hook"))
        elif hook == "powersgd":
            self.powersgd = powerSGD_hook.PowerSGDState(process_group=None, **asdict(self.cfg.powersgd))
            self.module.register_comm_hook(self.powersgd, powerSGD_hook.powerSGD_hook)
        self.raw_bytes = gradient_bytes(model)
        wire = self.raw_bytes // 2 if hook in ("fp16", "bf16") else self.raw_bytes
        self.bytes_per_step = 2 * (n - 1) * wire // n  # what its ring all-reduce moves
        self._compressed = 0  # PowerSGD's elements after compression, summed over its steps so far

    def micro_step(self, is_boundary: bool) -> AbstractContextManager[None]:
        # DDP decides during forward whether backward communicates.
        return nullcontext() if is_boundary else self.module.no_sync()

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:
            return SyncReport()
        moved = self.bytes_per_step
        if self.powersgd is not None and self.powersgd.total_numel_after_compression:
            # PowerSGD counts the elements it sends (P, Q and the tensors it leaves whole) per bucket.
            after = self.powersgd.total_numel_after_compression
            # Frozen parameters have no gradient to send: raw_bytes counts only the trainable ones.
            trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            n, esize = self.world.world_size, self.raw_bytes // trainable
            moved = 2 * (n - 1) * (after - self._compressed) * esize // n
            self._compressed = after
        return SyncReport(bytes_sent=moved, bytes_recv=moved)

    def zero_grad(self) -> None:
        # Zero in place: the grads are views into DDP's buckets.
        self.optimizer.zero_grad(set_to_none=False)

    def describe(self) -> dict[str, Any]:
        return {"bucket_mb": float(self.cfg.bucket_mb), "backend": self.world.backend, "hook": self.cfg.hook}

    def close(self) -> None:
        # Drop DDP while the process group is still registered. Its reducer holds the group; were
        # the reducer's reference the last, the group would be destroyed inside the reducer's
        # destructor, which joins Gloo's worker threads holding the GIL while one of them may need
        # it to free a finished collective's tensor: a rank hung at exit that way.
        if isinstance(getattr(self, "module", None), DistributedDataParallel):  # none before setup made it
            self.module = self.model


def _check(cfg: Any) -> None:
    sync = cfg.sync
    require(sync.bucket_mb > 0, f"sync.bucket_mb={sync.bucket_mb}: must be > 0 (DDP's bucket cap)")
    require(sync.hook in HOOKS, f"sync.hook={sync.hook}: allowed: {'|'.join(HOOKS)}")
    if sync.hook == "powersgd":
        ps = sync.powersgd
        require(ps.matrix_approximation_rank >= 1, f"sync.powersgd.matrix_approximation_rank={ps.matrix_approximation_rank}: must be >= 1")
        require(ps.start_powerSGD_iter > 1 or not (ps.use_error_feedback or ps.warm_start),
                f"sync.powersgd.start_powerSGD_iter={ps.start_powerSGD_iter}: torch needs > 1 with error feedback or warm start")


def _hook_codec(cfg: Any) -> Any | None:
    """The testbed codec that the hook (sync.hook) stands for, as the simulator costs it."""
    hook = cfg.sync.get("hook", "none")
    if hook == "none":
        return None
    if hook != "powersgd":
        return OmegaConf.structured(CODECS[hook].schema)
    state = cfg.sync.powersgd
    return OmegaConf.merge(OmegaConf.structured(CODECS["powersgd"].schema), {
        "rank": state.matrix_approximation_rank, "start_step": state.start_powerSGD_iter,
        "warm_start": state.warm_start, "min_compression_rate": state.min_compression_rate,
        "error_feedback": state.use_error_feedback,
    })


def _label(sync: Mapping[str, Any]) -> str:
    hook = sync.get("hook", "none")
    if hook == "powersgd":
        return f"ddp powersgd r={sync['powersgd']['matrix_approximation_rank']}"
    return "ddp" if hook == "none" else f"ddp {hook}"


SPEC = SyncSpec(
    name="ddp", schema=DdpSyncConfig, impl=DdpSync, check=_check, label=_label,
    no_codec="DDP runs torch's own hooks: use sync.hook=fp16|bf16|powersgd",
    averaged_gradient=lambda cfg: "DDP averages the gradients inside backward, so no rank sees its own; use "
                                  "sync=allreduce (the backend's collective, after backward)",
    unbalanced=lambda cfg: "DDP's all-reduce runs inside backward, so a rank's backward time includes waiting for the "
                           "slowest and its own speed is not measured; use sync=allreduce (the same collective, after "
                           "backward)",
    # DDP always overlaps.
    sim=SimModel(series=NATIVE.series, cost=NATIVE.cost, two_level=NATIVE.two_level, overlap=lambda cfg: True,
                 codec=_hook_codec),
    inelastic="DDP's reducer waits for its all-reduce inside C++, where a lost peer cannot interrupt it (the survivors would wait out timeouts.collective_s)",
)
