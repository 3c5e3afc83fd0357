"""Parameter-server benchmark: one push + pull round vs message size, beside its transport ceiling.

Same records as the collective benchmark (``impl, world_size, bytes, time_s, algbw, busbw,
correct``) with ``impl`` = ``ps_k{k}`` (k server shards, sync mode), ``grpc_raw`` (the same
1 MiB-chunk streams against one server that neither stores nor updates anything, with messages
built once: what gRPC in Python carries) and ``native`` (the backend's all-reduce, n >= 2).
``time_s`` is the slowest worker's round (push, then pull), median over iterations each started
after a barrier; algbw = bytes / time_s (time to synchronize a buffer, comparable across impls);
busbw = bytes each worker sends / time_s (PS and raw: bytes; all-reduce: 2(n-1)/n bytes).

The raw stream and every ``ps_k`` of one (world size, size) run in the same world, their rounds
interleaved (the order rotating every iteration), so that the machine's drift, which is larger
than the differences measured, falls on all of them alike: ``paired`` holds each record's median
ratio of round times against every other impl of its world. Every record carries its algorithm's
fraction of the alpha-beta bound on the link, which two ranks calibrate first (testbed.bench.bound).
``--bandwidth`` puts every worker and server (the raw one included) on its own emulated link.

  python -m testbed.bench.ps --workers 1,2,4 --servers 1,2,4 --sizes 1M,16M,64M --out ps.json
  python -m testbed.bench.ps --workers 4 --servers 1,2,4 --sizes 16M --bandwidth 1gbit --no-native
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import grpc
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from testbed.bench.bound import algorithm_cost, bound_fraction, probe_sizes, probe_world_rank
from testbed.bench.collectives import bench_rank, default_iters
from testbed.bench.table import format_results, human, parse_bytes
from testbed.collectives import chunk_bounds
from testbed.costs import Link
from testbed.latency import link_delay
from testbed.launch.spawn import RankFailure, spawn_world
from testbed.netem import EmulatedNetwork, NetworkUnavailable, enter_rank_namespace, parse_rate
from testbed.ps import parameter_server_pb2 as pb
from testbed.ps import parameter_server_pb2_grpc as pb_grpc
from testbed.ps.client import PsClient
from testbed.ps.launch import LocalServers, wait_healthy, wait_port_file
from testbed.ps.wire import CHANNEL_OPTIONS, auth_metadata, chunks, keep_freed_memory

CHUNK_BYTES = 1 << 20
SGD = {"name": "sgd", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False}
RAW = "grpc_raw"


def _timed_round(run_round: Callable[[], None]) -> float:
    """The slowest worker's time for one round started after a barrier."""
    dist.barrier()
    start = time.perf_counter()
    run_round()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _all_true(flag: bool) -> bool:
    failed = torch.tensor([0.0 if flag else 1.0])
    dist.all_reduce(failed)
    return bool(failed.item() == 0)


class _PsRounds:
    """One ``ps_k`` of the world: rounds of push(grad = rank + 1) then pull, in sync mode with
    SGD(lr=1) from zeros, so that after c rounds every parameter is exactly -c (n + 1) / 2."""

    def __init__(self, addresses: list[str], token: str, numel: int) -> None:
        rank, k = dist.get_rank(), len(addresses)
        self.client = PsClient(addresses, token, rank, timeout_s=300.0, chunk_bytes=CHUNK_BYTES)
        self.params = torch.zeros(numel)
        bounds = chunk_bounds(numel, k)
        self.param_shards = [self.params[lo:hi] for lo, hi in bounds]
        grads = torch.full((numel,), float(rank + 1))
        self.grad_shards = [grads[lo:hi] for lo, hi in bounds]
        self.client.register(wait_s=60)
        if rank == 0:
            self.client.init_params(self.param_shards)
        dist.barrier()
        self.versions = self.client.pull(self.param_shards, 0).versions
        self.clock = 0

    def __call__(self) -> None:
        self.client.push(self.grad_shards, self.versions)
        self.clock += 1
        self.versions = self.client.pull(self.param_shards, self.clock).versions

    def correct(self) -> bool:
        return bool(torch.all(self.params == -self.clock * (dist.get_world_size() + 1) / 2))

    def close(self) -> None:
        self.client.close()


