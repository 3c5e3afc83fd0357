"""Gradients in flat buffers, cut into buckets: what every all-reduce synchronizer shares.

An algorithm subclasses ``FlatGradSynchronizer`` with ``allreduce_`` (sum one bucket in place) and,
where it reuses working memory, ``make_scratch``; bucketing, overlap and the mean live here.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from testbed.collectives.ring import ring_allgather_
from testbed.compress import Codec, build_codec
from testbed.compress.codec import codec_facts, residual_norm
from testbed.sync.base import GradReadiness, Synchronizer, SyncReport
from testbed.timing import Stamp, stamp, stamp_seconds
from testbed.world import World


def bucket_ends(sizes: list[int], cap_bytes: float | None) -> list[int]:
    """Where buckets end (one past their last tensor) over tensors of ``sizes`` bytes, in the order
    backward produces them: a bucket closes once it holds ``cap_bytes`` (None: one bucket for all).
    torch's DDP given a ``bucket_cap_mb`` cuts its buckets by the same rule, the first included (its
    1 MiB first bucket applies only when the cap is left at its default), so the two compare on
    the same buckets. The simulator plans buckets with this rule too."""
    ends, filled = [], 0
    for i, size in enumerate(sizes):
        filled += size
        if cap_bytes is not None and filled >= cap_bytes:
            ends.append(i + 1)
            filled = 0
    if not ends or ends[-1] != len(sizes):
        ends.append(len(sizes))
    return ends


def bucket_layout(params: list[nn.Parameter], cap_bytes: float | None) -> list[list[list[int]]]:
    """A rank's buckets over ``params``: for each dtype (in name order), its parameters in reverse
    registration order (backward's), cut by bucket_ends; each bucket as its parameters' indices in
    ``params``. Bucket i of the flattened list is codec i's (testbed.compress.build_codec)."""
    groups = []
    for dtype in sorted({p.dtype for p in params}, key=str):
        group = [i for i in reversed(range(len(params))) if params[i].dtype == dtype]
        ends = bucket_ends([params[i].numel() * params[i].element_size() for i in group], cap_bytes)
        groups.append([group[lo:hi] for lo, hi in zip([0, *ends[:-1]], ends)])
    return groups


@dataclass
class Traffic:
    """One bucket's collective: bytes this rank sent and received, and when it ran (on the device's
    timeline: testbed.timing.stamp); compressed, also its codec time."""

    sent: int
    recv: int
    start: Stamp
    end: Stamp
    t_encode: float = 0.0
    t_decode: float = 0.0


class InFlight(Protocol):
    """A launched collective: ``result()`` waits for it and returns its Traffic."""

    def result(self) -> Traffic: ...


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``: how long at least one collective was in flight."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@dataclass
class Bucket:
    """A contiguous slice of a flat gradient buffer, all-reduced as one collective."""

    view: torch.Tensor
    params: list[nn.Parameter]


class FlatGradSynchronizer(Synchronizer):
    """Averages gradients through preallocated flat buffers (one per dtype), bucket by bucket.

    Each ``p.grad`` is a view into a buffer, so backward accumulates straight into it and every
    collective runs on a contiguous slice with no packing copy (DDP's gradient_as_bucket_view).
    Parameters are laid out in reverse registration order, roughly the order backward produces
    their gradients, and cut into buckets of ``sync.bucket_mb`` (null: one bucket per buffer; 0:
    one per tensor). With ``sync.overlap`` a bucket's collective starts as soon as backward has
    produced all its gradients, in bucket order on every rank, and the step waits only for what is
    still in flight; without it the buckets run one by one after backward. Where the collective
    runs is the algorithm's (``launch``): the testbed's own algorithms on a communication thread
    of this process, the backend's asynchronously on its own threads, as DDP runs them.

    The mean is taken before the sum, as DDP takes it, a bucket at a time just before its
    collective: the division of every bucket but the last hides behind backward.
    """

    def __init__(self, cfg: Any, compress: Any = None, seed: int = 0) -> None:
        super().__init__(cfg, compress, seed)
        self._comm: ThreadPoolExecutor | None = None  # overlap's communication thread, from setup

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        super().setup(model, optimizer, world)
        params = [p for p in model.parameters() if p.requires_grad]
        cap = self.cfg.bucket_mb
        cap_bytes = None if cap is None else float(cap) * 2**20
        self.buffers: list[torch.Tensor] = []
        self.buckets: list[Bucket] = []
        for buckets in bucket_layout(params, cap_bytes):
            group = [params[i] for bucket in buckets for i in bucket]
            flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=world.device)
            offset = 0
            for p in group:
                view = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view
                offset += p.numel()
            offsets = list(itertools.accumulate((p.numel() for p in group), initial=0))
            start = 0
            for bucket in buckets:
                end = start + len(bucket)
                self.buckets.append(Bucket(flat[offsets[start] : offsets[end]], group[start:end]))
                start = end
            self.buffers.append(flat)
        self.scratch = [self.make_scratch(b.view) for b in self.buckets]
        codecs = [build_codec(self.compress, b.view, [p.shape for p in b.params], i, world.rank, self.seed)
                  for i, b in enumerate(self.buckets)]
        self.codecs: list[Codec] | None = codecs if any(c is not None for c in codecs) else None  # type: ignore[assignment]
        self.overlap = bool(self.cfg.overlap) and world.world_size > 1
        if self.overlap:
            self._comm = ThreadPoolExecutor(max_workers=1, thread_name_prefix="comm")
            bucket_of = {id(p): [i] for i, b in enumerate(self.buckets) for p in b.params}
            self._launched: list[InFlight] = []
            self._readiness = GradReadiness(params, lambda p: bucket_of[id(p)], len(self.buckets), self._bucket_ready)

    def micro_step(self, is_boundary: bool) -> AbstractContextManager[None]:
        if not (self.overlap and is_boundary):
            return nullcontext()
        self._launched = []
        return self._readiness.armed()

    def _bucket_ready(self, index: int) -> None:
        # Launch in bucket order only, so that every rank issues the same collectives in the same order.
        remaining = self._readiness.remaining
        while len(self._launched) < len(self.buckets) and remaining[len(self._launched)] == 0:
            self._launched.append(self._start(len(self._launched)))

    # --- the step --------------------------------------------------------------------------------

    def _start(self, index: int) -> InFlight:
        self._mean_(index)
        return self.launch(index)

    def _mean_(self, index: int) -> None:
        if self.codecs is None or self.codecs[index].divides_first:
            self.buckets[index].view.div_(self.world.world_size)

    def launch(self, index: int) -> InFlight:
        """Start bucket ``index``'s collective during backward, where the algorithm runs it."""
        assert self._comm is not None  # launched only with overlap, which started it
        return self._comm.submit(self._timed, index)

    def _timed(self, index: int) -> Traffic:
        device = self.world.device
        start = stamp(device)
        if self.codecs is not None:
            moved = self.codecs[index].reduce_(self.buckets[index].view, self)
            return Traffic(moved.sent, moved.recv, start, stamp(device), moved.t_encode, moved.t_decode)
        sent, recv = self.allreduce_(self.buckets[index].view, self.scratch[index])
        return Traffic(sent, recv, start, stamp(device))

    # --- what a codec's reduction runs on (testbed.compress.codec.Collectives) ---------------

    @property
    def world_size(self) -> int:
        return self.world.world_size

    def allreduce_payload_(self, payload: torch.Tensor) -> tuple[int, int]:
        return self.allreduce_(payload, None)

    def allgather_payload(self, payload: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Every rank's payload, in rank order: around a ring, for the testbed's own schedules
        (whose all-reduce is their own; the allgather of a non-linear codec is the ring's)."""
        gathered = torch.empty(self.world_size * payload.numel(), dtype=payload.dtype, device=payload.device)
        gathered.view(self.world_size, -1)[self.world.rank].copy_(payload)
        traffic = ring_allgather_(gathered)
        return gathered, traffic.sent, traffic.recv

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:  # accumulate locally; communicate once per window
            return SyncReport()
        if self.world.world_size == 1 and self.codecs is None:  # a codec still changes the gradients
            return SyncReport(t_comm=0.0)
        if self.overlap:
            for index in range(len(self._launched), len(self.buckets)):  # parameters backward did not reach
                self._launched.append(self._start(index))
            results = [flight.result() for flight in self._launched]
        else:
            results = []
            for index in range(len(self.buckets)):
                self._mean_(index)
                results.append(self._timed(index))
        times = stamp_seconds(self.world.device, [t for r in results for t in (r.start, r.end)])
        report = SyncReport(bytes_sent=sum(r.sent for r in results), bytes_recv=sum(r.recv for r in results),
                            t_comm=busy_time(list(zip(times[::2], times[1::2]))))
        if self.codecs is not None:
            report.t_encode = sum(r.t_encode for r in results)
            report.t_decode = sum(r.t_decode for r in results)
            report.residual_norm = residual_norm(self.codecs)
        return report

    def make_scratch(self, bucket: torch.Tensor) -> torch.Tensor | None:
        """Working memory the algorithm reuses every step for ``bucket`` (allocated once, at setup)."""
        return None

    @abstractmethod
    def allreduce_(self, flat: torch.Tensor, scratch: torch.Tensor | None) -> tuple[int, int]:
        """Sum ``flat`` across ranks in place; return (bytes sent, bytes received) by this rank."""

    def zero_grad(self) -> None:
        # One memset per flat buffer; the grads stay views into it.
        for flat in self.buffers:
            flat.zero_()

    def describe(self) -> dict[str, Any]:
        facts = {
            "buffer_bytes": sum(b.numel() * b.element_size() for b in self.buffers),
            "buckets": len(self.buckets),
            "bucket_mb": self.cfg.bucket_mb,
            "overlap": self.overlap,
        }
        if self.codecs is not None:
            facts["compress"] = codec_facts(self.compress, self.codecs, facts["buffer_bytes"])
        return facts

    def close(self) -> None:
        if self._comm is not None:
            self._comm.shutdown(wait=True)
