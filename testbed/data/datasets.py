"""The in-memory data sets (synthetic classification, synthetic language modelling, scikit-learn
digits) and the input spec of every data set, in memory or read from files (testbed.data.loader)."""

from __future__ import annotations

from typing import Any

import torch

from testbed.data.loader import ImageFolder
from testbed.data.spec import DataSpec


def load_dataset(cfg: Any, seed: int) -> tuple[torch.Tensor, torch.Tensor, DataSpec]:
    if cfg.name == "synthetic":
        return synthetic_classification(list(cfg.shape), cfg.num_classes, cfg.num_samples, seed)
    if cfg.name == "lm":
        return synthetic_lm(cfg.vocab_size, cfg.seq_len, cfg.num_samples, seed)
    if cfg.name == "digits":
        return digits()
    raise ValueError(f"data={cfg.name}: unknown; allowed: synthetic|lm|digits")


# What each data option feeds a model: classification inputs with labels, or token sequences.
DATA_KINDS = {"synthetic": "classification", "digits": "classification", "synthetic_images": "classification",
              "image_folder": "classification", "lm": "lm", "tokens": "lm"}


def spec_for(cfg: Any) -> DataSpec:
    """The data's input spec without generating or reading it (what models and the simulator need)."""
    if cfg.name not in DATA_KINDS:
        raise ValueError(f"data={cfg.name}: unknown; allowed: {'|'.join(DATA_KINDS)}")
    if DATA_KINDS[cfg.name] == "lm":
        return DataSpec("lm", (cfg.seq_len,), vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    if cfg.name == "synthetic":
        return DataSpec("classification", tuple(cfg.shape), num_classes=cfg.num_classes)
    if cfg.name == "digits":
        return DataSpec("classification", (1, 8, 8), num_classes=10)
    if cfg.name == "synthetic_images":
        return DataSpec("classification", (3, cfg.image_size, cfg.image_size), num_classes=cfg.num_classes)
    # image_folder scans its folders (as torchvision's ImageFolder does): a bad root fails before any rank starts.
    classes = ImageFolder(cfg.root, cfg.image_size).classes
    return DataSpec("classification", (3, cfg.image_size, cfg.image_size), num_classes=len(classes))


def synthetic_classification(
    shape: list[int], num_classes: int, num_samples: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, DataSpec]:
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, and exactly reproducible."""
    gen = torch.Generator().manual_seed(seed + 17)
    x = torch.randn(num_samples, *shape, generator=gen)
    teacher = torch.randn(x[0].numel(), num_classes, generator=gen)
    y = (x.flatten(1) @ teacher).argmax(dim=1)
    return x, y, DataSpec("classification", tuple(shape), num_classes=num_classes)


def synthetic_lm(vocab: int, seq_len: int, num_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, DataSpec]:
    """Token sequences from a sparse random Markov chain (4 likely successors per token)."""
    gen = torch.Generator().manual_seed(seed + 29)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)
    tokens = torch.empty(num_samples, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (num_samples,), generator=gen)
    for t in range(seq_len):
        pick = torch.randint(0, 4, (num_samples,), generator=gen)
        tokens[:, t + 1] = successors[tokens[:, t], pick]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), DataSpec("lm", (seq_len,), vocab_size=vocab, seq_len=seq_len)


def digits() -> tuple[torch.Tensor, torch.Tensor, DataSpec]:
    """scikit-learn's 1797 real 8x8 handwritten digits, scaled to [0, 1], as 1-channel images."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).div_(16.0).view(-1, 1, 8, 8)
    y = torch.tensor(bunch.target, dtype=torch.long)
    return x, y, DataSpec("classification", (1, 8, 8), num_classes=10)
