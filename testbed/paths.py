"""Where the Hydra config root lives: ``experiments/`` in a checkout, packaged copy in a wheel; and
files named relative to the checkout."""

from pathlib import Path


def config_dir() -> str:
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "experiments", here / "experiments"):
        if (candidate / "config.yaml").exists():
            return str(candidate)
    raise FileNotFoundError("testbed: no experiments/config.yaml next to the package")


def in_checkout(path: str) -> Path:
    """``path`` as given, or relative to the checkout (where presets name shipped calibrations)."""
    given = Path(path)
    return given if given.is_absolute() or given.exists() else Path(config_dir()).parent / given
