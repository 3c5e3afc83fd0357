"""GPT-2 and BERT from Hugging Face transformers' own model classes, randomly initialised.

The field's reference implementations, built from their config classes (no hub access, no
weights): at the defaults GPT-2 small (``GPT2LMHeadModel``, tied embeddings, 124,439,808
parameters at vocabulary 50257) and BERT-base with its masked-LM head (``BertForMaskedLM``: the
encoder without the pooler, 109,514,298 parameters at vocabulary 30522; the encoder with the pooler
is the 109,482,240 usually quoted). transformers is imported only when one of them is built: it
costs seconds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from testbed.checks import require
from testbed.data.spec import DataSpec

POSITIONAL = (".position_embeddings.", ".wpe.", ".pos.")  # BERT's, GPT-2's and the small transformer's
IGNORE = -100  # cross-entropy's ignore_index: the unmasked positions of a masked-LM batch


class Logits(nn.Module):
    """A transformers model as a plain module: token ids in, logits (batch, seq, vocab) out."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def _hf_config(cfg: Any, spec: DataSpec, kind: str) -> Any:
    from transformers import BertConfig, GPT2Config

    last = spec.vocab_size - 1  # special tokens inside the vocabulary (small test vocabularies too)
    if kind == "gpt2":
        return GPT2Config(
            vocab_size=spec.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.d_model, n_layer=cfg.n_layer,
            n_head=cfg.n_head, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            bos_token_id=last, eos_token_id=last,
        )
    return BertConfig(
        vocab_size=spec.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, intermediate_size=4 * cfg.d_model, max_position_embeddings=cfg.n_positions,
        hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout, pad_token_id=0,
    )


def build_gpt2(cfg: Any, spec: DataSpec) -> nn.Module:
    from transformers import GPT2LMHeadModel

    return Logits(GPT2LMHeadModel(_hf_config(cfg, spec, "gpt2")))


def build_bert(cfg: Any, spec: DataSpec) -> nn.Module:
    from transformers import BertForMaskedLM

    return Logits(BertForMaskedLM(_hf_config(cfg, spec, "bert")))


def flops_per_token(cfg: Any, model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 N for the weights' forward and backward, N without the position
    embeddings (they are a lookup), plus attention's 12 L d T (PaLM's appendix B; nanoGPT's MFU)."""
    positions = sum(p.numel() for name, p in model.named_parameters() if any(k in f".{name}" for k in POSITIONAL))
    n = sum(p.numel() for p in model.parameters()) - positions
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.d_model * seq_len


class MaskedTokens:
    """BERT's masked-LM objective over a token batch stream.

    Of each sequence, ``mask_prob`` of the positions are chosen; of those 80 % become the mask
    token, 10 % a random token, 10 % stay; the target is the original token there and ignored
    elsewhere. The draws come from a generator seeded by (seed, rank, batch), so a run is
    reproducible and resumes with the same masks.
    """

    def __init__(self, batches: Any, cfg: Any, vocab_size: int, seed: int, rank: int) -> None:
        self.batches, self.vocab_size, self.seed, self.rank = batches, vocab_size, seed, rank
        self.prob, self.mask_token = float(cfg.mask_prob), int(cfg.mask_token)

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _ = self.batches.batch(i)  # the next-token targets are not this objective's
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.rank) * 1_000_003 + i)
        return self.mask(tokens, gen)

    def mask(self, tokens: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs with the chosen positions masked, and targets only there."""
        draw = torch.rand(tokens.shape, generator=gen).to(tokens.device)
        chosen = draw < self.prob
        inputs = tokens.clone()
        inputs[draw < 0.8 * self.prob] = self.mask_token
        randomised = (draw >= 0.8 * self.prob) & (draw < 0.9 * self.prob)
        inputs[randomised] = torch.randint(0, self.vocab_size, tokens.shape, generator=gen).to(tokens.device)[randomised]
        return inputs, torch.where(chosen, tokens, torch.full_like(tokens, IGNORE))


class MaskedHeldOut:
    """BERT's held-out split: each sequence masked by a generator seeded by its position alone, so
    the masks do not depend on how many ranks share the evaluation."""

    def __init__(self, heldout: Any, cfg: Any, vocab_size: int, seed: int) -> None:
        self.heldout, self.seed = heldout, seed
        self.masker = MaskedTokens(None, cfg, vocab_size, seed, rank=0)

    def __len__(self) -> int:
        return len(self.heldout)

    def take(self, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, _ = self.heldout.take(positions)
        masked = [self.masker.mask(row[None], torch.Generator().manual_seed(self.seed * 1_000_003 + p))
                  for row, p in zip(tokens, positions)]
        return torch.cat([m[0] for m in masked]), torch.cat([m[1] for m in masked])

    def describe(self) -> dict[str, Any]:
        return {**self.batches.describe(), "mask_prob": self.prob}

    def close(self) -> None:
        self.batches.close()


def check_language(cfg: Any) -> None:
    """A language model's fields against the data's sequences (``cfg``: the whole config)."""
    require(cfg.data.seq_len <= cfg.model.get("n_positions", cfg.data.seq_len),
            f"data.seq_len={cfg.data.seq_len} exceeds model.n_positions={cfg.model.get('n_positions')}; "
            "lower data.seq_len or raise model.n_positions")
    require(cfg.model.d_model % cfg.model.n_head == 0,
            f"model.d_model={cfg.model.d_model} does not divide by model.n_head={cfg.model.n_head}")


def check_bert(cfg: Any) -> None:
    check_language(cfg)
    require(0 < cfg.model.mask_prob < 1, f"model.mask_prob={cfg.model.mask_prob}: must be in (0, 1)")
    require(0 <= cfg.model.mask_token < cfg.data.vocab_size,
            f"model.mask_token={cfg.model.mask_token} is outside data.vocab_size={cfg.data.vocab_size}")
