"""One parameter-server shard: a flat range of the parameters and the optimizer that updates it.

Modes (``--mode``):
- ``sync`` (BSP): pushes for a step are staged until all workers have pushed; then their mean is
  applied in one optimizer step and the waiting pulls are released. This is all-reduce training.
  The step runs block by block (a few of the pull's chunks each) on a thread of its own, and a
  pull sends each chunk as soon as it is updated, so the update overlaps the pulls instead of
  delaying them.
- ``async`` (ASP): each push is applied on arrival, scaled by 1/workers so that a round of pushes
  moves the parameters as far as one synchronous step.
- ``ssp``: applied on arrival as in async, but a worker's pull blocks while its clock (pushes made)
  is more than ``--staleness`` ahead of the slowest worker's.

With ``--sums-only`` (BytePS's summation service, sync mode) the shard runs no optimizer: it holds
the mean of a step's pushes, which the pulls stream back, and the workers step their own
optimizers with it. Pushes are folded in partition by partition as they arrive, and a pull may be
open while its worker still pushes: each partition streams back as soon as every worker has pushed
it, so pushes and pulls share the link's two directions (BytePS's pipelining). A summation-only
push is therefore not staged whole before it counts: one refused mid-stream fails the step for
every worker, with its reason.

The staleness of an applied update is the number of versions applied between the version the
gradient was computed on and its own application. Every message is validated before it touches
state; a bad one is refused with INVALID_ARGUMENT (or FAILED_PRECONDITION) and the shard goes on
serving. Calls without the run's token are refused with UNAUTHENTICATED.

Run one shard:  TESTBED_PS_TOKEN=... python -m testbed.ps.server --shard 0 --workers 4 --mode sync
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from omegaconf import OmegaConf

from testbed.compress import build_codec
from testbed.compress.codec import PayloadCodec
from testbed.eval.schedule import LrSchedule
from testbed.optim import SgdConfig, build_optimizer
from testbed.ps import parameter_server_pb2 as pb
from testbed.ps import parameter_server_pb2_grpc as pb_grpc
from testbed.ps.modes import CHUNK_KB, MODES, STALENESS
from testbed.ps.wire import (
    CHANNEL_OPTIONS,
    FROM_WIRE,
    SERVICE,
    TO_WIRE,
    TOKEN_HEADER,
    Chunk,
    byte_view,
    chunk_ranges,
    copy_in,
    decode_chunk,
    encoded_chunks,
    keep_freed_memory,
    passthrough,
    token_from_env,
)

log = logging.getLogger("testbed.ps.server")
# An optimizer per block of partitions of this size: small enough that a pull's first chunks wait
# little for the update, large enough that the optimizer's per-call cost stays small.
UPDATE_BYTES = 8 << 20
# The longest a streamed request (InitParams, Push) may take, whatever the client's deadline.
STREAM_TIMEOUT_S = 600.0
NOTHING: Iterator[Any] = iter(())


class Refused(Exception):
    """A request that must not change any state; carries the status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class Shard:
    """The state of one shard and its update rules; all methods are safe to call from many threads."""

    def __init__(self, shard: int, workers: int, mode: str, staleness: int, optim_cfg: Any, chunk_bytes: int,
                 compress: Any = None, seed: int = 0, sums_only: bool = False) -> None:
        """``compress``: the workers' codec config (testbed.compress), whose payloads the pushes
        carry; ``seed``: the run's, for the draws a codec shares with its workers; ``sums_only``:
        hold the mean gradient for the pulls instead of updating parameters (sync mode)."""
        if sums_only and mode != "sync":
            raise ValueError(f"a summation-only shard runs in sync mode, not {mode}")
        self.shard, self.workers, self.mode, self.staleness = shard, workers, mode, staleness
        self.sums_only = sums_only
        self.delivered = [0] * workers  # summation-only: partitions each worker has pushed this step
        self.summed = 0  # summation-only: partitions of the step in progress summed
        self.optim_cfg, self.chunk_bytes = optim_cfg, chunk_bytes
        # The workers' learning-rate schedule (testbed.eval.schedule), resolved by the launcher into
        # the optim config; without one (a server started by hand from an older config), optim.lr.
        self.schedule = LrSchedule.of_optim(optim_cfg)
        self.compress, self.seed = compress, seed
        self.codecs: list[PayloadCodec] | None = None  # one per worker, built with the parameters
        # compress.pull: the encoded update since what each worker holds (sync: one for all, made
        # once per version), with the held copy the server keeps in step with the worker's.
        self.pull_codecs: list[PayloadCodec] | None = None
        self.held: torch.Tensor | None = None
        self.holding = [False] * workers  # has had its full pull
        self.pull_cache: tuple[int, torch.Tensor] | None = None
        self.cond = threading.Condition()
        self.params: torch.nn.Parameter | None = None
        self.initialising = False  # an InitParams stream is being received
        self.version = 0
        self.clocks = [0] * workers
        self.pending: set[int] = set()  # sync: workers whose push for the current step is staged
        # Each worker's staged push, one tensor per partition: views of the received chunks.
        self.staged: list[list[torch.Tensor]] = [[] for _ in range(workers)]
        self.pushing: set[int] = set()  # workers with a push stream in progress
        self.histogram: Counter[int] = Counter()
        self.stats = Counter()  # bytes_in, bytes_out, pushes, pulls, rejected
        self.apply_seconds = 0.0
        # The shard in partitions of chunk_bytes (the pull's chunks), and consecutive partitions in
        # blocks of about UPDATE_BYTES, each with an optimizer of its own: both optimizers are
        # elementwise, so stepping the blocks is stepping the whole.
        self.parts: list[tuple[int, int]] = []
        self.blocks: list[range] = []  # partition indices of each block
        self.optimizers: list[torch.optim.Optimizer] = []
        self.applied = 0  # sync: partitions updated to the current version (all of them when idle)
        self.apply_error = ""
        # Write the state after every `checkpoint_every`-th step of the workers' to
        # <checkpoint_dir>/step<step>/ps<shard>.pt, beside the workers' checkpoint of that step
        # (see _agreed_step).
        self.checkpoint_dir: Path | None = None
        self.checkpoint_every = 0

    # --- initialisation -----------------------------------------------------------------------

    def warm_up(self) -> None:
        """Build and step a throwaway optimizer, before serving: the first one a process builds
        imports torch._dynamo (2 s here when idle, over 10 s on a loaded machine), which would
        otherwise fall inside the first InitParams and its client's deadline."""
        if not self.sums_only:
            param = torch.nn.Parameter(torch.zeros(1))
            param.grad = torch.zeros(1)
            build_optimizer(self.optim_cfg, [param]).step()

    def init_params(self, stream: Iterator[Chunk]) -> pb.ShardInfo:
        """The shard's size and first values, streamed outside the lock: a stream that stalls holds
        up nobody (other calls go on, a second InitParams is refused meanwhile)."""
        first = next(stream, None)
        if first is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "InitParams: empty stream")
        with self.cond:
            if self.params is not None:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard} is already initialised")
            if self.initialising:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard} is being initialised")
            if first.dtype not in FROM_WIRE or first.step == 0:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "InitParams: need a dtype and the shard size in step")
            numel, dtype = int(first.step), FROM_WIRE[first.dtype]
            try:  # the size is the client's word: one that cannot be held is a bad request, not a crash
                values = torch.empty(numel, dtype=dtype)
            except (RuntimeError, MemoryError):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"InitParams: cannot hold {numel} elements of {dtype}") from None
            self.initialising = True
        try:
            self._receive("InitParams", first, stream, numel, dtype, worker_bound=1, same=("step",),
                          changed="every chunk must carry the same size",
                          take=lambda chunk: copy_in(values, chunk.offset, chunk.data))
            with self.cond:
                self._hold(values)
                self.stats["bytes_in"] += numel * values.element_size()
        finally:
            with self.cond:
                self.initialising = False
        return self.info()

    def _receive(self, rpc: str, first: Chunk, rest: Iterator[Chunk], numel: int, dtype: torch.dtype, worker_bound: int,
                 same: tuple[str, ...], changed: str, take: Callable[[Chunk], None]) -> None:
        """Validate the chunk stream ``first, *rest`` and hand each chunk to ``take``: chunks of
        ``dtype`` in order without gaps that cover ``numel`` elements exactly, from workers below
        ``worker_bound``, each with the fields ``same`` of the first chunk (else refused as
        "<rpc>: <changed>"). A refusal may come after ``take`` saw earlier chunks."""
        expected = 0
        for chunk in _chain(first, rest):
            self._check_chunk(chunk, expected, numel, dtype, worker_bound)
            if any(getattr(chunk, field) != getattr(first, field) for field in same):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{rpc}: {changed}")
            take(chunk)
            expected += chunk.length
        if expected != numel:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{rpc}: got {expected} of {numel} elements")

    def _hold(self, values: torch.Tensor) -> None:
        """Preallocate, once: the parameters, an optimizer per block, the mean gradient (n > 1;
        a lone worker's push is its own gradient, read where it was received) and (async/ssp) each
        worker's pull snapshot; (sync) start the update thread. A summation-only shard's values
        are the mean gradient itself, and it has no optimizers."""
        numel, dtype = values.numel(), values.dtype
        self.params = torch.nn.Parameter(values)
        self.grad = self.params.detach() if self.sums_only else torch.zeros_like(values) if self.workers > 1 else None
        self.parts = [(lo, lo + n) for lo, n in chunk_ranges(numel, values.element_size(), self.chunk_bytes)]
        # Views: each partition's updates land in params.
        self.part_params = [torch.nn.Parameter(self.params.detach()[lo:hi]) for lo, hi in self.parts]
        per_block = max(1, UPDATE_BYTES // self.chunk_bytes)
        self.blocks = [range(i, min(i + per_block, len(self.parts))) for i in range(0, len(self.parts), per_block)]
        self.optimizers = [] if self.sums_only else [
            build_optimizer(self.optim_cfg, [self.part_params[i] for i in block]) for block in self.blocks]
        self.applied = len(self.parts)
        self.snapshots = torch.zeros(self.workers, numel, dtype=dtype) if self.mode != "sync" else None
        if self.compress is not None and self.compress.name != "none":
            codecs = [build_codec(self.compress, values, [values.shape], self.shard, w, self.seed) for w in range(self.workers)]
            if not all(isinstance(c, PayloadCodec) for c in codecs):
                raise SystemExit(f"compress={self.compress.name}: a parameter server decodes payloads; this codec has none")
            self.codecs = codecs  # type: ignore[assignment]
            if self.compress.get("pull"):
                slots = 1 if self.mode == "sync" else self.workers
                # The held copy moves only by what a pull carried, so parameters - held already keeps
                # what is not sent yet: a residual on top would send it twice (and diverge).
                plain = OmegaConf.merge(self.compress, {"error_feedback": False})
                self.pull_codecs = [build_codec(plain, values, [values.shape], self.shard, -1 - w, self.seed)
                                    for w in range(slots)]  # type: ignore[misc]
                self.held = torch.zeros(slots, numel, dtype=dtype)
        if self.mode == "sync" and not self.sums_only:
            threading.Thread(target=self._update_loop, name=f"ps{self.shard}-update", daemon=True).start()

    # --- checkpoints -----------------------------------------------------------------------------

    def restore(self, path: Path) -> None:
        """Continue from a checkpoint written by this shard's predecessor (see checkpoint_every)."""
        state = torch.load(path, weights_only=False)
        mode = state.get("mode", "sync")
        if (state["shard"], state["workers"], mode) != (self.shard, self.workers, self.mode):
            raise SystemExit(f"{path}: a checkpoint of shard {state['shard']} with {state['workers']} workers in mode "
                             f"{mode}; this is shard {self.shard} with {self.workers}, mode {self.mode}")
        with self.cond:
            self._hold(state["params"])
            if len(state.get("optimizers", ())) != len(self.optimizers):
                raise SystemExit(f"{path}: optimizer state for {len(state.get('optimizers', ()))} blocks, "
                                 f"this shard has {len(self.optimizers)} (same --chunk-kb as the run that wrote it)")
            for optimizer, saved in zip(self.optimizers, state["optimizers"]):
                optimizer.load_state_dict(saved)
            self.version, self.clocks = state["version"], list(state["clocks"])
            self.histogram = Counter(state["histogram"])
            self.stats = Counter(state.get("stats", {}))

    def _agreed_step(self) -> int | None:
        """(Under the lock) the workers' step to checkpoint now, if this is such a point: every
        worker has pushed the same number c of steps, a multiple of checkpoint_every, and it is all
        applied. Workers meet at a barrier after such a step (testbed.checkpoint.save), so no push
        of a later step can have arrived: the state saved is the state at that step exactly, in
        async and SSP modes too, whatever the interleaving that led there."""
        c = self.clocks[0]
        if not self.checkpoint_every or c == 0 or c % self.checkpoint_every or any(k != c for k in self.clocks):
            return None
        return c - 1 if self._updated() else None

    def _save(self, step: int) -> None:
        """The state after the workers' ``step``; the caller holds the lock."""
        assert self.params is not None and self.checkpoint_dir is not None
        target = self.checkpoint_dir / f"step{step:07d}"
        target.mkdir(parents=True, exist_ok=True)
        state = {"shard": self.shard, "workers": self.workers, "mode": self.mode, "params": self.params.detach().clone(),
                 "optimizers": [o.state_dict() for o in self.optimizers], "version": self.version,
                 "clocks": list(self.clocks), "histogram": dict(self.histogram), "stats": dict(self.stats)}
        tmp = target / f"ps{self.shard}.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, target / f"ps{self.shard}.pt")

    def register(self, worker: int) -> pb.ShardInfo:
        self._check_worker(worker)
        return self.info()

    def info(self) -> pb.ShardInfo:
        with self.cond:
            numel = 0 if self.params is None else self.params.numel()
            dtype = 0 if self.params is None else TO_WIRE[self.params.dtype]
            return pb.ShardInfo(shard=self.shard, workers=self.workers, numel=numel, dtype=dtype, mode=self.mode,
                                staleness=self.staleness, version=self.version)

    # --- push ---------------------------------------------------------------------------------

    def push(self, stream: Iterator[Chunk]) -> pb.PushReply:
        first = next(stream, None)
        if first is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "Push: empty stream")
        worker = first.worker
        with self.cond:
            self._require_params()
            self._check_worker(worker)
            if worker in self.pushing:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker} already has a push in progress")
            if self.mode == "sync" and worker in self.pending:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker} already pushed step {self.version}")
            if self.mode == "sync" and first.step != self.version:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"sync push for version {first.step}, but the shard is at version {self.version}")
            if first.step > self.version:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"push based on version {first.step} > {self.version}")
            # Staged pushes are read until the last partition is updated (only a client that pushes
            # before pulling the previous step can find the update still running).
            self.cond.wait_for(self._updated)
            self._check_updating()
            self.pushing.add(worker)
        if self.sums_only:
            return self._push_folded(worker, first, stream)
        try:
            received: list[Chunk] = []  # outside the lock; staged only once the whole stream is valid
            numel, dtype = self.params.numel(), self.params.dtype
            if self.codecs is not None:
                numel, dtype = self.codecs[worker].payload_numel(), self.codecs[worker].payload_dtype
            self._receive("Push", first, stream, numel, dtype, worker_bound=self.workers,
                          same=("worker", "step"), changed="worker and step must not change mid-stream",
                          take=received.append)
            staged = self._partitioned(received) if self.codecs is None else self._decoded(worker, received)
            return self._commit(worker, int(first.step), staged)
        finally:
            with self.cond:
                self.pushing.discard(worker)

    def _push_folded(self, worker: int, first: Chunk, stream: Iterator[Chunk]) -> pb.PushReply:
        """(Summation-only) a push folded in chunk by chunk: one chunk per partition."""
        assert self.params is not None
        with self.cond:
            self.pending.add(worker)
        try:
            self._receive("Push", first, stream, self.params.numel(), self.params.dtype, worker_bound=self.workers,
                          same=("worker", "step"), changed="worker and step must not change mid-stream",
                          take=lambda chunk: self._fold(worker, chunk))
        except Refused as refused:  # partitions of it may be summed already: the step cannot complete
            with self.cond:
                self.apply_error = f"a push of worker {worker} was refused mid-stream ({refused})"
                self.cond.notify_all()
            raise
        finally:
            with self.cond:
                self.pushing.discard(worker)
        with self.cond:
            self.clocks[worker] += 1
            self.stats["pushes"] += 1
            self.stats["bytes_in"] += self.params.numel() * self.params.element_size()
            self.histogram[0] += 1
            return pb.PushReply(version=self.version, staleness=0)

    def _fold(self, worker: int, chunk: Chunk) -> None:
        """Stage one partition of ``worker``'s push; sum, in order, every partition all workers have
        now pushed, into the values that pulls stream; the last one completes the step."""
        assert self.params is not None
        part = self.delivered[worker]
        lo, hi = self.parts[part]
        if chunk.length != hi - lo:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"Push: a chunk of {chunk.length} elements for partition "
                          f"{part} of {hi - lo}: a summation-only shard takes pushes in its partitions (its --chunk-kb)")
        with self.cond:
            self.staged[worker].append(torch.frombuffer(chunk.data, dtype=self.params.dtype))
            self.delivered[worker] += 1
            start = time.perf_counter()
            everyone = range(self.workers)
            for ready in range(self.summed, min(self.delivered)):
                self._gradient(ready, everyone)  # lands in the values
            self.summed = max(self.summed, min(self.delivered))
            self.apply_seconds += time.perf_counter() - start
            if self.summed == len(self.parts):
                self.version += 1
                self.summed, self.delivered = 0, [0] * self.workers
                self.staged = [[] for _ in everyone]
                self.pending.clear()
            self.cond.notify_all()

    def _summed(self, clock: int, part: int) -> bool:
        """(Summation-only) partition ``part`` holds step ``clock``'s sum."""
        return self.version >= clock or (self.version == clock - 1 and self.summed > part)

    def _as_summed(self, messages: Iterator[Any], clock: int) -> Iterator[Any]:
        """(Summation-only) the pull's messages, each once its partition holds step ``clock``'s sum."""
        for part in range(len(self.parts)):
            with self.cond:
                self.cond.wait_for(lambda part=part: self._summed(clock, part) or bool(self.apply_error))
                self._check_updating()
            yield next(messages)

    def _partitioned(self, received: list[Chunk]) -> list[torch.Tensor]:
        """A valid push as one tensor per partition: zero-copy views of the received messages when
        the client chunks as the servers do (the same chunk_kb), else views of one copy of them."""
        assert self.params is not None
        dtype = self.params.dtype
        if [chunk.length for chunk in received] == [hi - lo for lo, hi in self.parts]:
            return [torch.frombuffer(chunk.data, dtype=dtype) for chunk in received]
        flat = torch.empty(self.params.numel(), dtype=dtype)
        for chunk in received:
            copy_in(flat, chunk.offset, chunk.data)
        return [flat[lo:hi] for lo, hi in self.parts]

    def _decoded(self, worker: int, received: list[Chunk]) -> list[torch.Tensor]:
        """A compressed push decoded into a gradient of its own, as one view per partition. The
        worker's clock is its pushes so far: the step its codec encoded at (random-k's draws)."""
        assert self.params is not None and self.codecs is not None
        codec = self.codecs[worker]
        payload = torch.empty(codec.payload_numel(), dtype=codec.payload_dtype)
        for chunk in received:
            copy_in(payload, chunk.offset, chunk.data)
        codec.expect(self.clocks[worker])  # the worker's own pushes move its clock: stable here
        dense = torch.empty_like(self.params.detach())
        codec.decode(payload, dense)
        return [dense[lo:hi] for lo, hi in self.parts]

    def _gradient(self, part: int, workers: range | list[int]) -> torch.Tensor:
        """One partition's gradient from the pushes of ``workers`` (all of them in sync mode, the one
        that pushed in async/ssp), read where they were received: their mean over the shard's
        workers, added in worker order so that the result does not depend on arrival order."""
        pushed = [self.staged[w][part] for w in workers]
        if self.grad is None:  # a lone worker: its push is the gradient
            return pushed[0]
        lo, hi = self.parts[part]
        grad = self.grad[lo:hi]
        if len(pushed) == 1:
            return torch.div(pushed[0], self.workers, out=grad)
        grad.copy_(pushed[0])
        for more in pushed[1:]:
            grad.add_(more)
        return grad.div_(self.workers)

    def _step(self, block: int, workers: range | list[int], step: int) -> None:
        """Apply block ``block`` of the workers' step ``step`` (0-based: the pushing worker's clock
        before this push), at the learning rate the run's schedule gives that step."""
        for part in self.blocks[block]:
            grad = self._gradient(part, workers)  # a summation-only shard's lands in its values: done
            if self.optimizers:
                self.part_params[part].grad = grad
        if self.optimizers:
            optimizer = self.optimizers[block]
            for group in optimizer.param_groups:
                group["lr"] = self.schedule.lr_at(step)
            optimizer.step()

    def _commit(self, worker: int, base: int, received: list[torch.Tensor]) -> pb.PushReply:
        assert self.params is not None
        with self.cond:
            self.staged[worker] = received
            self.stats["pushes"] += 1
            self.stats["bytes_in"] += (self.codecs[worker].payload_bytes() if self.codecs is not None
                                       else self.params.numel() * self.params.element_size())
            self.clocks[worker] += 1
            if self.mode == "sync":
                self.pending.add(worker)
                if len(self.pending) == self.workers:  # the step is complete: hand it to the update thread
                    self.version += 1
                    self.applied = 0
                    self.pending.clear()
                staleness = 0
            else:
                staleness = self.version - base
                start = time.perf_counter()
                for block in range(len(self.blocks)):
                    self._step(block, [worker], self.clocks[worker] - 1)
                self.staged[worker] = []
                self.apply_seconds += time.perf_counter() - start
                self.version += 1
            self.histogram[staleness] += 1
            step = self._agreed_step() if self.mode != "sync" else None  # sync: once the update thread is done
            if step is not None:
                self._save(step)
            self.cond.notify_all()
            return pb.PushReply(version=self.version, staleness=staleness)

    def _update_loop(self) -> None:
        """sync: each completed step's update, block by block, outside the lock: nothing else
        touches a partition's parameters, gradient or staged pushes until it is done (pulls wait
        for it, pushes for the last one)."""
        everyone = range(self.workers)
        while True:
            with self.cond:
                self.cond.wait_for(lambda: not self._updated())
                step = self.version - 1  # the step every worker pushed
            start = time.perf_counter()
            try:
                for block in range(len(self.blocks)):
                    self._step(block, everyone, step)
                    with self.cond:
                        self.applied = self.blocks[block].stop
                        if self._updated():
                            self.staged = [[] for _ in everyone]  # the received messages can go
                            self.apply_seconds += time.perf_counter() - start
                            step = self._agreed_step()
                            if step is not None:
                                self._save(step)
                        self.cond.notify_all()
            except Exception as exc:  # every later push and pull is refused with it
                log.exception("shard %d: update of version %d failed", self.shard, self.version)
                with self.cond:
                    self.apply_error = f"{type(exc).__name__}: {exc}"
                    self.applied = len(self.parts)
                    self.cond.notify_all()
                return

    def _updated(self) -> bool:
        return self.applied == len(self.parts)

    def _check_updating(self) -> None:
        if self.apply_error:
            raise Refused(grpc.StatusCode.INTERNAL, f"shard {self.shard}: the update failed: {self.apply_error}")

    def _as_updated(self, messages: Iterator[Any]) -> Iterator[Any]:
        """sync: the pull's messages, one per partition (pull_messages chunks as the partitions are
        cut), each generated only once its partition is updated, so that none reads stale values."""
        for part in range(len(self.parts)):
            if self.applied <= part:
                with self.cond:
                    self.cond.wait_for(lambda part=part: self.applied > part)
            self._check_updating()
            message = next(messages, None)
            if message is None:
                raise Refused(grpc.StatusCode.INTERNAL, f"shard {self.shard}: pull has fewer messages than partitions")
            yield message
        if next(messages, None) is not None:
            raise Refused(grpc.StatusCode.INTERNAL, f"shard {self.shard}: pull has more messages than partitions")

    # --- pull ---------------------------------------------------------------------------------

    def pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        worker, clock = request.worker, request.clock
        with self.cond:
            params = self._require_params()
            self._check_worker(worker)
            if request.shard != self.shard:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"Pull: shard {request.shard}, this is shard {self.shard}")
            # A summation-only pull may be open while its worker's push of that step streams.
            if clock > self.clocks[worker] + self.sums_only:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"Pull: worker {worker} at clock {clock} has pushed only {self.clocks[worker]} times")
            start = time.perf_counter()
            remaining = context.time_remaining()
            if not self.cond.wait_for(lambda: self._may_pull(worker, clock) or bool(self.apply_error), timeout=remaining):
                raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"Pull: worker {worker} at clock {clock} still blocked; clocks {self.clocks}")
            self._check_updating()
            blocked = time.perf_counter() - start
            version = clock if self.sums_only else self.version
            self.stats["pulls"] += 1
            slowest = min(self.clocks)
            if self.pull_codecs is not None and self.holding[worker] and not request.full:
                payload = self._encoded_pull(worker, version)
                self.stats["bytes_out"] += payload.numel() * payload.element_size()
            else:
                payload = None
                if self.snapshots is not None:  # async/ssp: updates may land while this pull streams
                    source = self.snapshots[worker]
                    source.copy_(params.detach())
                else:  # sync: nothing changes until this worker pushes again
                    source = params.detach()
                self.stats["bytes_out"] += params.numel() * params.element_size()
                if self.pull_codecs is not None:  # the worker will hold these parameters
                    self._hold_full(worker)
        meta = (("blocked-seconds", f"{blocked:.9f}"), ("slowest-clock", str(slowest)))
        if payload is not None:
            context.send_initial_metadata((*meta, ("encoded", "1")))
            yield from encoded_chunks(payload, self.shard, 0, version, self.chunk_bytes, byte_view(payload))
            return
        context.send_initial_metadata(meta)
        messages = self.pull_messages(source, version)
        if self.sums_only:
            yield from self._as_summed(iter(messages), clock)
        else:
            yield from messages if self.snapshots is not None else self._as_updated(iter(messages))

    def _hold_full(self, worker: int) -> None:
        """(Under the lock, compressed pulls) ``worker`` is sent the whole parameters: what it holds.
        In sync mode every worker holds the same, updated or not, so the update is waited for."""
        assert self.held is not None and self.params is not None
        if self.mode == "sync":
            self.cond.wait_for(self._updated)
            self._check_updating()
        self.held[0 if self.mode == "sync" else worker].copy_(self.params.detach())
        self.holding[worker] = True

    def _encoded_pull(self, worker: int, version: int) -> torch.Tensor:
        """(Under the lock) the update since what ``worker`` holds, encoded, with the held copy
        moved by what the payload carries (error feedback keeps the rest for the next pull). Sync
        mode waits for the whole update and encodes once per version for every worker."""
        assert self.held is not None and self.params is not None and self.pull_codecs is not None
        slot = 0
        if self.mode == "sync":
            self.cond.wait_for(self._updated)
            self._check_updating()
            if self.pull_cache is not None and self.pull_cache[0] == version:
                return self.pull_cache[1]
        else:
            slot = worker
        codec, held = self.pull_codecs[slot], self.held[slot]
        codec.steps = version  # the step its draws are taken at; the worker's decoder takes it from the chunks
        payload = codec.compress(self.params.detach() - held).clone()  # its buffer is reused by the next encode
        decoded = torch.empty_like(held)
        codec.decode(payload, decoded)
        held.add_(decoded)
        if self.mode == "sync":
            self.pull_cache = (version, payload)
        return payload

    def pull_messages(self, source: torch.Tensor, version: int) -> Iterator[Any]:
        """A pull's TensorChunk messages, which add_servicer's ``encode`` turns into bytes: here
        already encoded (testbed.ps.wire); testbed.bench.wire overrides it to compare codecs."""
        return encoded_chunks(source, self.shard, 0, version, self.chunk_bytes, byte_view(source))

    def _may_pull(self, worker: int, clock: int) -> bool:
        if self.sums_only:  # held back until the first partition is summed: the slowest worker's push
            return self._summed(clock, 0)
        if self.mode == "sync":
            return self.version >= clock
        if self.mode == "ssp":
            return clock - min(self.clocks) <= self.staleness
        return True

    # --- clocks, stats --------------------------------------------------------------------------

    def clock(self, request: pb.ClockRequest) -> pb.ClockReply:
        with self.cond:
            self._check_worker(request.worker)
            if request.advance:
                if self.mode == "sync":
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "sync mode advances clocks only by pushing")
                self.clocks[request.worker] += 1
                step = self._agreed_step()
                if step is not None:
                    self._save(step)
                self.cond.notify_all()
            return pb.ClockReply(clocks=self.clocks, version=self.version)

    def stats_reply(self) -> pb.StatsReply:
        with self.cond:
            top = max(self.histogram, default=-1)
            return pb.StatsReply(
                version=self.version, clocks=self.clocks,
                staleness_histogram=[self.histogram.get(s, 0) for s in range(top + 1)],
                bytes_in=self.stats["bytes_in"], bytes_out=self.stats["bytes_out"], pushes=self.stats["pushes"],
                pulls=self.stats["pulls"], rejected=self.stats["rejected"], apply_seconds=self.apply_seconds,
            )

    # --- validation -----------------------------------------------------------------------------

    def _require_params(self) -> torch.nn.Parameter:
        if self.params is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard} has no parameters yet (InitParams)")
        return self.params

    def _check_worker(self, worker: int) -> None:
        if worker >= self.workers:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"worker {worker} out of range [0, {self.workers})")

    def _check_chunk(self, chunk: Chunk, expected: int, numel: int, dtype: torch.dtype, worker_bound: int) -> None:
        problem = None
        if chunk.malformed:
            problem = chunk.malformed
        elif chunk.shard != self.shard:
            problem = f"shard {chunk.shard}, this is shard {self.shard}"
        elif chunk.worker >= worker_bound:
            problem = f"worker {chunk.worker} out of range [0, {worker_bound})"
        elif FROM_WIRE.get(chunk.dtype) != dtype:
            problem = f"dtype {pb.DType.Name(chunk.dtype) if chunk.dtype in pb.DType.values() else chunk.dtype}, shard holds {dtype}"
        elif chunk.offset != expected:
            problem = f"offset {chunk.offset}, expected {expected} (chunks in order, no gaps)"
        elif chunk.length == 0 or chunk.offset + chunk.length > numel:
            problem = f"range [{chunk.offset}, {chunk.offset + chunk.length}) outside [0, {numel})"
        elif len(chunk.data) != chunk.length * torch.empty(0, dtype=dtype).element_size():
            problem = f"{len(chunk.data)} data bytes for {chunk.length} elements of {dtype}"
        if problem:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"chunk refused: {problem}")


