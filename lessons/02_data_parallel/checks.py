"""Lesson 02's proof: every DDP variant of main.py against one process on the whole batch and
torch's DistributedDataParallel, what torch DDP does with its buckets (observed through its
logging data), the error an unused parameter gives; then BucketedDDP against torch DDP where
torch's contract says more: find_unused_parameters, buffers that change (BatchNorm) with and
without broadcast_buffers, tied weights, and two process groups at once; and the CLI.

`python lessons/02_data_parallel/main.py` runs `main()` here; `--bench` hands over to bench.py.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lessons._checks import max_abs_diff
from lessons._launch import RankContext, choose_device, inject_fault
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    launch_checks,
    lesson_parser,
)

from . import main as data_parallel

LESSON = "02_data_parallel"
# float64 runs: per step, DDP and the single process differ only in summation order
# ((B-1) eps sum|terms| ~ 1e-14 here; on a GPU too, whose float64 arithmetic is IEEE with other
# summation orders and fused multiply-adds); 1e-10 leaves room for growth over the steps, while
# a missed average or a skipped bucket is off by ~1e-2.
TOLERANCE = 1e-10
CHECK_CAP_BYTES = 1024  # the demo's bucket cap: 3 buckets on the tiny float64 model
KINDS = ("naive", "flat", "bucketed", "torch")


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def torch_ddp(ctx: RankContext, model: nn.Module, **kwargs) -> DistributedDataParallel:
    """torch's DDP around `model` (already on ctx.device), one device per process."""
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, **kwargs)


def shard_of_step(ctx: RankContext, index: int, batch: int, seed: int,
                  group: dist.ProcessGroup | None = None, **sizes):
    """This rank's rows of global batch `index` (its share among the ranks of `group`, None:
    all), on ctx.device."""
    x, y = data_parallel.global_batch(index, batch, seed, **sizes)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return (data_parallel.local_shard(x, rank, world).to(ctx.device),
            data_parallel.local_shard(y, rank, world).to(ctx.device))


def train_single_process(seed: int, steps: int, batch: int, accumulation: int = 1,
                         device: torch.device | str = "cpu") -> dict:
    """The reference: one process, the whole global batch (accumulation x batch rows) per step."""
    model = data_parallel.make_model(seed).to(device)
    optimizer = make_optimizer(model)
    losses = []
    for step in range(steps):
        xs, ys = zip(*(data_parallel.global_batch(step * accumulation + micro, batch, seed)
                       for micro in range(accumulation)))
        x, y = torch.cat(xs).to(device), torch.cat(ys).to(device)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": torch.tensor(losses, dtype=torch.float64),
            "params": data_parallel.flat_params(model).cpu()}


def train_data_parallel(ctx: RankContext, kind: str, seed: int, steps: int, batch: int,
                        accumulation: int = 1, buggy_accumulation: bool = False,
                        bucket_cap_bytes: int = CHECK_CAP_BYTES) -> dict:
    """Train on this rank's shard of every global batch (on ctx.device) with one DDP variant:
    'naive', 'flat', 'bucketed' (ours) or 'torch' (DistributedDataParallel).

    With accumulation k > 1 each step runs k micro-batches; the first k-1 inside no_sync().
    `buggy_accumulation` instead flips the sync flag only around backward, after forward has
    already read it: the historical bug (build-nanogpt pull request 30).
    Returns per-step global losses, the final parameters and (bucketed) the launch order.
    """
    torch.manual_seed(seed + 1000 + ctx.rank)  # different on every rank: the broadcast must fix it
    model = data_parallel.make_model(seed + ctx.rank).to(ctx.device)
    launches: list[int] = []
    if kind in ("naive", "flat"):
        data_parallel.broadcast_parameters_and_buffers(model)
        wrapped = model
    elif kind == "bucketed":
        wrapped = data_parallel.BucketedDDP(
            model, bucket_cap_mb=bucket_cap_bytes / 2**20,
            on_event=lambda event, bucket: launches.append(bucket) if event == "launch" else None)
    elif kind == "torch":
        wrapped = torch_ddp(ctx, model, bucket_cap_mb=bucket_cap_bytes / 2**20)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    optimizer = make_optimizer(model)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        step_loss = 0.0
        for micro in range(accumulation):
            last = micro == accumulation - 1
            x, y = shard_of_step(ctx, step * accumulation + micro, batch, seed)
            if buggy_accumulation:
                out = wrapped(x)                               # forward reads the stale flag
                wrapped.require_backward_grad_sync = last      # too late for this backward
                loss = F.mse_loss(out, y) / accumulation
                loss.backward()
            else:
                context = wrapped.no_sync() if (not last and kind in ("bucketed", "torch")) \
                    else contextlib.nullcontext()
                with context:
                    loss = F.mse_loss(wrapped(x), y) / accumulation
                    loss.backward()
            step_loss += loss.item()
        if kind == "naive":
            data_parallel.naive_all_reduce_gradients(model)
        elif kind == "flat":
            data_parallel.flat_all_reduce_gradients(model)
        optimizer.step()
        mean_loss = torch.tensor([step_loss], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / ctx.world_size)
    result = {"losses": torch.tensor(losses, dtype=torch.float64),  # float64, not a list: no
              "params": data_parallel.flat_params(model).cpu()}     # rounding on comparison
    if kind == "bucketed":
        result["launch_order"] = launches
        result["buckets"] = len(wrapped.buckets)
    return result


