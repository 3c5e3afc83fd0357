"""A real input pipeline: map-style data sets read by a ``DataLoader`` per rank.

Everything is in global-batch units, as in ``RankBatches``: each epoch orders the samples by a
permutation drawn from ``(seed, epoch)``, global batch ``t`` of the epoch is order positions
``[t*G, (t+1)*G)`` with ``G = sum(sizes)``, and rank ``r`` takes the ``sizes[r]`` positions after
those of ranks ``0..r-1``. So the concatenation over ranks of one step's batches is exactly the
batch a single process would draw, and data-parallel training stays equal to single-process
training. Unlike ``RankBatches`` a batch never straddles epochs: the tail is dropped
(``drop_last``) or the last global batch is padded by wrapping to the start of the epoch's order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from testbed.seeds import rank_seed

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
TOKEN_DTYPES = ("uint16", "uint32")
# Workers must start from a clean process: a forked gRPC channel (the parameter server's) breaks.
WORKER_STARTS = ("forkserver", "spawn")


class RankSampler(Sampler[int]):
    """The sample indices of this rank's batches in one epoch, from ``start_step`` on."""

    def __init__(
        self, num_samples: int, sizes: list[int], rank: int, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        self.num_samples, self.seed, self.shuffle, self.drop_last = num_samples, seed, shuffle, drop_last
        self.per_rank, self.offset, self.global_batch = sizes[rank], sum(sizes[:rank]), sum(sizes)
        if num_samples < 1 or (drop_last and num_samples < self.global_batch):
            raise ValueError(
                f"data: {num_samples} samples cannot fill one global batch of {self.global_batch}; "
                "lower data.batch_size or set data.drop_last=false"
            )
        self.epoch, self.start_step = 0, 0

    @property
    def steps_per_epoch(self) -> int:
        if self.drop_last:
            return self.num_samples // self.global_batch
        return math.ceil(self.num_samples / self.global_batch)

    def set_epoch(self, epoch: int, start_step: int = 0) -> None:
        """Iterate ``epoch`` next, from ``start_step`` (a resumed run); a new epoch starts at 0."""
        if not 0 <= start_step < self.steps_per_epoch:
            raise ValueError(f"start_step={start_step}: an epoch has {self.steps_per_epoch} steps")
        self.epoch, self.start_step = epoch, start_step

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        steps = torch.arange(self.start_step, self.steps_per_epoch)
        positions = steps[:, None] * self.global_batch + self.offset + torch.arange(self.per_rank)
        # Positions past the end wrap to the epoch's start: the padding of a partial last batch.
        return iter(order[positions.flatten() % self.num_samples].tolist())

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.per_rank


class LoaderBatches:
    """This rank's batch stream over a map-style data set; ``batch(i)`` is batch ``i`` of the run."""

    def __init__(
        self,
        dataset: Dataset,
        sizes: list[int],
        rank: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = True,
        prefetch_factor: int = 2,
        worker_start: str = "forkserver",
    ) -> None:
        if worker_start not in WORKER_STARTS:
            raise ValueError(f"data.worker_start={worker_start}: allowed: {'|'.join(WORKER_STARTS)}")
        self.sampler = RankSampler(len(dataset), sizes, rank, seed, shuffle, drop_last)
        workers = num_workers > 0
        self.loader = DataLoader(
            dataset,
            batch_size=sizes[rank],
            sampler=self.sampler,
            num_workers=num_workers,
            pin_memory=pin_memory,
            persistent_workers=persistent_workers and workers,
            prefetch_factor=prefetch_factor if workers else None,
            multiprocessing_context=worker_start if workers else None,
            generator=torch.Generator().manual_seed(rank_seed(seed, rank)),
        )
        self.epoch, self.epochs_started = 0, 0
        self._iterator: Iterator[list[torch.Tensor]] | None = None
        self._next: int | None = None  # the batch number the next call must ask for; None before the first

    def _start_epoch(self, epoch: int, start_step: int = 0) -> None:
        self.sampler.set_epoch(epoch, start_step)
        self.epoch = epoch
        self.epochs_started += 1
        self._iterator = iter(self.loader)  # persistent workers are reused, not restarted

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._next is None:
            self._start_epoch(*divmod(i, self.sampler.steps_per_epoch))
        elif i != self._next:
            raise ValueError(f"data: batch {i} asked for, but batches are read in order and the next is {self._next}")
        self._next = i + 1
        batch = next(self._iterator, None)
        if batch is None:
            self._start_epoch(self.epoch + 1)
            batch = next(self._iterator)
        return batch

    def describe(self) -> dict[str, Any]:
        """For summary.json: the data set's size, the steps an epoch has and the epochs begun."""
        return {"samples": self.sampler.num_samples, "steps_per_epoch": self.sampler.steps_per_epoch,
                "epochs": self.epochs_started, "num_workers": self.loader.num_workers}

    def close(self) -> None:
        """Shut the workers down: the loader holds persistent workers' iterator too, so drop both."""
        self._iterator = None
        self.loader._iterator = None


class ImageFolder(Dataset):
    """The ImageNet layout: ``root/<class>/<image>``; classes are the sorted folder names.

    A sample is the image with its shorter side resized to ``image_size`` (bilinear) and center
    cropped to a square, as ImageNet-normalized floats ``3 x S x S``, and its class index.
    """

    def __init__(self, root: str, image_size: int) -> None:
        path = Path(root)
        if not path.is_dir():
            raise ValueError(f"data.root={root}: no such directory; give a folder with one subfolder of images per class")
        self.classes = sorted(d.name for d in path.iterdir() if d.is_dir())
        if not self.classes:
            raise ValueError(f"data.root={root}: no class folders (expected root/<class>/<image>)")
        self.samples: list[tuple[str, int]] = []
        for label, name in enumerate(self.classes):
            files = sorted(f for f in (path / name).iterdir() if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)
            if not files:
                raise ValueError(f"data.root={root}: class folder {name!r} has no {'/'.join(IMAGE_EXTENSIONS)} images")
            self.samples += [(str(f), label) for f in files]
        self.image_size = image_size
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        file, label = self.samples[index]
        size = self.image_size
        with Image.open(file) as image:
            image = image.convert("RGB")
        w, h = image.size
        # torchvision's Resize(size): the shorter side becomes size, the longer keeps the aspect (truncated).
        if w > h:
            rw, rh = int(size * w / h), size
        else:
            rw, rh = size, int(size * h / w)
        image = image.resize((rw, rh), Image.Resampling.BILINEAR)
        left, top = int(round((rw - size) / 2)), int(round((rh - size) / 2))
        image = image.crop((left, top, left + size, top + size))
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255).permute(2, 0, 1)
        return ((pixels - self.mean) / self.std).contiguous(), label


