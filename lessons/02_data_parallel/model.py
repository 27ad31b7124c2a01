"""Lesson 02's model and data: what every DDP variant of main.py trains (lessons 03, 06 and 13
use them too, as `data_parallel.make_model`, `global_batch`, `local_shard`, `flat_params`).

The same model on every rank, a different slice of each global batch on every rank:
`local_shard` gives rank r its B/p rows, so the mean of the p local mean losses is the global
mean loss, and averaging the p local gradients is exact.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyMLP(nn.Module):
    """x (B, d_in) -> fc1 -> ReLU -> fc2 -> ReLU -> head -> (B, d_out), with a buffer that
    scales the input (buffers are broadcast too). `unused=True` adds a layer forward never
    calls, whose parameters get no gradient."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4, unused: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, d_out)
        self.register_buffer("input_scale", torch.ones(d_in))
        self.spare = nn.Linear(hidden, hidden) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.input_scale
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def make_model(seed: int, dtype: torch.dtype = torch.float64, unused: bool = False, **sizes) -> TinyMLP:
    """A TinyMLP (on the CPU) whose weights and buffer follow from `seed` alone."""
    torch.manual_seed(seed)
    model = TinyMLP(unused=unused, **sizes).to(dtype)
    model.input_scale.uniform_(0.5, 1.5)
    return model


def global_batch(step: int, batch: int, seed: int, d_in: int = 16, d_out: int = 4,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of step `step` (deterministic, on the CPU): inputs (batch, d_in),
    targets (batch, d_out)."""
    generator = torch.Generator().manual_seed(seed * 7919 + step)
    x = torch.randn(batch, d_in, generator=generator, dtype=dtype)
    y = torch.randn(batch, d_out, generator=generator, dtype=dtype)
    return x, y


def local_shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank r's rows of a global batch: rows [r*b, (r+1)*b) with b = B / p. The mean of the p
    local mean losses is then the global mean loss, so averaging gradients is exact."""
    if x.shape[0] % world_size:
        raise ValueError(f"global batch {x.shape[0]} is not divisible by world size {world_size}")
    per_rank = x.shape[0] // world_size
    return x[rank * per_rank:(rank + 1) * per_rank]


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, detached and concatenated in parameters() order: shape (Psi,)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
