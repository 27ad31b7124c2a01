"""Lesson 08's proof: the chunk manager (main.py) and its cost model (cost_model.py), measured.

* every (persistent chunks, recomputed blocks) configuration trains bitwise like plain training
  with torch.optim.Adam (and, in the tests, with AdamW, SGD with momentum and frozen parameters);
* the profiler (ProTrain's memory-aware profiler in miniature): lesson 07's tracker for bytes,
  the clock for the copies the manager makes and the steps it runs;
* predicted peaks against the tracker, predicted fetches against the counted ones, the
  planner's choice against the budget; the GPT-2 XL worked examples (memory and PCIe time);
* the CLI (`main()`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lessons._checks import best_time, synchronize
from lessons._launch import RankContext, inject_fault, launch
from lessons._report import Check, Report, check_args, finish, float_in, int_in, lesson_parser

from . import cost_model
from . import main as offload

LESSON = "08_offload"
memory = offload.memory  # lesson 07's technique
tiny_gpt = offload.tiny_gpt  # lesson 07's TinyGPT, markov_batches


# ============================================================================ training runs


def offload_batches(config: dict, steps: int, seed: int) -> list[tuple]:
    """Lesson 07's synthetic language (markov_batches), on the model's device."""
    batches = tiny_gpt.markov_batches(config["vocab"], config["seq"], config["batch"], steps, seed)
    return [tuple(t.to(config.get("device", "cpu")) for t in batch) for batch in batches]


def freeze(model, frozen: tuple[str, ...]) -> None:
    """requires_grad = False for the parameters named in `frozen` (the LoRA case: base weights
    frozen), before anything is built on the model."""
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def train_plain(config: dict, steps: int, seed: int, optimizer_class=torch.optim.Adam,
                frozen: tuple[str, ...] = (), unused_at: dict | None = None, **defaults) -> dict:
    """The reference: the same model trained with `optimizer_class(model.parameters(),
    **defaults)` (default Adam, lr 1e-3), nothing offloaded. `frozen` parameters never get a
    gradient; `unused_at[step]` names parameters that get none in that step only."""
    defaults.setdefault("lr", 1e-3)
    model = offload.make_offload_model(config, seed)
    freeze(model, frozen)
    optimizer = optimizer_class(model.parameters(), **defaults)
    losses = []
    for step, (tokens, targets) in enumerate(offload_batches(config, steps, seed)):
        optimizer.zero_grad(set_to_none=True)
        with unused(model, (unused_at or {}).get(step, ())):
            loss = model.loss(tokens, targets)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "weights": [p.detach().cpu().clone() for p in model.parameters()]}


@contextlib.contextmanager
def unused(model, names) -> None:
    """Inside: the named (trainable) parameters take no gradient, as a parameter that a step
    does not use; restored afterwards."""
    params = [p for n, p in model.named_parameters() if n in names]
    for param in params:
        param.requires_grad_(False)
    try:
        yield
    finally:
        for param in params:
            param.requires_grad_(True)


def attach_tracker(manager: offload.ChunkManager, tracker, moments: dict) -> None:
    """File the manager's tensors in lesson 07's tracker (device vs host), run its steps in the
    tracker's phases, and record into `moments` the device peak of each moment ("forward_peak",
    ...) and the device bytes still live when it ends ("forward_end": what forward leaves for
    backward)."""
    config = manager.config
    tracker.mark(offload.fixed_parameters(manager.model), "parameter")
    tracker.mark(manager.flat[:config.n_persist] + manager.buffers, "parameter")
    tracker.mark(manager.grad[:config.n_persist], "gradient")
    tracker.mark(manager.flat[config.n_persist:] + manager.grad[config.n_persist:], "host")
    mark_states(tracker, manager)

    def observe(name: str) -> None:
        if name == "backward_peak":
            tracker.mark((p.grad for p in offload.fixed_parameters(manager.model)), "gradient")
        if name == "step_peak":
            mark_states(tracker, manager)
        moments[name] = tracker.peak_bytes
        moments[name.replace("_peak", "_end")] = tracker.live_bytes  # what stays, at that point
        tracker.reset_peak()

    manager.phase, manager.observe = tracker.phase, observe


def mark_states(tracker, manager: offload.ChunkManager) -> None:
    """The device optimizer's states are device memory; its scalar step counters (torch's Adam
    keeps them on the CPU unless capturable or fused) and all the host optimizer's states are
    host memory."""
    states = memory.optimizer_tensors(manager.device_optimizer)
    tracker.mark([t for t in states if t.dim() > 0], "optimizer")
    tracker.mark([t for t in states if t.dim() == 0], "host")
    if manager.host_optimizer is not None:
        tracker.mark(memory.optimizer_tensors(manager.host_optimizer), "host")


class CopyCounter(TorchDispatchMode):
    """Counts the elements copied into the manager's chunk buffers (every aten copy_ whose
    destination shares a buffer's storage): what the fetches really move, whatever code
    issues them."""

    def __init__(self, manager: offload.ChunkManager) -> None:
        super().__init__()
        self.buffers = {b.untyped_storage().data_ptr() for b in manager.buffers}
        self.copies, self.numel = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and \
                args[0].untyped_storage().data_ptr() in self.buffers:
            self.copies, self.numel = self.copies + 1, self.numel + args[0].numel()
        return func(*args, **(kwargs or {}))


def final_weights(manager: offload.ChunkManager) -> list[torch.Tensor]:
    """Every parameter's values, in model.parameters() order, read from where they live (its
    chunk on the device or the host; the fixed parameters from the model)."""
    weights = []
    for param in manager.model.parameters():
        slot = manager.slot_of.get(id(param))
        value = param if slot is None else manager._view(manager.flat[slot.chunk], slot)
        weights.append(value.detach().cpu().clone())
    return weights


def train_offloaded(config: dict, offload_config: offload.OffloadConfig, steps: int, seed: int,
                    optimizer_class=torch.optim.Adam, frozen: tuple[str, ...] = (),
                    unused_at: dict | None = None, **defaults) -> dict:
    """Train with `offload_config` and `optimizer_class(**defaults)` (default Adam, lr 1e-3;
    `frozen` and `unused_at` as in train_plain). The last step runs under lesson 07's tracker:
    its device bytes at the start and at three moments (see ChunkManager.step), its peak, and
    under a CopyCounter the chunk copies and the elements they moved. "seconds": the median
    untracked step after the first (nan with fewer than 3)."""
    defaults.setdefault("lr", 1e-3)
    device = config.get("device", "cpu")
    model = offload.make_offload_model(config, seed)
    freeze(model, frozen)
    manager = offload.ChunkManager(model, offload_config, config["chunk_numel"], optimizer_class,
                                   device=device, **defaults)
    batches = offload_batches(config, steps, seed)
    losses, seconds = [], []
    for step, (tokens, targets) in enumerate(batches[:-1]):
        synchronize(device)
        started = time.perf_counter()
        with unused(model, (unused_at or {}).get(step, ())):
            losses.append(manager.step(tokens, targets))
        synchronize(device)
        seconds.append(time.perf_counter() - started)
    tracker, copies = memory.MemoryTracker(device), CopyCounter(manager)
    moments: dict = {}
    attach_tracker(manager, tracker, moments)
    tracker.reset_peak()
    manager.pool.fetches = 0
    moments["start"] = tracker.live_bytes
    with tracker, copies, unused(model, (unused_at or {}).get(len(batches) - 1, ())):
        losses.append(manager.step(*batches[-1]))
    steady = sorted(seconds[1:]) or [math.nan]  # the first step allocates Adam's states
    peak = max(moments["forward_peak"], moments["backward_peak"], moments["step_peak"])
    return {"losses": losses, "weights": final_weights(manager), "moments": moments,
            "peak_bytes": peak, "fetches": manager.pool.fetches, "copies": copies.copies,
            "copied_numel": copies.numel, "seconds": steady[len(steady) // 2]}


# ============================================================================ the profiler


def copy_seconds_per_byte(config: dict, used: list[int], repeats: int) -> tuple[float, float]:
    """The two copies the manager makes, timed as it makes them: a chunk fetch (pinned host ->
    device buffer, non-blocking, then waited for) and one block's gradients (device -> host
    with .to(), as _grad_ready does; on a CPU-only machine no copy happens: ~0)."""
    device = torch.device(config.get("device", "cpu"))
    source = torch.randn(max(used), pin_memory=device.type == "cuda")
    buffer = torch.empty(config["chunk_numel"], device=device)
    h2d = best_time(lambda: buffer[: source.numel()].copy_(source, non_blocking=True), repeats, device)
    block = memory.TransformerLayer(config["hidden"], config["heads"]).to(device)
    grads = [torch.randn_like(p).reshape(-1) for p in block.parameters()]
    d2h = best_time(lambda: [g.to("cpu") for g in grads], repeats, device)
    block_bytes = sum(g.numel() for g in grads) * cost_model.ITEMSIZE
    return h2d / (source.numel() * cost_model.ITEMSIZE), d2h / block_bytes


def adam_seconds_per_element(numel: int, device: str, repeats: int) -> float:
    flat = torch.zeros(numel, device=device)
    flat.grad = torch.randn_like(flat)
    adam = torch.optim.Adam([flat])
    return best_time(adam.step, repeats, device) / numel


def largest_in_chunks(slots: list, n_chunks: int) -> list[int]:
    """The largest parameter (elements) in each chunk: what the optimizer's temporaries scale with."""
    largest = [0] * n_chunks
    for slot in slots:
        largest[slot.chunk] = max(largest[slot.chunk], slot.numel)
    return largest


