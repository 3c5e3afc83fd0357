"""The input pipeline: per-rank sampling in global-batch units, the batch stream, the data sets."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import TensorDataset

from testbed.data import RankBatches
from testbed.data.loader import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageFolder,
    LoaderBatches,
    RankSampler,
    SyntheticImageBatches,
    TokenFile,
)

pytestmark = pytest.mark.unit

UNEVEN = [3, 1, 2]


def rank_steps(num_samples: int, sizes: list[int], epoch: int = 0, seed: int = 7, **kw) -> list[list[list[int]]]:
    """``steps[t][r]``: the indices rank ``r`` draws at step ``t`` of ``epoch``."""
    per_rank = []
    for rank, size in enumerate(sizes):
        sampler = RankSampler(num_samples, sizes, rank, seed, **kw)
        sampler.set_epoch(epoch)
        flat = list(sampler)
        assert len(flat) == len(sampler) == sampler.steps_per_epoch * size
        per_rank.append([flat[i : i + size] for i in range(0, len(flat), size)])
    return [list(step) for step in zip(*per_rank)]


def epoch_order(num_samples: int, epoch: int = 0, seed: int = 7) -> list[int]:
    """The epoch's whole order: what one process drawing all samples in one batch sees."""
    return rank_steps(num_samples, [num_samples], epoch, seed)[0][0]


@pytest.mark.parametrize("sizes", [[2, 2, 2], UNEVEN])
def test_drop_last_sees_every_sample_once_per_epoch_when_the_global_batch_divides(sizes: list[int]) -> None:
    for epoch in (0, 1):
        steps = rank_steps(12, sizes, epoch)
        assert len(steps) == 2
        seen = [i for step in steps for batch in step for i in batch]
        assert sorted(seen) == list(range(12))


def test_drop_last_drops_only_the_tail() -> None:
    steps = rank_steps(14, UNEVEN)  # G = 6: two steps, two samples dropped
    seen = [i for step in steps for batch in step for i in batch]
    assert seen == epoch_order(14)[:12]


@pytest.mark.parametrize("num_samples", [14, 4])  # a partial last batch; a data set smaller than G
def test_without_drop_last_every_sample_is_seen_and_padding_wraps_to_the_epoch_start(num_samples: int) -> None:
    steps = rank_steps(num_samples, UNEVEN, drop_last=False)
    seen = [i for step in steps for batch in step for i in batch]
    assert len(steps) == -(-num_samples // 6) and len(seen) == 6 * len(steps)
    order = epoch_order(num_samples)
    assert seen == [order[p % num_samples] for p in range(len(seen))]
    assert set(seen) == set(range(num_samples))


@pytest.mark.parametrize("sizes", [[2, 2, 2], UNEVEN])
def test_the_ranks_of_a_step_concatenate_to_the_single_process_batch(sizes: list[int]) -> None:
    g = sum(sizes)
    single = rank_steps(20, [g], drop_last=False)
    parallel = rank_steps(20, sizes, drop_last=False)
    assert len(parallel) == len(single) == 4
    for t, step in enumerate(parallel):
        assert [i for batch in step for i in batch] == single[t][0]


def test_the_order_depends_on_epoch_and_seed_only() -> None:
    first = epoch_order(30, 0, seed=7)
    assert epoch_order(30, 0, seed=7) == first
    assert epoch_order(30, 1, seed=7) != first
    assert epoch_order(30, 0, seed=8) != first
    assert sorted(epoch_order(30, 1, seed=7)) == list(range(30))
    unshuffled = RankSampler(30, [30], 0, seed=7, shuffle=False)
    unshuffled.set_epoch(3)
    assert list(unshuffled) == list(range(30))


def test_start_step_skips_the_first_steps_of_the_epoch() -> None:
    sampler = RankSampler(24, [2, 2], 1, seed=7)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start_step=4)
    assert list(sampler) == full[8:] and len(sampler) == 4
    with pytest.raises(ValueError, match="start_step=6"):
        sampler.set_epoch(2, start_step=6)


def index_batches(sizes: list[int], rank: int, **kw) -> LoaderBatches:
    """A stream over a data set whose samples are their own indices."""
    return LoaderBatches(TensorDataset(torch.arange(10.0), torch.arange(10)), sizes, rank, seed=3, **kw)


