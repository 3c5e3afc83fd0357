"""Where the Hydra config root lives: ``experiments/`` in a checkout, packaged copy in a wheel."""

from pathlib import Path


def config_dir() -> str:
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "experiments", here / "experiments"):
        if (candidate / "config.yaml").exists():
            return str(candidate)
    raise FileNotFoundError("testbed: no experiments/config.yaml next to the package")
