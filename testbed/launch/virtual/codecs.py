"""The all-reduce family's codecs, run for every virtual worker with their real math.

Each worker holds one codec per bucket, as a real rank does (testbed.compress.build_codec with its
rank and the run's seed: the same shared draws, the same error-feedback residuals), and the buckets
are a real rank's (testbed.sync.flat.bucket_layout). A step runs every worker's real ``reduce_`` on
a thread of its own, bucket by bucket in bucket order, over collectives held in memory: an
all-reduce that sums the workers' payloads in worker order, an allgather that stacks them. So top-k, QSGD, the casts and
PowerSGD's two all-reduces run here exactly as they do between processes; only the wire is gone.
"""

from __future__ import annotations

import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch import nn

from testbed.compress import Codec, build_codec
from testbed.sync.flat import bucket_layout


class _Meeting:
    """The workers' in-memory collectives: each call waits for every worker's payload."""

    def __init__(self, n: int, timeout_s: float) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        self.slots: list[torch.Tensor | None] = [None] * n
        self.result: torch.Tensor | None = None

    def exchange(self, worker: int, payload: torch.Tensor, gather: bool) -> torch.Tensor:
        self.slots[worker] = payload
        if self.barrier.wait() == 0:  # one worker combines, in worker order
            parts = [p for p in self.slots if p is not None]
            if gather:
                self.result = torch.cat([p.reshape(-1) for p in parts])
            else:
                total = parts[0].clone()
                for part in parts[1:]:
                    total.add_(part)
                self.result = total
        self.barrier.wait()
        result = self.result
        assert result is not None
        self.barrier.wait()  # every worker has read it before the next call writes
        return result


class _Member:
    """One worker's view of the meeting (testbed.compress.codec.Collectives); no bytes move."""

    def __init__(self, meeting: _Meeting, worker: int) -> None:
        self.meeting, self.worker, self.world_size = meeting, worker, meeting.n

    def allreduce_payload_(self, payload: torch.Tensor) -> tuple[int, int]:
        payload.copy_(self.meeting.exchange(self.worker, payload, gather=False))
        return 0, 0

    def allgather_payload(self, payload: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        return self.meeting.exchange(self.worker, payload, gather=True), 0, 0


class VirtualCodecs:
    """Every worker's codecs over ``model``'s flat parameters (testbed.sync.base.flat_views' order)."""

    def __init__(self, compress: Any, bucket_mb: float | None, model: nn.Module, n: int, seed: int,
                 timeout_s: float) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        offsets, offset = [], 0
        for p in params:
            offsets.append(offset)
            offset += p.numel()
        # testbed.sync.flat's buckets, each as the flat positions of its parameters.
        cap = None if bucket_mb is None else float(bucket_mb) * 2**20
        layout = [bucket for group in bucket_layout(params, cap) for bucket in group]
        self.buckets = [torch.cat([torch.arange(offsets[i], offsets[i] + params[i].numel()) for i in bucket])
                        for bucket in layout]
        self.n = n
        self.codecs: list[list[Codec]] = []
        for w in range(n):
            built = [build_codec(compress, torch.empty(len(idx), dtype=params[bucket[0]].dtype),
                                 [params[i].shape for i in bucket], b, w, seed)
                     for b, (idx, bucket) in enumerate(zip(self.buckets, layout))]
            self.codecs.append([c for c in built if c is not None])
        self.meeting = _Meeting(n, timeout_s)
        self.members = [_Member(self.meeting, w) for w in range(n)]
        self.pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="worker") if n > 1 else None

    def mean(self, grads: torch.Tensor) -> torch.Tensor:
        """The compressed mean of the workers' gradients (rows of ``grads``): what every worker's
        codecs reduce it to (worker 0's; all agree, as real ranks do)."""
        rows = [[grads[w, idx] for idx in self.buckets] for w in range(self.n)]
        if self.pool is None:
            self._reduce(0, rows[0])
        else:
            futures = [self.pool.submit(self._reduce, w, rows[w]) for w in range(self.n)]
            finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
            if any(f.exception() is not None for f in finished):
                self.meeting.barrier.abort()  # the others wait on a worker that failed: release them
            errors = [e for e in (f.exception() for f in futures) if e is not None]
            if errors:  # the failure itself, not the others' broken barrier
                raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        out = torch.empty(grads.shape[1], dtype=grads.dtype)
        for idx, bucket in zip(self.buckets, rows[0]):
            out[idx] = bucket
        return out

    def _reduce(self, worker: int, buckets: list[torch.Tensor]) -> None:
        for codec, bucket in zip(self.codecs[worker], buckets):
            if codec.divides_first:  # as testbed.sync.flat takes the mean before the sum
                bucket.div_(self.n)
            codec.reduce_(bucket, self.members[worker])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
