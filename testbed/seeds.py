"""Seeds derived from the run's one ``seed``: every rank's own stream, apart from the shared ones."""

from __future__ import annotations

import numpy as np


def rank_seed(seed: int, rank: int) -> int:
    """One well-mixed 64-bit seed per ``(seed, rank)``, distinct from the epoch-order seeds: a rank's
    own randomness (dropout masks, its data pipeline's augmentations), as separate machines have."""
    return int(np.random.SeedSequence((seed % 2**64, rank)).generate_state(1, np.uint64)[0])
