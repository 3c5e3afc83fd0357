"""Launching: joining a torchrun world, a crashed rank reported by rank without a hang, and a local
job that nothing beyond loopback can reach."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from conftest import cli_env, read_json, read_jsonl, wait_for_steps


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--log-dir={cwd / 'torchrun-logs'}", "-m", "testbed", *args]
    return subprocess.run(cmd, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=300)


def test_joins_a_torchrun_world(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = torchrun(["world_size=2", "sync=ring", "steps=6", "warmup_steps=1", f"hydra.run.dir={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(out / "summary.json")
    assert summary["status"] == "ok" and summary["world_size"] == 2 and summary["replicas_identical"]
    assert not (out / "logs").exists()  # nothing spawned by the testbed: torchrun's ranks were used
    assert len(read_jsonl(out / "metrics" / "rank1.jsonl")) == 6


def test_torchrun_world_size_mismatch_is_a_config_error(tmp_path: Path) -> None:
    proc = torchrun(["world_size=4", f"hydra.run.dir={tmp_path / 'job'}"], tmp_path)
    assert proc.returncode != 0
    assert "world_size=4 but the surrounding torchrun/Slurm world has 2 ranks; set world_size=2" in proc.stderr


def test_torchrun_needs_an_explicit_job_dir(tmp_path: Path) -> None:
    proc = torchrun(["world_size=2"], tmp_path)
    assert proc.returncode != 0 and "pass hydra.run.dir=<shared path>" in proc.stderr


def test_killed_rank_fails_the_run_by_rank_and_keeps_metrics(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = subprocess.Popen(
        [sys.executable, "-m", "testbed", "world_size=2", "sync=ring", "steps=100000", f"hydra.run.dir={out}",
         "timeouts.collective_s=30"],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_steps(out)
        logs = list((out / "logs").glob("*/attempt_0/1/stdout.log"))
        pid = int(re.search(r"rank 1/2 pid (\d+)", logs[0].read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 1
    summary = read_json(out / "summary.json")
    assert summary["status"] == "failed"
    assert summary["error"]["rank"] == 1 and "SIGKILL" in summary["error"]["message"]
    assert summary["steps"] >= 3  # the steps both ranks finished are kept and summarised
    assert len(read_jsonl(out / "metrics" / "rank0.jsonl")) >= 3
    assert "failed" in stdout


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" ", 1)
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(rest.rsplit(")", 1)[1].split()[1]), []).append(int(pid))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def _listening(pids: set[int]) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN that one of ``pids`` holds, from /proc."""
    owner = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owner[int(link[8:-1])] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            (address, port), state, inode = fields[1].split(":"), fields[3], int(fields[9])
            if state == "0A" and inode in owner:  # 0A: LISTEN; the address is 32-bit words, each little-endian
                raw = bytes.fromhex(address)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.append((ipaddress.ip_address(words), int(port, 16), owner[inode]))
    return found


def test_nothing_of_a_local_job_listens_beyond_loopback(tmp_path: Path) -> None:
    """The launcher's rendezvous, the ranks' store, Gloo and the parameter servers: none of them
    has authentication but the servers' token, so none may be reachable from another machine."""
    out = tmp_path / "job"
    proc = subprocess.Popen(
        [sys.executable, "-m", "testbed", "world_size=2", "sync=ps", "steps=100000", f"hydra.run.dir={out}"],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        wait_for_steps(out)
        sockets = _listening(_descendants(proc.pid))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    # Each rank's Gloo listener, rank 0's store and the parameter server, at least.
    assert len(sockets) >= 4, sockets
    beyond = [(a, port, pid) for a, port, pid in sockets
              if not (a.is_loopback or (a.version == 6 and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback))]
    assert not beyond, f"listening beyond loopback: {beyond}"
