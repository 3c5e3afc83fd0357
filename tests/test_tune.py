"""The tuner: its space composes and screens in the simulator (in-process, grid and Optuna's TPE);
a link its calibration lacks is benchmarked first; on a tiny space it picks what a full grid of
measured runs ranks first, or one within the noise of it, leaving normal job directories behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import read_json, run_cli
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from testbed.checks import ConfigError
from testbed.paths import config_dir
from testbed.results.summary import load_summaries
from testbed.sim import calibrate
from testbed.tune import space, trials

SETTING = ["world_size=2", "steps=60", "warmup_steps=10", "device=cpu", "launcher.echo_rank0=false"]


@pytest.mark.unit
def test_a_space_names_its_knobs_and_refuses_one_without_candidates() -> None:
    assert space.knobs(None) == {k: space.DEFAULTS[k] for k in space.SPACE}
    assert space.knobs({"sync": ["ring", "ps"], "sync.overlap": None}) == {"sync": ["ring", "ps"], "sync.overlap": [False, True]}
    with pytest.raises(ConfigError, match=r"tune.space: no candidates for model.hidden; give them"):
        space.knobs(["sync", "model.hidden"])


@pytest.mark.unit
def test_knobs_that_do_not_apply_merge_candidates_and_the_simulator_ranks_them() -> None:
    sim = {"compute_ms_per_sample": 0.05, "calibration": str(Path(config_dir()).parent / "docs/sim/calibration.json")}
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3", job_name="tune"):
        cfg, applied = space.compose_candidate(["world_size=2"], {"sync": "ps", "sync.bucket_mb": 4})
        assert applied == ("sync=ps",) and cfg.sync.name == "ps"  # a parameter server has no buckets
        cfg, applied = space.compose_candidate(["world_size=2"], {"sync": "ring", "sync.bucket_mb": 4})
        assert applied == ("sync=ring", "sync.bucket_mb=4") and cfg.sync.bucket_mb == 4
        knobs = {"sync": ["ring", "ps"], "sync.bucket_mb": [1, 4], "compress": ["none", "powersgd"]}
        grid = space.screen(["world_size=2", "model.hidden=512"], knobs, sim, screen_max=100, seed=0)
        assert (grid.method, grid.size, len(grid.candidates)) == ("grid", 8, 6)  # ps x bucket sizes merge
        refused = [c for c in grid.candidates if math.isnan(c.predicted)]
        assert [c.overrides for c in refused] == [("sync=ps", "compress=powersgd")]
        assert "compress=powersgd with sync=ps" in refused[0].why
        ranked = grid.ranked()
        assert all(a.predicted >= b.predicted for a, b in zip(ranked, ranked[1:])) and ranked[0].overrides[0] == "sync=ring"
        assert {c.overrides[0]: c.fit for c in ranked} == {"sync=ring": "loopback/ring", "sync=ps": "loopback/ps_k1"}
        # A link without the synchronizer's own fit is costed with its all-reduce fit, and says so.
        emulated = space.screen(["world_size=2", "model.hidden=512", "network=emulated", "network.bandwidth=1gbit"],
                                {"sync": ["ps"]}, sim, screen_max=100, seed=0)
        assert [(c.fit, c.lacks) for c in emulated.candidates] == [("1gbit/native (for ps_k1)", "ps_k1")]
        assert trials.benchmarked("ps_k1") and trials.benchmarked("tree") and not trials.benchmarked("ps_sparse")
        sampled = space.screen(["world_size=2", "model.hidden=512"], knobs, sim, screen_max=4, seed=0)
        assert sampled.method == "tpe" and 1 <= len(sampled.candidates) <= 4  # Optuna draws, repeats merge
        assert {c.overrides for c in sampled.candidates} <= {c.overrides for c in grid.candidates}


@pytest.mark.unit
def test_measured_candidates_the_runs_cannot_tell_from_the_first_are_named() -> None:
    first, close, apart, once = (trials.Measured(space.Candidate((f"sync={s}",)), throughput=t) for s, t in
                                 (("ring", [100.0, 104.0, 96.0]), ("tree", [97.0, 99.0, 95.0]),
                                  ("ps", [80.0, 81.0, 79.0]), ("ddp", [99.0])))
    ranked = trials.rank([apart, once, close, first], "throughput")
    assert ranked[:3] == [first, once, close]
    assert trials.within_noise(ranked) == [close]  # 98 is 2 from 100, under 4 + 2; a single run has no spread


@pytest.mark.serial  # benchmarks of the link: two ranks busy for a minute, kept off the parallel tier
def test_a_link_the_calibration_lacks_is_benchmarked_and_fitted_first(tmp_path: Path) -> None:
    given = json.loads((Path(config_dir()).parent / "docs/sim/calibration.json").read_text())
    given["fits"] = [f for f in given["fits"] if f["link"] != "loopback"]  # this machine's link, unknown
    lacking = tmp_path / "calibration.json"
    lacking.write_text(json.dumps(given))
    (tmp_path / "logs").mkdir()
    cfg = OmegaConf.create({"world_size": 2, "network": {"name": "loopback"}, "sim": {"link": None}})
    fitted = trials.calibration_for(cfg, lacking, tmp_path)
    assert fitted == tmp_path / "calibration" / "calibration.json"
    fits = {(f.link, f.impl): f for f in calibrate.load(fitted)}
    assert {("loopback", "native"), ("loopback", "ring"), ("loopback", "tree")} <= set(fits)
    assert all(f.beta > 0 for (link, _), f in fits.items() if link == "loopback")
    assert ("1gbit", "ring") in fits and calibrate.load_codecs(fitted) == calibrate.load_codecs(lacking)
    assert trials.calibration_for(cfg, fitted, tmp_path) == fitted  # has the link now: used as it is
    # A fit the screen had to stand in for (a parameter server's) is benchmarked and added.
    with_ps = trials.calibration_for(cfg, fitted, tmp_path, frozenset({"ps_k1"}))
    fits_ps = {(f.link, f.impl): f for f in calibrate.load(with_ps)}
    added = {("loopback", "ps_k1"), ("loopback", "grpc_raw")}  # the server, and the raw stream it is set against
    assert set(fits_ps) == set(fits) | added and fits_ps["loopback", "ps_k1"].beta > 0
    with pytest.raises(ValueError, match="no benchmark measures ps_sparse"):
        trials.calibration_for(cfg, fitted, tmp_path, frozenset({"ps_sparse"}))


@pytest.mark.serial
def test_the_tuner_picks_what_a_measured_grid_ranks_first_or_one_within_its_noise(tmp_path: Path) -> None:
    tuning = tmp_path / "tuning"
    proc = run_cli([*SETTING, "tune.space={sync:[allreduce,ps],compress:[none,fp16]}", "tune.budget=2", "tune.repeats=1",
                    f"hydra.run.dir={tuning}"], cwd=tmp_path, module="testbed.tune")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tuning / "tuning.json").read_text())
    assert len(result["screened"]) == 4 and all(not math.isnan(c["predicted"]) for c in result["screened"])
    best = result["measured"][0]["knobs"].split()
    assert (tuning / "tuning.png").is_file() and (tuning / "tuning.md").is_file()
    measured = load_summaries([tuning / "trials"])  # normal job directories, as analysis reads them
    assert len(measured) == 2 and all(s["status"] == "ok" for s in measured)
    assert best in [[o for o in s["overrides"] if o.startswith(("sync=", "compress="))] for s in measured]
    # The full grid, measured: every screened candidate twice (python -m testbed.tune.grid), so that
    # one run the machine disturbed (CI once measured a candidate at half its pace) shows as noise.
    proc = run_cli([str(tuning), "--repeats", "2"], cwd=tmp_path, module="testbed.tune.grid", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict = read_json(tuning / "grid.json")
    grid = {row["knobs"]: row["measured"] for row in verdict["grid"]}
    assert len(grid) == 4 and len(load_summaries([tuning / "grid" / "trials"])) == 8
    assert verdict["pick"] == " ".join(best) and verdict["pick_measured"] == grid[verdict["pick"]]
    assert verdict["best_measured"] == max(grid.values()) and verdict["grid_s"] > 0 and (tuning / "grid.md").is_file()
    assert verdict["repeats"] == 2 and all(row["runs"] == 2 for row in verdict["grid"])
    assert (verdict["pick"] == verdict["best"] or verdict["pick"] in verdict["within_noise_of_best"]
            or verdict["pick_over_best"] >= 0.8), verdict  # two cores: runs of one config spread by ~20 %
