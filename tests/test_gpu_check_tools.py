"""The CUDA check's tools on CPU: the timing benchmark runs both ways, the staging benchmark refuses
without a GPU, and docs/gpu.md shows the committed report's numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from analysis.gpu_report import markdown
from testbed.bench import staging, sync_timing

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.unit


def test_sync_timing_reads_events_and_brackets_of_the_same_codec_steps() -> None:
    result = sync_timing.measure(["device=cpu", "sync=allreduce", "compress=powersgd", "model.hidden=64"], steps=8)
    events, bracketed = result["events"], result["bracketed"]
    assert events["t_sync"] > 0 and bracketed["t_sync"] > 0
    # PowerSGD runs at world_size=1 (a codec changes the gradients): its encode and decode are timed in both runs.
    assert events["t_encode"] > 0 and bracketed["t_encode"] > 0 and events["t_decode"] > 0
    assert events["t_encode"] + events["t_decode"] <= events["t_sync"]
    assert result["ratio"] == pytest.approx(events["t_sync"] / bracketed["t_sync"])
    assert not torch.distributed.is_initialized()  # the process group it made is gone


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_staging_refuses_without_a_gpu() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        staging.measure([1.0], repeats=1)


def test_gpu_page_shows_the_committed_report() -> None:
    """Every table row rendered from docs/gpu/gpu_check.json is on docs/gpu.md, as rendered."""
    report = json.loads((ROOT / "docs" / "gpu" / "gpu_check.json").read_text())
    rows = [line for line in markdown(report).splitlines() if re.match(r"\| [a-z0-9]", line)]
    assert len(rows) >= 20
    page = (ROOT / "docs" / "gpu.md").read_text()
    missing = [row for row in rows if row not in page]
    assert not missing, f"docs/gpu.md lacks rows of its report; rerender them with python -m analysis.gpu_report --markdown docs/gpu.md docs/gpu/gpu_check.json: {missing}"
