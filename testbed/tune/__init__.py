"""``python -m testbed.tune``: which synchronizer and knobs are best for this model on this network.

Screens a space of knobs in the simulator, calibrated for the setting (one measured single-worker
run, the link's fits), then measures the best predicted candidates for real and ranks them
(testbed.tune.__main__).
"""
