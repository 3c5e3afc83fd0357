"""TensorChunk codec A/B: testbed.ps.wire's hand codec against the generated parameter_server_pb2 classes.

Each codec does what the shard and its clients do with it. encode: a payload's chunk stream into
the bytes gRPC sends (hand: ``encoded_chunks``, one copy; pb2: ``TensorChunk(data=bytes(slice))``
then ``SerializeToString``). decode: those bytes parsed and copied into a tensor, as Push does into
its staging row and a pull into the worker's parameters (hand: ``decode_chunk``, the payload a view
of the message; pb2: ``TensorChunk.FromString``). push+pull: one round through a shard process
(testbed.ps.shard's Shard, testbed.ps.service's Servicer; sync, one worker, 1 MiB chunks) speaking
the codec on both ends: add_servicer's ``decode``/``encode`` and, for pb2, Shard.pull_messages
overridden.
Medians over --reps, the codecs interleaved; pb2/hand > 1: the hand codec is faster.

  python -m testbed.bench.wire [--sizes 1M,16M,64M] [--reps 15] [--no-round-trip]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError

from testbed.bench.table import human, parse_bytes
from testbed.optim import SgdConfig
from testbed.ps import parameter_server_pb2 as pb
from testbed.ps.launch import wait_healthy
from testbed.ps.service import Servicer, add_servicer
from testbed.ps.shard import Shard
from testbed.ps.wire import (
    CHANNEL_OPTIONS,
    SERVICE,
    TO_WIRE,
    Chunk,
    byte_view,
    chunk_ranges,
    copy_in,
    decode_chunk,
    encoded_chunks,
    keep_freed_memory,
    passthrough,
)
from testbed.results.format import rows_frame, text_table

CHUNK_BYTES = 1 << 20  # the default --chunk-kb
SGD = SgdConfig(lr=1.0, momentum=0.0)


def pb2_chunks(flat: torch.Tensor, shard: int, worker: int, step: int, chunk_bytes: int) -> Iterator[pb.TensorChunk]:
    """The chunk stream as generated message objects (what a pb2 client or shard would yield)."""
    view, esize, dtype = byte_view(flat), flat.element_size(), TO_WIRE[flat.dtype]
    for offset, length in chunk_ranges(flat.numel(), esize, chunk_bytes):
        data = bytes(view[offset * esize : (offset + length) * esize])
        yield pb.TensorChunk(worker=worker, shard=shard, offset=offset, length=length, dtype=dtype, step=step, data=data)


def pb2_decode(message: bytes) -> Chunk:
    """TensorChunk.FromString as the shard's request deserializer must be: never raising."""
    try:
        m = pb.TensorChunk.FromString(message)
    except DecodeError as exc:
        return Chunk(malformed=f"malformed TensorChunk: {exc}")
    return Chunk(m.worker, m.shard, m.offset, m.length, m.dtype, m.step, m.data)


@dataclass(frozen=True)
class Codec:
    """The chunk messages of a tensor, how gRPC serializes them, how it parses what arrives."""

    name: str
    messages: Callable[[torch.Tensor, int, int, int, int], Iterator[Any]]  # flat, shard, worker, step, chunk_bytes
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


CODECS = {
    "hand": Codec("hand", lambda flat, *rest: encoded_chunks(flat, *rest, byte_view(flat)), passthrough, decode_chunk),
    "pb2": Codec("pb2", pb2_chunks, pb.TensorChunk.SerializeToString, pb2_decode),
}


class Pb2Shard(Shard):
    """The shard with its pulls sent as generated messages."""

    def pull_messages(self, source: torch.Tensor, version: int) -> Iterator[pb.TensorChunk]:
        return pb2_chunks(source, self.shard, 0, version, self.chunk_bytes)


# --- encode / decode in this process ------------------------------------------------------------


def encode_stream(codec: Codec, flat: torch.Tensor) -> list[bytes]:
    return [codec.encode(m) for m in codec.messages(flat, 0, 0, 0, CHUNK_BYTES)]


def decode_stream(codec: Codec, messages: list[bytes], into: torch.Tensor) -> None:
    for message in messages:
        chunk = codec.decode(message)
        copy_in(into, chunk.offset, chunk.data)


