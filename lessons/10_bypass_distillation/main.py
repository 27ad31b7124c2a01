"""Lesson 10: blockwise local ("bypass") distillation, in parallel, resumable, stitched, exported.

The story, top to bottom (this file: the distillation itself; resumable.py: runs that survive):

1. A teacher: a small GPT (lesson 07's layers) trained on lesson 07's synthetic language, and
   its block I/O: the residual stream entering and leaving every block.
2. Students whose blocks are cheaper: a block with a 1h MLP instead of 4h (initialised from the
   teacher's first h channels), or a single linear layer.
3. The block loss: each student block is trained ALONE to map the teacher's input of that block
   to the teacher's output of that block, with the normalized MSE
   sum((y - t)^2) / (sum(t^2) + eps). Because the residual stream passes through every block,
   that number is small for a block that does little: compare it with the block's own no-op
   baseline, or normalise by the block's own change.
4. One step of one block, alone: no gradient crosses blocks.
5. The blocks over the ranks: rank r owns the blocks i with i mod p = r and trains them with
   no communication; the price is the teacher prefix each rank recomputes.
6. Stitching: the teacher's embeddings and head around the student blocks.

resumable.py makes the runs survive: every run is named by a fingerprint of its configuration;
per-block checkpoints with an atomically updated `latest` pointer; a block trained to the end
resumes from them and ends bitwise where an uninterrupted run ends; one rank's share of a run;
the stitched student loaded from the checkpoints and exported from the live modules with lesson
06's verified safetensors export.

The proof (the sweep demo, evaluation, the end-to-end baseline, broken exports, the CLI) is in
checks.py. Run: `python lessons/10_bypass_distillation/main.py`.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn as nn

memory = importlib.import_module("lessons.07_memory.main")  # lesson 07's technique
tiny_gpt = importlib.import_module("lessons.07_memory.tiny_gpt")  # lesson 07's TinyGPT, markov_batches
EPS = 1e-8

# ============================================================================ 1. the teacher


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    vocab: int = 64
    hidden: int = 64
    heads: int = 4
    layers: int = 4
    seq: int = 32
    batch: int = 8
    steps: int = 100
    lr: float = 3e-3
    seed: int = 0


def make_teacher(config: TeacherConfig) -> tiny_gpt.TinyGPT:
    torch.manual_seed(config.seed)
    return tiny_gpt.TinyGPT(config.vocab, config.hidden, config.heads, config.layers, config.seq, dropout=0.0)


def batches(config: TeacherConfig, steps: int, stream: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sentences of one synthetic language (lesson 07's, chosen by the seed): stream 0 trains
    the teacher, 1 the students, 2 is held out. A batch depends only on (seed, stream, step)."""
    return tiny_gpt.markov_batches(config.vocab, config.seq, config.batch, steps, config.seed,
                                 sample_seed=config.seed * 1000 + stream + 1)


def train_teacher(config: TeacherConfig) -> tiny_gpt.TinyGPT:
    teacher = make_teacher(config)
    optimizer = torch.optim.AdamW(teacher.parameters(), lr=config.lr)
    for tokens, targets in batches(config, config.steps, 0):
        optimizer.zero_grad()
        teacher.loss(tokens, targets).backward()
        optimizer.step()
    return teacher.eval()


def embed(model: tiny_gpt.TinyGPT, tokens: torch.Tensor) -> torch.Tensor:
    """tokens (b, s) -> the first block's input (s, b, h), exactly as TinyGPT.forward does."""
    return (model.embed(tokens) + model.pos.weight[: tokens.shape[1]]).transpose(0, 1)


@torch.no_grad()
def teacher_block_io(teacher: tiny_gpt.TinyGPT, tokens: torch.Tensor,
                     upto: int | None = None) -> list[torch.Tensor]:
    """The residual stream at the block boundaries: [input of block 0, output of block 0, ...,
    output of block `upto`] (default: every block). Block i's input is states[i], its target
    states[i + 1]; reaching block i costs i + 1 teacher block forwards."""
    states = [embed(teacher, tokens)]
    for layer in teacher.layers[: None if upto is None else upto + 1]:
        states.append(layer(states[-1]))
    return states


# ============================================================================ 2. student blocks


