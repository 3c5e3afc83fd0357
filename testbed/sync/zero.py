"""ZeRO (Rajbhandari et al. 2020): data parallelism whose model state is sharded over the ranks.

Stage 1 shards the optimizer state: gradients are reduce-scattered, each rank steps the optimizer
on its shard of the parameters, and the parameters are all-gathered (2Ψ on the wire, DDP's).
Stage 2 also shards the gradients: backward's gradients are reduce-scattered unit by unit as soon
as a unit's are complete, and only this rank's shard of them is kept. Stage 3 also shards the
parameters: each layer is gathered for its forward and again for its backward, and freed after
(3Ψ on the wire). Units are partitioned evenly by elements (testbed.sync.shards); the collectives
are the testbed's ring, so emulated links apply.

The optimizer of a rank is the trainer's kind with its settings, over the rank's shard; the
trainer's own optimizer never steps and only carries the learning rate of each step.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from testbed.checks import require
from testbed.collectives.common import Traffic
from testbed.costs import ring, ring_allgather
from testbed.memory import Sharding, optimizer_tensors
from testbed.optim import follow, like
from testbed.sharded_checkpoint import Pieces, Whole, cut, optimizer_state
from testbed.sync.base import GradReadiness, Synchronizer, SyncReport
from testbed.sync.flat import bucket_ends, busy_time
from testbed.sync.gather import LayerGather, layers
from testbed.sync.shards import Comm, Unit, all_gather_, free_, make_unit, reduce_scatter_, stage_grads
from testbed.sync.spec import SimModel, SyncBase, SyncSpec, require_gloo_cpu
from testbed.world import World

STAGES = (1, 2, 3)
# The codecs a reduce-scatter carries: elementwise casts, whose payload is chunked as the gradients are.
WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class ZeroSyncConfig(SyncBase):
    name: str = "zero"
    stage: int = 1  # 1: optimizer state sharded | 2: + gradients | 3: + parameters
    # Stages 1 and 2: the parameters are reduced and gathered in units of this many MB, in the order
    # backward produces their gradients (null: one unit for all); stage 3's units are the layers.
    bucket_mb: float | None = 25.0
    # Stage 3: layers gathered ahead of the one computing, on a communication thread (0: each when needed).
    prefetch: int = 1


class Zero(Synchronizer):
    steps_optimizer = True  # each rank steps its shard's optimizer

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        self.stage = int(self.cfg.stage)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.names = {id(p): name for name, p in model.named_parameters()}  # a tied parameter by its first name
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"sync=zero shards flat buffers of one dtype; the model has {sorted(map(str, dtypes))}")
        n, rank = world.world_size, world.rank
        self.flat_grads: torch.Tensor | None = None
        self.units = self._layers(model, rank, n) if self.stage == 3 else self._buckets(rank, n)
        shards = [u.shard for u in self.units if u.shard is not None]
        if not shards:
            raise ValueError(f"sync=zero: rank {rank} owns no element of the model's {self._psi()}; "
                             f"use fewer ranks than parameter elements")
        self.shard_grads: torch.Tensor | None = None
        if self.stage == 1:  # the gradients stay whole; a shard's gradient is its chunk of them
            for unit in self.units:
                if unit.shard is not None:
                    unit.shard.grad = self.flat_grads[unit.at + unit.own[0] : unit.at + unit.own[1]]
        else:
            self.shard_grads = torch.zeros(sum(s.numel() for s in shards), dtype=shards[0].dtype, device=world.device)
            offset = 0
            for shard in shards:
                shard.grad = self.shard_grads[offset : offset + shard.numel()]
                offset += shard.numel()
        self.shard_optimizer = like(optimizer, shards)
        # The gradients' wire dtype: a cast codec's (compress=fp16|bf16), or their own.
        self.wire: torch.dtype | None = WIRE.get(self.compress.name) if self.compress else None
        self.scratch = torch.empty(max(u.numel for u in self.units) // n + 1, dtype=self.wire or shards[0].dtype,
                                   device=world.device)
        self.comm = Comm(thread=self.stage == 3 and int(self.cfg.prefetch) > 0 and n > 1)
        self._flights: list[Future[None]] = []
        self._boundary = True
        self.gathers: LayerGather | None = None
        if self.stage == 3:
            self.gathers = LayerGather(model, self.units, self.comm, int(self.cfg.prefetch))
        if self.stage >= 2:  # gradients reduced during backward, unit by unit, in one order on every rank
            unit_of = {id(p): i for i, unit in enumerate(self.units) for p in unit.params}
            self._order = list(range(len(self.units)))[:: -1 if self.stage == 3 else 1]
            self._readiness = GradReadiness(self.params, lambda p: [unit_of[id(p)]], len(self.units), self._unit_ready)

    def _psi(self) -> int:
        return sum(p.numel() for p in self.params)

    def _buckets(self, rank: int, n: int) -> list[Unit]:
        """Stages 1 and 2: one flat buffer of parameters (and, stage 1, of gradients) in the order
        backward produces them, cut into buckets; the shards are views of the flat parameters."""
        ordered = list(reversed(self.params))  # roughly backward's order, as the buckets of DDP
        self.flat_params = torch.empty(self._psi(), dtype=ordered[0].dtype, device=self.world.device)
        self.flat_grads = torch.zeros_like(self.flat_params) if self.stage == 1 else None
        offset = 0
        for p in ordered:
            view = self.flat_params[offset : offset + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            if self.flat_grads is not None:
                p.grad = self.flat_grads[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        cap = self.cfg.bucket_mb
        ends = bucket_ends([p.numel() * p.element_size() for p in ordered], None if cap is None else float(cap) * 2**20)
        units, start, at = [], 0, 0
        for end in ends:
            unit = make_unit(ordered[start:end], rank, n)
            unit.full = self.flat_params[at : at + unit.numel]
            unit.at = at
            lo, hi = unit.own
            unit.shard = nn.Parameter(unit.full[lo:hi]) if hi > lo else None  # shares the flat storage
            units.append(unit)
            start, at = end, at + unit.numel
        return units

    def _layers(self, model: nn.Module, rank: int, n: int) -> list[Unit]:
        """Stage 3: a flat buffer per layer, of which a rank keeps its chunk; the buffer is freed."""
        units = []
        for _, params in layers(model):
            unit = make_unit(params, rank, n)
            unit.full = torch.empty(unit.numel, dtype=params[0].dtype, device=self.world.device)
            for p, lo, hi in zip(params, unit.offsets, unit.offsets[1:]):
                unit.full[lo:hi].copy_(p.detach().reshape(-1))
                p.data = unit.full[lo:hi].view_as(p)
            lo, hi = unit.own
            unit.shard = nn.Parameter(unit.full[lo:hi].clone()) if hi > lo else None
            free_(unit.full)
            units.append(unit)
        return units

    # --- backward ----------------------------------------------------------------------------------

    def micro_step(self, is_boundary: bool) -> AbstractContextManager[None]:
        self._boundary = is_boundary
        if self.stage == 3 or (self.stage == 2 and is_boundary):  # stage 3 frees each layer in every backward
            self._ready: set[int] = set()
            self._next = 0
            return self._readiness.armed()
        return nullcontext()

    def _unit_ready(self, index: int) -> None:
        if self.gathers is not None:
            self.gathers.release(index)
        if not self._boundary:
            return
        self._ready.add(index)
        while self._next < len(self._order) and self._order[self._next] in self._ready:  # one order on every rank
            self._reduce(self._order[self._next])
            self._next += 1

    def _reduce(self, index: int) -> None:
        """Reduce-scatter unit ``index``'s gradients into this rank's shard of them, averaged (the
        mean taken before the sum where the wire carries a cast, as torch's fp16 hook takes it)."""
        unit, n = self.units[index], self.world.world_size
        flat = self.flat_grads[unit.at : unit.at + unit.numel] if self.stage == 1 else stage_grads(unit)
        lo, hi = unit.own
        into = flat[lo:hi] if self.stage == 1 else unit.shard.grad if unit.shard is not None else None

        def job() -> Traffic:
            if self.wire is None:
                traffic = reduce_scatter_(flat, self.scratch)
                if into is not None:
                    torch.div(flat[lo:hi], n, out=into)
                return traffic
            payload = flat.div(n).to(self.wire)
            traffic = reduce_scatter_(payload, self.scratch)
            if into is not None:
                into.copy_(payload[lo:hi])
            return traffic

        self._flights.append(self.comm.run(job))

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:
            if self.gathers is not None:
                self.gathers.release_all()  # any layer prefetched but not used
            return SyncReport()
        if self.stage == 1:
            self._order, self._next = list(range(len(self.units))), 0
        for index in self._order[self._next :]:  # units backward did not complete (or, stage 1, every unit)
            if self.gathers is not None:
                self.gathers.release(index)
            self._reduce(index)
        self._next = len(self._order)
        for flight in self._flights:
            flight.result()
        self._flights = []
        if self.gathers is not None:
            self.gathers.release_all()
        self._step_shards()
        if self.stage < 3:  # every rank's updated shard, to every rank
            for unit in self.units:
                self.comm.run(lambda unit=unit: all_gather_(unit.full)).result()
        moved = self.comm.drain()
        return SyncReport(bytes_sent=sum(m.sent for m in moved), bytes_recv=sum(m.recv for m in moved),
                          t_comm=busy_time([(m.start, m.end) for m in moved]))

    def _step_shards(self) -> None:
        """Step the shard's optimizer with the trainer's optimizer's settings for this step (its lr)."""
        follow(self.optimizer, self.shard_optimizer)
        self.shard_optimizer.step()

    def zero_grad(self) -> None:
        if self.flat_grads is not None:
            self.flat_grads.zero_()
        else:  # stage 2 and 3 overwrite their shard of the gradients; a parameter's own is dropped
            for p in self.params:
                p.grad = None

    # --- the model as a whole ---------------------------------------------------------------------

    def _whole(self) -> AbstractContextManager[None]:
        return self.gathers.whole() if self.gathers is not None else nullcontext()

    @contextmanager
    def evaluated(self) -> Iterator[tuple[nn.Module, dict[str, Any]]]:
        """Stage 3 gathers every layer for the evaluation (each rank evaluates a different number of
        batches, so no layer can be gathered per call)."""
        with self._whole():
            yield self.model, {"model": "replicas"}

    def finalize(self) -> None:
        """The final model, gathered: what summary.json hashes and model_final.pt holds."""
        if self.gathers is not None:
            self.gathers.gather_all()

    # --- what it holds -----------------------------------------------------------------------------

    def held(self) -> dict[str, list[torch.Tensor | None]]:
        shards = [u.shard for u in self.units if u.shard is not None]
        params: list[torch.Tensor | None] = [*self.params, *(shards if self.stage == 3 else [])]
        grads: list[torch.Tensor | None] = [p.grad for p in self.params]
        grads += [self.flat_grads] if self.stage == 1 else [self.shard_grads]
        return {"params": params, "grads": grads, "optimizer": optimizer_tensors(self.shard_optimizer)}

    # --- sharded checkpoints ---------------------------------------------------------------------

    def _names(self, unit: Unit) -> list[str]:
        return [self.names[id(p)] for p in unit.params]

    def pieces(self) -> Pieces:
        out = Pieces()
        for unit in self.units:
            if unit.shard is not None:
                state = self.shard_optimizer.state.get(unit.shard, {})
                cut(out, self._names(unit), unit.offsets, *unit.own, unit.shard.detach(), state)
        return out

    def restore(self, whole: Whole) -> None:
        for unit in self.units:
            names, (lo, hi) = self._names(unit), unit.own
            flat = whole.flat(names).to(self.world.device)
            if self.stage < 3:  # every rank holds the parameters whole
                unit.full.copy_(flat)
            if unit.shard is None:
                continue
            if self.stage == 3:
                unit.shard.data.copy_(flat[lo:hi])
            state = optimizer_state(whole, names, lo, hi, unit.shard)
            if state:
                self.shard_optimizer.state[unit.shard] = state

    def sharding(self) -> Sharding:
        shards = [u.shard_numel for u in self.units]
        return Sharding(self.stage, self._psi(), sum(shards), self.params[0].element_size(), sum(1 for s in shards if s))

    def describe(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "units": len(self.units),
            "unit_numel": [u.numel for u in self.units] if len(self.units) <= 64 else None,
            "shard_numel": sum(u.shard_numel for u in self.units),
            "prefetch": int(self.cfg.prefetch) if self.stage == 3 else None,
        }

    def close(self) -> None:
        if hasattr(self, "comm"):
            self.comm.close()


def _check(cfg: Any) -> None:
    sync = cfg.sync
    require(sync.stage in STAGES, f"sync.stage={sync.stage}: allowed: {'|'.join(map(str, STAGES))}")
    require(sync.bucket_mb is None or sync.bucket_mb > 0,
            f"sync.bucket_mb={sync.bucket_mb}: must be > 0 MB (null: one unit for all parameters)")
    require(sync.prefetch >= 0, f"sync.prefetch={sync.prefetch}: must be >= 0 (0: each layer gathered when needed)")
    require_gloo_cpu(cfg, "sync=zero")
    codec = cfg.compress.name
    require(codec == "none" or codec in WIRE,
            f"compress={codec} with sync=zero sync.stage={sync.stage}: the reduce-scatter hands each rank a chunk of "
            f"the gradients, which only an elementwise codec's payload has; use compress={'|'.join(WIRE)}, or compress=none")
    require(codec == "none" or not cfg.compress.error_feedback,
            f"compress={codec} compress.error_feedback=true with sync=zero: its residual is not kept; drop error_feedback")


def unshardable(model: nn.Module) -> str | None:
    """Why the flat buffers cannot hold ``model``'s trainable parameters (built on the meta device)."""
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    if len(dtypes) > 1:
        return f"its flat buffers hold one dtype; the model's parameters have {sorted(map(str, dtypes))}"
    return None if dtypes else "the model has no trainable parameters"


def _cost(cfg: Any) -> Any:
    n = int(cfg.world_size)
    if int(cfg.sync.stage) == 3:  # the parameters gathered twice (forward, backward), the gradients reduce-scattered
        return lambda s: ring(n, s) + ring_allgather(n, s)
    return lambda s: ring(n, s)  # a reduce-scatter and an all-gather: the ring all-reduce's two halves


SPEC = SyncSpec(
    name="zero", schema=ZeroSyncConfig, impl=Zero, check=_check,
    sim=SimModel(series=lambda cfg: "ring", cost=_cost, overlap=lambda cfg: False),
    label=lambda sync: f"zero-{sync.get('stage')}",
    compresses=True,
    averaged_gradient=lambda cfg: "ZeRO keeps only this rank's shard of the averaged gradient",
    inelastic="each rank's shard of the state is not redistributed over a new membership",
    unshardable=unshardable,
    sharded_checkpoint=True,
)
