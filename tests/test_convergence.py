"""On real data (scikit-learn digits) data-parallel training learns."""

from __future__ import annotations

from pathlib import Path

from conftest import read_json, run_cli


def test_digits_ring_learns(tmp_path: Path) -> None:
    out = tmp_path / "job"
    proc = run_cli(["data=digits", "model=mlp", "model.hidden=64", "sync=ring", "world_size=2", "steps=120",
                    "optim.lr=0.1", f"hydra.run.dir={out}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = read_json(out / "summary.json")
    assert summary["loss_first"] > 2.0  # chance level for 10 classes is ln 10 = 2.30
    assert summary["final_loss"] < 0.3
