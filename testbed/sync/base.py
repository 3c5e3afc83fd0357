"""The Synchronizer protocol: the one thing that differs between experiments."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from testbed.memory import Sharding, optimizer_tensors
from testbed.schema import typed
from testbed.sharded_checkpoint import Pieces, Whole
from testbed.world import World


@dataclass
class SyncReport:
    """What one synchronization cost this rank."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    staleness: int | None = None  # parameter servers: versions between pull and apply
    version: int | None = None  # parameter servers: the version (shard 0's) the pushed gradient was computed on
    # Time blocked on slower ranks, when the synchronizer measures it itself (parameter servers);
    # None: derived from all ranks' arrival times after the run (testbed.timing).
    t_wait: float | None = None
    # Busy communication time: how long collectives were in flight, overlapped with backward or not
    # (testbed.timing); None where the synchronizer cannot tell (DDP).
    t_comm: float | None = None
    # The replicas' parameters are equal after this step, so their buffers are made equal too
    # (testbed.buffers); False for local steps, asynchronous updates and no synchronization.
    replicas_agree: bool = True
    # Compression (testbed.compress), None without: encoding and decoding time (summed over
    # buckets, overlapped with backward or not) and the error-feedback residual's norm.
    t_encode: float | None = None
    t_decode: float | None = None
    residual_norm: float | None = None
    # Backup workers (testbed.sync.ps), None without: True when this rank's gradient came too late
    # for the step's update and was left out.
    dropped: bool | None = None


class Synchronizer(ABC):
    """Combines gradients across ranks after backward.

    After ``after_backward`` returns, every rank holds the same averaged gradients in ``p.grad``
    (and the trainer's optimizer steps), or — for a synchronizer with ``steps_optimizer`` — already
    holds updated parameters.
    """

    # True when the call blocks until every rank has arrived, so that t_wait (time spent waiting for
    # slower ranks) is derived from arrival times as in testbed.timing; False when it never waits
    # or reports its own t_wait.
    waits_for_peers: ClassVar[bool] = True
    steps_optimizer: ClassVar[bool] = False
    # elastic.enabled (testbed.elastic): the replicas hold the model, so a new membership restores
    # the last commit, and a survivor may block in a collective, which a new membership wakes by
    # shutting its connections. False for parameter servers: the servers hold the model, and a
    # worker blocks in calls that the servers end.
    replicas_hold_state: ClassVar[bool] = True

    def __init__(self, cfg: Any, compress: Any = None, seed: int = 0) -> None:
        """``cfg``: the sync config, kept as its schema's dataclass (a DictConfig or a mapping is
        converted); ``compress``: the codec's (testbed.compress), for the synchronizers that carry
        one; ``seed``: the run's (shared codec draws)."""
        from testbed.sync import spec_of  # the registry imports this module

        self.cfg = typed(spec_of(cfg.name).schema, cfg)
        self.compress, self.seed = compress, seed
        self.accumulate = int(self.cfg.accumulate)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        self.model, self.optimizer, self.world = model, optimizer, world
        self.module: nn.Module = model  # what the trainer runs forward through (a wrapper may replace it)

    def regroup(self, world: World, epoch: int) -> int | None:
        """Go on in membership ``epoch``'s process group (elastic.enabled): set up again over it.
        Returns the step to go on from, or None: the one after the commit the survivors restore."""
        self.close()
        self.setup(self.model, self.optimizer, world)
        return None

    def membership_changed(self, change: dict[str, Any]) -> None:
        """elastic.enabled: membership ``change["epoch"]`` is announced, which lost the workers
        ``change["lost"]`` and admitted ``change["joined"]``; tell whatever else holds the run's
        state (parameter servers). Called before this rank goes on in it, and may be called again."""

    def takes_part(self, step: int) -> bool:
        """Whether this rank computes a gradient for ``step``. False where the step's update is
        made without it (a parameter server's backup workers): the trainer calls ``sit_out``
        instead of computing."""
        return True

    def sit_out(self, step: int) -> SyncReport:
        """``step`` goes on without this rank's gradient: catch up with its update."""
        raise NotImplementedError(f"{type(self).__name__} takes part in every step")

    def micro_step(self, is_boundary: bool) -> AbstractContextManager[None]:
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

    @contextmanager
    def evaluated(self) -> Iterator[tuple[nn.Module, dict[str, Any]]]:
        """The run's model for held-out evaluation (testbed.eval), and facts for its record (``model``:
        what it is). Every rank enters together. Here the replicas are the model: after a
        synchronous step they are equal."""
        yield self.model, {"model": "replicas"}

    def describe(self) -> dict[str, Any]:
        """Facts worth recording in summary.json (algorithm actually used, buffer sizes, ...)."""
        return {}

    def held(self) -> dict[str, list[torch.Tensor | None]]:
        """The model state this rank holds, by kind (testbed.memory): the parameters, their
        gradients and the optimizer's state. A synchronizer that shards any of them says so here."""
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params], "optimizer": optimizer_tensors(self.optimizer)}

    def pieces(self) -> Pieces:
        """This rank's part of the model state for a sharded checkpoint (testbed.sharded_checkpoint),
        for a synchronizer whose SyncSpec says ``sharded_checkpoint``."""
        raise NotImplementedError(f"{type(self).__name__} saves the model and optimizer whole")

    def restore(self, whole: Whole) -> None:
        """Take this rank's shard of the model state a sharded checkpoint put together (after setup)."""
        raise NotImplementedError(f"{type(self).__name__} restores the model and optimizer whole")

    def sharding(self) -> Sharding | None:
        """How ``held`` lays the model state out, for ZeRO's formula (testbed.memory): here every
        rank holds all of it; None where the formula does not apply."""
        params = list(self.model.parameters())
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            return None
        psi = sum(p.numel() for p in params)
        return Sharding(None, psi, psi, params[0].element_size(), sum(1 for p in params if p.requires_grad))

    def close(self) -> None:
        """Release buffers, threads and connections."""


class GradReadiness:
    """Calls ``on_ready(group)`` during a boundary backward as soon as every gradient of ``group``
    (a bucket, a shard) is complete: the trigger of overlapped communication.

    ``groups_of(p)`` lists the groups parameter ``p`` belongs to; ``remaining[g]`` is how many of
    group g's gradients backward has still to produce. Hooks fire only inside ``armed()``, so
    accumulation micro-steps and the rest of the step cost one flag test per gradient.
    """

    def __init__(
        self, params: list[nn.Parameter], groups_of: Callable[[nn.Parameter], list[int]], groups: int,
        on_ready: Callable[[int], None],
    ) -> None:
        self._groups_of = {id(p): groups_of(p) for p in params}
        self._needed = [0] * groups
        for members in self._groups_of.values():
            for g in members:
                self._needed[g] += 1
        self.remaining = list(self._needed)
        self._on_ready = on_ready
        self._armed = False
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @contextmanager
    def armed(self) -> Iterator[None]:
        self.remaining = list(self._needed)
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        for g in self._groups_of[id(p)]:
            self.remaining[g] -= 1
            if self.remaining[g] == 0:
                self._on_ready(g)


@contextmanager
def holding(flat_params: torch.Tensor, values: torch.Tensor) -> Iterator[None]:
    """The model (whose parameters view ``flat_params``) holds ``values`` inside, its own after."""
    own = flat_params.clone()
    flat_params.copy_(values)
    try:
        yield
    finally:
        flat_params.copy_(own)


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
