"""Functions that lesson 03's tests run on spawned ranks (importable by their dotted name): the
demo's checks and the contract checks (the integration criterion), and one worker per
exercise of main.py and zero3.py.

Every exercise runs on 3 ranks (odd), each piece twice: over the world, and over a process
group that is not the world: ranks {0, 2} form one group and rank 1 is a group of its own, so
that code which ignores `group` still completes (every rank runs the same collectives) but
with numbers that a test catches, instead of hanging. Sizes are uneven (20 elements over 3
ranks) and some shards empty (2 elements over 3 ranks); each rank's inputs differ.

An exercise's worker grades that exercise alone: the pieces of the *other* exercises that it
needs run as the reference versions below (`other_exercises_given`), so a mistake fails its own
exercise only. Every expected value comes from an oracle that shares nothing with the code
under test: averages computed locally from every member's (deterministic) inputs, a plain model
per member, torch's optimizers and clip_grad_norm_, one process on the whole batch, lesson 07's
memory tracker. A worker returns, per check, a problem (a sentence naming the configuration,
what was expected and what came back) or "" when it held. `exercises` runs them all in one
launch: the ranks' start-up costs more than the checks.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lessons._checks import max_abs_diff, sum_order_tolerance
from lessons._launch import phase

M = importlib.import_module("lessons.03_zero.main")  # the technique
Z3 = importlib.import_module("lessons.03_zero.zero3")  # the technique: ZeRO-3
C = importlib.import_module("lessons.03_zero.checks")  # the proof
MEMORY = importlib.import_module("lessons.07_memory.main")  # lesson 07's MemoryTracker
collectives, contract, data_parallel = M.collectives, M.contract, C.data_parallel
WORLD = 3  # the exercises' launch
STEPS, BATCH, ITEMSIZE = 3, 12, 8  # float64 training runs; 12 rows split over 1, 2 or 3 ranks
EXACT = 1e-12  # one collective in float64: only the summation order differs (about 1e-16)


def all_checks(ctx, seed: int, steps: int, batch: int) -> dict:
    """The demo's checks on this rank."""
    return C.verify_worker(ctx, seed, steps, batch, None, 0)


# ============================================================================ groups


def make_groups(ctx) -> dict:
    """{"world": None, "group": this rank's group}: ranks {0, 2} and {1} (every rank creates
    both, in the same order, as torch requires)."""
    pair, alone = dist.new_group([0, 2]), dist.new_group([1])
    return {"world": None, "group": pair if ctx.rank in (0, 2) else alone}


def members(group) -> list[int]:
    """The global ranks of `group` (None: the world), in group-rank order."""
    return contract.group_ranks(group)


def label(ctx, group) -> str:
    """Names the configuration in every message: "rank 2 (world of 3)", "rank 2 (group [0, 2])"."""
    where = f"world of {ctx.world_size}" if group is None else f"group {members(group)}"
    return f"rank {ctx.rank} ({where})"


# ============================================================================ the other exercises


def given_shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    return collectives.chunk_bounds(numel, world_size)[rank]


def given_reduce_scatter_mean(grad: torch.Tensor, traffic, group=None) -> torch.Tensor:
    return contract.reduce_scatter_sum(grad.reshape(-1), traffic, group) / dist.get_world_size(group)


def given_reduce_gradient(self, index: int) -> None:
    param, shard = self.named[index][1], self.shards[index]
    grad = param.grad if param.grad is not None else torch.zeros_like(param)
    reduced = given_reduce_scatter_mean(grad, self.traffic, self.group)
    shard.grad = reduced if shard.grad is None else shard.grad + reduced
    param.grad = None


def given_reduce_scatter_gradients(self) -> None:
    for index, present in enumerate(self.gradient_presence()):
        if present:
            given_reduce_gradient(self, index)


def given_skip_step(self) -> bool:
    flag = getattr(self, "found_inf", None)
    if flag is None:
        return False
    bad = float(flag) > 0 or any(not bool(torch.isfinite(s.grad).all())
                                 for s in self.shards if s.grad is not None)
    verdict = torch.tensor([float(bad)])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=self.group)
    return bool(verdict.item())


def given_all_gather_parameters(self) -> None:
    for (_, param), shard in zip(self.named, self.shards):
        if shard.grad is not None:
            full = contract.all_gather_flat(shard.detach(), param.numel(), self.traffic, self.group)
            with torch.no_grad():
                param.copy_(full.view_as(param))


def given_sharded_clip(shard_grads, max_norm, group=None) -> torch.Tensor:
    squares = torch.zeros(1, dtype=torch.promote_types(shard_grads[0].dtype, torch.float32))
    for grad in shard_grads:
        squares += grad.detach().to(squares.dtype).pow(2).sum()
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt()[0]
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in shard_grads:
        grad.detach().mul_(scale.to(grad.dtype))
    return norm


