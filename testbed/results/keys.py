"""Which runs share a configuration: the one key the console table, the analysis and the simulator's
validation group runs by."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Overrides that vary within one configuration: the worker count and the repeat's seed.
VARYING = ("world_size=", "seed=")
# Orders to the sweep, not part of any configuration (summary.json's config_hash leaves them out too):
# a sweep resumed with sweep_resume=true holds the same configurations as before.
NOT_CONFIGURATION = ("sweep_resume=",)


def run_key(overrides: Iterable[str], vary: Sequence[str] = VARYING, ignore: Sequence[str] = ()) -> str:
    """The configuration a run belongs to: its command-line overrides, sorted and comma-joined,
    without those that start with a prefix in ``vary`` or ``ignore``.

    Runs with equal keys are the same configuration and may differ only in what the dropped overrides
    set. By default that is what ``vary`` names, the worker count and the seed, so the repeats and
    world sizes of one configuration share a key (analysis.load's ``config_key``); the console
    table's baseline passes ``vary=("world_size=",)``, comparing each run with the single worker of
    its own seed. ``ignore`` drops more: ``("sync=",)`` gives the setting that runs under different
    synchronizers share; ``("hydra.",)``, Hydra's own settings. Everything else tells configurations
    apart: model, data, network, steps, synchronizer and its options. Values that follow from
    world_size without being overrides (the global batch, ps_sharded's shard count) are not in the
    key, and the overrides are compared as typed, not resolved (``lr=0.1`` and ``lr=.1`` differ).
    """
    skip = (*vary, *ignore, *NOT_CONFIGURATION)
    return ",".join(sorted(o for o in overrides if not o.startswith(skip)))
