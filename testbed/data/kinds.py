"""Data kinds by name (the ``data=`` option): what each feeds a model, how it loads, and its
held-out split.

A kind declares its input spec (what models and the simulator need, without loading anything), the
training batch stream of one rank, the held-out split that evaluation reads (testbed.eval), and
checks that run before any process is spawned. Nothing outside this module switches on a data
kind's name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
from omegaconf import OmegaConf

from testbed.checks import ConfigError, require, resolved_device
from testbed.data import datasets
from testbed.data.batches import BatchSource, DatasetHeldOut, HeldOut, RankBatches, TensorHeldOut
from testbed.data.loader import (
    TOKEN_DTYPES,
    WORKER_STARTS,
    ImageFolder,
    LoaderBatches,
    SyntheticImageBatches,
    TokenFile,
)
from testbed.data.schema import (
    DataConfig,
    LmDataConfig,
    Mnist1dDataConfig,
    SyntheticImagesDataConfig,
    TokensDataConfig,
)
from testbed.data.spec import DataSpec


@dataclass(frozen=True)
class DataKind:
    schema: type[DataConfig]  # its fields and their defaults (testbed.data.schema)
    reads: str  # what it feeds a model: "classification" (inputs and labels) | "lm" (token sequences)
    spec: Callable[[Any], DataSpec]
    # This rank's training batches: (cfg, sizes (every rank's samples per step), rank, seed, device).
    batches: Callable[[Any, list[int], int, int, torch.device], BatchSource]
    # The held-out split, the same on every rank: (cfg, seed); None where the kind has none.
    heldout: Callable[[Any, int], HeldOut] | None
    no_heldout: str = ""  # why it has none, or how to give it one (a quality target is refused with this)
    heldout_from: str | None = None  # the config field the held-out split is read from (a file kind's)
    loader: bool = False  # read through a DataLoader: the input pipeline's settings (data.num_workers, ...) apply
    # A rank's share of the global batch may change during the run (balance=static|dynamic).
    resizable: bool = False
    # Its batches are RankBatches over two tensors, which one process can slice for many workers
    # (launcher=virtual, testbed.launch.virtual).
    in_memory: bool = False
    check: Callable[[Any], None] = lambda cfg: None
    # Training samples, known before anything loads (warmup_epochs, eval at an epoch); None: unknown.
    train_size: Callable[[Any], int | None] = lambda cfg: None


# --- in-memory kinds: one generator gives both splits --------------------------------------------


VAL_SAMPLES = DataConfig.val_samples  # the schema's default, for a data config given without it

# Each in-memory kind's generator: (data config as plain values, seed) -> both splits.
_GENERATORS: dict[str, Callable[[dict[str, Any], int], datasets.Tensors]] = {
    "synthetic": lambda c, seed: datasets.synthetic_classification(
        c["shape"], c["num_classes"], c["num_samples"], c.get("val_samples", VAL_SAMPLES), seed),
    "lm": lambda c, seed: datasets.synthetic_lm(c["vocab_size"], c["seq_len"], c["num_samples"],
                                                c.get("val_samples", VAL_SAMPLES), seed),
    "digits": lambda c, seed: datasets.digits(),
    "mnist1d": lambda c, seed: datasets.mnist1d(c["num_samples"]),
}


@lru_cache(maxsize=4)
def _tensors(cfg_json: str, seed: int) -> datasets.Tensors:
    cfg = json.loads(cfg_json)
    return _GENERATORS[cfg["name"]](cfg, seed)


def tensors(cfg: Any, seed: int) -> datasets.Tensors:
    """An in-memory kind's training and held-out tensors (made once per process and config)."""
    plain = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    return _tensors(json.dumps(plain, sort_keys=True, default=str), seed)


def _in_memory_batches(cfg: Any, sizes: list[int], rank: int, seed: int, device: torch.device) -> BatchSource:
    x, y, _, _ = tensors(cfg, seed)
    return RankBatches(x, y, sizes, rank, seed).to(device)


def _in_memory_heldout(cfg: Any, seed: int) -> HeldOut:
    _, _, x, y = tensors(cfg, seed)
    return TensorHeldOut(x, y)


def _check_counts(cfg: Any) -> None:
    require(cfg.num_samples >= 1, f"data.num_samples={cfg.num_samples}: must be >= 1")
    require(cfg.val_samples >= 1, f"data.val_samples={cfg.val_samples}: held-out samples, must be >= 1")


def _check_mnist1d(cfg: Any) -> None:
    # The generator makes num_samples // 10 per digit, and holds out 20 % of them.
    require(cfg.num_samples >= 50, f"data.num_samples={cfg.num_samples}: MNIST-1D needs >= 50 (10 digits, 20 % held out)")


# --- file kinds: a folder or a token file for each split -----------------------------------------


def _pipeline(cfg: Any) -> dict[str, Any]:
    keys = ("shuffle", "drop_last", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "worker_start")
    return {k: cfg[k] for k in keys}


def _image_folder_spec(cfg: Any) -> DataSpec:
    # It scans its folders (as torchvision's ImageFolder does): a bad root fails before any rank starts.
    classes = ImageFolder(cfg.root, cfg.image_size).classes
    return DataSpec("classification", (3, cfg.image_size, cfg.image_size), num_classes=len(classes))


def _check_image_folder(cfg: Any) -> None:
    require(cfg.image_size >= 1, f"data.image_size={cfg.image_size}: must be >= 1 (pixels per side)")
    if cfg.val_root is None:
        return
    train = ImageFolder(cfg.root, cfg.image_size).classes
    try:
        held = ImageFolder(cfg.val_root, cfg.image_size).classes
    except ValueError as exc:
        raise ConfigError(f"data.val_root={cfg.val_root}: {exc}") from None
    require(train == held, f"data.val_root={cfg.val_root}: its classes differ from data.root's ({len(held)} against "
                           f"{len(train)}; e.g. {sorted(set(train) ^ set(held))[:3]}); give a val/ folder of the same classes")


def _check_tokens(cfg: Any) -> None:
    require(cfg.dtype in TOKEN_DTYPES, f"data.dtype={cfg.dtype}: allowed: {'|'.join(TOKEN_DTYPES)}")
    require(cfg.vocab_size >= 2, f"data.vocab_size={cfg.vocab_size}: the token file's vocabulary, >= 2")
    for key in ("path", "val_path") if cfg.val_path is not None else ("path",):
        try:  # the file's size against dtype and seq_len: a stat, not a read
            tokens = TokenFile(str(cfg[key]), cfg.seq_len, cfg.dtype)
        except ValueError as exc:
            message = str(exc).replace("data.path=", f"data.{key}=")
            raise ConfigError(f"{message}; data=tokens reads a flat {cfg.dtype} token file (nanoGPT's train.bin)") from None
        # Every id must index the embedding: found here, by file and offset, not as an IndexError mid-run.
        beyond = tokens.first_beyond(int(cfg.vocab_size))
        require(beyond is None, f"data.{key}={cfg[key]}: token {beyond[1] if beyond else ''} at offset "
                                f"{beyond[0] if beyond else ''} (in tokens) is outside data.vocab_size={cfg.vocab_size}; "
                                "set data.vocab_size to the tokenizer's vocabulary (above the largest id), or check "
                                "data.dtype against how the file was written")


def _lm_spec(cfg: Any) -> DataSpec:
    return DataSpec("lm", (cfg.seq_len,), vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)


