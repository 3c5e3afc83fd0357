"""One parameter-server shard: a flat range of the parameters and the optimizer that updates it.

This module is the shard process: its command line and ``serve``. The shard's state is
testbed.ps.shard, its modes (``--mode``, ``--sums-only``) testbed.ps.policies, the gRPC service
testbed.ps.service, its checkpoints testbed.ps.shard_checkpoint.

Run one shard:  TESTBED_PS_TOKEN=... python -m testbed.ps.server --shard 0 --workers 4 --mode sync
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from dataclasses import asdict
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from omegaconf import OmegaConf

from testbed.optim import SgdConfig
from testbed.ps.modes import CHUNK_KB, MODES, STALENESS
from testbed.ps.service import STREAM_TIMEOUT_S, Servicer, TokenInterceptor, add_servicer
from testbed.ps.shard import Shard
from testbed.ps.shard_checkpoint import restore
from testbed.ps.wire import CHANNEL_OPTIONS, keep_freed_memory, token_from_env

log = logging.getLogger("testbed.ps.server")


def serve(args: argparse.Namespace) -> None:
    token = token_from_env()
    optim_cfg = OmegaConf.create(json.loads(args.optim))
    compress = OmegaConf.create(json.loads(args.compress)) if args.compress else None
    shard = Shard(args.shard, args.workers, args.mode, args.staleness, optim_cfg, args.chunk_kb * 1024, compress, args.seed,
                  args.sums_only, args.backup_workers)
    if args.checkpoint_dir:
        shard.checkpoint_dir, shard.checkpoint_every = Path(args.checkpoint_dir), args.checkpoint_every
    if args.restore:
        restore(shard, Path(args.restore))
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
        shard.close()  # calls waiting (for workers that may be gone) are refused at once
        server.stop(grace=2.0).wait()  # those transferring get the grace to finish
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
    parser.add_argument("--backup-workers", type=int, default=0,
                        help="sync: each step's update takes the first workers - b pushes (the workers decide which)")
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
