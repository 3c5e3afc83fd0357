"""Sharded checkpoints: each rank saves its pieces of the model state, and any number of ranks resumes.

A synchronizer that shards the model state (ZeRO, FSDP) describes what a rank holds as pieces,
independent of how many ranks there are: for each parameter (by name) a list of (first element,
values) of its flattened tensor, the same for each elementwise optimizer state of it (momentum,
Adam's moments), and its scalar optimizer state (the step count). Every rank writes its pieces into
its own checkpoint file; a resumed run, at the same world size or another, reads every file, puts
each tensor together whole (checking that the pieces cover it exactly once), and each rank takes
its new shard of it (``Synchronizer.restore``). Whole tensors are built on every rank for that
moment: the price of a format that any layout can read.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

Span = tuple[int, torch.Tensor]  # (first element in the flattened tensor, values)


@dataclass
class Pieces:
    """What one rank holds, by parameter name (see the module's docstring)."""

    params: dict[str, list[Span]] = field(default_factory=dict)
    optimizer: dict[str, dict[str, list[Span]]] = field(default_factory=dict)
    scalars: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, name: str, start: int, values: torch.Tensor, state: dict[str, Any], lo: int, hi: int) -> None:
        """Parameter ``name``'s elements ``start``... are ``values``; ``state`` is the optimizer state
        of the shard they were cut from, of which they are elements ``lo:hi``."""
        self.params.setdefault(name, []).append((start, values.detach().cpu().clone()))
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                local = value.to_local() if hasattr(value, "to_local") else value
                piece = local.reshape(-1)[lo:hi].detach().cpu().clone()
                self.optimizer.setdefault(name, {}).setdefault(key, []).append((start, piece))
            else:
                self.scalars.setdefault(name, {})[key] = value.detach().cpu().clone() if torch.is_tensor(value) else value

    def as_dict(self) -> dict[str, Any]:
        return {"params": self.params, "optimizer": self.optimizer, "scalars": self.scalars}


def cut(pieces: Pieces, names: list[str], offsets: list[int], lo: int, hi: int, values: torch.Tensor,
        state: dict[str, Any]) -> None:
    """Add a shard to ``pieces``: ``values`` are elements ``lo:hi`` of a flat buffer that lays out the
    parameters ``names`` at ``offsets``, ``state`` its optimizer state (elementwise entries as long
    as ``values``); cut at the parameters' bounds."""
    for name, a, b in zip(names, offsets, offsets[1:]):
        start, end = max(a, lo), min(b, hi)
        if start < end:
            pieces.add(name, start - a, values[start - lo : end - lo], state, start - lo, end - lo)


@dataclass
class Whole:
    """The model state put together: flattened tensors by parameter name."""

    params: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, torch.Tensor]]
    scalars: dict[str, dict[str, Any]]

    def flat(self, names: Iterable[str], key: str | None = None) -> torch.Tensor:
        """The named tensors (or their optimizer state ``key``) laid end to end."""
        return torch.cat([self.params[n] if key is None else self.optimizer[n][key] for n in names])

    def state_keys(self, name: str) -> list[str]:
        """The elementwise optimizer state kept for parameter ``name``."""
        return sorted(self.optimizer.get(name, {}))


def _join(name: str, spans: list[Span], numel: int, where: str) -> torch.Tensor:
    out = torch.empty(numel, dtype=spans[0][1].dtype)
    covered = 0
    for start, values in sorted(spans, key=lambda s: s[0]):
        if start != covered:
            raise ValueError(f"{where}: {name} has {'a gap' if start > covered else 'an overlap'} at element {covered}")
        out[start : start + values.numel()] = values
        covered = start + values.numel()
    if covered != numel:
        raise ValueError(f"{where}: {name} covers {covered} of its {numel} elements")
    return out


def assemble(ranks: list[dict[str, Any]], numels: dict[str, int], where: str) -> Whole:
    """Whole tensors from every rank's pieces (``numels``: each parameter's elements)."""
    params: dict[str, list[Span]] = {}
    optimizer: dict[str, dict[str, list[Span]]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pieces in ranks:
        for name, spans in pieces["params"].items():
            params.setdefault(name, []).extend(spans)
        for name, keys in pieces["optimizer"].items():
            for key, spans in keys.items():
                optimizer.setdefault(name, {}).setdefault(key, []).extend(spans)
        for name, values in pieces["scalars"].items():
            scalars.setdefault(name, {}).update(values)
    missing = sorted(set(numels) - set(params))
    if missing:
        raise ValueError(f"{where}: no rank saved {', '.join(missing[:3])}")
    return Whole(
        params={name: _join(name, params[name], numel, where) for name, numel in numels.items()},
        optimizer={name: {key: _join(f"{name} ({key})", spans, numels[name], where) for key, spans in keys.items()}
                   for name, keys in optimizer.items()},
        scalars=scalars,
    )


def load_whole(step_dir: Path, numels: dict[str, int]) -> Whole:
    """Every rank's pieces in the checkpoint ``step_dir``, put together."""
    files = sorted(step_dir.glob("rank*.pt"), key=lambda p: int(p.stem.removeprefix("rank")))
    ranks = [torch.load(file, weights_only=False)["pieces"] for file in files]
    return assemble(ranks, numels, str(step_dir))


def optimizer_state(whole: Whole, names: list[str], lo: int, hi: int, like: torch.Tensor) -> dict[str, Any]:
    """The optimizer state of a tensor shaped like ``like`` that holds elements ``lo:hi`` of the
    parameters ``names`` laid end to end: each elementwise entry cut from the whole, the scalars as
    saved (empty where the optimizer had not stepped)."""
    state: dict[str, Any] = {}
    for key in whole.state_keys(names[0]):
        state[key] = whole.flat(names, key)[lo:hi].to(like.device, like.dtype).view(like.shape).clone()
    for key, value in whole.scalars.get(names[0], {}).items():
        state[key] = value.clone() if torch.is_tensor(value) else value
    return state
