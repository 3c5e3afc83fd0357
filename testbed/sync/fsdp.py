"""torch's FSDP2 (``fully_shard``) behind the common interface: the reference for sync=zero stage 3.

The layers are sync=zero stage 3's (testbed.sync.gather.layers): each module with parameters of
its own is sharded as one group, modules that share a parameter (tied embeddings) together, and the
root takes what is left. ``reshard_after_forward=true`` frees each layer after its forward and
gathers it again for backward, as ZeRO-3 does (3Ψ); ``false`` keeps it from forward to backward
(2Ψ, more memory). FSDP2 shards each parameter along its first dimension, padded to a multiple of
the ranks, where sync=zero partitions flat buffers by elements.

Its collectives run inside torch, so the bytes a step moves are counted as a ring would move FSDP's
padded buffers, and their time is not separated from compute.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from testbed.costs import ring, ring_allgather
from testbed.memory import Sharding, optimizer_tensors
from testbed.optim import follow, like
from testbed.sharded_checkpoint import Pieces, Whole, optimizer_state
from testbed.sync.base import Synchronizer, SyncReport
from testbed.sync.spec import SimModel, SyncBase, SyncSpec
from testbed.world import World


@dataclass
class FsdpSyncConfig(SyncBase):
    name: str = "fsdp"
    # Free each layer's gathered parameters after its forward and gather them again for backward
    # (ZeRO-3); false: keep them until backward is done with them.
    reshard_after_forward: bool = True


def groups(model: nn.Module) -> list[list[nn.Module]]:
    """The modules below the root with parameters of their own, in registration order, those that
    share a parameter in one group."""
    owner: dict[int, int] = {}
    members: list[list[nn.Module]] = []
    for module in model.modules():
        direct = list(module.parameters(recurse=False))
        if module is model or not direct:
            continue
        joined = sorted({owner[id(p)] for p in direct if id(p) in owner})
        index = joined[0] if joined else len(members)
        if not joined:
            members.append([])
        for other in joined[1:]:  # a module that ties two groups merges them
            members[index] += members[other]
            members[other] = []
            owner.update({key: index for key, value in owner.items() if value == other})
        members[index].append(module)
        owner.update({id(p): index for p in direct})
    return [group for group in members if group]


def ties(model: nn.Module) -> list[list[str]]:
    """The names of each parameter that more than one module holds (tied embeddings), first first."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def padded_numel(shape: torch.Size, n: int) -> int:
    """Elements of a parameter as FSDP2 shards it: its first dimension padded to a multiple of n."""
    rows = shape[0]
    return -(-rows // n) * n * (shape.numel() // rows)


class Fsdp(Synchronizer):
    steps_optimizer = True

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        super().setup(model, optimizer, world)
        # The model's shapes without its memory: a whole copy is made from it to evaluate and to save.
        self._skeleton = copy.deepcopy(model).to("meta")
        self._ties = ties(model)
        mesh = init_device_mesh(world.device.type, (world.world_size,))
        reshard = bool(self.cfg.reshard_after_forward)
        for group in reversed(groups(model)):  # inner groups first, as fully_shard expects
            fully_shard(group if len(group) > 1 else group[0], mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        self.params = list(model.parameters())
        self.shard_optimizer = like(optimizer, self.params)
        n = world.world_size
        padded = sum(padded_numel(p.shape, n) for p in self.params) * self.params[0].element_size()
        self._bytes = (3 if reshard else 2) * (n - 1) * padded // n if n > 1 else 0

    def micro_step(self, is_boundary: bool) -> AbstractContextManager[None]:
        self.model.set_requires_gradient_sync(is_boundary)  # accumulate whole gradients until the boundary
        return nullcontext()

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:
            return SyncReport()
        follow(self.optimizer, self.shard_optimizer)
        self.shard_optimizer.step()
        return SyncReport(bytes_sent=self._bytes, bytes_recv=self._bytes)

    def zero_grad(self) -> None:
        self.shard_optimizer.zero_grad(set_to_none=True)

    def _whole(self) -> nn.Module:
        """A whole copy of the model, from every rank's shards (a collective)."""
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in self.model.state_dict().items()}
        whole = copy.deepcopy(self._skeleton).to_empty(device=self.world.device)
        for first, *others in self._ties:  # moving to the meta device unties them
            for name in others:
                owner, _, leaf = name.rpartition(".")
                setattr(whole.get_submodule(owner), leaf, whole.get_parameter(first))
        whole.load_state_dict(state)
        return whole

    @contextmanager
    def evaluated(self) -> Iterator[tuple[nn.Module, dict[str, Any]]]:
        """A whole copy: each rank evaluates a different number of batches, which FSDP's per-call
        gathers cannot do."""
        yield self._whole(), {"model": "replicas"}

    def finalize(self) -> None:
        """The final model as a whole copy, for the hashes and model_final.pt."""
        self.model = self._whole()

    # --- sharded checkpoints: each rank's rows of every parameter ---------------------------------

    def _rows(self, p: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Where this rank's rows of ``p`` start in its flattened whole (FSDP2 chunks the first
        dimension as torch.chunk does), and its local tensor."""
        local = p.to_local()
        per_rank = -(-p.shape[0] // self.world.world_size)
        return self.world.rank * per_rank * (p.numel() // p.shape[0]), local

    def pieces(self) -> Pieces:
        out = Pieces()
        for name, p in self.model.named_parameters():
            start, local = self._rows(p)
            if local.numel():
                out.add(name, start, local.reshape(-1), self.shard_optimizer.state.get(p, {}), 0, local.numel())
        return out

    def restore(self, whole: Whole) -> None:
        from torch.distributed.tensor import DTensor

        for name, p in self.model.named_parameters():
            start, local = self._rows(p)
            if not local.numel():
                continue
            with torch.no_grad():
                local.reshape(-1).copy_(whole.params[name][start : start + local.numel()])
            state = optimizer_state(whole, [name], start, start + local.numel(), local)
            if state:
                self.shard_optimizer.state[p] = {
                    key: DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                    if torch.is_tensor(value) and value.dim() > 0 else value
                    for key, value in state.items()}

    def held(self) -> dict[str, list[torch.Tensor | None]]:
        return {"params": list(self.params), "grads": [p.grad for p in self.params],
                "optimizer": optimizer_tensors(self.shard_optimizer)}

    def sharding(self) -> Sharding:
        """ZeRO-3's layout with this rank's unpadded share (the count includes FSDP's padding)."""
        shard = sum(p.to_local().numel() for p in self.params)
        return Sharding(3, sum(p.numel() for p in self.params), shard, self.params[0].element_size(), len(self.params))

    def describe(self) -> dict[str, Any]:
        return {"reshard_after_forward": bool(self.cfg.reshard_after_forward), "groups": len(groups(self._skeleton)) + 1,
                "bytes": "a ring's count of FSDP's padded collectives"}


def unshardable(model: nn.Module) -> str | None:
    """Why FSDP2 cannot shard ``model`` (built on the meta device), or None."""
    scalars = [name for name, p in model.named_parameters() if p.dim() == 0]
    if scalars:
        return f"fully_shard cannot shard scalar parameters ({', '.join(scalars[:3])}); make them 1-element tensors or use sync=zero"
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) > 1:
        return f"fully_shard needs one parameter dtype per group; the model has {sorted(map(str, dtypes))}"
    return None


def _cost(cfg: Any) -> Any:
    n = int(cfg.world_size)
    if cfg.sync.reshard_after_forward:
        return lambda s: ring(n, s) + ring_allgather(n, s)
    return lambda s: ring(n, s)


SPEC = SyncSpec(
    name="fsdp", schema=FsdpSyncConfig, impl=Fsdp,
    sim=SimModel(series=lambda cfg: "native", cost=_cost, overlap=lambda cfg: True),
    label=lambda sync: "fsdp" if sync.get("reshard_after_forward", True) else "fsdp-keep",
    no_codec="FSDP's reduce-scatter carries no codec",
    averaged_gradient=lambda cfg: "FSDP keeps only this rank's shard of the averaged gradient",
    inelastic="each rank's shard of the state is not redistributed over a new membership",
    unshardable=unshardable,
    sharded_checkpoint=True,
)
