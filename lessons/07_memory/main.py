"""Lesson 07: where the memory of a training step goes, and four ways to shrink it.

The technique in four files, in reading order. This one, main.py, measures and models memory:

1. `MemoryTracker`: a TorchDispatchMode that sees every storage an operator creates, follows it
   with a weak reference until it is freed, and files its bytes under parameter, gradient,
   optimizer, activation or temporary. It keeps the peak and what was live at the peak.
2. Model states: bytes per parameter of each recipe (16 for fp32 or mixed-precision Adam, 18
   or 20 with Megatron's fp32 `main_grad`, about 10 with 8-bit Adam).
3. Activations: a transformer layer written op for op as Korthikanti et al. count it keeps
   sbh(34 + 5as/h) bytes in 16-bit (plus LayerNorm's statistics), 34sbh when only its
   attention core is recomputed (selective recomputation); the cost model of a step.
tiny_gpt.py, 4. recomputation: `TinyGPT(recompute=True)` keeps each layer's input and replays its
forward (and `markov_batches`, the learnable synthetic data later lessons train it on).
mixed_precision.py: 16-bit training's fp32 master weights (`MixedPrecisionAdam`) and why fp16
needs loss scaling (`DynamicLossScaler`, with GradScaler's rules). adam8bit.py: `Adam8bit`,
block-wise 8-bit optimizer states (one absmax per block).

The proof (torch's MemTracker and GradScaler as references, the measurements, the CLI) is in
checks.py. Run: `python lessons/07_memory/main.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import weakref
from collections.abc import Iterable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

# ============================================================================ 1. the tracker

CATEGORIES = ("parameter", "gradient", "optimizer", "activation", "temporary", "host")
# What a NEW storage is, by the phase that created it; `mark` re-files it later (a gradient is
# made in backward as a temporary and becomes a gradient once it is some parameter's .grad).
PHASE_CATEGORY = {"setup": "temporary", "forward": "activation", "backward": "temporary",
                  "optimizer": "temporary", "host": "host"}


@dataclasses.dataclass(eq=False)
class Allocation:
    """One live storage: its size in bytes and what it is for."""

    nbytes: int
    category: str


class MemoryTracker(TorchDispatchMode):
    """Live bytes by category, and the peak, for every storage an operator creates.

    Storages, not tensors: a view shares its base's storage and costs nothing. A storage is
    counted once, from its creation until Python's weak reference to it fires. Bytes filed
    under "host" (the CPU memory of an offloading system, lesson 08; with `device` set, every
    storage on another device) are followed but not counted in `live_bytes` / `peak_bytes`,
    which model the device. Cost: one weak reference per storage, O(1) per operator output.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        if device is not None:
            device = torch.device(device)
            if device.type == "cuda" and device.index is None:  # storages say cuda:N, never "cuda"
                device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.live: dict[int, Allocation] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.phase_name = "setup"
        self.live_bytes = self.peak_bytes = 0
        self.peak_live: list[Allocation] = []
        self._at_peak = False  # live set not yet copied into peak_live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.track(item)
        return out

    # exercise tracker (4 points): The tracker's accounting: live bytes per storage, the peak
    # hint: key by tensor.untyped_storage()._cdata so a view finds its base's entry; only
    #   non-host bytes move live_bytes; _grow raises the peak, _leave_peak runs before shrinking
    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Follow `tensor`'s storage, or re-file it under `category` if already followed.

        Key: `storage._cdata`, the address of the C++ StorageImpl (unique while it lives). A new
        storage is filed under `category` or PHASE_CATEGORY[phase], or "host" when it lives on
        another device than `self.device`; its bytes are added to `live_bytes` (unless host)
        and a weak reference to it calls `_free` when it dies."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.live:
            if category is not None:
                self._refile(self.live[key], category)
            return
        elsewhere = self.device is not None and storage.device != self.device
        item = Allocation(storage.nbytes(),
                          "host" if elsewhere else category or PHASE_CATEGORY[self.phase_name])
        self.live[key] = item
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        if item.category != "host":
            self._grow(item.nbytes)

    # exercise tracker (continued)
    def _grow(self, nbytes: int) -> None:
        """live_bytes += nbytes; a new maximum becomes peak_bytes (and the live set at that
        moment is copied into peak_live when the tracker next shrinks: `_leave_peak`)."""
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes, self._at_peak = self.live_bytes, True

    def _leave_peak(self) -> None:
        """About to shrink: if we are at a new peak, remember what is live (once per peak)."""
        if self._at_peak:
            self.peak_live = [a for a in self.live.values() if a.category != "host"]
            self._at_peak = False

    # exercise tracker (continued)
    def _refile(self, item: Allocation, category: str) -> None:
        """Change what a live storage is for. Between two device categories the byte counts do
        not move; into "host" its bytes leave live_bytes, out of "host" they join it."""
        if item.category == "host" and category != "host":
            self._grow(item.nbytes)
        elif item.category != "host" and category == "host":
            self._leave_peak()
            self.live_bytes -= item.nbytes
        item.category = category

    # exercise tracker (continued)
    def _free(self, key: int) -> None:
        """The weak reference fired: the storage is gone. Forget it (its entries in `live` and
        `_refs`), and take its bytes out of live_bytes unless it was host memory (the peak
        stays)."""
        self._leave_peak()
        item = self.live.pop(key, None)
        self._refs.pop(key, None)
        if item is not None and item.category != "host":
            self.live_bytes -= item.nbytes

    @contextlib.contextmanager
    def phase(self, name: str):
        """New storages created inside are filed as PHASE_CATEGORY[name]."""
        previous, self.phase_name = self.phase_name, name
        try:
            yield self
        finally:
            self.phase_name = previous

    def mark(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """Follow these tensors' storages under `category` (re-filing those already followed)."""
        for tensor in tensors:
            if tensor is not None:
                self.track(tensor, category)

    def breakdown(self, items: Iterable[Allocation] | None = None) -> dict[str, int]:
        """Bytes per category of `items` (default: what is live now)."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for item in self.live.values() if items is None else items:
            totals[item.category] += item.nbytes
        return totals

    def peak_breakdown(self) -> dict[str, int]:
        """What was live at the peak, filed by what each storage turned out to be."""
        self._leave_peak()
        return self.breakdown(self.peak_live)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak_bytes, self._at_peak = self.live_bytes, True
        self._leave_peak()


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in `optimizer.state` (Adam's m, v and step counters)."""
    return [value for state in optimizer.state.values() for value in state.values()
            if isinstance(value, torch.Tensor)]


def tracked_step(tracker: MemoryTracker, model: nn.Module, optimizer, batch) -> torch.Tensor:
    """One training step with phases and re-filing, so the breakdown names every byte."""
    with tracker.phase("forward"):
        loss = model.loss(*batch)
    with tracker.phase("backward"):
        loss.backward()
    tracker.mark((p.grad for p in model.parameters()), "gradient")
    with tracker.phase("optimizer"):
        optimizer.step()
    tracker.mark(optimizer_tensors(optimizer), "optimizer")
    return loss.detach()


# ============================================================================ 2. model states


# exercise memory-formulas (2 points): Bytes per parameter and activation bytes per layer
# hint: count each tensor kept between steps (weights, grads, master, m, v) by its dtype's size;
#   activations: 16 itemsize + 2 bytes per sbh element, 2 itemsize + 1 per a s^2 b element
def model_state_bytes_per_param(recipe: str) -> int:
    """Bytes per parameter kept between steps (weights, gradients, optimizer states).

    fp32 Adam:                      4 weights + 4 grads + 4 m + 4 v                     = 16
    mixed-precision Adam:           2 weights + 2 grads + 4 fp32 master + 4 m + 4 v     = 16
    + fp32 main_grad, 16-bit freed: 2 + 4 main_grad + 12 (Megatron-LM's DDP hook)       = 18
    + fp32 main_grad, both kept:    2 + 2 + 4 + 12                                      = 20
    8-bit Adam, mixed precision:    2 + 2 + 4 master + 1 m + 1 v (+ absmax per block)   ~ 10
    """
    return {"fp32_adam": 16, "mixed_adam": 16, "mixed_adam_main_grad": 18,
            "mixed_adam_fp32_accum": 20, "mixed_adam8bit": 10}[recipe]


# ============================================================================ 3. activations


class MaskDropout(torch.autograd.Function):
    """Dropout that keeps a 1-byte bool mask for backward (what the 34sbh formula assumes).
    Uses the global RNG, so checkpoint() can replay it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        mask = torch.rand(x.shape, device=x.device) >= p
        ctx.save_for_backward(mask)
        ctx.scale = 1.0 / (1.0 - p)
        return x * mask * ctx.scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (mask,) = ctx.saved_tensors
        return grad * mask * ctx.scale, None


class TransformerLayer(nn.Module):
    """A GPT layer (pre-LN causal attention + 4h GeLU MLP), op for op as Korthikanti et al.
    count it (the causal mask is an additive bias, which autograd does not keep).

    x: (s, b, h) -> (s, b, h). What autograd keeps, in units of sbh bytes for 16-bit tensors:
    LN1 input 2, QKV input 2, Q and K 4, V 2, attention output 2 (into the O projection),
    dropout mask 1, LN2 input 2, MLP input 2, GeLU input 8, down-projection input 8, mask 1 = 34;
    and as^2 b: softmax output 2, its dropout mask 1, dropped probabilities 2 = 5.
    """

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1, causal: bool = True,
                 recompute_attention: bool = False) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} must be divisible by heads {heads}")
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.recompute_attention = recompute_attention  # selective recomputation: the 5as/h term
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        a, d = self.heads, h // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.reshape(s, b, a, d).permute(1, 2, 0, 3).contiguous() for t in (q, k, v))
        context = (checkpoint(self.attention, q, k, v, use_reentrant=False)
                   if self.recompute_attention else self.attention(q, k, v))  # (b, a, s, d)
        context = context.permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + self.drop(self.out(context))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The core, (b, a, s, d) x 3 -> (b, a, s, d): softmax(q k^T / sqrt(d) + mask), dropout,
        times v. It alone keeps the a s^2 b tensors; recomputed, it keeps only q, k, v, which
        the layer saves anyway (Korthikanti et al.'s selective recomputation)."""
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if self.causal:  # position i sees positions <= i; the add keeps nothing for backward
            scores = scores + causal_bias(q.shape[2], scores.dtype, scores.device)
        return self.drop(torch.softmax(scores, dim=-1)) @ v

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout in training mode only: in eval mode it neither changes x nor draws from the
        RNG (an evaluation must not shift the random stream a resumed run replays)."""
        return MaskDropout.apply(x, self.dropout) if self.training else x


def causal_bias(seq: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(s, s): 0 on and below the diagonal, -inf above (a token never sees a later one)."""
    return torch.full((seq, seq), float("-inf"), dtype=dtype, device=device).triu(1)


# exercise memory-formulas (continued)
def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, itemsize: int = 2) -> int:
    """Korthikanti et al.: sbh(34 + 5as/h) for 16-bit tensors (itemsize 2) and 1-byte masks.
    In general: sbh(16 itemsize + 2) + a s^2 b (2 itemsize + 1)."""
    sbh, ass_b = seq * batch * hidden, heads * seq * seq * batch
    return sbh * (16 * itemsize + 2) + ass_b * (2 * itemsize + 1)