def profile_model(config: dict, seed: int, repeats: int = 3) -> tuple[cost_model.Profile, dict]:
    """Measure what the cost model needs, on this machine, from plain steps (ProTrain's
    memory-aware profiler in miniature): lesson 07's tracker for bytes, a clock for times.
    Also returns the plain run's measured moments (static bytes included)."""
    seq, batch, hidden = config["seq"], config["batch"], config["hidden"]
    device = config.get("device", "cpu")
    act_block = memory.measure_layer_activations(seq, batch, hidden, config["heads"], 1,
                                                 dtype=torch.float32, seed=seed)
    model = offload.make_offload_model(config, seed)
    slots, used = offload.pack_chunks(model.layers, config["chunk_numel"])
    fixed = offload.fixed_parameters(model)
    profile = cost_model.Profile(used, offload.chunks_of_block(slots, config["layers"]),
                                 config["chunk_numel"], sum(p.numel() for p in fixed),
                                 max(p.numel() for p in fixed), act_block,
                                 seq * batch * hidden * cost_model.ITEMSIZE,
                                 chunk_largest=largest_in_chunks(slots, len(used)))
    plain = offload.OffloadConfig(len(used), 0)
    run = train_offloaded(config, plain, repeats + 2, seed)
    moments, static = run["moments"], cost_model.static_bytes(profile, plain)
    blocks = config["layers"] * act_block
    profile.forward_extra = moments["forward_peak"] - static - blocks
    profile.backward_extra = moments["backward_peak"] - static - blocks
    profile.step_extra = (moments["step_peak"] - static - 2 * cost_model.ITEMSIZE
                          * max([profile.largest_fixed] + profile.chunk_largest))
    profile.t_plain_step = run["seconds"]
    x = torch.randn(seq, batch, hidden, device=device)
    with torch.no_grad():
        profile.t_forward_block = best_time(lambda: model.layers[0](x), repeats, device)
    profile.t_h2d_per_byte, profile.t_d2h_per_byte = copy_seconds_per_byte(config, used, repeats)
    profile.t_adam_device = adam_seconds_per_element(max(used), device, repeats)
    # on a CPU-only machine the "device" is the host: one rate, not two noisy ones
    profile.t_adam_host = (profile.t_adam_device if device == "cpu"
                           else adam_seconds_per_element(max(used), "cpu", repeats))
    return profile, moments


