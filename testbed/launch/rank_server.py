"""The fork server local ranks start from (multiprocessing's ``forkserver``).

It imports torch, ``torch._dynamo`` (which the first optimizer a rank builds imports: seconds of
CPU) and the ranks' module once per launcher; each rank is then a fork of it, ready in a fraction
of a second, where a fresh interpreter per rank spends several seconds importing. The launcher
starts it before it imports anything heavy itself, so that both import side by side.

A forked rank inherits the server's environment, which is the launcher's of when the server
started: each rank is handed the launcher's environment of its launch and adopts it
(``adopt_environment``), as a spawned process would have inherited it.

This module imports nothing heavy, so that it can run first.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import signal

# In the launcher, its environment at import; in a rank forked from the server, the server's.
SERVER_ENVIRON = dict(os.environ)
_PRELOAD = ["torch", "torch._dynamo", __name__]
_started = False


def start_rank_server(module: str) -> None:
    """Start the server, with torch and ``module`` (the ranks' entry point's) imported in it, unless
    it runs already. It is killed when the launcher exits: a launcher that exits early (a config
    error, ``--help``) must not leave it importing in the background, holding the launcher's
    output open."""
    global _started
    if not _started:
        multiprocessing.set_forkserver_preload([*_PRELOAD, module])
        multiprocessing.forkserver.ensure_running()
        atexit.register(_kill_server)
        _started = True


def adopt_environment(launcher_environ: dict[str, str]) -> None:
    """In a rank: take the launcher's environment, keeping what the launch agent set for this rank
    (RANK, MASTER_ADDR, ...: whatever differs from the environment the process started with)."""
    from_agent = {key: value for key, value in os.environ.items() if SERVER_ENVIRON.get(key) != value}
    os.environ.clear()
    os.environ.update(launcher_environ)
    os.environ.update(from_agent)


def _kill_server() -> None:
    # multiprocessing has no public handle on the server process.
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        os.kill(pid, signal.SIGKILL)
