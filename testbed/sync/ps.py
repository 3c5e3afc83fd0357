"""The gRPC parameter server as a synchronizer: push gradients to k shards, pull parameters back.

The optimizer runs on the servers (testbed.ps.server), so the trainer's optimizer does not step.
Parameters and gradients live in two flat buffers that the model's tensors view: pulls write the
parameters in place and pushes read the gradients in place, with no per-step allocation.

With ``sync.overlap`` each shard is pushed from backward's hooks as soon as every parameter it
holds has its gradient, while backward goes on; shards stay whole pushes, so the servers validate
and apply them exactly as without overlap.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn

from testbed.collectives import chunk_bounds
from testbed.ps.client import PsClient, describe_stats
from testbed.ps.wire import tls_of, token_from_env
from testbed.sync import register
from testbed.sync.base import Synchronizer, SyncReport, flat_views
from testbed.world import World


@register("ps")
class ParameterServerSync(Synchronizer):
    steps_optimizer = True
    waits_for_peers = False  # the shards report how long they held each pull back (t_wait)

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        self.flat_params, self.flat_grads = flat_views(model, world.device)
        numel, servers = self.flat_params.numel(), int(self.cfg.servers)
        if numel < servers:
            raise ValueError(f"sync.servers={servers} exceeds the model's {numel} parameters")
        bounds = chunk_bounds(numel, servers)  # byte-balanced: one dtype, equal element counts
        self.param_shards = [self.flat_params[lo:hi] for lo, hi in bounds]
        self.grad_shards = [self.flat_grads[lo:hi] for lo, hi in bounds]
        self.bytes_per_step = numel * self.flat_params.element_size()

        self.client = PsClient(list(self.cfg.addresses), token_from_env(), world.rank, world.timeout_s,
                               self.cfg.chunk_kb * 1024, tls_of(self.cfg)[2])  # fmt: skip
        infos = self.client.register(wait_s=world.timeout_s)
        for i, info in enumerate(infos):
            if info.workers != world.world_size or info.mode != self.cfg.mode:
                raise ValueError(
                    f"ps shard {i} at {self.cfg.addresses[i]} expects {info.workers} workers in mode {info.mode}; "
                    f"this run has world_size={world.world_size}, sync.mode={self.cfg.mode}"
                )
        self.overlap = bool(self.cfg.overlap) and servers > 1
        if self.overlap:
            self._watch_shards(model, bounds)
        if world.rank == 0 and infos[0].version == 0:  # a shard restored from a checkpoint holds its own
            self.client.init_params(self.param_shards)
        dist.barrier()  # every shard holds the initial parameters before anyone pulls
        self.clock = int(infos[0].version)  # sync: a restored shard is at the step the run resumes from
        self.versions = self.client.pull(self.param_shards, self.clock).versions

    # --- overlap: push each shard from backward's hooks -------------------------------------

    def _watch_shards(self, model: nn.Module, bounds: list[tuple[int, int]]) -> None:
        self._shards_of: dict[int, list[int]] = {}
        self._needed = [0] * len(bounds)
        offset = 0
        for p in (p for p in model.parameters() if p.requires_grad):  # flat_views' order
            lo, hi = offset, offset + p.numel()
            offset = hi
            shards = [i for i, (a, b) in enumerate(bounds) if a < hi and lo < b]
            self._shards_of[id(p)] = shards
            for i in shards:
                self._needed[i] += 1
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self._pushes = ThreadPoolExecutor(max_workers=len(bounds), thread_name_prefix="ps-push")
        self._armed = False

    @contextmanager
    def _boundary_backward(self) -> Iterator[None]:
        self._remaining = list(self._needed)
        self._launched: dict[int, Future] = {}
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    def micro_step(self, is_boundary: bool) -> ContextManager[None]:
        return self._boundary_backward() if self.overlap and is_boundary else nullcontext()

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            return
        for i in self._shards_of[id(p)]:
            self._remaining[i] -= 1
            if self._remaining[i] == 0:
                self._launch(i)

    def _launch(self, i: int) -> None:
        self._launched[i] = self._pushes.submit(self.client.push_shard, i, self.grad_shards[i], self.versions[i])

    # --- the step --------------------------------------------------------------------------------

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:  # accumulate locally; push once per window
            return SyncReport()
        if self.overlap:
            for i in range(len(self.grad_shards)):  # shards whose parameters backward did not reach
                if i not in self._launched:
                    self._launch(i)
            replies = [self._launched[i].result() for i in range(len(self.grad_shards))]
        else:
            replies = self.client.push(self.grad_shards, self.versions)
        self.clock += 1
        pulled = self.client.pull(self.param_shards, self.clock)
        self.versions = pulled.versions
        return SyncReport(
            bytes_sent=self.bytes_per_step,  # payload bytes; gRPC and protobuf framing add ~0.01 %
            bytes_recv=self.bytes_per_step,
            staleness=max(r.staleness for r in replies),
            t_wait=pulled.blocked_s,
            replicas_agree=self.cfg.mode == "sync",  # async and ssp replicas pull different versions
        )

    def finalize(self) -> None:
        # In async and ssp modes workers stop at different versions; once every worker has pushed
        # its last gradient, all pull the servers' final parameters, so model_final.pt is that model.
        dist.barrier()
        self.versions = self.client.pull(self.param_shards, self.clock).versions

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.cfg.mode,
            "servers": int(self.cfg.servers),
            "staleness_bound": int(self.cfg.staleness) if self.cfg.mode == "ssp" else None,
            "addresses": list(self.cfg.addresses),
            "overlap": self.overlap,
            "server_stats": describe_stats(self.client.stats()),
        }

    def close(self) -> None:
        if getattr(self, "overlap", False):
            self._pushes.shutdown(wait=True)
        if hasattr(self, "client"):
            self.client.close()
