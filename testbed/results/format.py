"""Table formatting, the one path for every table the testbed and the analysis print.

One cell rule: a missing value (None, NaN, pd.NA) is ``-``; a float gets 3 decimals below 10 and
1 above (Markdown groups the thousands: 12,345.6); anything else is ``str(value)``. A column may
name its own formatter instead (the benchmark table's fixed decimals), which is given only the
values that are present. Two renderers over a pandas DataFrame: ``text_table`` (right-aligned
console columns) and ``markdown_table`` (a pipe table, without tabulate); ``rows_frame`` makes
one from row dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

MISSING = "-"

Formatter = Callable[[Any], str]


def missing(value: Any) -> bool:
    """None, NaN or pd.NA (pd.isna on a scalar; containers are values, not missing)."""
    if value is None:
        return True
    try:
        return bool(pd.isna(value)) if np.ndim(value) == 0 else False
    except (TypeError, ValueError):
        return False


def cell(value: Any, thousands: bool = False) -> str:
    if missing(value):
        return MISSING
    if isinstance(value, float | np.floating):
        if abs(value) < 10:
            return f"{value:.3f}"
        return f"{value:,.1f}" if thousands else f"{value:.1f}"
    return str(value)


def rows_frame(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> pd.DataFrame:
    """Rows (dicts) as a frame with the columns ``keys``, values kept as they are (object dtype:
    an integer column with a missing value stays integers, None stays None); absent keys are missing."""
    return pd.DataFrame(list(rows), columns=list(keys), dtype=object)


def _strings(
    data: pd.DataFrame, columns: Mapping[str, str], formats: Mapping[str, Formatter], thousands: bool
) -> dict[str, list[str]]:
    out = {}
    for key in columns:
        fmt = formats.get(key)
        out[key] = [MISSING if missing(v) else fmt(v) if fmt else cell(v, thousands) for v in data[key]]
    return out


def _present(data: pd.DataFrame, columns: Mapping[str, str], optional: Sequence[str]) -> dict[str, str]:
    """The columns of ``columns`` that ``data`` has, the ``optional`` ones only where some row has a value."""
    return {
        k: t for k, t in columns.items()
        if k in data.columns and (k not in optional or any(not missing(v) for v in data[k]))
    }


def text_table(
    data: pd.DataFrame,
    columns: Mapping[str, str],
    formats: Mapping[str, Formatter] | None = None,
    optional: Sequence[str] = (),
    rule: bool = True,
) -> str:
    """Console table: ``columns`` maps frame column to title, in print order; cells right-aligned
    to the wider of title and values, two spaces apart; ``rule``: a dashed line under the titles."""
    columns = _present(data, columns, optional)
    cells = _strings(data, columns, formats or {}, thousands=False)
    widths = {k: max([len(t), *map(len, cells[k])]) for k, t in columns.items()}
    lines = ["  ".join(t.rjust(widths[k]) for k, t in columns.items())]
    if rule:
        lines.append("  ".join("-" * widths[k] for k in columns))
    lines += ["  ".join(cells[k][i].rjust(widths[k]) for k in columns) for i in range(len(data))]
    return "\n".join(lines)


def markdown_table(
    data: pd.DataFrame,
    columns: Mapping[str, str],
    formats: Mapping[str, Formatter] | None = None,
    optional: Sequence[str] = (),
) -> str:
    """Markdown pipe table of the ``columns`` (frame column to title) that ``data`` has."""
    columns = _present(data, columns, optional)
    cells = _strings(data, columns, formats or {}, thousands=True)
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cells[k][i] for k in columns) + " |" for i in range(len(data))]
    return "\n".join(lines)
