"""Functions that lesson 03's tests run on spawned ranks (importable by their dotted name): the
demo's checks (the integration criterion) and one worker per exercise of main.py and zero3.py.

An exercise's worker grades that exercise alone: the pieces of the *other* exercises that it
needs run as the reference versions below (`other_exercises_given`), so a learner's ZeRO-2
hook is graded even while their ZeRO-1 step is still a stub, and a mistake fails its own
exercise only. Every expected value comes from an oracle that shares nothing with the code
under test: the average computed locally from every rank's (deterministic) inputs, torch's
`dist.all_reduce`, `torch.nn.utils.clip_grad_norm_`, or one process on the whole batch. A
worker returns, per check, a problem (a sentence) or "" when it held. `exercises` runs them
all in one launch: the ranks' start-up (mostly importing torch._dynamo for the first
optimizer) costs more than the checks.
"""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lessons._checks import max_abs_diff

M = importlib.import_module("lessons.03_zero.main")  # the technique
Z3 = importlib.import_module("lessons.03_zero.zero3")  # the technique: ZeRO-3
C = importlib.import_module("lessons.03_zero.checks")  # the proof
collectives = M.collectives
STEPS, BATCH, ITEMSIZE = 3, 24, 8  # float64 training runs
EXACT = 1e-12  # one collective in float64: only the summation order differs (about 1e-16)


def all_checks(ctx, seed: int, steps: int, batch: int) -> dict:
    """The demo's checks on this rank, and the class ZeroAdam builds for each stage."""
    result = C.verify_worker(ctx, seed, steps, batch, None, 0)
    model = C.data_parallel.make_model(0, **C.SIZES)
    result["classes"] = [type(M.ZeroAdam(model, stage)).__name__ for stage in (1, 2, 3)]
    return result


# ============================================================================ the other exercises


def given_shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    return collectives.chunk_bounds(numel, world_size)[rank]


def given_reduce_scatter_mean(grad: torch.Tensor, traffic) -> torch.Tensor:
    return collectives.ring_reduce_scatter(grad.reshape(-1), traffic) / dist.get_world_size()


def given_reduce_scatter_gradients(self) -> None:
    for (_, param), shard in zip(self.named, self.shards):
        shard.grad = given_reduce_scatter_mean(param.grad, self.traffic)
        param.grad = None


def given_step_shards(self, scaler=None) -> None:
    if scaler is None:
        self.optimizer.step()
    else:
        scaler.step(self.optimizer)


def given_all_gather_parameters(self) -> None:
    for (_, param), shard in zip(self.named, self.shards):
        full = collectives.ring_all_gather(shard.detach(), param.numel(), self.traffic)
        with torch.no_grad():
            param.copy_(full.view_as(param))


@contextlib.contextmanager
def other_exercises_given():
    """The ZeRO-1 step's pieces (exercise zero1-step) replaced by the reference, for the
    workers of the exercises built on it (ZeRO-2, ZeRO-3, clipping)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(M, "shard_bounds", given_shard_bounds))
        stack.enter_context(mock.patch.object(M, "reduce_scatter_mean", given_reduce_scatter_mean))
        for name, function in (("reduce_scatter_gradients", given_reduce_scatter_gradients),
                               ("step_shards", given_step_shards),
                               ("all_gather_parameters", given_all_gather_parameters)):
            stack.enter_context(mock.patch.object(M.ZeroStage1, name, function))
        yield


# ============================================================================ shared helpers


def values(seed: int, shape) -> torch.Tensor:
    """A deterministic float64 tensor: the same on every rank that asks for the same seed."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def mismatch(what: str, got: torch.Tensor | None, expected: torch.Tensor, world: int = 1,
             tolerance: float = EXACT) -> str:
    """"" when `got` equals `expected` (1-D or any shape, within `tolerance`), else what is
    wrong, naming the classic mistakes: the sum instead of the average, a wrong size."""
    if got is None:
        return f"{what} is None (never set)"
    got = got.detach()
    if got.numel() != expected.numel():
        return f"{what} has {got.numel()} elements, expected {expected.numel()} (shape " \
               f"{tuple(got.shape)} vs {tuple(expected.shape)})"
    got, expected = got.reshape(-1), expected.reshape(-1)
    diff = max_abs_diff(got, expected)
    if diff <= tolerance:
        return ""
    hint = ""
    if world > 1 and max_abs_diff(got, expected * world) <= tolerance * world:
        hint = f": it is the sum over the {world} ranks, not the average (divide by N)"
    return f"{what} is off by {diff:.2e} (tolerance {tolerance:g}){hint}"