def layernorm_stats_bytes(seq: int, batch: int, itemsize: int = 2) -> int:
    """The formula leaves out LayerNorm's mean and 1/std: 2 norms x 2 x s b values per layer,
    of `itemsize` bytes: the parameters' dtype on the CPU (2 in bf16, measured), fp32 (4) in
    CUDA's kernel whatever the input dtype (layer_norm_cuda allocates them in acc_type)."""
    return 2 * 2 * seq * batch * itemsize


def measure_layer_activations(seq: int, batch: int, hidden: int, heads: int, layers: int = 1,
                              dtype=torch.bfloat16, seed: int = 0, selective: bool = False) -> int:
    """Bytes created by `layers` stacked layers' forward and still alive after it (what autograd
    keeps for backward, plus the last output; the first input was made before), with the
    attention core recomputed when `selective`."""
    torch.manual_seed(seed)
    stack = nn.Sequential(*[TransformerLayer(hidden, heads, recompute_attention=selective)
                            for _ in range(layers)]).to(dtype)
    x = torch.randn(seq, batch, hidden, dtype=dtype, requires_grad=True)
    tracker = MemoryTracker()
    tracker.mark(stack.parameters(), "parameter")  # else a weight's .t() view counts as new
    with tracker, tracker.phase("forward"):
        y = stack(x)
    measured = tracker.breakdown()["activation"]
    del y
    return measured


