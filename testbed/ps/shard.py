"""One parameter-server shard's state: a flat range of the parameters, the optimizer that updates it,
the workers' clocks and pushes, and the handling of requests that every mode shares. What the
modes do differently is their policy's (testbed.ps.policies): the shard never asks its mode.

The staleness of an applied update is the number of versions applied between the version the
gradient was computed on and its own application. Every message is validated before it touches
state (testbed.ps.validation); a bad one is refused and the shard goes on serving.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from testbed.compress import CODECS, build_codec
from testbed.compress.codec import PayloadCodec
from testbed.eval.schedule import LrSchedule
from testbed.optim import build_optimizer
from testbed.ps import parameter_server_pb2 as pb
from testbed.ps.held_copies import HeldCopies
from testbed.ps.policies import policy_for
from testbed.ps.validation import Refused, check_worker, epoch_of, membership_changed, receive
from testbed.ps.wire import FROM_WIRE, TO_WIRE, Chunk, StepNorms, byte_view, chunk_ranges, copy_in, encoded_chunks

# An optimizer per block of partitions of this size: small enough that a pull's first chunks wait
# little for the update, large enough that the optimizer's per-call cost stays small.
UPDATE_BYTES = 8 << 20


class Shard:
    """The state of one shard; all methods are safe to call from many threads."""

    def __init__(self, shard: int, workers: int, mode: str, staleness: int, optim_cfg: Any, chunk_bytes: int,
                 compress: Any = None, seed: int = 0, sums_only: bool = False, backup_workers: int = 0) -> None:
        """``mode``: one of testbed.ps.modes.MODES; ``compress``: the workers' codec config
        (testbed.compress), whose payloads the pushes carry; ``seed``: the run's, for the draws a
        codec shares with its workers; ``sums_only``: hold the mean gradient for the pulls instead
        of updating parameters (sync mode); ``backup_workers``: pushes a sync step goes without."""
        if not 0 <= backup_workers < workers:
            raise ValueError(f"backup workers {backup_workers}: must be in [0, {workers}) of {workers} workers")
        self.shard, self.workers, self.mode, self.staleness = shard, workers, mode, staleness
        self.backup_workers = backup_workers
        self.policy = policy_for(mode, sums_only, backup_workers)(self)
        self.optim_cfg, self.chunk_bytes = optim_cfg, chunk_bytes
        # The workers' learning-rate schedule (testbed.eval.schedule), resolved by the launcher into
        # the optim config; without one (a server started by hand from an older config), optim.lr.
        self.schedule = LrSchedule.of_optim(optim_cfg)
        self.compress, self.seed = compress, seed
        self.codecs: list[PayloadCodec] | None = None  # one per worker, built with the parameters
        self.held: HeldCopies | None = None  # compress.pull: the copies the workers hold
        self.cond = threading.Condition()
        self.params: torch.nn.Parameter | None = None
        self.grad: torch.Tensor | None = None
        self.initialising = False  # an InitParams stream is being received
        self.version = 0
        self.clocks = [0] * workers
        self.pending: set[int] = set()  # sync: workers whose push for the current step is staged
        # Each worker's staged push, one tensor per partition: views of the received chunks.
        self.staged: list[list[torch.Tensor]] = [[] for _ in range(workers)]
        self.pushing: set[int] = set()  # workers with a push stream in progress
        # elastic.enabled (testbed.elastic): the workers still in the run, and their membership epoch.
        self.members, self.epoch = set(range(workers)), 0
        # stats.noise_scale: each worker's own squared gradient norm, as its latest push carried it, and
        # what sync updates measured (by the version they made), for the pulls' trailers.
        self.local_sq: list[float | None] = [None] * workers
        self.norms: dict[int, StepNorms] = {}
        self.reading: Counter[int] = Counter()  # pulls streaming, by the version they stream
        self.histogram: Counter[int] = Counter()
        self.stats = Counter()  # bytes_in, bytes_out, pushes, pulls, rejected
        self.apply_seconds = 0.0
        # The shard in partitions of chunk_bytes (the pull's chunks), and consecutive partitions in
        # blocks of about UPDATE_BYTES, each with an optimizer of its own: both optimizers are
        # elementwise, so stepping the blocks is stepping the whole.
        self.parts: list[tuple[int, int]] = []
        self.part_params: list[torch.nn.Parameter] = []
        self.blocks: list[range] = []  # partition indices of each block
        self.optimizers: list[torch.optim.Optimizer] = []
        self.applied = 0  # partitions updated to the current version (all of them when idle)
        self.refusal = ""  # why every later push and pull is refused: a failed update, or stopping
        # Checkpoints after every `checkpoint_every`-th step of the workers' (testbed.ps.shard_checkpoint).
        self.checkpoint_dir: Path | None = None
        self.checkpoint_every = 0

    # --- initialisation -----------------------------------------------------------------------

    def warm_up(self) -> None:
        """Build and step a throwaway optimizer, before serving: the first one a process builds
        imports torch._dynamo (2 s here when idle, over 10 s on a loaded machine), which would
        otherwise fall inside the first InitParams and its client's deadline."""
        if self.policy.optimizes:
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
            if not dtype.is_floating_point:
                floats = ", ".join(pb.DType.Name(w) for t, w in TO_WIRE.items() if t.is_floating_point)
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"InitParams: dtype {pb.DType.Name(first.dtype)}; parameters are one of {floats}")
            try:  # the size is the client's word: one that cannot be held is a bad request, not a crash
                values = torch.empty(numel, dtype=dtype)
            except (RuntimeError, MemoryError):
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"InitParams: cannot hold {numel} elements of {dtype}") from None
            self.initialising = True
        try:
            receive("InitParams", self.shard, first, stream, numel, dtype, worker_bound=1, same=("step",),
                    changed="every chunk must carry the same size",
                    take=lambda chunk: copy_in(values, chunk.offset, chunk.data))
            with self.cond:
                self.hold(values)
                self.stats["bytes_in"] += numel * values.element_size()
        finally:
            with self.cond:
                self.initialising = False
        return self.info()

    def hold(self, values: torch.Tensor) -> None:
        """(Under the lock) take ``values`` as the parameters and preallocate, once: an optimizer
        per block, the mean gradient (n > 1; a lone worker's push is its own gradient, read where it
        was received; without an optimizer the values are the mean gradient itself), the codecs,
        and what the policy holds. All is made before any of it is set: a refusal (or failure)
        leaves the shard uninitialised, for a corrected request to initialise."""
        codecs, held = self._codecs(values)
        params = torch.nn.Parameter(values)
        optimizes = self.policy.optimizes
        grad = params.detach() if not optimizes else torch.zeros_like(values) if self.workers > 1 else None
        parts = [(lo, lo + n) for lo, n in chunk_ranges(values.numel(), values.element_size(), self.chunk_bytes)]
        part_params = [torch.nn.Parameter(params.detach()[lo:hi]) for lo, hi in parts]  # views: updates land in params
        per_block = max(1, UPDATE_BYTES // self.chunk_bytes)
        blocks = [range(i, min(i + per_block, len(parts))) for i in range(0, len(parts), per_block)]
        optimizers = [build_optimizer(self.optim_cfg, [part_params[i] for i in block]) for block in blocks] if optimizes else []
        self.params, self.grad, self.parts, self.part_params = params, grad, parts, part_params
        self.blocks, self.optimizers, self.codecs, self.held = blocks, optimizers, codecs, held
        self.applied = len(parts)
        self.policy.hold()

    def _codecs(self, values: torch.Tensor) -> tuple[list[PayloadCodec] | None, HeldCopies | None]:
        """The decoders of each worker's pushes and (compress.pull) the held copies, for ``values``."""
        if self.compress is None or self.compress.name == "none":
            return None, None
        codecs = [build_codec(self.compress, values, [values.shape], self.shard, w, self.seed) for w in range(self.workers)]
        if not all(isinstance(c, PayloadCodec) for c in codecs):
            usable = "|".join(name for name, spec in CODECS.items() if spec.impl and issubclass(spec.impl, PayloadCodec))
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shard {self.shard} runs --compress {self.compress.name}: a parameter server decodes "
                          f"payloads and this codec has none; start the servers with one of {usable}")
        held = None
        if self.compress.get("pull"):
            held = HeldCopies(self.compress, values, self.shard, self.workers, self.seed, self.policy.shared_pulls)
        return codecs, held  # type: ignore[return-value]

    def register(self, worker: int) -> pb.ShardInfo:
        check_worker(worker, self.workers)
        return self.info()

    def info(self) -> pb.ShardInfo:
        with self.cond:
            numel = 0 if self.params is None else self.params.numel()
            dtype = 0 if self.params is None else TO_WIRE[self.params.dtype]
            return pb.ShardInfo(shard=self.shard, workers=self.workers, numel=numel, dtype=dtype, mode=self.mode,
                                staleness=self.staleness, version=self.version, backup_workers=self.backup_workers)

    # --- push ---------------------------------------------------------------------------------

    def push(self, stream: Iterator[Chunk], local_sq: float | None = None, epoch: int = 0) -> pb.PushReply:
        """``local_sq``: the worker's own squared gradient norm (stats.noise_scale), or None;
        ``epoch``: the membership the push belongs to (elastic.enabled)."""
        first = next(stream, None)
        if first is None:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "Push: empty stream")
        worker = first.worker
        with self.cond:
            self._require_params()
            check_worker(worker, self.workers)
            if worker in self.pushing:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker} already has a push in progress")
            self._check_member(worker, epoch, "push")
            self.policy.check_push(worker, first)
            if first.step > self.version:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"push based on version {first.step} > {self.version}")
            # Staged pushes are read until the last partition is updated (only a client that pushes
            # before pulling the previous step can find the update still running).
            self.cond.wait_for(self.settled)
            self.check_updating()
            self.pushing.add(worker)
            self.local_sq[worker] = local_sq
        return self.policy.push(worker, first, stream, epoch)

    def _check_member(self, worker: int, epoch: int, what: str) -> None:
        """(Under the lock) refuse a lost worker, and a call of an older membership."""
        if worker not in self.members:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker} has left the run")
        if epoch != self.epoch and self.policy.epoch_bound:
            raise membership_changed(self.shard, epoch, self.epoch, what)

    def staged_push(self, worker: int, first: Chunk, stream: Iterator[Chunk], epoch: int = 0) -> pb.PushReply:
        """The rest of ``worker``'s push received outside the lock and staged only once the whole
        stream is valid, then committed."""
        try:
            assert self.params is not None
            received: list[Chunk] = []
            numel, dtype = self.params.numel(), self.params.dtype
            if self.codecs is not None:
                numel, dtype = self.codecs[worker].payload_numel(), self.codecs[worker].payload_dtype
            receive("Push", self.shard, first, stream, numel, dtype, worker_bound=self.workers,
                    same=("worker", "step"), changed="worker and step must not change mid-stream",
                    take=received.append)
            staged = self._partitioned(received) if self.codecs is None else self._decoded(worker, received)
            return self._commit(worker, int(first.step), staged, epoch)
        finally:
            with self.cond:
                self.pushing.discard(worker)

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
        assert self.codecs is not None
        codec = self.codecs[worker]
        payload = torch.empty(codec.payload_numel(), dtype=codec.payload_dtype)
        for chunk in received:
            copy_in(payload, chunk.offset, chunk.data)
        dense = self._decode(worker, payload)
        return [dense[lo:hi] for lo, hi in self.parts]

    def _decode(self, worker: int, payload: torch.Tensor) -> torch.Tensor:
        """``worker``'s payload decoded into a gradient of this shard's range."""
        assert self.params is not None and self.codecs is not None
        codec = self.codecs[worker]
        codec.expect(self.clocks[worker])  # the worker's own pushes move its clock: stable here
        dense = torch.empty_like(self.params.detach())
        codec.decode(payload, dense)
        return dense

    def _commit(self, worker: int, base: int, received: list[torch.Tensor], epoch: int) -> pb.PushReply:
        assert self.params is not None
        with self.cond:
            self._check_member(worker, epoch, "push")  # a membership change while it streamed
            self.staged[worker] = received
            self.stats["pushes"] += 1
            self.stats["bytes_in"] += (self.codecs[worker].payload_bytes() if self.codecs is not None
                                       else self.params.numel() * self.params.element_size())
            self.clocks[worker] += 1
            staleness = self.policy.commit(worker, base)
            self.cond.notify_all()
            return pb.PushReply(version=self.version, staleness=staleness)

    # --- the update ---------------------------------------------------------------------------

    def gradient(self, part: int, workers: range | list[int], over: int) -> torch.Tensor:
        """One partition's gradient from the pushes of ``workers`` (a sync step's, the one that
        pushed in async/ssp), read where they were received: their sum over ``over`` (the workers a
        step averages; async scales each push by it), added in worker order so that the result
        does not depend on arrival order."""
        pushed = [self.staged[w][part] for w in workers]
        if self.grad is None:  # a lone worker: its push is the gradient
            return pushed[0]
        lo, hi = self.parts[part]
        grad = self.grad[lo:hi]
        if len(pushed) == 1:
            return torch.div(pushed[0], over, out=grad)
        grad.copy_(pushed[0])
        for more in pushed[1:]:
            grad.add_(more)
        return grad.div_(over)

    def step_block(self, block: int, workers: range | list[int], step: int, over: int, measure: bool = False) -> float:
        """Apply block ``block`` of the workers' step ``step`` (0-based: the pushing worker's clock
        before this push), their pushes summed over ``over``, at the learning rate the run's
        schedule gives that step; with ``measure``, the squared norm of the block's gradient (else 0)."""
        squared = 0.0
        for part in self.blocks[block]:
            grad = self.gradient(part, workers, over)  # a summation-only shard's lands in its values: done
            if measure:
                squared += float(torch.linalg.vector_norm(grad, dtype=torch.float64)) ** 2
            if self.optimizers:
                self.part_params[part].grad = grad
        if self.optimizers:
            optimizer = self.optimizers[block]
            for group in optimizer.param_groups:
                group["lr"] = self.schedule.lr_at(step)
            optimizer.step()
        return squared

    def updated(self) -> bool:
        return self.applied == len(self.parts)

    def settled(self) -> bool:
        """(Under the lock) the update is done, or never will be (check_updating says why)."""
        return self.updated() or bool(self.refusal)

    def close(self) -> None:
        """Refuse every call still waiting, for workers that may be gone: the server's threads end,
        so the process exits as soon as it is told to stop rather than at its calls' deadlines."""
        with self.cond:
            self.refusal = self.refusal or "the server is stopping"
            self.cond.notify_all()

    def check_updating(self) -> None:
        if self.refusal:
            raise Refused(grpc.StatusCode.INTERNAL, f"shard {self.shard}: {self.refusal}")

    # --- pull ---------------------------------------------------------------------------------

    def pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        worker, clock = request.worker, request.clock
        epoch = epoch_of(context.invocation_metadata())
        with self.cond:
            params = self._require_params()
            check_worker(worker, self.workers)
            self._check_member(worker, epoch, "pull")
            if request.shard != self.shard:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"Pull: shard {request.shard}, this is shard {self.shard}")
            self.policy.check_pull(worker, clock)
            start = time.perf_counter()
            remaining = context.time_remaining()
            if not self.cond.wait_for(lambda: self.policy.may_pull(worker, clock) or bool(self.refusal)
                                      or self.epoch != epoch, timeout=remaining):
                raise Refused(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"Pull: worker {worker} at clock {clock} still blocked; clocks {self.clocks}")
            self.check_updating()
            if not self.policy.may_pull(worker, clock):  # woken by a new membership: the step is pushed again
                raise membership_changed(self.shard, epoch, self.epoch, "pull")
            blocked = time.perf_counter() - start
            version = self.policy.pull_version(clock)
            self.stats["pulls"] += 1
            slowest = min(self.clocks[w] for w in self.members)
            if self.held is not None and self.held.holds(worker) and not request.full:
                payload = self.held.encoded(worker, version, self._settled())
                self.stats["bytes_out"] += payload.numel() * payload.element_size()
            else:
                payload = None
                source = self.policy.pull_source(worker)
                self.stats["bytes_out"] += params.numel() * params.element_size()
                if self.held is not None:  # the worker will hold these parameters
                    self.held.hold_full(worker, self._settled())
            self.reading[version] += 1
        try:
            meta = (("blocked-seconds", f"{blocked:.9f}"), ("slowest-clock", str(slowest)))
            if payload is not None:
                context.send_initial_metadata((*meta, ("encoded", "1")))
                yield from encoded_chunks(payload, self.shard, 0, version, self.chunk_bytes, byte_view(payload))
                self._trail_norms(context, version)
                return
            context.send_initial_metadata(meta)
            yield from self.policy.stream(iter(self.pull_messages(source, version)), clock, version)
            self._trail_norms(context, version)
        finally:
            with self.cond:
                self.reading[version] -= 1
                if not self.reading[version]:
                    del self.reading[version]
                self.cond.notify_all()

    def _trail_norms(self, context: grpc.ServicerContext, version: int) -> None:
        """A streamed pull's trailer: what the update that made ``version`` measured, if anything
        (stats.noise_scale; the whole version has been streamed, so its update is done)."""
        with self.cond:
            norms = self.norms.get(version)
        if norms is not None:
            context.set_trailing_metadata((norms.header(),))

    def _settled(self) -> torch.Tensor:
        """(Under the lock, compressed pulls) the parameters once the update in progress is done:
        what a worker holds after its pull (in sync mode the update runs on a thread of its own)."""
        assert self.params is not None
        self.cond.wait_for(self.settled)
        self.check_updating()
        return self.params.detach()

    def pull_messages(self, source: torch.Tensor, version: int) -> Iterator[Any]:
        """A pull's TensorChunk messages, which add_servicer's ``encode`` turns into bytes: here
        already encoded (testbed.ps.wire); testbed.bench.wire overrides it to compare codecs."""
        return encoded_chunks(source, self.shard, 0, version, self.chunk_bytes, byte_view(source))

    # --- calls from this process (a virtual cluster: testbed.launch.virtual) -----------------------

    def push_local(self, worker: int, base: int, gradient: torch.Tensor) -> int:
        """``worker``'s gradient of this shard's range, computed on version ``base``, pushed from
        this process (with a codec: its payload, decoded as a received one is): checked and
        committed as a received push is, by the mode's policy; its staleness. The shard reads
        ``gradient`` until the update is applied, so it is the caller's to give away."""
        with self.cond:
            self._require_params()
            check_worker(worker, self.workers)
            self._check_member(worker, self.epoch, "push")
            self.policy.check_push(worker, Chunk(worker=worker, shard=self.shard, step=base))
            if base > self.version:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"push based on version {base} > {self.version}")
            self.cond.wait_for(self.settled)
            self.check_updating()
        if self.codecs is not None:
            gradient = self._decode(worker, gradient)
        return self._commit(worker, base, [gradient[lo:hi] for lo, hi in self.parts], self.epoch).staleness

    def pull_local(self, worker: int, clock: int) -> tuple[torch.Tensor, int]:
        """A copy of the parameters ``worker``'s pull at ``clock`` (its pushes) streams, and their
        version. A pull the mode holds back is refused rather than waited for: in one process
        nobody else could release it."""
        with self.cond:
            self._require_params()
            check_worker(worker, self.workers)
            self.policy.check_pull(worker, clock)
            if not self.policy.may_pull(worker, clock):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"Pull: worker {worker} at clock {clock} is held back by its mode; clocks {self.clocks}")
            self.cond.wait_for(self.settled)
            self.check_updating()
            self.stats["pulls"] += 1
            return self.policy.pull_source(worker).clone(), self.policy.pull_version(clock)

    # --- membership ------------------------------------------------------------------------------

    def leave(self, request: pb.LeaveRequest) -> pb.ShardInfo:
        """Drop a lost worker (elastic.enabled): from the barrier and clocks of membership ``epoch``
        on; the step in progress, if any, is pushed again by the survivors (the policy's ``leave``)."""
        with self.cond:
            check_worker(request.worker, self.workers)
            if request.epoch > self.epoch:
                self.epoch = request.epoch
                self.members.discard(request.worker)
                if not self.members:
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard}: no worker left")
                self.policy.leave(request.worker)
                self.cond.notify_all()
        return self.info()

    def join(self, request: pb.JoinRequest) -> pb.ShardInfo:
        """Admit a newcomer in a lost worker's place (elastic.rejoin_step) while every member waits at
        a step boundary: from membership ``epoch`` on it counts among the members, its clock (the
        step it takes part from) the slowest member's: in sync mode every member's, and under SSP
        one that holds nobody back."""
        with self.cond:
            worker = request.worker
            check_worker(worker, self.workers)
            if request.epoch > self.epoch:
                if worker in self.members:
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"worker {worker} is a member already")
                clock = min(self.clocks[w] for w in self.members)
                self.policy.check_join(worker, clock)
                self.epoch = request.epoch
                self.members.add(worker)
                self.clocks[worker] = clock
                self.staged[worker], self.local_sq[worker] = [], None
                self.policy.join(worker)
                self.cond.notify_all()
        return self.info()

    # --- clocks, stats --------------------------------------------------------------------------

    def clock(self, request: pb.ClockRequest) -> pb.ClockReply:
        with self.cond:
            check_worker(request.worker, self.workers)
            if request.advance:
                self.policy.advance(request.worker)
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

    def _require_params(self) -> torch.nn.Parameter:
        if self.params is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"shard {self.shard} has no parameters yet (InitParams)")
        return self.params
