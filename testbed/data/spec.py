from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataSpec:
    kind: str  # "classification" | "lm"
    shape: tuple[int, ...]  # one input sample
    num_classes: int = 0
    vocab_size: int = 0
    seq_len: int = 0

    @property
    def input_numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n
