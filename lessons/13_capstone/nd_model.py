"""The capstone in N dimensions, the one-process side: the model every layout must reproduce.

`GPTConfig` (the model and the run), `GPT` (token and position tables, pre-norm `Block`s with
the attributes lesson 04's TensorParallelBlock splits, a final LayerNorm, an untied head),
`build_gpt` (the same initial weights on every rank), `adamw` (nanoGPT's parameter groups),
`inputs_and_targets` (a batch's tokens and targets; `IGNORE_INDEX` marks a target that counts
nowhere: padding, a packed document's last token) and `train_one_process`, the float64
reference of every proof: the mean cross-entropy over the batch's real targets; `global_state` and
`load_global_state`: the model under the names checkpoints use (q, k, v fused as qkv, as the
tensor-parallel blocks hold them). nd.py splits this model over a mesh; nd_placement.py says
where each piece of it lives.
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

tensor_parallel = importlib.import_module("lessons.04_tensor_parallel.main")  # causal_attention
checkpointing = importlib.import_module("lessons.06_checkpointing.main")  # cosine_with_warmup

IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index: a target that counts nowhere


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The model and the run. Every layout trains the same global batch per step:
    `global_batch` sequences of `seq` tokens, each dp replica's share cut into `microbatches`."""

    vocab: int = 32
    hidden: int = 32
    heads: int = 4
    layers: int = 4
    seq: int = 16
    global_batch: int = 8
    microbatches: int = 2
    steps: int = 4
    lr: float = 3e-3
    warmup: int = 2
    clip: float = 1.0
    weight_decay: float = 0.1
    seed: int = 0

    def fingerprint(self) -> str:
        """The run's identity, the same in every layout (a checkpoint resumes in any)."""
        text = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        return checkpointing.sha256_hex(text.encode())[:16]


class Block(nn.Module):
    """Pre-norm transformer block on (s, b, h): x + o(attn(q, k, v of ln1 x)), then
    + down(gelu(up(ln2 x))); the attributes lesson 04's TensorParallelBlock splits."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.ln1(x)
        x = x + self.o(tensor_parallel.causal_attention(self.q(a), self.k(a), self.v(a), self.heads))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    """tokens (b, s) -> logits (b, s, vocab): embed + learned positions, `layers` Blocks,
    final LayerNorm, untied head (no bias)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.pos = nn.Embedding(config.seq, config.hidden)
        self.blocks = nn.ModuleList(Block(config.hidden, config.heads) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)
        for table in (self.embed, self.pos):
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = (self.embed(tokens) + self.pos.weight[: tokens.shape[1]]).transpose(0, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).transpose(0, 1)


def build_gpt(config: GPTConfig, dtype: torch.dtype = torch.float32) -> GPT:
    """The same initial weights on every rank: seeded, built on the CPU."""
    torch.manual_seed(config.seed)
    return GPT(config).to(dtype)


def adamw(params_by_dim: list[tuple[torch.Tensor, int]], config: GPTConfig) -> torch.optim.AdamW:
    """AdamW with nanoGPT's groups: tensors of 2+ dimensions decay (judged by the dimension of
    the parameter each tensor is, or is a shard of), the others do not."""
    decay = [p for p, dim in params_by_dim if dim >= 2]
    keep = [p for p, dim in params_by_dim if dim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                              {"params": keep, "weight_decay": 0.0}], lr=config.lr, foreach=False)


def inputs_and_targets(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's global batch -> (tokens (B, seq), targets (B, seq)). `batch` is windows
    (B, seq + 1) of a token stream (every next token a target), or a pair (tokens, targets)
    whose targets hold IGNORE_INDEX where a position predicts nothing: padding after a short
    document, or a packed row's document ends (the next document's first token is not
    predicted from the previous one's)."""
    if isinstance(batch, torch.Tensor):
        return batch[:, :-1], batch[:, 1:]
    tokens, targets = batch
    if tokens.shape != targets.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} differ")
    return tokens, targets


def train_one_process(config: GPTConfig, batches: list, dtype: torch.dtype = torch.float64,
                      bf16: bool = False, device: str | torch.device = "cpu"
                      ) -> tuple[list[tuple[float, float]], GPT]:
    """The reference every layout must equal: whole batches (`inputs_and_targets`), the mean
    cross-entropy over the batch's real targets (sum / count, IGNORE_INDEX left out), torch's
    clip_grad_norm_, AdamW, warmup + cosine; `bf16`: the forward under bf16 autocast (on the
    CPU too). Returns [(loss, norm before clipping)] and the trained model."""
    model = build_gpt(config, dtype).to(device)
    optimizer = adamw([(p, p.dim()) for p in model.parameters()], config)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, checkpointing.cosine_with_warmup(config.warmup, config.steps))
    history = []
    for batch in batches:
        tokens, targets = (t.to(device) for t in inputs_and_targets(batch))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens).to(dtype)  # cross-entropy in the weights' dtype
        loss = F.cross_entropy(logits.reshape(-1, config.vocab), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        history.append((loss.item(), norm.item()))
    return history, model


def global_state(gpt: GPT) -> dict[str, torch.Tensor]:
    """The one-process model under the names checkpoints use (q, k, v fused as qkv)."""
    state = {"embed": gpt.embed.weight, "pos": gpt.pos.weight, "norm.weight": gpt.norm.weight,
             "norm.bias": gpt.norm.bias, "head": gpt.head.weight}
    for i, block in enumerate(gpt.blocks):
        for part in ("weight", "bias"):
            state[f"blocks.{i}.qkv.{part}"] = torch.cat([getattr(getattr(block, n), part)
                                                         for n in "qkv"])
            for name in ("ln1", "ln2", "o", "up", "down"):
                state[f"blocks.{i}.{name}.{part}"] = getattr(getattr(block, name), part)
    return {name: t.detach() for name, t in state.items()}


def load_global_state(gpt: GPT, state: dict[str, torch.Tensor]) -> GPT:
    """`global_state`'s inverse: copy the named global tensors into a one-process GPT."""
    with torch.no_grad():
        for name, tensor in (("embed", gpt.embed.weight), ("pos", gpt.pos.weight),
                             ("norm.weight", gpt.norm.weight), ("norm.bias", gpt.norm.bias),
                             ("head", gpt.head.weight)):
            tensor.copy_(state[name])
        for i, block in enumerate(gpt.blocks):
            for part in ("weight", "bias"):
                for linear, piece in zip((block.q, block.k, block.v),
                                         state[f"blocks.{i}.qkv.{part}"].chunk(3)):
                    getattr(linear, part).copy_(piece)
                for name in ("ln1", "ln2", "o", "up", "down"):
                    getattr(getattr(block, name), part).copy_(state[f"blocks.{i}.{name}.{part}"])
    return gpt
