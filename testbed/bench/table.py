"""Size parsing and the benchmark tables (nccl-tests style: one row per world size and size)."""

from __future__ import annotations

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
    header = ["n", "bytes"]
    for impl in impls:
        header += [f"{impl} ms", f"{impl} busbw GB/s", f"{impl} ok"]
    header += [f"{impl}/{impls[0]}" for impl in impls[1:]]
    rows = []
    for (n, nbytes) in sorted({(r["world_size"], r["bytes"]) for r in records}):
        by = {r["impl"]: r for r in records if r["world_size"] == n and r["bytes"] == nbytes}
        row = [str(n), human(nbytes)]
        for impl in impls:
            r = by.get(impl)
            row += ["-", "-", "-"] if r is None else [f"{1e3 * r['time_s']:.3f}", f"{r['busbw'] / 1e9:.3f}", str(r["correct"])]
        base = by.get(impls[0])
        for impl in impls[1:]:
            r = by.get(impl)
            row.append(f"{r['time_s'] / base['time_s']:.2f}" if r and base else "-")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)
