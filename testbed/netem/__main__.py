"""``python -m testbed.netem cleanup [--all]``: remove emulated-network namespaces left behind.

A launcher killed with SIGKILL cannot clean up; its namespaces are named after its pid, and those
whose launcher is gone are removed here (and by every new emulated run). ``--all`` also removes
namespaces of launchers still running.
"""

from __future__ import annotations

import argparse
import sys

from testbed.netem.links import NetworkUnavailable, check_available, remove_leftovers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.netem", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["cleanup"])
    parser.add_argument("--all", action="store_true", help="also namespaces of running launchers")
    args = parser.parse_args(argv)
    try:
        check_available()
    except NetworkUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    removed = remove_leftovers(everything=args.all)
    print(f"removed {len(removed)} namespace(s)" + (": " + " ".join(removed) if removed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
