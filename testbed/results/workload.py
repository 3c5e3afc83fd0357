"""Throughput in the field's own unit (images/s, tokens/s) and model FLOPs utilisation (MFU).

MFU is the share of the devices' peak that the model's own training FLOPs use: achieved
``tokens/s x FLOPs per token`` over ``world_size x peak``; FLOPs per token are 6 N plus attention
(testbed.models.language.flops_per_token), the convention of PaLM and nanoGPT, so recomputation
and padding never count as useful work. The peak is ``peak_tflops`` when configured, else the dense
bf16 tensor-core peak of a known CUDA device; on CPU it must be configured.
"""

from __future__ import annotations

from typing import Any

# Dense bf16 peak TFLOP/s of one device, by a substring of torch.cuda.get_device_name (vendor sheets).
CUDA_PEAK_TFLOPS = (("H200", 989.0), ("H100", 989.0), ("A100", 312.0), ("L40S", 362.0), ("A10", 125.0), ("V100", 125.0))


def device_peak_tflops(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    import torch

    name = torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else ""
    return next((peak for key, peak in CUDA_PEAK_TFLOPS if key in name), None)


def workload_throughput(
    throughput: float | None, workload: dict[str, Any] | None, cfg: dict[str, Any], device: str
) -> dict[str, Any]:
    """``throughput_unit``, ``throughput_items`` (items/s) and, for language models with a known
    peak, ``flops_per_token``, ``peak_tflops`` and ``mfu``."""
    if not workload or throughput is None:
        return {}
    items = throughput * workload["per_sample"]
    facts: dict[str, Any] = {"throughput_unit": f"{workload['unit']}/s", "throughput_items": items}
    flops = workload.get("flops_per_item")
    if flops is not None:
        facts["flops_per_token"] = flops
        peak = cfg.get("peak_tflops") or device_peak_tflops(device)
        facts["peak_tflops"] = peak
        facts["mfu"] = items * flops / (int(cfg["world_size"]) * peak * 1e12) if peak else None
    return facts