def first(problems) -> str:
    return next((problem for problem in problems if problem), "")


def trajectory(ctx, trainer, stage: int, max_norm: float | None = None) -> dict:
    """Train `trainer` (a main.py stage) for STEPS steps; compare with one process on the whole
    batch (trajectory), the live bytes with the memory formula and the bytes sent with the exact
    ring formula. Shard sizes come from the reference bounds, never from the code under test."""
    run = C.train(ctx, trainer, 0, STEPS, BATCH, max_norm)
    reference = C.train_single_process_adam(0, STEPS, BATCH, max_norm)
    numels = run["numels"]
    shard = sum(end - start for start, end in
                (given_shard_bounds(n, ctx.world_size, ctx.rank) for n in numels))
    gap = C.gap(run, reference)
    if max_norm is not None:
        gap = max(gap, C.gap(run, reference, "norms"))
    expected_memory = C.expected_live_bytes(stage, sum(numels), shard, ITEMSIZE)
    expected_bytes = M.expected_bytes_sent(stage, numels, ITEMSIZE, ctx.world_size, ctx.rank)
    return {
        "trajectory": "" if gap <= C.TOLERANCE else
        f"losses/parameters{'/norms' if max_norm else ''} leave one process's by {gap:.2e} "
        f"(tolerance {C.TOLERANCE:g})",
        "memory": "" if run["memory"] == expected_memory else
        f"live bytes {run['memory']} != formula {expected_memory} (Psi_r = {shard})",
        "bytes_sent": "" if all(sent == expected_bytes for sent in run["bytes_per_step"]) else
        f"bytes sent per step {run['bytes_per_step']} != {expected_bytes} (the exact ring formula)",
    }


def expected_shard_grads(ctx, plain) -> list[torch.Tensor]:
    """This rank's slice of the data-parallel average of `plain`'s gradients, by torch's
    all-reduce on copies (the oracle for every shard gradient)."""
    expected = []
    for param in plain.parameters():
        total = param.grad.detach().clone()
        dist.all_reduce(total)
        start, end = given_shard_bounds(total.numel(), ctx.world_size, ctx.rank)
        expected.append((total / ctx.world_size).reshape(-1)[start:end])
    return expected


# ============================================================================ zero1-step


def zero1_step(ctx) -> dict:
    """Exercise zero1-step on this rank: each piece on inputs the test builds, then the step."""
    rank, world = ctx.rank, ctx.world_size
    result = {}

    # reduce_scatter_mean: rank j holds g_j of shape (3, 5); the oracle averages them locally
    grads = [values(100 + j, (3, 5)) for j in range(world)]
    mine, traffic = grads[rank].clone(), collectives.Traffic()
    shard = M.reduce_scatter_mean(mine, traffic)
    start, end = given_shard_bounds(15, world, rank)
    expected = (sum(grads) / world).reshape(-1)[start:end]
    sent = collectives.ring_bytes_sent(15, ITEMSIZE, world, rank)["reduce_scatter"]
    result["reduce_scatter_mean"] = first([
        mismatch(f"rank {rank}: reduce_scatter_mean of a (3, 5) gradient", shard, expected, world),
        "" if shard is None or shard.dim() == 1 else f"rank {rank}: the shard must be 1-D, got "
                                                     f"shape {tuple(shard.shape)}",
        "" if torch.equal(mine, grads[rank]) else f"rank {rank}: reduce_scatter_mean changed its input",
        "" if traffic.bytes_sent == sent else f"rank {rank}: sent {traffic.bytes_sent} B, the ring "
                                              f"reduce-scatter sends {sent} B"])

    # reduce_scatter_gradients: every rank's param.grad set to known values
    model = C.data_parallel.make_model(rank, **C.SIZES)
    zero = M.ZeroStage1(model)
    problems = []
    for index, (_, param) in enumerate(zero.named):
        param.grad = values(1000 * index + rank, param.shape)
    zero.reduce_scatter_gradients()
    for index, ((name, param), shard) in enumerate(zip(zero.named, zero.shards)):
        average = sum(values(1000 * index + j, param.shape) for j in range(world)) / world
        start, end = given_shard_bounds(param.numel(), world, rank)
        problems.append(mismatch(f"rank {rank}: {name} shard.grad", shard.grad,
                                 average.reshape(-1)[start:end], world))
        if param.grad is not None:
            problems.append(f"rank {rank}: {name}.grad still holds the full gradient after "
                            f"reduce_scatter_gradients (set it to None)")
    result["reduce_scatter_gradients"] = first(problems)

    # all_gather_parameters: every rank writes its own values into its shards
    problems = []
    with torch.no_grad():
        for index, ((_, param), shard) in enumerate(zip(zero.named, zero.shards)):
            start, end = given_shard_bounds(param.numel(), world, rank)
            shard.copy_(values(2000 + 10 * index + rank, param.numel())[start:end])
    zero.all_gather_parameters()
    for index, (name, param) in enumerate(zero.named):
        expected = torch.cat([values(2000 + 10 * index + r, param.numel())[slice(
            *given_shard_bounds(param.numel(), world, r))] for r in range(world)])
        problems.append(mismatch(f"rank {rank}: {name} after all_gather_parameters (each slice "
                                 f"from its owner's shard)", param, expected))
    result["all_gather_parameters"] = first(problems)

    result.update(trajectory(ctx, M.ZeroStage1, 1))
    return result


