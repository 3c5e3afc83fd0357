"""The data group's schema: the fields every data kind shares, and each kind's own defaults.

Each kind (testbed.data.kinds) names its schema; a kind whose defaults differ from the shared ones
(MNIST-1D's paper-sized set, GPT-2's token files) has a subclass, so that its YAML under
experiments/data/ repeats only values equal to its schema's (tests/test_config_defaults.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from omegaconf import MISSING


class Scaling(enum.Enum):
    weak = "weak"  # data.batch_size is per worker; the global batch grows with world_size
    strong = "strong"  # data.batch_size is global; each worker gets batch_size / world_size


@dataclass
class DataConfig:
    name: str = MISSING
    batch_size: int = 32
    scaling: Scaling = Scaling.weak
    num_samples: int = 4096  # synthetic data sets and mnist1d are materialised once per rank
    val_samples: int = 1024  # synthetic, lm: held-out samples drawn from the same teacher or chain
    shape: list[int] = field(default_factory=lambda: [3, 16, 16])  # classification inputs
    num_classes: int = 10
    vocab_size: int = 256  # language-model data (tokens: the tokenizer's vocabulary)
    seq_len: int = 64
    image_size: int = 224  # image_folder, synthetic_images: inputs are 3 x image_size x image_size
    root: str | None = None  # image_folder: one folder per class (the ImageNet layout)
    val_root: str | None = None  # image_folder: the held-out images (ImageNet's val/), the same classes
    path: str | None = None  # tokens: a flat binary token file (nanoGPT's train.bin)
    val_path: str | None = None  # tokens: the held-out token file (nanoGPT's val.bin)
    dtype: str = "uint16"  # tokens: uint16 | uint32
    # The input pipeline of file data sets (torch.utils.data.DataLoader, testbed.data.loader).
    num_workers: int = 0  # decoding processes per rank; 0: in the rank's own process
    pin_memory: bool = False  # page-locked batches (CUDA): faster, asynchronous host-to-device copies
    persistent_workers: bool = True  # workers live across epochs (num_workers > 0)
    prefetch_factor: int = 2  # batches each worker loads ahead (num_workers > 0)
    # How workers start: forkserver or spawn, never fork, whose children would inherit gRPC's
    # threads (the parameter server's channels) in an undefined state.
    worker_start: str = "forkserver"
    shuffle: bool = True  # a new order every epoch (DistributedSampler's set_epoch)
    drop_last: bool = True  # drop the epoch's last partial global batch; false: pad it by wrapping around


@dataclass
class LmDataConfig(DataConfig):
    batch_size: int = 16
    num_samples: int = 2048


@dataclass
class Mnist1dDataConfig(DataConfig):
    num_samples: int = 5000  # the paper's data set: 4,000 for training, 1,000 held out
    batch_size: int = 100  # the paper's


@dataclass
class SyntheticImagesDataConfig(DataConfig):
    num_classes: int = 1000  # ImageNet's, as Horovod's synthetic benchmark


@dataclass
class TokensDataConfig(DataConfig):
    batch_size: int = 8
    seq_len: int = 1024  # GPT-2's context
    vocab_size: int = 50257  # GPT-2's tokenizer
