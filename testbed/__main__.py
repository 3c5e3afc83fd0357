"""``python -m testbed``: the Hydra app. One Hydra job = one distributed run (testbed.launch.job)."""

from __future__ import annotations

from typing import Any, Optional

import hydra
from omegaconf import DictConfig

from testbed.config import register_schemas
from testbed.launch.job import run_job
from testbed.paths import config_dir

register_schemas()


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def main(cfg: DictConfig) -> Optional[dict[str, Any]]:
    return run_job(cfg)


if __name__ == "__main__":
    main()
