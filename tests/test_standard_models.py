"""The standard models pinned to their references: ResNet and VGG-16 to torchvision's totals
(torchvision itself does not import here), GPT-2 and BERT to the papers' (transformers' classes)."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from testbed.data.spec import DataSpec
from testbed.models import build_model, workload_facts
from testbed.models.language import IGNORE, MaskedTokens
from testbed.models.resnet import resnet
from testbed.models.vgg import vgg16

pytestmark = pytest.mark.unit


def _meta(build, *args, **kwargs) -> nn.Module:
    with torch.device("meta"):  # shapes only: full-size models build in milliseconds
        return build(*args, **kwargs)


def _bn_count(model: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())


# name, builder, params, parameter tensors, state_dict entries, BatchNorm2d modules, first, last parameter.
# The totals are torchvision's published num_params; tensor counts follow from its source.
REFERENCE = [
    ("resnet18", lambda: resnet(18), 11_689_512, 62, 122, 20,
     ("conv1.weight", (64, 3, 7, 7)), ("fc.bias", (1000,))),
    ("resnet50", lambda: resnet(50), 25_557_032, 161, 320, 53,
     ("conv1.weight", (64, 3, 7, 7)), ("fc.bias", (1000,))),
    ("resnet101", lambda: resnet(101), 44_549_160, 314, 626, 104,
     ("conv1.weight", (64, 3, 7, 7)), ("fc.bias", (1000,))),
    ("vgg16", lambda: vgg16(), 138_357_544, 32, 32, 0,
     ("features.0.weight", (64, 3, 3, 3)), ("classifier.6.bias", (1000,))),
]


@pytest.mark.parametrize(
    "name,build,params,tensors,entries,bns,first,last", REFERENCE, ids=[r[0] for r in REFERENCE]
)
def test_reference_totals(name, build, params, tensors, entries, bns, first, last) -> None:
    model = _meta(build)
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(named) == tensors
    assert len(model.state_dict()) == entries
    assert _bn_count(model) == bns
    assert named[0] == first and named[-1] == last


def test_resnet_names_and_shapes() -> None:
    r50 = _meta(resnet, 50)
    assert [n for n, _ in r50.layer1[0].named_parameters()] == [
        "conv1.weight", "bn1.weight", "bn1.bias", "conv2.weight", "bn2.weight", "bn2.bias",
        "conv3.weight", "bn3.weight", "bn3.bias", "downsample.0.weight", "downsample.1.weight", "downsample.1.bias",
    ]
    keys = list(r50.state_dict())
    assert keys[:7] == ["conv1.weight", "bn1.weight", "bn1.bias", "bn1.running_mean", "bn1.running_var",
                        "bn1.num_batches_tracked", "layer1.0.conv1.weight"]
    shapes = {n: tuple(p.shape) for n, p in r50.named_parameters()}
    assert shapes["layer1.0.downsample.0.weight"] == (256, 64, 1, 1)
    assert shapes["layer4.2.conv3.weight"] == (2048, 512, 1, 1)
    assert shapes["fc.weight"] == (1000, 2048)
    # v1.5: the stage's stride sits on the 3x3 conv, not the first 1x1.
    assert r50.layer2[0].conv1.stride == (1, 1) and r50.layer2[0].conv2.stride == (2, 2)
    assert r50.layer2[0].downsample[0].stride == (2, 2)
    assert isinstance(r50.avgpool, nn.AdaptiveAvgPool2d) and r50.avgpool.output_size == (1, 1)

    r18 = _meta(resnet, 18)
    assert r18.layer1[0].downsample is None and not hasattr(r18.layer1[0], "conv3")
    assert tuple(r18.fc.weight.shape) == (1000, 512)
    assert sum(p.numel() for p in _meta(resnet, 34).parameters()) == 21_797_672
    assert sum(p.numel() for p in _meta(resnet, 152).parameters()) == 60_192_808


def test_vgg16_names_and_shapes() -> None:
    model = _meta(vgg16)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["features.0.weight"] == (64, 3, 3, 3)
    assert shapes["features.28.weight"] == (512, 512, 3, 3)
    assert shapes["classifier.0.weight"] == (4096, 512 * 7 * 7)
    assert shapes["classifier.6.weight"] == (1000, 4096)
    assert len(model.features) == 31 and sum(isinstance(m, nn.MaxPool2d) for m in model.features) == 5
    assert [type(m) for m in model.classifier] == [nn.Linear, nn.ReLU, nn.Dropout] * 2 + [nn.Linear]
    assert model.avgpool.output_size == (7, 7)


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        resnet(20)
    with pytest.raises(ValueError):
        vgg16(width=0)
    assert tuple(_meta(resnet, 18, in_channels=1, width=16, layers=[1, 1, 1, 1]).conv1.weight.shape) == (16, 1, 7, 7)


@pytest.mark.parametrize(
    "build",
    [lambda: resnet(50, num_classes=10, width=8), lambda: vgg16(num_classes=10, width=8, hidden=64)],
    ids=["resnet50-w8", "vgg16-w8"],
)
def test_forward_backward(build) -> None:
    torch.manual_seed(0)
    model = build()
    for m in model.modules():  # torchvision's init
        if isinstance(m, nn.BatchNorm2d):
            assert bool((m.weight == 1).all()) and bool((m.bias == 0).all())
        elif isinstance(m, nn.Conv2d) and m.bias is not None:
            assert bool((m.bias == 0).all())
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name


# --- the model= options, through the registry ------------------------------------------------------


LM = {"n_layer": 12, "d_model": 768, "n_head": 12, "dropout": 0.1, "mask_prob": 0.15, "mask_token": 103}
IMAGENET = DataSpec("classification", (3, 224, 224), num_classes=1000)


@pytest.mark.parametrize(
    "model,spec,params,tensors",
    [
        ({"name": "resnet50", "width": 64, "layers": None}, IMAGENET, 25_557_032, 161),
        ({"name": "vgg16", "width": 64, "hidden": 4096, "dropout": 0.5}, IMAGENET, 138_357_544, 32),
        # GPT-2 small: tied input and output embeddings, so the head adds no tensor.
        ({"name": "gpt2", **LM, "n_positions": 1024}, DataSpec("lm", (1024,), vocab_size=50257, seq_len=1024),
         124_439_808, 148),
        # BERT-base with the masked-LM head and without the pooler: the encoder's 109,482,240 less
        # the pooler's 590,592, plus the head's transform (590,592 + 1,536) and decoder bias (30,522).
        ({"name": "bert", **LM, "n_positions": 512}, DataSpec("lm", (512,), vocab_size=30522, seq_len=512),
         109_482_240 - 590_592 + 590_592 + 1_536 + 30_522, 202),
    ],
    ids=["resnet50", "vgg16", "gpt2", "bert"],
)
def test_model_options_have_the_reference_totals(model: dict, spec: DataSpec, params: int, tensors: int) -> None:
    with torch.device("meta"):
        net = build_model(OmegaConf.create(model), spec)
    assert sum(p.numel() for p in net.parameters()) == params
    assert len(list(net.parameters())) == tensors


def test_bert_encoder_is_bert_base() -> None:
    from transformers import BertConfig, BertModel

    with torch.device("meta"):
        encoder = BertModel(BertConfig())  # the configuration build_bert fills in, at BERT-base
    assert sum(p.numel() for p in encoder.parameters()) == 109_482_240


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_language_models_train_a_step(name: str) -> None:
    cfg = OmegaConf.create({"name": name, "n_layer": 2, "d_model": 32, "n_head": 4, "n_positions": 16,
                            "dropout": 0.0, "mask_prob": 0.15, "mask_token": 3})
    spec = DataSpec("lm", (16,), vocab_size=64, seq_len=16)
    net = build_model(cfg, spec)
    tokens = torch.randint(0, 64, (2, 16))
    logits = net(tokens)
    assert logits.shape == (2, 16, 64)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())
    facts = workload_facts(cfg, spec, net)
    n = sum(p.numel() for p in net.parameters()) - 16 * 32  # without the position embeddings
    assert facts == {"unit": "tokens", "per_sample": 16, "flops_per_item": 6 * n + 12 * 2 * 32 * 16}


def test_masked_tokens_follow_berts_recipe() -> None:
    class Fixed:
        def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.arange(4000).remainder(50).view(8, 500) + 10, torch.zeros(8, 500)

        def close(self) -> None: ...

    cfg = OmegaConf.create({"mask_prob": 0.15, "mask_token": 3})
    masked = MaskedTokens(Fixed(), cfg, vocab_size=60, seed=0, rank=0)
    inputs, targets = masked.batch(0)
    original = Fixed().batch(0)[0]
    chosen = targets != IGNORE
    assert 0.13 < chosen.float().mean() < 0.17
    assert torch.equal(targets[chosen], original[chosen])
    assert torch.equal(inputs[~chosen], original[~chosen])  # unchosen tokens are untouched
    share_masked = (inputs[chosen] == 3).float().mean()
    assert 0.75 < share_masked < 0.85
    assert torch.equal(masked.batch(0)[0], inputs)  # reproducible
    assert not torch.equal(MaskedTokens(Fixed(), cfg, 60, seed=0, rank=1).batch(0)[0], inputs)  # per rank
