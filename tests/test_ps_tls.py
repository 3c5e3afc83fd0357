"""TLS between workers and parameter servers: a run over TLS trains as usual; a client without the
right certificate authority, or without TLS, is not served."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SGD, read_json, run_cli

from testbed.ps.client import PsClient, PsError
from testbed.ps.launch import LocalServers

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")


def make_authority(where: Path, name: str) -> tuple[Path, Path]:
    key, cert = where / f"{name}-ca.key", where / f"{name}-ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name} CA",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A certificate authority, a server certificate it signed for 127.0.0.1, and a stranger CA."""
    where = tmp_path_factory.mktemp("pki")
    ca_key, ca = make_authority(where, "testbed")
    _, stranger = make_authority(where, "stranger")
    key, csr, cert, ext = where / "server.key", where / "server.csr", where / "server.pem", where / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    subprocess.run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=ps", "-keyout", key, "-out", csr],
                   check=True, capture_output=True)
    subprocess.run(["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "1",
                    "-extfile", ext, "-out", cert], check=True, capture_output=True)
    return {"ca": ca, "cert": cert, "key": key, "stranger": stranger}


def test_a_run_over_tls_trains(tmp_path: Path, pki: dict[str, Path]) -> None:
    job = tmp_path / "job"
    proc = run_cli(["world_size=2", "sync=ps", "sync.servers=2", "steps=6", "warmup_steps=1", f"sync.tls_cert={pki['cert']}",
                    f"sync.tls_key={pki['key']}", f"sync.tls_ca={pki['ca']}", "launcher.echo_rank0=false",
                    f"hydra.run.dir={job}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and [s["pushes"] for s in summary["sync_facts"]["server_stats"]] == [12, 12]


@pytest.mark.parametrize("ca", [None, "stranger"])
def test_clients_without_the_authority_are_not_served(tmp_path: Path, pki: dict[str, Path], ca: str | None) -> None:
    cfg = {"servers": 1, "mode": "sync", "staleness": 0, "chunk_kb": 1, "host": "127.0.0.1",
           "tls_cert": str(pki["cert"]), "tls_key": str(pki["key"]), "tls_ca": str(pki["ca"])}
    with LocalServers(cfg, SGD, 1, tmp_path / "logs") as ps:
        trusted = PsClient(ps.addresses, ps.token, 0, timeout_s=10.0, chunk_bytes=1024, tls_ca=str(pki["ca"]))
        assert trusted.stats()[0].pushes == 0  # served over TLS
        trusted.close()
        other = PsClient(ps.addresses, ps.token, 0, timeout_s=3.0, chunk_bytes=1024, tls_ca=pki[ca] if ca else None)
        with pytest.raises(PsError, match="UNAVAILABLE"):
            other.stats()
        other.close()


def test_tls_without_an_authority_is_a_config_error(tmp_path: Path, pki: dict[str, Path]) -> None:
    proc = run_cli(["world_size=2", "sync=ps", f"sync.tls_cert={pki['cert']}", f"sync.tls_key={pki['key']}"], cwd=tmp_path)
    assert proc.returncode == 2 and "sync.tls_ca: TLS needs" in proc.stderr, proc.stderr[-2000:]
