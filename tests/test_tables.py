"""The one table-formatting path (testbed.results.format), the run key (testbed.results.keys) and
the console table's speed-up and efficiency (testbed.results.table.comparison_rows), in process."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from testbed.bench.table import format_results
from testbed.results.format import cell, markdown_table, missing, rows_frame, text_table
from testbed.results.keys import run_key
from testbed.results.table import comparison_rows, format_table

pytestmark = pytest.mark.unit

# --- cells -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, text",
    [
        (None, "-"), (float("nan"), "-"), (np.nan, "-"), (pd.NA, "-"),
        (0.0, "0.000"), (1 / 3, "0.333"), (9.9994, "9.999"), (-9.5, "-9.500"),  # below 10: 3 decimals
        (10.0, "10.0"), (1234.56, "1234.6"), (-12.34, "-12.3"), (np.float64(42.25), "42.2"),  # above: 1
        (np.float32(0.5), "0.500"),
        (3, "3"), (np.int64(12345), "12345"), (True, "True"), ("ring", "ring"), ("", ""),  # not floats: as they are
    ],
)
def test_cell_rule(value: object, text: str) -> None:
    assert cell(value) == text


def test_markdown_groups_thousands_and_console_does_not() -> None:
    assert cell(12345.67, thousands=True) == "12,345.7"
    assert cell(12345.67) == "12345.7"
    assert cell(9.5, thousands=True) == "9.500"


def test_containers_are_values_not_missing() -> None:
    assert not missing([None]) and not missing({}) and not missing("")
    assert missing(None) and missing(float("nan"))


# --- renderers ---------------------------------------------------------------------------------


def test_text_table_aligns_right_with_a_rule_and_keeps_integers() -> None:
    data = rows_frame([{"a": 1, "b": 2.5}, {"a": None, "b": 123.45}, {"b": None}], ["a", "b"])
    assert text_table(data, {"a": "n", "b": "value"}).splitlines() == [
        "n  value",
        "-  -----",
        "1  2.500",
        "-  123.5",  # a missing integer leaves its column integers (not 1.0)
        "-      -",  # an absent key is missing too
    ]
    assert text_table(data, {"a": "n"}, rule=False).splitlines() == ["n", "1", "-", "-"]


def test_column_selection_order_optional_and_formats() -> None:
    data = rows_frame([{"x": 1.0, "y": None, "z": 7}], ["x", "y", "z"])
    # Print order is the mapping's; columns the frame lacks are left out.
    assert text_table(data, {"z": "Z", "x": "X", "w": "W"}, rule=False).splitlines() == ["Z      X", "7  1.000"]
    # Optional columns only where some row has a value.
    assert text_table(data, {"x": "X", "y": "Y"}, optional=("y",), rule=False).splitlines()[0] == "    X"
    assert text_table(data, {"x": "X", "z": "Z"}, optional=("z",), rule=False).splitlines()[0] == "    X  Z"
    # A column's own formatter gets only present values: missing stays "-".
    formats = {"x": lambda v: f"{v:.2f}", "y": lambda v: 1 / 0}
    assert text_table(data, {"x": "X", "y": "Y"}, formats, rule=False).splitlines()[1] == "1.00  -"


def test_markdown_table() -> None:
    frame = pd.DataFrame({"sync": ["ring", "tree"], "n": [1, 2], "x": [12345.678, float("nan")], "other": [0, 0]})
    assert markdown_table(frame, {"sync": "sync", "n": "n", "x": "samples/s", "absent": "?"}).splitlines() == [
        "| sync | n | samples/s |",
        "|---|---|---|",
        "| ring | 1 | 12,345.7 |",
        "| tree | 2 | - |",
    ]
    assert markdown_table(frame.iloc[:0], {"sync": "sync"}).splitlines() == ["| sync |", "|---|"]


def columns_of(table: str) -> list[dict[str, str]]:
    """A console table's rows as {title: cell}, cut where the dashed rule puts the columns."""
    header, rule, *body = table.splitlines()
    spans, end = [], 0
    for dashes in rule.split("  "):
        spans.append((end, end + len(dashes)))
        end += len(dashes) + 2
    return [{header[a:b].strip(): line[a:b].strip() for a, b in spans} for line in body]


