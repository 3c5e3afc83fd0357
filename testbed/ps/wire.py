"""What client and server share: dtypes, chunking, byte views, channel options, the token."""

from __future__ import annotations

import os
import warnings
from typing import Iterator

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

TO_WIRE = {torch.float32: pb.FLOAT32, torch.float64: pb.FLOAT64, torch.bfloat16: pb.BFLOAT16, torch.float16: pb.FLOAT16}
FROM_WIRE = {v: k for k, v in TO_WIRE.items()}


def token_from_env() -> str:
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise RuntimeError(f"{TOKEN_ENV} is not set: parameter-server clients and servers share a token through it")
    return token


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_HEADER, f"Bearer {token}"),)


def chunk_ranges(numel: int, element_size: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(offset, length) in elements, each chunk at most ``chunk_bytes``."""
    step = max(1, chunk_bytes // element_size)
    for offset in range(0, numel, step):
        yield offset, min(step, numel - offset)


def byte_view(flat: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous 1-D CPU tensor."""
    return memoryview(flat.view(torch.uint8).numpy())


def chunks(
    flat: torch.Tensor, shard: int, worker: int, step: int, chunk_bytes: int, view: memoryview | None = None
) -> Iterator[pb.TensorChunk]:
    """The stream of messages carrying ``flat``; ``bytes`` of each slice is the one copy protobuf needs."""
    view = byte_view(flat) if view is None else view
    esize = flat.element_size()
    dtype = TO_WIRE[flat.dtype]
    for offset, length in chunk_ranges(flat.numel(), esize, chunk_bytes):
        data = bytes(view[offset * esize : (offset + length) * esize])
        yield pb.TensorChunk(worker=worker, shard=shard, offset=offset, length=length, dtype=dtype, step=step, data=data)


def copy_in(dst: torch.Tensor, offset: int, data: bytes) -> None:
    """Write a chunk's bytes into ``dst`` (1-D) at element ``offset`` without an intermediate copy."""
    src = torch.frombuffer(data, dtype=torch.uint8)
    esize = dst.element_size()
    dst[offset : offset + len(data) // esize].view(torch.uint8).copy_(src)