class _RawRounds:
    """The raw stream: the same chunked push and pull against the raw server, messages built once."""

    def __init__(self, address: str, nbytes: int) -> None:
        self.rank, self.nbytes = dist.get_rank(), nbytes
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.meta = auth_metadata("raw")  # the raw server checks nothing
        self.messages = list(chunks(torch.zeros(nbytes // 4), 0, self.rank, 0, CHUNK_BYTES))
        self.received = 0

    def __call__(self) -> None:
        link_delay()  # the emulated latency per request, as PsClient pays it
        self.stub.Push(iter(self.messages), timeout=300, metadata=self.meta, wait_for_ready=True)
        link_delay()
        pull = self.stub.Pull(pb.PullRequest(worker=self.rank, clock=self.nbytes), timeout=300, metadata=self.meta)
        self.received = sum(len(c.data) for c in pull)

    def correct(self) -> bool:
        return self.received == self.nbytes

    def close(self) -> None:
        self.channel.close()


def _record(impl: str, n: int, nbytes: int, times: list[float], correct: bool) -> dict[str, Any]:
    median = statistics.median(times)
    return {"impl": impl, "world_size": n, "bytes": nbytes, "time_s": median, "time_min_s": min(times),
            "algbw": nbytes / median, "busbw": nbytes / median, "correct": correct, "iters": len(times)}


@record
def bench_worker(raw_address: str, servers: dict[str, tuple[list[str], str]], nbytes: int, warmup: int,
                 iters: int) -> list[dict[str, Any]] | None:
    """One worker of the world: the raw stream and every ``servers`` impl (name: addresses, token),
    their rounds interleaved; returns the records on rank 0."""
    enter_rank_namespace()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    keep_freed_memory()
    rounds: dict[str, _RawRounds | _PsRounds] = {}
    try:
        rounds[RAW] = _RawRounds(raw_address, nbytes)
        for impl, (addresses, token) in servers.items():
            rounds[impl] = _PsRounds(addresses, token, nbytes // 4)
        impls = list(rounds)
        times: dict[str, list[float]] = {impl: [] for impl in impls}
        for i in range(warmup + iters):
            for j in range(len(impls)):  # rotated, so that no impl always follows the same one
                impl = impls[(i + j) % len(impls)]
                elapsed = _timed_round(rounds[impl])
                if i >= warmup:
                    times[impl].append(elapsed)
        correct = {impl: _all_true(r.correct()) for impl, r in rounds.items()}
        if dist.get_rank() != 0:
            return None
        records = []
        for impl in impls:
            rec = _record(impl, dist.get_world_size(), nbytes, times[impl], correct[impl])
            rec["paired"] = {other: statistics.median(a / b for a, b in zip(times[impl], times[other]))
                             for other in impls if other != impl}
            records.append(rec)
        return records
    finally:
        for r in rounds.values():
            r.close()
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


def serve_raw(port_file: str, host: str) -> None:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    keep_freed_memory()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=CHANNEL_OPTIONS)
    pb_grpc.add_ParameterServerServicer_to_server(RawServicer(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(f"{host}:0")
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


@contextmanager
def raw_server(logs: Path, network: EmulatedNetwork | None) -> Iterator[str]:
    """The raw server's process (on its own emulated host with ``network``); yields its address."""
    port_file = logs / "raw.port"
    port_file.unlink(missing_ok=True)
    prefix, host = [], "127.0.0.1"
    if network:
        endpoint = network.endpoints["raw"]
        prefix, host = ["ip", "netns", "exec", endpoint.namespace], endpoint.address
    proc = subprocess.Popen([*prefix, sys.executable, "-m", "testbed.bench.ps", "--serve-raw", str(port_file),
                             "--raw-host", host])
    try:
        address = f"{host}:{wait_port_file(proc, port_file, time.monotonic() + 60, 'raw gRPC server', 'its output is above')}"
        if not network:  # the launcher cannot reach into a namespace; workers wait for it instead
            wait_healthy(address, 30, "raw server")
        yield address
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def run_world(n: int, ks: list[int], nbytes: int, warmup: int, iters: int, logs: Path,
              network: EmulatedNetwork | None) -> list[dict[str, Any]]:
    """One world of n workers: the raw server and, per k, k fresh sync shards (their own hosts on
    ``network``: s0, s1, ... in order), all up at once."""
    with ExitStack() as stack:  # servers stop before the next world's start
        raw = stack.enter_context(raw_server(logs, network))
        servers, first = {}, 0
        for k in ks:
            hosts = None
            if network:
                hosts = [(network.endpoints[f"s{s}"].namespace, network.endpoints[f"s{s}"].address)
                         for s in range(first, first + k)]
            cfg = {"servers": k, "mode": "sync", "staleness": 0, "chunk_kb": CHUNK_BYTES // 1024, "host": "127.0.0.1"}
            shards = stack.enter_context(LocalServers(cfg, SGD, n, logs / f"ps-n{n}-k{k}", hosts))
            servers[f"ps_k{k}"] = (shards.addresses, shards.token)
            first += k
        env = network.rank_env(n) if network else {}
        return spawn_world(bench_worker, (raw, servers, nbytes, warmup, iters or default_iters(nbytes)), n, logs,
                           env=env)[0]


def bound_scaling(rec: dict[str, Any], link: Link) -> float:
    """ps_k1's bound time over this ps_k's, at the record's n and size: the speedup k shards can give."""
    n, nbytes = int(rec["world_size"]), float(rec["bytes"])
    cost = algorithm_cost(rec["impl"], n, nbytes, link)
    one = algorithm_cost("ps_k1", n, nbytes, link)
    assert cost is not None and one is not None
    return one.time(link) / cost.time(link)


def scaling_lines(records: list[dict[str, Any]]) -> list[str]:
    """Per (n, size): each ps_k's speedup over ps_k1 from the paired rounds, beside its bound's."""
    lines = []
    for rec in records:
        if rec["impl"].startswith("ps_k") and rec["impl"] != "ps_k1" and "ps_k1" in rec.get("paired", {}):
            ideal = rec.get("bound_scaling")
            lines.append(f"n={rec['world_size']} {human(rec['bytes'])}: {rec['impl']} {1 / rec['paired']['ps_k1']:.2f}x ps_k1"
                         + (f" (bound {ideal:.2f}x)" if ideal else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.bench.ps", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--servers", default="1,2,4")
    parser.add_argument("--sizes", default="1M,16M,64M")
    parser.add_argument("--iters", type=int, default=0, help="timed rounds per point (0: by size)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-native", action="store_true", help="skip the all-reduce baseline")
    parser.add_argument("--bandwidth", default="", help="emulate links of this rate (e.g. 1gbit): one namespace per worker and server")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="with --bandwidth: added per request by the testbed's senders")
    parser.add_argument("--out", default="")
    parser.add_argument("--serve-raw", default="", help=argparse.SUPPRESS)
    parser.add_argument("--raw-host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_raw:
        serve_raw(args.serve_raw, args.raw_host)
        return 0
    workers = sorted({int(s) for s in args.workers.split(",") if s})
    servers = sorted({int(s) for s in args.servers.split(",") if s})
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    if min(workers + servers) < 1 or any(s % 4 for s in sizes):
        parser.error("--workers and --servers must be >= 1; --sizes multiples of 4 bytes")
    if args.bandwidth:
        try:
            parse_rate(args.bandwidth)
        except ValueError as exc:
            parser.error(f"--bandwidth: {exc}")
    records: list[dict[str, Any]] = []
    impls = [RAW, *(f"ps_k{k}" for k in servers)] + ([] if args.no_native else ["native"])
    # Ranks r0, r1 at least (the link is calibrated between two), the raw server, then every shard.
    endpoints = [f"r{r}" for r in range(max(2, *workers))] + ["raw"] + [f"s{s}" for s in range(sum(servers))]
    network = EmulatedNetwork(endpoints, args.bandwidth, args.latency_ms) if args.bandwidth else None
    with tempfile.TemporaryDirectory(prefix="testbed-bench-ps-") as tmp, network or nullcontext():
        logs = Path(tmp)
        try:
            env = network.rank_env(2) if network else {}
            link = Link(*spawn_world(probe_world_rank, (probe_sizes(sizes), args.iters or 5), 2, logs, env=env)[0])
            for n in workers:
                measured = []
                for nbytes in sizes:
                    measured += run_world(n, servers, nbytes, args.warmup, args.iters, logs, network)
                if n > 1 and not args.no_native:
                    measured += spawn_world(bench_rank, (sizes, ["native"], args.iters, args.warmup, 1024, "gloo"), n, logs,
                                            env=network.rank_env(n) if network else {})[0]
                for rec in measured:  # the all-reduce baseline's came with its own calibration
                    rec["link"] = args.bandwidth or "loopback"
                    if "bound_fraction" not in rec:
                        rec.update(bound_fraction=bound_fraction(rec, link), link_alpha_s=link.alpha, link_beta_s=link.beta)
                    if rec["impl"].startswith("ps_k"):
                        rec["bound_scaling"] = bound_scaling(rec, link)
                records += measured
                if args.out:  # after each world size, so a later failure keeps what was measured
                    Path(args.out).write_text(json.dumps(records, indent=1) + "\n")
        except (RankFailure, NetworkUnavailable) as failure:
            print(f"benchmark failed: {failure}", file=sys.stderr)
            return 1
    print(format_results(records, impls))
    print("\n".join(scaling_lines(records)))
    return 0 if all(r["correct"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
