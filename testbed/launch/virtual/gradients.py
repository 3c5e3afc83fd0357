"""Many workers' gradients in one process, over flat parameters.

The parameters are one flat tensor in the order testbed.sync.base.flat_views lays them out (the
parameter server's, the collectives'), so a worker's gradient is one flat tensor too. Workers whose
gradients are due together are computed in one call vectorized over them (torch.func.vmap over
their parameters, or over none where they hold the same version, and over their batches); the
loss is the trainer's (testbed.models.call), weighted as the trainer weighs a rank's loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from testbed.models.call import ModelCall


class _Loss(nn.Module):
    """The model called as the trainer calls it, returning its loss."""

    def __init__(self, model: nn.Module, call: ModelCall) -> None:
        super().__init__()
        self.model, self.call = model, call

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.call(self.model, inputs, targets).loss


class Gradients:
    """Gradients of ``model``'s loss at flat parameters; ``group``: workers per vectorized call."""

    def __init__(self, model: nn.Module, call: ModelCall, group: int) -> None:
        self.wrapper = _Loss(model, call)
        named = [(f"model.{name}", p) for name, p in model.named_parameters() if p.requires_grad]
        self.layout: list[tuple[str, torch.Size, int, int]] = []
        offset = 0
        for name, p in named:
            self.layout.append((name, p.shape, offset, p.numel()))
            offset += p.numel()
        self.numel, self.group = offset, group
        self.frozen = {f"model.{name}": p.detach() for name, p in model.named_parameters() if not p.requires_grad}
        self._grad = grad(self._loss, has_aux=True)

    def initial(self) -> torch.Tensor:
        """The model's parameters, flat: every worker's at the start."""
        return torch.cat([p.detach().reshape(-1) for _, p in self.wrapper.named_parameters()
                          if p.requires_grad]).clone()

    def _loss(self, flat: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor,
              weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        params = {name: flat[o:o + n].view(shape) for name, shape, o, n in self.layout}
        loss = functional_call(self.wrapper, {**params, **self.frozen}, (inputs, targets))
        return loss * weight, loss.detach()

    def compute(self, params: torch.Tensor, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                weights: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradients [m, numel], losses [m]) of m workers: the gradient of worker i's loss on
        (inputs[i], targets[i]) times weights[i], at ``params`` (one flat tensor all m hold, or one
        row each); its loss unweighted."""
        m = len(inputs)
        shared = params.dim() == 1
        grads, losses = torch.empty(m, self.numel, dtype=params.dtype), torch.empty(m, dtype=params.dtype)
        even = len({tuple(x.shape) for x in inputs}) == 1 and len({tuple(y.shape) for y in targets}) == 1
        step = self.group if even else 1
        for lo in range(0, m, step):
            hi = min(lo + step, m)
            w = torch.tensor(weights[lo:hi], dtype=params.dtype)
            if hi - lo == 1:
                g, loss = self._grad(params if shared else params[lo], inputs[lo], targets[lo], w[0])
                grads[lo], losses[lo] = g, loss
                continue
            batched = vmap(self._grad, in_dims=(None if shared else 0, 0, 0, 0))
            g, loss = batched(params if shared else params[lo:hi], torch.stack(list(inputs[lo:hi])),
                              torch.stack(list(targets[lo:hi])), w)
            grads[lo:hi], losses[lo:hi] = g, loss
        return grads, losses