@contextlib.contextmanager
def other_exercises_given(*, clip: bool = True):
    """The ZeRO-1 step's pieces (exercise zero1-step), and clipping unless `clip` is False,
    replaced by the reference, for the workers of the exercises built on them."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(M, "shard_bounds", given_shard_bounds))
        stack.enter_context(mock.patch.object(M, "reduce_scatter_mean", given_reduce_scatter_mean))
        for name, function in (("reduce_gradient", given_reduce_gradient),
                               ("reduce_scatter_gradients", given_reduce_scatter_gradients),
                               ("skip_step", given_skip_step),
                               ("all_gather_parameters", given_all_gather_parameters)):
            stack.enter_context(mock.patch.object(M.ZeroStage1, name, function))
        if clip:
            stack.enter_context(mock.patch.object(M, "sharded_clip_grad_norm_", given_sharded_clip))
        yield


# ============================================================================ shared helpers


def values(seed: int, shape, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A deterministic tensor: the same on every rank that asks for the same seed."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def mismatch(what: str, got: torch.Tensor | None, expected: torch.Tensor | None,
             tolerance: float = EXACT, mistakes: dict | None = None) -> str:
    """"" when `got` equals `expected` (any shapes of the same number of elements, within
    `tolerance`; None expects None), else what is wrong: expected vs got, and the name of a
    known mistake whose result `got` equals (`mistakes`: {description: its result})."""
    if expected is None:
        return "" if got is None else f"{what}: expected None (no gradient), got a tensor of " \
                                      f"{got.numel()} elements"
    if got is None:
        return f"{what}: expected {expected.numel()} elements, got None (never set)"
    got = got.detach()
    if got.numel() != expected.numel():
        return f"{what}: expected {expected.numel()} elements (shape {tuple(expected.shape)}), " \
               f"got {got.numel()} (shape {tuple(got.shape)})"
    got, expected = got.reshape(-1).double(), expected.reshape(-1).double()
    diff = max_abs_diff(got, expected)
    if diff <= tolerance:
        return ""
    for mistake, result in (mistakes or {}).items():
        if result is not None and result.numel() == got.numel() and \
                max_abs_diff(got, result.reshape(-1).double()) <= tolerance:
            return f"{what} is off by {diff:.2e}: it is {mistake}"
    return f"{what} is off by {diff:.2e} (tolerance {tolerance:g}): expected " \
           f"{expected[:4].tolist()}..., got {got[:4].tolist()}..."


def first(problems) -> str:
    return next((problem for problem in problems if problem), "")


def trajectory(ctx, stage: int, group=None, max_norm: float | None = None,
               optimizer: str = "adam") -> dict:
    """Train `stage` (checks.train, the code under test) for STEPS steps over `group`; compare
    with one process on the whole batch (trajectory) and, over the world, the live bytes with
    the memory formula and the bytes sent with the exact ring formula. Shard sizes come from
    the reference bounds, never from the code under test."""
    where = label(ctx, group)
    run = C.train(ctx, stage, 0, STEPS, BATCH, max_norm, optimizer, group)
    reference = C.train_single_process(0, STEPS, BATCH, max_norm, optimizer)
    gap = C.gap(run, reference)
    if max_norm is not None:
        gap = max(gap, C.gap(run, reference, "norms"))
    result = {"trajectory": "" if gap <= C.TOLERANCE else
              f"{where}: ZeRO-{stage} with {optimizer}{' and clipping' if max_norm else ''}: "
              f"losses/parameters{'/norms' if max_norm else ''} leave one process's by {gap:.2e} "
              f"(expected <= {C.TOLERANCE:g})"}
    if group is None:
        numels = run["numels"]
        shard = sum(end - start for start, end in
                    (given_shard_bounds(n, ctx.world_size, ctx.rank) for n in numels))
        expected_memory = C.expected_live_bytes(stage, sum(numels), shard, ITEMSIZE)
        expected_bytes = M.expected_bytes_sent(stage, numels, ITEMSIZE, ctx.world_size, ctx.rank)
        result["memory"] = "" if run["memory"] == expected_memory else \
            f"{where}: ZeRO-{stage} live bytes: expected {expected_memory} (the formula, Psi_r = " \
            f"{shard}), got {run['memory']}"
        result["bytes_sent"] = "" if all(sent == expected_bytes for sent in run["bytes_per_step"]) else \
            f"{where}: ZeRO-{stage} bytes sent per step: expected {expected_bytes} (the exact ring " \
            f"formula), got {run['bytes_per_step']}"
    return result


def over_groups(ctx, groups: dict, text: str, piece) -> dict:
    """`piece(ctx, group)` over the world and over the group; per check, the first problem."""
    result = {}
    for config, group in groups.items():
        phase(f"{text} over the {config}")
        for key, problem in piece(ctx, group).items():
            result[key] = result.get(key) or problem
    return result


def named_parameters(rank: int) -> list[tuple[str, nn.Parameter]]:
    """The parameters the zero1-step pieces are tested on: uneven (20 elements over 3 or 2
    ranks), one frozen (never a gradient; not last, so that every parameter after it must be
    handled too), tiny (2 elements: an empty shard at 3 ranks), one whose gradient is missing
    on rank 2 only (unused there)."""
    return [(name, nn.Parameter(values(50 + rank + 7 * i, shape), requires_grad=name != "frozen"))
            for i, (name, shape) in enumerate((("weight", (4, 5)), ("frozen", (3,)), ("bias", (2,)),
                                                ("unused_on_rank_2", (7,))))]


def set_gradients(ctx, named, seed: int) -> None:
    """Rank r's gradients: values(seed + 100 i + r); none for `frozen`, nor for
    `unused_on_rank_2` on rank 2."""
    for i, (name, param) in enumerate(named):
        missing = name == "frozen" or (name == "unused_on_rank_2" and ctx.rank == 2)
        param.grad = None if missing else values(seed + 100 * i + ctx.rank, param.shape)


def average_gradient(ctx, group, name: str, i: int, shape, seed: int) -> torch.Tensor | None:
    """The oracle of `set_gradients`: the average over the members of `group` (a missing
    gradient counts as zero), or None when no member has one."""
    present = [r for r in members(group) if name != "frozen" and not (name == "unused_on_rank_2" and r == 2)]
    if not present:
        return None
    return sum(values(seed + 100 * i + r, shape) for r in present) / len(members(group))


# ============================================================================ zero1-step


def zero1_pieces(ctx, group) -> dict:
    """Exercise zero1-step's pieces on inputs the test builds, over `group` (None: the world)."""
    where, rank, world = label(ctx, group), dist.get_rank(group), dist.get_world_size(group)
    result = {}

    # reduce_scatter_mean: member j holds g_j, different rows everywhere; the oracle averages
    problems = []
    for shape in ((4, 5), (2,)):
        grads = {r: values(100 + r + 10 * len(shape), shape) for r in range(ctx.world_size)}
        mine, traffic = grads[ctx.rank].clone(), collectives.Traffic()
        got = M.reduce_scatter_mean(mine, traffic, group)
        start, end = given_shard_bounds(math.prod(shape), world, rank)
        expected = (sum(grads[r] for r in members(group)) / world).reshape(-1)[start:end]
        wb = given_shard_bounds(math.prod(shape), ctx.world_size, ctx.rank)
        mistakes = {f"the sum over the {world} ranks, not the average (divide by N)":
                    expected * world if world > 1 else None,
                    "the average over the world, not over `group`": None if group is None else
                    (sum(grads.values()) / ctx.world_size).reshape(-1)[wb[0]:wb[1]],
                    "divided by the world's size, not the group's": None if group is None else
                    expected * world / ctx.world_size}
        what = f"{where}: reduce_scatter_mean of a {shape} gradient (shard {start}:{end})"
        problems += [mismatch(what, got, expected, mistakes=mistakes),
                     "" if got is None or got.dim() == 1 else f"{what}: expected a 1-D shard, got "
                                                              f"shape {tuple(got.shape)}",
                     "" if torch.equal(mine, grads[ctx.rank]) else f"{what}: changed its input"]
        if group is None:
            sent = collectives.ring_bytes_sent(math.prod(shape), ITEMSIZE, world, rank)["reduce_scatter"]
            problems.append("" if traffic.bytes_sent == sent else
                            f"{what}: expected {sent} B sent by the ring, got {traffic.bytes_sent} B")
    result["reduce_scatter_mean"] = first(problems)

    # reduce_scatter_gradients: known gradients, one unused on rank 2, one frozen; then again
    named = named_parameters(ctx.rank)
    zero = M.ZeroStage1(named, torch.optim.SGD, group=group, lr=0.1)
    problems = []
    for round_, seed in enumerate((1000, 5000)):
        set_gradients(ctx, named, seed)
        zero.reduce_scatter_gradients()
        for i, ((name, param), shard) in enumerate(zip(zero.named, zero.shards)):
            start, end = given_shard_bounds(param.numel(), world, rank)
            averages = [average_gradient(ctx, group, name, i, param.shape, s)
                        for s in (1000, 5000)[:round_ + 1]]
            expected = None if averages[0] is None else sum(averages).reshape(-1)[start:end]
            what = f"{where}: {name} shard.grad after {round_ + 1} reduce_scatter_gradients"
            problems.append(mismatch(what, shard.grad, expected, mistakes={
                "only the last gradient (the second must add to the first)":
                    None if averages[0] is None or round_ == 0 else averages[-1].reshape(-1)[start:end]}))
            if param.grad is not None:
                problems.append(f"{where}: {name}.grad still holds the full gradient after "
                                f"reduce_scatter_gradients (expected None)")
    result["reduce_scatter_gradients"] = first(problems)

    # all_gather_parameters: every rank writes its own values into its shards (views of the
    # parameters); the frozen one (no shard gradient) is not to be gathered
    problems = []
    before = zero.traffic.bytes_sent
    with torch.no_grad():
        for i, ((_, param), shard) in enumerate(zip(zero.named, zero.shards)):
            start, end = given_shard_bounds(param.numel(), world, rank)
            if shard.grad is not None:
                shard.copy_(values(2000 + 10 * i + ctx.rank, param.numel())[start:end])
            else:
                param.copy_(values(3000 + ctx.rank, param.shape))
    pointers = [param.data_ptr() for _, param in zero.named]
    aliases = [param.detach() for _, param in zero.named]  # another reference to the storage
    objects = [param for _, param in named]
    zero.all_gather_parameters()
    expected_sent = 0
    for i, ((name, param), shard) in enumerate(zip(zero.named, zero.shards)):
        what = f"{where}: {name} after all_gather_parameters"
        if shard.grad is None:
            expected = values(3000 + ctx.rank, param.shape)
            problems.append(mismatch(what + " (no gradient: not stepped, not gathered)", param, expected))
            continue
        expected_sent += collectives.ring_bytes_sent(param.numel(), ITEMSIZE, world, rank)["all_gather"]
        expected = torch.cat([values(2000 + 10 * i + r, param.numel())[slice(
            *given_shard_bounds(param.numel(), world, j))] for j, r in enumerate(members(group))])
        problems += [mismatch(what + " (each slice from its owner's shard)", param, expected),
                     "" if param is objects[i] and param.data_ptr() == pointers[i] else
                     f"{what}: the live parameter moved (expected param.copy_ into the same "
                     f"tensor at {pointers[i]:#x}, got a tensor at {param.data_ptr():#x}: "
                     f"param.data rebound?)",
                     mismatch(what + ": another reference to the parameter's storage", aliases[i],
                              expected),
                     "" if shard.data_ptr() == param.data_ptr() + given_shard_bounds(
                         param.numel(), world, rank)[0] * ITEMSIZE or not shard.numel() else
                     f"{what}: the shard no longer views the live parameter's storage"]
    if group is None:
        sent = zero.traffic.bytes_sent - before
        problems.append("" if sent == expected_sent else
                        f"{where}: all_gather_parameters sent {sent} B, expected {expected_sent} B "
                        f"(one ring all-gather per stepped parameter)")
    result["all_gather_parameters"] = first(problems)

    # skip_step: the GradScaler's verdict, the same on every rank of the group
    problems = []
    with torch.no_grad():
        for shard in zero.shards:
            if shard.grad is not None:
                shard.grad.copy_(torch.ones_like(shard.grad))
    verdict = zero.skip_step()
    problems.append("" if verdict is False else
                    f"{where}: skip_step without a GradScaler: expected False, got {verdict!r}")
    cases = [("the scaler's found_inf set on rank 1 only", 1, None),
             ("a NaN in rank 0's shard gradient", None, 0),
             ("every gradient finite", None, None)]
    for text, flag_rank, nan_rank in cases:
        zero.found_inf = torch.tensor(1.0 if ctx.rank == flag_rank else 0.0)
        bad = [s for s in zero.shards if s.grad is not None and s.grad.numel()][0]
        if ctx.rank == nan_rank:
            bad.grad[0] = float("nan")
        expected = flag_rank in members(group) or nan_rank in members(group)
        got = zero.skip_step()
        problems.append("" if got == expected else
                        f"{where}: skip_step with {text}: expected {expected} on every rank of "
                        f"the group, got {got!r}")
        bad.grad[0] = 1.0
        del zero.found_inf
    result["skip_step"] = first(problems)
    return result


