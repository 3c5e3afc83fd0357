"""Data shards concatenate to the global batch; models take their data; sizes span 100 KB..100 MB."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from testbed.data import RankBatches, build_data
from testbed.models import build_model, gradient_bytes

pytestmark = pytest.mark.unit


def data_cfg(**kw):
    base = {"name": "synthetic", "num_samples": 50, "shape": [3, 4, 4], "num_classes": 5, "vocab_size": 16, "seq_len": 6}
    return OmegaConf.create({**base, **kw})


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rank_batches_concatenate_to_the_single_process_batch(n: int) -> None:
    x = torch.arange(23).float().unsqueeze(1)
    y = torch.arange(23)
    single = RankBatches(x, y, [5 * n], rank=0, seed=3)
    shards = [RankBatches(x, y, [5] * n, rank=r, seed=3) for r in range(n)]
    for step in range(12):  # several epochs: 23 samples, 5n per step
        assert torch.equal(torch.cat([s.indices(step) for s in shards]), single.indices(step))


def test_a_global_batch_that_changes_goes_on_through_the_order_and_a_rollback_redoes_its_segment() -> None:
    """elastic.batch=keep_local: 4 workers of 3 samples, 3 from batch 5 on (one lost), 4 again from
    batch 9; the 3 were rolled back to batch 7 first. Every batch continues the one sample order
    where the last left it, so the run's batches are that order, without a sample twice or left out."""
    x, y = torch.arange(23).float().unsqueeze(1), torch.arange(23)
    order = RankBatches(x, y, [1], rank=0, seed=3)
    stream = torch.cat([order.indices(i) for i in range(3 * 4 * 12)])  # the sample order, position by position
    workers = [RankBatches(x, y, [3] * 4, rank=r, seed=3) for r in range(4)]
    taken = []

    def run(batches: range, members: list[int]) -> None:
        for i in batches:
            taken.extend(torch.cat([workers[w].indices(i) for w in members]).tolist())

    run(range(5), [0, 1, 2, 3])
    for rank, w in enumerate((0, 1, 3)):
        workers[w].rebatch(5, [3] * 3, rank)
    run(range(5, 8), [0, 1, 3])
    for rank, w in enumerate((0, 1, 3)):  # rolled back to the commit after batch 6: batch 7 again
        workers[w].rebatch(7, [3] * 3, rank)
    del taken[-9:]
    run(range(7, 9), [0, 1, 3])
    workers[2].segments = workers[0].segments  # a newcomer takes the order's segments so far
    for w in range(4):
        workers[w].rebatch(9, [3] * 4, w)
    run(range(9, 12), [0, 1, 2, 3])
    assert taken == stream[: 5 * 12 + 4 * 9 + 3 * 12].tolist()


def test_every_epoch_is_a_permutation() -> None:
    stream = RankBatches(torch.zeros(10, 1), torch.zeros(10), [5], rank=0, seed=0)
    first_epoch = torch.cat([stream.indices(0), stream.indices(1)])
    assert sorted(first_epoch.tolist()) == list(range(10))
    assert not torch.equal(first_epoch, torch.cat([stream.indices(2), stream.indices(3)]))


@pytest.mark.parametrize("name", ["synthetic", "lm", "digits"])
def test_datasets_are_deterministic(name: str) -> None:
    cfg = data_cfg(name=name)
    (_, a), (_, b) = build_data(cfg, [4], 0, seed=1), build_data(cfg, [4], 0, seed=1)
    for step in range(3):
        assert all(torch.equal(u, v) for u, v in zip(a.batch(step), b.batch(step)))


def test_mnist1d_is_generated_once_and_kept_whole(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from testbed.data import datasets

    monkeypatch.setenv("TESTBED_DATA_CACHE", str(tmp_path))
    generated = datasets.mnist1d(200)
    [kept] = tmp_path.glob("mnist1d-200-*.pt")  # one file, no temporary left behind
    assert not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(datasets, "_generate_mnist1d", None)  # a second call must not generate
    loaded = datasets.mnist1d(200)
    assert len(loaded) == 4 and all(torch.equal(a, b) for a, b in zip(generated, loaded))
    assert generated[0].shape == (160, 1, 40) and generated[2].shape == (40, 1, 40)  # the package's 80/20 split


def test_digits_is_the_real_data_set() -> None:
    spec, batches = build_data(data_cfg(name="digits"), [8], 0, seed=0)
    # 1797 real digits, a stratified fifth of each class held out (testbed.data.datasets)
    assert batches.inputs.shape == (1433, 1, 8, 8) and spec.num_classes == 10
    assert 0.0 <= float(batches.inputs.min()) and float(batches.inputs.max()) <= 1.0


@pytest.mark.parametrize(
    "model,data",
    [
        ({"name": "mlp", "hidden": 8, "depth": 2}, {"name": "synthetic"}),
        ({"name": "cnn", "width": 4, "blocks": [1, 1]}, {"name": "synthetic"}),
        ({"name": "cnn", "width": 4, "blocks": [1, 1, 1]}, {"name": "digits"}),
        ({"name": "transformer", "d_model": 8, "n_layer": 1, "n_head": 2}, {"name": "lm"}),
    ],
)
def test_models_produce_logits_for_their_data(model: dict, data: dict) -> None:
    spec, batches = build_data(data_cfg(**data), [4], 0, seed=0)
    net = build_model(OmegaConf.create(model), spec)
    x, y = batches.batch(0)
    out = net(x)
    classes = spec.vocab_size if spec.kind == "lm" else spec.num_classes
    assert out.shape == (*y.shape, classes)


def test_gradient_size_spans_the_sweep_range() -> None:
    spec, _ = build_data(data_cfg(shape=[3, 16, 16], num_samples=1), [1], 0, seed=0)
    with torch.device("meta"):  # sizes only; nothing allocated
        small = build_model(OmegaConf.create({"name": "mlp", "hidden": 32, "depth": 1}), spec)
        large = build_model(OmegaConf.create({"name": "mlp", "hidden": 4096, "depth": 6}), spec)
    assert gradient_bytes(small) < 150_000
    assert gradient_bytes(large) > 100_000_000
