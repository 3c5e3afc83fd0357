"""The parameter server's gRPC service: handlers that answer a shard's refusals with their status
codes, parse unary requests leniently, and refuse calls without the run's token (UNAUTHENTICATED)."""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from testbed.ps import parameter_server_pb2 as pb
from testbed.ps import parameter_server_pb2_grpc as pb_grpc
from testbed.ps.shard import Shard
from testbed.ps.validation import Refused, epoch_of, local_sq_of
from testbed.ps.wire import SERVICE, TOKEN_HEADER, Chunk, decode_chunk, passthrough

# The longest a streamed request (InitParams, Push) may take, whatever the client's deadline.
STREAM_TIMEOUT_S = 600.0
NOTHING: Iterator[Any] = iter(())


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
        return self._bounded(context, request_iterator,
                             lambda requests: self.shard.push(requests, local_sq_of(context.invocation_metadata()),
                                                              epoch_of(context.invocation_metadata())))

    def Pull(self, request, context):  # noqa: N802
        try:
            yield from self.shard.pull(_parsed(request), context)
        except Refused as refused:
            with self.shard.cond:
                self.shard.stats["rejected"] += 1
            context.abort(refused.code, str(refused))

    def Clock(self, request, context):  # noqa: N802
        return self._guard(context, lambda: self.shard.clock(_parsed(request)))

    def Leave(self, request, context):  # noqa: N802
        return self._guard(context, lambda: self.shard.leave(_parsed(request)))

    def Join(self, request, context):  # noqa: N802
        return self._guard(context, lambda: self.shard.join(_parsed(request)))

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
        "Leave": std(servicer.Leave, _lenient(pb.LeaveRequest), pb.ShardInfo.SerializeToString),
        "Join": std(servicer.Join, _lenient(pb.JoinRequest), pb.ShardInfo.SerializeToString),
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

