"""Dependencies point down: importing a module loads nothing from the layers above it.

Each rule imports one module in a fresh interpreter and lists what ``sys.modules`` must not hold.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RULES = {
    # The synchronizer protocol and every synchronizer's declaration: no gRPC until a rank builds one.
    "testbed.sync.base": ("grpc", "testbed.ps.client"),
    "testbed.sync": ("grpc", "testbed.ps.client", "testbed.netem"),
    "testbed.config": ("grpc", "testbed.launch", "testbed.netem"),
    # The trainer knows neither the launcher nor how synchronizers are picked.
    "testbed.trainer": ("testbed.launch", "grpc"),
    # Results are read and written without synchronizers, launchers or gRPC.
    "testbed.results.summary": ("testbed.sync", "testbed.launch", "grpc"),
    "testbed.results.table": ("testbed.sync", "testbed.launch", "torch"),
    # Collectives and the PS client add link latency without the namespace code (ctypes' setns).
    "testbed.collectives": ("testbed.netem", "testbed.launch"),
    "testbed.ps.client": ("testbed.netem", "testbed.sync", "testbed.launch"),
    "analysis.load": ("testbed.sync", "testbed.launch", "grpc"),
}


@pytest.fixture(scope="module")
def loaded() -> dict[str, set[str]]:
    """The modules each import loads, from one fresh interpreter per rule (started together)."""
    code = "import importlib, json, sys; importlib.import_module(sys.argv[1]); print(json.dumps(sorted(sys.modules)))"
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = {module: subprocess.Popen([sys.executable, "-c", code, module], **pipes) for module in RULES}
    out = {}
    for module, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-2000:]
        out[module] = set(json.loads(stdout))
    return out


@pytest.mark.parametrize("module", list(RULES))
def test_imports_point_down(loaded: dict[str, set[str]], module: str) -> None:
    banned = [m for m in loaded[module] if any(m == b or m.startswith(f"{b}.") for b in RULES[module])]
    assert not banned, f"import {module} loads {sorted(banned)}"
