"""Lesson 07's proof: the technique (main.py, mixed_precision.py, adam8bit.py) against
PyTorch's own tools, and measured.

* the tracker against torch.distributed._tools MemTracker (the same step, the same bytes);
* bytes per parameter measured for each recipe; the activation formula measured op by op;
* mixed precision: autocast dtypes, fp16 underflow, bf16 swallowing small updates;
* `DynamicLossScaler` against torch.amp.GradScaler, step for step, with injected overflows;
* recomputation: bitwise gradients and the bytes it saves; GPT-2 XL's backward peak measured on
  the meta device (shapes only, no memory);
* 8-bit Adam: state bytes against the formula, the training curve beside Adam's;
* on a GPU, the tracker beside the CUDA caching allocator; and the CLI (`main()`).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn

from lessons._launch import RankContext, inject_fault, launch
from lessons._report import Check, Report, check_args, finish, int_in, lesson_parser

from . import adam8bit, mixed_precision, tiny_gpt
from . import main as memory

LESSON = "07_memory"


# ============================================================================ the tracker


class LossMLP(nn.Sequential):
    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).pow(2).mean()


def make_mlp(seed: int, width: int = 64, dtype=torch.float32) -> LossMLP:
    torch.manual_seed(seed)
    return LossMLP(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).to(dtype)


def compare_with_torch_memtracker(seed: int = 0) -> dict:
    """The same step under our tracker and under torch.distributed._tools MemTracker.

    Both count unique storages, so the peak totals must be equal to the byte. Their categories
    differ in one place: MemTracker files the optimizer's temporaries under "Optstate"."""
    from torch.distributed._tools.mem_tracker import MemTracker

    results = {}
    for name in ("ours", "torch"):
        model = make_mlp(seed)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        batch = (torch.randn(32, 64, generator=torch.Generator().manual_seed(seed)),)
        if name == "ours":
            tracker = memory.MemoryTracker()
            tracker.mark(model.parameters(), "parameter")
            with tracker:
                memory.tracked_step(tracker, model, optimizer, batch)
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


# ============================================================================ model states

RECIPES = ("fp32_adam", "mixed_adam", "mixed_adam_main_grad", "mixed_adam_fp32_accum")


