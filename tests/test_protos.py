"""The committed generated code is what scripts/gen_protos.sh makes from protos/ today."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO

GENERATED = ("parameter_server_pb2.py", "parameter_server_pb2.pyi", "parameter_server_pb2_grpc.py")


def test_generated_code_is_current(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", "scripts/gen_protos.sh", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    for name in GENERATED:
        fresh = (tmp_path / name).read_text()
        assert fresh == (REPO / "testbed" / "ps" / name).read_text(), f"{name} is stale: run scripts/gen_protos.sh"
