"""The gRPC parameter server as a synchronizer: push gradients to k shards, pull parameters back.

The optimizer runs on the servers (testbed.ps.server), so the trainer's optimizer does not step.
Parameters and gradients live in two flat buffers that the model's tensors view: pulls write the
parameters in place and pushes read the gradients in place, with no per-step allocation. On CUDA
gRPC still carries host memory: each shard's gradients are copied into a pinned host buffer before
it is pushed, and the pulled parameters are copied up to the device after each pull (staging; its
time is part of ``t_sync``, or of ``t_backward`` for the shards ``sync.overlap`` pushes during it).

With ``sync.overlap`` each shard is pushed from backward's hooks as soon as every parameter it
holds has its gradient, while backward goes on; shards stay whole pushes, so the servers validate
and apply them exactly as without overlap.

With ``sync.backup_workers=b`` (sync mode; Chen et al. 2016) each step's update takes the first
n - b gradients. A worker whose gradient is ready takes a ticket from an atomic counter in the
job's store, one per step: the same decision for every shard, so the update is the mean of n - b
whole mini-batches, and a late worker sends nothing (its link stays free). It pulls the newest
parameters instead and goes on from the step they are at: the steps the others completed without
it, it sits out (testbed.trainer). First is first to finish backward: a worker slow only on the
wire is not a straggler here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from testbed.checks import require
from testbed.collectives.common import chunk_bounds
from testbed.compress import build_codec
from testbed.compress.codec import PayloadCodec, codec_facts, residual_norm
from testbed.costs import Cost, parameter_server
from testbed.ps.modes import CHUNK_KB, MAX_CHUNK_KB, MODES, STALENESS
from testbed.sync.base import GradReadiness, Synchronizer, SyncReport, flat_views, holding
from testbed.sync.spec import Servers, SimModel, SyncBase, SyncSpec
from testbed.world import World, env_rank_layout

if TYPE_CHECKING:
    from testbed.ps.wire import StepNorms


@dataclass
class PsSyncConfig(SyncBase):
    name: str = "ps"
    mode: str = "sync"  # sync (BSP) | async (ASP) | ssp (bounded staleness)
    staleness: int = STALENESS  # ssp: how many clocks a worker may lead the slowest one
    servers: int = 1  # shards; parameters are split into this many byte-balanced ranges
    chunk_kb: int = CHUNK_KB  # streamed chunk size
    host: str = "127.0.0.1"  # address local servers bind to
    # Servers started elsewhere (python -m testbed.ps.server); empty: the launcher starts them here.
    addresses: list[str] = field(default_factory=list)
    # Push each shard during backward as soon as all its gradients are ready. A shard is pushed
    # whole, so the granularity is the shard: with one server nothing is ready before backward ends.
    overlap: bool = False
    # sync mode: each step's update takes the first world_size - backup_workers gradients; the
    # late workers' are dropped (Chen et al. 2016, "Revisiting Distributed Synchronous SGD").
    backup_workers: int = 0
    # TLS between workers and servers (PEM files): the servers' certificate and key, and the
    # authority that signed it, which workers verify the servers' addresses against.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None


class ParameterServerSync(Synchronizer):
    steps_optimizer = True
    waits_for_peers = False  # the shards report how long they held each pull back (t_wait)
    replicas_hold_state = False  # the servers hold the model: a new membership goes on where they are

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer, world: World) -> None:
        from testbed.elastic.membership import joining
        from testbed.ps.client import PsClient  # gRPC loads on the ranks that use it
        from testbed.ps.wire import tls_of, token_from_env

        super().setup(model, optimizer, world)
        self.flat_params, self.flat_grads = flat_views(model, world.device)
        self.host_params, self.host_grads = host_buffers(self.flat_params, self.flat_grads)
        numel, servers = self.flat_params.numel(), int(self.cfg.servers)
        if numel < servers:
            raise ValueError(f"sync.servers={servers} exceeds the model's {numel} parameters")
        bounds = chunk_bounds(numel, servers)  # byte-balanced: one dtype, equal element counts
        self.bounds, self.finalized = bounds, False
        self.param_shards = [self.host_params[lo:hi] for lo, hi in bounds]
        self.grad_shards = [self.host_grads[lo:hi] for lo, hi in bounds]
        self.bytes_per_step = numel * self.flat_params.element_size()
        codecs = [build_codec(self.compress, g, [g.shape], i, world.rank, self.seed) for i, g in enumerate(self.grad_shards)]
        self.codecs: list[PayloadCodec] | None = codecs if any(c is not None for c in codecs) else None  # type: ignore[assignment]
        self._encoded: dict[int, float] = {}  # encode seconds per shard, this step
        # stats.noise_scale (testbed.stats.noise_scale): this worker's own squared gradient norm for
        # its next push, and what the shards measured of the update it last pulled.
        self._local_sq: float | None = None
        self._norms: list[StepNorms | None] = []

        # A newcomer (elastic.rejoin_step) joins a running job: the servers admitted it under its worker's
        # name, which its rank in the admitting membership need not be, at the members' step.
        newcomer = joining() is not None
        worker, world_size = env_rank_layout()[0::2] if newcomer else (world.rank, world.world_size)
        self.client = PsClient(list(self.cfg.addresses), token_from_env(), worker, world.timeout_s,
                               self.cfg.chunk_kb * 1024, tls_of(self.cfg)[2])
        infos = self.client.register(wait_s=world.timeout_s)
        self.backup = int(self.cfg.backup_workers)
        self.needed = world.world_size - self.backup  # gradients a step's update takes
        for i, info in enumerate(infos):
            if info.workers != world_size or info.mode != self.cfg.mode or info.backup_workers != self.backup:
                raise ValueError(
                    f"ps shard {i} at {self.cfg.addresses[i]} expects {info.workers} workers in mode {info.mode} with "
                    f"{info.backup_workers} backup workers; this run has world_size={world_size}, "
                    f"sync.mode={self.cfg.mode}, sync.backup_workers={self.backup}"
                )
        self.overlap = bool(self.cfg.overlap) and servers > 1
        if self.overlap:
            self._watch_shards(model, bounds)
        # compress.pull: decoders of the shards' encoded updates (a worker's first and last pulls are whole)
        self.decoders = None
        if self.codecs is not None and self.compress.get("pull"):
            self.decoders = [build_codec(self.compress, p, [p.shape], i, world.rank, self.seed) for i, p in enumerate(self.param_shards)]
        if newcomer:  # the members are past the start: regroup, in the admitting membership, pulls where they are
            return
        if world.rank == 0 and infos[0].version == 0:  # a shard restored from a checkpoint holds its own
            self.client.init_params(self.param_shards)
        dist.barrier()  # every shard holds the initial parameters before anyone pulls
        # Steps this worker has pushed: 0, or a restored shard's count at the step the run resumes from.
        self.clock = int(self.client.clock(0).clocks[world.rank])
        self.versions = self.client.pull(self.param_shards, self.clock, full=True).versions
        self._params_up()

    def regroup(self, world: World, epoch: int) -> int | None:
        """Go on in membership ``epoch`` (elastic.enabled) from where the servers are: the workers
        have dropped the lost worker from them (membership_changed), and a step short of its
        pushes was dropped with it (testbed.ps.policies), so this worker's clock (its pushes the
        servers count) is the step to go on from (a newcomer's: the step the servers admitted it
        at). A lost worker whose push reached some shards' completed step and not others' leaves
        the shards at different steps, which no step can go on from."""
        from testbed.elastic.membership import MembershipLost

        self.world, self.needed = world, world.world_size - self.backup
        self.client.enter_epoch(epoch)
        clocks = [int(self.client.clock(i).clocks[self.client.worker]) for i in range(len(self.param_shards))]
        if len(set(clocks)) != 1:
            raise MembershipLost(f"worker {self.client.worker}: the shards count {clocks} pushes of it after the loss: "
                                 "the lost worker's last step reached some shards' update and not others'")
        self.clock = clocks[0]
        self.versions = self.client.pull(self.param_shards, self.clock, full=True).versions
        self._params_up()
        return self.clock

    def membership_changed(self, change: dict[str, Any]) -> None:
        """Every shard drops the workers membership ``change["epoch"]`` lost and admits those it
        joined. Each worker says so before it goes on in the membership, and the first to say it
        changes the shards (a repeat is a no-op): a survivor's pull waiting for a lost worker's push
        is refused then, and wakes."""
        for worker in change["lost"]:
            self.client.leave(worker, change["epoch"])
        for worker in change["joined"]:
            self.client.join(worker, change["epoch"])

    def _params_up(self) -> None:
        """The pulled parameters onto the device (staging; nothing to do on CPU)."""
        if self.host_params is not self.flat_params:
            self.flat_params.copy_(self.host_params)

    # --- overlap: push each shard from backward's hooks -------------------------------------

    def _watch_shards(self, model: nn.Module, bounds: list[tuple[int, int]]) -> None:
        params = [p for p in model.parameters() if p.requires_grad]  # flat_views' order
        shards_of, offset = {}, 0
        for p in params:
            lo, hi = offset, offset + p.numel()
            offset = hi
            shards_of[id(p)] = [i for i, (a, b) in enumerate(bounds) if a < hi and lo < b]
        cuda = self.world.device.type == "cuda"  # the push threads stage from this rank's GPU
        self._pushes = ThreadPoolExecutor(max_workers=len(bounds), thread_name_prefix="ps-push",
                                          initializer=torch.cuda.set_device if cuda else None,
                                          initargs=(self.world.device,) if cuda else ())
        self._launched: dict[int, Future] = {}
        self._readiness = GradReadiness(params, lambda p: shards_of[id(p)], len(bounds), self._launch)

    def micro_step(self, is_boundary: bool) -> AbstractContextManager[None]:
        if not (self.overlap and is_boundary):
            return nullcontext()
        self._launched = {}
        return self._readiness.armed()

    def _launch(self, i: int) -> None:
        self._launched[i] = self._pushes.submit(self._push_shard, i)

    def _payload(self, i: int) -> torch.Tensor:
        """Shard i's gradient as it travels: encoded (error feedback applied) with a codec."""
        if self.host_grads is not self.flat_grads:  # staging: a blocking copy, after backward's kernels
            lo, hi = self.bounds[i]
            self.grad_shards[i].copy_(self.flat_grads[lo:hi])
        if self.codecs is None:
            return self.grad_shards[i]
        start = time.perf_counter()
        payload = self.codecs[i].compress(self.grad_shards[i])
        self._encoded[i] = time.perf_counter() - start
        return payload

    def _push_shard(self, i: int) -> Any:
        return self.client.push_shard(i, self._payload(i), self.versions[i], self._local_sq)

    # --- the gradient noise scale, measured by the shards (testbed.stats.noise_scale.ServerNorms) ----

    def carry_local_sq(self, local_sq: float) -> None:
        self._local_sq = local_sq

    def step_norms(self) -> tuple[float, float, int] | None:
        """Every shard averaged the same workers (one decision per step) and reports the same mean of
        their own norms; the average's squared norm is the sum of its slices'."""
        if not self._norms or any(n is None for n in self._norms):
            return None
        norms = [n for n in self._norms if n is not None]
        return norms[0].local_sq, sum(n.slice_sq for n in norms), norms[0].workers

    # --- the step --------------------------------------------------------------------------------

    def takes_part(self, step: int) -> bool:
        """With backup workers: not where this worker's parameters are past ``step`` already, nor
        where the step has its n - b gradients before this one has begun."""
        if not self.backup:
            return True
        if self.versions[0] > step:
            return False
        return self._tickets(step, 0) < self.needed

    def sit_out(self, step: int) -> SyncReport:
        if self.versions[0] > step:  # the update of this step is in the parameters this worker holds
            return SyncReport(replicas_agree=False, t_wait=0.0, dropped=False)
        return self._catch_up(dropped=False)

    def _tickets(self, step: int, take: int) -> int:
        """Tickets of ``step`` taken so far, after taking ``take`` (0 or 1): one atomic add on the store."""
        assert self.world.store is not None
        return int(self.world.store.add(f"ps/backup/{step}", take))

    def _catch_up(self, dropped: bool) -> SyncReport:
        """Pull the newest parameters: of the step after those this worker holds, or later. Shards
        complete a step at slightly different moments; where they answer with different versions,
        the lagging ones are pulled again at the newest, so that the model is one that existed."""
        clock, pulls, blocked = self.versions[0] + 1, 0, 0.0
        made = clock  # the version this worker's step made: the update whose norms it may report
        while True:
            pulled = self.client.pull(self.param_shards, clock)
            pulls, blocked = pulls + 1, blocked + pulled.blocked_s
            clock = max(pulled.versions)
            if min(pulled.versions) == clock:
                break
        self.versions, self._norms = pulled.versions, pulled.norms if clock == made else []
        self._params_up()
        return SyncReport(bytes_recv=pulls * self.bytes_per_step, t_wait=blocked, replicas_agree=False, dropped=dropped)

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        if not is_boundary:  # accumulate locally; push once per window
            return SyncReport()
        if self.backup:
            if self.versions[0] != step:
                raise RuntimeError(f"rank {self.world.rank}: computed step {step} on parameters of version {self.versions[0]}")
            if self._tickets(step, 1) > self.needed:  # late: the step's update goes on without this gradient
                return self._catch_up(dropped=True)
            return self._push_pull(backup=True)
        return self._push_pull(backup=False)

    def _push_pull(self, backup: bool) -> SyncReport:
        base = self.versions[0]  # the version this worker's gradient was computed on (its push's base)
        if self.overlap:
            for i in range(len(self.grad_shards)):  # shards whose parameters backward did not reach
                if i not in self._launched:
                    self._launch(i)
            replies = [self._launched[i].result() for i in range(len(self.grad_shards))]
        else:
            replies = self.client.push([self._payload(i) for i in range(len(self.grad_shards))], self.versions,
                                       self._local_sq)
        self.clock += 1
        if backup:  # the step after the pushed one, or later: where the others are
            report = self._catch_up(dropped=False)
        else:
            pulled = self.client.pull(self.param_shards, self.clock, decoders=self.decoders)
            self.versions, self._norms = pulled.versions, pulled.norms
            self._params_up()
            report = SyncReport(
                bytes_recv=self.bytes_per_step,
                t_wait=pulled.blocked_s,
                replicas_agree=self.cfg.mode == "sync",  # async and ssp replicas pull different versions
            )
        report.bytes_sent = self.bytes_per_step  # payload bytes; gRPC and protobuf framing add ~0.01 %
        report.staleness = max(r.staleness for r in replies)
        report.version = base
        if self.codecs is not None:  # the shards decode; their time is the server's
            report.bytes_sent = sum(c.payload_bytes() for c in self.codecs)
            if self.decoders is not None:
                report.bytes_recv = sum(c.payload_bytes() for c in self.decoders)
            report.t_encode = sum(self._encoded.values())
            report.residual_norm = residual_norm(self.codecs)
        return report

    def finalize(self) -> None:
        # In async and ssp modes workers stop at different versions; once every worker has pushed
        # its last gradient, all pull the servers' final parameters, so model_final.pt is that model.
        dist.barrier()
        self.versions = self.client.pull(self.param_shards, self.clock, full=True).versions
        self._params_up()
        self.finalized = True

    @contextmanager
    def evaluated(self) -> Iterator[tuple[nn.Module, dict[str, Any]]]:
        """In async and ssp modes, and with backup workers, a worker's copy may be stale: the run's model is the servers' current
        parameters once every worker has pushed this step. Rank 0 pulls them (whole) and every rank
        evaluates that one model; each worker's own copy is back afterwards."""
        if (self.cfg.mode == "sync" and not self.backup) or self.finalized:
            yield self.model, {"model": "replicas"}  # every replica holds the servers' parameters
            return
        dist.barrier()  # every worker's push of this step is in: the model after it, whatever the order
        behind = torch.zeros(1, dtype=torch.int64, device=self.world.device)
        current = torch.empty_like(self.flat_params)  # broadcast from the device: NCCL carries no host tensors
        if self.world.rank == 0:
            staged = self.host_params is not self.flat_params
            pulled = torch.empty_like(self.host_params) if staged else current
            versions = self.client.pull([pulled[lo:hi] for lo, hi in self.bounds], self.clock, full=True).versions
            behind[0] = sum(versions) - sum(self.versions)
            if staged:
                current.copy_(pulled)
        dist.broadcast(current, src=0)
        dist.broadcast(behind, src=0)
        with holding(self.flat_params, current):
            # rank0_behind: updates (summed over shards) rank 0's own copy lacks, which it would have evaluated
            yield self.model, {"model": "servers", "rank0_behind": int(behind)}

    def zero_grad(self) -> None:
        self.flat_grads.zero_()

    def sharding(self) -> None:
        """The servers hold the optimizer state and step it: ZeRO's table has no row for a worker."""
        return None

    def describe(self) -> dict[str, Any]:
        from testbed.ps.client import describe_stats

        facts = {
            "mode": self.cfg.mode,
            "servers": int(self.cfg.servers),
            "staleness_bound": int(self.cfg.staleness) if self.cfg.mode == "ssp" else None,
            "addresses": list(self.cfg.addresses),
            "overlap": self.overlap,
            "backup_workers": self.backup,
            "server_stats": describe_stats(self.client.stats()),
        }
        if self.codecs is not None:
            facts["compress"] = codec_facts(self.compress, self.codecs, self.bytes_per_step)
        return facts

    def close(self) -> None:  # each part only where setup got to it
        if hasattr(self, "_pushes"):
            self._pushes.shutdown(wait=True)
        if hasattr(self, "client"):
            self.client.close()


