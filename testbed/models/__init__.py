"""Models by name (the ``model=`` option), each built from its config node and the data's spec.

A model kind says what it builds and which data it reads; ``check_fits`` builds any model on the
meta device and runs one forward pass, so a model that cannot read the data fails before a rank
is spawned, with the model and data named.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import nn

from testbed.checks import require
from testbed.data import DataSpec
from testbed.models.call import check_model_call, example_batch, model_call
from testbed.models.cnn import ResNet as SmallResNet
from testbed.models.cnn1d import Cnn1d
from testbed.models.custom import build_custom
from testbed.models.language import (
    MaskedHeldOut,
    MaskedTokens,
    build_bert,
    build_gpt2,
    check_bert,
    check_language,
    flops_per_token,
)
from testbed.models.mlp import Mlp
from testbed.models.resnet import resnet
from testbed.models.schema import (
    BertConfig,
    Cnn1dConfig,
    CnnConfig,
    CustomModelConfig,
    LanguageModelConfig,
    MlpConfig,
    ResNet18Config,
    ResNet101Config,
    ResNetConfig,
    TransformerConfig,
    VggConfig,
)
from testbed.models.transformer import Gpt
from testbed.models.vgg import vgg16


@dataclass(frozen=True)
class ModelKind:
    schema: type  # its fields and their defaults (testbed.models.schema)
    build: Callable[[Any, DataSpec], nn.Module]
    reads: str | None  # the data kind it takes ("classification" | "lm"); None: any, judged by its output
    language: bool = False  # a language model: throughput in tokens, MFU from flops_per_token
    # Wraps the data's batch stream in the model's own objective (BERT's masking); None: as is.
    objective: Callable[..., Any] | None = None
    # The same objective over the held-out split (testbed.eval), alike on every rank; None: as is.
    heldout_objective: Callable[..., Any] | None = None
    check: Callable[[Any], None] = lambda cfg: None  # its own fields' checks, given the whole config


def _resnet(depth: int) -> Callable[[Any, DataSpec], nn.Module]:
    def build(cfg: Any, spec: DataSpec) -> nn.Module:
        layers = list(cfg.layers) if cfg.get("layers") else None
        return resnet(depth, spec.num_classes, spec.shape[0], cfg.width, layers)

    return build


MODELS: dict[str, ModelKind] = {
    "mlp": ModelKind(MlpConfig, lambda cfg, spec: Mlp(spec.input_numel, spec.num_classes, cfg.hidden, cfg.depth), "classification"),
    "cnn": ModelKind(CnnConfig, lambda cfg, spec: SmallResNet(spec.shape[0], spec.num_classes, cfg.width, list(cfg.blocks)),
                     "classification"),
    "cnn1d": ModelKind(Cnn1dConfig, lambda cfg, spec: Cnn1d(spec.input_numel, spec.num_classes, cfg.channels), "classification"),
    "transformer": ModelKind(TransformerConfig, lambda cfg, spec: Gpt(spec.vocab_size, spec.seq_len, cfg.d_model, cfg.n_layer, cfg.n_head),
                             "lm", language=True, check=check_language),
    "resnet18": ModelKind(ResNet18Config, _resnet(18), "classification"),
    "resnet50": ModelKind(ResNetConfig, _resnet(50), "classification"),
    "resnet101": ModelKind(ResNet101Config, _resnet(101), "classification"),
    "vgg16": ModelKind(VggConfig, lambda cfg, spec: vgg16(spec.num_classes, spec.shape[0], cfg.width, cfg.hidden, cfg.dropout),
                       "classification"),
    "gpt2": ModelKind(LanguageModelConfig, build_gpt2, "lm", language=True, check=check_language),
    "bert": ModelKind(BertConfig, build_bert, "lm", language=True, objective=MaskedTokens, heldout_objective=MaskedHeldOut,
                      check=check_bert),
    "custom": ModelKind(CustomModelConfig, build_custom, None),
}


def model_kind(name: str) -> ModelKind:
    if name not in MODELS:
        raise ValueError(f"model={name}: unknown; allowed: {'|'.join(MODELS)}")
    return MODELS[name]


def build_model(cfg: Any, spec: DataSpec) -> nn.Module:
    return model_kind(cfg.name).build(cfg, spec)


def check_model(cfg: Any, spec: DataSpec, readers: list[str]) -> None:
    """The model reads the data (``readers``: the data kinds that give what it reads) and its own
    fields hold (``cfg``: the whole config). Whether one forward pass fits is ``check_fits``'s."""
    require(not OmegaConf.is_missing(cfg.model, "target") if cfg.model.name == "custom" else True,
            "model=custom needs model.target=<module.attr> of an nn.Module class or factory (e.g. torch.nn.Linear)")
    kind = model_kind(cfg.model.name)
    require(kind.reads is None or spec.kind == kind.reads,
            f"model={cfg.model.name} cannot read data={cfg.data.name}; allowed: data={'|'.join(readers)}")
    kind.check(cfg)
    if cfg.model.name == "custom":
        check_model_call(cfg.model)


