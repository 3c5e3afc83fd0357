"""No communication: each replica follows its own shard and the replicas drift apart.

It measures the headroom: the throughput every other synchronizer would reach if communication
were free. Its final model is not a data-parallel model.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.sync.base import Synchronizer, SyncReport
from testbed.sync.spec import SyncBase, SyncSpec


@dataclass
class NoneSyncConfig(SyncBase):
    name: str = "none"


class NoSync(Synchronizer):
    waits_for_peers = False

    def after_backward(self, step: int, is_boundary: bool = True) -> SyncReport:
        return SyncReport(replicas_agree=self.world.world_size == 1)


SPEC = SyncSpec(name="none", schema=NoneSyncConfig, impl=NoSync, sim=None, no_codec="nothing is communicated")
