"""compress.pull on a shard: the encoded update since what a worker holds, and the server's copy of
what it holds, kept in step with the worker's (which adds each decoded pull to its parameters)."""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import OmegaConf

from testbed.compress import build_codec
from testbed.compress.codec import PayloadCodec


class HeldCopies:
    """The copies ``workers`` hold of one shard's parameters ``values``: one per worker, or with
    ``shared`` (every worker pulls the same parameters at a version) one for all, whose encoded
    update is then made once per version."""

    def __init__(self, compress: Any, values: torch.Tensor, shard: int, workers: int, seed: int, shared: bool) -> None:
        slots = 1 if shared else workers
        # The held copy moves only by what a pull carried, so parameters - held already keeps what
        # is not sent yet: a residual on top would send it twice (and diverge).
        plain = OmegaConf.merge(compress, {"error_feedback": False})
        self.codecs: list[PayloadCodec] = [build_codec(plain, values, [values.shape], shard, -1 - w, seed)  # type: ignore[misc]
                                           for w in range(slots)]
        self.held = torch.zeros(slots, values.numel(), dtype=values.dtype)
        self.holding = [False] * workers  # has had its full pull
        self.shared = shared
        self.cache: tuple[int, torch.Tensor] | None = None  # shared: (version, its encoded update)

    def holds(self, worker: int) -> bool:
        return self.holding[worker]

    def hold_full(self, worker: int, params: torch.Tensor) -> None:
        """``worker`` is sent the whole ``params``: what it holds from now on."""
        self.held[self._slot(worker)].copy_(params)
        self.holding[worker] = True

    def encoded(self, worker: int, version: int, params: torch.Tensor) -> torch.Tensor:
        """The update from what ``worker`` holds to ``params`` (at ``version``), encoded, with the
        held copy moved by what the payload carries (error feedback keeps the rest for the next pull)."""
        if self.shared and self.cache is not None and self.cache[0] == version:
            return self.cache[1]
        slot = self._slot(worker)
        codec, held = self.codecs[slot], self.held[slot]
        codec.steps = version  # the step its draws are taken at; the worker's decoder takes it from the chunks
        payload = codec.compress(params - held).clone()  # its buffer is reused by the next encode
        decoded = torch.empty_like(held)
        codec.decode(payload, decoded)
        held.add_(decoded)
        if self.shared:
            self.cache = (version, payload)
        return payload

    def _slot(self, worker: int) -> int:
        return 0 if self.shared else worker
