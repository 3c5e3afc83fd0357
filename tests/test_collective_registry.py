"""The all-reduce algorithms are named in one place, testbed.collectives.registry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from testbed.checks import ConfigError
from testbed.collectives.hierarchical import node_size
from testbed.collectives.registry import BETWEEN_NODES, COLLECTIVES, collective

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "testbed" / "collectives" / "registry.py"


def listings(source: str) -> list[tuple[int, list[str]]]:
    """(line, names) of each literal list, tuple, set or dict whose strings are all algorithm names,
    two or more: a table of algorithms kept beside the registry's. Single names are left alone:
    "ring" and "tree" are also synchronizers' names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        strings = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
        if len(strings) >= 2 and all(s in COLLECTIVES for s in strings):
            found.append((node.lineno, strings))
    return found


def test_no_module_lists_algorithm_names_but_the_registry():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {names}"
        for folder in ("testbed", "analysis")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path != REGISTRY
        for line, names in listings(path.read_text())
    ]
    assert not offenders, "algorithm names listed outside testbed/collectives/registry.py:\n" + "\n".join(offenders)


def test_the_scan_finds_a_table_of_algorithms():
    # The listings the registry replaced, as they read before.
    assert listings('IMPLS = ("native", "ring", "tree", "halving_doubling")') == [(1, ["native", "ring", "tree", "halving_doubling"])]
    assert listings('INTER_COSTS = {"ring": ring, "native": ring}') == [(1, ["ring", "native"])]
    assert listings('SYNCS = ["allreduce", "ring", "ps"]') == []  # synchronizers, not algorithms


def test_an_unknown_algorithm_is_named_with_the_choices():
    with pytest.raises(ValueError, match=r"sync.inter: unknown all-reduce 'mesh'; allowed: native, ring, tree"):
        collective("mesh", "sync.inter")
    assert "tree" not in BETWEEN_NODES  # its second tree's connections exist only in its own synchronizer


def test_a_node_size_that_does_not_divide_the_world_is_a_config_error():
    assert node_size(None, 6, 3, "sync=hierarchical") == 3
    with pytest.raises(ConfigError, match="sync=hierarchical: 4 ranks per node do not divide world_size=6"):
        node_size(None, 6, 4, "sync=hierarchical")
