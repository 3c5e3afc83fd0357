"""Where the Hydra config root lives: ``experiments/`` in a checkout, packaged copy in a wheel; files
named relative to the checkout; and job directories' names."""

import hashlib
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


def short_dirname(name: str, limit: int = 200) -> str:
    """A sweep job's directory name within file systems' 255-byte limit: a long list of overrides
    is cut and ends in a hash of the whole, so names stay unique and readable."""
    if len(name.encode()) <= limit:
        return name
    return f"{name.encode()[: limit - 17].decode(errors='ignore')}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
