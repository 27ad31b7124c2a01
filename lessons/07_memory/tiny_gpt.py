"""Lesson 07, part 4: recomputation, in the small GPT later lessons train.

`TinyGPT` (token and position embeddings, main.py's `TransformerLayer`s, a final LayerNorm, a
tied head) with `recompute`: True (every layer), False, a set of layer indices whose forward
is replayed during backward, so that only the layer's input is kept, or "selective" (every
layer recomputes only its attention core: Korthikanti et al.'s selective recomputation). `markov_batches`: a
learnable synthetic language to train it on (lessons 08, 10, 11 and 13 use both).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from . import main as memory

# ============================================================================ 4. recomputation


class TinyGPT(nn.Module):
    """Token + position embeddings, `layers` TransformerLayers, final LayerNorm, tied head.
    `recompute`: True (every layer), False, the set of layer indices to recompute, or
    "selective" (the attention core of every layer)."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int,
                 dropout: float = 0.1, recompute: bool | set[int] | str = False) -> None:
        super().__init__()
        if isinstance(recompute, str) and recompute != "selective":
            raise ValueError(f"recompute={recompute!r}: True, False, a set of layers or 'selective'")
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(memory.TransformerLayer(hidden, heads, dropout,
                                                            recompute_attention=recompute == "selective")
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.recompute = recompute
        for table in (self.embed, self.pos):  # GPT-2's init: the tied head starts near uniform
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) -> logits (b, s, vocab)."""
        x = (self.embed(tokens) + self.pos.weight[: tokens.shape[1]]).transpose(0, 1)
        for index, layer in enumerate(self.layers):
            # recompute: keep only the layer's input; run its forward again during backward
            again = self.recompute is True or (isinstance(self.recompute, (set, frozenset))
                                               and index in self.recompute)
            x = checkpoint(layer, x, use_reentrant=False) if again else layer(x)
        return self.norm(x).transpose(0, 1) @ self.embed.weight.T

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def markov_batches(vocab: int, seq: int, batch: int, steps: int, seed: int,
                   sample_seed: int | None = None) -> list[tuple]:
    """A learnable synthetic language: each token's successor is drawn from one of 2 choices.
    `seed` picks the language (the successor table); `sample_seed`, when given, draws other
    sentences of the same language (train / held-out splits)."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 2), generator=generator)
    if sample_seed is not None:
        generator = torch.Generator().manual_seed(sample_seed)
    batches = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
        for t in range(seq):
            pick = torch.randint(0, 2, (batch,), generator=generator)
            tokens[:, t + 1] = successors[tokens[:, t], pick]
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches
