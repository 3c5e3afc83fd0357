"""Sparsifiers: top-k (the k largest magnitudes) and random-k (k indices all ranks draw alike).

``k = max(1, round(ratio * numel))`` per bucket. Top-k's indices differ between ranks, so its
payload carries them (int32 indices, then the values: 4k + k * element bytes, padded to a multiple of 4 or of the
element size) and is allgathered
(non-linear). Random-k's indices come from a generator seeded by (seed, bucket, step), the same
on every rank (with replacement: about ratio / 2 of them repeat), so only the k values travel and
they sum inside an all-reduce (linear). Neither
rescales the values (as GRACE's): with error feedback (on by default) what is not sent now is
sent later; at ratio 1 both send everything, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from testbed.checks import require
from testbed.compress.codec import BytePayload, CodecSpec, CompressConfig, PayloadCodec, generator

INDEX = torch.int32


@dataclass
class TopKConfig(CompressConfig):
    name: str = "topk"
    ratio: float = 0.01  # share of each bucket's elements sent
    error_feedback: bool = True


@dataclass
class RandomKConfig(CompressConfig):
    name: str = "randomk"
    ratio: float = 0.01
    seed: int | None = None  # of the shared index draws; null: the run's seed
    error_feedback: bool = True


def _k(cfg: Any, numel: int) -> int:
    return max(1, min(numel, round(float(cfg.ratio) * numel)))


class TopK(BytePayload):
    linear = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.k = _k(self.cfg, self.numel)
        esize = torch.empty(0, dtype=self.dtype).element_size()
        # Both parts start, and the payload ends, on a multiple of the larger element size, so that
        # they are views of it and of every slot of an allgather (a few bytes of padding at most).
        align = max(4, esize)
        self.index_bytes = -(-4 * self.k // align) * align
        total = -(-(self.index_bytes + self.k * esize) // align) * align
        self.buffer = torch.zeros(total, dtype=torch.uint8, device=self.device)
        self.indices = self.buffer[: 4 * self.k].view(INDEX)
        self.values = self.buffer[self.index_bytes : self.index_bytes + self.k * esize].view(self.dtype)
        self.esize = esize

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        chosen = torch.topk(x.abs(), self.k, sorted=False).indices
        self.indices.copy_(chosen)
        torch.index_select(x, 0, chosen, out=self.values)
        return self.buffer

    def decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool = False) -> None:
        indices = payload[: 4 * self.k].view(INDEX).long()
        values = payload[self.index_bytes : self.index_bytes + self.k * self.esize].view(self.dtype)
        if not add:
            out.zero_()
        out.index_add_(0, indices, values)


class RandomK(PayloadCodec):
    linear = True

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.k = _k(self.cfg, self.numel)
        self.shared_seed = self.seed if self.cfg.seed is None else int(self.cfg.seed)
        self.values = torch.empty(self.k, dtype=self.dtype, device=self.device)
        self.chosen = torch.empty(self.k, dtype=torch.long, device=self.device)

    def payload_numel(self) -> int:
        return self.k

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.chosen = self.indices(self.steps)
        return torch.index_select(x, 0, self.chosen, out=self.values)

    def expect(self, step: int) -> None:
        self.chosen = self.indices(step)

    def indices(self, step: int) -> torch.Tensor:
        """Step ``step``'s k indices, drawn with replacement (as BytePS's random-k: O(k), where a
        permutation costs O(numel)); all of them, in order, at ratio 1."""
        if self.k == self.numel:
            return torch.arange(self.numel, device=self.device)
        draw = generator(self.device, self.shared_seed, self.index, step)
        return torch.randint(self.numel, (self.k,), generator=draw, device=self.device)

    def decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool = False) -> None:
        # Put, not add: a repeated index carries the same value twice and must land once.
        if add:
            out.index_put_((self.chosen,), out[self.chosen] + payload)
        else:
            out.zero_()
            out.index_put_((self.chosen,), payload)


def _check(cfg: Any) -> None:
    ratio = cfg.compress.ratio
    require(0 < ratio <= 1, f"compress.ratio={ratio}: must be in (0, 1] (the share of elements sent)")


def _label(cfg: Any) -> str:
    return f"{cfg['name']} {100 * float(cfg['ratio']):g}%"


SPECS = (
    CodecSpec(name="topk", schema=TopKConfig, impl=TopK, check=_check, label=_label),
    CodecSpec(name="randomk", schema=RandomKConfig, impl=RandomK, check=_check, label=_label),
)
