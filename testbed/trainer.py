"""The one training loop every synchronizer shares.

data -> forward -> backward -> synchronizer -> optimizer, each phase timed (testbed.timing), one
JSON line per step (testbed.results.step_log). The loop never asks which synchronizer it runs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from testbed.balance import Balancer
from testbed.buffers import BufferSync
from testbed.data import BatchSource
from testbed.elastic.membership import Membership
from testbed.elastic.regroup import Regrouper
from testbed.eval.evaluate import Evaluator
from testbed.eval.schedule import LrSchedule
from testbed.faults import FaultInjector, NonFiniteLoss
from testbed.imbalance import Injector
from testbed.imbalance import loss_weight as rank_loss_weight
from testbed.memory import model_state_bytes
from testbed.models.call import ModelCall
from testbed.results.step_log import StepLog
from testbed.stall import Arrivals
from testbed.stats.noise_scale import GradientNoise
from testbed.step_record import StepRecord
from testbed.sync import Synchronizer
from testbed.sync.base import SyncReport
from testbed.timing import StepClock, real_compute_time
from testbed.world import World

log = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        sync: Synchronizer,
        batches: BatchSource,
        world: World,
        step_log: StepLog,
        steps: int,
        bf16: bool = False,
        log_every: int = 0,
        call: ModelCall | None = None,
        injector: Injector | None = None,
        loss_weight: float = 1.0,
        on_record: Callable[[StepRecord], None] | None = None,
        fault: FaultInjector | None = None,
        arrivals: Arrivals | None = None,
        start_step: int = 0,
        after_step: Callable[[int], None] | None = None,
        buffers: BufferSync | None = None,
        schedule: LrSchedule | None = None,
        evaluator: Evaluator | None = None,
        noise: GradientNoise | None = None,
        balancer: Balancer | None = None,
        clock_origin: float | None = None,
        membership: Membership | None = None,
        regrouper: Regrouper | None = None,
    ) -> None:
        # The model is the synchronizer's (sync.module): a wrapper such as DDP may stand in front of it.
        self.optimizer, self.sync, self.batches = optimizer, sync, batches
        self.world, self.step_log, self.steps = world, step_log, steps
        self.call = call or ModelCall()  # how the model is called, and where its loss is (testbed.models.call)
        self.autocast: Any = (
            torch.autocast(device_type=world.device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
        )
        self.log_every = log_every or max(1, steps // 10)
        self.injector = injector
        self.loss_weight = loss_weight  # != 1 only for uneven shards (testbed.imbalance)
        self.on_record = on_record  # e.g. the W&B mirror, called with each step's record
        self.fault = fault  # an injected failure (testbed.faults)
        self.arrivals = arrivals  # names the ranks a failed synchronization waited for (testbed.stall)
        self.start_step = start_step  # > 0 when resuming from a checkpoint (testbed.checkpoint)
        self.after_step = after_step  # e.g. the periodic checkpoint, called with each completed step
        self.buffers = buffers  # BatchNorm's statistics, made equal when the replicas agree (testbed.buffers)
        self.schedule = schedule  # the learning rate of every step (testbed.eval.schedule); None: optim.lr
        self.evaluator = evaluator  # held-out evaluation every eval.every steps, and the target (testbed.eval)
        self.noise = noise  # the gradient noise scale's estimate (testbed.stats.noise_scale)
        self.balancer = balancer  # re-decides the ranks' batches from their speeds (testbed.balance)
        # elastic.enabled: the run's membership (testbed.elastic), and what rebuilds the rank's parts for a new one
        self.membership, self.regrouper = membership, regrouper
        # This rank's name in the records (its rank at the start), whatever its rank in later memberships.
        self.worker = membership.worker if membership is not None else world.rank
        self.began = time.perf_counter()  # the run's clock (MLPerf's: it never stops, evaluation included)
        self.clock_origin = clock_origin  # when the run's clock started, in an earlier attempt (time.time())
        self.model_state: dict[str, int] | None = None  # bytes this rank holds, by kind (testbed.memory)

    def run(self) -> list[StepRecord]:
        world, sync = self.world, self.sync
        k = sync.accumulate
        clock = StepClock(world.device, world.clock_offset_s, micro_steps=k)
        records: list[StepRecord] = []
        last_compute: float | None = None
        # Each micro-batch's mean counts 1/k: the window's gradient is that of its whole batch.
        scale = self.loss_weight / k
        earlier = time.time() - self.clock_origin if self.clock_origin is not None else 0.0
        self.began = began = time.perf_counter() - earlier
        sync.module.train()
        step = self.start_step
        while step < self.steps:
            if self.membership is not None and self.membership.due(step):  # lost or joined between steps
                step = self._regroup(step, None, records)
                world, scale = self.world, self.loss_weight / k
                continue
            try:
                if self.fault is not None:
                    self.fault.before_step(step)
                lr = self._set_lr(step)
                clock.start()
                noise: tuple[float, float, float | None] | None = None
                if sync.takes_part(step):
                    losses, samples, report, noise = self._compute(step, clock, scale, last_compute)
                else:  # the step's update is made without this rank (backup workers): it catches up
                    for phase in ("data", "injected", "forward", "backward"):
                        clock.mark(phase)
                    report = self._synchronize(step, boundary=True, sits_out=True)
                    clock.mark("sync")
                    losses, samples = [], 0
                if not sync.steps_optimizer:
                    self.optimizer.step()
                if self.model_state is None:  # once: the optimizer state exists, the gradients still do
                    self.model_state = model_state_bytes(sync.held())
                sync.zero_grad()
                clock.mark("optimizer")
                times = clock.finish()
                phases = times.phases
                record = StepRecord(
                    step=step,
                    rank=self.worker,
                    samples=0 if report.dropped else samples,  # the samples the update took
                    loss=(losses[0] if len(losses) == 1 else torch.stack(losses).mean()).item() if losses else None,
                    t_data=phases["data"],
                    t_injected=phases["injected"],
                    t_forward=phases["forward"],
                    t_backward=phases["backward"],
                    t_sync=phases["sync"],
                    # None: completed after the run from all ranks' arrival times (testbed.timing)
                    t_wait=report.t_wait,
                    t_comm=report.t_comm,
                    t_encode=report.t_encode,
                    t_decode=report.t_decode,
                    t_optimizer=phases["optimizer"],
                    t_step=times.step,
                    bytes_sent=report.bytes_sent,
                    bytes_recv=report.bytes_recv,
                    t_sync_enter=times.sync_enter,
                    t_sync_exit=times.sync_exit,
                    lr=lr,
                    staleness=report.staleness,
                    version=report.version,
                    residual_norm=report.residual_norm,
                    dropped=None if report.dropped is None else int(report.dropped),
                    grad_sq_small=None if noise is None else noise[0],
                    grad_sq_big=None if noise is None else noise[1],
                    noise_scale=None if noise is None else noise[2],
                )
                if losses:
                    last_compute = real_compute_time(record)
                if self.balancer is not None and (sizes := self.balancer.after_step(step, record)) is not None:
                    self.loss_weight = rank_loss_weight(sizes, world.rank)
                    scale = self.loss_weight / k
                    if self.noise is not None:
                        self.noise.resize([b * k for b in sizes], self.loss_weight)
                self.step_log.write(record)
                records.append(record)
                if record.loss is not None and not math.isfinite(record.loss):  # recorded, then stop: NaN spreads
                    raise NonFiniteLoss(f"rank {world.rank}: loss is {record.loss} at step {step}")
                if self.on_record is not None:
                    self.on_record(record)
                if self.after_step is not None:
                    self.after_step(step)
                if world.is_main and ((step + 1) % self.log_every == 0 or step + 1 == self.steps):
                    self._progress(step, record, time.perf_counter() - began)
                if self.evaluator is not None and self.evaluator.due(step):
                    row = self.evaluator.evaluate(sync, step, time.perf_counter() - began)
                    if world.is_main:
                        log.info("eval after step %d: %s", step + 1, _metrics_line(row))
                    if self.evaluator.stop_now():
                        if world.is_main:
                            log.info("target %s reached after step %d: every rank stops", self.evaluator.target.describe(),
                                     step + 1)
                        break
            except Exception as exc:  # a lost worker: the survivors regroup and go on (testbed.elastic)
                if self.membership is None or not self.membership.recoverable(exc):
                    raise
                step = self._regroup(step, exc, records)
                world, scale = self.world, self.loss_weight / k
                continue
            if self.membership is not None:
                self.membership.after_step(step)
            step += 1
        return records

    def _regroup(self, step: int, exc: BaseException | None, records: list[StepRecord]) -> int:
        """A worker was lost (``step`` failed on it, or it was announced before ``step``), or newcomers
        join before ``step``: go on in the next membership; the records of the steps it does again
        are dropped."""
        assert self.membership is not None and self.regrouper is not None
        regrouper = self.regrouper

        def rebuild(world: World, epoch: int) -> int | None:
            self.world = world
            resume = regrouper.rebuild(world, epoch)
            self.sync.zero_grad()
            return resume

        resume = self.membership.regroup(step, exc, rebuild)
        self.loss_weight, self.schedule = regrouper.resumed(resume)
        records[:] = [r for r in records if r.step < resume]
        return resume

    def _compute(
        self, step: int, clock: StepClock, scale: float, last_compute: float | None
    ) -> tuple[list[torch.Tensor], int, SyncReport, tuple[float, float, float | None] | None]:
        """Data, forward, backward and synchronization of each micro-step of ``step``: the losses,
        the samples, the boundary's synchronization report and the noise scale's estimate."""
        sync, device, k = self.sync, self.world.device, self.sync.accumulate
        non_blocking = device.type == "cuda"
        losses, samples, noise = [], 0, None
        for micro in range(k):
            boundary = micro == k - 1
            inputs, targets = self.batches.batch(step * k + micro)
            inputs = inputs.to(device, non_blocking=non_blocking)
            targets = targets.to(device, non_blocking=non_blocking)
            clock.mark("data")
            if micro == 0:  # a slow rank is slow before its compute, so its gradients come late
                if self.injector is not None:
                    self.injector.wait(last_compute)
                clock.mark("injected")
            with sync.micro_step(boundary):
                with self.autocast:
                    loss = self.call(sync.module, inputs, targets).loss
                    if self.fault is not None:
                        loss = self.fault.loss(step, loss)
                clock.mark("forward")
                (loss * scale if scale != 1.0 else loss).backward()
                clock.mark("backward")
            if boundary and self.noise is not None:  # the local gradient, before it is averaged away
                self.noise.before_sync()
            report = self._synchronize(step, boundary)
            if boundary and self.noise is not None:
                noise = self.noise.after_sync(device)
            if boundary and report.replicas_agree and self.buffers is not None:
                moved = self.buffers.sync()
                report.bytes_sent, report.bytes_recv = report.bytes_sent + moved, report.bytes_recv + moved
            clock.mark("sync")
            losses.append(loss.detach())
            samples += int(inputs.shape[0])
        return losses, samples, report, noise

    def _set_lr(self, step: int) -> float:
        """This step's learning rate on the optimizer, before anything steps it (a synchronizer that
        steps its own, local SGD, reads it there; parameter servers follow the same schedule)."""
        if self.schedule is None:
            return float(self.optimizer.param_groups[0]["lr"])
        lr = self.schedule.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _synchronize(self, step: int, boundary: bool, sits_out: bool = False) -> SyncReport:
        def synchronize() -> SyncReport:
            return self.sync.sit_out(step) if sits_out else self.sync.after_backward(step, is_boundary=boundary)

        if self.arrivals is None or not boundary:
            return synchronize()
        self.arrivals.arrive(step)
        began = time.monotonic()
        try:
            return synchronize()
        except Exception as exc:
            stall = self.arrivals.stall(step, time.monotonic() - began, exc)
            if stall is not None:
                raise stall from exc
            raise

    def _progress(self, step: int, record: StepRecord, elapsed: float) -> None:
        done = step + 1
        eta = record.t_step * (self.steps - done)
        bar = "#" * (20 * done // self.steps)
        log.info(
            "[%-20s] step %d/%d  loss %s  step %.1f ms  sync %.1f ms  elapsed %.1fs  eta %.1fs",
            bar, done, self.steps, "-" if record.loss is None else f"{record.loss:.4f}", 1e3 * record.t_step, 1e3 * record.t_sync, elapsed, eta,
        )


def _metrics_line(row: dict[str, Any]) -> str:
    keys = ("loss", "accuracy", "top5", "perplexity")
    return "  ".join(f"{k} {row[k]:.4f}" for k in keys if k in row) + f"  ({row['model']}, {1e3 * row['t_eval']:.0f} ms)"
