"""Parameter-server benchmark: one push + pull round vs message size, beside its transport ceiling.

Same records as the collective benchmark (``impl, world_size, bytes, time_s, algbw, busbw,
correct``) with ``impl`` = ``ps_k{k}`` (k server shards, sync mode), ``grpc_raw`` (the same
1 MiB-chunk streams against a server that neither stores nor updates anything, with messages built
once: what gRPC in Python carries) and ``native`` (the backend's all-reduce, n >= 2). ``time_s``
is the slowest worker's round (push, then pull), median over iterations each started after a
barrier; algbw = bytes / time_s (time to synchronize a buffer, comparable across impls); busbw =
bytes each worker sends / time_s (PS and raw: bytes; all-reduce: 2(n-1)/n bytes). Every record
carries its algorithm's fraction of the alpha-beta bound on the link, which two ranks calibrate
first (testbed.bench.bound).

  python -m testbed.bench.ps --workers 1,2,4 --servers 1,2,4 --sizes 1M,16M,64M --out ps.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from testbed.bench.bound import bound_fraction, probe_sizes, probe_world_rank
from testbed.bench.collectives import bench_rank, default_iters
from testbed.bench.table import format_results, parse_bytes
from testbed.collectives import chunk_bounds
from testbed.launch.spawn import RankFailure, spawn_world
from testbed.ps import parameter_server_pb2 as pb
from testbed.ps import parameter_server_pb2_grpc as pb_grpc
from testbed.ps.client import PsClient
from testbed.ps.launch import LocalServers, wait_healthy
from testbed.ps.wire import CHANNEL_OPTIONS, TOKEN_ENV, auth_metadata, chunks, keep_freed_memory
from testbed.sim.costs import Link

CHUNK_BYTES = 1 << 20
SGD = {"name": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False}


def _rounds(run_round: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Slowest-worker time of each timed round."""
    times = []
    for i in range(warmup + iters):
        dist.barrier()
        start = time.perf_counter()
        run_round()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed.item()))
    return times


def _record(impl: str, n: int, nbytes: int, times: list[float], correct: bool) -> dict[str, Any]:
    median = statistics.median(times)
    return {"impl": impl, "world_size": n, "bytes": nbytes, "time_s": median, "time_min_s": min(times),
            "algbw": nbytes / median, "busbw": nbytes / median, "correct": correct, "iters": len(times)}


@record
def ps_worker(addresses: list[str], numel: int, warmup: int, iters: int) -> dict[str, Any] | None:
    """One worker: rounds of push(grad = rank + 1) then pull, in sync mode with SGD(lr=1) from zeros."""
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    k = len(addresses)
    client = PsClient(addresses, os.environ[TOKEN_ENV], rank, timeout_s=300.0, chunk_bytes=CHUNK_BYTES)
    try:
        params = torch.zeros(numel)
        grads = torch.full((numel,), float(rank + 1))
        bounds = chunk_bounds(numel, k)
        param_shards = [params[lo:hi] for lo, hi in bounds]
        grad_shards = [grads[lo:hi] for lo, hi in bounds]
        client.register(wait_s=60)
        if rank == 0:
            client.init_params(param_shards)
        dist.barrier()
        state = {"versions": client.pull(param_shards, 0).versions, "clock": 0}

        def run_round() -> None:
            client.push(grad_shards, state["versions"])
            state["clock"] += 1
            state["versions"] = client.pull(param_shards, state["clock"]).versions

        times = _rounds(run_round, warmup, iters)
        # Each round subtracts the mean gradient, (n + 1) / 2; exact in float32 for these sizes.
        correct = bool(torch.all(params == -state["clock"] * (n + 1) / 2))
        flag = torch.tensor([0.0 if correct else 1.0])
        dist.all_reduce(flag)
        return _record(f"ps_k{k}", n, numel * 4, times, bool(flag.item() == 0)) if rank == 0 else None
    finally:
        client.close()
        dist.destroy_process_group()