def host_buffers(flat_params: torch.Tensor, flat_grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffers gRPC reads and writes: the flat buffers themselves on CPU; on CUDA pinned host
    copies (the parameters' initial values included), copied by DMA several times faster than
    pageable memory (testbed.bench.staging)."""
    if flat_params.device.type == "cpu":
        return flat_params, flat_grads
    host_params = torch.empty(flat_params.shape, dtype=flat_params.dtype, pin_memory=True)
    host_params.copy_(flat_params)
    return host_params, torch.empty(flat_grads.shape, dtype=flat_grads.dtype, pin_memory=True)


def label(sync: Mapping[str, Any]) -> str:
    """PS variants carry their mode, shard count and backup workers: ps-sync, ps-ssp k=4, ps-sync b=1."""
    servers, backup = sync.get("servers", 1), sync.get("backup_workers", 0)
    return f"ps-{sync.get('mode', 'sync')}" + (f" k={servers}" if servers != 1 else "") + (f" b={backup}" if backup else "")


def _check(cfg: Any) -> None:
    ps = cfg.sync
    require(ps.mode in MODES, f"sync.mode={ps.mode}: allowed: {'|'.join(MODES)}")
    require(ps.servers >= 1, f"sync.servers={ps.servers}: must be >= 1")
    require(ps.staleness >= 0, f"sync.staleness={ps.staleness}: must be >= 0")
    require(1 <= ps.chunk_kb <= MAX_CHUNK_KB,
            f"sync.chunk_kb={ps.chunk_kb}: must be in [1, {MAX_CHUNK_KB}] (chunks stay under the message limit)")
    require(
        not ps.addresses or len(ps.addresses) == ps.servers,
        f"sync.addresses has {len(ps.addresses)} entries but sync.servers={ps.servers}; give one host:port per server",
    )
    given = {k: ps.get(k) for k in ("tls_cert", "tls_key", "tls_ca")}
    if any(given.values()):
        missing = [k for k, v in given.items() if not v and (k == "tls_ca" or not ps.addresses)]
        require(not missing, f"sync.{', sync.'.join(missing)}: TLS needs the servers' certificate and key (servers "
                             "started here) and the authority workers verify them with (tls_ca)")
        absent = [f"sync.{k}={v}" for k, v in given.items() if v and not Path(v).is_file()]
        require(not absent, f"{', '.join(absent)}: no such file")
    codec = cfg.compress.name
    _check_backup(cfg)
    require(not (cfg.elastic.enabled and ps.backup_workers), "elastic.enabled with sync.backup_workers: a step's "
            "workers are chosen by tickets among a fixed membership; use one of them")
    require(not (cfg.compress.get("pull") and cfg.eval.every),
            f"eval.every={cfg.eval.every} with sync=ps and compress.pull: workers hold a decoded approximation of the "
            "servers' parameters, and pulling the servers' own for an evaluation would break the copy the servers keep "
            "of what each worker holds; evaluate at the end only (eval.every=0), or drop compress.pull")
    require(codec != "powersgd", "compress=powersgd with sync=ps: PowerSGD needs every worker's P before anyone "
                                 "computes Q (two all-reduces), which one push cannot carry; use an all-reduce "
                                 "synchronizer, or another codec")
    require(not (cfg.network.name == "emulated" and ps.addresses),
            "network=emulated starts its own parameter servers inside the network; drop sync.addresses")
    if cfg.checkpoint.every or cfg.resume:
        require(not ps.addresses,
                "checkpoint/resume with sync=ps: the servers save their state in step with the workers when the "
                "launcher starts them; drop sync.addresses")


def _check_backup(cfg: Any) -> None:
    b, n = cfg.sync.backup_workers, cfg.world_size
    require(0 <= b < max(n, 1), f"sync.backup_workers={b} with world_size={n}: each step needs at least one gradient; "
                                f"use 0 <= sync.backup_workers < world_size")
    if not b:
        return
    require(cfg.sync.mode == "sync", f"sync.backup_workers={b} with sync.mode={cfg.sync.mode}: every push is applied on "
                                     "arrival there, so none is late; backup workers are a sync-mode policy")
    require(not cfg.sync.overlap, f"sync.backup_workers={b} with sync.overlap: overlap pushes during backward, before "
                                  "the step knows whether this worker is among its first; drop sync.overlap")
    require(cfg.compress.name == "none",
            f"sync.backup_workers={b} with compress={cfg.compress.name}: a dropped gradient would have to stay in the "
            "codec's error-feedback residual, which is not built; drop the codec (compress=none)")
    require(not (cfg.checkpoint.every or cfg.resume),
            f"sync.backup_workers={b} with checkpoints: the servers save when every worker has pushed the same "
            "number of steps, which with backup workers never happens; drop checkpoint.every and resume")


def _unbalanced(cfg: Any) -> str | None:
    if cfg.sync.mode != "sync":
        return (f"sync.mode={cfg.sync.mode} applies each push on arrival, scaled by 1/n whatever its batch, and no step "
                "waits for a slow worker; balance synchronous training (sync.mode=sync)")
    if cfg.sync.backup_workers:
        return "backup workers leave the late gradients out, so no step's batch is the one balance sized; use one of them"
    return None


def _unmeasured(cfg: Any) -> str | None:
    """Why the shards cannot measure the gradient noise scale (they do from the pushes in sync mode)."""
    if cfg.sync.mode != "sync":
        return (f"sync.mode={cfg.sync.mode} applies each push on arrival, so no update averages the workers' gradients "
                "of one step; measure it in sync mode (sync.mode=sync)")
    if cfg.sync.overlap:
        return ("sync.overlap pushes each shard during backward, before a worker has its own gradient's norm to send "
                "with it; drop sync.overlap")
    return None


@contextmanager
def _start_servers(
    plain: dict[str, Any], world_size: int, log_dir: Path, hosts: list[tuple[str, str]] | None,
    saving: tuple[Path, int] | None, restore: Path | None,
) -> Iterator[dict[str, str]]:
    from testbed.data import data_kind
    from testbed.eval.schedule import with_schedule
    from testbed.ps.launch import LocalServers

    optim = with_schedule(plain, data_kind(plain["data"]["name"]).train_size(OmegaConf.create(plain["data"])))
    with LocalServers(plain["sync"], optim, world_size, log_dir, hosts, saving, restore, plain.get("compress"),
                      int(plain.get("seed", 0))) as ps:
        plain["sync"]["addresses"] = ps.addresses
        yield ps.rank_env()


def _cost(cfg: Any) -> Callable[[float], Cost]:
    n, k = int(cfg.world_size), int(cfg.sync.servers)
    return lambda s: parameter_server(n, s, servers=k)


SPEC = SyncSpec(
    name="ps", schema=PsSyncConfig, impl=ParameterServerSync, check=_check, label=label,
    unbalanced=_unbalanced,
    averaged_gradient=_unmeasured,
    sim=SimModel(series=lambda cfg: f"ps_k{int(cfg.sync.servers)}", cost=_cost, schedule="clocks"),
    servers=Servers(
        count=lambda cfg: 0 if cfg.sync.addresses else int(cfg.sync.servers),
        start=_start_servers,
        apart="start the servers with python -m testbed.ps.server and pass sync.addresses=[host:port,...] "
              "(and TESTBED_PS_TOKEN on servers and workers; with a codec, the servers' --compress and --seed)",
    ),
    communicates_alone=True, compresses=True,
    exclusive={"backup_workers": "an update that goes on without the late workers' gradients needs a party that "
                                 "applies it: a collective waits for every rank's, so backup workers are a parameter-"
                                 "server policy"},
    inelastic=None,
)