def ddp_bucket_history(ctx: RankContext, model: nn.Module, iterations: int, seed: int,
                       **ddp_kwargs) -> list[dict]:
    """Train torch DDP around `model` for `iterations` forward+backward passes and read its
    logging data (`_get_ddp_logging_data()`, a prototype interface) after each. DDP samples
    its runtime stats at the start of forward, so the entry after iteration k describes the
    backward of iteration k-1 (num_buckets_reduced) and whether buckets were rebuilt since."""
    ddp = torch_ddp(ctx, model, **ddp_kwargs)
    d_in, d_out = model.fc1.in_features, model.head.out_features
    history = []
    for index in range(iterations):
        x, y = shard_of_step(ctx, index, 4 * ctx.world_size, seed, d_in=d_in, d_out=d_out,
                             dtype=model.fc1.weight.dtype)
        F.mse_loss(ddp(x), y).backward()
        data = ddp._get_ddp_logging_data()
        history.append({key: data.get(key) for key in (
            "iteration", "num_buckets_reduced", "has_rebuilt_buckets",
            "rebuilt_per_bucket_param_indices", "bucket_cap_bytes")})
    return history


def parse_bucket_indices(text: str | None) -> list[list[int]]:
    """DDP's logged '5 4, 3 2, 1 0' as [[5, 4], [3, 2], [1, 0]]."""
    return [[int(i) for i in group.split()] for group in (text or "").split(",") if group.strip()]


def unused_parameter_error(ctx: RankContext, seed: int) -> str:
    """Backward through BucketedDDP on a model with an unused layer: the error message."""
    model = data_parallel.BucketedDDP(data_parallel.make_model(seed, unused=True).to(ctx.device),
                                      bucket_cap_mb=CHECK_CAP_BYTES / 2**20)
    x, y = shard_of_step(ctx, 0, 4 * ctx.world_size, seed)
    loss = F.mse_loss(model(x), y)
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return ""


# ============================================================================ torch's contract


class SpareMLP(data_parallel.TinyMLP):
    """TinyMLP whose spare layer joins the hidden stream only when forward is told to
    (`use_spare`): a layer used on some steps and ranks and not on others. `idle=True` adds a
    last layer no forward ever uses."""

    def __init__(self, idle: bool = False, **sizes):
        super().__init__(unused=True, **sizes)
        self.idle = nn.Linear(4, 4) if idle else None

    def forward(self, x: torch.Tensor, use_spare: bool = True) -> torch.Tensor:
        hidden = F.relu(self.fc1(x * self.input_scale))
        if use_spare:
            hidden = hidden + self.spare(hidden)
        return self.head(F.relu(self.fc2(hidden)))


