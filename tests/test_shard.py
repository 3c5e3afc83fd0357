"""The parameter-server Shard's state machine in-process, without gRPC: chunk iterators in, as the
servicer passes them, and exact arithmetic out (integer-valued floats, SGD with lr 0.5, no momentum)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch

from testbed.optim import SgdConfig
from testbed.ps import parameter_server_pb2 as pb
from testbed.ps.shard import Shard
from testbed.ps.shard_checkpoint import restore
from testbed.ps.validation import Refused
from testbed.ps.wire import Chunk, copy_in, decode_chunk

NUMEL, CHUNK = 8, 3  # elements per shard and per chunk: streams of 3 + 3 + 2
LR = 0.5
INITIAL = torch.arange(NUMEL, dtype=torch.float32)
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION

pytestmark = pytest.mark.unit


def chunks(values: torch.Tensor, worker: int, step: int) -> list[Chunk]:
    """``values`` as the decoded chunks of one stream to shard 0."""
    data = values.numpy().tobytes()
    return [Chunk(worker=worker, shard=0, offset=o, length=min(CHUNK, NUMEL - o), dtype=pb.FLOAT32, step=step,
                  data=memoryview(data[4 * o : 4 * min(o + CHUNK, NUMEL)])) for o in range(0, NUMEL, CHUNK)]


def make_shard(mode: str, workers: int = 2, staleness: int = 1) -> Shard:
    shard = Shard(0, workers, mode, staleness, SgdConfig(lr=LR, momentum=0.0), chunk_bytes=4 * CHUNK)
    info = shard.init_params(iter(chunks(INITIAL, worker=0, step=NUMEL)))
    assert (info.numel, info.dtype, info.version, info.workers, info.mode) == (NUMEL, pb.FLOAT32, 0, workers, mode)
    return shard


def push(shard: Shard, worker: int, grad: float, base: int) -> pb.PushReply:
    return shard.push(iter(chunks(torch.full((NUMEL,), grad), worker, base)))


class Context:
    """The three ServicerContext methods Shard.pull uses (no membership epoch in the call's metadata)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s, self.metadata = timeout_s, {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def time_remaining(self) -> float:
        return self.timeout_s

    def send_initial_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = dict(metadata)


def pull(shard: Shard, worker: int, clock: int, timeout_s: float = 10.0) -> tuple[torch.Tensor, int, int]:
    """(parameters, version, slowest clock) of one pull."""
    context, params, versions = Context(timeout_s), torch.full((NUMEL,), float("nan")), set()
    for message in shard.pull(pb.PullRequest(worker=worker, shard=0, clock=clock), context):
        chunk = decode_chunk(message)
        copy_in(params, chunk.offset, chunk.data)
        versions.add(chunk.step)
    assert len(versions) == 1 and float(context.metadata["blocked-seconds"]) >= 0
    return params, versions.pop(), int(context.metadata["slowest-clock"])


def refusal(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Refused) as info:
        call()
    return info.value.code, str(info.value)


def in_thread(fn: Callable[[], object]) -> Callable[[], object]:
    """Start ``fn`` in a thread; the returned function joins it and gives its result."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()

    def join() -> object:
        thread.join(timeout=10)
        assert not thread.is_alive() and result, "the thread did not finish"
        return result[0]

    return join


def test_init_and_register() -> None:
    shard = Shard(0, 2, "sync", 0, SgdConfig(lr=LR, momentum=0.0), chunk_bytes=4 * CHUNK)
    assert shard.register(1).numel == 0  # registering needs no parameters
    assert refusal(lambda: push(shard, 0, 1.0, 0)) == (PRECONDITION, "shard 0 has no parameters yet (InitParams)")
    assert refusal(lambda: shard.init_params(iter([]))) == (INVALID, "InitParams: empty stream")
    shard.init_params(iter(chunks(INITIAL, worker=0, step=NUMEL)))
    assert shard.register(1).numel == NUMEL
    assert refusal(lambda: shard.register(2)) == (INVALID, "worker 2 out of range [0, 2)")
    again = chunks(INITIAL + 1, worker=0, step=NUMEL)
    assert refusal(lambda: shard.init_params(iter(again))) == (PRECONDITION, "shard 0 is already initialised")
    assert torch.equal(pull(shard, 1, clock=0)[0], INITIAL)
    assert shard.stats_reply().bytes_in == 4 * NUMEL


GOOD_INIT = chunks(INITIAL, worker=0, step=NUMEL)
BAD_INITS = {
    "size changes": ([GOOD_INIT[0], replace(GOOD_INIT[1], step=NUMEL + 1), GOOD_INIT[2]],
                     "InitParams: every chunk must carry the same size"),
    "truncated": (GOOD_INIT[:1], f"InitParams: got {CHUNK} of {NUMEL} elements"),
    "from worker 1": ([replace(c, worker=1) for c in GOOD_INIT], "chunk refused: worker 1 out of range [0, 1)"),
    "no size": ([replace(c, step=0) for c in GOOD_INIT], "InitParams: need a dtype and the shard size in step"),
}


@pytest.mark.parametrize("case", sorted(BAD_INITS))
def test_bad_init_is_refused_and_leaves_the_shard_empty(case: str) -> None:
    stream, message = BAD_INITS[case]
    shard = Shard(0, 1, "sync", 0, SgdConfig(lr=LR, momentum=0.0), chunk_bytes=4 * CHUNK)
    assert refusal(lambda: shard.init_params(iter(stream))) == (INVALID, message)
    assert shard.params is None and shard.stats_reply().bytes_in == 0
    shard.init_params(iter(GOOD_INIT))  # the shard can still be initialised
    assert torch.equal(pull(shard, 0, clock=0)[0], INITIAL)


def test_a_stalled_init_stream_holds_up_no_other_call() -> None:
    shard = Shard(0, 1, "sync", 0, SgdConfig(lr=LR, momentum=0.0), chunk_bytes=4 * CHUNK)
    release = threading.Event()

    def stalled() -> Iterator[Chunk]:  # one chunk, then nothing until the stream is given up
        yield GOOD_INIT[0]
        release.wait(timeout=10)
        raise grpc.RpcError("stream cancelled")

    holder = in_thread(lambda: _raises(shard, stalled()))
    deadline = time.monotonic() + 5
    while not shard.initialising and time.monotonic() < deadline:
        time.sleep(0.01)
    # Meanwhile every other call is answered at once.
    assert shard.register(0).numel == 0 and shard.stats_reply().version == 0
    assert refusal(lambda: shard.init_params(iter(GOOD_INIT))) == (PRECONDITION, "shard 0 is being initialised")
    release.set()
    assert holder() == "RpcError"
    shard.init_params(iter(GOOD_INIT))  # the stalled attempt left nothing behind
    assert torch.equal(pull(shard, 0, clock=0)[0], INITIAL)


def _raises(shard: Shard, stream: Iterator[Chunk]) -> str:
    try:
        shard.init_params(stream)
    except Exception as exc:
        return type(exc).__name__
    return "returned"


GOOD_PUSH = chunks(torch.full((NUMEL,), 4.0), worker=1, step=0)
BAD_PUSHES = {
    "gap": ([GOOD_PUSH[0], GOOD_PUSH[2]], f"chunk refused: offset {2 * CHUNK}, expected {CHUNK} (chunks in order, no gaps)"),
    "worker changes": ([GOOD_PUSH[0], replace(GOOD_PUSH[1], worker=0), GOOD_PUSH[2]],
                       "Push: worker and step must not change mid-stream"),
    "step changes": ([GOOD_PUSH[0], GOOD_PUSH[1], replace(GOOD_PUSH[2], step=1)],
                     "Push: worker and step must not change mid-stream"),
    "truncated": (GOOD_PUSH[:2], f"Push: got {2 * CHUNK} of {NUMEL} elements"),
    "short data": ([GOOD_PUSH[0], replace(GOOD_PUSH[1], data=GOOD_PUSH[1].data[:8]), GOOD_PUSH[2]],
                   f"chunk refused: 8 data bytes for {CHUNK} elements of torch.float32"),
    "future version": ([replace(c, step=3) for c in GOOD_PUSH], "push based on version 3 > 0"),
}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_bad_push_is_refused_and_changes_nothing(mode: str, case: str) -> None:
    stream, message = BAD_PUSHES[case]
    if mode == "sync" and case == "future version":
        message = "sync push for version 3, but the shard is at version 0"
    shard = make_shard(mode)
    assert refusal(lambda: shard.push(iter(stream))) == (INVALID, message)
    stats = shard.stats_reply()
    assert (stats.version, list(stats.clocks), stats.pushes, shard.pushing, shard.pending) == (0, [0, 0], 0, set(), set())
    assert torch.equal(shard.params.detach(), INITIAL)
    assert push(shard, 1, 4.0, 0).version == (0 if mode == "sync" else 1)  # the worker may push again


def test_sync_applies_the_mean_once_every_worker_pushed() -> None:
    shard = make_shard("sync")
    assert push(shard, 0, 2.0, 0) == pb.PushReply(version=0, staleness=0)  # staged, not applied
    assert torch.equal(shard.params.detach(), INITIAL)
    # A second push in the step is refused, and its data does not replace the staged one.
    assert refusal(lambda: push(shard, 0, 100.0, 0)) == (PRECONDITION, "worker 0 already pushed step 0")
    code, message = refusal(lambda: pull(shard, 0, clock=1, timeout_s=0.05))  # the step is not complete
    assert (code, message) == (grpc.StatusCode.DEADLINE_EXCEEDED, "Pull: worker 0 at clock 1 still blocked; clocks [1, 0]")
    waiting = in_thread(lambda: pull(shard, 0, clock=1))
    assert push(shard, 1, 6.0, 0) == pb.PushReply(version=1, staleness=0)  # applies the step
    expected = INITIAL - LR * (2.0 + 6.0) / 2
    params, version, slowest = waiting()
    assert torch.equal(params, expected) and (version, slowest) == (1, 1)
    assert torch.equal(shard.params.detach(), expected)
    # The next step: pushes on version 1 only.
    assert refusal(lambda: push(shard, 1, 1.0, 0)) == (INVALID, "sync push for version 0, but the shard is at version 1")
    push(shard, 1, 1.0, 1)
    assert push(shard, 0, 3.0, 1).version == 2
    assert torch.equal(pull(shard, 1, clock=2)[0], expected - LR * (1.0 + 3.0) / 2)
    stats = shard.stats_reply()
    assert (stats.version, list(stats.clocks), list(stats.staleness_histogram)) == (2, [2, 2], [4])
    assert (stats.pushes, stats.pulls, stats.rejected) == (4, 2, 0)
    assert (stats.bytes_in, stats.bytes_out) == (4 * NUMEL * (1 + 4), 4 * NUMEL * 2)
    assert stats.apply_seconds > 0
    assert refusal(lambda: shard.clock(pb.ClockRequest(worker=0, advance=True)))[0] == PRECONDITION


def test_a_summation_only_shard_streams_each_partition_once_every_worker_pushed_it() -> None:
    shard = Shard(0, 2, "sync", 0, SgdConfig(lr=LR), chunk_bytes=4 * CHUNK, sums_only=True)
    shard.init_params(iter(chunks(torch.zeros(NUMEL), worker=0, step=NUMEL)))
    held = threading.Event()

    def paused(stream: list[Chunk]) -> Iterator[Chunk]:  # worker 0 pushes its first partition, then waits
        yield stream[0]
        held.wait(timeout=10)
        yield from stream[1:]

    pushing = in_thread(lambda: shard.push(paused(chunks(torch.full((NUMEL,), 2.0), 0, 0))))
    # Worker 1's pull is open before its own push: allowed, and it streams as partitions are summed.
    stream = shard.pull(pb.PullRequest(worker=1, shard=0, clock=1), Context(10.0))
    assert push(shard, 1, 6.0, 0) == pb.PushReply(version=0, staleness=0)
    first = decode_chunk(next(stream))  # partition 0 is summed while worker 0 still pushes the rest
    assert (first.offset, first.length, first.step) == (0, CHUNK, 1) and shard.version == 0
    assert torch.equal(torch.frombuffer(bytes(first.data), dtype=torch.float32), torch.full((CHUNK,), 4.0))
    held.set()
    assert pushing().version == 1
    rest = [decode_chunk(m) for m in stream]
    assert [c.offset for c in rest] == [3, 6] and all(bytes(c.data) == torch.full((c.length,), 4.0).numpy().tobytes() for c in rest)
    assert torch.equal(pull(shard, 0, clock=1)[0], torch.full((NUMEL,), 4.0))  # the mean: no optimizer step
    assert (shard.version, shard.clocks) == (1, [1, 1])
    # A push refused mid-stream has had partitions summed: the step fails for everyone, with why.
    good = chunks(torch.ones(NUMEL), 0, 1)
    bad = [good[0], replace(good[1], offset=4)]
    assert refusal(lambda: shard.push(iter(bad)))[0] == INVALID
    code, message = refusal(lambda: pull(shard, 1, clock=2))
    assert code == grpc.StatusCode.INTERNAL and "a push of worker 0 was refused mid-stream" in message


def test_async_applies_each_push_on_arrival_scaled_by_one_over_workers() -> None:
    shard = make_shard("async")
    assert push(shard, 0, 4.0, 0) == pb.PushReply(version=1, staleness=0)
    assert torch.equal(shard.params.detach(), INITIAL - LR * 4.0 / 2)
    assert push(shard, 0, 2.0, 1) == pb.PushReply(version=2, staleness=0)
    # Worker 1's gradient was computed on version 0; two updates landed since.
    assert push(shard, 1, 8.0, 0) == pb.PushReply(version=3, staleness=2)
    expected = INITIAL - LR * (4.0 + 2.0 + 8.0) / 2
    params, version, slowest = pull(shard, 0, clock=2, timeout_s=0.0)  # async never waits, even 2 ahead
    assert torch.equal(params, expected) and (version, slowest) == (3, 1)
    assert refusal(lambda: pull(shard, 1, clock=2)) == (INVALID, "Pull: worker 1 at clock 2 has pushed only 1 times")
    stats = shard.stats_reply()
    assert (stats.version, list(stats.clocks), list(stats.staleness_histogram)) == (3, [2, 1], [2, 0, 1])
    assert (stats.pushes, stats.pulls, stats.bytes_in, stats.bytes_out) == (3, 1, 4 * NUMEL * 4, 4 * NUMEL)


def test_ssp_blocks_a_pull_while_its_worker_leads_by_more_than_the_staleness() -> None:
    shard = make_shard("ssp", staleness=1)
    push(shard, 0, 4.0, 0)
    assert pull(shard, 0, clock=1, timeout_s=0.0)[1:] == (1, 0)  # one ahead of the slowest: allowed
    push(shard, 0, 4.0, 1)
    code, message = refusal(lambda: pull(shard, 0, clock=2, timeout_s=0.05))  # two ahead: blocked
    assert (code, message) == (grpc.StatusCode.DEADLINE_EXCEEDED, "Pull: worker 0 at clock 2 still blocked; clocks [2, 0]")
    waiting = in_thread(lambda: pull(shard, 0, clock=2))
    assert push(shard, 1, 8.0, 0) == pb.PushReply(version=3, staleness=2)  # the straggler catches up: released
    params, version, slowest = waiting()
    assert torch.equal(params, INITIAL - LR * (4.0 + 4.0 + 8.0) / 2) and (version, slowest) == (3, 1)
    # A skipped step advances a clock without a push, and releases pulls just the same.
    push(shard, 0, 0.0, 3)
    waiting = in_thread(lambda: pull(shard, 0, clock=3))
    assert list(shard.clock(pb.ClockRequest(worker=1, advance=True)).clocks) == [3, 2]
    assert waiting()[1:] == (4, 2)
    stats = shard.stats_reply()
    assert (stats.version, list(stats.clocks), list(stats.staleness_histogram), stats.pulls) == (4, [3, 2], [3, 0, 1], 3)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_checkpoint_the_state_at_the_step_every_worker_pushed_and_restore_it_exactly(
    tmp_path: Path, mode: str
) -> None:
    shard = Shard(0, 2, mode, 1, SgdConfig(lr=LR, momentum=0.9), chunk_bytes=4 * CHUNK)  # momentum: optimizer state
    shard.init_params(iter(chunks(INITIAL, worker=0, step=NUMEL)))
    shard.checkpoint_dir, shard.checkpoint_every = tmp_path, 2
    saved = tmp_path / "step0000001" / "ps0.pt"
    push(shard, 0, 4.0, 0)
    push(shard, 0, 2.0, 1)  # worker 0 at clock 2, worker 1 at 0: no point both agree on
    push(shard, 1, 8.0, 0)
    assert not saved.exists()
    push(shard, 1, 1.0, 1)  # both have pushed step 1 (clock 2): the workers' checkpoint after step 1
    assert saved.exists()
    at_snapshot = (shard.params.detach().clone(), copy.deepcopy([o.state_dict() for o in shard.optimizers]), shard.version,
                   list(shard.clocks), dict(shard.histogram), dict(shard.stats))
    push(shard, 0, 16.0, 2)  # later pushes leave the snapshot as it was
    restored = Shard(0, 2, mode, 1, SgdConfig(lr=LR, momentum=0.9), chunk_bytes=4 * CHUNK)
    restore(restored, saved)
    params, optimizers, version, clocks, histogram, stats = at_snapshot
    assert torch.equal(restored.params.detach(), params) and not torch.equal(params, shard.params.detach())
    for ours, theirs in zip((o.state_dict() for o in restored.optimizers), optimizers, strict=True):
        assert ours["state"] and all(torch.equal(a["momentum_buffer"], b["momentum_buffer"]) for a, b in zip(ours["state"].values(), theirs["state"].values()))
    assert (restored.version, restored.clocks, dict(restored.histogram), dict(restored.stats)) == (version, clocks, histogram, stats)
    assert (version, clocks, histogram) == (4, [2, 2], {0: 2, 2: 2})
    # The restored shard goes on as the original did: the same push moves both alike.
    assert push(restored, 0, 16.0, 2) == pb.PushReply(version=5, staleness=2)
    assert torch.equal(restored.params.detach(), shard.params.detach())
    with pytest.raises(SystemExit, match="mode sync"):
        restore(Shard(0, 2, "sync", 1, SgdConfig(lr=LR), chunk_bytes=4 * CHUNK), saved)


def test_a_push_while_the_same_worker_is_pushing_is_refused() -> None:
    shard = make_shard("async")
    streaming, resume = threading.Event(), threading.Event()

    def paused(stream: list[Chunk]) -> Iterator[Chunk]:
        yield stream[0]
        streaming.set()  # the shard has taken the first chunk: the push is in progress
        assert resume.wait(timeout=10)
        yield from stream[1:]

    first = in_thread(lambda: shard.push(paused(chunks(torch.full((NUMEL,), 2.0), 0, 0))))
    assert streaming.wait(timeout=10)
    assert refusal(lambda: push(shard, 0, 100.0, 0)) == (PRECONDITION, "worker 0 already has a push in progress")
    assert push(shard, 1, 4.0, 0).version == 1  # other workers push meanwhile
    resume.set()
    assert first() == pb.PushReply(version=2, staleness=1)
    assert shard.pushing == set()
    assert torch.equal(shard.params.detach(), INITIAL - LR * (2.0 + 4.0) / 2)


def test_sync_update_runs_block_by_block_and_a_failed_one_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("testbed.ps.shard.UPDATE_BYTES", 4 * CHUNK)  # a block per chunk: three of them
    shard = make_shard("sync")
    assert [list(block) for block in shard.blocks] == [[0], [1], [2]]
    push(shard, 0, 2.0, 0)
    push(shard, 1, 6.0, 0)
    params, version, _ = pull(shard, 0, clock=1)
    assert torch.equal(params, INITIAL - LR * (2.0 + 6.0) / 2) and version == 1

    def broken() -> None:
        raise RuntimeError("no memory")

    monkeypatch.setattr(shard.optimizers[1], "step", broken)
    push(shard, 0, 2.0, 1)
    push(shard, 1, 2.0, 1)  # completes the step: its update fails in the second block
    internal = (grpc.StatusCode.INTERNAL, "shard 0: the update failed: RuntimeError: no memory")
    assert refusal(lambda: pull(shard, 1, clock=2)) == internal
    assert refusal(lambda: push(shard, 0, 2.0, 2)) == internal


def make_backup_shard(workers: int, backup: int) -> Shard:
    shard = Shard(0, workers, "sync", 0, SgdConfig(lr=LR, momentum=0.0), chunk_bytes=4 * CHUNK, backup_workers=backup)
    assert shard.init_params(iter(chunks(INITIAL, worker=0, step=NUMEL))).backup_workers == backup
    return shard


def test_backup_workers_update_with_the_mean_of_exactly_the_first_pushes() -> None:
    shard = make_backup_shard(workers=4, backup=2)
    push(shard, 3, 2.0, 0)
    # A push in progress holds the step's second place: a third worker is refused meanwhile.
    opened, release = threading.Event(), threading.Event()

    def slow_stream() -> Iterator[Chunk]:
        first, *rest = chunks(torch.full((NUMEL,), 6.0), 1, 0)
        yield first
        opened.set()
        release.wait(10)
        yield from rest

    pushing = in_thread(lambda: shard.push(slow_stream()))
    assert opened.wait(10)
    code, message = refusal(lambda: push(shard, 0, 1e6, 0))  # a marked gradient
    assert code == PRECONDITION and "step 0 has its 2 pushes already" in message
    release.set()
    assert pushing().version == 1
    expected = INITIAL - LR * (6.0 + 2.0) / 2  # over the two chosen, not the four workers
    assert torch.equal(pull(shard, 3, clock=1)[0], expected)
    # The late workers did not push, pull the same version, and may push the next step.
    assert torch.equal(pull(shard, 0, clock=1)[0], expected)
    assert refusal(lambda: push(shard, 0, 1e6, 0))[0] == INVALID  # a late push of step 0 never lands
    assert refusal(lambda: pull(shard, 2, clock=3))[0] == INVALID  # beyond the next version
    push(shard, 0, 4.0, 1)
    push(shard, 2, 8.0, 1)
    assert torch.equal(pull(shard, 1, clock=2)[0], expected - LR * (4.0 + 8.0) / 2)
    assert list(shard.stats_reply().clocks) == [1, 1, 1, 1]


def test_backup_workers_never_tear_a_pull_of_the_version_before_an_update() -> None:
    shard = make_backup_shard(workers=3, backup=1)
    push(shard, 0, 2.0, 0)
    push(shard, 1, 4.0, 0)
    first = INITIAL - LR * 3.0
    # The late worker 2 streams version 1 slowly; meanwhile the others complete step 1.
    context = Context(10.0)
    stream = shard.pull(pb.PullRequest(worker=2, shard=0, clock=1), context)
    received = torch.full((NUMEL,), float("nan"))

    def take(message: bytes) -> int:
        chunk = decode_chunk(message)
        copy_in(received, chunk.offset, chunk.data)
        return chunk.step

    assert take(next(stream)) == 1
    push(shard, 0, 10.0, 1)
    assert push(shard, 1, 10.0, 1).version == 2
    time.sleep(0.1)
    assert shard.applied == 0  # the update waits for the open pull of version 1
    assert {take(m) for m in stream} == {1} and torch.equal(received, first)
    assert torch.equal(pull(shard, 0, clock=2)[0], first - LR * 10.0)