def timed(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench_codecs(nbytes: int, reps: int) -> dict[str, tuple[float, float]]:
    """Median (hand, pb2) seconds per chunk stream to encode and to decode; checks that both agree."""
    flat = torch.arange(nbytes // 4, dtype=torch.float32)
    into = torch.empty_like(flat)
    wire = {name: encode_stream(codec, flat) for name, codec in CODECS.items()}
    assert wire["hand"] == wire["pb2"], "the codecs must write the same bytes"
    times: dict[str, dict[str, list[float]]] = {"encode": {n: [] for n in CODECS}, "decode": {n: [] for n in CODECS}}
    for _ in range(reps):
        for name, codec in CODECS.items():  # interleaved, so a busy moment hits both
            times["encode"][name].append(timed(encode_stream, codec, flat))
            into.zero_()
            times["decode"][name].append(timed(decode_stream, codec, wire[name], into))
            assert torch.equal(into, flat), f"{name} decoded wrong values"
    return {op: (statistics.median(by["hand"]), statistics.median(by["pb2"])) for op, by in times.items()}


# --- push + pull through shard processes ---------------------------------------------------------


def serve(codec_name: str, port_file: str, count: int) -> None:
    """``count`` shards (sync, one worker, SGD lr 1), each on its own port, speaking ``codec_name``;
    writes the ports, comma-separated, to ``port_file`` and runs until killed."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    torch.set_num_threads(1)
    keep_freed_memory()
    codec = CODECS[codec_name]
    servers, ports = [], []
    for _ in range(count):
        shard = (Pb2Shard if codec_name == "pb2" else Shard)(0, 1, "sync", 0, SGD, CHUNK_BYTES)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
        add_servicer(Servicer(shard, lambda: None), server, decode=codec.decode, encode=codec.encode)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        ports.append(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servers.append(server)
    tmp = Path(port_file + ".tmp")
    tmp.write_text(",".join(map(str, ports)))
    tmp.replace(port_file)
    servers[0].wait_for_termination()


class Link:
    """A client of one shard, speaking the shard's codec."""

    def __init__(self, codec: Codec, address: str) -> None:
        wait_healthy(address, 60, f"{codec.name} shard")
        self.codec, self.version = codec, 0
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.init = self.channel.stream_unary(f"/{SERVICE}/InitParams", codec.encode, pb.ShardInfo.FromString)
        self.push = self.channel.stream_unary(f"/{SERVICE}/Push", codec.encode, pb.PushReply.FromString)
        self.pull = self.channel.unary_stream(f"/{SERVICE}/Pull", pb.PullRequest.SerializeToString, codec.decode)

    def round(self, grad: torch.Tensor, params: torch.Tensor) -> None:
        """Push ``grad`` on the current version, then pull the update into ``params``."""
        self.push(self.codec.messages(grad, 0, 0, self.version, CHUNK_BYTES), timeout=300)
        self.version += 1
        for chunk in self.pull(pb.PullRequest(worker=0, shard=0, clock=self.version), timeout=300):
            copy_in(params, chunk.offset, chunk.data)


def start_shards(count: int, tmp: Path) -> tuple[list[subprocess.Popen], dict[str, list[Link]]]:
    """A shard process per codec, started together, holding ``count`` shards each."""
    procs = {name: subprocess.Popen([sys.executable, "-m", "testbed.bench.wire", "--serve", name, str(tmp / name), str(count)])
             for name in CODECS}
    links = {}
    deadline = time.monotonic() + 120
    for name, proc in procs.items():
        while not (tmp / name).exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {name} shard process did not start")
            time.sleep(0.05)
        links[name] = [Link(CODECS[name], f"127.0.0.1:{port}") for port in (tmp / name).read_text().split(",")]
    return list(procs.values()), links


def bench_round_trip(links: dict[str, Link], nbytes: int, reps: int) -> tuple[float, float]:
    """Median (hand, pb2) seconds of a push + pull to a fresh shard of ``nbytes``, the codecs interleaved."""
    numel = nbytes // 4
    params, grad = torch.zeros(numel), torch.ones(numel)
    for link in links.values():
        link.init(link.codec.messages(params, 0, 0, numel, CHUNK_BYTES), timeout=300)
    times: dict[str, list[float]] = {name: [] for name in links}
    for i in range(reps + 1):  # the first round warms up
        for name, link in links.items():
            elapsed = timed(link.round, grad, params)
            if i:
                times[name].append(elapsed)
            # SGD with lr 1 subtracts the gradient of ones once per round: exact integers.
            assert torch.all(params == -link.version), f"{name}: wrong parameters after round {link.version}"
    return statistics.median(times["hand"]), statistics.median(times["pb2"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.wire", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1M,16M,64M", help="payloads, comma-separated")
    parser.add_argument("--reps", type=int, default=15, help="repetitions per measurement (medians)")
    parser.add_argument("--no-round-trip", action="store_true", help="only encode and decode, no shard process")
    parser.add_argument("--serve", nargs=3, metavar=("CODEC", "PORT_FILE", "COUNT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve[0], args.serve[1], int(args.serve[2]))
        return 0
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    if args.reps < 1 or any(s <= 0 or s % 4 for s in sizes):
        parser.error("--reps must be >= 1, --sizes positive multiples of 4 bytes")
    torch.set_num_threads(1)
    keep_freed_memory()  # as PsClient and the shard do
    ops = ["encode", "decode"] + ([] if args.no_round_trip else ["push+pull"])
    columns = {"payload": "payload", "chunks": "chunks"}
    columns.update({f"{op} {c}": f"{op} {c}" for op in ops for c in ("hand ms", "pb2 ms", "pb2/hand")})
    two_decimals = {key: "{:.2f}".format for key in columns if key not in ("payload", "chunks")}
    rows = []
    procs: list[subprocess.Popen] = []
    links: dict[str, list[Link]] = {}
    with tempfile.TemporaryDirectory(prefix="testbed-bench-wire-") as tmp:
        try:
            if not args.no_round_trip:
                procs, links = start_shards(len(sizes), Path(tmp))
            for i, nbytes in enumerate(sizes):
                result = bench_codecs(nbytes, args.reps)
                if not args.no_round_trip:
                    result["push+pull"] = bench_round_trip({n: ls[i] for n, ls in links.items()}, nbytes, args.reps)
                row = {"payload": nbytes, "chunks": -(-nbytes // CHUNK_BYTES)}
                for op in ops:
                    hand, generated = result[op]
                    row.update({f"{op} hand ms": 1e3 * hand, f"{op} pb2 ms": 1e3 * generated, f"{op} pb2/hand": generated / hand})
                rows.append(row)
        finally:
            for link in (link for ls in links.values() for link in ls):
                link.channel.close()
            for proc in procs:
                proc.kill()
                proc.wait(timeout=10)
    print(text_table(rows_frame(rows, list(columns)), columns, {"payload": human, **two_decimals}, rule=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
