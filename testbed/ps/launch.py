"""Start the parameter-server shards of one run on this machine, and stop them, whatever happens.

Each shard is a fresh ``python -m testbed.ps.server`` process (not a fork: gRPC and fork do not
mix), bound to loopback unless ``sync.host`` says otherwise, on a port it picks itself. The run
is healthy when every shard answers the standard gRPC health check with SERVING. On an emulated
network each shard runs in its own namespace (``ip netns exec``) on its emulated address; the
launcher cannot reach it there, so the port file, written once the server is serving, is the sign.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from testbed.faults import PS_PIDS_ENV
from testbed.ps.wire import TOKEN_ENV, open_channel, tls_of


class ServerStartError(RuntimeError):
    pass


class LocalServers:
    """k shard processes; use as a context manager so they are stopped also when the run fails."""

    def __init__(
        self, sync_cfg: dict[str, Any], optim_cfg: dict[str, Any], workers: int, log_dir: Path,
        hosts: list[tuple[str, str]] | None = None, checkpoint: tuple[Path, int] | None = None,
        restore: Path | None = None, compress: dict[str, Any] | None = None, seed: int = 0,
    ) -> None:
        """``hosts``: (network namespace, address) per shard on an emulated network; ``checkpoint``:
        (directory, every) for checkpoints; ``restore``: a checkpoint step directory whose
        ``ps<shard>.pt`` each shard starts from; ``compress``: the workers' codec config (and
        ``seed`` the run's), whose payloads the shards decode."""
        self.sync_cfg, self.optim_cfg, self.workers, self.log_dir = sync_cfg, optim_cfg, workers, log_dir
        self.hosts, self.checkpoint, self.restore = hosts, checkpoint, restore
        self.compress = compress if compress and compress.get("name", "none") != "none" else None
        self.seed = seed
        self.token = secrets.token_hex(16)
        self.procs: list[subprocess.Popen] = []
        self.addresses: list[str] = []

    def __enter__(self) -> LocalServers:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, TOKEN_ENV: self.token, "OMP_NUM_THREADS": "1"}
        port_files, hosts = [], []
        for shard in range(self.sync_cfg["servers"]):
            prefix, host = [], self.sync_cfg["host"]
            if self.hosts is not None:
                namespace, host = self.hosts[shard]
                prefix = ["ip", "netns", "exec", namespace]
            hosts.append(host)
            port_file = self.log_dir / f"ps{shard}.port"
            port_file.unlink(missing_ok=True)
            port_files.append(port_file)
            cmd = [
                *prefix, sys.executable, "-m", "testbed.ps.server", "--shard", str(shard), "--workers", str(self.workers),
                "--mode", self.sync_cfg["mode"], "--staleness", str(self.sync_cfg["staleness"]),
                "--optim", json.dumps(self.optim_cfg), "--host", host, "--port", "0",
                "--port-file", str(port_file), "--chunk-kb", str(self.sync_cfg["chunk_kb"]),
            ]
            cert, key, _ = tls_of(self.sync_cfg)
            if cert:
                cmd += ["--tls-cert", cert, "--tls-key", key]
            if self.checkpoint:
                cmd += ["--checkpoint-dir", str(self.checkpoint[0]), "--checkpoint-every", str(self.checkpoint[1])]
            if self.restore:
                cmd += ["--restore", str(self.restore / f"ps{shard}.pt")]
            if self.sync_cfg.get("stream_timeout_s"):
                cmd += ["--stream-timeout-s", str(self.sync_cfg["stream_timeout_s"])]
            if self.sync_cfg.get("sums_only"):
                cmd.append("--sums-only")
            if self.sync_cfg.get("backup_workers"):
                cmd += ["--backup-workers", str(self.sync_cfg["backup_workers"])]
            if self.compress:
                cmd += ["--compress", json.dumps(self.compress), "--seed", str(self.seed)]
            log = open(self.log_dir / f"ps{shard}.log", "w")
            self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        deadline = time.monotonic() + timeout_s
        for shard, (proc, port_file) in enumerate(zip(self.procs, port_files)):
            port = wait_port_file(proc, port_file, deadline, f"ps shard {shard}", f"see {self.log_dir}/ps{shard}.log")
            host = hosts[shard]
            self.addresses.append(f"{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}")
        if self.hosts is not None:
            return
        for shard, address in enumerate(self.addresses):
            wait_healthy(address, max(1.0, deadline - time.monotonic()), f"ps shard {shard}", tls_of(self.sync_cfg)[2])

    def rank_env(self) -> dict[str, str]:
        """What the ranks inherit: the token (kept out of the config) and, for fault=kill_ps, the pids."""
        return {TOKEN_ENV: self.token, PS_PIDS_ENV: json.dumps([proc.pid for proc in self.procs])}

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate every shard (SIGTERM, then SIGKILL after ``grace_s``) and reap it."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def wait_port_file(proc: subprocess.Popen, port_file: Path, deadline: float, name: str, hint: str) -> str:
    """The port a server process writes to ``port_file`` once it serves, by ``deadline`` (monotonic)."""
    while not port_file.exists():
        if proc.poll() is not None:
            raise ServerStartError(f"{name} exited with code {proc.returncode}; {hint}")
        if time.monotonic() > deadline:
            raise ServerStartError(f"{name} did not start in time; {hint}")
        time.sleep(0.05)
    return port_file.read_text()


def wait_healthy(address: str, timeout_s: float, name: str, tls_ca: str | None = None) -> None:
    """Block until ``address`` reports SERVING on the standard gRPC health service."""
    deadline = time.monotonic() + timeout_s
    with open_channel(address, tls_ca) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as err:
                last = f"{err.code().name}: {err.details()}"
            else:
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            if time.monotonic() > deadline:
                raise ServerStartError(f"{name} at {address} not healthy within {timeout_s:.0f}s ({last})")
            time.sleep(0.05)
