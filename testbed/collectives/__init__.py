"""All-reduce algorithms as plain functions over one flat buffer and point-to-point send/recv.

They sum in place and return the bytes this rank put on and took off the wire, so synchronizers
and the benchmark share them and account traffic the same way.
"""

from testbed.collectives.common import Traffic, chunk_bounds
from testbed.collectives.halving_doubling import halving_doubling_allreduce_, scratch_elems
from testbed.collectives.ring import ring_allgather_, ring_allreduce_
from testbed.collectives.tree import btree, dtree, tree_allreduce_

__all__ = [
    "Traffic", "chunk_bounds", "ring_allreduce_", "ring_allgather_", "tree_allreduce_", "btree", "dtree",
    "halving_doubling_allreduce_", "scratch_elems",
]
