"""Lesson 02: data parallelism (DDP), from a naive loop to bucketed, overlapped all-reduce.

The story, top to bottom:

1. A model, a global batch split across ranks, and the single-process reference it must equal.
2. Start from the same weights: `broadcast_parameters_and_buffers` (rank 0's copy wins).
3. Naive DDP: after backward, all-reduce every gradient separately and divide by p.
4. Flat DDP: one all-reduce of all gradients concatenated (one message instead of many).
5. Bucketed, overlapped DDP (`BucketedDDP`): autograd hooks mark gradients ready; buckets in
   reverse parameter order under a byte cap; each full bucket launches an async all-reduce
   while backward goes on; everything is waited on at the end of backward. `no_sync()` for
   gradient accumulation, and the historical accumulation bug.
6. The checks: every variant equals the single-process run and torch's
   DistributedDataParallel; buckets launch in the documented order; unused parameters give a
   clear error; accumulation with no_sync equals one big batch.
7. `--bench`: step time of ours and torch DDP side by side, and a timeline of bucket launches.

Run: `python lessons/02_data_parallel/main.py --world-size 4`.
"""

from __future__ import annotations

import contextlib
import importlib
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from lessons._launch import RankContext, choose_device, inject_fault, is_reporting_rank, launch
from lessons._report import (
    Check,
    Report,
    check_args,
    finish,
    float_in,
    int_in,
    lesson_parser,
    merge_rank_checks,
    run_main,
)

LESSON = "02_data_parallel"
COLLECTIVES = importlib.import_module("lessons.01_collectives.main")  # lesson 01's formulas
DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # torch DDP's bucket_cap_mb default: 25 MiB
# float64 runs: per step, DDP and the single process differ only in summation order
# ((B-1) eps sum|terms| ~ 1e-14 here); 1e-10 leaves room for growth over the steps, while a
# missed average or a skipped bucket is off by ~1e-2.
TOLERANCE = 1e-10

# ============================================================================ 1. model and data


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
    torch.manual_seed(seed)
    model = TinyMLP(unused=unused, **sizes).to(dtype)
    model.input_scale.uniform_(0.5, 1.5)
    return model


def global_batch(step: int, batch: int, seed: int, d_in: int = 16, d_out: int = 4,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of step `step` (deterministic): inputs (batch, d_in), targets (batch, d_out)."""
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


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train_single_process(seed: int, steps: int, batch: int, accumulation: int = 1) -> dict:
    """The reference: one process, the whole global batch (accumulation x batch rows) per step."""
    model = make_model(seed)
    optimizer = make_optimizer(model)
    losses = []
    for step in range(steps):
        xs, ys = zip(*(global_batch(step * accumulation + micro, batch, seed)
                       for micro in range(accumulation)))
        x, y = torch.cat(xs), torch.cat(ys)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "params": flat_params(model)}


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ============================================================================ 2. same start


def broadcast_parameters_and_buffers(module: nn.Module, src: int = 0) -> None:
    """Make every rank start from rank `src`'s weights and buffers (what DDP's constructor does).
    Cost: one broadcast of the model, (params + buffers) bytes, once."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src)


# ============================================================================ 3. naive


def naive_all_reduce_gradients(module: nn.Module) -> int:
    """After backward: all-reduce each gradient on its own, then divide by p (dist.all_reduce
    sums). One collective per parameter tensor: latency paid n_params times. Returns the
    number of collectives launched."""
    world = dist.get_world_size()
    launched = 0
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world
            launched += 1
    return launched


# ============================================================================ 4. flat


def flat_all_reduce_gradients(module: nn.Module) -> int:
    """After backward: concatenate every gradient into one buffer, all-reduce it once, divide,
    copy back. One collective (alpha paid once) at the price of a copy in and out."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return 1


# ============================================================================ 5. bucketed + overlapped


def assign_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets in REVERSE parameter order (backward produces the
    last layer's gradients first). See `assign_buckets_by_size`."""
    return assign_buckets_by_size([p.numel() * p.element_size() for p in params], cap_bytes)


