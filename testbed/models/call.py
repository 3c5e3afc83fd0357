"""How the trainer and evaluation call a model and read what it returns (``model.loss``).

``loss=data`` (every built-in model, and custom ones by default): ``model(inputs)`` returns logits
and the loss is the testbed's cross-entropy against the data's targets.

``loss=model`` (``model=custom``): a model that computes its own loss, such as nanoGPT's ``GPT``
(``forward(idx, targets) -> (logits, loss)``) or a Hugging Face model given ``labels`` (an output
with ``.loss`` and ``.logits``), is given the targets too: as its second positional argument, or
as the keyword ``model.targets_as``. ``model.loss_from`` says where the loss is in what it returns
(a tuple index, a dict key or an attribute), ``model.logits_from`` where the logits are; evaluation
measures them, or the loss alone where there are none (null). docs/custom_models.md has examples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from testbed.checks import require
from testbed.data.spec import DataSpec

LOSSES = ("data", "model")


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy; language-model logits (batch, seq, vocab) are flattened over tokens."""
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


class Outputs(NamedTuple):
    loss: torch.Tensor
    logits: torch.Tensor | None  # None: the model returns no logits (its own loss alone)


@dataclass(frozen=True)
class ModelCall:
    loss_from: int | str | None = None  # None: loss=data
    logits_from: int | str | None = None
    targets_as: str = "positional"

    @property
    def has_logits(self) -> bool:
        return self.loss_from is None or self.logits_from is not None

    def __call__(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> Outputs:
        if self.loss_from is None:
            logits = model(inputs)
            return Outputs(cross_entropy(logits, targets), logits)
        out = model(inputs, targets) if self.targets_as == "positional" else model(inputs, **{self.targets_as: targets})
        loss = _pick(out, self.loss_from, "model.loss_from")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"model.loss_from={self.loss_from}: the model returns {what} there; the loss must be a "
                             "scalar tensor (the batch's mean)")
        return Outputs(loss, None if self.logits_from is None else _pick(out, self.logits_from, "model.logits_from"))


def example_batch(spec: DataSpec, batch: int, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``batch`` samples of zeros, shaped as the data's."""
    if spec.kind == "lm":
        tokens = torch.zeros(batch, spec.seq_len, dtype=torch.long, device=device)
        return tokens, tokens.clone()
    return torch.zeros(batch, *spec.shape, device=device), torch.zeros(batch, dtype=torch.long, device=device)


def model_call(cfg: Any) -> ModelCall:
    """The call of the model that ``cfg`` (the ``model`` config node) builds."""
    if cfg.get("loss", "data") == "data":
        return ModelCall()
    return ModelCall(cfg.loss_from, cfg.logits_from, cfg.targets_as)


def _pick(out: Any, key: int | str, field: str) -> Any:
    """``out[key]`` of a tuple or dict, or its attribute ``key``."""
    if isinstance(out, tuple | list):
        if not isinstance(key, int) or not -len(out) <= key < len(out):
            raise ValueError(f"{field}={key}: the model returns a {type(out).__name__} of {len(out)}; give an index in "
                             f"[0, {len(out)})")
        return out[key]
    if isinstance(out, Mapping) and key in out:
        return out[key]
    if isinstance(key, str) and hasattr(out, key):
        return getattr(out, key)
    raise ValueError(f"{field}={key}: the model returns a {type(out).__name__} without it; give a tuple index, an "
                     "attribute or a dict key of what it returns")


def check_model_call(model: Any) -> None:
    """model=custom's loss settings (``model.loss``, ``loss_from``, ``logits_from``, ``targets_as``)."""
    require(model.loss in LOSSES, f"model.loss={model.loss}: allowed: {'|'.join(LOSSES)} (data: the model returns logits; "
            "model: it computes its own loss from the targets)")
    if model.loss == "data":
        for name, default in (("loss_from", None), ("logits_from", None), ("targets_as", "positional")):
            require(model[name] == default, f"model.{name}={model[name]} is for a model that computes its own loss: "
                    "add model.loss=model, or drop it")
        return
    require(model.loss_from is not None,
            "model.loss=model needs model.loss_from=<tuple index | attribute | dict key> of the loss in what it returns")
    for name in ("loss_from", "logits_from"):
        value = model[name]
        require(value is None or isinstance(value, int) or str(value).isidentifier(),
                f"model.{name}={value}: give a tuple index (e.g. 1) or an attribute or dict key (e.g. loss)")
    require(model.targets_as == "positional" or str(model.targets_as).isidentifier(),
            f"model.targets_as={model.targets_as}: positional (the second argument), or a keyword name such as labels")