def gpt_param_count(layers: int, hidden: int, vocab: int, seq: int) -> int:
    """Per layer 12h^2 + 13h (QKV, O, 4h MLP, biases, two LayerNorms); token and position
    embeddings (the output head tied to the token embedding); a final LayerNorm."""
    return layers * (12 * hidden ** 2 + 13 * hidden) + vocab * hidden + seq * hidden + 2 * hidden


GPT2_XL = {"layers": 48, "hidden": 1600, "heads": 25, "vocab": 50257, "seq": 1024}  # README's example


def training_memory(layers: int, hidden: int, heads: int, vocab: int, seq: int, batch: int = 1,
                    recipe: str = "mixed_adam", recompute: bool | str = False) -> dict:
    """Bytes of one training step: model states (bytes/param x N; with 8-bit Adam the token and
    position embeddings keep 32-bit states, +6 B/param, as StableEmbedding asks) and the
    activations kept between forward and backward in 16-bit: sbh(34 + 5as/h) per layer;
    recompute="selective" (only the attention core) 34sbh; True or "full" only the 2sbh input.

    Not the backward peak: with recomputation one layer is rebuilt whole during backward (A
    bytes) next to its gradients' working set, and the loss needs the s b V logits; the README
    quotes that peak as measured by the tracker on the meta device."""
    n_params = gpt_param_count(layers, hidden, vocab, seq)
    sbh = seq * batch * hidden
    per_layer = {False: activation_bytes_per_layer(seq, batch, hidden, heads), "selective": 34 * sbh,
                 True: 2 * sbh, "full": 2 * sbh}[recompute]
    embeddings = (vocab + seq) * hidden if recipe == "mixed_adam8bit" else 0
    states = model_state_bytes_per_param(recipe) * n_params + (8 - 2) * embeddings
    return {"params": n_params, "states_bytes": states, "activation_bytes_per_layer": per_layer,
            "activation_bytes": layers * per_layer, "total_bytes": states + layers * per_layer,
            "logits_bytes": 2 * seq * batch * vocab}


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness

    run_harness(__file__)
