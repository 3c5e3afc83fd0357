"""One rank's record of one training step: the fields of ``metrics/rank{r}.jsonl`` (docs/results.md).

The trainer and the simulator build it, a resumed run reads its predecessor's back with
``from_json``, and ``to_json`` is the line the step log writes. A simulated record leaves what only
a real execution knows as None: ``loss``, ``lr``, ``bytes_sent``, ``bytes_recv``, ``t_sync_enter``
and ``t_sync_exit`` (the simulator predicts time, not learning or the wire), and ``t_encode`` and
``t_decode`` without a codec, as a run does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(slots=True)
class StepRecord:
    # Declared in the order of the JSON line; seconds and bytes.
    step: int
    rank: int
    samples: int
    loss: float | None
    t_data: float
    t_injected: float
    t_forward: float
    t_backward: float
    t_sync: float
    t_wait: float | None  # None until the run ends (testbed.timing.fill_wait)
    t_comm: float | None
    t_encode: float | None
    t_decode: float | None
    t_optimizer: float
    t_step: float
    bytes_sent: int | None
    bytes_recv: int | None
    t_sync_enter: float | None
    t_sync_exit: float | None
    lr: float | None
    # Only some synchronizers report these: the line has them only when they are set.
    staleness: int | None = None
    # Parameter servers: the version (shard 0's) this step's gradient was computed on. With one
    # shard, version + staleness orders the run's pushes, which a virtual run replays.
    version: int | None = None
    residual_norm: float | None = None
    # Backup workers: 1 when this rank's gradient came too late and its update left it out (its
    # ``samples`` are then 0). A step the rank sat out, its update made before the rank could
    # begin, has ``samples`` 0, ``loss`` None and ``dropped`` 0.
    dropped: int | None = None
    # stats.noise_scale: the mean over ranks of the squared norm of each rank's own gradient, the
    # squared norm of the averaged gradient, and B_simple over the moving averages so far
    # (testbed.stats.noise_scale; null while the averaged |G|² is not positive).
    grad_sq_small: float | None = None
    grad_sq_big: float | None = None
    noise_scale: float | None = None

    def to_json(self) -> dict[str, Any]:
        """The step log's object: every field in order, an optional one only when set."""
        out = {name: getattr(self, name) for name in FIELDS}
        for name in OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> StepRecord:
        """A record from a step log's object; ValueError naming the fields that are missing or unknown."""
        missing = [name for name in FIELDS if name not in obj]
        unknown = sorted(set(obj) - set(ALL_FIELDS))
        if missing or unknown:
            raise ValueError(
                f"step record of step {obj.get('step')}: missing fields {missing}, unknown fields {unknown}; "
                "the log was written by another version of the testbed (docs/results.md lists the fields): "
                "rerun it with this one"
            )
        return cls(**obj)


ALL_FIELDS = tuple(f.name for f in fields(StepRecord))
OPTIONAL_FIELDS = ("staleness", "version", "residual_norm", "dropped", "grad_sq_small", "grad_sq_big", "noise_scale")
FIELDS = tuple(name for name in ALL_FIELDS if name not in OPTIONAL_FIELDS)  # in every line, in this order
