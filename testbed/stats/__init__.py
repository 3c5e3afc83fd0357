"""Statistics of training measured alongside it: the gradient noise scale (testbed.stats.noise_scale)."""