# ============================================================================ GPT-2 XL


GPT2_XL = {"layers": 48, "hidden": 1600, "heads": 25, "vocab": 50257, "seq": 1024,
           "chunk_numel": 32 * 2 ** 20}


def named_model_layout(layers: int, hidden: int, heads: int, vocab: int, seq: int,
                       chunk_numel: int) -> dict:
    """Chunks and static device bytes of a real-size model, packed on the meta device (no
    memory): all chunks persistent, and none (host bytes: 16 per offloaded element); and the
    chunk fetches of one step with everything offloaded."""
    with torch.device("meta"):
        model = tiny_gpt.TinyGPT(vocab, hidden, heads, layers, seq, dropout=0.0)
    slots, used = offload.pack_chunks(model.layers, chunk_numel)
    fixed = offload.fixed_parameters(model)
    profile = cost_model.Profile(used, offload.chunks_of_block(slots, layers), chunk_numel,
                                 sum(p.numel() for p in fixed), max(p.numel() for p in fixed), 0, 0)
    every, none = offload.OffloadConfig(len(used), 0), offload.OffloadConfig(0, 0)
    return {"chunks": len(used), "chunk_numel": chunk_numel, "block_params": sum(used),
            "fixed_params": profile.fixed_numel,
            "buffers": cost_model.buffers_needed(profile, none),
            "fetches_all_offloaded": cost_model.count_fetches(profile, none),
            "fetched_numel_all_offloaded": cost_model.fetched_numel(profile, none),
            "static_all_persistent": cost_model.static_bytes(profile, every),
            "static_all_offloaded": cost_model.static_bytes(profile, none),
            "host_all_offloaded": 4 * cost_model.ITEMSIZE * sum(used)}