class LinearBlock(nn.Module):
    """The cheapest replacement: x + W LN(x) (h^2 + 3h parameters instead of 12h^2 + 13h).
    W starts at zero, so the block starts as the identity (the residual stream passes)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.norm(x))


def make_student_block(kind: str, teacher_layer: memory.TransformerLayer, hidden: int,
                       heads: int) -> nn.Module:
    """kind "mlp1": the teacher's attention and LayerNorms, its MLP cut from 4h to 1h channels,
    initialised from the teacher's FIRST h channels (a simplification: pruning keeps the most
    important channels, e.g. ranked by activation scores). kind "linear": LinearBlock."""
    if kind == "linear":
        return LinearBlock(hidden)
    if kind != "mlp1":
        raise ValueError(f"unknown student block kind {kind!r}: expected 'mlp1' or 'linear'")
    block = memory.TransformerLayer(hidden, heads, dropout=0.0)
    block.load_state_dict({k: v for k, v in teacher_layer.state_dict().items()
                           if not k.startswith(("up.", "down."))}, strict=False)
    block.up, block.down = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
    with torch.no_grad():
        block.up.weight.copy_(teacher_layer.up.weight[:hidden])
        block.up.bias.copy_(teacher_layer.up.bias[:hidden])
        block.down.weight.copy_(teacher_layer.down.weight[:, :hidden])
        block.down.bias.copy_(teacher_layer.down.bias)
    return block


def params_of(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def teacher_block_params(hidden: int) -> int:
    """QKV 3h^2 + 3h, output h^2 + h, MLP 8h^2 + 5h, two LayerNorms 4h: 12h^2 + 13h."""
    return 12 * hidden ** 2 + 13 * hidden


# ============================================================================ 3. the block loss


# exercise block-loss (2 points): The normalised block losses
# hint: divide by the TEACHER's energy, sum(t^2) (or sum((t - x)^2)), never the student's; add
#   EPS to the denominator so a zero target cannot divide by zero.
def normalized_mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The per-block distillation loss: sum((y - t)^2) / (sum(t^2) + eps).

    y: the student block's output, t: the teacher block's output, any equal shapes (here
    (s, b, h)); returns a 0-d tensor, differentiable in y. 0 is perfect, 1 is as bad as
    predicting zeros; it does not depend on the scale of t. It is NOT comparable across blocks:
    t = x + (the block's change), so the no-op student y = x already scores
    sum((x - t)^2) / sum(t^2), which is large where the block changes x a lot and small where it
    adds little to the residual stream (`block_change_mse` divides by that instead)."""
    return (y - t).pow(2).sum() / (t.pow(2).sum() + EPS)


# exercise block-loss (continued)
def block_change_mse(y: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """sum((y - t)^2) / (sum((t - x)^2) + eps): the error relative to what the teacher block
    changes (x its input): 0 perfect, 1 as bad as skipping the block, at every depth.
    y, x, t: equal shapes; returns a 0-d tensor, differentiable in y (eps = EPS)."""
    return (y - t).pow(2).sum() / ((t - x).pow(2).sum() + EPS)


# ============================================================================ 4. one block, alone


# exercise distill-step (3 points): One block's distillation step, alone
# hint: loss = normalized_mse(block(x), t); zero the gradients BEFORE backward, then
#   optimizer.step() and scheduler.step(); return float(loss).
def distill_step(block: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 x: torch.Tensor, t: torch.Tensor) -> float:
    """One training step of one student block, alone.

    x: the teacher's input of this block, t: the teacher block's output (both (s, b, h), no
    gradient). Forward the block on x, loss = `normalized_mse`(block(x), t), backward (the
    gradient reaches this block's parameters only), optimizer step, scheduler step. Returns
    the loss as a float. No communication: nothing here depends on another block.
    Mutates the block's parameters (and their .grad), the optimizer's and the scheduler's
    state (one step each); x and t are read, never changed."""
    loss = normalized_mse(block(x), t)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()
    return float(loss.detach())


# ============================================================================ 5. the blocks over the ranks


def owned_blocks(layers: int, rank: int, world: int) -> list[int]:
    """Round robin: rank r trains blocks r, r + p, r + 2p, ..."""
    return list(range(rank, layers, world))


def teacher_block_forwards(layers: int, world: int) -> dict:
    """Teacher block forwards per training step, over all ranks. Ours: each rank runs the
    teacher up to its last block, sum over r of (last owned block + 1); with no reuse between a
    rank's blocks, L(L+1)/2; pipelined (Puzzletron: contiguous blocks per rank, each rank sends
    its last block's output to the next), L, plus p - 1 activation transfers of (s, b, h)."""
    ours = sum(max(owned_blocks(layers, r, world)) + 1 for r in range(min(world, layers)))
    return {"ours": ours, "per_block_prefix": layers * (layers + 1) // 2, "pipelined": layers}


# ============================================================================ 6. stitching


def make_student(teacher: tiny_gpt.TinyGPT, kind: str, teacher_config: TeacherConfig) -> tiny_gpt.TinyGPT:
    """A TinyGPT that shares (copies of) the teacher's embeddings, norm and head, with student
    blocks in place of the teacher's layers."""
    student = make_teacher(teacher_config)
    student.load_state_dict(teacher.state_dict())
    hidden, heads = teacher_config.hidden, teacher_config.heads
    student.layers = nn.ModuleList(make_student_block(kind, layer, hidden, heads) for layer in teacher.layers)
    return student


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
