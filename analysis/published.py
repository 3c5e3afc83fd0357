"""Published points that the paper-scale presets are set against, with their sources.

Horovod (Sergeev & Del Balso 2018, arXiv:1802.05799): 128 Pascal GPUs, 4 per server, 25 Gbit/s
Ethernet, batch 64 per GPU, synthetic data. Scaling efficiency against one GPU: Horovod 88 % for
Inception V3 and ResNet-101 over TCP, standard distributed TensorFlow (parameter servers) about
50 %; VGG-16 79 % with RDMA (RoCE) in the project's benchmark page of the time. Read from the
paper's text and figures as summarized in secondary sources and from horovod/docs/benchmarks;
approximate to a few points.
"""

from __future__ import annotations

import pandas as pd

from testbed.results.format import markdown_table

HOROVOD_N = 128
HOROVOD = (  # (paper_model, system, efficiency at 128 GPUs)
    ("inception_v3", "Horovod ring all-reduce, TCP", 0.88),
    ("resnet101", "Horovod ring all-reduce, TCP", 0.88),
    ("inception_v3", "distributed TensorFlow, parameter servers", 0.50),
    ("resnet101", "distributed TensorFlow, parameter servers", 0.50),
    ("vgg16", "Horovod ring all-reduce, RDMA", 0.79),
)


def _model(setting: str) -> str | None:
    for part in str(setting).split(","):
        key, _, value = part.partition("=")
        if key.lstrip("+") == "paper_model":
            return value
    return None


def horovod_section(table: pd.DataFrame) -> str:
    """Predicted efficiency at 128 workers per model and synchronizer, beside the published points."""
    at = table[table["world_size"] == HOROVOD_N].assign(model=lambda t: t["setting"].map(_model))
    at = at[at["model"].notna()]
    if at.empty:
        return ""
    predicted = at.pivot_table(index="model", columns="option", values="efficiency_common")
    rows = []
    for model, system, published in HOROVOD:
        row = {"model": model, "published system": system, "published": published}
        if model in predicted.index:
            row.update({c: predicted.loc[model, c] for c in predicted.columns})
        rows.append(row)
    frame = pd.DataFrame(rows)
    columns = {c: c for c in frame.columns}
    return "\n".join([
        f"## Against the Horovod paper ({HOROVOD_N} GPUs, 25 Gbit/s)", "",
        "Efficiency against one GPU without communication (the 'common n=1' column of the scaling table), "
        "predicted per synchronizer, beside the published point for that model (analysis/published.py cites them).",
        "", markdown_table(frame, columns), "",
    ])
