"""The in-memory data sets, each a training split and a held-out split from one generator:
synthetic classification, synthetic language modelling, scikit-learn's digits and MNIST-1D.

Every function returns ``(x, y, x_heldout, y_heldout)``. The held-out samples come from the same
distribution as the training samples (the same teacher, the same Markov chain, the same digit
templates) and never from the training tensors themselves.
"""

from __future__ import annotations

import os
import random
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import torch

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def synthetic_classification(shape: list[int], num_classes: int, num_samples: int, heldout: int, seed: int) -> Tensors:
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, and exactly reproducible.
    The held-out inputs are drawn after the teacher, so the training samples do not depend on how
    many are held out."""
    gen = torch.Generator().manual_seed(seed + 17)
    x = torch.randn(num_samples, *shape, generator=gen)
    teacher = torch.randn(x[0].numel(), num_classes, generator=gen)
    x_val = torch.randn(heldout, *shape, generator=gen)
    return x, (x.flatten(1) @ teacher).argmax(dim=1), x_val, (x_val.flatten(1) @ teacher).argmax(dim=1)


def synthetic_lm(vocab: int, seq_len: int, num_samples: int, heldout: int, seed: int) -> Tensors:
    """Token sequences from a sparse random Markov chain (4 likely successors per token); the
    held-out sequences are walks of the same chain drawn after the training ones."""
    gen = torch.Generator().manual_seed(seed + 29)
    successors = torch.randint(0, vocab, (vocab, 4), generator=gen)

    def walks(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.empty(count, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (count,), generator=gen)
        for t in range(seq_len):
            pick = torch.randint(0, 4, (count,), generator=gen)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return *walks(num_samples), *walks(heldout)


# digits: every DIGITS_HOLDOUT-th sample of each class (in the data set's order) is held out.
DIGITS_HOLDOUT = 5


def digits() -> Tensors:
    """scikit-learn's 1797 real 8x8 handwritten digits, scaled to [0, 1], as 1-channel images, with
    a fixed stratified fifth of each class held out (364 samples)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.data, dtype=torch.float32).div_(16.0).view(-1, 1, 8, 8)
    y = torch.tensor(bunch.target, dtype=torch.long)
    held = torch.zeros(len(y), dtype=torch.bool)
    for label in y.unique():
        members = (y == label).nonzero().flatten()
        held[members[::DIGITS_HOLDOUT]] = True
    return x[~held], y[~held], x[held], y[held]


def mnist1d(num_samples: int) -> Tensors:
    """MNIST-1D (Greydanus 2020): the package's own generator with its own arguments (seed 42, an
    80/20 split), never its download path; ``num_samples`` 5000 is the paper's data set. Inputs are
    1 x 40 signals. Generating it takes seconds of CPU, so each size is generated once and kept in
    the data cache (testbed.data.datasets.cache_dir), per version of the package."""
    path = cache_dir() / f"mnist1d-{num_samples}-{version('mnist1d')}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    tensors = _generate_mnist1d(num_samples)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")  # whole or absent: ranks may race to write it
        os.close(fd)
        torch.save(tensors, tmp)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: generate every time
        pass
    return tensors


def cache_dir() -> Path:
    """Where generated data sets are kept: $TESTBED_DATA_CACHE, else ~/.cache/testbed."""
    return Path(os.environ.get("TESTBED_DATA_CACHE") or Path.home() / ".cache" / "testbed")


def _generate_mnist1d(num_samples: int) -> Tensors:
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples = num_samples
    # It seeds Python's and NumPy's global generators; leave the caller's as they were.
    states = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(args)
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])

    def tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(x, dtype=torch.float32).unsqueeze(1), torch.tensor(y, dtype=torch.long)

    return *tensors(data["x"], data["y"]), *tensors(data["x_test"], data["y_test"])
