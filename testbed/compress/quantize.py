"""Quantizers: QSGD (stochastic levels of each block's norm) and scaled sign (EF-signSGD).

- ``qsgd`` (Alistarh et al. 2017): element i of a block is sent as sign(x_i) * l_i with l_i in
  {0..s}, drawn so that E[l_i] = s |x_i| / ||block||_2 (unbiased); the payload is one norm per block
  of ``block`` elements (4 bytes each, fp32; the last block may be shorter), then one int8 per
  element (s <= 127). Blocks are the paper's buckets: QSGD's variance grows as sqrt(block) / s
  times the signal's, so one norm over a large bucket sends more noise than signal, and wherever
  the error is fed back (error feedback, a compressed pull's held copy) that noise grows each step
  and diverges. The rounding draws are each rank's own (seeded by seed, rank, bucket, step).
- ``signsgd`` (Karimireddy et al. 2019, EF-signSGD): the signs, one bit per element (the last
  byte padded with zero bits), scaled by ||x||_1 / numel (4 bytes, fp32); error feedback on by
  default, without which scaled sign does not converge in general.

Both payloads differ in scale between ranks, so they are allgathered (non-linear).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from testbed.checks import require
from testbed.compress.codec import BytePayload, CodecSpec, CompressConfig, generator

SCALE = torch.float32
BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


@dataclass
class QsgdConfig(CompressConfig):
    name: str = "qsgd"
    levels: int = 127  # s: quantization levels per sign (at most 127: one int8 per element)
    block: int = 512  # elements per norm (the paper's bucket size); 0: one norm for the whole bucket


@dataclass
class SignConfig(CompressConfig):
    name: str = "signsgd"
    error_feedback: bool = True


class Qsgd(BytePayload):
    linear = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.levels = int(self.cfg.levels)
        self.block = min(int(self.cfg.block) or self.numel, self.numel)
        self.full = self.numel // self.block  # whole blocks; a shorter one may follow
        blocks = -(-self.numel // self.block)
        self.buffer = torch.empty(4 * blocks + self.numel, dtype=torch.uint8, device=self.device)
        self.norms = self.buffer[: 4 * blocks].view(SCALE)
        self.codes = self.buffer[4 * blocks :].view(torch.int8)

    def _per_block_(self, values: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
        """Multiply each block of ``values`` (numel) by its factor, in place."""
        cut = self.full * self.block
        values[:cut].view(self.full, self.block).mul_(factors[: self.full, None])
        if cut < self.numel:
            values[cut:].mul_(factors[self.full])
        return values

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        values = x.to(SCALE)
        cut = self.full * self.block
        torch.linalg.vector_norm(values[:cut].view(self.full, self.block), dim=1, out=self.norms[: self.full])
        if cut < self.numel:
            self.norms[self.full] = values[cut:].norm()
        inverse = torch.where(self.norms > 0, self.levels / self.norms, 0.0)  # a zero block sends zeros
        scaled = self._per_block_(values.abs(), inverse)
        draw = generator(self.device, self.seed, self.rank, self.index, self.steps)
        noise = torch.rand(self.numel, generator=draw, dtype=SCALE, device=self.device)
        levels = scaled.add_(noise).floor_().clamp_(max=self.levels)
        self.codes.copy_(levels.mul_(torch.sign(values)))
        return self.buffer

    def decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool = False) -> None:
        cut = 4 * self.norms.numel()
        scale = payload[:cut].clone().view(SCALE) / self.levels  # a copy: a gathered slot may sit unaligned
        values = self._per_block_(payload[cut:].view(torch.int8).to(out.dtype), scale.to(out.dtype))
        if add:
            out.add_(values)
        else:
            out.copy_(values)


class ScaledSign(BytePayload):
    linear = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.nbytes = -(-self.numel // 8)
        self.buffer = torch.empty(4 + self.nbytes, dtype=torch.uint8, device=self.device)
        self.scale = self.buffer[:4].view(SCALE)
        self.bits = torch.zeros(self.nbytes * 8, dtype=torch.uint8, device=self.device)  # padding stays 0
        self.weights = BITS.to(self.device)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.copy_(x.abs().sum().to(SCALE) / self.numel)
        torch.ge(x, 0, out=self.bits[: self.numel].view(torch.bool))
        packed = self.bits.view(-1, 8).mul(self.weights).sum(dim=1, dtype=torch.uint8)
        self.buffer[4:].copy_(packed)
        return self.buffer

    def decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool = False) -> None:
        scale = payload[:4].clone().view(SCALE).to(out.dtype)
        bits = payload[4:].unsqueeze(1).bitwise_and(self.weights).ne(0).view(-1)[: self.numel]
        values = bits.to(out.dtype).mul_(2).sub_(1).mul_(scale)  # 1 -> +scale, 0 -> -scale
        if add:
            out.add_(values)
        else:
            out.copy_(values)


def _check_qsgd(cfg: Any) -> None:
    levels = cfg.compress.levels
    require(1 <= levels <= 127, f"compress.levels={levels}: must be in [1, 127] (one int8 per element)")
    require(cfg.compress.block >= 0, f"compress.block={cfg.compress.block}: elements per norm, >= 0 (0: one per bucket)")


SPECS = (
    CodecSpec(name="qsgd", schema=QsgdConfig, impl=Qsgd, check=_check_qsgd, label=lambda c: f"qsgd s={c['levels']} block={c['block']}"),
    CodecSpec(name="signsgd", schema=SignConfig, impl=ScaledSign),
)
