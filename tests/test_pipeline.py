"""Real workloads end to end: file data through the DataLoader, any model by import path, and what a
measured run refuses (simulator-only models, bad targets) before it spawns anything."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, load_params, read_json, read_jsonl, relative_error, run_cli
from hydra import compose, initialize_config_dir
from PIL import Image

from testbed.config import ConfigError, validate
from testbed.paths import config_dir

TINY_CNN = ["model=cnn", "model.width=4", "model.blocks=[1]"]


def image_folder(root: Path, classes: int = 3, per_class: int = 8) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (14, 18, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"class{c}" / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


def test_image_folder_with_loader_workers_and_a_parameter_server(tmp_path: Path) -> None:
    """Two workers per rank decode the images while gRPC channels are open (they start from a
    forkserver, never a fork), and deliver exactly the batches the rank's own process would."""
    root = image_folder(tmp_path / "images")
    common = [*TINY_CNN, "data=image_folder", f"data.root={root}", "data.image_size=12", "data.batch_size=4",
              "sync=ps", "world_size=2", "steps=7", "warmup_steps=1", "launcher.echo_rank0=false"]
    jobs = {}
    for workers in (0, 2):
        jobs[workers] = tmp_path / f"w{workers}"
        proc = run_cli([*common, f"data.num_workers={workers}", f"hydra.run.dir={jobs[workers]}"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with_workers, without = (read_json(jobs[w] / "summary.json") for w in (2, 0))
    assert with_workers["status"] == "ok" and with_workers["replicas_identical"]
    # 24 images, a global batch of 8: 3 steps an epoch, so 7 steps begin a third epoch.
    assert with_workers["data"] == {"samples": 24, "steps_per_epoch": 3, "epochs": 3, "num_workers": 2}
    assert with_workers["param_hash"] == without["param_hash"]  # the same batches, bitwise
    assert with_workers["throughput_unit"] == "images/s"
    steps = read_jsonl(jobs[2] / "metrics" / "rank0.jsonl")
    assert all(r["t_data"] > 0 for r in steps)


def test_token_file_trains_like_one_process(tmp_path: Path) -> None:
    """data=tokens: windows of a memory-mapped uint16 file, split over ranks, train the model one
    process trains on the concatenated batches."""
    path = tmp_path / "train.bin"
    np.random.default_rng(0).integers(0, 50, 40 * 16 + 1, dtype=np.uint16).tofile(path)
    common = ["model=transformer", "model.d_model=16", "model.n_head=2", "model.n_layer=1", "data=tokens",
              f"data.path={path}", "data.vocab_size=50", "data.seq_len=16", "data.scaling=strong", "data.batch_size=12",
              "steps=5", "warmup_steps=1", "launcher.echo_rank0=false"]
    for n in (1, 3):
        proc = run_cli([*common, f"world_size={n}", f"hydra.run.dir={tmp_path / str(n)}"], cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout.splitlines()[-3]  # the comparison table shows the field's unit
    parallel = read_json(tmp_path / "3" / "summary.json")
    assert parallel["replicas_identical"] and parallel["data"]["steps_per_epoch"] == 3  # 40 windows, 12 a step
    assert parallel["throughput_items"] == pytest.approx(16 * parallel["throughput"])
    assert relative_error(load_params(tmp_path / "3"), load_params(tmp_path / "1")) <= 1e-5


def test_custom_model_by_import_path(tmp_path: Path) -> None:
    """model=custom builds a test module's class by import path, with keyword arguments, on every rank."""
    proc = run_cli(["model=custom", "model.target=custom_models.TwoLayer", "+model.kwargs.hidden=12",
                    "+model.kwargs.in_features=768", "world_size=2", "steps=3", "warmup_steps=1",
                    f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path,
                   env={"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])})  # this checkout's testbed too
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_json(tmp_path / "job" / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"]
    assert set(load_params(tmp_path / "job")) == {"first.weight", "first.bias", "second.weight", "second.bias"}
    assert summary["gradient_bytes"] == 4 * (768 * 12 + 12 + 12 * 10 + 10)


@pytest.mark.parametrize(
    "args,message",
    [
        (["model=custom", "model.target=torch.nn.NoSuchLayer"],
         "config error: model.target=torch.nn.NoSuchLayer: Error locating target 'torch.nn.NoSuchLayer'"),
        (["model=custom", "model.target=torch.nn.Linear", "+model.kwargs.in_features=5", "+model.kwargs.out_features=10"],
         "config error: model=custom cannot read this data (input shape [3, 16, 16])"),
        (["+paper_model=inception_v3"], "config error: sim.gradient_mb=90.99 stands for a model the testbed does not build"),
    ],
    ids=["missing-target", "does-not-fit", "simulator-only"],
)
def test_refused_before_spawning(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run_cli([*args, f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr[-2000:]
    assert not (tmp_path / "job").exists()  # nothing ran, not even the Hydra job


def test_paper_models_select_the_real_model() -> None:
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+paper_model=vgg16"])
        assert (cfg.model.name, cfg.data.name, cfg.data.image_size) == ("vgg16", "synthetic_images", 224)
        assert cfg.sim.gradient_mb is None  # the simulator sizes the built model too
        validate(cfg)
        custom = compose(config_name="config", overrides=["model=custom"])
    with pytest.raises(ConfigError, match=r"model=custom needs model.target="):
        validate(custom)
