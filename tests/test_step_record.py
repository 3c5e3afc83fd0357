"""The step record: one set of fields for the trainer, the simulator, a resumed run and docs/results.md."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, step_record
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

from testbed import checkpoint
from testbed.data import RankBatches
from testbed.paths import config_dir
from testbed.results.step_log import StepLog, metrics_path
from testbed.sim.step import predict
from testbed.step_record import ALL_FIELDS, FIELDS, StepRecord
from testbed.sync import build_synchronizer
from testbed.trainer import Trainer
from testbed.world import World

pytestmark = pytest.mark.unit

# What only a real execution knows (testbed.step_record), and a codec's times in a run without one.
SIMULATED_NONE = {"loss", "lr", "bytes_sent", "bytes_recv", "t_sync_enter", "t_sync_exit", "t_encode", "t_decode"}


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """A real Gloo process group of one rank, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield World(0, 0, 1, 1, torch.device("cpu"), "gloo", 30.0)
    dist.destroy_process_group()


def documented_fields() -> list[str]:
    """The field names in the first column of docs/results.md's table of ``metrics/rank{r}.jsonl``."""
    text = (REPO / "docs" / "results.md").read_text()
    section = text.split("## `metrics/rank{r}.jsonl`", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [name for row in rows for name in re.findall(r"`(\w+)`", row)]


def test_the_results_contract_documents_every_field_and_no_other() -> None:
    documented = documented_fields()
    assert len(documented) == len(set(documented))
    assert set(documented) == set(ALL_FIELDS)


def test_a_line_has_every_field_in_order_and_an_optional_one_only_when_set() -> None:
    plain = step_record(step=3, t_wait=None)
    assert list(plain.to_json()) == list(FIELDS) and plain.to_json()["t_wait"] is None
    ps = step_record(step=3, staleness=0)
    assert list(ps.to_json()) == [*FIELDS, "staleness"]
    assert StepRecord.from_json(json.loads(json.dumps(ps.to_json()))) == ps


def test_a_line_of_another_version_is_refused_by_name() -> None:
    line = step_record(step=2).to_json()
    del line["lr"]
    with pytest.raises(ValueError, match=r"step 2: missing fields \['lr'\], unknown fields \[\]"):
        StepRecord.from_json(line)
    with pytest.raises(ValueError, match=r"unknown fields \['t_extra'\]"):
        StepRecord.from_json({**step_record().to_json(), "t_extra": 1.0})


def test_a_resumed_run_takes_over_the_records_up_to_its_checkpoint(tmp_path: Path) -> None:
    written = [step_record(step=s, loss=1.0 / (s + 1), staleness=s % 2, t_wait=0.5) for s in range(4)]
    log = StepLog(metrics_path(tmp_path, 0))
    for record in written:
        log.write(record)
    log.close()
    assert checkpoint.earlier_records(tmp_path, 0, upto=2) == written[:3]
    path = metrics_path(tmp_path, 1)
    path.write_text(json.dumps({"step": 0}) + "\n")
    with pytest.raises(ValueError, match=rf"{path}: step record of step 0: missing fields \['rank'"):
        checkpoint.earlier_records(tmp_path, 1, upto=0)


def trained_record(world: World, tmp_path: Path) -> StepRecord:
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = build_synchronizer(OmegaConf.create({"name": "ring", "accumulate": 1, "bucket_mb": None, "overlap": False}))
    sync.setup(model, optimizer, world)
    generator = torch.Generator().manual_seed(1)
    batches = RankBatches(torch.randn(16, 6, generator=generator), torch.randint(0, 4, (16,), generator=generator),
                          [8], 0, seed=0)
    log = StepLog(tmp_path / "rank0.jsonl")
    (record,) = Trainer(optimizer, sync, batches, world, log, steps=1).run()
    log.close()
    sync.close()
    return record


def test_the_simulator_writes_the_trainers_record_with_what_it_cannot_know_left_none(
    world: World, tmp_path: Path,
) -> None:
    trained = trained_record(world, tmp_path)
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["sync=ring", "world_size=2", "steps=2", "sim.bandwidth=1gbit",
                                                      "sim.compute_ms_per_sample=0.1"])
    simulated = predict(cfg).records[1][0]
    assert list(simulated.to_json()) == list(trained.to_json()) == list(FIELDS)
    assert {name for name, value in simulated.to_json().items() if value is None} == SIMULATED_NONE
    assert {name for name, value in trained.to_json().items() if value is None} <= {"t_wait", "t_encode", "t_decode"}