@record
def raw_worker(address: str, nbytes: int, warmup: int, iters: int) -> dict[str, Any] | None:
    """One worker against the raw server: the same streams, messages built once, nothing stored."""
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    keep_freed_memory()  # the same process tuning as PsClient, so the ceiling is comparable
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    stub = pb_grpc.ParameterServerStub(channel)
    meta = auth_metadata("raw")  # the raw server checks nothing
    messages = list(chunks(torch.zeros(nbytes // 4), 0, rank, 0, CHUNK_BYTES))
    received = [0]

    def run_round() -> None:
        stub.Push(iter(messages), timeout=300, metadata=meta)
        received[0] = sum(len(c.data) for c in stub.Pull(pb.PullRequest(worker=rank, clock=nbytes), timeout=300, metadata=meta))

    try:
        times = _rounds(run_round, warmup, iters)
        return _record("grpc_raw", n, nbytes, times, received[0] == nbytes) if rank == 0 else None
    finally:
        channel.close()
        dist.destroy_process_group()


class RawServicer(pb_grpc.ParameterServerServicer):
    """Consumes pushes and serves pulls from prebuilt messages: the transport alone.

    A pull's size in bytes travels in its ``clock`` field (this server keeps no clocks).
    """

    def __init__(self) -> None:
        self._messages: dict[int, list[pb.TensorChunk]] = {}

    def Push(self, request_iterator: Iterator[pb.TensorChunk], context: grpc.ServicerContext) -> pb.PushReply:  # noqa: N802
        for _ in request_iterator:
            pass
        return pb.PushReply()

    def Pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.TensorChunk]:  # noqa: N802
        nbytes = int(request.clock)
        if nbytes not in self._messages:
            self._messages[nbytes] = list(chunks(torch.zeros(nbytes // 4), 0, 0, 0, CHUNK_BYTES))
        yield from self._messages[nbytes]


def serve_raw(port_file: str) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    keep_freed_memory()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=CHANNEL_OPTIONS)
    pb_grpc.add_ParameterServerServicer_to_server(RawServicer(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


def run_raw(n: int, sizes: list[int], warmup: int, iters: int, logs: Path) -> list[dict[str, Any]]:
    port_file = logs / "raw.port"
    proc = subprocess.Popen([sys.executable, "-m", "testbed.bench.ps", "--serve-raw", str(port_file)])
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("raw gRPC server did not start")
            time.sleep(0.05)
        address = f"127.0.0.1:{port_file.read_text()}"
        wait_healthy(address, 30, "raw server")
        out = []
        for nbytes in sizes:
            result = spawn_world(raw_worker, (address, nbytes, warmup, iters or default_iters(nbytes)), n, logs)
            out.append(result[0])
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        port_file.unlink(missing_ok=True)


def run_ps(n: int, k: int, sizes: list[int], warmup: int, iters: int, logs: Path) -> list[dict[str, Any]]:
    out = []
    for nbytes in sizes:
        cfg = {"servers": k, "mode": "sync", "staleness": 0, "chunk_kb": CHUNK_BYTES // 1024, "host": "127.0.0.1"}
        with LocalServers(cfg, SGD, n, logs / f"ps-n{n}-k{k}") as servers:
            result = spawn_world(ps_worker, (servers.addresses, nbytes // 4, warmup, iters or default_iters(nbytes)), n,
                                 logs, env={TOKEN_ENV: servers.token})
        out.append(result[0])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.ps", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--sizes", default="1M,16M,64M")
    parser.add_argument("--iters", type=int, default=0, help="timed rounds per point (0: by size)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-native", action="store_true", help="skip the all-reduce baseline")
    parser.add_argument("--out", default="")
    parser.add_argument("--serve-raw", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_raw:
        serve_raw(args.serve_raw)
        return 0
    workers = [int(s) for s in args.workers.split(",") if s]
    servers = [int(s) for s in args.servers.split(",") if s]
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    if min(workers + servers) < 1 or any(s % 4 for s in sizes):
        parser.error("--workers and --servers must be >= 1; --sizes multiples of 4 bytes")
    records: list[dict[str, Any]] = []
    impls = ["grpc_raw", *(f"ps_k{k}" for k in servers)] + ([] if args.no_native else ["native"])
    with tempfile.TemporaryDirectory(prefix="testbed-bench-ps-") as tmp:
        logs = Path(tmp)
        try:
            link = Link(*spawn_world(probe_world_rank, (probe_sizes(sizes), args.iters or 5), 2, logs)[0])
            for n in workers:
                records += run_raw(n, sizes, args.warmup, args.iters, logs)
                for k in servers:
                    records += run_ps(n, k, sizes, args.warmup, args.iters, logs)
                if n > 1 and not args.no_native:
                    records += spawn_world(bench_rank, (sizes, ["native"], args.iters, args.warmup, 1024, "gloo"), n, logs)[0]
                for rec in records:  # the all-reduce baseline's came with its own calibration
                    if "bound_fraction" not in rec:
                        rec.update(bound_fraction=bound_fraction(rec, link), link_alpha_s=link.alpha, link_beta_s=link.beta)
                if args.out:  # after each world size, so a later failure keeps what was measured
                    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
        except RankFailure as failure:
            print(f"benchmark failed: {failure}", file=sys.stderr)
            return 1
    print(format_results(records, impls))
    return 0 if all(r["correct"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
