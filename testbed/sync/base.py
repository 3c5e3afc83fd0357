"""The Synchronizer protocol: the one thing that differs between experiments."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, ContextManager, Optional

import torch
from torch import nn

from testbed.world import World


@dataclass
class SyncReport:
    """What one synchronization cost this rank."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    staleness: Optional[int] = None  # parameter servers: versions between pull and apply
    # Time blocked on slower ranks, when the synchronizer measures it itself (parameter servers);
    # None: derived from all ranks' arrival times after the run (testbed.timing).
    t_wait: Optional[float] = None


class Synchronizer(ABC):
    """Combines gradients across ranks after backward.

    After ``after_backward`` returns, every rank holds the same averaged gradients in ``p.grad``
    (and the trainer's optimizer steps), or — for a synchronizer with ``steps_optimizer`` — already
    holds updated parameters.
    """

    name: ClassVar[str]
    # True when the call blocks until every rank has arrived, so that t_wait (time spent waiting for
    # slower ranks) is derived from arrival times as in testbed.timing; False when it never waits
    # or reports its own t_wait.
    waits_for_peers: ClassVar[bool] = True
    steps_optimizer: ClassVar[bool] = False

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.accumulate = int(cfg.get("accumulate", 1))

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        self.model, self.optimizer, self.world = model, optimizer, world
        self.module: nn.Module = model  # what the trainer runs forward through (a wrapper may replace it)

    def micro_step(self, is_boundary: bool) -> ContextManager[None]:
        """Context around one micro-step's forward and backward (DDP must know during forward)."""
        return nullcontext()

    @abstractmethod
    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        """Synchronize this step's gradients; ``is_boundary`` is False on accumulation micro-steps."""

    def finalize(self) -> None:
        """After the last step, before results are written: bring replicas to the final model."""

    def zero_grad(self) -> None:
        """Clear the gradients for the next step; synchronizers that own gradient memory override it."""
        self.optimizer.zero_grad(set_to_none=True)

    def describe(self) -> dict[str, Any]:
        """Facts worth recording in summary.json (algorithm actually used, buffer sizes, ...)."""
        return {}

    def close(self) -> None:
        """Release buffers, threads and connections."""


class FlatGradSynchronizer(Synchronizer):
    """Averages gradients through one preallocated flat buffer per dtype.

    Each ``p.grad`` is made a view into the buffer, so backward accumulates straight into it and
    the collective runs on one contiguous tensor with no packing copy (DDP's gradient_as_bucket_view).
    """

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        params = [p for p in model.parameters() if p.requires_grad]
        self.buffers: list[torch.Tensor] = []
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        for dtype in sorted({p.dtype for p in params}, key=str):
            group = [p for p in params if p.dtype == dtype]
            flat = torch.zeros(sum(p.numel() for p in group), dtype=dtype, device=world.device)
            offset = 0
            for p in group:
                view = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                self._views.append((p, view))
                offset += p.numel()
            self.buffers.append(flat)
        self.scratch = [self.make_scratch(flat) for flat in self.buffers]

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        report = SyncReport()
        if not is_boundary:  # accumulate locally; communicate once per window
            return report
        self._rebind_grads()
        for flat, scratch in zip(self.buffers, self.scratch):
            traffic = self.allreduce_(flat, scratch)
            report.bytes_sent += traffic[0]
            report.bytes_recv += traffic[1]
            if self.world.world_size > 1:
                flat.div_(self.world.world_size)
        return report

    def make_scratch(self, flat: torch.Tensor) -> Optional[torch.Tensor]:
        """Working memory the algorithm reuses every step for ``flat`` (allocated once, at setup)."""
        return None

    @abstractmethod
    def allreduce_(self, flat: torch.Tensor, scratch: Optional[torch.Tensor]) -> tuple[int, int]:
        """Sum ``flat`` across ranks in place; return (bytes sent, bytes received) by this rank."""

    def zero_grad(self) -> None:
        # One memset per flat buffer; the grads stay views into it.
        for flat in self.buffers:
            flat.zero_()

    def _rebind_grads(self) -> None:
        # zero_grad(set_to_none=True) or user code may have replaced a grad; copy it back into place.
        for p, view in self._views:
            if p.grad is None:
                view.zero_()
                p.grad = view
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

    def describe(self) -> dict[str, Any]:
        return {"buffer_bytes": sum(b.numel() * b.element_size() for b in self.buffers)}


def flat_views(model: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the trainable parameters and their gradients into two flat buffers the tensors view.

    Collectives and transfers then work on one contiguous tensor each, with no packing copy.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"flat parameter buffers need one dtype, got {sorted(map(str, dtypes))}")
    numel = sum(p.numel() for p in params)
    flat_params = torch.empty(numel, dtype=params[0].dtype, device=device)
    flat_grads = torch.zeros(numel, dtype=params[0].dtype, device=device)
    offset = 0
    for p in params:
        view = flat_params[offset : offset + p.numel()].view_as(p)
        view.copy_(p.detach())
        p.data = view
        p.grad = flat_grads[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat_params, flat_grads
