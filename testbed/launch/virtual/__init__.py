"""A virtual cluster: a job's workers on a simulated clock, their gradients real (``launcher=virtual``).

A run's time to accuracy has two halves: the order of events (which parameter version each gradient
is computed on, which pushes a step takes, when local SGD averages), which timing decides, and the
math, the real model on the real data in that order. A real run takes the order from this machine's
scheduler; a virtual run takes it from the simulator's clock (testbed.sim) for a described cluster
(the ``cluster`` group, testbed.launch.virtual.cluster), and computes every worker's gradient in one
process, in that order. The rules of each mode are the real synchronizers': the parameter server's
shards and policies (testbed.ps), the optimizers, schedules and batch streams.
"""
