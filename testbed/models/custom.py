"""``model=custom``: any ``nn.Module`` by import path (``model.target``), built by Hydra's instantiate.

  python -m testbed model=custom model.target=torchvision.models.resnet50 +model.kwargs.num_classes=10

The target is a class or a factory returning a module; ``model.kwargs`` are its keyword arguments.
It must read the data's inputs and return logits that fit its targets, or compute its own loss
(``model.loss=model``, testbed.models.call); both are checked before spawning. Lazy modules
(``torch.nn.LazyLinear``) are materialized by a forward pass of two samples, as DDP asks, before the
parameters are counted or shared.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from testbed.data.spec import DataSpec
from testbed.models.call import example_batch, model_call


def build_custom(cfg: Any, spec: DataSpec) -> nn.Module:
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    kwargs = OmegaConf.to_container(cfg.kwargs, resolve=True) if OmegaConf.is_config(cfg.kwargs) else dict(cfg.kwargs)
    try:
        model = instantiate({"_target_": cfg.target, **kwargs}, _convert_="all")
    except InstantiationException as exc:
        reason = str(exc).strip().splitlines()[0].split(", set env var HYDRA_FULL_ERROR")[0]
        raise ValueError(f"model.target={cfg.target}: {reason}; give module.attr of an nn.Module class or factory") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"model.target={cfg.target} built a {type(model).__name__}, not a torch.nn.Module")
    if any(is_lazy(t) for t in [*model.parameters(), *model.buffers()]):
        _materialize(model, cfg, spec)
    return model


def _materialize(model: nn.Module, cfg: Any, spec: DataSpec) -> None:
    """Give lazy modules their shapes (and initial values: the same on every rank, from the seed)
    with one forward pass of two samples, in eval mode so that no statistic moves."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model_call(cfg)(model, *example_batch(spec, 2, torch.get_default_device()))
    finally:
        model.train(was_training)
