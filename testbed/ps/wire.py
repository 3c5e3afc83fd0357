"""What client and server share: dtypes, chunking, byte views, channels (plain or TLS), the token."""

from __future__ import annotations

import ctypes
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from testbed.ps import parameter_server_pb2 as pb

# Received chunks are read through a zero-copy view of the (immutable) protobuf bytes.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

TOKEN_ENV = "TESTBED_PS_TOKEN"
TOKEN_HEADER = "authorization"
# Chunks stay far below gRPC's 4 MiB default; the limits are still set explicitly on both ends.
MAX_MESSAGE_BYTES = 8 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

TO_WIRE = {torch.float32: pb.FLOAT32, torch.float64: pb.FLOAT64, torch.bfloat16: pb.BFLOAT16, torch.float16: pb.FLOAT16,
           torch.uint8: pb.UINT8}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}


def keep_freed_memory() -> None:
    """Let glibc reuse freed megabyte blocks instead of returning them to the OS.

    Every message is a fresh ~1 MiB ``bytes``; by default glibc serves such blocks with mmap and
    unmaps them on free, so each message pays page faults on every page: encoding measured
    ~1.5 GB/s, ten times slower than with the blocks kept (glibc's M_MMAP_THRESHOLD and
    M_TRIM_THRESHOLD, raised here for this process). A no-op where the C library is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: blocks below 64 MiB come from the heap
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: keep up to 256 MiB of freed heap
    except (OSError, AttributeError):
        pass


def token_from_env() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise RuntimeError(f"{TOKEN_ENV} is not set: parameter-server clients and servers share a token through it")
    return token


def open_channel(address: str, ca: str | None = None) -> grpc.Channel:
    """A channel to a shard: TLS when ``ca`` (the PEM of the certificate authority that signed the
    servers' certificates) is given, so tokens and tensors never cross a network in the clear."""
    if ca is None:
        return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(ca).read_bytes()), options=CHANNEL_OPTIONS)


def tls_of(sync_cfg: Any) -> tuple[str | None, str | None, str | None]:
    """(certificate, key, certificate authority) of a sync config; all None without TLS."""
    # A mapping (the launcher's plain config) or a synchronizer's typed one (testbed.schema).
    get = sync_cfg.get if isinstance(sync_cfg, Mapping) else lambda key: getattr(sync_cfg, key, None)
    return get("tls_cert") or None, get("tls_key") or None, get("tls_ca") or None


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_HEADER, f"Bearer {token}"),)


# The gradient noise scale (stats.noise_scale, testbed.stats.noise_scale) rides the calls that carry
# the gradients, as metadata: a push carries its worker's own squared gradient norm, and a sync
# pull's trailer what the shard measured of the update it streamed.
LOCAL_SQ_HEADER = "local-grad-sq"
# elastic.enabled: the membership epoch a push or pull belongs to (testbed.elastic); absent: 0.
EPOCH_HEADER = "membership-epoch"
STEP_NORMS_HEADER = "step-grad-sq"


@dataclass(frozen=True)
class StepNorms:
    """A sync shard's measure of one update: the mean over the workers it averaged of their own
    squared gradient norms (each the whole gradient's, uncompressed, as the push carried it), the
    squared norm of the averaged gradient's slice on this shard, and how many workers it averaged."""

    local_sq: float
    slice_sq: float
    workers: int

    def header(self) -> tuple[str, str]:
        return STEP_NORMS_HEADER, f"{self.local_sq!r} {self.slice_sq!r} {self.workers}"

    @classmethod
    def of(cls, metadata: Any) -> StepNorms | None:
        """From a pull's trailing metadata; None where the shard measured none."""
        value = dict(metadata or ()).get(STEP_NORMS_HEADER)
        if value is None:
            return None
        local_sq, slice_sq, workers = str(value).split()
        return cls(float(local_sq), float(slice_sq), int(workers))


def chunk_ranges(numel: int, element_size: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) in elements, each chunk at most ``chunk_bytes``."""
    step = max(1, chunk_bytes // element_size)
    for offset in range(0, numel, step):
        yield offset, min(step, numel - offset)


def byte_view(flat: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous 1-D CPU tensor."""
    return memoryview(flat.view(torch.uint8).numpy())


