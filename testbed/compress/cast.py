"""fp16 and bf16: each gradient cast to a 16-bit float for the wire, and summed in it (linear).

As torch's fp16/bf16 DDP hooks: the mean is taken in the gradient's precision, then the cast
payload is all-reduced and cast back; half the bytes, with a rounding per element (fp16: 11
significant bits, range 6e-5 to 65504; bf16: 8 bits, fp32's range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from testbed.compress.codec import CodecSpec, CompressConfig, PayloadCodec


@dataclass
class Fp16Config(CompressConfig):
    name: str = "fp16"


@dataclass
class Bf16Config(CompressConfig):
    name: str = "bf16"


class Cast(PayloadCodec):
    linear = True
    target: ClassVar[torch.dtype]

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buffer = torch.empty(self.numel, dtype=self.target, device=self.device)

    def payload_numel(self) -> int:
        return self.numel

    @property
    def payload_dtype(self) -> torch.dtype:
        return self.target

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.buffer.copy_(x)

    def decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool = False) -> None:
        if add:
            out.add_(payload)
        else:
            out.copy_(payload)


class Fp16(Cast):
    target = torch.float16


class Bf16(Cast):
    target = torch.bfloat16


SPECS = (CodecSpec(name="fp16", schema=Fp16Config, impl=Fp16), CodecSpec(name="bf16", schema=Bf16Config, impl=Bf16))