def _chain(first: Chunk, rest: Iterator[Chunk]) -> Iterator[Chunk]:
    yield first
    yield from rest


class Servicer(pb_grpc.ParameterServerServicer):
    """gRPC handlers: translate Refused into status codes, count refusals, and cancel a streamed
    request that outlasts ``stream_timeout_s`` (or the client's own deadline, when sooner), so that
    a client that stops sending mid-stream holds nothing past it."""

    def __init__(self, shard: Shard, stop: Callable[[], None], stream_timeout_s: float = STREAM_TIMEOUT_S) -> None:
        self.shard, self._stop, self.stream_timeout_s = shard, stop, stream_timeout_s

    def _guard(self, context: grpc.ServicerContext, call: Callable[[], Any], rest: Iterator[Any] = NOTHING) -> Any:
        """``call``, its refusal answered with its status; ``rest``: a streamed request's messages not
        read yet, drained first, because gRPC Python's client reports an answer that comes before it
        finished sending as CANCELLED, not as the status (grpc/grpc#29615)."""
        try:
            return call()
        except Refused as refused:
            with self.shard.cond:
                self.shard.stats["rejected"] += 1
            try:
                for _ in rest:  # bounded by the stream's deadline (_bounded), which ends the iteration
                    pass
            except grpc.RpcError:
                pass
            context.abort(refused.code, str(refused))

    def Register(self, request, context):  # noqa: N802 (gRPC method names)
        return self._guard(context, lambda: self.shard.register(_parsed(request).worker))

    def _bounded(self, context: grpc.ServicerContext, requests: Iterator[Any], call: Callable[[Iterator[Any]], Any]) -> Any:
        timer = threading.Timer(self.stream_timeout_s, context.cancel)  # the stream's next chunk then raises
        timer.daemon = True
        timer.start()

        def stream() -> Iterator[Any]:
            # The deadline bounds the receiving only: a call cancelled after its stream was taken
            # in would tell the client CANCELLED while the shard applies it.
            yield from requests
            timer.cancel()

        requests_until_end = stream()
        try:
            return self._guard(context, lambda: call(requests_until_end), rest=requests_until_end)
        finally:
            timer.cancel()

    def InitParams(self, request_iterator, context):  # noqa: N802
        return self._bounded(context, request_iterator, self.shard.init_params)

    def Push(self, request_iterator, context):  # noqa: N802
        return self._bounded(context, request_iterator, self.shard.push)

    def Pull(self, request, context):  # noqa: N802
        try:
            yield from self.shard.pull(_parsed(request), context)
        except Refused as refused:
            with self.shard.cond:
                self.shard.stats["rejected"] += 1
            context.abort(refused.code, str(refused))

    def Clock(self, request, context):  # noqa: N802
        return self._guard(context, lambda: self.shard.clock(_parsed(request)))

    def Stats(self, request, context):  # noqa: N802
        self._guard(context, lambda: _parsed(request))
        return self.shard.stats_reply()

    def Shutdown(self, request, context):  # noqa: N802
        self._guard(context, lambda: _parsed(request))
        threading.Thread(target=self._stop, daemon=True).start()  # reply first, then stop
        return pb.ShutdownReply()