def chunks(flat: torch.Tensor, shard: int, worker: int, step: int, chunk_bytes: int) -> Iterator[pb.TensorChunk]:
    """``encoded_chunks`` as protobuf objects, for the generated stubs (tests, the raw benchmark)."""
    for message in encoded_chunks(flat, shard, worker, step, chunk_bytes, byte_view(flat)):
        yield pb.TensorChunk.FromString(message)


# --- the fast path: TensorChunk encoded and decoded by hand ------------------------------------
# protobuf's Python objects copy a payload up to three times (bytes(), the message, the wire
# string). Writing the same wire format by hand costs one copy (header + payload joined into the
# message gRPC sends) and reading it none (the payload stays a view of the received bytes).
# Standard protobuf clients and servers interoperate with it unchanged. ``python -m
# testbed.bench.wire`` measures it against the generated classes (docs/ps_wire.md); it stays only
# while it is the faster.

_DATA_KEY = (7 << 3) | 2  # field 7, length-delimited


@dataclass
class Chunk:
    """A decoded TensorChunk whose ``data`` is a view of the received message."""

    worker: int = 0
    shard: int = 0
    offset: int = 0
    length: int = 0
    dtype: int = 0
    step: int = 0
    data: memoryview = memoryview(b"")
    malformed: str = ""  # set instead of raising, so the server can refuse with INVALID_ARGUMENT


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def encode_chunk(worker: int, shard: int, offset: int, length: int, dtype: int, step: int, data: memoryview) -> bytes:
    header = bytearray()
    for field, value in ((1, worker), (2, shard), (3, offset), (4, length), (5, dtype), (6, step)):
        if value:  # proto3 leaves zeros out
            header += _varint(field << 3) + _varint(value)
    header += _varint(_DATA_KEY) + _varint(len(data))
    return b"".join((header, data))


_FIELDS = {1: "worker", 2: "shard", 3: "offset", 4: "length", 5: "dtype", 6: "step"}


def decode_chunk(message: bytes) -> Chunk:
    """Parse any valid encoding of TensorChunk (fields in any order, unknown fields skipped)."""
    chunk, view, pos, end = Chunk(), memoryview(message), 0, len(message)

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            if pos >= end or shift > 63:
                raise ValueError("truncated varint")
            byte = message[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    try:
        while pos < end:
            key = varint()
            field, wire = key >> 3, key & 7
            if wire == 0:
                value = varint()
                if field in _FIELDS:
                    setattr(chunk, _FIELDS[field], value)
            elif wire == 2:
                size = varint()
                if pos + size > end:
                    raise ValueError("length-delimited field past the end")
                if field == 7:
                    chunk.data = view[pos : pos + size]
                pos += size
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise ValueError(f"wire type {wire}")
        if pos != end:
            raise ValueError("truncated field")
    except ValueError as exc:
        chunk.malformed = f"malformed TensorChunk: {exc}"
    return chunk


def encoded_chunks(flat: torch.Tensor, shard: int, worker: int, step: int, chunk_bytes: int, view: memoryview) -> Iterator[bytes]:
    """``chunks`` on the fast path: ready-to-send messages, one copy each."""
    esize = flat.element_size()
    dtype = TO_WIRE[flat.dtype]
    for offset, length in chunk_ranges(flat.numel(), esize, chunk_bytes):
        yield encode_chunk(worker, shard, offset, length, dtype, step, view[offset * esize : (offset + length) * esize])


SERVICE = "testbed.ps.ParameterServer"


def passthrough(message: bytes) -> bytes:
    """Serializer for messages that are already encoded (encoded_chunks)."""
    return message


def copy_in(dst: torch.Tensor, offset: int, data: bytes | memoryview) -> None:
    """Write a chunk's bytes into ``dst`` (1-D) at element ``offset`` without an intermediate copy."""
    src = torch.frombuffer(data, dtype=torch.uint8)
    esize = dst.element_size()
    dst[offset : offset + len(data) // esize].view(torch.uint8).copy_(src)
