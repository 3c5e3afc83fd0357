from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
BFLOAT16: DType
FLOAT16: DType
UINT8: DType

class TensorChunk(_message.Message):
    __slots__ = ("worker", "shard", "offset", "length", "dtype", "step", "data")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    worker: int
    shard: int
    offset: int
    length: int
    dtype: DType
    step: int
    data: bytes
    def __init__(self, worker: _Optional[int] = ..., shard: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., step: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: int
    def __init__(self, worker: _Optional[int] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("shard", "workers", "numel", "dtype", "mode", "staleness", "version", "backup_workers")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    shard: int
    workers: int
    numel: int
    dtype: DType
    mode: str
    staleness: int
    version: int
    backup_workers: int
    def __init__(self, shard: _Optional[int] = ..., workers: _Optional[int] = ..., numel: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., mode: _Optional[str] = ..., staleness: _Optional[int] = ..., version: _Optional[int] = ..., backup_workers: _Optional[int] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("version", "staleness")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    version: int
    staleness: int
    def __init__(self, version: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker", "shard", "clock", "full")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    worker: int
    shard: int
    clock: int
    full: bool
    def __init__(self, worker: _Optional[int] = ..., shard: _Optional[int] = ..., clock: _Optional[int] = ..., full: _Optional[bool] = ...) -> None: ...

class ClockRequest(_message.Message):
    __slots__ = ("worker", "advance")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ADVANCE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    advance: bool
    def __init__(self, worker: _Optional[int] = ..., advance: _Optional[bool] = ...) -> None: ...

class ClockReply(_message.Message):
    __slots__ = ("clocks", "version")
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    clocks: _containers.RepeatedScalarFieldContainer[int]
    version: int
    def __init__(self, clocks: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("version", "clocks", "staleness_histogram", "bytes_in", "bytes_out", "pushes", "pulls", "rejected", "apply_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    clocks: _containers.RepeatedScalarFieldContainer[int]
    staleness_histogram: _containers.RepeatedScalarFieldContainer[int]
    bytes_in: int
    bytes_out: int
    pushes: int
    pulls: int
    rejected: int
    apply_seconds: float
    def __init__(self, version: _Optional[int] = ..., clocks: _Optional[_Iterable[int]] = ..., staleness_histogram: _Optional[_Iterable[int]] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., pushes: _Optional[int] = ..., pulls: _Optional[int] = ..., rejected: _Optional[int] = ..., apply_seconds: _Optional[float] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker", "epoch")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker: int
    epoch: int
    def __init__(self, worker: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("worker", "epoch")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker: int
    epoch: int
    def __init__(self, worker: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