def offload_traffic(layout: dict, tokens: int, itemsize: int = 2, link_bytes_per_s: float = 25e9,
                    flops_per_s: float = 400e12) -> dict:
    """PCIe bytes per step against compute per step, for a model with every block chunk
    offloaded, chunks of `itemsize`-byte elements. The rates are assumptions, not
    measurements: `link_bytes_per_s` (PCIe 4.0 x16 is 31.5 GB/s per direction nominal),
    `flops_per_s` sustained bf16 (about 40% of an H100 SXM's 989 TFLOP/s dense bf16 peak), so
    the copies are priced in the same precision (itemsize 2, the default): compute runs on
    16-bit weights, and so do the chunks that feed it. Compute: 6 x N x tokens FLOPs (forward
    and backward); copies: bytes / link, the two directions not overlapped with each other.

    This lesson's manager: the chunks it fetches (up: each copies its chunk's used elements,
    fetched_numel) and every block gradient (down). ZeRO-Offload's schedule: the 16-bit
    weights of ALL parameters stay on the GPU, their 16-bit gradients go down and the updated
    16-bit weights come up, 2 + 2 bytes per parameter per step; the fp32 master weights and
    Adam's states never cross the link."""
    params = layout["block_params"] + layout["fixed_params"]
    up, down = itemsize * layout["fetched_numel_all_offloaded"], itemsize * layout["block_params"]
    zero_offload = (2 + 2) * params
    flops_per_token = 6 * params
    return {"ours_h2d_bytes": up, "ours_d2h_bytes": down, "ours_bytes": up + down,
            "ours_seconds": (up + down) / link_bytes_per_s,
            "zero_offload_bytes": zero_offload, "zero_offload_seconds": zero_offload / link_bytes_per_s,
            "compute_seconds": flops_per_token * tokens / flops_per_s,
            # tokens per step at which compute takes as long as the copies
            "break_even_tokens_ours": math.ceil((up + down) / link_bytes_per_s * flops_per_s
                                                / flops_per_token),
            "break_even_tokens_zero_offload": math.ceil(zero_offload / link_bytes_per_s * flops_per_s
                                                        / flops_per_token)}


# ============================================================================ the checks


def model_config(args) -> dict:
    return {"vocab": 64, "hidden": args.hidden, "heads": args.heads, "layers": args.layers,
            "seq": args.seq, "batch": args.batch, "chunk_numel": args.chunk_numel, "device": "cpu"}


