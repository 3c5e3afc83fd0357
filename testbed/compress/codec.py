"""The codec interface: what a gradient compressor is to the synchronizers that carry it.

A codec compresses one bucket (a contiguous slice of the flat gradient buffer, or a parameter
server shard) into one flat *payload* tensor, the bytes that go on the wire, and decodes payloads
back into a bucket. Its payload has the same size on every rank and at every step (a function of
the bucket's size only), so payloads all-reduce or allgather without padding or a size exchange.

- A *linear* codec's payloads can be summed as they are (``decode(sum of payloads)`` is the sum
  of the decoded ones): fp16/bf16 casts, random-k with indices every rank draws alike. The
  all-reduce family all-reduces its payload.
- A non-linear one (top-k, QSGD, scaled sign) cannot: its payloads are allgathered and each is
  decoded and added, so traffic grows with n, as GRACE's allgather communicator does.
- A codec may instead run its own collective protocol (``reduce_``): PowerSGD's two all-reduces.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) keeps per bucket the part of the
input that was not sent, and adds it to the next step's input: ``x = g + e``, send ``C(x)``,
``e' = x - D(C(x))``. Codecs are per rank and per bucket, and see buckets in the same order at
the same steps on every rank, so any randomness they share (random-k's indices, PowerSGD's first
Q) is drawn from a generator seeded alike everywhere, and step counts agree without messages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from testbed.schema import typed
from testbed.timing import device_seconds


@dataclass
class CompressConfig:
    name: str = "none"
    # Keep what a step did not send and add it to the next step's input (a residual per bucket).
    error_feedback: bool = False
    # Parameter servers: encode the pull too (bidirectional compression). The all-reduce family's
    # results always travel as payloads, both ways: there it changes nothing, so one sweep can set
    # it for every synchronizer.
    pull: bool = False


class Collectives(Protocol):
    """What a synchronizer offers a codec: its own all-reduce and an allgather, each returning
    the (bytes sent, bytes received) of this rank."""

    world_size: int

    def allreduce_payload_(self, payload: torch.Tensor) -> tuple[int, int]: ...

    def allgather_payload(self, payload: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """[world_size * payload.numel()]: every rank's payload, in rank order."""
        ...