def test_console_comparison_table_columns() -> None:
    rows = [{"sync": "ring", "world_size": 2, "status": "ok", "throughput": 1234.5, "speedup": 1.9, "efficiency": 0.95}]
    (cells,) = columns_of(format_table(rows))
    assert list(cells) == ["sync", "n", "status", "samples/s", "step ms", "sync ms", "wait ms", "imbalance",
                           "speedup", "efficiency", "MB/step", "loss"]  # (tokens/s: optional, no value)
    assert cells["samples/s"] == "1234.5" and cells["efficiency"] == "0.950" and cells["n"] == "2" and cells["loss"] == "-"
    (cells,) = columns_of(format_table([{**rows[0], "tokens": 5e5}]))
    assert cells["tokens/s"] == "500000.0"
    assert format_table([]).splitlines()[0].split()[:2] == ["sync", "n"]


def test_benchmark_table() -> None:
    def rec(impl: str, n: int, nbytes: int, t: float) -> dict:
        return {"impl": impl, "world_size": n, "bytes": nbytes, "time_s": t, "busbw": 2e9, "correct": True}

    records = [rec("native", 2, 4096, 1e-3), rec("ring", 2, 4096, 2.5e-3), rec("ring", 3, 1 << 20, 0.0125)]
    records[1]["bound_fraction"] = 0.8  # records from before the bound was measured have none
    lines = format_results(records, ["native", "ring"]).splitlines()
    assert lines[0].split() == ["n", "bytes", "native", "ms", "native", "busbw", "GB/s", "native", "of", "bound",
                                "native", "ok", "ring", "ms", "ring", "busbw", "GB/s", "ring", "of", "bound", "ring", "ok",
                                "ring/native"]
    assert len(lines) == 3  # no rule under the titles (nccl-tests style)
    assert lines[1].split() == ["2", "4K", "1.000", "2.000", "-", "True", "2.500", "2.000", "0.80", "True", "2.50"]
    assert lines[2].split() == ["3", "1M", "-", "-", "-", "-", "12.500", "2.000", "-", "True", "-"]  # fixed decimals
    assert all(len(line) == len(lines[0]) for line in lines)


# --- the run key -------------------------------------------------------------------------------


def test_run_key_groups_worker_counts_and_seeds_of_one_configuration() -> None:
    base = ["sync=ring", "model.hidden=32", "steps=8"]
    key = run_key(base)
    assert key == "model.hidden=32,steps=8,sync=ring"  # sorted, comma-joined
    assert run_key(["world_size=4", "seed=1", *reversed(base)]) == key  # order, workers, seed: same key
    assert run_key(["model.hidden=64", "sync=ring", "steps=8"]) != key  # any other override: another
    assert run_key(["sync=tree", "model.hidden=32", "steps=8"]) != key
    assert run_key(["sync=ring", "model.hidden=32", "steps=8", "data.workers=2"]) != key
    assert run_key([*base, "sweep_resume=True"]) == key  # a resumed sweep's runs are the same configuration


def test_run_key_vary_and_ignore() -> None:
    a, b = ["sync=ring", "seed=0", "world_size=1"], ["sync=ring", "seed=1", "world_size=4"]
    assert run_key(a, vary=("world_size=",)) == "seed=0,sync=ring" != run_key(b, vary=("world_size=",))
    assert run_key(["sync=ring", "x=1"], ignore=("sync=",)) == run_key(["sync=tree", "x=1"], ignore=("sync=",)) == "x=1"
    assert run_key(["hydra.job.chdir=true", "x=1"], ignore=("hydra.",)) == "x=1"
    assert run_key([]) == ""


# --- speed-up and efficiency --------------------------------------------------------------------