class _Undecodable:
    """A unary request whose bytes did not parse: refused by the service, counted like any other."""


def _lenient(message: Any) -> Callable[[bytes], Any]:
    """A request parser that never raises: gRPC would answer a parse error INTERNAL, uncounted."""

    def parse(raw: bytes) -> Any:
        try:
            return message.FromString(raw)
        except DecodeError:
            return _Undecodable()

    return parse


def _parsed(request: Any) -> Any:
    if isinstance(request, _Undecodable):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "request bytes do not parse")
    return request


def add_servicer(
    servicer: Servicer, server: grpc.Server, decode: Callable[[bytes], Chunk] = decode_chunk,
    encode: Callable[[Any], bytes] = passthrough,
) -> None:
    """Register the service with the fast TensorChunk path: chunks in are decoded without copying
    their payload, chunks out are encoded with one copy (testbed.ps.wire). ``decode`` (which must
    not raise: it marks a bad message ``malformed``) and ``encode`` (of Shard.pull_messages) are
    there for the codec benchmark, testbed.bench.wire."""
    std = grpc.unary_unary_rpc_method_handler
    handlers = {
        "Register": std(servicer.Register, _lenient(pb.RegisterRequest), pb.ShardInfo.SerializeToString),
        "InitParams": grpc.stream_unary_rpc_method_handler(servicer.InitParams, decode, pb.ShardInfo.SerializeToString),
        "Push": grpc.stream_unary_rpc_method_handler(servicer.Push, decode, pb.PushReply.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, _lenient(pb.PullRequest), encode),
        "Clock": std(servicer.Clock, _lenient(pb.ClockRequest), pb.ClockReply.SerializeToString),
        "Stats": std(servicer.Stats, _lenient(pb.StatsRequest), pb.StatsReply.SerializeToString),
        "Shutdown": std(servicer.Shutdown, _lenient(pb.ShutdownRequest), pb.ShutdownReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call that lacks ``authorization: Bearer <token>``, except health checks."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        offered = dict(details.invocation_metadata).get(TOKEN_HEADER, "")
        if hmac.compare_digest(str(offered).encode(), self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        kind = (handler.request_streaming, handler.response_streaming)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[kind]
        return make(deny)


def serve(args: argparse.Namespace) -> None:
    token = token_from_env()
    optim_cfg = OmegaConf.create(json.loads(args.optim))
    compress = OmegaConf.create(json.loads(args.compress)) if args.compress else None
    shard = Shard(args.shard, args.workers, args.mode, args.staleness, optim_cfg, args.chunk_kb * 1024, compress, args.seed,
                  args.sums_only)
    if args.checkpoint_dir:
        shard.checkpoint_dir, shard.checkpoint_every = Path(args.checkpoint_dir), args.checkpoint_every
    if args.restore:
        shard.restore(Path(args.restore))
    shard.warm_up()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2 * args.workers + 4, thread_name_prefix=f"ps{args.shard}"),
        interceptors=[TokenInterceptor(token)],
        options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
    )
    health_servicer = health.HealthServicer()
    stopped = threading.Event()

    def stop() -> None:
        health_servicer.enter_graceful_shutdown()
        server.stop(grace=2.0).wait()
        stopped.set()

    add_servicer(Servicer(shard, stop, args.stream_timeout_s), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if args.tls_cert:  # the certificate the workers verify against their certificate authority
        key, cert = Path(args.tls_key).read_bytes(), Path(args.tls_cert).read_bytes()
        port = server.add_secure_port(f"{args.host}:{args.port}", grpc.ssl_server_credentials([(key, cert)]))
    else:
        port = server.add_insecure_port(f"{args.host}:{args.port}")
    if port == 0:
        raise SystemExit(f"ps shard {args.shard}: cannot bind {args.host}:{args.port}")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("shard %d pid %d serving on %s:%d (%s, %d workers)", args.shard, os.getpid(), args.host, port, args.mode, args.workers)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: threading.Thread(target=stop, daemon=True).start())
    stopped.wait()
    log.info("shard %d stopped: %s", args.shard, " ".join(str(shard.stats_reply()).split()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m testbed.ps.server", description=__doc__.splitlines()[0])
    parser.add_argument("--shard", type=int, required=True, help="this server's shard index")
    parser.add_argument("--workers", type=int, required=True, help="number of workers that will push")
    parser.add_argument("--mode", choices=MODES, default="sync")
    parser.add_argument("--staleness", type=int, default=STALENESS, help="ssp bound s")
    parser.add_argument("--optim", default=json.dumps(asdict(SgdConfig())), help="the trainer's optim config as JSON, with its resolved lr_schedule (testbed.eval.schedule)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless set)")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--port-file", default="", help="write the bound port here once serving")
    parser.add_argument("--chunk-kb", type=int, default=CHUNK_KB, help="pull chunk size")
    parser.add_argument("--compress", default="", help="the workers' codec config as JSON (testbed.compress); pushes carry its payloads")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed (draws a codec shares with the workers)")
    parser.add_argument("--stream-timeout-s", type=float, default=STREAM_TIMEOUT_S,
                        help="cancel an InitParams or Push stream that takes longer (a client that stalled mid-stream)")
    parser.add_argument("--sums-only", action="store_true",
                        help="sync mode: serve the mean of each step's pushes, with no optimizer (BytePS's summation service)")
    parser.add_argument("--tls-cert", default="", help="serve TLS with this PEM certificate (and --tls-key)")
    parser.add_argument("--tls-key", default="", help="the certificate's PEM private key")
    parser.add_argument("--checkpoint-dir", default="", help="save the state here after every --checkpoint-every steps of the workers")
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--restore", default="", help="start from this checkpoint file")
    args = parser.parse_args(argv)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.sums_only and args.mode != "sync":
        parser.error("--sums-only runs in --mode sync")
    if args.workers < 1 or args.shard < 0 or args.staleness < 0:
        parser.error("--workers must be >= 1, --shard and --staleness >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[ps] %(asctime)s %(message)s", stream=sys.stdout, force=True)
    torch.set_num_threads(1)
    keep_freed_memory()
    serve(parse_args(argv))


if __name__ == "__main__":
    main()