def scaler_trajectory(ctx, optimizer: str = "sgd", overflow_step: int = 2) -> str:
    """ZeRO-1 under scaler.step(zero) with torch's GradScaler, an inf injected into rank 1's
    gradient at `overflow_step`, against one process with a GradScaler and the same inf: the
    step is skipped on every rank, the parameters follow one process's, and rank 1 (which saw
    the inf) keeps one process's scale. SGD: an unscaled gradient would move it 2^10 x too far."""
    cls, kwargs = C.OPTIMIZERS[optimizer]
    model = data_parallel.make_model(ctx.rank, **C.SIZES)
    model.input_scale.copy_(data_parallel.make_model(0, **C.SIZES).input_scale)
    zero = M.ZeroStage1(model.named_parameters(), cls, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    one = data_parallel.make_model(0, **C.SIZES)
    one_opt = cls(one.parameters(), **kwargs)
    one_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    for step in range(4):
        x, y = C.batch_on(ctx, step, BATCH, 0)
        zero.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if step == overflow_step and ctx.rank == 1:
            model.fc1.weight.grad[0, 0] = float("inf")
        scaler.step(zero)
        scaler.update()
        gx, gy = data_parallel.global_batch(step, BATCH, 0, C.SIZES["d_in"], C.SIZES["d_out"])
        one_opt.zero_grad()
        one_scaler.scale(F.mse_loss(one(gx), gy)).backward()
        if step == overflow_step:
            one.fc1.weight.grad[0, 0] = float("inf")
        one_scaler.step(one_opt)
        one_scaler.update()
        gap = max_abs_diff(data_parallel.flat_params(model), data_parallel.flat_params(one))
        if not gap <= C.TOLERANCE:
            return (f"rank {ctx.rank} (world of {ctx.world_size}): ZeRO-1 with {optimizer} under "
                    f"scaler.step(zero), an inf on rank 1 at step {overflow_step}: after step {step} "
                    f"the parameters leave one process's (with GradScaler) by {gap:.2e}, expected "
                    f"<= {C.TOLERANCE:g}")
        if ctx.rank == 1 and scaler.get_scale() != one_scaler.get_scale():
            return (f"rank 1: GradScaler's scale after step {step}: expected {one_scaler.get_scale()} "
                    f"(one process), got {scaler.get_scale()}")
    return ""


def zero1_step(ctx, groups: dict) -> dict:
    """Exercise zero1-step on this rank (clipping given)."""
    result = {}
    with mock.patch.object(M, "sharded_clip_grad_norm_", given_sharded_clip):
        result.update(over_groups(ctx, groups, "zero1-step pieces", zero1_pieces))
        phase("zero1-step training")
        result.update(trajectory(ctx, 1))
        for optimizer in ("adamw", "sgd"):
            problem = trajectory(ctx, 1, optimizer=optimizer)["trajectory"]
            result["optimizers"] = result.get("optimizers") or problem
        result["subgroup_trajectory"] = trajectory(ctx, 1, groups["group"])["trajectory"]
        phase("zero1-step under a GradScaler")
        # an inconsistent skip would leave ranks in different collectives (a hang): run the
        # GradScaler path only if skip_step held on every rank (one all-reduce decides)
        held = torch.tensor([float(not result["skip_step"])])
        dist.all_reduce(held, op=dist.ReduceOp.MIN)
        result["grad_scaler"] = scaler_trajectory(ctx) if held.item() else \
            "not run: skip_step must first give the same verdict on every rank (see its test)"

    return result


# ============================================================================ zero2-hook


class Branches(nn.Module):
    """Two equal branches summed (rank 1 runs them in the other order, so its backward
    produces their gradients in another order), a branch rank 1 never uses, one nobody uses
    (it requires grad), a frozen layer, a head: (B, 4) -> (B, 2)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.spare = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.never, self.frozen, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.frozen.requires_grad_(False)
        self.double()

    def forward(self, x: torch.Tensor, rank: int, probe=None) -> torch.Tensor:
        h = self.b(x) + self.a(x) if rank == 1 else self.a(x) + self.b(x)
        if rank != 1:
            h = h + self.spare(x)
        if probe is not None:  # runs in backward once the head's gradients are complete
            h.register_hook(lambda grad: probe())
        return self.head(F.relu(self.frozen(h)))


def branches_batch(rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    return values(700 + 10 * micro + rank, (3, 4)), values(800 + 10 * micro + rank, (3, 2))


def zero2_backward(ctx, group) -> dict:
    """Two backwards of `Branches` under ZeroStage2 over `group`: the shard gradients against
    the average of every member's plain gradients (computed here, member by member)."""
    where, rank, world = label(ctx, group), dist.get_rank(group), dist.get_world_size(group)
    model = Branches(ctx.rank)
    zero = M.ZeroStage2(model.named_parameters(), torch.optim.SGD, group=group, lr=0.1)
    plains = {r: Branches(members(group)[0]) for r in members(group)}  # group rank 0's weights
    result = {}
    head = [index for index, (name, _) in enumerate(zero.named) if name.startswith("head.")]
    for micro in range(2):
        before = zero.traffic.bytes_sent
        seen = {}

        def probe(seen=seen, before=before):  # mid-backward: the head comes first in `order`
            seen["sent"] = zero.traffic.bytes_sent - before
            seen["held"] = [zero.named[i][0] for i in head if zero.named[i][1].grad is not None]

        x, y = branches_batch(ctx.rank, micro)
        F.mse_loss(model(x, ctx.rank, probe), y).backward()
        early = sum(collectives.ring_bytes_sent(zero.named[i][1].numel(), ITEMSIZE, world, rank)[
            "reduce_scatter"] for i in head)
        result[f"during{micro}"] = first([
            "" if not seen.get("held") else
            f"{where}: backward {micro + 1} reached the frozen layer with the head's full gradients "
            f"{seen['held']} still held: expected them reduce-scattered and freed as soon as ready "
            f"(they are first in `order`)",
            "" if group is not None or seen.get("sent", 0) >= early else
            f"{where}: backward {micro + 1} reached the frozen layer having sent {seen.get('sent')} B, "
            f"expected at least {early} B (the head's reduce-scatters, first in `order`)"])
        for r, plain in plains.items():
            px, py = branches_batch(r, micro)
            F.mse_loss(plain(px, r), py).backward()  # accumulates: the oracle of the sum
        problems = []
        for (name, param), shard in zip(zero.named, zero.shards):
            grads = [dict(plain.named_parameters())[name].grad for plain in plains.values()]
            start, end = given_shard_bounds(param.numel(), world, rank)
            expected = None if all(g is None for g in grads) else \
                (sum(g for g in grads if g is not None) / world).reshape(-1)[start:end]
            problems.append(mismatch(f"{where}: {name} shard.grad after {micro + 1} backward(s)",
                                     shard.grad, expected))
        result[f"backward{micro}"] = first(problems)
        kept = [name for name, param in zero.named if param.grad is not None]
        result[f"freed{micro}"] = "" if not kept else \
            f"{where}: after backward {micro + 1}, expected no full gradient, got {kept}"
        if group is None:
            sent = zero.traffic.bytes_sent - before
            expected = sum(collectives.ring_bytes_sent(p.numel(), ITEMSIZE, world, rank)["reduce_scatter"]
                           for _, p in zero.named if p.requires_grad)
            result[f"sent{micro}"] = "" if sent == expected else \
                f"{where}: backward {micro + 1} sent {sent} B, expected {expected} B (one " \
                f"reduce-scatter per parameter that requires grad)"
    return result


def zero2_hook(ctx, groups: dict) -> dict:
    """Exercise zero2-hook on this rank (ZeRO-1's pieces and clipping given)."""
    result = {}
    with other_exercises_given():
        result.update(over_groups(ctx, groups, "zero2-hook backward", zero2_backward))
        phase("zero2-hook training")
        result.update(trajectory(ctx, 2))
        result["subgroup_trajectory"] = trajectory(ctx, 2, groups["group"])["trajectory"]
    return result


# ============================================================================ zero3-hooks


def live_activation_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                          settle_to: int | None = None) -> tuple[int, torch.Tensor]:
    """Bytes of the storages created by `model`'s forward (and the loss) that are still alive
    when backward could start (lesson 07's MemoryTracker; the parameters filed apart), and
    the loss, whose graph keeps them.

    gloo's worker thread drops its reference to a finished collective's buffers just after
    waking the waiter (ProcessGroupGloo's runLoop resets the work after `execute`), so a
    buffer the forward sent can outlive `wait()` by a moment. With `settle_to`, the count is
    read again for up to SETTLE_S while it is above `settle_to`: a buffer that autograd
    really keeps never goes, so a real leak still shows."""
    tracker = MEMORY.MemoryTracker()
    with tracker:
        tracker.mark(model.parameters(), "parameter")
        with tracker.phase("forward"):
            loss = F.mse_loss(model(x), y)
    live, deadline = tracker.breakdown()["activation"], time.monotonic() + SETTLE_S
    while settle_to is not None and live > settle_to and time.monotonic() < deadline:
        time.sleep(0.01)
        live = tracker.breakdown()["activation"]
    return live, loss


