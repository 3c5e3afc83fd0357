"""The tuner's real runs: the single worker that calibrates the simulator, the measured candidates,
and the ranked table and figure they end in.

Every run is ``python -m testbed`` with the setting's overrides plus its own, in a job directory of
its own (``calibration/n1``, ``trials/<rank>_<knobs>_seed<s>``), so ``python -m analysis <dir>/trials``
reads the measured candidates like any sweep; a link the calibration lacks is benchmarked into
``calibration/``.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from testbed.collectives.registry import COLLECTIVES
from testbed.paths import short_dirname
from testbed.results.format import markdown_table, text_table
from testbed.sim import calibrate
from testbed.tune.space import Candidate, Screen


@dataclass
class Measured:
    candidate: Candidate
    jobs: list[Path] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    time_to_target: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def mean(self, values: list[float]) -> float:
        return statistics.fmean(values) if values else math.nan

    def row(self) -> dict[str, Any]:
        measured = self.mean(self.throughput)
        return {
            "knobs": self.candidate.label, "predicted": self.candidate.predicted, "measured": measured,
            "std": statistics.stdev(self.throughput) if len(self.throughput) > 1 else 0.0,
            "ratio": measured / self.candidate.predicted if self.candidate.predicted else math.nan,
            "time_to_target": self.mean(self.time_to_target), "runs": len(self.throughput),
            "failed": "; ".join(self.failed),
        }


def run_job(overrides: list[str], job: Path, log: Path) -> dict[str, Any] | None:
    """One ``python -m testbed`` run; its summary, or None when it wrote none."""
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "testbed", *overrides, f"hydra.run.dir={job}", "launcher.echo_rank0=false"]
    with log.open("w") as out:
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=os.environ.copy(), check=False)
    try:
        return json.loads((job / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def single_worker(base: list[str], out: Path, threads: int) -> Path:
    """A world_size=1 run of the setting (allreduce: alone, it communicates nothing) with the
    ``threads`` each rank of the tuned setting gets: the compute of one of its ranks, which the
    simulator takes as it is."""
    job = out / "calibration" / "n1"
    own = [] if any(o.startswith("threads_per_rank=") for o in base) else [f"threads_per_rank={threads}"]
    summary = run_job([*base, "world_size=1", "sync=allreduce", "compress=none", *own], job, out / "logs" / "n1.log")
    if summary is None or summary.get("status") != "ok":
        raise RuntimeError(f"the single-worker calibration run failed: see {out / 'logs' / 'n1.log'}")
    return job


BENCH_SIZES = "1M,4M,16M"


def benchmarked(impl: str) -> bool:
    """Whether a benchmark measures ``impl`` (an all-reduce, or a parameter server ``ps_k<k>``)."""
    return impl in COLLECTIVES or re.fullmatch(r"ps_k\d+", impl) is not None


def calibration_for(cfg: Any, calibration: Path, out: Path, lacking: frozenset[str] = frozenset()) -> Path:
    """``calibration``, or a copy in ``out/calibration`` with the fits it lacks for the setting's
    link, benchmarked there first: all-reduce (python -m testbed.bench: every registered algorithm at
    the setting's world size) where the link has no fit at all, and the impls of ``lacking`` (the
    screen's fallbacks: testbed.bench for an all-reduce, testbed.bench.ps for ``ps_k<k>``)."""
    emulated = cfg.network.name == "emulated"
    link = cfg.sim.link or (str(cfg.network.bandwidth) if emulated else calibrate.DEFAULT_LINK)
    collectives = {i for i in lacking if i in COLLECTIVES}
    if not any(f.link == link for f in calibrate.load(calibration)):
        collectives |= set(COLLECTIVES)
    unknown = sorted(i for i in lacking if not benchmarked(i))
    if unknown:
        raise ValueError(f"no benchmark measures {', '.join(unknown)}")
    servers = sorted(int(i.removeprefix("ps_k")) for i in lacking if i not in COLLECTIVES)
    n, shaped = str(max(2, int(cfg.world_size))), ["--bandwidth", link] if emulated else []
    benches = []
    if collectives:
        benches.append(_bench(out, f"bench-{link}", ["testbed.bench", "--world-sizes", n, "--impls",
                                                     ",".join(sorted(collectives)), "--sizes", BENCH_SIZES, *shaped]))
    if servers:
        benches.append(_bench(out, f"bench-ps-{link}", ["testbed.bench.ps", "--workers", n, "--servers",
                                                        ",".join(map(str, servers)), "--sizes", BENCH_SIZES, "--no-native", *shaped]))
    if not benches:
        return calibration
    sources = json.loads(calibration.read_text()).get("sources", [])
    fitted = out / "calibration" / "calibration.json"
    calibrate.save(calibrate.load(calibration) + calibrate.fit_records(calibrate.load_records(benches)), fitted,
                   [*sources, *benches], calibrate.load_codecs(calibration))
    return fitted


def _bench(out: Path, name: str, module_args: list[str]) -> Path:
    """Run a benchmark (``python -m <module_args>``) into ``out/calibration/<name>.json``."""
    bench = out / "calibration" / f"{name}.json"
    bench.parent.mkdir(parents=True, exist_ok=True)
    with (out / "logs" / f"{name}.log").open("w") as log:
        subprocess.run([sys.executable, "-m", *module_args, "--out", str(bench)], stdout=log, stderr=subprocess.STDOUT,
                       env=os.environ.copy(), check=False)
    if not bench.is_file():
        raise RuntimeError(f"the benchmark {name} failed: see {out / 'logs' / f'{name}.log'}")
    return bench


def measure(base: list[str], chosen: list[Candidate], repeats: int, seed: int, out: Path,
            progress: Any = print) -> list[Measured]:
    """``repeats`` runs of each chosen candidate, seeds ``seed``, ``seed + 1``, ..., in rounds of
    one run of each: the machine's drift over minutes (10 % here, more than the gaps between good
    candidates) then falls on every candidate alike, not on whichever ran last."""
    results = [Measured(candidate) for candidate in chosen]
    for r in range(repeats):
        for rank, measured in enumerate(results):
            candidate = measured.candidate
            knobs = "_".join(o.replace("=", "-") for o in candidate.overrides) or "given"  # '=' is Hydra's own
            name = short_dirname(f"{rank}_{knobs}_seed{seed + r}", 120)
            job = out / "trials" / name
            progress(f"[measure round {r + 1}/{repeats}, {rank + 1}/{len(chosen)}] {candidate.label}")
            summary = run_job([*base, *candidate.overrides, f"seed={seed + r}"], job, out / "logs" / f"{name}.log")
            measured.jobs.append(job)
            if summary is not None and summary.get("status") == "ok":
                measured.throughput.append(float(summary["throughput"]))
            else:
                measured.failed.append((summary or {}).get("error", {}).get("message", "no summary") if summary else "no summary")
    return results


def add_time_to_target(results: list[Measured]) -> dict[str, Any] | None:
    """Each measured run's seconds to the held-out quality target (summary.json time_to_target,
    evaluation time included, MLPerf's clock); a run that did not reach it counts as not measured.
    Returns the target."""
    target = None
    for m in results:
        m.time_to_target = []
        for job in m.jobs:
            path = job / "summary.json"
            reached = json.loads(path.read_text()).get("time_to_target") if path.exists() else None
            if reached:
                target = {k: reached[k] for k in ("metric", "value")}
                if reached["reached"]:
                    m.time_to_target.append(float(reached["seconds"]))
    return target


COLUMNS = {"knobs": "knobs", "predicted": "predicted samples/s", "measured": "measured samples/s", "std": "± std",
           "ratio": "measured/predicted", "time_to_target": "time to target s", "runs": "runs", "failed": "failed"}


def rank(results: list[Measured], objective: str) -> list[Measured]:
    def key(m: Measured) -> float:
        value = m.mean(m.time_to_target) if objective == "time_to_target" else -m.mean(m.throughput)
        return value if not math.isnan(value) else math.inf

    return sorted(results, key=key)


def within_noise(ranked: list[Measured]) -> list[Measured]:
    """The measured candidates after the first whose mean throughput is within the sum of the two
    standard deviations of the first's: runs cannot tell them apart, and the first may be either."""
    if not ranked or len(ranked[0].throughput) < 2:
        return []
    best = ranked[0].row()
    return [m for m in ranked[1:] if len(m.throughput) > 1
            and abs(best["measured"] - m.row()["measured"]) <= best["std"] + m.row()["std"]]


def write(out: Path, screen: Screen, ranked: list[Measured], facts: dict[str, Any]) -> str:
    """tuning.md, tuning.json and tuning.png in ``out``; the console table."""
    rows = pd.DataFrame([{"rank": i + 1, **m.row()} for i, m in enumerate(ranked)])
    columns = {"rank": "#", **COLUMNS}
    tied = [m.candidate.label for m in within_noise(ranked)]
    unpredicted = [c for c in screen.candidates if math.isnan(c.predicted)]
    lines = [
        "# Tuning", "",
        f"Objective: {facts['objective']}. Space: {screen.size} combinations, {len(screen.candidates)} distinct "
        f"candidates screened ({screen.method}) in {facts['screen_s']:.1f} s; {len(ranked)} measured "
        f"({facts['repeats']} runs each) in {facts['measure_s']:.1f} s. Calibration: {facts['calibration']}, "
        f"compute from {facts['compute_from']}.", "",
        "## Measured (best first)", "", markdown_table(rows, columns, optional=("time_to_target", "failed")), "",
        *([f"Within the noise of #1 (throughput apart by less than their two standard deviations): {'; '.join(tied)}.", ""]
          if tied else []),
        "## Screened (predicted, best first)", "",
        markdown_table(pd.DataFrame([{"knobs": c.label, "predicted": c.predicted, "step ms": 1e3 * c.predicted_step_s,
                                      "fit": c.fit} for c in screen.ranked()]),
                       {"knobs": "knobs", "predicted": "samples/s", "step ms": "step ms", "fit": "link fit"}), "",
    ]
    if unpredicted:
        lines += ["## Not predicted", "", *(f"- {c.label}: {c.why}" for c in unpredicted), ""]
    (out / "tuning.md").write_text("\n".join(lines))
    (out / "tuning.json").write_text(json.dumps({**facts, "measured": rows.to_dict("records"), "within_noise": tied, "screened": [
        {"overrides": list(c.overrides), "predicted": c.predicted, "fit": c.fit, "why": c.why} for c in screen.candidates]},
        indent=2, default=str) + "\n")
    _figure(out / "tuning.png", screen, ranked)
    return text_table(rows, columns, optional=("time_to_target", "failed")) + (f"\nwithin the noise of #1: {'; '.join(tied)}" if tied else "")


def _figure(path: Path, screen: Screen, ranked: list[Measured]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    screened = screen.ranked()
    left.plot(range(1, len(screened) + 1), [c.predicted for c in screened], "o-", ms=3)
    left.set(xlabel="candidate (by prediction)", ylabel="predicted samples/s", title=f"screened ({screen.method})")
    labels = [m.candidate.label for m in ranked]
    x = range(len(ranked))
    right.bar([i - 0.2 for i in x], [m.candidate.predicted for m in ranked], 0.4, label="predicted")
    right.bar([i + 0.2 for i in x], [m.mean(m.throughput) for m in ranked], 0.4, label="measured",
              yerr=[m.row()["std"] for m in ranked])
    right.set_xticks(list(x), labels, rotation=20, ha="right", fontsize=7)
    right.set(ylabel="samples/s", title="measured candidates")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