def verify_worker(ctx: RankContext, seed: int, config: dict, steps: int, budget: int | None,
                  budget_fraction: float, safety: float, quick: bool, fault: str | None,
                  fault_rank: int) -> dict:
    inject_fault(ctx, fault, fault_rank)
    profile, _ = profile_model(config, seed)
    plain = offload.OffloadConfig(len(profile.chunk_used), 0)
    plain_peak = cost_model.predict_peak(profile, plain)
    if budget is None:
        budget = int(budget_fraction * plain_peak)
    try:
        chosen = cost_model.plan(profile, budget, safety)
    except cost_model.BudgetError as exc:
        return {"budget_error": str(exc)}
    configs = cost_model.all_configs(profile)
    if quick:  # the corners, the middle and the planner's choice
        n, layers = len(profile.chunk_used), len(profile.block_chunks)
        configs = list(dict.fromkeys([plain, offload.OffloadConfig(0, 0), offload.OffloadConfig(0, layers),
                                      offload.OffloadConfig(n // 2, layers // 2), chosen]))
    reference = train_plain(config, steps, seed)
    rows, equal, fetches_ok, static_ok = [], [], [], []
    for candidate in configs:
        run = train_offloaded(config, candidate, steps, seed)
        predicted = cost_model.predict_peak(profile, candidate)
        rows.append({"n_persist": candidate.n_persist, "n_checkpoint": candidate.n_checkpoint,
                     "peak_measured": run["peak_bytes"], "peak_predicted": predicted,
                     "rel_err": abs(predicted - run["peak_bytes"]) / run["peak_bytes"],
                     "fetches": run["fetches"],
                     "fetches_predicted": cost_model.count_fetches(profile, candidate),
                     "seconds": run["seconds"],
                     "seconds_predicted": cost_model.predict_time(profile, candidate)})
        equal.append(run["losses"] == reference["losses"] and
                     all(torch.equal(a, b) for a, b in zip(run["weights"], reference["weights"])))
        rows[-1].update(copies=run["copies"], copied_numel=run["copied_numel"],
                        copied_numel_predicted=cost_model.fetched_numel(profile, candidate))
        fetches_ok.append(rows[-1]["fetches"] == rows[-1]["fetches_predicted"] == run["copies"]
                          and run["copied_numel"] == rows[-1]["copied_numel_predicted"])
        static_ok.append(run["moments"]["start"] == cost_model.static_bytes(profile, candidate))
    worst = max(rows, key=lambda r: r["rel_err"])
    chosen_row = next(r for r in rows if (r["n_persist"], r["n_checkpoint"]) ==
                      (chosen.n_persist, chosen.n_checkpoint))
    checks = [
        Check(f"{len(configs)} configurations train bitwise like the plain run", all(equal),
              f"losses and every weight after {steps} Adam steps; failing: "
              f"{[r for r, ok in zip(rows, equal) if not ok][:1] or 'none'}"),
        Check("static device bytes (states + buffers) == the formula", all(static_ok),
              "fixed 12 B/elem, persistent chunks 16 B/elem, buffers 4 B/elem"),
        Check("predicted peak within 10% of lesson 07's tracker, every configuration",
              worst["rel_err"] <= 0.10,
              f"max relative error {worst['rel_err']:.2%} at n_persist={worst['n_persist']}, "
              f"n_checkpoint={worst['n_checkpoint']} ({worst['peak_predicted']:,} vs "
              f"{worst['peak_measured']:,} B)"),
        Check("predicted chunk fetches and copied elements == counted, every configuration",
              all(fetches_ok), "e.g. all offloaded: {fetches} fetches, {copied_numel:,} "
              "elements copied".format(**next(r for r in rows if r["n_persist"] == 0))),
        Check(f"the planner's choice fits the budget with a {safety:.2f} margin (measured)",
              math.ceil(safety * chosen_row["peak_measured"]) <= budget,
              f"budget {budget:,} B: n_persist={chosen.n_persist}, n_checkpoint={chosen.n_checkpoint}, "
              f"peak {chosen_row['peak_measured']:,} B"),
    ]
    roomy = cost_model.required_budget(profile, plain, safety)
    kept = cost_model.plan(profile, roomy, safety)
    checks.append(Check("with room for everything the planner keeps everything (never slower)",
                        kept == plain
                        and cost_model.predict_time(profile, kept) <= cost_model.predict_time(profile, plain),
                        f"budget {roomy:,} B -> n_persist={kept.n_persist}, "
                        f"n_checkpoint={kept.n_checkpoint}"))
    smallest = min(cost_model.required_budget(profile, c, safety) for c in cost_model.all_configs(profile))
    try:
        cost_model.plan(profile, smallest - 1, safety)
        message = "accepted"
    except cost_model.BudgetError as exc:
        message = str(exc)
    checks.append(Check("an impossible budget names the smallest feasible one",
                        f"smallest feasible budget is {smallest:,} bytes" in message
                        and cost_model.plan(profile, smallest, safety) is not None, message))
    time_errors = sorted(abs(r["seconds_predicted"] - r["seconds"]) / r["seconds"] for r in rows)
    metrics = {"peak_pred_rel_err_max": worst["rel_err"], "budget": budget, "safety": safety,
               "time_pred_rel_err_median": time_errors[len(time_errors) // 2],
               "chosen": {"n_persist": chosen.n_persist, "n_checkpoint": chosen.n_checkpoint},
               "plain_peak": plain_peak, "smallest_feasible_budget": smallest,
               "n_chunks": len(profile.chunk_used), "chunk_used": profile.chunk_used,
               "configs": rows, "profile": dataclasses.asdict(profile)}
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Chunked offloading and a cost model that plans it, checked against "
                           "lesson 07's tracker.", world_size=1, max_world_size=1)
    parser.add_argument("--layers", type=int_in(1, 32), default=4, help="blocks (default 4)")
    parser.add_argument("--hidden", type=int_in(8, 1024), default=64, help="hidden size (default 64)")
    parser.add_argument("--heads", type=int_in(1, 64), default=4, help="attention heads (default 4)")
    parser.add_argument("--seq", type=int_in(1, 1024), default=32, help="sequence length (default 32)")
    parser.add_argument("--batch", type=int_in(1, 256), default=4, help="batch (default 4)")
    parser.add_argument("--chunk-numel", type=int_in(256), default=32768,
                        help="elements per chunk (default 32768)")
    parser.add_argument("--steps", type=int_in(2, 100), default=4, help="Adam steps per run (default 4)")
    parser.add_argument("--budget", type=int_in(1), default=None,
                        help="device memory budget in bytes (default: --budget-fraction of the "
                             "all-persistent peak)")
    parser.add_argument("--budget-fraction", type=float_in(0.01, 10.0), default=0.6,
                        help="budget as a fraction of the all-persistent peak (default 0.6)")
    parser.add_argument("--safety", type=float_in(1.0, 4.0), default=cost_model.SAFETY,
                        help=f"a configuration fits when safety x its predicted peak <= the "
                             f"budget (default {cost_model.SAFETY})")
    args = parser.parse_args(argv)
    largest = 4 * args.hidden * args.hidden
    if args.chunk_numel < largest:
        parser.error(f"--chunk-numel {args.chunk_numel} is smaller than the largest weight "
                     f"({largest} elements: 4 x hidden^2)")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if args.device == "cuda":
        parser.error("--device cuda: this demo runs on the CPU (the notebook runs the manager on CUDA)")
    check_args(parser, args)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    (result,) = launch(verify_worker, 1, (args.seed, model_config(args), args.steps, args.budget,
                                          args.budget_fraction, args.safety, args.quick, args.fault,
                                          args.fault_rank), device="cpu", timeout_s=args.timeout)
    if "budget_error" in result:
        print(f"error: {result['budget_error']}", file=sys.stderr)
        return 2
    checks = [Check(**c) for c in result["checks"]]
    metrics = result["metrics"]
    chosen = metrics["chosen"]
    metrics["headline"] = (f"plan for {metrics['budget']:,} B: n_persist={chosen['n_persist']}, "
                           f"n_checkpoint={chosen['n_checkpoint']}; peak error max "
                           f"{metrics['peak_pred_rel_err_max']:.2%}")
    return finish(Report(LESSON, "cpu", "none", 1, checks, metrics), args.json, started)
