"""``model=custom``: any ``nn.Module`` by import path (``model.target``), built by Hydra's instantiate.

  python -m testbed model=custom model.target=torchvision.models.resnet50 +model.kwargs.num_classes=10

The target is a class or a factory returning a module; ``model.kwargs`` are its keyword arguments.
It must read the data's inputs and return logits that fit its targets (checked before spawning).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from testbed.data.spec import DataSpec


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
    return model