def summary(sync: str, n: int, throughput: float | None, status: str = "ok", **over: object) -> dict:
    extra = [f"{k}={v}" for k, v in over.items()]
    return {"sync": sync, "sync_label": sync, "world_size": n, "status": status, "throughput": throughput,
            "overrides": [f"sync={sync}", f"world_size={n}", *extra]}


def test_speedup_and_efficiency_against_the_single_worker_of_the_same_key() -> None:
    rows = comparison_rows([
        summary("ring", 4, 300.0), summary("ring", 1, 100.0), summary("ring", 2, 180.0),
        summary("tree", 1, 50.0), summary("tree", 2, 90.0),
    ])
    assert [(r["sync"], r["world_size"]) for r in rows] == [("ring", 1), ("ring", 2), ("ring", 4), ("tree", 1), ("tree", 2)]
    got = {(r["sync"], r["world_size"]): (r["speedup"], r["efficiency"]) for r in rows}
    assert got[("ring", 1)] == pytest.approx((1.0, 1.0))
    assert got[("ring", 2)] == pytest.approx((1.8, 0.9))
    assert got[("ring", 4)] == pytest.approx((3.0, 0.75))
    assert got[("tree", 2)] == pytest.approx((1.8, 0.9))  # against tree's own n = 1, not ring's


def test_other_overrides_and_seeds_take_their_own_baseline() -> None:
    rows = comparison_rows([
        summary("ring", 1, 100.0, seed=0), summary("ring", 2, 150.0, seed=0),
        summary("ring", 1, 200.0, seed=1), summary("ring", 2, 300.0, seed=1),
        summary("ring", 2, 100.0, seed=2),  # no n = 1 run of seed 2
    ])
    eff = sorted((r["throughput"], r.get("efficiency")) for r in rows if r["world_size"] == 2)
    assert eff[0] == (100.0, None)
    assert eff[1][1] == pytest.approx(0.75) and eff[2][1] == pytest.approx(0.75)


def test_failed_or_missing_baseline_gives_no_efficiency() -> None:
    failed = comparison_rows([summary("ring", 1, 100.0, status="failed"), summary("ring", 2, 150.0)])
    none = comparison_rows([summary("ring", 1, None), summary("ring", 2, 150.0)])
    alone = comparison_rows([summary("ring", 2, 150.0), summary("tree", 1, 100.0)])
    for rows in (failed, none, alone):
        two = next(r for r in rows if r["sync"] == "ring" and r["world_size"] == 2)
        assert "efficiency" not in two and "speedup" not in two
        assert format_table(rows)  # prints with "-" where there is none
    # A run without throughput has no efficiency either, even with a baseline.
    rows = comparison_rows([summary("ring", 1, 100.0), summary("ring", 2, None, status="failed")])
    assert "efficiency" not in rows[1]


def test_summaries_without_overrides_match_on_the_resolved_config() -> None:
    def old(n: int, x: float, hidden: int, address: str) -> dict:
        cfg = {"world_size": n, "model": {"hidden": hidden}, "sync": {"name": "ps", "addresses": [address]}}
        return {"sync": "ps", "world_size": n, "status": "ok", "throughput": x, "config": cfg}

    rows = comparison_rows([old(1, 100.0, 32, "a:1"), old(2, 160.0, 32, "b:2"), old(2, 100.0, 64, "c:3")])
    hidden = {(r["world_size"], r["throughput"]): r.get("efficiency") for r in rows}
    assert hidden[(1, 100.0)] == pytest.approx(1.0)
    assert hidden[(2, 160.0)] == pytest.approx(0.8)  # server addresses and world_size differ: same configuration
    assert hidden[(2, 100.0)] is None  # hidden=64 has no single worker
    # With overrides the key is theirs, never the config's: the two kinds do not match each other.
    mixed = comparison_rows([old(1, 100.0, 32, "a:1"), {**old(2, 160.0, 32, "b:2"), "overrides": ["world_size=2"]}])
    assert "efficiency" not in mixed[1]
