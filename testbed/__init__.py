"""testbed: every way of synchronizing gradients behind one data-parallel trainer."""

__version__ = "0.1.0"
