"""A worker's connection to all parameter-server shards: push and pull every shard concurrently.

Channels are created in the rank process, after it was spawned (gRPC and fork do not mix). Every
call has a deadline; failures name the shard, its address and the gRPC status.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import torch

from testbed.latency import link_delay
from testbed.ps import parameter_server_pb2 as pb
from testbed.ps import parameter_server_pb2_grpc as pb_grpc
from testbed.ps.wire import (
    EPOCH_HEADER,
    LOCAL_SQ_HEADER,
    SERVICE,
    StepNorms,
    auth_metadata,
    byte_view,
    copy_in,
    decode_chunk,
    encoded_chunks,
    keep_freed_memory,
    open_channel,
    passthrough,
)
from testbed.rank_failure import RunFailure

T = TypeVar("T")


class PsError(RunFailure, RuntimeError):
    """A failed call to one shard: ``ps shard <i> at <address>: <call>: <STATUS>: <details>``."""

    kind = "parameter_server"

    def __init__(self, shard: int, address: str, what: str) -> None:
        self.shard = shard  # every worker loses a dead shard, whichever reports it: the shard is the cause
        super().__init__(f"ps shard {shard} at {address}: {what}")

    def facts(self) -> dict[str, Any]:
        return {"shard": self.shard}


@dataclass
class PullResult:
    versions: list[int]
    blocked_s: float  # longest time a shard held the pull back for slower workers (sync, ssp)
    slowest_clock: int  # the slowest worker's clock when the pull was released (min over shards)
    norms: list[StepNorms | None]  # per shard: what a sync update measured (stats.noise_scale), else None


class PsClient:
    def __init__(
        self, addresses: list[str], token: str, worker: int, timeout_s: float, chunk_bytes: int, tls_ca: str | None = None,
        shards: list[int] | None = None,
    ) -> None:
        """``shards``: the shard index each address serves, when this worker reaches only some of
        the run's shards (testbed.sync.byteps); by default address i serves shard i."""
        self.addresses, self.worker, self.timeout_s, self.chunk_bytes = addresses, worker, timeout_s, chunk_bytes
        self.ids = list(range(len(addresses))) if shards is None else list(shards)
        keep_freed_memory()
        self._auth = self.metadata = auth_metadata(token)
        self.channels = [open_channel(a, tls_ca) for a in addresses]
        self.stubs = [pb_grpc.ParameterServerStub(c) for c in self.channels]
        # The tensor-carrying calls take the fast path: pre-encoded chunks out, zero-copy decode in.
        self._init = [c.stream_unary(f"/{SERVICE}/InitParams", passthrough, pb.ShardInfo.FromString) for c in self.channels]
        self._push = [c.stream_unary(f"/{SERVICE}/Push", passthrough, pb.PushReply.FromString) for c in self.channels]
        self._pull = [c.unary_stream(f"/{SERVICE}/Pull", pb.PullRequest.SerializeToString, decode_chunk) for c in self.channels]
        self.pool = ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="ps-client")
        self._pushes: ThreadPoolExecutor | None = None  # push_pull's, beside the pool its pulls use
        self._views: dict[int, memoryview] = {}

    def _call(self, shard: int, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except grpc.RpcError as err:
            raise PsError(self.ids[shard], self.addresses[shard], f"{what}: {err.code().name}: {err.details()}") from None

    def _each(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(shard)`` for every shard concurrently; the first failure is raised."""
        if len(self.stubs) == 1:  # no thread hand-off for a single shard
            return [fn(0)]
        return [f.result() for f in [self.pool.submit(fn, i) for i in range(len(self.stubs))]]

    def _in_turn(self, fn: Callable[[int], T]) -> list[T]:
        """``fn(shard)`` for every shard in turn, on the calling thread."""
        return [fn(i) for i in range(len(self.stubs))]

    def _view(self, flat: torch.Tensor) -> memoryview:
        # Byte views of the preallocated buffers are made once and reused every step.
        key = flat.data_ptr()
        if key not in self._views:
            self._views[key] = byte_view(flat)
        return self._views[key]

    def register(self, wait_s: float) -> list[pb.ShardInfo]:
        """Wait (up to ``wait_s``) until every shard answers; return their descriptions."""
        request = pb.RegisterRequest(worker=self.worker)
        return self._each(lambda i: self._call(i, "Register", lambda: self.stubs[i].Register(
            request, timeout=wait_s, metadata=self.metadata, wait_for_ready=True)))

    def init_params(self, shards: list[torch.Tensor]) -> list[pb.ShardInfo]:
        def send(i: int) -> pb.ShardInfo:
            # InitParams carries the shard's size in every chunk's step field.
            stream = encoded_chunks(shards[i], self.ids[i], self.worker, shards[i].numel(), self.chunk_bytes, self._view(shards[i]))
            return self._call(i, "InitParams", lambda: self._init[i](stream, timeout=self.timeout_s, metadata=self.metadata))

        return self._each(send)

    def push_shard(self, i: int, grad: torch.Tensor, base_version: int, local_sq: float | None = None) -> pb.PushReply:
        """Push shard ``i``'s whole gradient (computed on parameters of ``base_version``); with
        ``local_sq``, this worker's own squared gradient norm (stats.noise_scale)."""
        link_delay()  # one emulated latency per request (testbed.latency)
        stream = encoded_chunks(grad, self.ids[i], self.worker, base_version, self.chunk_bytes, self._view(grad))
        metadata = self.metadata if local_sq is None else (*self.metadata, (LOCAL_SQ_HEADER, repr(local_sq)))
        return self._call(i, "Push", lambda: self._push[i](stream, timeout=self.timeout_s, metadata=metadata))

    def push(self, grads: list[torch.Tensor], base_versions: list[int], local_sq: float | None = None) -> list[pb.PushReply]:
        return self._each(lambda i: self.push_shard(i, grads[i], base_versions[i], local_sq))

    def pull(self, params: list[torch.Tensor], clock: int, full: bool = False,
             decoders: list[Any] | None = None) -> PullResult:
        """Pull every shard into ``params``. With ``decoders`` (one codec per shard: compressed
        pulls) a shard may send the encoded update since what this worker holds, which is decoded
        and added; ``full`` asks for the whole parameters instead."""
        def receive(i: int) -> tuple[int, float, int, StepNorms | None]:
            def run() -> tuple[int, float, int, StepNorms | None]:
                link_delay()
                call = self._pull[i](pb.PullRequest(worker=self.worker, shard=self.ids[i], clock=clock, full=full),
                                     timeout=self.timeout_s, metadata=self.metadata)
                meta = dict(call.initial_metadata())
                into = params[i]
                if meta.get("encoded"):
                    if decoders is None:
                        raise PsError(self.ids[i], self.addresses[i], "Pull: an encoded pull, but no codec here")
                    into = torch.empty(decoders[i].payload_numel(), dtype=decoders[i].payload_dtype)
                version, received = -1, 0
                for chunk in call:
                    if chunk.malformed or chunk.offset + chunk.length > into.numel():
                        raise PsError(self.ids[i], self.addresses[i], f"Pull: bad chunk {chunk.malformed}")
                    copy_in(into, chunk.offset, chunk.data)
                    version, received = chunk.step, received + chunk.length
                if received != into.numel():
                    raise PsError(self.ids[i], self.addresses[i], f"Pull: got {received} of {into.numel()} elements")
                if into is not params[i]:  # the update, added as the shard added it to its copy
                    assert decoders is not None
                    decoders[i].expect(version)
                    update = torch.empty_like(params[i])
                    decoders[i].decode(into, update)
                    params[i].add_(update)
                norms = StepNorms.of(call.trailing_metadata())
                return version, float(meta.get("blocked-seconds", 0.0)), int(meta.get("slowest-clock", 0)), norms

            return self._call(i, "Pull", run)

        results = self._each(receive)
        return PullResult([r[0] for r in results], max(r[1] for r in results), min(r[2] for r in results),
                          [r[3] for r in results])

    def push_pull(self, grads: list[torch.Tensor], base_versions: list[int], clock: int) -> PullResult:
        """Push every shard and pull it back into ``grads`` at once: a summation-only shard streams
        each partition's sum as soon as every worker has pushed it, so the pull overlaps the push.
        A chunk is copied into its message as it is sent, before its sum can come back."""
        if self._pushes is None:
            self._pushes = ThreadPoolExecutor(max_workers=len(self.addresses), thread_name_prefix="ps-push")
        pushes = [self._pushes.submit(self.push_shard, i, grads[i], base_versions[i]) for i in range(len(self.stubs))]
        pulled = self.pull(grads, clock)
        for push in pushes:
            push.result()
        return pulled

    def clock(self, shard: int, advance: bool = False) -> pb.ClockReply:
        request = pb.ClockRequest(worker=self.worker, advance=advance)
        return self._call(shard, "Clock", lambda: self.stubs[shard].Clock(request, timeout=self.timeout_s, metadata=self.metadata))

    def enter_epoch(self, epoch: int) -> None:
        """From now on every call belongs to membership ``epoch`` (elastic.enabled)."""
        self.metadata = (*self._auth, (EPOCH_HEADER, str(epoch)))

    def leave(self, worker: int, epoch: int) -> list[pb.ShardInfo]:
        """Every shard drops ``worker``, lost, from membership ``epoch`` on (every survivor says it;
        a repeat is a no-op). Shard by shard on the calling thread: the pool's threads may be
        blocked in the pulls this call is to wake."""
        request = pb.LeaveRequest(worker=worker, epoch=epoch)
        return self._in_turn(lambda i: self._call(i, "Leave", lambda: self.stubs[i].Leave(
            request, timeout=self.timeout_s, metadata=self.metadata)))

    def join(self, worker: int, epoch: int) -> list[pb.ShardInfo]:
        """Every shard admits ``worker``, a newcomer, from membership ``epoch`` on (every member says
        it; a repeat is a no-op)."""
        request = pb.JoinRequest(worker=worker, epoch=epoch)
        return self._in_turn(lambda i: self._call(i, "Join", lambda: self.stubs[i].Join(
            request, timeout=self.timeout_s, metadata=self.metadata)))

    def stats(self) -> list[pb.StatsReply]:
        return self._each(lambda i: self._call(i, "Stats", lambda: self.stubs[i].Stats(
            pb.StatsRequest(), timeout=self.timeout_s, metadata=self.metadata)))

    def shutdown(self) -> None:
        self._each(lambda i: self._call(i, "Shutdown", lambda: self.stubs[i].Shutdown(
            pb.ShutdownRequest(), timeout=self.timeout_s, metadata=self.metadata)))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self._pushes is not None:
            self._pushes.shutdown(wait=True)
        for channel in self.channels:
            channel.close()


def describe_stats(stats: list[pb.StatsReply]) -> list[dict[str, Any]]:
    return [
        {"version": s.version, "pushes": s.pushes, "pulls": s.pulls, "rejected": s.rejected, "bytes_in": s.bytes_in,
         "bytes_out": s.bytes_out, "apply_seconds": s.apply_seconds, "staleness_histogram": list(s.staleness_histogram)}
        for s in stats
    ]