def measure_model_states(recipe: str, seed: int = 0) -> dict:
    """Bytes live after one step with `recipe`, per category, and per parameter.

    torch's Adam keeps one 4-byte `step` counter per parameter tensor; it is reported apart so
    the per-parameter figure is the formula's."""
    dtype = torch.float32 if recipe == "fp32_adam" else torch.bfloat16
    model = make_mlp(seed, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    batch = (torch.randn(32, 64, generator=torch.Generator().manual_seed(seed), dtype=dtype),)
    tracker = memory.MemoryTracker()
    tracker.mark(model.parameters(), "parameter")
    with tracker:
        if recipe == "fp32_adam":
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
        else:
            optimizer = mixed_precision.MixedPrecisionAdam(
                model.parameters(), fp32_accumulation=recipe != "mixed_adam",
                free_model_grads=recipe == "mixed_adam_main_grad")
        memory.tracked_step(tracker, model, optimizer, batch)
        if recipe != "fp32_adam":
            tracker.mark(optimizer.tensors(), "optimizer")
            tracker.mark(optimizer.main_grads or [], "gradient")
        counters = [t for t in memory.optimizer_tensors(optimizer) if t.dim() == 0]
        live = tracker.breakdown()
    counter_bytes = sum(t.untyped_storage().nbytes() for t in counters)
    states = live["parameter"] + live["gradient"] + live["optimizer"] - counter_bytes
    return {"recipe": recipe, "n_params": n_params, "breakdown": live,
            "step_counter_bytes": counter_bytes, "bytes_per_param": states / n_params}


# ============================================================================ mixed precision


def autocast_dtypes(seed: int = 0) -> dict:
    """Under autocast a matmul runs in the low-precision dtype; the loss stays near fp32's."""
    model = make_mlp(seed)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        reference = float(model.loss(x))
    results = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
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


def fp16_flush_threshold() -> dict:
    """fp16's smallest subnormal is 2^-24; a value rounds to 0 at or below half of it, 2^-25,
    and up to 2^-24 just above (round to nearest, ties to even)."""
    at, above = torch.tensor([2.0 ** -25, 2.0 ** -25 * (1 + 2.0 ** -10)]).half().float().tolist()
    return {"smallest_subnormal": 2.0 ** -24, "threshold": 2.0 ** -25,
            "at_threshold": at, "just_above": above}


def bf16_rounding_at_one() -> dict:
    """bf16's neighbours of 1.0 are 1 + 2^-7 above and 1 - 2^-8 below, so 1.0 swallows an
    increase up to half the upward step (2^-8 ~ 0.0039) and a decrease up to 2^-9 ~ 0.002."""
    one = torch.ones((), dtype=torch.bfloat16)
    return {"ulp_up": 2.0 ** -7, "ulp_down": 2.0 ** -8, "up_threshold": 2.0 ** -8,
            "down_threshold": 2.0 ** -9,
            "plus_0.0038": float(one + 0.0038), "plus_0.004": float(one + 0.004),
            "minus_0.0019": float(one - 0.0019), "minus_0.002": float(one - 0.002)}


def codebook_stats(signed: bool) -> dict:
    """The dynamic codebook's resolution: codes, the smallest nonzero magnitude, and half the
    gap to the next code relative to the values in between (from the top of the gap, where it
    is smallest, to its bottom, where it is largest)."""
    book = adam8bit.CODEBOOKS[signed].double()
    positive = book[book > 0]
    half = (positive[1:] - positive[:-1]) / 2
    return {"codes": book.numel(), "smallest": float(positive[0]),
            "half_gap_min": float((half / positive[1:]).min()),
            "half_gap_max": float((half / positive[:-1]).max())}


def fp8_demo(seed: int = 0) -> dict:
    """The FP8 formats' limits (torch.finfo) and what per-tensor scaling buys: the share of the
    small gradients (log-uniform in [1e-9, 1e-6]) that E4M3 and E5M2 flush to 0 unscaled and
    scaled, and the largest relative error of the scaled values that stay normal."""
    grads = small_gradients(seed=seed).double()
    result = {}
    for fmt, dtype in mixed_precision.FP8.items():
        info = torch.finfo(dtype)
        plain, _ = mixed_precision.fp8_round_trip(grads, fmt, scaled=False)
        scaled, scale = mixed_precision.fp8_round_trip(grads, fmt)
        normal = grads * scale >= info.smallest_normal
        result[fmt] = {"max": info.max, "smallest_normal": info.smallest_normal,
                       "zeroed_unscaled": float((plain == 0).double().mean()),
                       "zeroed_scaled": float((scaled == 0).double().mean()),
                       "max_rel_err_normal": float(((scaled - grads).abs() / grads)[normal].max())}
    return result


def swallowed_updates(steps: int = 100, update: float = 1e-3) -> dict:
    """A weight of 1.0 receives `steps` updates of +update. In bf16 each add of less than 2^-8
    (half the step to 1 + 2^-7) rounds back to 1.0, so all of them are lost; an fp32 master
    weight keeps them, and the bf16 copy made from it moves."""
    weight16 = torch.ones(1, dtype=torch.bfloat16)
    master = torch.ones(1, dtype=torch.float32)
    for _ in range(steps):
        weight16 += update
        master += update
    return {"bf16": float(weight16), "fp32_master": float(master),
            "bf16_copy_of_master": float(master.bfloat16()), "expected": 1 + steps * update}


def compare_with_grad_scaler(steps: int = 12, overflow_steps: tuple[int, ...] = (2, 7, 8),
                             growth_interval: int = 3, seed: int = 0) -> dict:
    """Train the same model with our scaler and with torch.amp.GradScaler; at `overflow_steps`
    one gradient element is set to inf in both. Scales, skipped steps and weights must agree."""
    runs = {}
    for name in ("ours", "torch"):
        model = make_mlp(seed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = (mixed_precision.DynamicLossScaler(growth_interval=growth_interval) if name == "ours"
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


# ============================================================================ recomputation


def forward_backward(tracker: memory.MemoryTracker, model, tokens, targets) -> int:
    """Forward (new storages filed as activations) and backward under `tracker`. Returns the
    activation bytes alive after forward; the tracker's peak is then the backward's."""
    with tracker:
        with tracker.phase("forward"):
            loss = model.loss(tokens, targets)
        kept = tracker.breakdown()["activation"]
        tracker.reset_peak()
        with tracker.phase("backward"):
            loss.backward()
    return kept


def compare_recomputation(seq: int, batch: int, hidden: int, heads: int, layers: int,
                          seed: int = 0) -> dict:
    """Activation bytes alive after forward, the backward peak and the gradients of one fp32
    step without recomputation ("plain"), with only the attention cores recomputed
    ("selective") and with whole layers recomputed ("recompute")."""
    tokens, targets = tiny_gpt.markov_batches(64, seq, batch, 1, seed)[0]
    results = {}
    for name, recompute in (("plain", False), ("selective", "selective"), ("recompute", True)):
        torch.manual_seed(seed)
        model = tiny_gpt.TinyGPT(64, hidden, heads, layers, seq, recompute=recompute)
        tracker = memory.MemoryTracker()
        tracker.mark(model.parameters(), "parameter")
        torch.manual_seed(seed + 1)  # the same dropout masks in every run
        after_forward = forward_backward(tracker, model, tokens, targets)
        results[name] = {"activation_bytes": after_forward, "backward_peak_bytes": tracker.peak_bytes,
                         "grads": [p.grad.clone() for p in model.parameters()]}
    grads = [results[name].pop("grads") for name in ("plain", "selective", "recompute")]
    results["grads_equal"] = all(torch.equal(a, b) for other in grads[1:] for a, b in zip(grads[0], other))
    plain, selective, recomputed = results["plain"], results["selective"], results["recompute"]
    results["saved_bytes"] = plain["activation_bytes"] - recomputed["activation_bytes"]
    # each layer keeps its fp32 input instead of all it saves (formula + LayerNorm statistics)
    results["saved_bytes_formula"] = layers * (
        memory.activation_bytes_per_layer(seq, batch, hidden, heads, 4)
        + memory.layernorm_stats_bytes(seq, batch, 4) - 4 * seq * batch * hidden)
    # selective drops exactly the a s^2 b term: softmax output 4 + mask 1 + dropped 4 bytes (fp32)
    results["selective_saved_bytes"] = plain["activation_bytes"] - selective["activation_bytes"]
    results["selective_saved_bytes_formula"] = layers * heads * seq * seq * batch * (2 * 4 + 1)
    return results


def gpt_step_on_meta(layers: int, hidden: int, heads: int, vocab: int, seq: int, batch: int = 1,
                     recompute: bool | str = False) -> dict:
    """One bf16 step of TinyGPT (dropout on) at a real size, on the meta device: shapes and
    bytes, no memory and no arithmetic. The gradients are allocated up front, as a training loop
    that keeps them does, so at the backward peak beyond = peak - weights - gradients is what
    activations and the backward's temporaries add to the model states."""
    with torch.device("meta"):
        model = tiny_gpt.TinyGPT(vocab, hidden, heads, layers, seq, recompute=recompute).bfloat16()
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    tracker = memory.MemoryTracker()
    tracker.mark(model.parameters(), "parameter")
    tracker.mark([p.grad for p in model.parameters()], "gradient")
    kept = forward_backward(tracker, model, tokens, tokens)
    states = tracker.breakdown()
    return {"kept_after_forward": kept,
            "backward_beyond_states": tracker.peak_bytes - states["parameter"] - states["gradient"]}


# ============================================================================ 8-bit Adam


def make_optimizer(name: str, params, lr: float):
    return {"adam": lambda: torch.optim.Adam(params, lr=lr, foreach=False),
            "adam32_ours": lambda: adam8bit.Adam8bit(params, lr=lr, min_8bit_numel=math.inf),
            "adam8bit": lambda: adam8bit.Adam8bit(params, lr=lr)}[name]()


def train_curve(optimizer_name: str, batches: list[tuple], hidden: int, heads: int, layers: int,
                seq: int, lr: float = 3e-3, seed: int = 0, dtype=torch.float32) -> dict:
    """Losses of TinyGPT (no dropout) trained with one optimizer, and its final weights.

    Machine-dependent in its last digits: another CPU's kernels round the float sums of a
    matmul differently, and the 8-bit rounding turns such last-bit differences into other
    codes, so the 8-bit curve's final loss moves by a few 1e-4 between CPUs (even in float64)."""
    torch.manual_seed(seed)
    model = tiny_gpt.TinyGPT(64, hidden, heads, layers, seq, dropout=0.0).to(dtype)
    optimizer = make_optimizer(optimizer_name, model.parameters(), lr)
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad()
        loss = model.loss(tokens, targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": [p.detach().clone() for p in model.parameters()]}


def optimizer_state_bytes(optimizer_name: str, hidden: int, heads: int, layers: int, seq: int,
                          seed: int = 0) -> dict:
    """One fp32 step under the tracker: the bytes of the optimizer's states (m and v, codes and
    absmax; not Adam's step counters) and the parameters' sizes."""
    torch.manual_seed(seed)
    model = tiny_gpt.TinyGPT(64, hidden, heads, layers, seq, dropout=0.0)
    optimizer = make_optimizer(optimizer_name, model.parameters(), 3e-3)
    tokens, targets = tiny_gpt.markov_batches(64, seq, 2, 1, seed)[0]
    tracker = memory.MemoryTracker()
    with tracker:
        model.loss(tokens, targets).backward()
        optimizer.step()
        state = [t for t in memory.optimizer_tensors(optimizer) if t.dim() > 0]
        tracker.mark(state, "optimizer")
        state_bytes = tracker.breakdown()["optimizer"]
    return {"state_bytes": state_bytes, "numels": [p.numel() for p in model.parameters()]}


def compare_adam8bit(steps: int, hidden: int, heads: int, layers: int, seq: int, batch: int,
                     seed: int = 0, ours_fp32: bool = True) -> dict:
    """Adam and 8-bit Adam trained on the same batches: their states' bytes and final losses.
    With `ours_fp32`, a third run (our Adam with 8-bit off) is compared with torch's Adam bit
    for bit ("ours_fp32_vs_torch_adam"; None without it: the README's numbers need only the
    first two runs)."""
    batches = tiny_gpt.markov_batches(64, seq, batch, steps, seed)
    names = ("adam", "adam32_ours", "adam8bit") if ours_fp32 else ("adam", "adam8bit")
    runs = {name: train_curve(name, batches, hidden, heads, layers, seq, seed=seed) for name in names}
    sizes = {name: optimizer_state_bytes(name, hidden, heads, layers, seq, seed)
             for name in ("adam", "adam8bit")}
    numels = sizes["adam"]["numels"]
    big = [n for n in numels if n >= adam8bit.MIN_8BIT_NUMEL]
    tail = max(1, steps // 10)  # compare the mean of the last 10% of steps (less noise)
    final = {name: sum(run["losses"][-tail:]) / tail for name, run in runs.items()}
    ours_vs_torch = max(float((a - b).abs().max()) for a, b in
                        zip(runs["adam"]["weights"], runs["adam32_ours"]["weights"])) if ours_fp32 else None
    return {
        "state_bytes_32": sizes["adam"]["state_bytes"],
        "state_bytes_8": sizes["adam8bit"]["state_bytes"],
        "state_bytes_8_formula": sum(adam8bit.adam8bit_state_bytes(n) for n in numels),
        "reduction_total": 1 - sizes["adam8bit"]["state_bytes"] / sizes["adam"]["state_bytes"],
        "reduction_quantized": 1 - sum(adam8bit.adam8bit_state_bytes(n) for n in big) / (8 * sum(big)),
        "quantized_fraction": sum(big) / sum(numels),
        "first_loss": runs["adam"]["losses"][0],
        "final_loss": final,
        "final_loss_gap": final["adam8bit"] - final["adam"],
        "ours_fp32_vs_torch_adam": ours_vs_torch,
        "curves": {name: run["losses"] for name, run in runs.items()},
    }


def block_saving(block: int, numel: int = 2 ** 30) -> float:
    """The 8-bit states' saving against two fp32 states on a large tensor: 1 - (2 + 8/B)/8."""
    return 1 - adam8bit.adam8bit_state_bytes(numel, block) / (8 * numel)


# ============================================================================ GPU cross-check


def cuda_cross_check(seed: int = 0) -> dict:
    """On a GPU: our tracker's peak for one bf16 training step of TinyGPT beside the caching
    allocator's max_memory_allocated (which rounds every block up to 512 bytes).

    A first, untracked step warms up (Adam's states, cuBLAS's workspace, the allocator's pools);
    then the peak statistics are reset and both count only what the second step adds."""
    device = torch.device("cuda")
    torch.manual_seed(seed)
    model = tiny_gpt.TinyGPT(64, 256, 8, 4, 128).to(device=device, dtype=torch.bfloat16)
    optimizer = mixed_precision.MixedPrecisionAdam(model.parameters())
    batches = [tuple(t.to(device) for t in b) for b in tiny_gpt.markov_batches(64, 128, 8, 2, seed)]
    model.loss(*batches[0]).backward()  # the warm-up step
    optimizer.step()
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    tracker = memory.MemoryTracker(device)
    tracker.mark(list(model.parameters()) + optimizer.tensors(), "parameter")
    start = tracker.live_bytes
    with tracker:
        memory.tracked_step(tracker, model, optimizer, batches[1])
    torch.cuda.synchronize()
    ours = tracker.peak_bytes - start
    allocator = torch.cuda.max_memory_allocated() - baseline
    return {"ours_peak_bytes": ours, "cuda_peak_bytes": allocator, "ratio": ours / allocator}


# ============================================================================ the checks


def verify_worker(ctx: RankContext, seed: int, seq: int, batch: int, hidden: int, heads: int,
                  layers: int, steps: int, fault: str | None, fault_rank: int) -> dict:
    inject_fault(ctx, fault, fault_rank)
    checks, metrics = [], {}

    versus = compare_with_torch_memtracker(seed)
    checks.append(Check("tracker peak == torch MemTracker's peak (and its categories)",
                        versus["ours"] == versus["torch"],
                        f"ours {versus['ours']}, torch {versus['torch']}"))
    metrics["memtracker"] = versus

    metrics["bytes_per_param"] = {}
    for recipe in RECIPES:
        measured = measure_model_states(recipe, seed)
        expected = memory.model_state_bytes_per_param(recipe)
        metrics["bytes_per_param"][recipe] = measured["bytes_per_param"]
        checks.append(Check(f"{recipe}: {expected} bytes per parameter (measured)",
                            measured["bytes_per_param"] == expected,
                            f"{measured['bytes_per_param']:.2f} B/param over {measured['n_params']:,} "
                            f"params, {measured['breakdown']}, + {measured['step_counter_bytes']} B "
                            "of step counters"))

    one = memory.measure_layer_activations(seq, batch, hidden, heads, 1, seed=seed)
    formula = memory.activation_bytes_per_layer(seq, batch, hidden, heads)
    stats = memory.layernorm_stats_bytes(seq, batch)
    checks.append(Check("one bf16 layer keeps sbh(34 + 5as/h) + LayerNorm stats (measured)",
                        one == formula + stats,
                        f"{one:,} B measured = {formula:,} formula + {stats:,} LN stats "
                        f"(s={seq}, b={batch}, h={hidden}, a={heads})"))
    stacked = memory.measure_layer_activations(seq, batch, hidden, heads, layers, seed=seed)
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
    flush = fp16_flush_threshold()
    checks.append(Check("fp16 flushes values <= 2^-25 to 0; x65536 or bf16 keeps the gradients",
                        flush["at_threshold"] == 0 and flush["just_above"] == 2.0 ** -24
                        and lost["fp16"] > 0.4 and lost["fp16_scaled"] == 0 and lost["bf16"] == 0,
                        f"zeroed: fp16 {lost['fp16']:.1%}, fp16 x 2^16 {lost['fp16_scaled']:.1%}, "
                        f"bf16 {lost['bf16']:.1%}"))
    swallowed = swallowed_updates()
    checks.append(Check("bf16 weights swallow small updates; the fp32 master keeps them",
                        swallowed["bf16"] == 1.0
                        and abs(swallowed["fp32_master"] - swallowed["expected"]) < 1e-5,
                        f"1.0 + 100 x 0.001: bf16 {swallowed['bf16']}, fp32 master "
                        f"{swallowed['fp32_master']:.6f} (its bf16 copy "
                        f"{swallowed['bf16_copy_of_master']})"))
    rounding = bf16_rounding_at_one()
    checks.append(Check("bf16 at 1.0: + up to 2^-8 and - up to 2^-9 round back to 1.0",
                        (rounding["plus_0.0038"], rounding["plus_0.004"], rounding["minus_0.0019"],
                         rounding["minus_0.002"]) == (1.0, 1.0 + 2 ** -7, 1.0, 1.0 - 2 ** -8),
                        f"1 + 0.0038 -> {rounding['plus_0.0038']}, 1 + 0.004 -> "
                        f"{rounding['plus_0.004']}, 1 - 0.0019 -> {rounding['minus_0.0019']}, "
                        f"1 - 0.002 -> {rounding['minus_0.002']}"))
    fp8 = fp8_demo(seed)
    checks.append(Check("FP8: per-tensor scaling keeps small gradients; error <= half a mantissa step",
                        all(fp8[f]["zeroed_unscaled"] == 1.0 and fp8[f]["zeroed_scaled"] < 0.01
                            for f in fp8) and fp8["e4m3"]["max_rel_err_normal"] <= 2 ** -4
                        and fp8["e5m2"]["max_rel_err_normal"] <= 2 ** -3,
                        ", ".join(f"{f}: max {v['max']:g}, zeroed {v['zeroed_unscaled']:.0%} unscaled, "
                                  f"{v['zeroed_scaled']:.2%} scaled, max rel err "
                                  f"{v['max_rel_err_normal']:.3f}" for f, v in fp8.items())))
    metrics["fp8"] = fp8
    metrics["underflow"] = lost
    metrics["autocast"] = dtypes
    metrics["swallowed_updates"] = swallowed

    scaler = compare_with_grad_scaler()
    checks.append(Check("DynamicLossScaler == GradScaler: scales, skipped steps, weights",
                        scaler["ours"] == scaler["torch"] and scaler["weights_equal"]
                        and scaler["ours"]["skipped"] == [2, 7, 8],
                        f"scales {scaler['ours']['scales']}, skipped {scaler['ours']['skipped']}"))
    metrics["loss_scales"] = scaler["ours"]["scales"]

    recompute = compare_recomputation(seq, batch, hidden, heads, layers, seed)
    checks.append(Check("recomputation (whole layers, attention cores): same gradients, bitwise",
                        recompute["grads_equal"],
                        "torch.equal on every parameter's gradient (dropout replayed)"))
    checks.append(Check("recomputation saves L x (layer's activations - its input) (measured)",
                        recompute["saved_bytes"] == recompute["saved_bytes_formula"],
                        f"{recompute['plain']['activation_bytes']:,} -> "
                        f"{recompute['recompute']['activation_bytes']:,} B after forward; "
                        f"saved {recompute['saved_bytes']:,} B, "
                        f"formula {recompute['saved_bytes_formula']:,}"))
    checks.append(Check("selective recomputation saves exactly the 5as/h term (measured)",
                        recompute["selective_saved_bytes"] == recompute["selective_saved_bytes_formula"],
                        f"{recompute['plain']['activation_bytes']:,} -> "
                        f"{recompute['selective']['activation_bytes']:,} B after forward; saved "
                        f"{recompute['selective_saved_bytes']:,} B = L a s^2 b x 9 (fp32)"))
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
    example = memory.training_memory(**memory.GPT2_XL)
    metrics["gpt2_xl_gb"] = {"states": example["states_bytes"] / 1e9,
                             "activations": example["activation_bytes"] / 1e9}
    metrics["headline"] = (f"16 B/param measured; 8-bit Adam states "
                           f"{metrics['adam8bit']['reduction_quantized']:.1%} smaller")
    return finish(Report(LESSON, "cpu", "none", 1, checks, metrics), args.json, started)

