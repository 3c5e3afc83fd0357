"""The model group's schemas: each model kind's fields and defaults (testbed.models.MODELS names
them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class MlpConfig:
    name: str = "mlp"
    hidden: int = 256
    depth: int = 2  # hidden layers


@dataclass
class CnnConfig:
    name: str = "cnn"
    width: int = 16  # channels of the first stage; stage i has width * 2**i
    blocks: list[int] = field(default_factory=lambda: [1, 1, 1])  # residual blocks per stage


@dataclass
class Cnn1dConfig:
    """MNIST-1D's convolutional network (testbed.models.cnn1d); it reads any input as one signal."""

    name: str = "cnn1d"
    channels: int = 25


@dataclass
class TransformerConfig:
    name: str = "transformer"
    d_model: int = 128
    n_layer: int = 2
    n_head: int = 4


@dataclass
class ResNetConfig:
    """torchvision's ResNet-18/50/101 (testbed.models.resnet); the depth is the option's name."""

    name: str = "resnet50"
    width: int = 64  # base width (torchvision: 64); stage i has width * 2**i channels (x4 in bottlenecks)
    layers: list[int] | None = None  # blocks per stage; null: the depth's own ([3, 4, 6, 3] for 50)


@dataclass
class ResNet18Config(ResNetConfig):
    name: str = "resnet18"


@dataclass
class ResNet101Config(ResNetConfig):
    name: str = "resnet101"


@dataclass
class VggConfig:
    """torchvision's VGG-16 (configuration D, no batch norm; testbed.models.vgg)."""

    name: str = "vgg16"
    width: int = 64  # channels of the first block (torchvision: 64); the others scale with it
    hidden: int = 4096  # classifier width
    dropout: float = 0.5


@dataclass
class LanguageModelConfig:
    """GPT-2 and BERT from Hugging Face transformers' own classes, randomly initialised (no hub).

    The defaults are GPT-2 small and BERT-base; the vocabulary is the data's (data.vocab_size
    50257 for GPT-2 and 30522 for BERT give the reference totals).
    """

    name: str = "gpt2"  # gpt2 (causal LM) | bert (masked LM, BertConfig)
    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12
    n_positions: int = 1024  # position embeddings; data.seq_len must not exceed it
    dropout: float = 0.1
    mask_prob: float = 0.15  # bert: share of tokens masked (of these 80 % [MASK], 10 % random, 10 % kept)
    mask_token: int = 103  # bert: the [MASK] token id (BERT's vocabulary)


@dataclass
class BertConfig(LanguageModelConfig):
    name: str = "bert"
    n_positions: int = 512  # BERT-base's


@dataclass
class CustomModelConfig:
    """Any ``nn.Module`` by import path, built with Hydra's instantiate (testbed.models.custom)."""

    name: str = "custom"
    target: str = MISSING  # e.g. torchvision.models.resnet50, or my_package.models.Net
    kwargs: dict[str, Any] = field(default_factory=dict)  # its constructor's keyword arguments
    # data: it returns logits, the testbed's cross-entropy is the loss; model: it computes its own
    # loss from the targets it is given (testbed.models.call, docs/custom_models.md).
    loss: str = "data"
    loss_from: Any = None  # loss=model: the loss's tuple index, attribute or dict key in what it returns
    logits_from: Any = None  # loss=model: the logits' (for evaluation); null: none, the loss alone is measured
    targets_as: str = "positional"  # loss=model: the targets as its second positional argument, or this keyword