def objective_batches(cfg: Any, batches: Any, spec: DataSpec, seed: int, rank: int) -> Any:
    """The batch stream the model trains on: BERT masks its tokens; the others read the data as is."""
    objective = model_kind(cfg.name).objective
    return batches if objective is None else objective(batches, cfg, spec.vocab_size, seed, rank)


def model_heldout(cfg: Any, heldout: Any, spec: DataSpec, seed: int) -> Any:
    """The held-out split the model is evaluated on: BERT masks it; the others read it as is."""
    objective = model_kind(cfg.name).heldout_objective
    return heldout if objective is None else objective(heldout, cfg, spec.vocab_size, seed)


# Below this many parameters a forward pass on the CPU takes milliseconds, while the meta device's
# first forward in a process takes seconds (its kernels load torch._dynamo).
CPU_CHECK_PARAMS = 5_000_000


def check_fits(cfg: Any, spec: DataSpec) -> None:
    """Build the model and run a forward pass of two samples; raise ValueError (one line naming the
    model and the data) when it cannot be built or its output does not fit the data's targets.

    Small models run on the CPU; large ones on the meta device (shapes only: no memory, no compute),
    or on the CPU where the meta device lacks an operation. A pair that fits is checked once per
    process: a sweep validates the same model at every point.
    """
    key = json.dumps([OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg, str(spec)],
                     sort_keys=True, default=str)
    if key not in _FITTING:
        _check_fits(cfg, spec)
        _FITTING.add(key)


_FITTING: set[str] = set()


def _check_fits(cfg: Any, spec: DataSpec) -> None:
    expected = (2, spec.seq_len, spec.vocab_size) if spec.kind == "lm" else (2, spec.num_classes)
    call = model_call(cfg)
    devices = ("meta", "cpu")
    try:
        with torch.device("meta"):
            if sum(p.numel() for p in build_model(cfg, spec).parameters()) <= CPU_CHECK_PARAMS:
                devices = ("cpu",)
    except ValueError:
        raise
    except Exception:
        pass  # reported by the attempts below
    for device in devices:
        try:
            with torch.device(device):
                model = build_model(cfg, spec)
                inputs, targets = example_batch(spec, 2, device)
                out = model(inputs) if call.loss_from is None else call(model, inputs, targets).logits
        except ValueError:
            raise
        except Exception as exc:
            if device == "meta":
                continue
            raise ValueError(f"model={cfg.name} cannot read this data (input shape {_shape(spec)}): {exc}") from None
        break
    if out is None:  # its own loss, and no logits
        return
    shape = tuple(out.shape) if isinstance(out, torch.Tensor) else None
    if shape != expected:
        what = "logits (batch, seq_len, vocab_size)" if spec.kind == "lm" else "logits (batch, num_classes)"
        where = f"model.logits_from={call.logits_from}: the model" if call.loss_from is not None else f"model={cfg.name}"
        hint = ("; a model that computes its own loss: model.loss=model (docs/custom_models.md)"
                if cfg.name == "custom" and call.loss_from is None and shape is None else "")
        raise ValueError(
            f"{where} returns {type(out).__name__ if shape is None else shape} for a batch of 2 with input shape {_shape(spec)}; "
            f"the data needs {what} = {expected}{hint}"
        )


def _shape(spec: DataSpec) -> list[int]:
    return [spec.seq_len] if spec.kind == "lm" else list(spec.shape)


def workload_facts(cfg: Any, spec: DataSpec, model: nn.Module) -> dict[str, Any]:
    """The field's throughput unit for this workload, and the FLOPs behind MFU where they are known."""
    if model_kind(cfg.name).language or spec.kind == "lm":
        facts: dict[str, Any] = {"unit": "tokens", "per_sample": spec.seq_len}
        if model_kind(cfg.name).language:
            facts["flops_per_item"] = flops_per_token(cfg, model, spec.seq_len)
        return facts
    return {"unit": "images" if len(spec.shape) == 3 else "samples", "per_sample": 1}


def gradient_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