def test_batches_continue_across_epochs_and_a_resume_draws_the_same_batches() -> None:
    stream = index_batches([2, 2], 1)  # G = 4 of 10 samples: two steps per epoch
    labels = [stream.batch(i)[1].tolist() for i in range(6)]
    assert stream.epoch == 2 and stream.epochs_started == 3
    for epoch in range(3):
        assert labels[2 * epoch : 2 * epoch + 2] == [step[1] for step in rank_steps(10, [2, 2], epoch, seed=3)]
    assert labels[0] != labels[2]  # a new epoch, a new order

    resumed = index_batches([2, 2], 1)
    assert [resumed.batch(i)[1].tolist() for i in range(3, 6)] == labels[3:]
    assert resumed.epochs_started == 2  # epoch 1 from its second step, then epoch 2

    with pytest.raises(ValueError, match="batch 7 asked for.*next is 6"):
        resumed.batch(7)
    with pytest.raises(ValueError, match="next is 6"):
        resumed.batch(5)
    resumed.close()
    resumed.close()


def test_with_whole_epochs_the_stream_equals_the_in_memory_batches() -> None:
    inputs, targets = torch.randn(12, 2), torch.arange(12)
    for rank in range(3):
        stream = LoaderBatches(TensorDataset(inputs, targets), UNEVEN, rank, seed=4)
        memory = RankBatches(inputs, targets, UNEVEN, rank, seed=4)
        for i in range(5):
            assert all(torch.equal(a, b) for a, b in zip(stream.batch(i), memory.batch(i)))


def test_the_inputs_belong_to_the_labels() -> None:
    inputs, labels = index_batches(UNEVEN, 0).batch(0)
    assert inputs.dtype == torch.float32 and labels.dtype == torch.int64 and labels.shape == (3,)
    assert torch.equal(inputs, labels.float())


def write_images(root: Path) -> dict[str, tuple[int, int, int]]:
    """Three classes of five solid 12 x 10 images (PNG and JPEG, mixed case), plus files to skip."""
    colors = {"cat": (255, 0, 0), "ant": (0, 128, 255), "bee": (40, 200, 90)}
    for name, color in colors.items():
        folder = root / name
        folder.mkdir(parents=True)
        for k, ext in enumerate([".png", ".PNG", ".jpg", ".JPEG", ".png"]):
            Image.new("RGB", (12, 10), color).save(folder / f"{k}{ext}")
        (folder / "notes.txt").write_text("not an image")
    (root / "README").write_text("not a class")
    return colors


def normalized(color: tuple[int, int, int]) -> torch.Tensor:
    return (torch.tensor(color) / 255 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)


def test_image_folder_decodes_normalized_squares_with_sorted_classes(tmp_path: Path) -> None:
    colors = write_images(tmp_path)
    data = ImageFolder(str(tmp_path), image_size=8)
    assert data.classes == ["ant", "bee", "cat"] and len(data) == 15
    assert [label for _, label in data.samples] == [0] * 5 + [1] * 5 + [2] * 5
    assert [Path(f).name for f, _ in data.samples[:5]] == ["0.png", "1.PNG", "2.jpg", "3.JPEG", "4.png"]
    for index in range(len(data)):
        image, label = data[index]
        assert image.shape == (3, 8, 8) and image.dtype == torch.float32
        expected = normalized(colors[data.classes[label]]).view(3, 1, 1).expand(3, 8, 8)
        lossy = Path(data.samples[index][0]).suffix.lower() != ".png"
        torch.testing.assert_close(image, expected, atol=0.06 if lossy else 1e-5, rtol=0)


def test_image_folder_center_crops_after_resizing_the_shorter_side(tmp_path: Path) -> None:
    (tmp_path / "only").mkdir()
    stripes = np.zeros((10, 20, 3), dtype=np.uint8)
    stripes[:, :5] = (255, 0, 0)
    stripes[:, 5:15] = (0, 255, 0)
    stripes[:, 15:] = (0, 0, 255)
    Image.fromarray(stripes).save(tmp_path / "only" / "wide.png")
    image, _ = ImageFolder(str(tmp_path), image_size=10)[0]
    # The shorter side is already 10: the crop keeps the middle half, all green; squashing would not.
    torch.testing.assert_close(image, normalized((0, 255, 0)).view(3, 1, 1).expand(3, 10, 10), atol=1e-5, rtol=0)


def test_workers_started_by_forkserver_yield_the_batches_of_the_main_process(tmp_path: Path) -> None:
    write_images(tmp_path)
    data = ImageFolder(str(tmp_path), image_size=8)  # 15 samples, G = 6: two steps per epoch
    inline = LoaderBatches(data, [2, 4], 1, seed=5)
    workers = LoaderBatches(data, [2, 4], 1, seed=5, num_workers=2, worker_start="forkserver")
    for i in range(5):  # across two epoch boundaries, the persistent workers kept
        expected, got = inline.batch(i), workers.batch(i)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert workers.epoch == 2 and workers.epochs_started == 3
    pids = [w.pid for w in workers.loader._iterator._workers]
    assert all(os.path.exists(f"/proc/{pid}") for pid in pids)
    workers.close()
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids), "close() shuts the workers down"
    workers.close()