class TwoHeadMLP(nn.Module):
    """fc1 -> ReLU -> two heads, (head, aux): forward runs both; the loss leaves aux out on some
    steps and ranks, so its layer gets no gradient although forward used it. A last layer,
    idle, no forward uses."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.fc1, self.head = nn.Linear(d_in, hidden), nn.Linear(hidden, d_out)
        self.aux, self.idle = nn.Linear(hidden, d_out), nn.Linear(d_out, d_out)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = F.relu(self.fc1(x))
        return self.head(hidden), self.aux(hidden)


class NormMLP(nn.Module):
    """fc1 -> BatchNorm1d -> ReLU -> head: every training forward updates the norm's buffers
    (running mean and variance, a batch counter) from this rank's own rows."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4):
        super().__init__()
        self.fc1, self.norm = nn.Linear(d_in, hidden), nn.BatchNorm1d(hidden)
        self.head = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.fc1(x))))


class TiedMLP(nn.Module):
    """fc1 (d -> h), then fc2 applied twice (one layer, two uses; `again` is the same module),
    then fc1's own weight, transposed, back to d (a tied decoder, as a language model ties its
    embedding and output layer). parameters() lists each shared tensor once."""

    def __init__(self, d_in: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_in, hidden), nn.Linear(hidden, hidden)
        self.again = self.fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.relu(self.again(F.relu(self.fc2(F.relu(self.fc1(x))))))
        return F.linear(hidden, self.fc1.weight.t())


def build(make: Callable[[], nn.Module], seed: int, device) -> nn.Module:
    """`make()` (a module class, or any function that builds one) in float64 with weights from
    `seed` alone, on `device`."""
    torch.manual_seed(seed)
    return make().to(torch.float64).to(device)