# Far above the microseconds gloo's thread takes, and above a loaded machine's scheduling delay
# (tens of milliseconds with a dozen runnable threads on two cores); a real leak waits it out
# on every rank and configuration (the planted bugs that keep gathered weights: CI's time).
SETTLE_S = 0.5


def zero3_backward(ctx, group) -> dict:
    """One forward and backward of lesson 02's MLP under ZeroStage3 over `group`: what the
    module holds, the memory between forward and backward, the loss and the shard gradients
    against plain models (one per member)."""
    where, rank, world = label(ctx, group), dist.get_rank(group), dist.get_world_size(group)
    model = data_parallel.make_model(ctx.rank, **C.SIZES)
    model.input_scale.copy_(data_parallel.make_model(0, **C.SIZES).input_scale)
    names = [name for name, _ in model.named_parameters()]
    zero = Z3.ZeroStage3(model, group=group)
    result = {"module_parameters": first([
        "" if [n for n, _ in model.named_parameters()] == names else
        f"{where}: named_parameters() after sharding: expected {names}, got "
        f"{[n for n, _ in model.named_parameters()]}",
        "" if all(p is s for p, s in zip(model.parameters(), zero.shards)) else
        f"{where}: module.parameters() must be the shards (zero.shards), got other tensors"])}
    source = members(group)[0]  # group rank 0's weights, broadcast by ZeroStage3
    plains = {r: data_parallel.make_model(source, **C.SIZES) for r in members(group)}
    for plain in plains.values():
        plain.input_scale.copy_(model.input_scale)
    x, y = C.batch_on(ctx, 0, BATCH, 0, group=group)
    plain_live, _ = live_activation_bytes(plains[ctx.rank], x, y)
    live, loss = live_activation_bytes(model, x, y, settle_to=plain_live)
    held = [f"{layer}.{attr}" for layer in ("fc1", "fc2", "head") for attr in ("weight", "bias")
            if getattr(getattr(model, layer), attr) is not zero.shards[names.index(f"{layer}.{attr}")]]
    result["between_forward_and_backward"] = first([
        "" if live == plain_live else
        f"{where}: storages alive after forward, before backward: expected {plain_live} B (the "
        f"plain model's activations: no gathered weight kept), got {live} B (autograd keeps "
        f"{live - plain_live} B more: saved-tensor hooks without a recipe?)",
        "" if not held else f"{where}: after forward, expected the shards back in the modules, "
                            f"got gathered weights in {held}"])
    plain_loss = F.mse_loss(plains[ctx.rank](x), y)
    result["forward"] = mismatch(f"{where}: the loss", loss, plain_loss)
    loss.backward()
    for r, plain in plains.items():
        full_x, full_y = data_parallel.global_batch(0, BATCH, 0, C.SIZES["d_in"], C.SIZES["d_out"])
        j = members(group).index(r)
        F.mse_loss(plain(data_parallel.local_shard(full_x, j, world)),
                   data_parallel.local_shard(full_y, j, world)).backward()
    problems = []
    for name, shard in zero.named:
        average = sum(dict(p.named_parameters())[name].grad for p in plains.values()) / world
        start, end = given_shard_bounds(average.numel(), world, rank)
        problems.append(mismatch(f"{where}: {name} shard.grad", shard.grad,
                                 average.reshape(-1)[start:end], mistakes={
                                     f"the sum over the {world} ranks, not the average":
                                     average.reshape(-1)[start:end] * world if world > 1 else None}))
    result["shard_grads"] = first(problems)
    left = [names[index] for index in zero.regathered]
    result["after_backward"] = first([
        "" if not left else f"{where}: after backward, expected nothing regathered, got {left}",
        "" if not zero.saved_tensor_hooks else
        f"{where}: after backward, expected no saved-tensor hooks left entered, got "
        f"{len(zero.saved_tensor_hooks)}"])
    return result