DATA_KINDS: dict[str, DataKind] = {
    "synthetic": DataKind(
        DataConfig, "classification", lambda cfg: DataSpec("classification", tuple(cfg.shape), num_classes=cfg.num_classes),
        _in_memory_batches, _in_memory_heldout, in_memory=True, check=_check_counts, train_size=lambda cfg: int(cfg.num_samples),
        resizable=True),
    "digits": DataKind(
        DataConfig, "classification", lambda cfg: DataSpec("classification", (1, 8, 8), num_classes=10),
        _in_memory_batches, _in_memory_heldout, in_memory=True, train_size=lambda cfg: len(tensors(cfg, 0)[0]), resizable=True),
    "mnist1d": DataKind(
        Mnist1dDataConfig, "classification", lambda cfg: DataSpec("classification", (1, 40), num_classes=10),
        _in_memory_batches, _in_memory_heldout, in_memory=True, check=_check_mnist1d,
        train_size=lambda cfg: int(cfg.num_samples) // 10 * 10 * 4 // 5, resizable=True),
    "lm": DataKind(LmDataConfig, "lm", _lm_spec, _in_memory_batches, _in_memory_heldout, in_memory=True, check=_check_counts,
                   train_size=lambda cfg: int(cfg.num_samples), resizable=True),
    "synthetic_images": DataKind(
        SyntheticImagesDataConfig, "classification",
        lambda cfg: DataSpec("classification", (3, cfg.image_size, cfg.image_size), num_classes=cfg.num_classes),
        lambda cfg, sizes, rank, seed, device: SyntheticImageBatches(
            (3, cfg.image_size, cfg.image_size), cfg.num_classes, sizes[rank], rank, seed, device),
        None, no_heldout="its one random batch has no held-out split (it measures systems, not learning)",
        check=lambda cfg: require(cfg.image_size >= 1 and cfg.num_classes >= 1,
                                  "data.image_size and data.num_classes: must be >= 1")),
    "image_folder": DataKind(
        DataConfig, "classification", _image_folder_spec,
        lambda cfg, sizes, rank, seed, device: LoaderBatches(
            ImageFolder(cfg.root, cfg.image_size), sizes, rank, seed, **_pipeline(cfg)),
        lambda cfg, seed: DatasetHeldOut(ImageFolder(cfg.val_root, cfg.image_size)),
        no_heldout="set data.val_root to its held-out images (ImageNet's val/ layout, the same classes)",
        heldout_from="val_root", loader=True,
        check=_check_image_folder),
    "tokens": DataKind(
        TokensDataConfig, "lm", _lm_spec,
        lambda cfg, sizes, rank, seed, device: LoaderBatches(
            TokenFile(cfg.path, cfg.seq_len, cfg.dtype), sizes, rank, seed, **_pipeline(cfg)),
        lambda cfg, seed: DatasetHeldOut(TokenFile(cfg.val_path, cfg.seq_len, cfg.dtype)),
        no_heldout="set data.val_path to a held-out token file (nanoGPT's val.bin)",
        heldout_from="val_path", loader=True,
        check=_check_tokens),
}


def data_kind(name: str) -> DataKind:
    if name not in DATA_KINDS:
        raise ValueError(f"data={name}: unknown; allowed: {'|'.join(DATA_KINDS)}")
    return DATA_KINDS[name]


def spec_for(cfg: Any) -> DataSpec:
    """The data's input spec without generating or reading it (what models and the simulator need)."""
    return data_kind(cfg.name).spec(cfg)


def heldout_of(cfg: Any) -> str | None:
    """Why this data has no held-out split to evaluate on; None when it has one."""
    kind = data_kind(cfg.name)
    if kind.heldout is None:
        return f"data={cfg.name}: {kind.no_heldout}"
    if kind.heldout_from is not None and cfg[kind.heldout_from] is None:
        return f"data={cfg.name} without data.{kind.heldout_from}: {kind.no_heldout}"
    return None


def build_heldout(cfg: Any, seed: int) -> HeldOut:
    """The held-out split evaluation reads; call ``heldout_of`` first for the reason there is none."""
    reason = heldout_of(cfg)
    if reason is not None:
        raise ValueError(reason)
    return data_kind(cfg.name).heldout(cfg, seed)  # type: ignore[misc]


def check_data(cfg: Any) -> None:
    """The data group's own checks: its kind's, and the input pipeline's where it has one."""
    data = cfg.data
    require(all(d >= 1 for d in data.shape), f"data.shape={list(data.shape)}: every dimension must be >= 1")
    kind = data_kind(data.name)
    kind.check(data)
    if kind.loader:
        require(data.num_workers >= 0, f"data.num_workers={data.num_workers}: must be >= 0 (0: load in the rank)")
        require(data.prefetch_factor >= 1, f"data.prefetch_factor={data.prefetch_factor}: must be >= 1")
        require(data.worker_start in WORKER_STARTS,
                f"data.worker_start={data.worker_start}: allowed: {'|'.join(WORKER_STARTS)} (fork breaks gRPC channels)")
        require(not data.pin_memory or resolved_device(cfg) == "cuda", "data.pin_memory=true is for CUDA; drop it on CPU")