def torch_ddp_like(ctx: RankContext, model: nn.Module, broadcast_buffers: bool = True,
                   **kwargs) -> DistributedDataParallel:
    """torch's DDP with our constructor's meaning of broadcast_buffers: True is torch 2.13's
    forward_sync_buffers=True (the same as the deprecated broadcast_buffers=True); False is the
    deprecated broadcast_buffers=False, which also skips the buffers at construction. Before
    torch 2.13 (2.11 on the course's GPU box) there is no forward_sync_buffers, and
    broadcast_buffers=True, not yet deprecated, means the same."""
    if broadcast_buffers:
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
            return torch_ddp(ctx, model, forward_sync_buffers=True, **kwargs)
        return torch_ddp(ctx, model, broadcast_buffers=True, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return torch_ddp(ctx, model, broadcast_buffers=False, **kwargs)


def train_contract(ctx: RankContext, engine: str, model: nn.Module, steps: int, seed: int,
                   accumulation: int = 1, use: Callable[[int, int, int], dict] | None = None,
                   group: dist.ProcessGroup | None = None, d_out: int = 4, **ddp_kwargs) -> dict:
    """Train `model` (already on ctx.device) under our BucketedDDP or torch's (`engine` 'ours'
    or 'torch') over `group`, with SGD + momentum, `accumulation` micro-batches per step (all
    but the last inside no_sync()). `use(step, micro, group rank)` gives forward's keyword
    arguments, and (popped) `aux_loss`: whether the loss takes a tuple output's second element
    too (else only the first). Returns the gradients after each step's backward (a None kept
    as None), then the final parameters and buffers, by name."""
    ddp_kwargs.setdefault("bucket_cap_mb", CHECK_CAP_BYTES / 2**20)
    if engine == "ours":
        wrapped = data_parallel.BucketedDDP(model, process_group=group, **ddp_kwargs)
    else:
        wrapped = torch_ddp_like(ctx, model, process_group=group, **ddp_kwargs)
    optimizer = make_optimizer(model)
    d_in, grads = model.fc1.in_features, []
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(accumulation):
            x, y = shard_of_step(ctx, step * accumulation + micro, 4 * dist.get_world_size(group),
                                 seed, group, d_in=d_in, d_out=d_out)
            kwargs = use(step, micro, dist.get_rank(group)) if use else {}
            aux_loss = kwargs.pop("aux_loss", False)
            with wrapped.no_sync() if micro < accumulation - 1 else contextlib.nullcontext():
                output = wrapped(x, **kwargs)
                if isinstance(output, tuple):
                    output = output[0] + output[1] if aux_loss else output[0]
                F.mse_loss(output, y).backward()
        grads.append({name: None if p.grad is None else p.grad.detach().cpu().clone()
                      for name, p in model.named_parameters()})
        optimizer.step()
    return {"grads": grads,
            "params": {name: p.detach().cpu().clone() for name, p in model.named_parameters()},
            "buffers": {name: b.detach().cpu().clone() for name, b in model.named_buffers()}}


def contract_gap(ours: dict, theirs: dict) -> tuple[float, str]:
    """The largest |ours - torch| over every step's gradients, the final parameters and the
    buffers (inf where one has a gradient and the other None), and where it is."""
    worst, where = 0.0, "all equal"
    pairs = [(f"step {i} grad {n}", g, theirs["grads"][i][n]) for i, step in enumerate(ours["grads"])
             for n, g in step.items()]
    pairs += [(f"final {kind} {n}", t, theirs[kind][n]) for kind in ("params", "buffers")
              for n, t in ours[kind].items()]
    for name, a, b in pairs:
        if (a is None) != (b is None):
            return float("inf"), f"{name}: ours {'None' if a is None else 'a tensor'}, torch " \
                                 f"{'None' if b is None else 'a tensor'}"
        gap = 0.0 if a is None else max_abs_diff(a, b)
        if gap > worst:
            worst, where = gap, name
    return worst, where


def spare_plan(step: int, micro: int, rank: int, key: str = "use_spare") -> dict:
    """Which (step, micro-batch, rank) uses the optional layer: step 0 everywhere; step 1
    nowhere (no rank uses it: its .grad stays None); step 2 only group rank 0's last
    micro-batch; step 3 only the first micro-batch (under no_sync: used, though not in the
    synchronised one). `key`: forward's argument (use_spare) or the loss's (aux_loss)."""
    return {key: (step == 0 or (step == 2 and rank == 0 and micro == 1) or (step == 3 and micro == 0))}


def contract_checks(ctx: RankContext, seed: int) -> list[Check]:
    """BucketedDDP against torch DDP, float64, 4 steps each, gradients (None kept), weights
    and buffers: find_unused_parameters, BatchNorm buffers with and without broadcast_buffers,
    tied weights, and two process groups (the even and the odd ranks) at once."""
    def pair(name: str, make, **kwargs) -> Check:
        try:  # every rank meets the same error at the same point: no peer is left waiting
            runs = {engine: train_contract(ctx, engine, make(), 4, seed, **kwargs)
                    for engine in ("ours", "torch")}
        except RuntimeError as exc:
            return Check(name, False, f"raised {str(exc)[:150]}")
        gap, where = contract_gap(runs["ours"], runs["torch"])
        return Check(name, gap <= TOLERANCE, f"max |ours - torch| {gap:.1e} ({where})")

    def different(cls):  # a different model on every rank: the construction must fix it
        return lambda: build(cls, seed + ctx.rank, ctx.device)

    halves = [list(range(ctx.world_size))[start::2] for start in (0, 1) if start < ctx.world_size]
    groups = [dist.new_group(ranks) for ranks in halves]  # every rank creates every group
    mine = next(g for g, ranks in zip(groups, halves) if ctx.rank in ranks)
    return [
        pair("find_unused_parameters: a layer some steps and ranks skip, one no step uses == torch "
             "DDP (grads, None kept, weights)", different(lambda: SpareMLP(idle=True)), accumulation=2,
             use=spare_plan, find_unused_parameters=True),
        pair("find_unused_parameters: an output the loss leaves out on some steps and ranks == "
             "torch DDP (grads, None kept, weights)", different(TwoHeadMLP), accumulation=2,
             use=lambda *at: spare_plan(*at, key="aux_loss"), find_unused_parameters=True),
        pair("broadcast_buffers: BatchNorm's running stats, weights == torch DDP on every rank",
             different(NormMLP), accumulation=2),
        pair("broadcast_buffers=False: each rank keeps its own running stats, as torch DDP",
             different(NormMLP), accumulation=2, broadcast_buffers=False),
        pair("tied weights (one layer used twice, a weight in two roles) counted once == torch DDP",
             different(TiedMLP), d_out=16),
        pair(f"process groups {halves} at once == torch DDP on each group",
             different(data_parallel.TinyMLP), accumulation=2, group=mine),
    ]


def verify_worker(ctx: RankContext, seed: int, steps: int, batch: int, fault: str | None,
                  fault_rank: int) -> dict:
    """Every check of the demo, on one rank (every tensor a collective sees is on ctx.device)."""
    inject_fault(ctx, fault, fault_rank)
    checks: list[Check] = []
    reference = train_single_process(seed, steps, batch, device=ctx.device)
    runs = {kind: train_data_parallel(ctx, kind, seed, steps, batch) for kind in KINDS}
    for kind in ("naive", "flat", "bucketed"):
        loss_gap = max_abs_diff(runs[kind]["losses"], reference["losses"])
        param_gap = max_abs_diff(runs[kind]["params"], reference["params"])
        checks.append(Check(f"{kind} DDP == single process (losses, params)",
                            max(loss_gap, param_gap) <= TOLERANCE,
                            f"max |diff| loss {loss_gap:.1e}, params {param_gap:.1e}"))
        torch_gap = max(max_abs_diff(runs[kind]["losses"], runs["torch"]["losses"]),
                        max_abs_diff(runs[kind]["params"], runs["torch"]["params"]))
        checks.append(Check(f"{kind} DDP == torch DistributedDataParallel", torch_gap <= TOLERANCE,
                            f"max |diff| {torch_gap:.1e}"))

    buckets = runs["bucketed"]["buckets"]
    order = runs["bucketed"]["launch_order"]
    every_rank: list = [None] * ctx.world_size
    dist.all_gather_object(every_rank, order)
    checks.append(Check("buckets launch in order 0..n-1 (last layer first), same on every rank",
                        order == list(range(buckets)) * steps
                        and all(o == order for o in every_rank),
                        f"{buckets} buckets per step, order {order[:buckets]}"))

    ours = data_parallel.assign_buckets(list(data_parallel.make_model(seed).parameters()),
                                        CHECK_CAP_BYTES)
    history = ddp_bucket_history(ctx, data_parallel.make_model(seed).to(ctx.device), 3, seed,
                                 bucket_cap_mb=CHECK_CAP_BYTES / 2**20)
    rebuilt = parse_bucket_indices(history[2]["rebuilt_per_bucket_param_indices"])
    checks.append(Check("torch DDP: 1 bucket in iteration 1, then rebuilt in gradient order == ours",
                        history[1]["num_buckets_reduced"] == 1
                        and history[1]["has_rebuilt_buckets"] == 0
                        and history[2]["has_rebuilt_buckets"] == 1
                        and history[2]["num_buckets_reduced"] == len(ours) and rebuilt == ours,
                        f"buckets reduced {history[1]['num_buckets_reduced']} then "
                        f"{history[2]['num_buckets_reduced']}; rebuilt {rebuilt}, ours {ours}"))

    # torch's default cap (bucket_cap_mb=None): the rebuilt bucket 0 closes at 1 MiB, later
    # ones at 25 MiB. On this float32 model that gives 2 buckets, where 25 MiB alone gives 1.
    sizes = {"d_in": 512, "hidden": 512, "d_out": 8}
    params = list(data_parallel.make_model(seed, torch.float32, **sizes).parameters())
    with_first = data_parallel.assign_buckets(params, data_parallel.DEFAULT_BUCKET_CAP_BYTES,
                                              data_parallel.DDP_FIRST_BUCKET_BYTES)
    history = ddp_bucket_history(
        ctx, data_parallel.make_model(seed, torch.float32, **sizes).to(ctx.device), 3, seed)
    rebuilt = parse_bucket_indices(history[2]["rebuilt_per_bucket_param_indices"])
    without_first = data_parallel.assign_buckets(params, data_parallel.DEFAULT_BUCKET_CAP_BYTES)
    checks.append(Check("torch DDP default cap: a 1 MiB first bucket, then 25 MiB (ours with "
                        "first_cap_bytes)",
                        rebuilt == with_first and len(without_first) == 1 < len(with_first)
                        and history[2]["bucket_cap_bytes"] == data_parallel.DEFAULT_BUCKET_CAP_BYTES,
                        f"rebuilt {rebuilt}, ours {with_first} (no first cap: {without_first})"))

    accumulation = 3
    big_batch = train_single_process(seed, steps, batch, accumulation, device=ctx.device)
    ours_acc = train_data_parallel(ctx, "bucketed", seed, steps, batch, accumulation)
    torch_acc = train_data_parallel(ctx, "torch", seed, steps, batch, accumulation)
    gap = max(max_abs_diff(ours_acc["params"], big_batch["params"]),
              max_abs_diff(torch_acc["params"], big_batch["params"]))
    checks.append(Check(f"accumulation x{accumulation} with no_sync == one big batch (ours, torch)",
                        gap <= TOLERANCE, f"max |diff| {gap:.1e}"))

    ours_bug = train_data_parallel(ctx, "bucketed", seed, steps, batch, accumulation, True)
    torch_bug = train_data_parallel(ctx, "torch", seed, steps, batch, accumulation, True)
    bug_gap = max_abs_diff(ours_bug["params"], big_batch["params"])
    same_bug = max_abs_diff(ours_bug["params"], torch_bug["params"])
    # With one rank there is nothing to synchronise and the bug is harmless.
    caught = bug_gap > 1e3 * TOLERANCE if ctx.world_size > 1 else bug_gap <= TOLERANCE
    checks.append(Check("flag toggled around backward only: caught (wrong, as in torch DDP)",
                        caught and same_bug <= TOLERANCE,
                        f"off the big batch by {bug_gap:.1e}; ours vs torch DDP {same_bug:.1e}"
                        + ("" if ctx.world_size > 1 else " (1 rank: harmless)")))

    message = unused_parameter_error(ctx, seed)  # hooks run on one rank too
    checks.append(Check("unused parameters give a clear error", "spare.weight" in message,
                        message[:90] + "..." if message else "no error raised"))
    checks += contract_checks(ctx, seed)
    metrics = {"final_loss": float(runs["bucketed"]["losses"][-1]), "buckets": buckets,
               "max_param_diff_vs_torch": max_abs_diff(runs["bucketed"]["params"],
                                                       runs["torch"]["params"])}
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


# ============================================================================ the CLI


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Data parallelism from scratch, checked against "
                           "DistributedDataParallel.")
    parser.add_argument("--steps", type=int_in(1, 1000), default=4, help="training steps (default 4)")
    parser.add_argument("--batch", type=int_in(1, 1 << 16), default=24,
                        help="global batch per micro-step, divisible by the world size (default 24)")
    parser.add_argument("--bench", action="store_true",
                        help="step time: no communication, flat after backward, bucketed and "
                             "overlapped over a sweep of bucket caps, torch DDP; a timeline PNG")
    parser.add_argument("--bucket-mb", type=float_in(0.001, 1024), nargs="+", default=None,
                        metavar="MIB", help="bucket caps for --bench in MiB (default 0.5 6 25; "
                                            "0.0625 0.375 25 with --quick)")
    parser.add_argument("--plot", type=Path, default=Path("ddp_timeline.png"),
                        help="where --bench writes the timeline PNG")
    args = parser.parse_args(argv)
    world = check_args(parser, args)
    if args.batch % world:
        parser.error(f"--batch {args.batch} is not divisible by the world size {world}")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results, checks = launch_checks(verify_worker, args, (args.seed, args.steps, args.batch))
    world = len(results)
    metrics = dict(results[0]["metrics"])
    if args.bench:
        from . import bench
        metrics.update(bench.run_bench(args, world))
    metrics["headline"] = (f"bucketed DDP == torch DDP to {metrics['max_param_diff_vs_torch']:.0e}; "
                           f"{metrics['buckets']} buckets")
    device, backend = choose_device(args.device, world)
    return finish(Report(LESSON, device, backend, world, checks, metrics), args.json, started)
