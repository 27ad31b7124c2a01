"""Lesson 07: where the memory of a training step goes, and four ways to shrink it.

The story, top to bottom:

1. `MemoryTracker`: a TorchDispatchMode that sees every tensor an operator creates, follows
   its storage with a weak reference until it is freed, and files its bytes under parameter,
   gradient, optimizer, activation or temporary. It keeps the peak and what was live at the
   peak. Checked against torch's own `MemTracker` (and, on a GPU, `max_memory_allocated`).
2. Model states: fp32 Adam and mixed-precision Adam cost 16 bytes per parameter, 20 with an
   fp32 gradient accumulator; measured, not assumed.
3. Activations: a transformer layer written op for op as Korthikanti et al. count it keeps
   sbh(34 + 5as/h) bytes in 16-bit (plus LayerNorm's small statistics); measured.
4. Mixed precision: autocast in bf16 and fp16, why fp16 needs loss scaling (gradients
   underflow), and `DynamicLossScaler` from scratch, equal to torch.amp.GradScaler step for step.
5. Activation recomputation with torch.utils.checkpoint: bytes saved, gradients unchanged.
6. `Adam8bit`: block-wise 8-bit optimizer states (blocks of 2048, one absmax per block,
   small tensors kept in 32-bit): ~75% less state memory, and the training curve beside Adam's.

Run: `python lessons/07_memory/main.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
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

from lessons._launch import RankContext, inject_fault, launch
from lessons._report import Check, Report, check_args, finish, int_in, lesson_parser, run_main

LESSON = "07_memory"

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
    counted once from its creation until Python's weak reference to it fires. Bytes filed under
    "host" (CPU memory of an offloading system, lesson 08) are tracked but not counted in
    `live_bytes` / `peak_bytes`, which model the device.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, Allocation] = {}
        self._refs: dict[int, weakref.ref] = {}
        self.phase_name = "setup"
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_live: list[Allocation] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self.track(item)
        return out

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        """Start following `tensor`'s storage (or re-file it under `category`)."""
        storage = tensor.untyped_storage()
        key = storage._cdata  # the address of the C++ StorageImpl: unique while it lives
        if key in self.live:
            if category is not None:
                self._refile(self.live[key], category)
            return
        item = Allocation(storage.nbytes(), category or PHASE_CATEGORY[self.phase_name])
        self.live[key] = item
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        if item.category != "host":
            self._grow(item.nbytes)

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self.peak_live = [a for a in self.live.values() if a.category != "host"]

    def _refile(self, item: Allocation, category: str) -> None:
        if item.category == "host" and category != "host":
            self._grow(item.nbytes)
        elif item.category != "host" and category == "host":
            self.live_bytes -= item.nbytes
        item.category = category

    def _free(self, key: int) -> None:
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
        return self.breakdown(self.peak_live)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.peak_live = [a for a in self.live.values() if a.category != "host"]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
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


