"""A calibrated cost model and simulator of data-parallel training steps (see docs/simulator.md)."""
