"""Sweep points left out: Hydra's basic sweeper runs the whole cartesian product of its parameters,
and some combinations cannot run (a parameter server cannot carry PowerSGD's two all-reduces).
A config's ``sweep_exclude`` names them; such a job is skipped before it is checked or spawned."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def excluded(overrides: Iterable[str], exclude: Sequence[Sequence[str]]) -> list[str] | None:
    """The entry of ``exclude`` whose overrides a job's ``overrides`` all include, else None."""
    given = {o.lstrip("+") for o in overrides}
    for entry in exclude or ():
        if entry and all(str(o).lstrip("+") in given for o in entry):
            return [str(o) for o in entry]
    return None