def assign_buckets_by_size(sizes_bytes: list[int], cap_bytes: int) -> list[list[int]]:
    """Bucket assignment on sizes alone, indices in `parameters()` order. As in torch DDP, a
    parameter joins the open bucket and the bucket closes once it holds at least `cap_bytes`:
    a bucket passes the cap by at most one parameter, and a parameter larger than the cap
    closes its bucket at once. assign_buckets_by_size([8, 8, 8], 16) == [[2, 1], [0]]."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(sizes_bytes))):
        current.append(index)
        size += sizes_bytes[index]
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def count_buckets(sizes_bytes: list[int], cap_bytes: int) -> int:
    """How many all-reduces (one per bucket) a backward launches."""
    return len(assign_buckets_by_size(sizes_bytes, cap_bytes))


def ddp_bytes_per_rank(num_params: float, bytes_per_param: int, world_size: int) -> float:
    """Bytes each rank sends per step to all-reduce the gradient with a ring (lesson 01):
    2(p-1)/p x Psi x b, the same for the naive, flat and bucketed variants."""
    return COLLECTIVES.ring_all_reduce_bytes_formula(num_params * bytes_per_param, world_size)


class BucketedDDP(nn.Module):
    """Our DistributedDataParallel: broadcast at start, gradient buckets all-reduced
    asynchronously as soon as they are full, waited on when backward ends.

    Per backward: one async all-reduce per bucket, launched from a post-accumulate-grad hook
    the moment the bucket's last gradient is ready, so communication overlaps the rest of
    backward. An autograd-engine callback at the end of backward waits for every bucket,
    divides by p and copies the averages back into `.grad`.
    As in torch DDP, whether a backward synchronizes is decided in `forward` (from
    `require_backward_grad_sync`, which `no_sync()` turns off).
    """

    def __init__(self, module: nn.Module, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES):
        super().__init__()
        self.module = module
        broadcast_parameters_and_buffers(module)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.buckets = assign_buckets(self.params, bucket_cap_bytes)
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self.require_backward_grad_sync = True
        self.launch_log: list[tuple[int, float]] = []  # (bucket, time.perf_counter() at launch)
        self.wait_log: list[tuple[float, float]] = []  # (start, end) of the end-of-backward wait
        self._sync_this_backward = False
        self._reset_backward_state()
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._make_hook(index))

    def _reset_backward_state(self) -> None:
        self._pending = [set(bucket) for bucket in self.buckets]
        self._inflight: list[tuple[int, torch.Tensor, object]] = []
        self._callback_queued = False

    def forward(self, *args, **kwargs):
        self._sync_this_backward = self.require_backward_grad_sync and torch.is_grad_enabled()
        self._reset_backward_state()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes whose FORWARD ran inside this context accumulate gradients locally
        without communication; the first backward after it all-reduces the accumulated sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self._sync_this_backward:
                return
            if not self._callback_queued:  # first gradient of this backward
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._callback_queued = True
            bucket = self.bucket_of[index]
            self._pending[bucket].discard(index)
            if not self._pending[bucket]:
                self._launch(bucket)
        return hook

    def _launch(self, bucket: int) -> None:
        """Flatten the bucket's gradients and start an async all-reduce (returns at once)."""
        flat = torch.cat([self.params[i].grad.reshape(-1) for i in self.buckets[bucket]])
        work = dist.all_reduce(flat, async_op=True)
        self._inflight.append((bucket, flat, work))
        self.launch_log.append((bucket, time.perf_counter()))

    def _finish(self) -> None:
        """End of backward: every bucket must have launched (else some parameter got no
        gradient), then wait, average and write back."""
        missing = [self.names[id(self.params[i])] for pending in self._pending for i in pending]
        if missing:
            self._sync_this_backward = False
            raise RuntimeError(
                f"parameters {missing} received no gradient in this backward, so their bucket "
                "never filled and its all-reduce would never start (torch DDP hangs or errors "
                "here unless find_unused_parameters=True); use every parameter in forward or "
                "remove it")
        world = dist.get_world_size()
        wait_start = time.perf_counter()
        for bucket, flat, work in self._inflight:
            work.wait()
            flat /= world
            offset = 0
            for i in self.buckets[bucket]:
                grad = self.params[i].grad
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        self._inflight = []
        self.wait_log.append((wait_start, time.perf_counter()))


# ============================================================================ 6. training loops