class TokenFile(Dataset):
    """A flat token file (nanoGPT's ``train.bin``): sample ``i`` is window ``i`` of ``seq_len`` tokens
    and the same window shifted by one as its targets; the file is memory-mapped on first use."""

    def __init__(self, path: str, seq_len: int, dtype: str = "uint16") -> None:
        if dtype not in TOKEN_DTYPES:
            raise ValueError(f"data.dtype={dtype}: allowed: {'|'.join(TOKEN_DTYPES)}")
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len}: must be positive")
        file = Path(path)
        if not file.is_file():
            raise ValueError(f"data.path={path}: no such file")
        itemsize = np.dtype(dtype).itemsize
        nbytes = file.stat().st_size
        if nbytes % itemsize:
            raise ValueError(f"data.dtype={dtype}: data.path={path} has {nbytes} bytes, not a multiple of {itemsize}")
        self.num_tokens = nbytes // itemsize
        if self.num_tokens < seq_len + 1:
            raise ValueError(
                f"data.path={path}: {self.num_tokens} tokens, fewer than one window of data.seq_len={seq_len} + 1"
            )
        self.path, self.seq_len, self.dtype = path, seq_len, dtype
        self._tokens: np.memmap | None = None

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def first_beyond(self, vocab_size: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
        """(offset, id) of the file's first token id outside [0, ``vocab_size``), or None: read in chunks,
        so that a file larger than memory is checked too."""
        tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        for start in range(0, self.num_tokens, chunk):
            part = tokens[start:start + chunk]
            if int(part.max()) >= vocab_size:
                at = int(np.argmax(part >= vocab_size))
                return start + at, int(part[at])
        return None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = index * self.seq_len
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict:
        # A worker maps the file itself; pickling the map would copy the whole file.
        return {**self.__dict__, "_tokens": None}


class SyntheticImageBatches:
    """Horovod's synthetic benchmark input: one random batch made once on the device, every step."""

    def __init__(
        self, shape: tuple[int, int, int], num_classes: int, batch: int, rank: int, seed: int, device: torch.device
    ) -> None:
        gen = torch.Generator(device=device).manual_seed(rank_seed(seed, rank))
        self.images = torch.randn(batch, *shape, generator=gen, device=device)
        self.labels = torch.randint(0, num_classes, (batch,), generator=gen, device=device)

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images, self.labels

    def describe(self) -> dict[str, Any]:
        return {"samples": int(self.images.shape[0]), "synthetic": True}

    def close(self) -> None:
        """Nothing to shut down (the interface of ``LoaderBatches``)."""


__all__ = ["ImageFolder", "LoaderBatches", "RankSampler", "SyntheticImageBatches", "TokenFile"]