def write_tokens(path: Path, tokens: np.ndarray) -> str:
    tokens.tofile(path)
    return str(path)


@pytest.mark.parametrize("dtype, base", [("uint16", 60_000), ("uint32", 100_000)])
def test_token_windows_are_shifted_by_one_and_cover_the_file(tmp_path: Path, dtype: str, base: int) -> None:
    tokens = np.arange(base, base + 301, dtype=dtype)  # values beyond int16 / uint16 catch a wrong dtype
    data = TokenFile(write_tokens(tmp_path / "train.bin", tokens), seq_len=16, dtype=dtype)
    assert len(data) == 18  # (301 - 1) // 16
    windows = [data[i] for i in range(len(data))]
    for x, y in windows:
        assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
        assert torch.equal(y[:-1], x[1:])
    assert torch.equal(torch.cat([x for x, _ in windows]), torch.from_numpy(tokens[: 18 * 16].astype(np.int64)))
    assert torch.equal(torch.cat([y for _, y in windows]), torch.from_numpy(tokens[1 : 18 * 16 + 1].astype(np.int64)))
    with pytest.raises(IndexError):
        data[18]


def test_a_token_file_pickles_without_its_tokens(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "train.bin", np.arange(20_000, dtype=np.uint16))
    data = TokenFile(path, seq_len=8)
    x, _ = data[3]  # maps the file
    blob = pickle.dumps(data)
    assert len(blob) < 1000  # the file is 40 kB
    assert torch.equal(pickle.loads(blob)[3][0], x)


@pytest.mark.parametrize("split", ["path", "val_path"])
def test_a_token_id_past_the_vocabulary_is_named_with_its_file_and_offset(tmp_path: Path, split: str) -> None:
    from hydra import compose, initialize_config_dir

    from testbed.checks import ConfigError
    from testbed.config import validate
    from testbed.paths import config_dir

    tokens = {key: np.arange(400, dtype=np.uint16) % 256 for key in ("path", "val_path")}
    tokens[split][333] = 300  # one id past a vocabulary of 256
    files = {key: write_tokens(tmp_path / f"{key}.bin", t) for key, t in tokens.items()}
    assert TokenFile(files[split], seq_len=16).first_beyond(256, chunk=100) == (333, 300)  # found across chunks
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "data=tokens", "model=transformer", "data.vocab_size=256", "data.seq_len=16",
            f"data.path={files['path']}", f"data.val_path={files['val_path']}"])
    with pytest.raises(ConfigError, match=rf"data\.{split}=.*{split}\.bin: token 300 at offset 333 .*data\.vocab_size=256"):
        validate(cfg)


def test_configuration_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data\.root=.*nowhere: no such directory"):
        ImageFolder(str(tmp_path / "nowhere"), 8)
    with pytest.raises(ValueError, match=r"data\.root=.*no class folders"):
        ImageFolder(str(tmp_path), 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"data\.root=.*'empty' has no"):
        ImageFolder(str(tmp_path), 8)

    with pytest.raises(ValueError, match=r"data\.path=.*missing\.bin: no such file"):
        TokenFile(str(tmp_path / "missing.bin"), 8)
    short = write_tokens(tmp_path / "short.bin", np.arange(8, dtype=np.uint16))
    with pytest.raises(ValueError, match=r"data\.path=.*8 tokens.*data\.seq_len=8"):
        TokenFile(short, 8)
    odd = write_tokens(tmp_path / "odd.bin", np.arange(7, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"data\.dtype=uint16"):
        TokenFile(odd, 2)

    message = "data: 10 samples cannot fill one global batch of 12; lower data.batch_size or set data.drop_last=false"
    with pytest.raises(ValueError, match=message):
        RankSampler(10, [4, 4, 4], 0, seed=0)
    assert RankSampler(10, [4, 4, 4], 0, seed=0, drop_last=False).steps_per_epoch == 1


def test_synthetic_batches_repeat_one_batch_per_rank() -> None:
    cpu = torch.device("cpu")
    rank0 = SyntheticImageBatches((3, 4, 4), num_classes=5, batch=6, rank=0, seed=1, device=cpu)
    images, labels = rank0.batch(0)
    assert images.shape == (6, 3, 4, 4) and labels.shape == (6,)
    assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() < 5
    again = rank0.batch(9)
    assert again[0] is images and again[1] is labels  # no work per step
    same = SyntheticImageBatches((3, 4, 4), num_classes=5, batch=6, rank=0, seed=1, device=cpu).batch(0)
    assert torch.equal(same[0], images) and torch.equal(same[1], labels)
    rank1 = SyntheticImageBatches((3, 4, 4), num_classes=5, batch=6, rank=1, seed=1, device=cpu).batch(0)
    assert not torch.equal(rank1[0], images)
