"""A group option's config as an instance of its schema's dataclass: what a synchronizer or a codec
is given, so that its fields are typed and their defaults live in one place (the dataclass)."""

from __future__ import annotations

from typing import Any, TypeVar

from omegaconf import OmegaConf

T = TypeVar("T")


def typed(schema: type[T], cfg: Any) -> T:
    """``cfg`` (a DictConfig, a mapping, or already a ``schema``) as a ``schema``; the fields it
    leaves out take the schema's defaults, and a key the schema lacks is an error naming it."""
    if isinstance(cfg, schema):
        return cfg
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), cfg))  # type: ignore[return-value]