def compare_with_torch_memtracker(seed: int = 0) -> dict:
    """The same step under our tracker and under torch.distributed._tools MemTracker.

    Both count unique storages, so the peak totals must be equal to the byte. Their categories
    differ in one place: MemTracker files the optimizer's temporaries under "Optstate".
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    results = {}
    for name in ("ours", "torch"):
        model = make_mlp(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        batch = (torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)),)
        if name == "ours":
            tracker = MemoryTracker()
            tracker.mark(model.parameters(), "parameter")
            with tracker:
                tracked_step(tracker, model, optimizer, batch)
            peak = tracker.peak_breakdown()
            results[name] = {"total": tracker.peak_bytes, "parameter": peak["parameter"],
                             "gradient": peak["gradient"],
                             "optimizer": peak["optimizer"] + peak["temporary"]}
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                loss = model.loss(*batch)  # alive through the step, as in tracked_step
                loss.backward()
                optimizer.step()
            peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
            by_name = {str(getattr(k, "value", k)): v for k, v in peak.items()}
            results[name] = {"total": by_name["Total"], "parameter": by_name["Parameter"],
                             "gradient": by_name["Gradient"],
                             "optimizer": by_name["Optstate"] + by_name["Temp"]}
    return results


class LossMLP(nn.Sequential):
    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).pow(2).mean()


def make_mlp(seed: int, width: int = 64, dtype=torch.float32) -> LossMLP:
    torch.manual_seed(seed)
    return LossMLP(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).to(dtype)


# ============================================================================ 2. model states


def model_state_bytes_per_param(recipe: str) -> int:
    """Bytes per parameter kept for a whole step (weights, gradients, optimizer states).

    fp32 Adam:                  4 weights + 4 grads + 4 m + 4 v                       = 16
    mixed-precision Adam:       2 weights + 2 grads + 4 fp32 master + 4 m + 4 v       = 16
    + fp32 grad accumulation:   the above + 4 (an fp32 copy of the gradients)        = 20
    8-bit Adam, mixed precision: 2 + 2 + 4 master + 1 m + 1 v (+ absmax per block)    ~ 10
    """
    return {"fp32_adam": 16, "mixed_adam": 16, "mixed_adam_fp32_accum": 20, "mixed_adam8bit": 10}[recipe]


class MixedPrecisionAdam:
    """Adam for a 16-bit model: fp32 master weights updated by torch's Adam, copied back.

    Gradients arrive in 16-bit on the model; `accumulate()` (with fp32_accumulation) adds them
    into a persistent fp32 buffer, as Megatron's main_grad does for gradient accumulation.
    """

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3,
                 fp32_accumulation: bool = False) -> None:
        self.params = list(params)
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.inner = torch.optim.Adam(self.master, lr=lr, foreach=False)
        self.main_grads = ([torch.zeros_like(m) for m in self.master] if fp32_accumulation else None)
        self.state = self.inner.state  # so optimizer_tensors() sees m and v

    def accumulate(self) -> None:
        if self.main_grads is not None:
            for buffer, param in zip(self.main_grads, self.params):
                buffer.add_(param.grad)

    def step(self) -> None:
        self.accumulate()
        for index, (master, param) in enumerate(zip(self.master, self.params)):
            master.grad = (self.main_grads[index] if self.main_grads is not None
                           else param.grad.float())
        self.inner.step()
        for master, param in zip(self.master, self.params):
            master.grad = None
            with torch.no_grad():
                param.copy_(master)

    def tensors(self) -> list[torch.Tensor]:
        """Everything this optimizer keeps between steps (filed as "optimizer" or "gradient")."""
        return self.master + optimizer_tensors(self.inner)


def measure_model_states(recipe: str, seed: int = 0) -> dict:
    """Bytes live after one step with `recipe`, per category, and per parameter.

    torch's Adam keeps one 4-byte `step` counter per parameter tensor; it is reported apart so
    the per-parameter figure is the formula's."""
    dtype = torch.float32 if recipe == "fp32_adam" else torch.bfloat16
    model = make_mlp(seed, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    batch = (torch.randn(32, 64, generator=torch.Generator().manual_seed(seed), dtype=dtype),)
    tracker = MemoryTracker()
    tracker.mark(model.parameters(), "parameter")
    with tracker:
        if recipe == "fp32_adam":
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        else:
            optimizer = MixedPrecisionAdam(model.parameters(), fp32_accumulation=recipe.endswith("accum"))
        tracked_step(tracker, model, optimizer, batch)
        if recipe != "fp32_adam":
            tracker.mark(optimizer.tensors(), "optimizer")
            tracker.mark(optimizer.main_grads or [], "gradient")
        counters = [t for t in optimizer_tensors(optimizer) if t.dim() == 0]
        live = tracker.breakdown()
    counter_bytes = sum(t.untyped_storage().nbytes() for t in counters)
    states = live["parameter"] + live["gradient"] + live["optimizer"] - counter_bytes
    return {"recipe": recipe, "n_params": n_params, "breakdown": live,
            "step_counter_bytes": counter_bytes, "bytes_per_param": states / n_params}


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

    def __init__(self, hidden: int, heads: int, dropout: float = 0.1, causal: bool = True) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden {hidden} must be divisible by heads {heads}")
        self.heads, self.dropout, self.causal = heads, dropout, causal
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.out = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        a, d = self.heads, h // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.reshape(s, b, a, d).permute(1, 2, 0, 3).contiguous() for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
        if self.causal:  # position i sees positions <= i; the add keeps nothing for backward
            scores = scores + causal_bias(s, scores.dtype, scores.device)
        probs = torch.softmax(scores, dim=-1)
        context = self.drop(probs) @ v  # (b, a, s, d)
        context = context.permute(2, 0, 1, 3).reshape(s, b, h)
        x = x + self.drop(self.out(context))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout in training mode only: in eval mode it neither changes x nor draws from the
        RNG (an evaluation must not shift the random stream a resumed run replays)."""
        return MaskDropout.apply(x, self.dropout) if self.training else x


def causal_bias(seq: int, dtype: torch.dtype, device) -> torch.Tensor:
    """(s, s): 0 on and below the diagonal, -inf above (a token never sees a later one)."""
    return torch.full((seq, seq), float("-inf"), dtype=dtype, device=device).triu(1)


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, itemsize: int = 2) -> int:
    """Korthikanti et al.: sbh(34 + 5as/h) for 16-bit tensors (itemsize 2) and 1-byte masks.
    In general: sbh(16 itemsize + 2) + a s^2 b (2 itemsize + 1)."""
    sbh, ass_b = seq * batch * hidden, heads * seq * seq * batch
    return sbh * (16 * itemsize + 2) + ass_b * (2 * itemsize + 1)


def layernorm_stats_bytes(seq: int, batch: int, itemsize: int = 2) -> int:
    """The formula leaves out LayerNorm's mean and 1/std: 2 norms x 2 x s b values per layer."""
    return 2 * 2 * seq * batch * itemsize


def measure_layer_activations(seq: int, batch: int, hidden: int, heads: int, layers: int = 1,
                              dtype=torch.bfloat16, seed: int = 0) -> int:
    """Bytes created by `layers` stacked layers' forward and still alive after it (what autograd
    keeps for backward, plus the last output; the first input was made before)."""
    torch.manual_seed(seed)
    stack = nn.Sequential(*[TransformerLayer(hidden, heads) for _ in range(layers)]).to(dtype)
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


# GPT-2 XL: the worked example in the README.
GPT2_XL = {"layers": 48, "hidden": 1600, "heads": 25, "vocab": 50257, "seq": 1024}


def training_memory(layers: int, hidden: int, heads: int, vocab: int, seq: int, batch: int = 1,
                    recipe: str = "mixed_adam", recompute: bool = False) -> dict:
    """Bytes of one training step: model states (bytes/param x N) and activations (16-bit;
    with full recomputation only each layer's 16-bit input, 2sbh, is kept)."""
    n_params = gpt_param_count(layers, hidden, vocab, seq)
    per_layer = (2 * seq * batch * hidden if recompute
                 else activation_bytes_per_layer(seq, batch, hidden, heads))
    states = model_state_bytes_per_param(recipe) * n_params
    return {"params": n_params, "states_bytes": states, "activation_bytes_per_layer": per_layer,
            "activation_bytes": layers * per_layer, "total_bytes": states + layers * per_layer}


# ============================================================================ 4. mixed precision


def autocast_dtypes(seed: int = 0) -> dict:
    """Under autocast a matmul runs in the low-precision dtype; the loss stays near fp32's."""
    model = make_mlp(seed)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
    reference = float(model.loss(x))
    results = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with torch.autocast("cpu", dtype=dtype):
            hidden = model[0](x)
            loss = model.loss(x)
        results[name] = {"matmul_dtype": str(hidden.dtype).removeprefix("torch."),
                         "loss_rel_err": abs(float(loss) - reference) / abs(reference)}
    return results


def underflow_fraction(values: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> float:
    """Fraction of non-zero fp32 `values` that become 0 when cast to `dtype` after x scale."""
    return float(((values * scale).to(dtype) == 0).float().mean())


def small_gradients(n: int = 100_000, seed: int = 0) -> torch.Tensor:
    """Magnitudes log-uniform in [1e-9, 1e-6]: typical of late-training gradients."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (10.0 ** (-9 + 3 * u)).float()


class DynamicLossScaler:
    """Loss scaling from scratch, with torch.amp.GradScaler's rules and defaults.

    scale(loss) = loss x S. unscale_(opt): grads x (1/S) and found_inf = any non-finite grad.
    step(opt): skipped when found_inf. update(): found_inf -> S x backoff, counter 0;
    else counter + 1, and at growth_interval clean steps S x growth, counter 0.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale_value = torch.tensor(init_scale, dtype=torch.float32)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.clean_steps = growth_interval, 0
        self.found_inf = False

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value.to(loss.dtype)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        inv_scale = self.scale_value.double().reciprocal().float()  # as GradScaler computes it
        self.found_inf = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.found_inf |= not bool(torch.isfinite(param.grad).all())
                    param.grad.mul_(inv_scale)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale and step unless a gradient overflowed; True when the step was taken."""
        self.unscale_(optimizer)
        if not self.found_inf:
            optimizer.step()
        return not self.found_inf

    def update(self) -> None:
        if self.found_inf:
            self.scale_value = self.scale_value * self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale_value = self.scale_value * self.growth_factor
                self.clean_steps = 0

    def get_scale(self) -> float:
        return float(self.scale_value)


def compare_with_grad_scaler(steps: int = 12, overflow_steps: tuple[int, ...] = (2, 7, 8),
                             growth_interval: int = 3, seed: int = 0) -> dict:
    """Train the same model with our scaler and with torch.amp.GradScaler; at `overflow_steps`
    one gradient element is set to inf in both. Scales, skipped steps and weights must agree."""
    runs = {}
    for name in ("ours", "torch"):
        model = make_mlp(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = (DynamicLossScaler(growth_interval=growth_interval) if name == "ours"
                  else torch.amp.GradScaler("cpu", growth_interval=growth_interval))
        generator = torch.Generator().manual_seed(seed)
        scales, skipped = [], []
        for step in range(steps):
            optimizer.zero_grad()
            scaler.scale(model.loss(torch.randn(16, 64, generator=generator))).backward()
            if step in overflow_steps:
                model[0].weight.grad[0, 0] = float("inf")
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(optimizer)
            scaler.update()
            if all(torch.equal(b, p) for b, p in zip(before, model.parameters())):
                skipped.append(step)
            scales.append(scaler.get_scale())
        runs[name] = {"scales": scales, "skipped": skipped,
                      "weights": [p.detach().clone() for p in model.parameters()]}
    runs["weights_equal"] = all(torch.equal(a, b) for a, b in
                                zip(runs["ours"].pop("weights"), runs["torch"].pop("weights")))
    return runs


# ============================================================================ 5. recomputation


class TinyGPT(nn.Module):
    """Token + position embeddings, `layers` TransformerLayers, final LayerNorm, tied head."""

    def __init__(self, vocab: int, hidden: int, heads: int, layers: int, seq: int,
                 dropout: float = 0.1, recompute: bool = False) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(TransformerLayer(hidden, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.recompute = recompute
        for table in (self.embed, self.pos):  # GPT-2's init: the tied head starts near uniform
            nn.init.normal_(table.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (b, s) -> logits (b, s, vocab)."""
        x = (self.embed(tokens) + self.pos.weight[: tokens.shape[1]]).transpose(0, 1)
        for layer in self.layers:
            # recompute: keep only the layer's input; run its forward again during backward
            x = checkpoint(layer, x, use_reentrant=False) if self.recompute else layer(x)
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


def compare_recomputation(seq: int, batch: int, hidden: int, heads: int, layers: int,
                          seed: int = 0) -> dict:
    """Activation bytes alive after forward, and the gradients, with and without recompute."""
    tokens, targets = markov_batches(64, seq, batch, 1, seed)[0]
    results = {}
    for recompute in (False, True):
        torch.manual_seed(seed)
        model = TinyGPT(64, hidden, heads, layers, seq, recompute=recompute)
        tracker = MemoryTracker()
        tracker.mark(model.parameters(), "parameter")
        torch.manual_seed(seed + 1)  # the same dropout masks in both runs
        with tracker:
            with tracker.phase("forward"):
                loss = model.loss(tokens, targets)
            after_forward = tracker.breakdown()["activation"]
            tracker.reset_peak()
            with tracker.phase("backward"):
                loss.backward()
        results["recompute" if recompute else "plain"] = {
            "activation_bytes": after_forward, "backward_peak_bytes": tracker.peak_bytes,
            "grads": [p.grad.clone() for p in model.parameters()]}
    plain, recomputed = results["plain"], results["recompute"]
    results["grads_equal"] = all(torch.equal(a, b) for a, b in zip(plain.pop("grads"),
                                                                     recomputed.pop("grads")))
    results["saved_bytes"] = plain["activation_bytes"] - recomputed["activation_bytes"]
    # each layer keeps its fp32 input instead of all it saves (formula + LayerNorm statistics)
    results["saved_bytes_formula"] = layers * (activation_bytes_per_layer(seq, batch, hidden, heads, 4)
                                               + layernorm_stats_bytes(seq, batch, 4)
                                               - 4 * seq * batch * hidden)
    return results


# ============================================================================ 6. 8-bit Adam

BLOCK = 2048
MIN_8BIT_NUMEL = 4096


def dynamic_codebook(signed: bool) -> torch.Tensor:
    """Sorted values in [-1, 1] (signed) or [0, 1]: 0, and m x 2^-e for 8 mantissas m in
    (0.5, 1] and exponents e = 0..14 (signed: 241 codes) or 0..30 (unsigned: 249 codes).
    Dense near 0 like Dettmers' dynamic tree map: small normalized values keep ~3% precision."""
    exponents = 15 if signed else 31
    magnitudes = torch.tensor([2.0 ** -e * (1 - j / 16) for e in range(exponents) for j in range(8)])
    values = torch.cat([magnitudes, -magnitudes, torch.zeros(1)]) if signed else \
        torch.cat([magnitudes, torch.zeros(1)])
    return values.sort().values


CODEBOOKS = {True: dynamic_codebook(True), False: dynamic_codebook(False)}


def quantize_blockwise(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x (any shape, n elements) -> (codes uint8 (ceil(n/B) x B), absmax fp32 (ceil(n/B),)).
    Each block of B = 2048 is divided by its own absmax, then rounded to the nearest code."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % BLOCK
    blocks = F.pad(flat, (0, pad)).view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    codebook = CODEBOOKS[signed]
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    codes = torch.bucketize(blocks / absmax[:, None], midpoints).to(torch.uint8)
    return codes, absmax


def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                         shape: torch.Size) -> torch.Tensor:
    values = CODEBOOKS[signed][codes.long()] * absmax[:, None]
    return values.reshape(-1)[: math.prod(shape)].view(shape)


def adam8bit_state_bytes(numel: int) -> int:
    """Two states: 1 byte per (padded) element each, plus one fp32 absmax per block each;
    tensors below MIN_8BIT_NUMEL keep two fp32 states (8 bytes per element)."""
    if numel < MIN_8BIT_NUMEL:
        return 8 * numel
    blocks = -(-numel // BLOCK)
    return 2 * (blocks * BLOCK + 4 * blocks)


class Adam8bit(torch.optim.Optimizer):
    """Adam whose m and v live as block-wise 8-bit codes between steps (Dettmers et al.).

    Each step: dequantize m, v to fp32, apply Adam exactly as torch does, quantize them back.
    Tensors with fewer than `min_8bit_numel` elements keep fp32 states (set it to math.inf and
    this is plain Adam)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 min_8bit_numel: float = MIN_8BIT_NUMEL) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        self.min_8bit_numel = min_8bit_numel
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.steps += 1
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                quantized = param.numel() >= self.min_8bit_numel
                if not state:
                    zeros = torch.zeros_like(param)
                    state.update(self._store(zeros, True, quantized, "m"))
                    state.update(self._store(zeros, False, quantized, "v"))
                m = self._load(state, True, quantized, "m", param.shape)
                v = self._load(state, False, quantized, "v", param.shape)
                m.lerp_(param.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                bias1, bias2 = 1 - beta1 ** self.steps, 1 - beta2 ** self.steps
                denom = (v.sqrt() / math.sqrt(bias2)).add_(group["eps"])
                param.addcdiv_(m, denom, value=-group["lr"] / bias1)
                state.update(self._store(m, True, quantized, "m"))
                state.update(self._store(v, False, quantized, "v"))

    @staticmethod
    def _store(value: torch.Tensor, signed: bool, quantized: bool, name: str) -> dict:
        if not quantized:
            return {name: value.clone()}
        codes, absmax = quantize_blockwise(value, signed)
        return {f"{name}_codes": codes, f"{name}_absmax": absmax}

    @staticmethod
    def _load(state: dict, signed: bool, quantized: bool, name: str, shape) -> torch.Tensor:
        if not quantized:
            return state[name]
        return dequantize_blockwise(state[f"{name}_codes"], state[f"{name}_absmax"], signed, shape)


def train_curve(optimizer_name: str, batches: list[tuple], hidden: int, heads: int, layers: int,
                seq: int, lr: float = 3e-3, seed: int = 0) -> dict:
    """Losses of TinyGPT (fp32, no dropout) trained with one optimizer; optimizer state bytes
    measured by the tracker after the run."""
    torch.manual_seed(seed)
    model = TinyGPT(64, hidden, heads, layers, seq, dropout=0.0)
    optimizer = {"adam": lambda p: torch.optim.Adam(p, lr=lr, foreach=False),
                 "adam32_ours": lambda p: Adam8bit(p, lr=lr, min_8bit_numel=math.inf),
                 "adam8bit": lambda p: Adam8bit(p, lr=lr)}[optimizer_name](model.parameters())
    tracker = MemoryTracker()
    losses = []
    with tracker:
        for tokens, targets in batches:
            optimizer.zero_grad()
            loss = model.loss(tokens, targets)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        state = [t for t in optimizer_tensors(optimizer) if t.dim() > 0]  # not Adam's step counters
        tracker.mark(state, "optimizer")
        state_bytes = tracker.breakdown()["optimizer"]
    return {"losses": losses, "state_bytes": state_bytes,
            "numels": [p.numel() for p in model.parameters()],
            "weights": [p.detach().clone() for p in model.parameters()]}


def compare_adam8bit(steps: int, hidden: int, heads: int, layers: int, seq: int, batch: int,
                     seed: int = 0) -> dict:
    batches = markov_batches(64, seq, batch, steps, seed)
    runs = {name: train_curve(name, batches, hidden, heads, layers, seq, seed=seed)
            for name in ("adam", "adam32_ours", "adam8bit")}
    numels = runs["adam"]["numels"]
    big = [n for n in numels if n >= MIN_8BIT_NUMEL]
    tail = max(1, steps // 10)  # compare the mean of the last 10% of steps (less noise)
    final = {name: sum(run["losses"][-tail:]) / tail for name, run in runs.items()}
    ours_vs_torch = max(float((a - b).abs().max()) for a, b in
                        zip(runs["adam"]["weights"], runs["adam32_ours"]["weights"]))
    return {
        "state_bytes_32": runs["adam"]["state_bytes"],
        "state_bytes_8": runs["adam8bit"]["state_bytes"],
        "state_bytes_8_formula": sum(adam8bit_state_bytes(n) for n in numels),
        "reduction_total": 1 - runs["adam8bit"]["state_bytes"] / runs["adam"]["state_bytes"],
        "reduction_quantized": 1 - sum(adam8bit_state_bytes(n) for n in big) / (8 * sum(big)),
        "quantized_fraction": sum(big) / sum(numels),
        "first_loss": runs["adam"]["losses"][0],
        "final_loss": final,
        "final_loss_gap": final["adam8bit"] - final["adam"],
        "ours_fp32_vs_torch_adam": ours_vs_torch,
        "curves": {name: run["losses"] for name, run in runs.items()},
    }


# ============================================================================ GPU cross-check


def cuda_cross_check(seed: int = 0) -> dict:
    """On a GPU: our tracker's peak for one bf16 training step of TinyGPT beside the caching
    allocator's max_memory_allocated (which rounds every block up to 512 bytes)."""
    device = torch.device("cuda")
    torch.manual_seed(seed)
    model = TinyGPT(64, 256, 8, 4, 128).to(device=device, dtype=torch.bfloat16)
    optimizer = MixedPrecisionAdam(model.parameters())
    tokens, targets = (t.to(device) for t in markov_batches(64, 128, 8, 1, seed)[0])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    tracker = MemoryTracker()
    tracker.mark(list(model.parameters()) + optimizer.tensors(), "parameter")
    start = tracker.live_bytes
    with tracker:
        tracked_step(tracker, model, optimizer, (tokens, targets))
    torch.cuda.synchronize()
    ours = tracker.peak_bytes - start
    allocator = torch.cuda.max_memory_allocated() - baseline
    return {"ours_peak_bytes": ours, "cuda_peak_bytes": allocator, "ratio": ours / allocator}


# ============================================================================ the checks


def verify_worker(ctx: RankContext, seed: int, seq: int, batch: int, hidden: int, heads: int,
                  layers: int, steps: int, fault: str | None, fault_rank: int) -> dict:
    inject_fault(ctx, fault, fault_rank)
    torch.set_num_threads(2)
    checks, metrics = [], {}

    versus = compare_with_torch_memtracker(seed)
    checks.append(Check("tracker peak == torch MemTracker's peak (and its categories)",
                        versus["ours"] == versus["torch"],
                        f"ours {versus['ours']}, torch {versus['torch']}"))
    metrics["memtracker"] = versus

    metrics["bytes_per_param"] = {}
    for recipe in ("fp32_adam", "mixed_adam", "mixed_adam_fp32_accum"):
        measured = measure_model_states(recipe, seed)
        expected = model_state_bytes_per_param(recipe)
        metrics["bytes_per_param"][recipe] = measured["bytes_per_param"]
        checks.append(Check(f"{recipe}: {expected} bytes per parameter (measured)",
                            measured["bytes_per_param"] == expected,
                            f"{measured['bytes_per_param']:.2f} B/param over {measured['n_params']:,} "
                            f"params, {measured['breakdown']}, + {measured['step_counter_bytes']} B "
                            "of step counters"))

    one = measure_layer_activations(seq, batch, hidden, heads, 1, seed=seed)
    formula = activation_bytes_per_layer(seq, batch, hidden, heads)
    stats = layernorm_stats_bytes(seq, batch)
    checks.append(Check("one bf16 layer keeps sbh(34 + 5as/h) + LayerNorm stats (measured)",
                        one == formula + stats,
                        f"{one:,} B measured = {formula:,} formula + {stats:,} LN stats "
                        f"(s={seq}, b={batch}, h={hidden}, a={heads})"))
    stacked = measure_layer_activations(seq, batch, hidden, heads, layers, seed=seed)
    checks.append(Check(f"{layers} layers keep {layers} x one layer", stacked == layers * one,
                        f"{stacked:,} B"))
    metrics["activation_bytes_per_layer"] = one

    dtypes = autocast_dtypes(seed)
    checks.append(Check("autocast: matmuls run in bf16 / fp16",
                        [dtypes[k]["matmul_dtype"] for k in ("bf16", "fp16")] == ["bfloat16", "float16"],
                        str(dtypes)))
    grads = small_gradients()
    lost = {"fp16": underflow_fraction(grads, torch.float16),
            "fp16_scaled": underflow_fraction(grads, torch.float16, 2.0 ** 16),
            "bf16": underflow_fraction(grads, torch.bfloat16)}
    checks.append(Check("fp16 loses small gradients; x65536 or bf16 keeps them",
                        lost["fp16"] > 0.4 and lost["fp16_scaled"] == 0 and lost["bf16"] == 0,
                        f"zeroed: fp16 {lost['fp16']:.1%}, fp16 x 2^16 {lost['fp16_scaled']:.1%}, "
                        f"bf16 {lost['bf16']:.1%}"))
    metrics["underflow"] = lost
    metrics["autocast"] = dtypes

    scaler = compare_with_grad_scaler()
    checks.append(Check("DynamicLossScaler == GradScaler: scales, skipped steps, weights",
                        scaler["ours"] == scaler["torch"] and scaler["weights_equal"]
                        and scaler["ours"]["skipped"] == [2, 7, 8],
                        f"scales {scaler['ours']['scales']}, skipped {scaler['ours']['skipped']}"))
    metrics["loss_scales"] = scaler["ours"]["scales"]

    recompute = compare_recomputation(seq, batch, hidden, heads, layers, seed)
    checks.append(Check("recomputation: same gradients, bitwise", recompute["grads_equal"],
                        "torch.equal on every parameter's gradient (dropout replayed)"))
    checks.append(Check("recomputation saves L x (layer's activations - its input) (measured)",
                        recompute["saved_bytes"] == recompute["saved_bytes_formula"],
                        f"{recompute['plain']['activation_bytes']:,} -> "
                        f"{recompute['recompute']['activation_bytes']:,} B after forward; "
                        f"saved {recompute['saved_bytes']:,} B, "
                        f"formula {recompute['saved_bytes_formula']:,}"))
    metrics["recompute"] = recompute

    eight = compare_adam8bit(steps, hidden, heads, layers, seq, 16, seed)
    checks.append(Check("our Adam (8-bit off) == torch Adam", eight["ours_fp32_vs_torch_adam"] == 0,
                        f"max |weight diff| {eight['ours_fp32_vs_torch_adam']:.1e} after {steps} steps"))
    checks.append(Check("8-bit states: measured bytes == formula, ~75% less on quantized tensors",
                        eight["state_bytes_8"] == eight["state_bytes_8_formula"]
                        and eight["reduction_quantized"] > 0.74,
                        f"{eight['state_bytes_32']:,} -> {eight['state_bytes_8']:,} B "
                        f"({eight['reduction_total']:.1%} less in all, "
                        f"{eight['reduction_quantized']:.2%} on the quantized "
                        f"{eight['quantized_fraction']:.0%} of parameters)"))
    gap = eight["final_loss_gap"]
    learned = eight["first_loss"] - eight["final_loss"]["adam"]
    checks.append(Check("8-bit Adam's curve stays close to Adam's (gap < 5% of what Adam learned)",
                        abs(gap) < 0.05 * learned,
                        f"final loss {eight['final_loss']['adam']:.4f} (Adam) vs "
                        f"{eight['final_loss']['adam8bit']:.4f} (8-bit), from {eight['first_loss']:.3f}"))
    metrics["adam8bit"] = {k: v for k, v in eight.items() if k != "curves"}
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Memory of a training step: a tracker, mixed precision, loss scaling, "
                           "recomputation and 8-bit Adam, each measured.", world_size=1,
                           max_world_size=1)
    parser.add_argument("--seq", type=int_in(1, 1024), default=16, help="sequence length (default 16)")
    parser.add_argument("--batch", type=int_in(1, 256), default=2, help="batch (default 2)")
    parser.add_argument("--hidden", type=int_in(8, 1024), default=64, help="hidden size (default 64)")
    parser.add_argument("--heads", type=int_in(1, 64), default=4, help="attention heads (default 4)")
    parser.add_argument("--layers", type=int_in(1, 16), default=2, help="layers (default 2)")
    parser.add_argument("--steps", type=int_in(10, 2000), default=150,
                        help="training steps for the 8-bit Adam curve (default 150)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        parser.error("--device cuda: this demo runs on the CPU (the notebook runs cuda_cross_check())")
    check_args(parser, args)
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.quick:
        args.steps = min(args.steps, 60)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    (result,) = launch(verify_worker, 1, (args.seed, args.seq, args.batch, args.hidden, args.heads,
                                          args.layers, args.steps, args.fault, args.fault_rank),
                       device="cpu", timeout_s=args.timeout)
    checks = [Check(**c) for c in result["checks"]]
    metrics = result["metrics"]
    example = training_memory(**GPT2_XL)
    metrics["gpt2_xl_gb"] = {"states": example["states_bytes"] / 1e9,
                             "activations": example["activation_bytes"] / 1e9}
    metrics["headline"] = (f"16 B/param measured; 8-bit Adam states "
                           f"{metrics['adam8bit']['reduction_quantized']:.1%} smaller")
    return finish(Report(LESSON, "cpu", "none", 1, checks, metrics), args.json, started)


if __name__ == "__main__":
    run_main(main)