class Sliced(nn.Module):
    """A unit whose forward uses a slice of its weight (autograd saves a view at an offset) and
    returns (output, None), as attention layers return (output, weights)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight[1:]), None


class Quirks(nn.Module):
    """A trainable layer, then a frozen one applied twice (its weight saved twice, regathered
    for backward, never reduced), a `Sliced` unit, a head: (B, 4) -> (B, 2)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.frozen = nn.Linear(4, 4).double(), nn.Linear(4, 4).double()
        self.frozen.requires_grad_(False)
        self.sliced, self.head = Sliced(), nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.frozen(F.relu(self.frozen(F.relu(self.first(x))))))
        return self.head(F.relu(self.sliced(h)[0]))


def zero3_quirks(ctx, group) -> dict:
    """`Quirks` under ZeroStage3 over `group` against plain models (one per member): the loss,
    the shard gradients, nothing left regathered after backward (the frozen weight's copy goes
    with its last recipe); then an evaluation forward under torch.no_grad equals the plain one."""
    where, rank, world = label(ctx, group), dist.get_rank(group), dist.get_world_size(group)
    model, plain = Quirks(ctx.rank), Quirks(members(group)[0])
    zero = Z3.ZeroStage3(model, group=group)
    xs = {r: values(600 + r, (3, 4)) for r in members(group)}
    loss = model(xs[ctx.rank]).pow(2).mean()
    problems = [mismatch(f"{where}: Quirks' loss", loss, plain(xs[ctx.rank]).pow(2).mean())]
    loss.backward()
    for x in xs.values():
        plain(x).pow(2).mean().backward()
    for name, shard in zero.named:
        grad = dict(plain.named_parameters())[name].grad
        start, end = given_shard_bounds(dict(plain.named_parameters())[name].numel(), world, rank)
        problems.append(mismatch(f"{where}: Quirks' {name} shard.grad", shard.grad,
                                 None if grad is None else (grad / world).reshape(-1)[start:end]))
    left = [zero.named[index][0] for index in zero.regathered]
    problems.append("" if not left else
                    f"{where}: Quirks (a frozen layer used twice, a sliced weight): after backward "
                    f"expected nothing regathered, got {left}")
    with torch.no_grad():
        try:
            out = model(xs[ctx.rank])
            problems.append(mismatch(f"{where}: Quirks under torch.no_grad", out, plain(xs[ctx.rank])))
        except RuntimeError as exc:
            problems.append(f"{where}: a forward under torch.no_grad (no output requires grad) "
                            f"must run, got RuntimeError: {exc}")
    problems.append("" if not zero.saved_tensor_hooks else
                    f"{where}: expected no saved-tensor hooks left entered, got "
                    f"{len(zero.saved_tensor_hooks)}")
    return {"quirks": first(problems)}


