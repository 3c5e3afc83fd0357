"""A shard's checks of requests: every message is validated before it touches state, and a bad one
is refused with a status code (testbed.ps.service answers with it) and a message naming the cause."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch

from testbed.ps import parameter_server_pb2 as pb
from testbed.ps.wire import EPOCH_HEADER, FROM_WIRE, LOCAL_SQ_HEADER, Chunk


class Refused(Exception):
    """A request that must not change any state; carries the status code to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_worker(worker: int, workers: int) -> None:
    if worker >= workers:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"worker {worker} out of range [0, {workers})")


def epoch_of(metadata: Any) -> int:
    """The membership epoch a call belongs to (elastic.enabled), from its metadata; 0 without one."""
    value = dict(metadata or ()).get(EPOCH_HEADER, "0")
    if not value.isdigit():
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{EPOCH_HEADER} {value!r} is not an epoch")
    return int(value)


def membership_changed(shard: int, epoch: int, now: int, what: str) -> Refused:
    """A call of an older membership: its step is pushed again by the new one (testbed.elastic)."""
    return Refused(grpc.StatusCode.ABORTED, f"shard {shard}: membership changed ({what} of epoch {epoch}, the shard "
                                            f"is at epoch {now}): push the step again")


def local_sq_of(metadata: Any) -> float | None:
    """A push's worker's own squared gradient norm (stats.noise_scale), from the call's metadata;
    None without one."""
    value = dict(metadata or ()).get(LOCAL_SQ_HEADER)
    if value is None:
        return None
    try:
        local_sq = float(value)
    except ValueError:
        local_sq = -1.0
    if not (math.isfinite(local_sq) and local_sq >= 0):
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"Push: {LOCAL_SQ_HEADER} {value!r} is not a finite squared norm")
    return local_sq


def check_chunk(chunk: Chunk, shard: int, expected: int, numel: int, dtype: torch.dtype, worker_bound: int) -> None:
    """``chunk`` of a stream to ``shard``: the one at element ``expected`` of ``numel`` of ``dtype``,
    from a worker below ``worker_bound``."""
    problem = None
    if chunk.malformed:
        problem = chunk.malformed
    elif chunk.shard != shard:
        problem = f"shard {chunk.shard}, this is shard {shard}"
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


def receive(rpc: str, shard: int, first: Chunk, rest: Iterator[Chunk], numel: int, dtype: torch.dtype,
            worker_bound: int, same: tuple[str, ...], changed: str, take: Callable[[Chunk], None]) -> None:
    """Validate the chunk stream ``first, *rest`` to ``shard`` and hand each chunk to ``take``: chunks
    of ``dtype`` in order without gaps that cover ``numel`` elements exactly, from workers below
    ``worker_bound``, each with the fields ``same`` of the first chunk (else refused as
    "<rpc>: <changed>"). A refusal may come after ``take`` saw earlier chunks."""
    expected = 0
    for chunk in _chain(first, rest):
        check_chunk(chunk, shard, expected, numel, dtype, worker_bound)
        if any(getattr(chunk, field) != getattr(first, field) for field in same):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{rpc}: {changed}")
        take(chunk)
        expected += chunk.length
    if expected != numel:
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{rpc}: got {expected} of {numel} elements")


def _chain(first: Chunk, rest: Iterator[Chunk]) -> Iterator[Chunk]:
    yield first
    yield from rest
