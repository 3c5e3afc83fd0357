"""Which runs share a configuration: the one key the console table, the analysis and the simulator's
validation group runs by."""

from __future__ import annotations

from typing import Iterable, Sequence

# Overrides that vary within one configuration: the worker count and the repeat's seed.
VARYING = ("world_size=", "seed=")


def run_key(overrides: Iterable[str], vary: Sequence[str] = VARYING, ignore: Sequence[str] = ()) -> str:
    """The configuration a run belongs to: its command-line overrides, sorted and comma-joined,
    but those that start with a prefix of ``vary`` or ``ignore``. Runs with equal keys differ only
    in what those overrides set.

    What varies within a configuration (``vary``): by default world_size and seed, so repeats and
    worker counts of one configuration share a key; the console table's baseline passes
    ``("world_size=",)``, so that a run is compared with the single worker of its own seed.
    Values that follow from world_size without being overrides (ps_sharded's shard count, the global
    batch) do not enter the key. ``ignore`` drops more: ``("sync=",)`` gives the setting that runs
    under different synchronizers share (compared against one another); ``hydra.`` or where a run
    logged are not part of the experiment. Everything else, model, data, network, sync options,
    steps, tells configurations apart, as does a different spelling of the same value (the key
    compares the overrides as typed, not the resolved config).
    """
    skip = (*vary, *ignore)
    return ",".join(sorted(o for o in overrides if not o.startswith(skip)))
