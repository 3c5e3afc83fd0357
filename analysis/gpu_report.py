"""The CUDA check's report: scripts/gpu_check.sh's parts gathered into one JSON and one Markdown page.

``python -m analysis.gpu_report OUT`` reads ``OUT/runs`` (each part's exit status, log, job
directory or JSON) and writes ``OUT/gpu_check.json``; ``python -m analysis.gpu_report --markdown
docs/gpu.md docs/gpu/gpu_check.json`` renders a committed report's tables into the manual's page,
between its BEGIN and END markers (the reading of them above stays as written).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TRAIN_KEYS = ("status", "error", "device", "backend", "global_batch", "throughput", "throughput_items",
              "throughput_unit", "mfu", "peak_tflops", "flops_per_token", "step_time", "step_time_p10",
              "step_time_p90", "phases", "cuda_peak_bytes", "loss_first", "final_loss")
OVERHEAD_TARGET, MFU_TARGET, TIMING_TOLERANCE = 0.97, 0.40, 0.10
BEGIN, END = "<!-- gpu_report tables: begin -->", "<!-- gpu_report tables: end -->"


def gather(out: Path) -> dict[str, Any]:
    runs = out / "runs"
    env = (out / "environment.txt").read_text().splitlines() if (out / "environment.txt").exists() else []
    report: dict[str, Any] = {"environment": env, "parts": {}, "train": {}, "overhead": {}, "timing": {}}
    for rc in sorted(runs.glob("*.rc")):
        log = rc.with_suffix(".log")
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
        report["parts"][rc.stem] = {"rc": rc.read_text().strip(), "tail": tail}
    for summary in sorted(runs.glob("train_*/summary.json")):
        data = json.loads(summary.read_text())
        report["train"][summary.parent.name.removeprefix("train_")] = {k: data.get(k) for k in TRAIN_KEYS}
    for kind in ("overhead", "timing"):
        for path in sorted(runs.glob(f"{kind}_*.json")):
            report[kind][path.stem.removeprefix(f"{kind}_")] = json.loads(path.read_text())
    if (runs / "staging.json").exists():
        report["staging"] = json.loads((runs / "staging.json").read_text())
    return report


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1e3 * value:.3f}"


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = ["# The CUDA path, measured", "", "Produced by `scripts/gpu_check.sh` and rendered by `python -m analysis.gpu_report`;",
             "the raw report is [gpu/gpu_check.json](gpu/gpu_check.json).", "", "```", *env, "```", "",
             "## Parts", "", "| part | exit status |", "|---|---|"]
    lines += [f"| {name} | {part['rc']} |" for name, part in report["parts"].items()]
    lines += ["", "## Throughput and MFU (`python -m testbed`, world_size=1, NCCL)", "",
              "Medians after 10 warm-up steps. MFU counts the model's own training FLOPs (6N plus attention) against "
              f"the device's dense bf16 peak; target for GPT-2 in bf16: at least {MFU_TARGET:.0%}.", "",
              "| run | status | throughput | unit | step ms (p10–p90) | MFU | peak memory GiB | loss first → final |",
              "|---|---|---|---|---|---|---|---|"]
    for name, r in report["train"].items():
        peak = (r.get("cuda_peak_bytes") or [None])[0]
        mfu = r.get("mfu")
        lines.append(
            f"| {name} | {r['status']} | {_num(r.get('throughput_items'))} | {r.get('throughput_unit') or 'samples/s'} | "
            f"{_ms(r.get('step_time'))} ({_ms(r.get('step_time_p10'))}–{_ms(r.get('step_time_p90'))}) | "
            f"{'-' if mfu is None else f'{mfu:.1%}'} | {_num(peak / 2**30 if peak else None, '.2f')} | "
            f"{_num(r.get('loss_first'), '.3f')} → {_num(r.get('final_loss'), '.3f')} |")
    lines += ["", "## The trainer against a plain PyTorch loop", "",
              f"Same model, data and optimizer; pairs alternate which goes first; ratio = median over pairs of "
              f"plain time / trainer time (target ≥ {OVERHEAD_TARGET}).", "",
              "| workload | plain samples/s | trainer samples/s | ratio | pairs |", "|---|---|---|---|---|"]
    for name, r in report["overhead"].items():
        lines.append(f"| {name} | {r['plain_samples_per_s']:.1f} | {r['trainer_samples_per_s']:.1f} | {r['ratio']:.3f} | "
                     f"{r['repeats']} |")
    lines += ["", "## Communication timing: CUDA events against synchronize brackets", "",
              "ResNet-50, bf16, world_size=1 (the all-reduce has no peer). Medians over the steps after warm-up, in "
              f"ms; ratio = events / bracketed (target within {TIMING_TOLERANCE:.0%}). `t_encode`/`t_decode` are read once "
              "the device is done in both runs.", "",
              "| synchronizer | t_sync events | t_sync bracketed | ratio | t_encode events / bracketed run | "
              "t_decode events / bracketed run | t_backward |", "|---|---|---|---|---|---|---|"]
    for name, r in report["timing"].items():
        ev, br = r["events"], r["bracketed"]
        lines.append(f"| {name} | {_ms(ev['t_sync'])} | {_ms(br['t_sync'])} | {_num(r['ratio'], '.3f')} | "
                     f"{_ms(ev['t_encode'])} / {_ms(br['t_encode'])} | {_ms(ev['t_decode'])} / {_ms(br['t_decode'])} | "
                     f"{_ms(ev['t_backward'])} |")
    if "staging" in report:
        lines += ["", "## Staging bandwidth (host ↔ device copies, GB/s, median of 20)", "",
                  "| MiB | host memory | direction | GB/s |", "|---|---|---|---|"]
        lines += [f"| {r['mib']:.1f} | {'pinned' if r['pinned'] else 'pageable'} | {r['direction']} | {r['gb_per_s']:.2f} |"
                  for r in report["staging"]["rows"]]
    return "\n".join(lines) + "\n"


def write_tables(page: Path, text: str) -> None:
    """``text``'s tables (from its first section on) between ``page``'s markers; the whole of
    ``text`` where the page does not exist yet."""
    if not page.exists():
        page.write_text(text)
        return
    old = page.read_text()
    if BEGIN not in old or END not in old:
        raise SystemExit(f"{page} has no {BEGIN} ... {END} markers to render the tables between")
    tables = text[text.index("\n## ") + 1:]
    head, rest = old.split(BEGIN, 1)
    page.write_text(f"{head}{BEGIN}\n{tables}{END}{rest.split(END, 1)[1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m analysis.gpu_report", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the check's OUT directory, or a gpu_check.json with --markdown")
    parser.add_argument("--markdown", default="", help="render the report as Markdown to this file")
    args = parser.parse_args(argv)
    source = Path(args.source)
    if source.is_dir():
        report = gather(source)
        (source / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    else:
        report = json.loads(source.read_text())
    text = markdown(report)
    if args.markdown:
        write_tables(Path(args.markdown), text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
