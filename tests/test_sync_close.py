"""A failure while a synchronizer is built or set up is reported with its own cause: ``close()``
(which a rank runs on the way out, whatever happened) is safe at every point before setup's end."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch import nn

from testbed import config
from testbed.paths import config_dir
from testbed.sync import SYNCHRONIZERS, Synchronizer
from testbed.world import World

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    """A real Gloo process group of one rank, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield World(0, 0, 1, 1, torch.device("cpu"), "gloo", 30.0)
    dist.destroy_process_group()


def built(name: str) -> Synchronizer:
    """``sync=<name>`` as a rank builds it, from its composed config (overlap on where it has one)."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"sync={name}"])
    config.validate(cfg)
    if "overlap" in cfg.sync:
        cfg.sync.overlap = True
    return SYNCHRONIZERS[name].impl(cfg.sync, cfg.compress, 0)


@pytest.mark.parametrize("name", list(SYNCHRONIZERS))
def test_close_right_after_construction(name: str) -> None:
    built(name).close()


@pytest.mark.parametrize("name", list(SYNCHRONIZERS))
def test_close_after_a_setup_that_failed_part_way(world: World, name: str) -> None:
    sync = built(name)
    model = nn.Linear(4, 2).requires_grad_(False)  # nothing to synchronize: some setups refuse it part-way
    try:
        sync.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), world)
    except Exception as exc:  # whatever setup raised, close must not replace it
        print(f"setup refused: {type(exc).__name__}: {exc}")
    sync.close()