# ============================================================================ zero2-hook


def zero2_hook(ctx) -> dict:
    """Exercise zero2-hook on this rank (ZeRO-1's pieces given): the hook's shard gradients
    over two micro-batches against torch's all-reduce of a plain model's, then the step."""
    rank, world = ctx.rank, ctx.world_size
    result = {}
    with other_exercises_given():
        model = C.data_parallel.make_model(rank, **C.SIZES)
        zero = M.ZeroStage2(model)  # broadcasts rank 0's weights
        plain = C.data_parallel.make_model(0, **C.SIZES)  # rank 0's weights, no hooks
        names = [name for name, _ in zero.named]
        numels = [param.numel() for _, param in zero.named]
        per_backward = sum(collectives.ring_bytes_sent(n, ITEMSIZE, world, rank)["reduce_scatter"]
                           for n in numels)
        for micro in range(2):
            x, y = C.batch_on(ctx, micro, 4 * world, 0)
            before = zero.traffic.bytes_sent
            F.mse_loss(model(x), y).backward()
            F.mse_loss(plain(x), y).backward()  # accumulates too: the oracle of the sum
            expected = expected_shard_grads(ctx, plain)
            result[f"backward{micro}"] = first(
                mismatch(f"rank {rank}: {name} shard.grad after {micro + 1} backward(s)",
                         shard.grad, want, world) for name, shard, want in
                zip(names, zero.shards, expected))
            kept = [name for name, param in zero.named if param.grad is not None]
            result[f"freed{micro}"] = "" if not kept else \
                f"rank {rank}: after backward {micro + 1}, {kept} still hold full gradients"
            sent = zero.traffic.bytes_sent - before
            result[f"sent{micro}"] = "" if sent == per_backward else \
                f"rank {rank}: backward {micro + 1} sent {sent} B, one reduce-scatter per " \
                f"parameter sends {per_backward} B"
        result.update(trajectory(ctx, M.ZeroStage2, 2))
    return result


# ============================================================================ zero3-hooks


def zero3_hooks(ctx) -> dict:
    """Exercise zero3-hooks on this rank (ZeRO-1's pieces given): the lifetimes of the full
    weights, the shard gradients of one backward against a plain model's, then the step."""
    rank, world = ctx.rank, ctx.world_size
    result = {}
    with other_exercises_given():
        model = C.data_parallel.make_model(rank, **C.SIZES)
        zero = Z3.ZeroStage3(model)
        plain = C.data_parallel.make_model(0, **C.SIZES)
        x, y = C.batch_on(ctx, 0, 4 * world, 0)
        loss = F.mse_loss(model(x), y)
        layers = {"fc1": model.fc1, "fc2": model.fc2, "head": model.head}
        held = [f"{layer}.{attr}" for layer, module in layers.items() for attr in ("weight", "bias")
                if getattr(module, attr) is not None]
        result["dropped_after_forward"] = "" if not held else \
            f"rank {rank}: after forward, {held} still hold gathered full weights (set them to None)"
        plain_loss = F.mse_loss(plain(x), y)
        result["forward"] = mismatch(f"rank {rank}: the loss", loss, plain_loss)
        loss.backward()
        plain_loss.backward()
        names = [name for name, _ in zero.named]
        result["shard_grads"] = first(
            mismatch(f"rank {rank}: {name} shard.grad", shard.grad, want, world)
            for name, shard, want in zip(names, zero.shards, expected_shard_grads(ctx, plain)))
        held = [f"{layer}.{attr}" for layer, module in layers.items() for attr in ("weight", "bias")
                if getattr(module, attr) is not None]
        left = [names[index] for index in zero.regathered]
        result["dropped_after_backward"] = first([
            "" if not held else f"rank {rank}: after backward, {held} hold full weights",
            "" if not left else f"rank {rank}: after backward, regathered still holds {left} "
                                f"(the gather's backward must drop them)",
            "" if not zero.saved_tensor_hooks else
            f"rank {rank}: {len(zero.saved_tensor_hooks)} saved-tensor hooks left entered"])
        result.update(trajectory(ctx, Z3.ZeroStage3, 3))
    return result


