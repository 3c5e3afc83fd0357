"""Size parsing and the benchmark tables (nccl-tests style: one row per world size and size)."""

from __future__ import annotations

from collections.abc import Callable

from testbed.results.format import rows_frame, text_table

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def human(nbytes: float) -> str:
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit]:
            return f"{nbytes / UNITS[unit]:g}{unit}"
    return f"{int(nbytes)}"


def size_series(lo: int, hi: int, factor: int) -> list[int]:
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def format_results(records: list[dict], impls: list[str]) -> str:
    """One row per (world size, size): each impl's time (ms), busbw (GB/s), fraction of its algorithm's
    bound on the link (testbed.bench.bound) and correctness, then each impl's time over the first's
    (testbed.results.format; ``-`` where an impl has no record or no bound): the median of paired
    rounds where the two ran interleaved in one world (a record's ``paired``), else of medians."""
    columns, formats = {"n": "n", "bytes": "bytes"}, {"bytes": human}
    for impl in impls:
        columns.update({f"{impl} ms": f"{impl} ms", f"{impl} busbw": f"{impl} busbw GB/s",
                        f"{impl} bound": f"{impl} of bound", f"{impl} ok": f"{impl} ok"})
        formats.update({f"{impl} ms": _fixed(3), f"{impl} busbw": _fixed(3), f"{impl} bound": _fixed(2)})
    for impl in impls[1:]:
        columns[f"{impl}/{impls[0]}"] = f"{impl}/{impls[0]}"
        formats[f"{impl}/{impls[0]}"] = _fixed(2)
    rows = []
    for n, nbytes in sorted({(r["world_size"], r["bytes"]) for r in records}):
        by = {r["impl"]: r for r in records if r["world_size"] == n and r["bytes"] == nbytes}
        row = {"n": n, "bytes": nbytes}
        for impl, r in by.items():
            row.update({f"{impl} ms": 1e3 * r["time_s"], f"{impl} busbw": r["busbw"] / 1e9, f"{impl} ok": r["correct"]})
            if r.get("bound_fraction") is not None:
                row[f"{impl} bound"] = r["bound_fraction"]
        base = by.get(impls[0])
        for impl in impls[1:]:
            if impl in by and base:
                paired = by[impl].get("paired", {}).get(impls[0])
                row[f"{impl}/{impls[0]}"] = paired if paired is not None else by[impl]["time_s"] / base["time_s"]
        rows.append(row)
    return text_table(rows_frame(rows, list(columns)), columns, formats, rule=False)


def _fixed(decimals: int) -> Callable[[float], str]:
    return lambda value: f"{value:.{decimals}f}"
