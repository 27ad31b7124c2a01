"""Lesson 02: data parallelism (DDP), from a naive loop to bucketed, overlapped all-reduce.

Same model on every rank, a different slice of the batch on every rank, one averaged gradient.
main.py, top to bottom:
1. The model and its data: `make_model`, `global_batch`, and `local_shard` (rank r's rows).
2. The same start: `broadcast_parameters_and_buffers` (rank 0's copy wins).
3. Naive DDP: after backward, all-reduce every gradient on its own and divide by p. Then flat
   DDP: one all-reduce of all gradients concatenated (the latency paid once, not per tensor).
4. Buckets: `assign_buckets_by_size` groups gradients in reverse parameter order under a byte cap.
5. `BucketedDDP`: autograd hooks mark gradients ready; each full bucket starts an asynchronous
   all-reduce, in bucket order, while backward goes on; the end of backward waits for them.
   `no_sync()` turns communication off for gradient accumulation.
Then cost_model.py: bytes per rank, how many all-reduces (buckets), and the step time with
and without overlap.

The proof (a single process and torch's DistributedDataParallel) is in checks.py, the
benchmark in bench.py. Run: `python lessons/02_data_parallel/main.py --world-size 4`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # torch DDP's bucket_cap_mb default: 25 MiB
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES: 1 MiB

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
    """A TinyMLP (on the CPU) whose weights and buffer follow from `seed` alone."""
    torch.manual_seed(seed)
    model = TinyMLP(unused=unused, **sizes).to(dtype)
    model.input_scale.uniform_(0.5, 1.5)
    return model


def global_batch(step: int, batch: int, seed: int, d_in: int = 16, d_out: int = 4,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of step `step` (deterministic, on the CPU): inputs (batch, d_in),
    targets (batch, d_out)."""
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


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter, detached and concatenated in parameters() order: shape (Psi,)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ============================================================================ 2. same start


def broadcast_parameters_and_buffers(module: nn.Module, src: int = 0) -> None:
    """Make every rank start from rank `src`'s weights and buffers (what DDP's constructor does).
    Cost: one broadcast of the model, (params + buffers) bytes, once."""
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(tensor, src)


# ============================================================================ 3. naive, then flat


# exercise average-gradients (3 points): The averaged gradient: per tensor, then one flat buffer
# hint: dist.all_reduce sums in place (divide by dist.get_world_size()); torch.cat makes a
#   copy, so the flat variant copies each slice back with grad.copy_(...).
def naive_all_reduce_gradients(module: nn.Module) -> int:
    """Call after backward, on every rank. For every parameter of `module.parameters()` whose
    .grad is not None: all-reduce its .grad in place and divide by p (dist.all_reduce sums), so
    every rank's .grad holds the average (1/p) sum_r g_r, same shape and tensor as before.
    Parameters without a gradient are skipped (not counted, .grad stays None).

    Cost: one collective per parameter tensor, so the per-message latency alpha is paid
    n_tensors times; bytes per rank 2(p-1)/p x Psi x b with a ring. Returns the number of
    collectives launched (= the number of parameters with a gradient)."""
    world = dist.get_world_size()
    launched = 0
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world
            launched += 1
    return launched


