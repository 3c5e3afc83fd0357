"""Held-out metrics from sums that add over ranks: each rank evaluates a disjoint slice, one
all-reduce adds the sums, and every rank computes the same metrics from them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from testbed.data.spec import DataSpec

IGNORE = -100  # a target that counts in no metric (BERT's unmasked positions)
SUMS = ("loss", "correct", "top5", "count", "samples")


def metrics_of(spec: DataSpec, logits: bool = True) -> tuple[str, ...]:
    """What evaluation measures on this data: loss and top-1 accuracy always (per token for
    language models: next-token, or BERT's masked-token, accuracy), top-5 over more than five
    classes, perplexity for language models. A model that returns its own loss and no logits
    (testbed.models.call) is measured by its loss alone."""
    if spec.kind == "lm":
        return ("loss", "accuracy", "perplexity") if logits else ("loss", "perplexity")
    if not logits:
        return ("loss",)
    return ("loss", "accuracy", "top5") if spec.num_classes > 5 else ("loss", "accuracy")


def batch_sums(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """One batch's sums, in float64: summed cross-entropy, top-1 and top-5 hits, counted targets
    (tokens for language models) and samples."""
    flat, labels = logits.flatten(0, -2).float(), targets.flatten()
    counted = labels != IGNORE
    flat, labels = flat[counted], labels[counted]
    loss = F.cross_entropy(flat, labels, reduction="sum") if len(labels) else flat.new_zeros(())
    top = flat.topk(min(5, flat.shape[-1]), dim=-1).indices if len(labels) else flat.new_zeros((0, 1), dtype=torch.long)
    hits = top == labels[:, None]
    return torch.tensor([loss.item(), hits[:, :1].sum().item(), hits.sum().item(), len(labels), len(targets)],
                        dtype=torch.float64)


def loss_sums(loss: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sums of a batch the model measured itself: its mean loss over the counted targets."""
    count = int((targets != IGNORE).sum())
    return torch.tensor([loss.item() * count, 0.0, 0.0, count, len(targets)], dtype=torch.float64)


def metrics_from(sums: torch.Tensor, spec: DataSpec, logits: bool = True) -> dict[str, float]:
    loss, correct, top5, count, samples = sums.tolist()
    count = max(count, 1.0)
    out = {"loss": loss / count, "samples": int(samples)}
    if logits:
        out["accuracy"] = correct / count
    if "top5" in metrics_of(spec, logits):
        out["top5"] = top5 / count
    if spec.kind == "lm":
        out["perplexity"] = math.exp(min(out["loss"], 700.0))
        out["tokens"] = int(count)
    return out