class Alone:
    """The collectives of a world of one: a sum or gather of one payload is that payload."""

    world_size = 1

    def allreduce_payload_(self, payload: torch.Tensor) -> tuple[int, int]:
        return 0, 0

    def allgather_payload(self, payload: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        return payload, 0, 0


@dataclass
class Moved:
    """One bucket's compressed synchronization: wire bytes and codec time (seconds)."""

    sent: int = 0
    recv: int = 0
    t_encode: float = 0.0
    t_decode: float = 0.0


@dataclass(frozen=True)
class CodecSpec:
    """What a codec declares (one module of testbed.compress per codec family): its Hydra option
    (``compress=<name>``), schema, implementation (None: no compression), checks and label."""

    name: str
    schema: type
    impl: type[Codec] | None
    check: Callable[[Any], None] = lambda cfg: None  # semantic checks of cfg.compress
    label: Callable[[Mapping[str, Any]], str] = lambda cfg: str(cfg.get("name"))


class Codec(ABC):
    """One bucket's codec on one rank: ``numel`` elements of ``dtype`` on ``device``, made of the
    parameter tensors of ``shapes`` (in the bucket's order), at bucket index ``index``."""

    linear: ClassVar[bool]
    # The synchronizer divides the bucket by n before reduce_ (the mean taken before the sum, as
    # DDP and torch's fp16 hook take it); False: the codec takes the sum and divides itself.
    divides_first: ClassVar[bool] = True

    def __init__(self, cfg: Any, numel: int, dtype: torch.dtype, device: torch.device, shapes: list[torch.Size],
                 index: int, rank: int, seed: int) -> None:
        from testbed.compress import codec_spec  # the registry imports this module

        self.cfg = typed(codec_spec(cfg.name).schema, cfg)  # its schema's dataclass
        self.numel, self.dtype, self.device = numel, dtype, device
        self.shapes, self.index, self.rank, self.seed = shapes, index, rank, seed
        self.error_feedback = bool(self.cfg.error_feedback)
        self.residual = torch.zeros(numel, dtype=dtype, device=device) if self.error_feedback else None
        self.steps = 0  # reductions so far: the same on every rank

    @abstractmethod
    def payload_bytes(self) -> int:
        """Bytes this rank puts in its messages for one bucket at the current step."""

    @abstractmethod
    def reduce_(self, bucket: torch.Tensor, comm: Collectives) -> Moved:
        """Replace ``bucket`` by its reduction over the ranks, through ``comm``."""

    def rounds(self) -> list[int]:
        """Bytes of each collective one compressed step runs for this bucket (the simulator's)."""
        return [self.payload_bytes()]

    def uncompressed_steps(self) -> int:
        """Steps at the start that send the bucket as it is (PowerSGD's ``start_step``)."""
        return 0

    def residual_norm(self) -> float | None:
        return float(self.residual.norm()) if self.residual is not None else None


class PayloadCodec(Codec):
    """A codec that encodes a bucket into one payload tensor and decodes payloads back; such a
    codec also serves a parameter server (push the payload, the shard decodes it)."""

    @abstractmethod
    def payload_numel(self) -> int:
        """Elements of the payload tensor (of ``payload_dtype``)."""

    @property
    def payload_dtype(self) -> torch.dtype:
        return self.dtype

    def payload_bytes(self) -> int:
        return self.payload_numel() * torch.empty(0, dtype=self.payload_dtype).element_size()

    @abstractmethod
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of ``x`` (1-D, ``numel`` elements); the codec may keep context for decode."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, out: torch.Tensor, add: bool = False) -> None:
        """Write (or, with ``add``, add) the decoded ``payload`` into ``out``."""

    def expect(self, step: int) -> None:
        """The next payload to decode was encoded at ``step`` by a codec like this one elsewhere
        (a parameter server decoding a worker's push): set whatever decode draws from the step."""

    def compress(self, x: torch.Tensor) -> torch.Tensor:
        """The payload of ``x`` with error feedback applied: ``x`` holds the input plus the old
        residual afterwards, and the residual is what the payload does not carry."""
        if self.residual is not None:
            x.add_(self.residual)
        payload = self.encode(x)
        self.steps += 1
        if self.residual is not None:
            self.decode(payload, self.residual)
            torch.sub(x, self.residual, out=self.residual)
        return payload

    def reduce_(self, bucket: torch.Tensor, comm: Collectives) -> Moved:
        """Replace ``bucket`` (this rank's share of the mean) by the sum over ranks of the decoded
        payloads: all-reduced for a linear codec, allgathered for a non-linear one."""
        device = bucket.device  # its clock waits for the device's kernels to run (testbed.timing)
        start = device_seconds(device)
        payload = self.compress(bucket)
        encoded = device_seconds(device)
        if self.linear:
            sent, recv = comm.allreduce_payload_(payload)
            decoding = device_seconds(device)
            self.decode(payload, bucket)
        else:
            gathered, sent, recv = comm.allgather_payload(payload)
            decoding = device_seconds(device)
            bucket.zero_()
            for part in gathered.view(comm.world_size, -1):
                self.decode(part, bucket, add=True)
        return Moved(sent, recv, encoded - start, device_seconds(device) - decoding)


class BytePayload(PayloadCodec):
    """A payload packed as bytes into ``self.buffer`` (uint8), which the codec allocates."""

    buffer: torch.Tensor

    def payload_numel(self) -> int:
        return self.buffer.numel()

    @property
    def payload_dtype(self) -> torch.dtype:
        return torch.uint8


def codec_facts(cfg: Any, codecs: list[Codec], raw_bytes: int) -> dict[str, Any]:
    """summary.json's ``sync_facts.compress``: the codec, its payload per step and the ratio."""
    payload = sum(c.payload_bytes() for c in codecs)
    return {"codec": cfg.name, "linear": codecs[0].linear, "payload_bytes": payload, "ratio": raw_bytes / payload}


def residual_norm(codecs: list[Codec]) -> float | None:
    """The norm of all the codecs' residuals together (None without error feedback)."""
    norms = [c.residual_norm() for c in codecs]
    return None if any(n is None for n in norms) else float(sum(n**2 for n in norms) ** 0.5)  # type: ignore[operator]


def generator(device: torch.device, *key: int) -> torch.Generator:
    """A generator seeded from ``key`` (e.g. seed, bucket, step): the same draws wherever the key is."""
    value = 0
    for part in key:
        value = (value * 1_000_003 + int(part)) % (2**63 - 1)
    gen = torch.Generator(device=device)
    gen.manual_seed(value)
    return gen
