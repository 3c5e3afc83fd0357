"""ZeRO stage 3's parameters: each layer's gathered from the ranks' shards when it computes, freed after.

Every module with parameters of its own is a layer (a unit, testbed.sync.shards); a parameter two
modules share (tied embeddings) belongs to the first, and the other gathers that unit too. Before a
layer's forward its unit is gathered, and ``prefetch`` units after it are issued on the
communication thread; after its forward the unit is freed. A hook on the layer's outputs gathers it
again when backward reaches them (prefetching the units before it); the unit is freed once backward
has produced all its gradients (``release``, called by the synchronizer). The parameters stay views
of the unit's flat buffer, whose storage is freed and refilled in place, so the tensors autograd
saved in forward read the gathered values in backward.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from testbed.collectives.common import Traffic
from testbed.sync.shards import Comm, Unit, all_gather_, free_, is_free, refill_


def layers(model: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """The model's modules with parameters of their own, in registration order (roughly forward's),
    each with the trainable parameters no earlier module holds."""
    seen: set[int] = set()
    out = []
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            out.append((module, own))
    return out


class LayerGather:
    """Gathers and frees the units of ``units`` (in forward order) around their modules' calls."""

    def __init__(self, model: nn.Module, units: list[Unit], comm: Comm, prefetch: int) -> None:
        self.units, self.comm, self.prefetch = units, comm, prefetch
        self.enabled = True  # False while the whole model is gathered (evaluation, the final model)
        self._flights: dict[int, Future[None]] = {}
        unit_of = {id(p): i for i, unit in enumerate(units) for p in unit.params}
        for module in model.modules():
            needs = sorted({unit_of[id(p)] for p in module.parameters(recurse=False) if id(p) in unit_of})
            if needs:
                module.register_forward_pre_hook(functools.partial(self._before_forward, needs))
                module.register_forward_hook(functools.partial(self._after_forward, needs))

    # --- one unit ----------------------------------------------------------------------------------

    def gather(self, index: int) -> None:
        """Issue unit ``index``'s all-gather, unless it is gathered or on its way."""
        unit = self.units[index]
        if index in self._flights or not is_free(unit.full):
            return
        refill_(unit.full)
        self._flights[index] = self.comm.run(functools.partial(self._all_gather, unit))

    @staticmethod
    def _all_gather(unit: Unit) -> Traffic:
        lo, hi = unit.own
        if unit.shard is not None:
            unit.full[lo:hi].copy_(unit.shard.detach())
        return all_gather_(unit.full)

    def wait(self, index: int) -> None:
        flight = self._flights.pop(index, None)
        if flight is not None:
            flight.result()

    def release(self, index: int) -> None:
        """Free unit ``index``'s parameters (once its gather, if on its way, has landed)."""
        self.wait(index)
        free_(self.units[index].full)

    def release_all(self) -> None:
        for index in range(len(self.units)):
            self.release(index)

    # --- around the modules ------------------------------------------------------------------------

    def _ready(self, needs: list[int], ahead: range) -> None:
        for index in needs:
            self.gather(index)
        for index in ahead:
            if 0 <= index < len(self.units):
                self.gather(index)
        for index in needs:
            self.wait(index)

    def _before_forward(self, needs: list[int], module: nn.Module, args: Any) -> None:
        if self.enabled:
            self._ready(needs, range(needs[-1] + 1, needs[-1] + 1 + self.prefetch))

    def _after_forward(self, needs: list[int], module: nn.Module, args: Any, output: Any) -> None:
        if not self.enabled:
            return
        for index in needs:
            self.release(index)
        if torch.is_grad_enabled():
            for leaf in tree_leaves(output):
                if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                    leaf.register_hook(functools.partial(self._before_backward, needs))

    def _before_backward(self, needs: list[int], grad: torch.Tensor) -> None:
        if self.enabled:
            self._ready(needs, range(needs[0] - 1, needs[0] - 1 - self.prefetch, -1))

    def gather_all(self) -> None:
        """The whole model gathered, the hooks idle (until ``release_all``)."""
        self.enabled = False
        for index in range(len(self.units)):
            self.gather(index)
        for index in range(len(self.units)):
            self.wait(index)

    @contextmanager
    def whole(self) -> Iterator[None]:
        """The whole model gathered inside; as it was after."""
        if not self.enabled:  # already whole (the final model)
            yield
            return
        self.gather_all()
        try:
            yield
        finally:
            self.release_all()
            self.enabled = True
