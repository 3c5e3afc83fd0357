"""Time to accuracy, in process: held-out splits, metrics, the evaluation's split over ranks, the
learning-rate schedule and the checks that refuse a run before anything spawns."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

from testbed.checks import ConfigError
from testbed.config import validate
from testbed.data import build_heldout, data_kind
from testbed.data.kinds import tensors
from testbed.data.spec import DataSpec
from testbed.eval.evaluate import Target, slice_of
from testbed.eval.metrics import IGNORE, batch_sums, metrics_from
from testbed.eval.schedule import LrSchedule, schedule_of
from testbed.paths import config_dir

pytestmark = pytest.mark.unit


def composed(overrides: list[str]):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def row_hashes(x: torch.Tensor) -> set[str]:
    return {hashlib.sha256(r.contiguous().numpy().tobytes()).hexdigest() for r in x}


IN_MEMORY = {
    "synthetic": ["data=synthetic", "data.num_samples=256", "data.val_samples=128"],
    "lm": ["data=lm", "model=transformer", "data.num_samples=256", "data.val_samples=128", "data.seq_len=16"],
    "digits": ["data=digits"],
    "mnist1d": ["data=mnist1d", "data.num_samples=500"],
}


@pytest.mark.parametrize("kind", list(IN_MEMORY))
def test_in_memory_heldout_is_disjoint_and_deterministic(kind: str) -> None:
    cfg = composed(IN_MEMORY[kind])
    x, y, hx, hy = tensors(cfg.data, seed=3)
    assert len(hx) > 0 and len(hx) == len(hy)
    assert not row_hashes(x) & row_hashes(hx), "a held-out sample is also a training sample"
    from testbed.data import kinds

    kinds._tensors.cache_clear()  # made again from nothing: the same split
    again = tensors(cfg.data, seed=3)
    assert all(torch.equal(a, b) for a, b in zip((x, y, hx, hy), again))
    held = build_heldout(cfg.data, seed=3)
    assert len(held) == len(hx) and torch.equal(held.take(range(2, 5))[0], hx[2:5])
    assert data_kind(cfg.data.name).train_size(cfg.data) == len(x)


def test_digits_holds_out_a_fifth_of_every_class() -> None:
    _, y, _, hy = tensors(composed(["data=digits"]).data, seed=0)
    for label in range(10):
        share = (hy == label).sum().item() / ((y == label).sum().item() + (hy == label).sum().item())
        assert share == pytest.approx(0.2, abs=0.01)


def test_mnist1d_is_the_papers_split_and_leaves_the_global_generators_alone() -> None:
    import random

    import numpy as np

    np.random.seed(7)
    random.seed(7)
    before = np.random.random(), random.random()
    np.random.seed(7)
    random.seed(7)
    x, y, hx, _ = tensors(composed(["data=mnist1d"]).data, seed=0)
    assert (np.random.random(), random.random()) == before
    assert x.shape == (4000, 1, 40) and hx.shape == (1000, 1, 40)
    assert sorted(y.unique().tolist()) == list(range(10))


def test_file_kinds_read_their_own_heldout(tmp_path: Path) -> None:
    for split, classes in (("train", ["cat", "dog"]), ("val", ["cat", "dog"]), ("odd", ["cat", "eel"])):
        for name in classes:
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (10, 8)).save(tmp_path / split / name / "0.png")
    ok = composed(["data=image_folder", f"data.root={tmp_path / 'train'}", f"data.val_root={tmp_path / 'val'}",
                   "data.image_size=8", "target.metric=accuracy", "target.value=0.5"])
    validate(ok)
    assert len(build_heldout(ok.data, 0)) == 2
    bad = composed(["data=image_folder", f"data.root={tmp_path / 'train'}", f"data.val_root={tmp_path / 'odd'}",
                    "data.image_size=8"])
    with pytest.raises(ConfigError, match="data.val_root=.*its classes differ from data.root's"):
        validate(bad)
    (tmp_path / "train.bin").write_bytes(bytes(400))
    (tmp_path / "val.bin").write_bytes(bytes(200))
    tokens = composed(["data=tokens", "model=transformer", f"data.path={tmp_path / 'train.bin'}",
                       f"data.val_path={tmp_path / 'val.bin'}", "data.vocab_size=256", "data.seq_len=16"])
    validate(tokens)
    held = build_heldout(tokens.data, 0)
    assert len(held) == (100 - 1) // 16 and held.take(range(0, 2))[0].shape == (2, 16)


REFUSED = {
    "a target on data without a held-out split": (
        ["data=synthetic_images", "data.image_size=8", "model=cnn", "target.metric=accuracy", "target.value=0.5"],
        "target.metric=accuracy: data=synthetic_images: its one random batch has no held-out split"),
    "a target on files without their held-out split": (
        ["data=image_folder", "data.root=IMAGES", "data.image_size=8", "target.metric=accuracy", "target.value=0.5"],
        "data=image_folder without data.val_root: set data.val_root"),
    "eval.every < 0": (["eval.every=-1"], "eval.every=-1: steps between evaluations, must be >= 0"),
    "a warmup longer than the run": (["steps=10", "optim.warmup_steps=20"],
                                     "a warmup of 20 steps is longer than the run (steps=10)"),
    "warmup epochs longer than the run": (["steps=10", "data.num_samples=320", "optim.warmup_epochs=2"],
                                          "optim.warmup_epochs: a warmup of 20 steps is longer than the run"),
    "top-5 of five classes": (["data.num_classes=5", "target.metric=top5", "target.value=0.9"],
                              "target.metric=top5: this model and data measure loss|accuracy"),
    "an accuracy above 1": (["target.metric=accuracy", "target.value=90"], "target.value=90.0: an accuracy is a fraction"),
    "a target without a value": (["target.metric=loss"], "target.metric=loss needs target.value"),
    "a scaling rule": (["optim.lr_scaling=square"], "optim.lr_scaling=square: allowed: none|linear|sqrt"),
    "milestones out of order": (["optim.schedule=step", "optim.milestones=[30,10]"], "optim.milestones=[30, 10]"),
    "compressed pulls evaluated during the run": (
        ["sync=ps", "compress=fp16", "compress.pull=true", "eval.every=5"],
        "eval.every=5 with sync=ps and compress.pull"),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_bad_eval_and_schedule_settings_are_refused(case: str, tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    Image.new("RGB", (10, 8)).save(tmp_path / "cat" / "0.png")
    args, expected = REFUSED[case]
    with pytest.raises(ConfigError) as info:
        validate(composed([a.replace("IMAGES", str(tmp_path)) for a in args]))
    assert expected in str(info.value)


def test_slices_cover_the_split_once_for_any_world() -> None:
    for total in (0, 1, 7, 1000):
        for n in range(1, 6):
            covered = [i for r in range(n) for i in slice_of(total, r, n)]
            assert covered == list(range(total))


def test_metrics_by_hand_and_added_over_slices() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0], [0.0, 3.0, 0.0, 0.0, 0.0, 0.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 5.0]])
    targets = torch.tensor([0, 2, 4])
    spec = DataSpec("classification", (6,), num_classes=6)
    whole = metrics_from(batch_sums(logits, targets), spec)
    ce = torch.nn.functional.cross_entropy(logits, targets).item()
    assert whole["loss"] == pytest.approx(ce) and whole["accuracy"] == pytest.approx(1 / 3)
    assert whole["top5"] == pytest.approx(2 / 3)  # sample 2's class 4 ranks sixth... of six: last
    parts = batch_sums(logits[:1], targets[:1]) + batch_sums(logits[1:], targets[1:])
    assert metrics_from(parts, spec) == pytest.approx(whole)
    lm = DataSpec("lm", (2,), vocab_size=6, seq_len=2)
    tokens = metrics_from(batch_sums(logits.view(1, 3, 6), torch.tensor([[0, IGNORE, 4]])), lm)
    assert tokens["tokens"] == 2 and tokens["accuracy"] == pytest.approx(0.5)
    assert tokens["perplexity"] == pytest.approx(math.exp(tokens["loss"]))


def test_targets_know_which_way_is_better() -> None:
    acc = Target(composed(["target.metric=accuracy", "target.value=0.9"]).target)
    loss = Target(composed(["target.metric=loss", "target.value=0.5"]).target)
    assert acc.met({"accuracy": 0.9}) and not acc.met({"accuracy": 0.89})
    assert loss.met({"loss": 0.5}) and not loss.met({"loss": 0.51})
    assert not Target(composed([]).target).met({"accuracy": 1.0})


def test_linear_scaling_with_warmup_by_hand() -> None:
    # Weak scaling, 4 workers x 32: k = 128 / 32 = 4, so the peak is 0.4; warmup climbs from 0.1.
    cfg = composed(["world_size=4", "optim.lr=0.1", "optim.lr_scaling=linear", "optim.warmup_steps=4", "steps=20"])
    s = schedule_of(cfg, train_size=None)
    assert [s.lr_at(i) for i in range(6)] == pytest.approx([0.175, 0.25, 0.325, 0.4, 0.4, 0.4])
    sqrt = schedule_of(composed(["world_size=4", "optim.lr=0.1", "optim.lr_scaling=sqrt", "steps=20"]), None)
    assert sqrt.lr_at(0) == pytest.approx(0.2)
    base = schedule_of(composed(["world_size=4", "optim.lr=0.1", "optim.lr_scaling=linear", "optim.base_batch=256"]), None)
    assert base.lr_at(0) == pytest.approx(0.05)


def test_cosine_and_step_decay_by_hand() -> None:
    cfg = composed(["optim.lr=1.0", "optim.schedule=cosine", "optim.warmup_steps=2", "steps=12", "optim.min_lr=0.1"])
    s = schedule_of(cfg, None)
    assert s.lr_at(0) == pytest.approx(0.5) and s.lr_at(1) == pytest.approx(1.0)  # warmup from 0 without scaling
    assert s.lr_at(2) == pytest.approx(1.0) and s.lr_at(11) == pytest.approx(0.1)
    assert s.lr_at(2 + 9 // 2) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    step = schedule_of(composed(["optim.lr=1.0", "optim.schedule=step", "optim.milestones=[3,6]", "steps=10"]), None)
    assert [step.lr_at(i) for i in (0, 2, 3, 5, 6, 9)] == pytest.approx([1, 1, 0.1, 0.1, 0.01, 0.01])


def test_warmup_epochs_count_the_training_data() -> None:
    # 4096 samples in batches of 2 x 32: 64 steps an epoch; half an epoch is 32 steps.
    cfg = composed(["world_size=2", "optim.warmup_epochs=0.5", "steps=100"])
    assert schedule_of(cfg, data_kind("synthetic").train_size(cfg.data)).warmup == 32


def test_a_server_reads_the_schedule_it_is_handed() -> None:
    s = LrSchedule(peak=0.4, start=0.1, warmup=4, total=20, kind="cosine")
    assert LrSchedule.of_optim({"lr": 9.0, "lr_schedule": s.as_dict()}) == s
    assert LrSchedule.of_optim({"lr": 0.3}).lr_at(17) == 0.3


def test_interval_verdicts_and_mlperf_score_by_hand() -> None:
    from analysis.stats import interval, mlperf_score, point, verdicts

    lo, hi = interval([1.0, 2.0, 3.0])  # mean 2, s = 1, t(0.975, 2) = 4.303
    assert (lo, hi) == pytest.approx((2 - 4.3027 / math.sqrt(3), 2 + 4.3027 / math.sqrt(3)), rel=1e-4)
    assert all(math.isnan(v) for v in interval([5.0]))
    fast, close, slow = point([10.0, 10.5, 11.0]), point([10.8, 11.0, 11.2]), point([20.0, 20.5, 21.0])
    assert verdicts([close, fast, slow], higher_is_better=False) == ["tie", "best", ""]
    assert verdicts([close, fast, slow], higher_is_better=True) == ["", "", "best"]
    assert verdicts([point([1.0]), point([2.0])], higher_is_better=True) == ["tie", "best"]  # one run each: no finding
    assert mlperf_score([5.0, 1.0, 3.0, 4.0, 100.0]) == pytest.approx(4.0)  # 1 and 100 dropped
    assert mlperf_score([1.0, 2.0, float("nan")]) == pytest.approx(2.0)  # the unreached run is the slowest
    assert math.isnan(mlperf_score([1.0, float("nan"), float("nan")])) and math.isnan(mlperf_score([1.0, 2.0]))


def test_one_worker_that_moves_nothing_is_one_point_for_every_synchronizer() -> None:
    import pandas as pd

    from analysis.metrics import aggregate

    rows = []
    for option, n, throughput, sent in [("allreduce", 1, 100.0, 0), ("ring", 1, 160.0, 0), ("tree", 1, 130.0, 0),
                                        ("ps", 1, 60.0, 4096), ("allreduce", 2, 150.0, 4096), ("ring", 2, 170.0, 4096)]:
        rows.append({"status": "ok", "option": option, "world_size": n, "throughput": throughput, "bytes_per_step": sent,
                     "config_key": f"sync={option}", "setting_key": "", "setting": "", "step_time": 1 / throughput,
                     "imbalance": 0.0, "idle_fraction": 0.0})
    table = aggregate(pd.DataFrame(rows)).set_index(["option", "world_size"])
    pooled = [table.loc[(o, 1), "throughput"] for o in ("allreduce", "ring", "tree")]
    assert pooled == pytest.approx([130.0] * 3) and table.loc[("allreduce", 1), "repeats"] == 3
    assert table.loc[("ps", 1), "throughput"] == 60.0  # its round trip makes it another computation
    assert table.loc[("ring", 2), "speedup"] == pytest.approx(170 / 130)