# exercise average-gradients (continued)
def flat_all_reduce_gradients(module: nn.Module) -> int:
    """Call after backward, on every rank. Concatenate every gradient (the parameters whose
    .grad is not None, in parameters() order, each flattened) into one flat buffer of shape
    (Psi,), all-reduce it once, divide by p, and copy each slice back into its .grad in place
    (the buffer is a copy: without that, .grad keeps the local gradient). Afterwards every
    rank's .grad holds (1/p) sum_r g_r, exactly as `naive_all_reduce_gradients` leaves it.

    Cost: one collective (alpha paid once) for the same 2(p-1)/p x Psi x b bytes, at the price
    of a copy in and out and a temporary buffer of Psi elements. Returns 1 (collectives)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return 1


# ============================================================================ 4. buckets


# exercise bucket-assignment (3 points): Buckets by size, in gradient order, closed at the cap
# hint: walk reversed(range(n)); add the index first, then close the bucket once its bytes
#   reach the limit (>=); the limit is first_cap_bytes only until the first bucket closes.
def assign_buckets_by_size(sizes_bytes: list[int], cap_bytes: int,
                           first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices (in parameters() order) into buckets, walking them in REVERSE
    (backward produces the last layer's gradients first).

    The close-at-cap rule of torch DDP (reducer.cpp, compute_bucket_assignment_by_size): a
    parameter joins the open bucket, and the bucket closes once it holds at least the cap. A
    bucket passes the cap by at most one parameter; a parameter larger than the cap closes its
    bucket at once. `first_cap_bytes` caps bucket 0 alone (torch uses 1 MiB there when
    bucket_cap_mb is left at its default). Every index lands in exactly one bucket.

    Returns the buckets in the order they close (bucket 0 first), each a list of indices in
    the order they joined it (descending); a last, open bucket below the cap is kept; [] for no
    parameters. The same assignment as torch's reducer when it rebuilds its buckets.
    assign_buckets_by_size([8, 8, 8], 16) == [[2, 1], [0]];
    assign_buckets_by_size([8, 8, 8, 8], 100, first_cap_bytes=8) == [[3], [2, 1, 0]]."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for index in reversed(range(len(sizes_bytes))):
        current.append(index)
        size += sizes_bytes[index]
        limit = first_cap_bytes if first_cap_bytes is not None and not buckets else cap_bytes
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


# exercise bucket-assignment (continued)
def assign_buckets(params: list[nn.Parameter], cap_bytes: int,
                   first_cap_bytes: int | None = None) -> list[list[int]]:
    """`assign_buckets_by_size` on the parameters' sizes in bytes (numel x element size, so a
    float64 parameter weighs twice a float32 one of the same shape); indices into `params`."""
    return assign_buckets_by_size([p.numel() * p.element_size() for p in params], cap_bytes,
                                  first_cap_bytes)


# ============================================================================ 5. bucketed + overlapped


class BucketedDDP(nn.Module):
    """Our DistributedDataParallel: the averaged gradient, communicated during backward.

    Contract: `BucketedDDP(module, bucket_cap_bytes)` broadcasts rank 0's parameters and
    buffers, then groups the parameters into `self.buckets` (`assign_buckets`, with
    `first_bucket_cap_bytes` as bucket 0's own cap if given). Calling it
    runs `module` unchanged. After `loss.backward()`, every parameter's .grad holds the average
    over ranks, (1/p) sum_r g_r, unless that forward ran inside `no_sync()`: then .grad keeps
    the local gradient, accumulated as usual. Every parameter must get a gradient in a
    synchronised backward; otherwise backward raises a RuntimeError naming the parameters.

    How: a post-accumulate-grad hook per parameter marks it ready; when bucket i is complete
    and buckets 0..i-1 have started, the bucket's gradients are flattened and an async
    all-reduce starts (so every rank launches the same collectives in the same order, bucket
    0, 1, ..., n-1, as torch DDP does). The first hook of a backward queues an autograd-engine
    callback that runs when backward ends: it waits for every bucket, divides by p and copies
    the averages into .grad. As in torch DDP, whether a backward synchronises is decided in
    `forward`, from `require_backward_grad_sync` (which `no_sync()` turns off), and stored in
    `self._sync_this_backward`: the hooks (`_make_hook`, `_launch`, `_finish`) read only that
    decision and the bookkeeping of `_start_backward()`.

    Cost per synchronised backward: len(self.buckets) all-reduces, 2(p-1)/p x Psi x b bytes
    sent per rank in all, one copy of each gradient into its bucket and back. Rank 0's buffers
    are broadcast once, here (torch DDP re-broadcasts them before every synchronised forward).
    `on_event(kind, bucket)`, if given, is told ("launch", i) when bucket i's all-reduce
    starts, ("backward_end", -1) when backward ends, ("reduced", i) when bucket i's average is
    in .grad: timing and checks observe through it, it never changes a result.
    """

    def __init__(self, module: nn.Module, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 first_bucket_cap_bytes: int | None = None,
                 on_event: Callable[[str, int], None] | None = None):
        super().__init__()
        self.module = module
        broadcast_parameters_and_buffers(module)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {id(p): name for name, p in module.named_parameters()}
        self.buckets = assign_buckets(self.params, bucket_cap_bytes, first_bucket_cap_bytes)
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self.require_backward_grad_sync = True
        self.on_event = on_event
        self._sync_this_backward = False
        self._start_backward()
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._make_hook(index))

    def _start_backward(self) -> None:
        """The bookkeeping of one backward, reset by every forward."""
        self._pending = [set(bucket) for bucket in self.buckets]  # [b]: not ready yet in bucket b
        self._next_bucket = 0  # the next bucket to launch: strictly in index order
        self._inflight: list[tuple[int, torch.Tensor, dist.Work]] = []  # (bucket, flat, work)
        self._callback_queued = False  # is `_finish` queued for the end of this backward?

    def _notify(self, kind: str, bucket: int) -> None:
        if self.on_event is not None:
            self.on_event(kind, bucket)

    # exercise no-sync (2 points): Decide at forward; no_sync() for gradient accumulation
    # hint: decide in forward, never in backward; no_sync: save the flag, clear it, yield
    #   inside try, restore the saved value in finally.
    def forward(self, *args, **kwargs):
        """Run `self.module(*args, **kwargs)` and return its output unchanged. Before it, decide
        whether the backward of this forward synchronises: only if `require_backward_grad_sync`
        is set (no_sync() clears it) and grad mode is on (torch.is_grad_enabled()). Store the
        decision in `self._sync_this_backward` (the hooks read it; changing the flag after
        forward is too late, as in torch DDP), and reset the bookkeeping: call
        `self._start_backward()` once per forward."""
        self._sync_this_backward = self.require_backward_grad_sync and torch.is_grad_enabled()
        self._start_backward()
        return self.module(*args, **kwargs)

    # exercise no-sync (continued)
    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes whose FORWARD ran inside this context accumulate gradients locally
        without communication; the first synchronised backward after it all-reduces the
        accumulated sum. Cost: no bytes sent for those micro-steps.

        Contract: `require_backward_grad_sync` is False inside the context and gets back the
        value it had before on exit, also when the body raises; contexts nest (leaving an
        inner one keeps it False)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # exercise bucketed-reducer (5 points): Hooks, in-order async launches, wait and unflatten
    # hint: queue self._finish once per backward with
    #   torch.autograd.Variable._execution_engine.queue_callback; launch in a `while` loop from
    #   self._next_bucket, never a bucket whose predecessors are still pending.
    def _make_hook(self, index: int):
        """Return the hook of parameter `index` (self.params[index]): hook(param) -> None,
        which __init__ registers with register_post_accumulate_grad_hook, so it runs once
        param.grad holds this backward's (accumulated) gradient. On an unsynchronised backward
        (`self._sync_this_backward` False) it does nothing. Otherwise: at the first gradient
        of this backward queue `_finish` as an autograd-engine callback (once per backward,
        `_callback_queued`), mark `index` ready (remove it from
        `_pending[self.bucket_of[index]]`), then launch every complete bucket from
        `_next_bucket` on, in index order (a complete bucket waits for its predecessors: every
        rank then issues the same all-reduces in the same order)."""
        def hook(param: torch.Tensor) -> None:
            if not self._sync_this_backward:
                return
            if not self._callback_queued:  # first gradient of this backward
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._callback_queued = True
            self._pending[self.bucket_of[index]].discard(index)
            while self._next_bucket < len(self.buckets) and not self._pending[self._next_bucket]:
                self._launch(self._next_bucket)
                self._next_bucket += 1
        return hook

    # exercise bucketed-reducer (continued)
    def _launch(self, bucket: int) -> None:
        """Flatten the bucket's gradients into a new 1-D buffer (each .grad reshaped to 1-D, in
        the order of `self.buckets[bucket]`), start `dist.all_reduce(flat, async_op=True)`
        (returns at once with a Work), append (bucket, flat, work) to `self._inflight`, then
        `self._notify("launch", bucket)`."""
        flat = torch.cat([self.params[i].grad.reshape(-1) for i in self.buckets[bucket]])
        work = dist.all_reduce(flat, async_op=True)
        self._inflight.append((bucket, flat, work))
        self._notify("launch", bucket)

    # exercise bucketed-reducer (continued)
    def _finish(self) -> None:
        """End of backward (the autograd engine calls it once, after every hook ran). Every
        bucket must have launched: if not, some parameter got no gradient, so switch
        `_sync_this_backward` off and raise a RuntimeError naming every parameter still
        pending (by its name in `self.names[id(param)]`, e.g. 'spare.weight'). Else
        `self._notify("backward_end", -1)`, then for each (bucket, flat, work) of `_inflight`
        in launch order: wait for the work, divide flat by p, copy each slice back into its
        .grad in place (the order of `_launch`), `self._notify("reduced", bucket)`; at the end
        `_inflight` is empty. Afterwards every .grad holds (1/p) sum_r g_r."""
        if self._next_bucket < len(self.buckets):
            missing = [self.names[id(self.params[i])]
                       for pending in self._pending for i in sorted(pending)]
            self._sync_this_backward = False
            raise RuntimeError(
                f"parameters {missing} received no gradient in this backward, so their bucket "
                "never filled and its all-reduce (and every later bucket's) would never start "
                "(torch DDP raises at the next forward unless find_unused_parameters=True); "
                "use every parameter in forward or remove it")
        self._notify("backward_end", -1)
        world = dist.get_world_size()
        for bucket, flat, work in self._inflight:
            work.wait()  # on a GPU: the current stream waits for the all-reduce
            flat /= world
            offset = 0
            for i in self.buckets[bucket]:
                grad = self.params[i].grad
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            self._notify("reduced", bucket)
        self._inflight = []


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
