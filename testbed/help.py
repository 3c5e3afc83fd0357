"""``python -m testbed --help``: the config groups a user picks from, listed from experiments/."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from testbed.paths import config_dir


def app_help() -> dict[str, str]:
    """``--help``: the groups a user picks from (experiments/), without the internal schema/*."""
    root = Path(config_dir())
    groups = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name != "hydra")
    defaults = OmegaConf.to_container(OmegaConf.load(root / "config.yaml").defaults)
    chosen = {next(iter(entry)) for entry in defaults if isinstance(entry, dict)}
    names = {g: g if g in chosen else f"+{g}" for g in groups}
    width = max(map(len, names.values()))
    lines = [f"  {names[g]:<{width}}  {', '.join(sorted(p.stem for p in (root / g).glob('*.yaml')))}" for g in groups]
    return {
        "app_name": "testbed",
        "header": "python -m testbed: one data-parallel training run per Hydra job (-m sweeps).",
        "footer": "Use --hydra-help for Hydra's own options.",
        "template": "${hydra.help.header}\n== Configuration groups ==\nPick one option per group (group=option; "
        "+group=option for the groups marked +):\n\n" + "\n".join(lines) + "\n\n== Config ==\nOverride anything "
        "in the config (foo.bar=value):\n\n$CONFIG\n${hydra.help.footer}\n",
    }