def train_data_parallel(ctx: RankContext, kind: str, seed: int, steps: int, batch: int,
                        accumulation: int = 1, buggy_accumulation: bool = False,
                        bucket_cap_bytes: int = 1024) -> dict:
    """Train on this rank's shard of every global batch with one DDP variant:
    'naive', 'flat', 'bucketed' (ours) or 'torch' (DistributedDataParallel).

    With accumulation k > 1 each step runs k micro-batches; the first k-1 inside no_sync().
    `buggy_accumulation` instead flips the sync flag only around backward, after forward has
    already read it: the historical bug (build-nanogpt issue 30).
    Returns per-step global losses and the final parameters as lists.
    """
    torch.manual_seed(seed + 1000 + ctx.rank)  # different on every rank: the broadcast must fix it
    model = make_model(seed + ctx.rank)
    if kind in ("naive", "flat"):
        broadcast_parameters_and_buffers(model)
        wrapped = model
    elif kind == "bucketed":
        wrapped = BucketedDDP(model, bucket_cap_bytes=bucket_cap_bytes)
    elif kind == "torch":
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_bytes / 2**20)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    optimizer = make_optimizer(model)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        step_loss = 0.0
        for micro in range(accumulation):
            last = micro == accumulation - 1
            x, y = global_batch(step * accumulation + micro, batch, seed)
            x, y = local_shard(x, ctx.rank, ctx.world_size), local_shard(y, ctx.rank, ctx.world_size)
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
            naive_all_reduce_gradients(model)
        elif kind == "flat":
            flat_all_reduce_gradients(model)
        optimizer.step()
        mean_loss = torch.tensor([step_loss], dtype=torch.float64)
        dist.all_reduce(mean_loss)
        losses.append(mean_loss.item() / ctx.world_size)
    result = {"losses": losses, "params": flat_params(model).tolist()}
    if kind == "bucketed":
        result["launch_order"] = [bucket for bucket, _ in wrapped.launch_log]
        result["buckets"] = len(wrapped.buckets)
    return result


def max_abs_diff(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max()) if a.numel() else 0.0


def unused_parameter_error(ctx: RankContext, seed: int) -> str:
    """Backward through BucketedDDP on a model with an unused layer: the error message."""
    model = BucketedDDP(make_model(seed, unused=True), bucket_cap_bytes=1024)
    x, y = global_batch(0, 4 * ctx.world_size, seed)
    loss = F.mse_loss(model(local_shard(x, ctx.rank, ctx.world_size)),
                      local_shard(y, ctx.rank, ctx.world_size))
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return ""


def verify_worker(ctx: RankContext, seed: int, steps: int, batch: int, fault: str | None,
                  fault_rank: int) -> dict:
    """Every check of the demo, on one rank."""
    inject_fault(ctx, fault, fault_rank)
    checks: list[Check] = []
    reference = train_single_process(seed, steps, batch)
    runs = {kind: train_data_parallel(ctx, kind, seed, steps, batch)
            for kind in ("naive", "flat", "bucketed", "torch")}
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

    order = runs["bucketed"]["launch_order"]
    every_rank: list = [None] * ctx.world_size
    dist.all_gather_object(every_rank, order)
    expected = list(range(runs["bucketed"]["buckets"])) * steps
    checks.append(Check("buckets launch in reverse parameter order, same on every rank",
                        order == expected and all(o == order for o in every_rank),
                        f"{runs['bucketed']['buckets']} buckets per step, order "
                        f"{order[:runs['bucketed']['buckets']]}"))

    accumulation = 3
    big_batch = train_single_process(seed, steps, batch, accumulation)
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
    metrics = {"final_loss": runs["bucketed"]["losses"][-1],
               "buckets": runs["bucketed"]["buckets"], "max_param_diff_vs_torch":
               max_abs_diff(runs["bucketed"]["params"], runs["torch"]["params"])}
    return {"checks": [vars(c) for c in checks], "metrics": metrics}


# ============================================================================ 7. the benchmark


def bench_worker(ctx: RankContext, hidden: int, steps: int, bucket_cap_bytes: int) -> dict:
    """Step time (forward + backward + sync + SGD) of our BucketedDDP and torch DDP on the
    same float32 model and data, alternating step by step; plus one step's bucket timeline."""
    def build(kind: str):
        model = make_model(0, torch.float32, d_in=hidden, hidden=hidden, d_out=hidden).to(ctx.device)
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = BucketedDDP(model, bucket_cap_bytes) if kind == "ours" else \
            DistributedDataParallel(model, device_ids=device_ids,
                                    bucket_cap_mb=bucket_cap_bytes / 2**20)
        return model, wrapped, make_optimizer(model)

    runs = {kind: build(kind) for kind in ("ours", "torch")}
    x, y = global_batch(0, 64 * ctx.world_size, 0, hidden, hidden, torch.float32)
    x = local_shard(x, ctx.rank, ctx.world_size).to(ctx.device)
    y = local_shard(y, ctx.rank, ctx.world_size).to(ctx.device)
    times: dict[str, list[float]] = {"ours": [], "torch": []}
    timeline = {}
    for step in range(steps + 1):
        for kind, (_, wrapped, optimizer) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            optimizer.zero_grad()
            loss = F.mse_loss(wrapped(x), y)
            backward_start = time.perf_counter()
            loss.backward()
            backward_end = time.perf_counter()
            optimizer.step()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            elapsed = time.perf_counter() - start
            if step > 0:  # step 0 is warm-up
                times[kind].append(elapsed)
            if kind == "ours" and step == steps:
                timeline = {"backward_s": backward_end - backward_start,
                            "wait_s": [t - backward_start for t in wrapped.wait_log[-1]],
                            "launches": [(b, t - backward_start)
                                         for b, t in wrapped.launch_log[-len(wrapped.buckets):]],
                            "bucket_bytes": [sum(wrapped.params[i].numel() * 4 for i in bucket)
                                             for bucket in wrapped.buckets]}
    return {"ours_s": statistics.median(times["ours"]), "torch_s": statistics.median(times["torch"]),
            "timeline": timeline, "params": sum(p.numel() for p in runs["ours"][0].parameters())}