class CastInside(nn.Module):
    """A unit that records the dtype of the input it receives and casts it to its weight's."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2, 3))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        return F.linear(x.to(self.weight.dtype), self.weight)


def zero3_input_casts(ctx) -> str:
    """cast_forward_inputs: with param_dtype bf16, a unit receives bf16 inputs when it is True
    (the default) and its float32 inputs unchanged when it is False."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    problems = []
    for cast, expected in ((True, torch.bfloat16), (False, torch.float32)):
        unit = CastInside()
        Z3.ZeroStage3(unit, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           cast_forward_inputs=cast))
        unit(torch.ones(4, 3))
        problems.append("" if unit.seen == [expected] else
                        f"{label(ctx, None)}: MixedPrecisionPolicy(param_dtype=bf16, "
                        f"cast_forward_inputs={cast}): the unit's input dtype: expected "
                        f"{expected}, got {unit.seen}")
    return first(problems)


def zero3_mixed_precision(ctx) -> str:
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32, output_dtype=float32) over
    the world: float32 shards, bf16 gathers (2 bytes per element sent), a float32
    reduce-scatter (4), float32 shard gradients equal to the average of every rank's bf16
    gradients (`checks.mirrored_bf16_grads`) within the float32 sum-order bound."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    where = label(ctx, None)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                  output_dtype=torch.float32)
    model = data_parallel.make_model(ctx.rank, dtype=torch.float32, **C.SIZES)
    source = data_parallel.make_model(0, dtype=torch.float32, **C.SIZES)
    model.input_scale.copy_(source.input_scale)
    zero = Z3.ZeroStage3(model, mp_policy=policy)
    x, y = C.batch_on(ctx, 0, BATCH, 0, torch.float32)
    out = model(x)
    F.mse_loss(out, y).backward()
    problems = ["" if out.dtype == torch.float32 else f"{where}: output dtype: expected float32 "
                                                       f"(output_dtype), got {out.dtype}"]
    full_x, full_y = data_parallel.global_batch(0, BATCH, 0, C.SIZES["d_in"], C.SIZES["d_out"],
                                                torch.float32)
    local = [C.mirrored_bf16_grads(source, data_parallel.local_shard(full_x, r, WORLD),
                                   data_parallel.local_shard(full_y, r, WORLD)) for r in range(WORLD)]
    numels = [s.numel() for s in zero.shapes]
    for i, (name, shard) in enumerate(zero.named):
        per_rank = [g[i].double() for g in local]
        average = sum(per_rank) / WORLD
        bound = sum_order_tolerance(sum(g.abs() for g in per_rank), WORLD, torch.float32) / WORLD + \
            torch.finfo(torch.float32).eps * average.abs()
        start, end = given_shard_bounds(numels[i], WORLD, ctx.rank)
        got = shard.grad
        if got is None or got.dtype != torch.float32:
            problems.append(f"{where}: {name} shard.grad: expected float32 (the shard's dtype), got "
                            f"{None if got is None else got.dtype}")
            continue
        gap = (got.double() - average.reshape(-1)[start:end]).abs()
        excess = (gap - bound.reshape(-1)[start:end]).max() if got.numel() else torch.tensor(-1.0)
        problems.append("" if excess <= 0 else
                        f"{where}: {name} shard.grad under bf16/float32 mixed precision leaves the "
                        f"average of the ranks' bf16 gradients by {excess.item():.2e} beyond the "
                        f"float32 sum-order bound")
    expected = sum(2 * collectives.ring_bytes_sent(n, 2, WORLD, ctx.rank)["all_gather"] +
                   collectives.ring_bytes_sent(n, 4, WORLD, ctx.rank)["reduce_scatter"] for n in numels)
    problems.append("" if zero.traffic.bytes_sent == expected else
                    f"{where}: one step under bf16/float32 sent {zero.traffic.bytes_sent} B, expected "
                    f"{expected} B (two bf16 all-gathers and one float32 reduce-scatter per parameter)")
    return first(problems)


class Tied(nn.Module):
    """A model with a tied weight (fc4 reuses fc2's), a frozen bias and a frozen parameter that
    forward never uses (as CS336's toy models)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(10, 10, bias=False), nn.Linear(10, 50, bias=False)
        self.fc3, self.fc4 = nn.Linear(50, 10, bias=False), nn.Linear(10, 50, bias=False)
        self.fc5 = nn.Linear(50, 5)
        self.fc4.weight = self.fc2.weight
        self.fc5.bias.requires_grad_(False)
        self.fixed = nn.Parameter(torch.tensor([2.0, 2.0]), requires_grad=False)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in (self.fc1, self.fc2, self.fc3, self.fc4):
            x = F.relu(layer(x))
        return self.fc5(x)


def tied_trajectory(ctx, stage: int, group=None) -> str:
    """`Tied` trained with AdamW (weight decay) at `stage` over `group` against one process:
    the tied weight counted once, frozen parameters never moved (no weight decay either)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model, one = Tied(rank), Tied(0)
    kwargs = {"lr": 0.01, "weight_decay": 0.1, "foreach": False}
    if stage == 3:
        Z3.ZeroStage3(model, group=group)
        opt = torch.optim.AdamW(model.parameters(), **kwargs)
    else:
        opt = (M.ZeroStage1 if stage == 1 else M.ZeroStage2)(model.parameters(), torch.optim.AdamW,
                                                             group=group, **kwargs)
    one_opt = torch.optim.AdamW(one.parameters(), **kwargs)
    for step in range(STEPS):
        x, y = values(900 + step, (12, 10)), values(950 + step, (12, 5))
        opt.zero_grad()
        per = 12 // world
        F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
        one_opt.zero_grad()
        F.mse_loss(one(x), y).backward()
        one_opt.step()
    full = model.zero3.full_state_dict() if stage == 3 else dict(model.named_parameters())
    gap = max(max_abs_diff(full[name], param) for name, param in one.named_parameters())
    return "" if gap <= C.TOLERANCE else \
        f"{label(ctx, group)}: ZeRO-{stage} on a model with a tied weight and frozen parameters " \
        f"(AdamW, weight decay 0.1): the parameters leave one process's by {gap:.2e}, expected " \
        f"<= {C.TOLERANCE:g}"


