"""What a synchronizer declares to the rest of the testbed, beside its implementation.

Each synchronizer is one module of this package with a ``SPEC``: its config schema and semantic
checks (``testbed.config``), the servers the launcher must start for it (``testbed.launch``), its
cost in the simulator (``testbed.sim``), and its label for tables and ``summary.json``. Those
modules look a synchronizer up by name in ``testbed.sync.SYNCHRONIZERS`` and never switch on it.
Declarations import nothing heavy: a synchronizer's gRPC or collective code loads when a rank
builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from testbed.checks import require, resolved_backend, resolved_device
from testbed.costs import Cost, Link, ring_two_level


@dataclass
class SyncBase:
    # Micro-steps per optimizer step: k forward/backward passes accumulate gradients, and only the
    # last one (the window's boundary) communicates. The global batch grows k-fold.
    accumulate: int = 1


@dataclass
class BucketedSyncConfig(SyncBase):
    # Gradients are all-reduced in buckets of this many MB, in the order backward produces them;
    # null: one bucket for all gradients; 0: one collective per tensor.
    bucket_mb: float | None = None
    # Start each bucket's collective during backward, as soon as its gradients are ready.
    overlap: bool = False


@dataclass(frozen=True)
class SimModel:
    """How the simulator costs a synchronizer (testbed.sim.step).

    ``schedule`` is the shape of its step: ``buckets``, every step's gradients bucket by bucket,
    after backward or overlapped with it; ``average``, the whole model at the steps ``meets`` says
    (local SGD); ``clocks``, pushes and pulls through the parameter server's worker-clock
    simulation. ``cost(cfg)`` gives the cost of one message of ``s`` bytes, and ``series(cfg)`` the
    calibration series (testbed.sim.calibrate) whose link fit prices it. ``two_level(cfg)``, on a
    two-level network (``network.nodes``), the seconds of one message of ``s`` bytes given the link
    inside a node and a node's uplink (its sharing by the node's ranks included); None where the
    synchronizer is not costed there. ``codec(cfg)``: the codec config (testbed.compress) that the
    synchronizer applies in place of ``compress`` (None: none), for one that compresses its own way.
    """

    series: Callable[[Any], str]
    cost: Callable[[Any], Callable[[float], Cost]]
    two_level: Callable[[Any], Callable[[float, Link, Link], float]] | None = None
    schedule: str = "buckets"
    overlap: Callable[[Any], bool] = lambda cfg: bool(cfg.sync.get("overlap", False))
    meets: Callable[[Any, int], bool] = lambda cfg, step: True
    codec: Callable[[Any], Any | None] | None = None


@dataclass(frozen=True)
class Servers:
    """Processes a synchronizer needs besides the ranks, started by the launcher before them.

    ``count(cfg)``: how many the launcher starts here (0: started elsewhere, or none needed);
    ``start(plain, world_size, log_dir, hosts, saving, restore)``: a context manager that starts
    them (on ``hosts``, (namespace, address) pairs on an emulated network), writes their addresses
    into ``plain["sync"]``, yields the environment the ranks need to reach them, and stops them on
    exit; ``apart``: how to run them apart, for launches (torchrun, Slurm) that cannot start them;
    ``machines(cfg)``: on a two-level network, the machine of each (testbed.netem.machines_of), when
    not one of its own each (or one on each node, colocated).
    """

    count: Callable[[Any], int]
    start: Callable[..., AbstractContextManager[dict[str, str]]]
    apart: str
    machines: Callable[[Any], list[int]] | None = None


def overlapped(cfg: Any) -> str | None:
    """SyncSpec.averaged_gradient of a synchronizer that may overlap with backward."""
    if cfg.sync.get("overlap"):
        return "sync.overlap averages each bucket during backward, before a rank could read its own gradient; " \
               "drop sync.overlap"
    return None


@dataclass(frozen=True)
class SyncSpec:
    name: str  # the Hydra option (sync=<name>)
    schema: type  # its structured config
    impl: type  # its Synchronizer, built on every rank
    sim: SimModel | None  # None: it never communicates
    check: Callable[[Any], None] = lambda cfg: None  # semantic checks on the whole config
    label: Callable[[Mapping[str, Any]], str] = lambda sync: str(sync.get("name"))  # rows and dashboards
    servers: Servers | None = None
    # Environment each rank sets before its process group exists (NCCL reads it there).
    rank_env: Callable[[Any], dict[str, str]] = lambda cfg: {}
    # A world of one still communicates (a parameter server is not a peer).
    communicates_alone: bool = False
    # Carries a gradient codec (compress=...; testbed.compress); if not, why (for the refusal).
    compresses: bool = False
    no_codec: str = "this synchronizer does not carry a codec"
    # Options of its schema that the other synchronizers cannot have, and why (for their refusal).
    exclusive: Mapping[str, str] = field(default_factory=dict)
    # Why a rank cannot read its own gradient before synchronizing and the averaged one after (the
    # gradient noise scale's estimate, testbed.stats); None: it can.
    averaged_gradient: Callable[[Any], str | None] = overlapped
    # Why the ranks' batches cannot be balanced (testbed.balance): a step that is not one global
    # batch's mean gradient; None: they can.
    unbalanced: Callable[[Any], str | None] = lambda cfg: None
    # Why a lost worker cannot leave a run of it without a restart (elastic.enabled,
    # testbed.elastic); None: its survivors regroup (a new process group, set up again, and the
    # last commit restored).
    inelastic: str | None = "its state is not rebuilt for a new membership"
    # Each rank checkpoints its pieces of the model state (Synchronizer.pieces), and a run resumes
    # from them at any world size; False: every rank saves the model and optimizer whole.
    sharded_checkpoint: bool = False
    # Why it cannot shard a model (built on the meta device), None when it can; None: it shards nothing.
    unshardable: Callable[[Any], str | None] | None = None

    def local_servers(self, cfg: Any) -> int:
        return self.servers.count(cfg) if self.servers else 0


def node_ordered_ring(cfg: Any) -> Callable[[float, Link, Link], float]:
    """SimModel.two_level of a ring over the ranks in node order (testbed.costs.ring_two_level)."""
    n, nodes = int(cfg.world_size), int(cfg.network.nodes)
    return lambda s, intra, inter: ring_two_level(n, nodes, s, intra, inter)


def ranks_per_node(cfg: Any) -> int:
    """A node's ranks as the launcher lays them out (for the launcher and the simulator):
    sync.ranks_per_node, an emulated network's nodes, or every rank on one machine."""
    if cfg.sync.get("ranks_per_node"):
        return int(cfg.sync.ranks_per_node)
    nodes = int(cfg.network.get("nodes") or 0) if cfg.network.name == "emulated" else 0
    return int(cfg.world_size) // nodes if nodes else int(cfg.world_size)


def require_gloo_cpu(cfg: Any, what: str) -> None:
    """The testbed's point-to-point schedules run over Gloo on CPU tensors."""
    if cfg.world_size > 1:
        # Gloo has no CUDA send/recv, and NCCL ignores message tags and serialises ungrouped
        # point-to-point calls, which the pipelined schedules rely on; they are verified on Gloo.
        require(
            resolved_device(cfg) == "cpu" and resolved_backend(cfg) == "gloo",
            f"{what} runs over Gloo on CPU tensors; use device=cpu (or sync=allreduce for NCCL)",
        )

