"""What a rank's memory holds: the model state counted from its tensors, and the peaks measured.

Model state is ZeRO's (Rajbhandari et al. 2020): parameters, gradients and optimizer state. Each
kind is counted as the bytes of the distinct storages its tensors live in, so the views of a flat
buffer count once, at the buffer's size, and a sharded parameter whose full buffer is freed
between uses counts nothing for it. The count is taken once per run, after the first optimizer
step and before the gradients are cleared: the optimizer state exists, the gradients still do.

``zero_formula`` is the paper's table for the optimizer in use, with this run's element size
instead of mixed precision's 2 + 2 bytes; for a rank's shard sizes it gives the count exactly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("params", "grads", "optimizer")


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages ``tensors`` view (a DTensor counts its local shard)."""
    seen: dict[tuple[str, int], int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.nbytes():
            seen[(str(local.device), storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of ``optimizer``'s state (momentum, Adam's moments, its step counters)."""
    return [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]


def model_state_bytes(held: dict[str, list[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes of each kind of model state (Synchronizer.held), and their total."""
    counts = {kind: storage_bytes(held[kind]) for kind in KINDS}
    counts["total"] = sum(counts.values())
    return counts


def state_per_element(optimizer: Any) -> int:
    """K: the optimizer state's elements per parameter element (the optim config or an optimizer)."""
    name = optimizer.name if hasattr(optimizer, "name") else type(optimizer).__name__.lower()
    if name == "adamw":
        return 2  # exp_avg, exp_avg_sq
    if name == "sgd":
        momentum = optimizer.momentum if hasattr(optimizer, "momentum") else optimizer.defaults["momentum"]
        return 1 if momentum else 0  # the momentum buffer
    raise ValueError(f"optim={name}: its state per element is not known")


def step_counter_bytes(optimizer: Any) -> int:
    """Bytes of the step counter an optimizer keeps per tensor it steps (AdamW's float32 scalar)."""
    name = optimizer.name if hasattr(optimizer, "name") else type(optimizer).__name__.lower()
    return 4 if name == "adamw" else 0


@dataclass(frozen=True)
class Sharding:
    """How a synchronizer lays the model state out on this rank (Synchronizer.sharding)."""

    stage: int | None  # ZeRO's stage; None: every rank holds all of it (DDP)
    psi: int  # the model's parameter elements
    shard: int  # this rank's share of them (psi / n, to the element), or psi
    esize: int  # bytes per element
    tensors: int  # the tensors this rank's optimizer steps (each has a step counter in AdamW)


def zero_formula(layout: Sharding, k: int, counter_bytes: int = 0) -> dict[str, int]:
    """ZeRO's model-state bytes per rank for ``layout``, with ``k`` optimizer elements per
    parameter element and ``counter_bytes`` of step counter per stepped tensor."""
    full, part = layout.psi * layout.esize, layout.shard * layout.esize
    params = part if layout.stage == 3 else full
    grads = part if layout.stage in (2, 3) else full
    optimizer = k * (full if layout.stage is None else part) + counter_bytes * layout.tensors
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def model_state_formula(optim: Any, sync: Any) -> dict[str, int] | None:
    """The formula's bytes for this rank under the run's optimizer config; None where the
    synchronizer's state is not laid out as ZeRO's table has it (the servers hold the optimizer)."""
    layout = sync.sharding()
    return None if layout is None else zero_formula(layout, state_per_element(optim), step_counter_bytes(optim))


def peak_memory(device: torch.device) -> dict[str, Any]:
    """The process's measured memory: its peak resident set so far, the C allocator's bytes in use
    now (glibc's mallinfo2, where there is one; freed blocks it keeps for reuse are not in use but
    stay resident), and on CUDA the caching allocator's peaks."""
    facts: dict[str, Any] = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    heap = _malloc_in_use()
    if heap is not None:
        facts["malloc_in_use_bytes"] = heap
    if device.type == "cuda":
        facts["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        facts["cuda_reserved_peak_bytes"] = torch.cuda.max_memory_reserved(device)
    return facts


def rss_now_peak() -> int:
    """The peak resident set so far (the baseline a run's training adds to)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _malloc_in_use() -> int | None:
    """Bytes glibc's malloc has handed out and not had back: small blocks and mmapped ones."""
    path = ctypes.util.find_library("c")
    libc = ctypes.CDLL(path) if path else None
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)
