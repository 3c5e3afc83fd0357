"""Timing semantics, defined once: phase durations per step and the wait/transfer split of sync.

Phases of one step, in order: ``data`` (fetch the batch, move it to the device), ``injected``
(time added by the ``imbalance`` config, never real work), ``forward``, ``backward``, ``sync`` (the
synchronizer's call), ``optimizer`` (optimizer step and zeroing the gradients). ``t_step`` is
their sum. A rank's *compute* time is every phase but sync, injected time included: the time it
was busy, really or by emulation, before it could synchronize. On CPU the boundaries are ``time.perf_counter`` readings; on
CUDA they are CUDA events recorded on the current stream (never host timers around asynchronous
kernels), read once the step's last event has completed.

Each step also records, on rank 0's clock, when the rank *entered* sync (``t_sync_enter``) and when
sync *completed* (``t_sync_exit``). For a synchronizer that blocks until every rank has arrived
(all-reduce, synchronous PS), rank i's wait at a step is::

    t_wait_i = clamp(max_j(t_sync_enter_j) - t_sync_enter_i, 0, t_sync_i)

the time it sat in sync only because slower ranks had not arrived yet; ``t_sync - t_wait`` is the
transfer itself. No barrier is added to measure it: after the last step one all-reduce (max) of
the enter times gives every rank ``max_j`` per step (``fill_wait_from_latest``), so per-step lines are written with ``t_wait: null`` while the run is in
progress and completed when it ends. For synchronizers that do not wait for peers, ``t_wait`` is 0.
Communication that overlaps backward (``sync.overlap``) is split the same way into *busy* and
*exposed* time. ``t_comm`` (busy) is how long collectives were in flight during the step, hidden
behind backward or not; ``t_sync`` is the exposed part, the time the step waited after its own
compute was done for communication still in flight (and for slower ranks: ``t_wait`` is part of
it). Throughput depends on exposed time only; ``t_comm - t_sync`` is, roughly, what overlap hid.
Synchronizers that cannot see their collectives (DDP, whose all-reduce runs inside backward)
record ``t_comm: null``. On CUDA a collective's start and end are events on the streams that run
it (``stamp``), and codec time is read once the device is done (``device_seconds``): NCCL returns
from a call, a future or ``work.wait()`` as soon as the work is queued.

A synchronizer may measure the wait itself (a parameter server reports how long it held each pull
back for slower workers); then its value is recorded as is.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from testbed.step_record import StepRecord

PHASES = ("data", "injected", "forward", "backward", "sync", "optimizer")


@dataclass
class StepTimes:
    phases: dict[str, float]  # seconds per phase, keys from PHASES
    sync_enter: float  # absolute, rank 0's clock
    sync_exit: float

    @property
    def step(self) -> float:
        return sum(self.phases.values())


class StepClock:
    """Times the phases of one step: ``start()``, ``mark(phase)`` at the end of each phase, ``finish()``.

    A phase may repeat (gradient accumulation runs data/forward/backward/sync once per micro-step);
    its durations add up. ``sync_enter``/``sync_exit`` are those of the last sync phase, the one
    that communicates.
    """

    def __init__(self, device: torch.device, clock_offset_s: float = 0.0, micro_steps: int = 1) -> None:
        self.cuda = device.type == "cuda"
        self.offset = clock_offset_s
        self.max_marks = 4 * micro_steps + 2  # data, forward, backward, sync per micro-step; injected, optimizer
        if self.cuda:
            self._events = [torch.cuda.Event(enable_timing=True) for _ in range(self.max_marks + 1)]
        self._names: list[str] = []
        self._checked: tuple[str, ...] = ()
        self._marks: list[float] = []
        self._start_wall = 0.0

    def start(self) -> None:
        # On CUDA the stream is idle here (finish() waited for the previous step), so the first
        # event fires at this wall-clock time and event offsets convert to absolute times.
        self._start_wall = time.time() + self.offset
        self._names = []
        if self.cuda:
            self._events[0].record()
        else:
            self._marks = [time.perf_counter()]

    def mark(self, phase: str) -> None:
        if len(self._names) == self.max_marks:
            raise RuntimeError(f"StepClock: more than {self.max_marks} phase marks in one step")
        self._names.append(phase)
        if self.cuda:
            self._events[len(self._names)].record()
        else:
            self._marks.append(time.perf_counter())

    def finish(self) -> StepTimes:
        names = tuple(self._names)
        if names != self._checked:  # the same sequence every step: checked once
            if set(names) != set(PHASES):
                raise RuntimeError(f"StepClock: marked {list(names)}; every phase of {PHASES} is needed, no others")
            self._checked = names
        if self.cuda:
            events = self._events[: len(self._names) + 1]
            events[-1].synchronize()
            durations = [a.elapsed_time(b) / 1000.0 for a, b in zip(events, events[1:])]
        else:
            durations = [b - a for a, b in zip(self._marks, self._marks[1:])]
        phases = dict.fromkeys(PHASES, 0.0)
        for name, duration in zip(self._names, durations):
            phases[name] += duration
        last_sync = len(self._names) - 1 - self._names[::-1].index("sync")
        enter = self._start_wall + sum(durations[:last_sync])
        return StepTimes(phases, enter, enter + durations[last_sync])


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU): for host timers around whole runs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_seconds(device: torch.device) -> float:
    """``time.perf_counter()`` once the device's queued work is done: on CUDA a host timer alone
    reads when kernels were queued, not when they ran."""
    synchronize(device)
    return time.perf_counter()


# A point on a device's timeline: the host clock on CPU; on CUDA an event on the current stream,
# which fires when the work queued on it before has run (under NCCL, work.wait() and a collective's
# future return once it is queued).
Stamp = float | torch.cuda.Event


def stamp(device: torch.device) -> Stamp:
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def stamp_seconds(device: torch.device, stamps: list[Stamp]) -> list[float]:
    """``stamps`` on the ``time.perf_counter`` clock; on CUDA this waits for the device, then
    counts back from an event recorded on the idle device."""
    if device.type != "cuda":
        return [float(s) for s in stamps]
    torch.cuda.synchronize(device)
    anchor = torch.cuda.Event(enable_timing=True)
    anchor.record()
    anchor.synchronize()
    now = time.perf_counter()
    return [now - s.elapsed_time(anchor) / 1000.0 for s in stamps]  # type: ignore[union-attr]


def fill_wait(records_by_rank: list[list[StepRecord]], waits_for_peers: bool) -> None:
    """Set ``t_wait`` in every record, in place, from the enter times of all ranks (see module doc).

    Records that already carry a ``t_wait`` (measured by the synchronizer) keep it. Steps that not
    every rank completed (a failed run) keep ``t_wait: None``.
    """
    by_step: list[dict[int, StepRecord]] = [{r.step: r for r in recs} for recs in records_by_rank]
    common = sorted(set(by_step[0]).intersection(*by_step[1:])) if by_step else []
    latest = [max(ranks[step].t_sync_enter for ranks in by_step) for step in common]
    for ranks in by_step:
        fill_wait_from_latest([ranks[step] for step in common], latest, waits_for_peers)


def fill_wait_from_latest(records: list[StepRecord], latest: list[float], waits_for_peers: bool) -> None:
    """Set ``t_wait`` of one rank's records given, per record, the latest enter time over all ranks."""
    for rec, last in zip(records, latest):
        if rec.t_wait is None:  # a synchronizer's own measurement is kept
            rec.t_wait = min(max(last - rec.t_sync_enter, 0.0), rec.t_sync) if waits_for_peers else 0.0


def real_compute_time(record: StepRecord) -> float:
    """Time a rank spent on its own real work in a step: everything but synchronization and injection."""
    return record.t_data + record.t_forward + record.t_backward + record.t_optimizer


def compute_time(record: StepRecord) -> float:
    """Time a rank was busy before it could synchronize: real compute plus injected slowness."""
    return real_compute_time(record) + record.t_injected


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