def plot_timeline(timeline: dict, path: Path) -> None:
    """Bucket launch times against the backward pass, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 2.5))
    ax.barh(0, timeline["backward_s"] * 1e3, color="#cde", label="loss.backward()")
    wait_start, wait_end = timeline["wait_s"]
    ax.barh(0, (wait_end - wait_start) * 1e3, left=wait_start * 1e3, color="#f9c",
            label="end-of-backward wait for the all-reduces")
    for bucket, start in timeline["launches"]:
        ax.plot([start * 1e3], [0], "v", color="C3")
        ax.annotate(f"b{bucket}", (start * 1e3, 0.15), ha="center", fontsize=8)
    ax.set_yticks([])
    ax.set_xlabel("ms since loss.backward() was called")
    ax.set_title("bucket all-reduce launches during backward (rank 0)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ============================================================================ the demo


def parse_args(argv: list[str] | None = None):
    parser = lesson_parser("Data parallelism from scratch, checked against "
                           "DistributedDataParallel.")
    parser.add_argument("--steps", type=int_in(1, 1000), default=4, help="training steps (default 4)")
    parser.add_argument("--batch", type=int_in(1, 1 << 16), default=24,
                        help="global batch per micro-step, divisible by --world-size (default 24)")
    parser.add_argument("--bench", action="store_true", help="step time ours vs torch DDP, "
                                                             "and a bucket timeline PNG")
    parser.add_argument("--bucket-mb", type=float_in(0.001, 1024), default=None,
                        help="bucket cap for --bench in MiB (default 1; 0.25 with --quick)")
    parser.add_argument("--plot", type=Path, default=Path("ddp_timeline.png"),
                        help="where --bench writes the timeline PNG")
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.batch % args.world_size:
        parser.error(f"--batch {args.batch} is not divisible by --world-size {args.world_size}")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    results = launch(verify_worker, args.world_size,
                     (args.seed, args.steps, args.batch, args.fault, args.fault_rank),
                     device="cpu" if args.device == "auto" else args.device, timeout_s=args.timeout)
    world = len(results)
    checks = merge_rank_checks([r["checks"] for r in results])
    metrics = dict(results[0]["metrics"])
    if args.bench:
        hidden, steps = (256, 5) if args.quick else (1024, 10)
        bucket_mb = args.bucket_mb or (0.25 if args.quick else 1.0)
        bench = launch(bench_worker, args.world_size, (hidden, steps, int(bucket_mb * 2**20)),
                       device=args.device,
                       timeout_s=max(args.timeout, 600))[0]
        metrics.update(step_ms_ours=bench["ours_s"] * 1e3, step_ms_torch=bench["torch_s"] * 1e3,
                       ratio_ours_torch=bench["ours_s"] / bench["torch_s"],
                       bench_params=bench["params"], timeline=bench["timeline"])
        if is_reporting_rank():
            line = bench["timeline"]
            print(f"\nstep time, {bench['params']:,} float32 parameters, {world} ranks: ours "
                  f"{bench['ours_s'] * 1e3:.1f} ms, torch DDP {bench['torch_s'] * 1e3:.1f} ms "
                  f"(ratio {bench['ours_s'] / bench['torch_s']:.2f})")
            print(f"loss.backward() took {line['backward_s'] * 1e3:.1f} ms, of which "
                  f"{(line['wait_s'][1] - line['wait_s'][0]) * 1e3:.1f} ms waiting for all-reduces "
                  "at the end; bucket launches (ms after backward() was called):")
            for bucket, start in line["launches"]:
                print(f"  bucket {bucket} ({line['bucket_bytes'][bucket] / 2**20:.2f} MiB) at "
                      f"{start * 1e3:7.2f} ms")
            plot_timeline(line, args.plot)
            print(f"timeline written to {args.plot}")
    metrics["headline"] = (f"bucketed DDP == torch DDP to {metrics['max_param_diff_vs_torch']:.0e}; "
                           f"{metrics['buckets']} buckets")
    device, backend = choose_device("cpu" if args.device == "auto" else args.device, world)
    return finish(Report(LESSON, device, backend, world, checks, metrics), args.json, started)


if __name__ == "__main__":
    run_main(main)
