"""PowerSGD (Vogels et al. 2019) as torch's ``powerSGD_hook`` runs it, per bucket.

Each parameter tensor of the bucket is viewed as a matrix M (rows = its first dimension) and, if
that saves enough ((rows + cols) r * min_compression_rate < rows * cols, torch's rule), sent as
two rank-r factors: P = M Q, all-reduced and orthogonalized, then Q = M^T P, all-reduced; M is
replaced by P Q^T / n. Tensors not worth compressing (biases, small matrices) are all-reduced as
they are, in the first all-reduce with the Ps (torch runs them as one more all-reduce of the same
bytes). With warm start, each step's Q starts from the last; the first Q is random, drawn alike
on every rank. Before ``start_step`` the bucket is all-reduced uncompressed, as torch's
``start_powerSGD_iter``. Error feedback (on by default, as torch's) keeps the difference between
this rank's input and the decoded mean. The codec takes the bucket unscaled and divides by n
itself, as torch's hook does, so its residuals are torch's.

Two all-reduces per bucket: PowerSGD needs every rank's P before anyone computes Q, which a
parameter server's single push cannot carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from testbed.checks import require
from testbed.compress.codec import Codec, CodecSpec, Collectives, CompressConfig, Moved, generator
from testbed.timing import device_seconds


@dataclass
class PowerSgdConfig(CompressConfig):
    name: str = "powersgd"
    rank: int = 1  # matrix_approximation_rank
    start_step: int = 0  # start_powerSGD_iter: uncompressed all-reduce before this step
    warm_start: bool = True
    min_compression_rate: float = 2.0
    error_feedback: bool = True


def orthogonalize_(matrix: torch.Tensor) -> None:
    """Gram-Schmidt on the columns of ``matrix`` in place (torch's _orthogonalize_gram_schmidt; a
    zero column stays zero, where torch's would turn to NaN without its epsilon)."""
    for i in range(matrix.shape[1]):
        col = matrix[:, i : i + 1]
        col.div_(col.norm().clamp_min(torch.finfo(matrix.dtype).tiny))
        if i + 1 < matrix.shape[1]:
            rest = matrix[:, i + 1 :]
            rest.sub_(col @ (col.T @ rest))


class PowerSgd(Codec):
    linear = True
    divides_first = False

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        rank, rate = int(self.cfg.rank), float(self.cfg.min_compression_rate)
        self.matrices: list[tuple[int, int, int, int]] = []  # (offset, rows, cols, r) of compressed tensors
        self.plain: list[tuple[int, int]] = []  # (offset, numel) of tensors sent as they are
        offset = 0
        for shape in self.shapes:
            numel = shape.numel()
            rows = shape[0] if len(shape) else 1
            cols = numel // max(1, rows)
            r = min(rows, cols, rank)
            if (rows + cols) * r * rate < rows * cols:
                self.matrices.append((offset, rows, cols, r))
            else:
                self.plain.append((offset, numel))
            offset += numel
        self.plain_numel = sum(n for _, n in self.plain)
        p_numel = sum(rows * r for _, rows, _, r in self.matrices)
        q_numel = sum(cols * r for _, _, cols, r in self.matrices)
        self.first = torch.empty(self.plain_numel + p_numel, dtype=self.dtype, device=self.device)  # plain, Ps
        self.q_memory = torch.empty(q_numel, dtype=self.dtype, device=self.device)
        self.ps, self.qs = [], []
        p_at, q_at = self.plain_numel, 0
        for _, rows, cols, r in self.matrices:
            self.ps.append(self.first[p_at : p_at + rows * r].view(rows, r))
            self.qs.append(self.q_memory[q_at : q_at + cols * r].view(cols, r))
            p_at, q_at = p_at + rows * r, q_at + cols * r
        self.input = torch.empty(self.numel, dtype=self.dtype, device=self.device) if self.error_feedback else None
        self.fresh_q = True

    def compressing(self) -> bool:
        return self.steps >= int(self.cfg.start_step)

    def payload_bytes(self) -> int:
        esize = torch.empty(0, dtype=self.dtype).element_size()
        if not self.compressing():
            return self.numel * esize
        return (self.first.numel() + self.q_memory.numel()) * esize

    def rounds(self) -> list[int]:
        esize = torch.empty(0, dtype=self.dtype).element_size()
        return [n * esize for n in (self.first.numel(), self.q_memory.numel()) if n]

    def uncompressed_steps(self) -> int:
        return int(self.cfg.start_step)

    def reduce_(self, bucket: torch.Tensor, comm: Collectives) -> Moved:
        n = comm.world_size
        if not self.compressing():  # vanilla all-reduce (the residual waits at zero)
            self.steps += 1
            sent, recv = comm.allreduce_payload_(bucket)
            bucket.div_(n)
            return Moved(sent, recv)
        start = device_seconds(self.device)  # waits for the device's kernels (testbed.timing)
        if self.residual is not None:
            bucket.add_(self.residual)
            self.input.copy_(bucket)
        if self.fresh_q or not self.cfg.warm_start:
            draw = generator(self.device, self.seed, self.index, self.steps)
            self.q_memory.copy_(torch.randn(self.q_memory.numel(), generator=draw, dtype=self.dtype, device=self.device))
            self.fresh_q = False
        at = 0
        for offset, numel in self.plain:
            self.first[at : at + numel].copy_(bucket[offset : offset + numel])
            at += numel
        matrices = [bucket[o : o + rows * cols].view(rows, cols) for o, rows, cols, _ in self.matrices]
        for m, p, q in zip(matrices, self.ps, self.qs):
            orthogonalize_(q)
            torch.matmul(m, q, out=p)
        encoded = device_seconds(self.device)
        sent, recv = comm.allreduce_payload_(self.first)
        mid = device_seconds(self.device)
        for p in self.ps:
            orthogonalize_(p)
        for m, p, q in zip(matrices, self.ps, self.qs):
            torch.matmul(m.T, p, out=q)
        between = device_seconds(self.device) - mid
        more_sent, more_recv = comm.allreduce_payload_(self.q_memory) if self.q_memory.numel() else (0, 0)
        decoding = device_seconds(self.device)
        self.q_memory.div_(n)
        at = 0
        for offset, numel in self.plain:
            bucket[offset : offset + numel].copy_(self.first[at : at + numel]).div_(n)
            at += numel
        for m, p, q in zip(matrices, self.ps, self.qs):
            torch.matmul(p, q.T, out=m)
        if self.residual is not None:
            torch.sub(self.input, bucket, out=self.residual)
        self.steps += 1
        return Moved(sent + more_sent, recv + more_recv, encoded - start + between,
                     device_seconds(self.device) - decoding)


def _check(cfg: Any) -> None:
    c = cfg.compress
    require(c.rank >= 1, f"compress.rank={c.rank}: must be >= 1 (the factors' rank)")
    require(c.start_step >= 0, f"compress.start_step={c.start_step}: must be >= 0")
    require(c.min_compression_rate > 0, f"compress.min_compression_rate={c.min_compression_rate}: must be > 0")


SPECS = (CodecSpec(name="powersgd", schema=PowerSgdConfig, impl=PowerSgd, check=_check,
                   label=lambda c: f"powersgd r={c['rank']}"),)