# ============================================================================ sharded-clip


SHAPES = [(4, 3), (3,), (5,), (1,)]  # on 4 ranks: shards of 3, 1, 2 or 1 element, or none


def clip_case(ctx, dtype: torch.dtype, fraction: float) -> str:
    """Clip this rank's shards of a known gradient with max_norm = fraction x ||g||; compare
    the norm and the shards with torch.nn.utils.clip_grad_norm_ on the whole gradient."""
    rank, world = ctx.rank, ctx.world_size
    full = [values(300 + index, shape).to(dtype) for index, shape in enumerate(SHAPES)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
    for param, grad in zip(params, full):
        param.grad = grad.clone()
    total = torch.nn.utils.get_total_norm([g.double() for g in full]).item()
    max_norm = fraction * total
    reference = torch.nn.utils.clip_grad_norm_(params, max_norm)
    bounds = [given_shard_bounds(g.numel(), world, rank) for g in full]
    shards = [g.reshape(-1)[start:end].clone() for g, (start, end) in zip(full, bounds)]
    objects = list(shards)
    norm = M.sharded_clip_grad_norm_(shards, max_norm)
    tolerance = EXACT if dtype == torch.float64 else 1e-5
    label = f"rank {rank}, {str(dtype).split('.')[-1]}, max_norm {fraction:g} ||g||"
    if not isinstance(norm, torch.Tensor) or norm.numel() != 1:
        return f"{label}: must return ||g|| as a 0-d tensor, got {norm!r}"
    problems = [mismatch(f"{label}: the returned norm", norm, torch.tensor(total, dtype=torch.float64),
                         tolerance=tolerance * max(1.0, total)),
                "" if all(a is b for a, b in zip(shards, objects)) else
                f"{label}: the list of shards was replaced (clip in place)"]
    for index, (shard, param, (start, end)) in enumerate(zip(objects, params, bounds)):
        problems.append(mismatch(f"{label}: shard {index} after clipping (torch: scale "
                                 f"{min(1.0, max_norm / (reference.item() + 1e-6)):.4f})", shard,
                                 param.grad.reshape(-1)[start:end], tolerance=tolerance))
    return first(problems)


def sharded_clip(ctx) -> dict:
    """Exercise sharded-clip on this rank: known gradients (clipped and left alone, float64
    and float32), the norm on every rank, then ZeRO-1 training with clipping (ZeRO-1 given)."""
    result = {"clips": clip_case(ctx, torch.float64, 0.5),
              "leaves_small_alone": clip_case(ctx, torch.float64, 3.0),
              "float32": clip_case(ctx, torch.float32, 0.25)}
    g = [values(400 + ctx.rank, (7,))]  # a different shard on every rank: the norm must agree
    result["norm"] = M.sharded_clip_grad_norm_(g, 1e9).item()
    result["expected_norm"] = float(sum(values(400 + r, (7,)).pow(2).sum() for r in
                                        range(ctx.world_size)) ** 0.5)
    with other_exercises_given():
        max_norm = C.CLIP_FRACTION * C.train_single_process_adam(0, 1, BATCH)["norms"][0]
        result["training"] = trajectory(ctx, M.ZeroStage1, 1, max_norm)["trajectory"]
    return result


# ============================================================================ all in one launch

EXERCISE_WORKERS = {"zero1-step": zero1_step, "zero2-hook": zero2_hook,
                    "sharded-clip": sharded_clip, "zero3-hooks": zero3_hooks}


def exercises(ctx, names: list[str]) -> dict:
    """Each named exercise's worker in turn on this rank: {name: its result}. An exception ends
    the rank (and so the launch, at once: its peers lose their connection instead of waiting
    for it in a collective); the tests then run each exercise alone."""
    return {name: EXERCISE_WORKERS[name](ctx) for name in names}
