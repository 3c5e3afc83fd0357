"""model=custom beyond a module that returns logits: lazy modules, and models that compute their
own loss (nanoGPT's (logits, loss), Hugging Face's output with .loss and .logits), trained through
the real trainer and evaluated on the held-out split; bad combinations refused before spawning."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
from conftest import REPO, load_params, read_json, read_jsonl, relative_error, run_cli
from hydra import compose, initialize_config_dir

from testbed.config import ConfigError, validate
from testbed.paths import config_dir

ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}  # this checkout's testbed, and the models
NANOGPT = ["model=custom", "model.target=custom_models.GPT", "data=lm", "data.vocab_size=64", "data.seq_len=16",
           "+model.kwargs.config={_target_:custom_models.GPTConfig,vocab_size:64,block_size:16,n_embd:16}"]
OWN_LOSS = {
    "nanogpt": [*NANOGPT, "model.loss=model", "model.loss_from=1", "model.logits_from=0"],
    "nanogpt_loss_only": [*NANOGPT, "model.loss=model", "model.loss_from=1"],
    "huggingface": ["model=custom", "model.target=custom_models.LabelledClassifier", "+model.kwargs.in_features=64",
                    "data=digits", "model.loss=model", "model.loss_from=loss", "model.logits_from=logits",
                    "model.targets_as=labels"],
}
# A global batch of 32 split alike at 1 and 2 ranks: the same training, to rounding.
RUN = ["data.scaling=strong", "data.batch_size=32", "steps=4", "warmup_steps=1", "eval.samples=64",
       "launcher.echo_rank0=false"]


def train(tmp_path: Path, name: str, args: list[str]) -> Path:
    job = tmp_path / name
    proc = run_cli([*args, f"hydra.{'sweep' if '-m' in args else 'run'}.dir={job}"], cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return job


@pytest.mark.parametrize("model", ["nanogpt", "huggingface"])
def test_a_model_that_computes_its_own_loss_trains_alike_on_one_and_two_ranks(tmp_path: Path, model: str) -> None:
    sweep = train(tmp_path, "sweep", ["-m", *OWN_LOSS[model], *RUN, "world_size=1,2", "sync=allreduce"])
    jobs = {read_json(p)["world_size"]: p.parent for p in sweep.glob("*/summary.json")}
    summary = read_json(jobs[2] / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"]
    assert relative_error(load_params(jobs[2]), load_params(jobs[1])) <= 1e-5
    assert len(read_jsonl(jobs[2] / "metrics" / "rank0.jsonl")) == 4
    # Evaluated on the logits it returns (split over the ranks, to rounding the same).
    final, alone = summary["eval"]["final"], read_json(jobs[1] / "summary.json")["eval"]["final"]
    measured = ("loss", "accuracy", "perplexity") if model == "nanogpt" else ("loss", "accuracy", "top5")
    assert [final[k] for k in measured] == pytest.approx([alone[k] for k in measured], rel=1e-5)


def test_a_model_that_returns_no_logits_is_evaluated_by_its_loss(tmp_path: Path) -> None:
    summary = read_json(train(tmp_path, "job", [*OWN_LOSS["nanogpt_loss_only"], *RUN, "world_size=2"]) / "summary.json")
    final = summary["eval"]["final"]
    assert summary["status"] == "ok" and "accuracy" not in final and summary["eval"]["best_by"] == "loss"
    assert final["perplexity"] == pytest.approx(math.exp(final["loss"]))


def test_lazy_modules_are_materialized_before_the_replicas_are_shared(tmp_path: Path) -> None:
    job = train(tmp_path, "job", ["model=custom", "model.target=custom_models.LazyTwoLayer", "+model.kwargs.hidden=12",
                                  "data=digits", "world_size=2", "sync=ddp", "steps=3", "warmup_steps=1",
                                  "eval.at_end=false", "launcher.echo_rank0=false"])
    summary = read_json(job / "summary.json")
    assert summary["status"] == "ok" and summary["replicas_identical"]
    assert summary["gradient_bytes"] == 4 * (64 * 12 + 12 + 12 * 10 + 10)  # the input size, from the data


@pytest.mark.parametrize(
    "overrides,message",
    [
        (NANOGPT, r"model=custom returns tuple for a batch of 2 with input shape \[16\]; the data needs logits "
                  r"\(batch, seq_len, vocab_size\) = \(2, 16, 64\); a model that computes its own loss: model.loss=model"),
        ([*NANOGPT, "model.loss=model"], r"model.loss=model needs model.loss_from=<tuple index \| attribute \| dict key>"),
        ([*NANOGPT, "model.loss_from=1"], r"model.loss_from=1 is for a model that computes its own loss: add model.loss=model"),
        ([*NANOGPT, "model.loss=own"], r"model.loss=own: allowed: data\|model"),
        ([*NANOGPT, "model.loss=model", "model.loss_from=2"],
         r"model.loss_from=2: the model returns a tuple of 2; give an index in \[0, 2\)"),
        ([*NANOGPT, "model.loss=model", "model.loss_from=0"],
         r"model.loss_from=0: the model returns shape \(2, 16, 64\) there; the loss must be a scalar tensor"),
        ([*NANOGPT, "model.loss=model", "model.loss_from=1", "model.logits_from=1"],
         r"model.logits_from=1: the model returns \(\) for a batch of 2"),
        ([*NANOGPT, "model.loss=model", "model.loss_from=1", "model.targets_as=a-b"],
         r"model.targets_as=a-b: positional \(the second argument\), or a keyword name"),
        ([*OWN_LOSS["huggingface"][:-1], "model.targets_as=labels", "model.loss_from=losses"],
         r"model.loss_from=losses: the model returns a SequenceClassifierOutput without it"),
        ([*OWN_LOSS["nanogpt_loss_only"], "target.metric=accuracy", "target.value=0.5"],
         r"target.metric=accuracy: this model and data measure loss\|perplexity"),
    ],
    ids=["tuple-without-loss-model", "no-loss-from", "loss-from-without-loss-model", "unknown-loss", "index-out-of-range",
         "loss-not-scalar", "logits-wrong-shape", "bad-keyword", "no-such-attribute", "accuracy-without-logits"],
)
def test_bad_combinations_are_refused_before_spawning(overrides: list[str], message: str) -> None:
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