def zero3_hooks(ctx, groups: dict) -> dict:
    """Exercise zero3-hooks on this rank (ZeRO-1's pieces and clipping given)."""
    result = {}
    with other_exercises_given():
        result.update(over_groups(ctx, groups, "zero3-hooks forward and backward", zero3_backward))
        result.update(over_groups(ctx, groups, "zero3-hooks frozen, sliced, no_grad", zero3_quirks))
        phase("zero3-hooks mixed precision")
        result["mixed_precision"] = first([zero3_mixed_precision(ctx), zero3_input_casts(ctx)])
        phase("zero3-hooks training")
        result.update(trajectory(ctx, 3))
        result["subgroup_trajectory"] = trajectory(ctx, 3, groups["group"])["trajectory"]
        result["tied_and_frozen"] = tied_trajectory(ctx, 3)
    return result


# ============================================================================ sharded-clip


SHAPES = [(4, 3), (3,), (5,), (1,), (2,)]  # on 3 ranks: uneven shards, some empty


def clip_case(ctx, group, dtype: torch.dtype, fraction: float, shapes=None) -> str:
    """Clip this rank's shards of a known gradient over `group` with max_norm = fraction x
    ||g||; compare the norm and the shards with torch.nn.utils.clip_grad_norm_ on the whole
    gradient. Each member's gradient differs (rank r's is scaled by 1 + r), so a norm summed
    over the wrong ranks is caught. float32 accepts float32 or float64 sums (the docstring
    allows either): 1e-5 relative; bfloat16 must sum in float32 or wider (the norm at 1e-5
    relative of the float64 norm of its values; the clipped shards within 2^-7 relative: one
    rounding of c and one of the product to bf16); float64 must sum in float64: EXACT.
    `shapes`: the gradient's tensors (SHAPES by default; one tensor: a single shard)."""
    where, rank, world = label(ctx, group), dist.get_rank(group), dist.get_world_size(group)
    full = [values(300 + i, shape).to(dtype) for i, shape in enumerate(shapes or SHAPES)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
    # the group's gradient: each element owned by one member, rows that differ per member
    owner_scale = [1.0 + r for r in members(group)]
    whole = []
    for g in full:
        bounds = [given_shard_bounds(g.numel(), world, j) for j in range(world)]
        flat = g.reshape(-1).clone()
        for j, (start, end) in enumerate(bounds):
            flat[start:end] *= owner_scale[j]
        whole.append(flat.view_as(g))
    for param, grad in zip(params, whole):
        param.grad = grad.clone()
    total = torch.nn.utils.get_total_norm([g.double() for g in whole]).item()
    max_norm = fraction * total
    torch.nn.utils.clip_grad_norm_(params, max_norm)  # the reference: clips params' gradients
    bounds = [given_shard_bounds(g.numel(), world, rank) for g in whole]
    shards = [g.reshape(-1)[start:end].clone() for g, (start, end) in zip(whole, bounds)]
    objects = list(shards)
    norm = M.sharded_clip_grad_norm_(shards, max_norm, group)
    tolerance = EXACT if dtype == torch.float64 else 1e-5
    what = f"{where}, {str(dtype).split('.')[-1]}, max_norm {fraction:g} ||g||"
    if not isinstance(norm, torch.Tensor) or norm.numel() != 1:
        return f"{what}: expected ||g|| as a 0-d tensor, got {norm!r}"
    own = math.sqrt(sum(float(s.double().pow(2).sum()) for s in objects)) if fraction > 1 else None
    problems = [mismatch(f"{what}: the returned norm", norm, torch.tensor(total, dtype=torch.float64),
                         tolerance=tolerance * max(1.0, total),
                         mistakes={"the norm of this rank's shards only (sum the squares over the "
                                   "group's ranks)": None if own is None else torch.tensor(own)}),
                "" if all(a is b for a, b in zip(shards, objects)) else
                f"{what}: the list of shards was replaced (expected clipping in place)"]
    scale = min(1.0, max_norm / (total + 1e-6))  # the exact factor, in float64
    for index, (shard, param, g, (start, end)) in enumerate(zip(objects, params, whole, bounds)):
        text = f"{what}: shard {index} after clipping (scale {scale:.4f})"
        if dtype != torch.bfloat16:
            problems.append(mismatch(text, shard, param.grad.reshape(-1)[start:end],
                                     tolerance=tolerance))
            continue
        expected = g.double().reshape(-1)[start:end] * scale
        excess = ((shard.double() - expected).abs() - 2 ** -7 * expected.abs()).max() \
            if shard.numel() else torch.tensor(-1.0)
        problems.append("" if excess <= 0 else f"{text}: off by {excess.item():.2e} beyond 2^-7 "
                                               f"relative of the exactly clipped values")
    return first(problems)


def sharded_clip(ctx, groups: dict) -> dict:
    """Exercise sharded-clip on this rank: known gradients (clipped and left alone, float64
    and float32) over the world and over a group, then ZeRO-1 training with clipping over
    both (ZeRO-1's pieces given)."""
    result = {"clips": "", "float32": "", "leaves_small_alone": ""}
    for config, group in groups.items():
        phase(f"sharded-clip over the {config}")
        for key, dtype, fraction in (("clips", torch.float64, 0.5), ("float32", torch.float32, 0.25),
                                     ("float32", torch.bfloat16, 0.25),
                                     ("leaves_small_alone", torch.float64, 3.0)):
            result[key] = result[key] or clip_case(ctx, group, dtype, fraction)
        result["clips"] = result["clips"] or clip_case(ctx, group, torch.float64, 0.5, SHAPES[:1])
    with other_exercises_given(clip=False):
        phase("sharded-clip training")
        max_norm = C.CLIP_FRACTION * C.train_single_process(0, 1, BATCH)["norms"][0]
        result["training"] = first([trajectory(ctx, 1, None, max_norm)["trajectory"],
                                    trajectory(ctx, 1, groups["group"], max_norm)["trajectory"],
                                    trajectory(ctx, 3, None, max_norm)["trajectory"]])
    return result


# ============================================================================ all in one launch

EXERCISE_WORKERS = {"zero1-step": zero1_step, "zero2-hook": zero2_hook,
                    "sharded-clip": sharded_clip, "zero3-hooks": zero3_hooks}


def exercises(ctx, names: list[str]) -> dict:
    """Each named exercise's worker in turn on this rank: {name: its result}. An exception ends
    the rank (and so the launch, at once: its peers lose their connection instead of waiting
    for it in a collective); the tests then run each exercise alone."""
    groups = make_groups(ctx)
    return {name: EXERCISE_WORKERS[name](ctx, groups) for name in names}


# ============================================================================ integration


def contract_checks(ctx) -> dict:
    """The optimizer contract on 3 ranks (reference code throughout): frozen, tied and unused
    parameters at every stage; a consolidated state dict resharded onto 2 ranks and onto one
    process; ZeRO-2 refusing a GradScaler with a clear error; ZeRO-3 under torch's
    ShardedGradScaler. Returns {check: problem or ""}."""
    groups = make_groups(ctx)
    result = {f"tied_zero{stage}": tied_trajectory(ctx, stage) for stage in (1, 2, 3)}
    result["tied_zero1_group"] = tied_trajectory(ctx, 1, groups["group"])

    # a state dict consolidated on 3 ranks, loaded on ranks {0, 2} and in one process
    model = data_parallel.make_model(ctx.rank, **C.SIZES)
    model.input_scale.copy_(data_parallel.make_model(0, **C.SIZES).input_scale)
    cls, kwargs = C.OPTIMIZERS["adamw"]
    zero = M.ZeroStage1(C.param_groups(model.named_parameters(), "adamw"), cls, **kwargs)
    for step in range(2):
        x, y = C.batch_on(ctx, step, BATCH, 0)
        zero.zero_grad()
        F.mse_loss(model(x), y).backward()
        zero.step()
    zero.consolidate_state_dict(to=0)
    state = [zero.state_dict() if ctx.rank == 0 else None]
    dist.broadcast_object_list(state, src=0)
    weights = [data_parallel.flat_params(model)]  # cloned per use: vector_to_parameters rebinds .data to it
    problems = []
    if ctx.rank != 0:
        try:
            zero.state_dict()
            problems.append(f"rank {ctx.rank}: state_dict() on a rank that did not consolidate: "
                            f"expected RuntimeError, got a dict")
        except RuntimeError:
            pass
    one = data_parallel.make_model(0, **C.SIZES)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(weights[0].clone(), one.parameters())
    one_opt = cls(C.param_groups(one.named_parameters(), "adamw"), **kwargs)
    one_opt.load_state_dict(state[0])
    if ctx.rank in (0, 2):
        pair = groups["group"]
        resumed = data_parallel.make_model(0, **C.SIZES)
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(weights[0].clone(), resumed.parameters())
        two = M.ZeroStage1(C.param_groups(resumed.named_parameters(), "adamw"), cls, group=pair, **kwargs)
        two.load_state_dict(state[0])
    for step in range(2, 4):
        gx, gy = data_parallel.global_batch(step, BATCH, 0, C.SIZES["d_in"], C.SIZES["d_out"])
        one_opt.zero_grad()
        F.mse_loss(one(gx), gy).backward()
        one_opt.step()
        if ctx.rank in (0, 2):
            j = [0, 2].index(ctx.rank)
            two.zero_grad()
            F.mse_loss(resumed(data_parallel.local_shard(gx, j, 2)),
                       data_parallel.local_shard(gy, j, 2)).backward()
            two.step()
    straight = C.train_single_process(0, 4, BATCH, optimizer="adamw")["params"]
    gap_one = max_abs_diff(data_parallel.flat_params(one), straight)
    problems.append("" if gap_one <= C.TOLERANCE else
                    f"rank {ctx.rank}: a state dict from 3 ranks loaded into torch's AdamW in one "
                    f"process: 2 more steps leave the uninterrupted run by {gap_one:.2e}")
    if ctx.rank in (0, 2):
        gap_two = max_abs_diff(data_parallel.flat_params(resumed), straight)
        problems.append("" if gap_two <= C.TOLERANCE else
                        f"rank {ctx.rank}: a state dict from 3 ranks loaded into ZeroStage1 on ranks "
                        f"[0, 2]: 2 more steps leave the uninterrupted run by {gap_two:.2e}")
    result["resharded_state_dict"] = first(problems)

    # ZeRO-2 refuses a GradScaler, clearly
    model = data_parallel.make_model(0, **C.SIZES)
    zero2 = M.ZeroStage2(model.parameters(), torch.optim.SGD, lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = C.batch_on(ctx, 0, BATCH, 0)
    scaler.scale(F.mse_loss(model(x), y)).backward()
    try:
        scaler.step(zero2)
        result["zero2_refuses_scaler"] = f"rank {ctx.rank}: ZeroStage2 under scaler.step: expected " \
                                         f"RuntimeError naming ZeroStage1, got none"
    except RuntimeError as exc:
        result["zero2_refuses_scaler"] = "" if "ZeroStage1" in str(exc) else \
            f"rank {ctx.rank}: ZeroStage2's refusal must point to ZeroStage1, got {exc}"

    # ZeRO-3 with torch's ShardedGradScaler (its flag all-reduced) == one process with GradScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    model = data_parallel.make_model(ctx.rank, **C.SIZES)
    model.input_scale.copy_(data_parallel.make_model(0, **C.SIZES).input_scale)
    Z3.ZeroStage3(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    one = data_parallel.make_model(0, **C.SIZES)
    one_opt = torch.optim.SGD(one.parameters(), lr=0.05, momentum=0.9)
    one_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    for step in range(4):
        x, y = C.batch_on(ctx, step, BATCH, 0)
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if step == 2 and ctx.rank == 1:
            next(model.parameters()).grad[0] = float("inf")
        scaler.step(opt)
        scaler.update()
        gx, gy = data_parallel.global_batch(step, BATCH, 0, C.SIZES["d_in"], C.SIZES["d_out"])
        one_opt.zero_grad()
        one_scaler.scale(F.mse_loss(one(gx), gy)).backward()
        if step == 2:
            rank_1_start = given_shard_bounds(one.fc1.weight.numel(), WORLD, 1)[0]
            one.fc1.weight.grad.view(-1)[rank_1_start] = float("inf")  # rank 1's first element
        one_scaler.step(one_opt)
        one_scaler.update()
    full = torch.cat([t.reshape(-1) for t in model.zero3.full_state_dict().values()])
    gap = max_abs_diff(full, data_parallel.flat_params(one))
    result["zero3_sharded_grad_scaler"] = first([
        "" if gap <= C.TOLERANCE else
        f"rank {ctx.rank}: ZeRO-3 + ShardedGradScaler (inf on rank 1 at step 2): parameters leave "
        f"one process + GradScaler by {gap:.2e}",
        "" if scaler.get_scale() == one_scaler.get_scale() else
        f"rank {ctx.rank}: ShardedGradScaler's scale: expected {one_scaler.get_scale()}, got "
        f"{scaler.get_scale()}"])
    return result
