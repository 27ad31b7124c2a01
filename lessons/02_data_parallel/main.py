"""Lesson 02: data parallelism (DDP), from a naive loop to bucketed, overlapped all-reduce.

Same model on every rank (model.py: the model and its data), a different slice of the batch on
every rank, one averaged gradient. main.py, top to bottom, over a process group (None: all):
1. The same start: `broadcast_parameters_and_buffers` (rank 0's copy wins).
2. Naive DDP: after backward, all-reduce every gradient on its own and divide by p. Then flat
   DDP: one all-reduce of all gradients concatenated (the latency paid once, not per tensor).
3. Buckets: `assign_buckets_by_size` groups gradients in reverse parameter order under a byte cap.
4. `BucketedDDP`, with torch DDP's contract: autograd hooks mark gradients ready; each full
   bucket starts an asynchronous all-reduce, in bucket order, while backward goes on; the end
   of backward waits for them. `no_sync()` turns communication off for gradient accumulation;
   buffers follow rank 0 at each forward; find_unused.py finds what a forward left out.
Then cost_model.py: bytes, buckets and the step time with and without overlap. The proof
(one process and torch's DistributedDataParallel) is in checks.py, the benchmark in bench.py.
Run: `python lessons/02_data_parallel/main.py --world-size 4`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn as nn

_data = importlib.import_module("lessons.02_data_parallel.model")  # the model and its data
TinyMLP, make_model, global_batch = _data.TinyMLP, _data.make_model, _data.global_batch
local_shard, flat_params = _data.local_shard, _data.flat_params  # (lessons 03, 06, 13 use them)
find_unused = importlib.import_module("lessons.02_data_parallel.find_unused")  # unused_parameters

DEFAULT_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # torch DDP's bucket_cap_mb default: 25 MiB
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES: 1 MiB
Group = dist.ProcessGroup | None  # a process group; None is the default group (every rank)

# ============================================================================ 1. same start


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0, *, group: Group = None) -> None:
    """Overwrite each tensor, in place, with rank `src`'s (a rank of `group`, as
    dist.broadcast's group_src counts it). Cost: one broadcast per tensor, their bytes once."""
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, group=group, group_src=src)


def broadcast_parameters_and_buffers(module: nn.Module, src: int = 0, *, group: Group = None) -> None:
    """Make every rank of `group` start from rank `src`'s weights and buffers (what DDP's
    constructor does). Cost: one broadcast of the model, (params + buffers) bytes, once."""
    broadcast_tensors([*module.parameters(), *module.buffers()], src, group=group)


# ============================================================================ 2. naive, then flat


# exercise average-gradients (3 points): The averaged gradient: per tensor, then one flat buffer
# hint: dist.all_reduce(..., group=group) sums in place (divide by the group's size);
#   torch.cat makes a copy, so the flat variant copies each slice back with grad.copy_(...).
def naive_all_reduce_gradients(module: nn.Module, *, group: Group = None) -> int:
    """Call after backward, on every rank of `group` (None: all ranks; p is its size). For
    every parameter of `module.parameters()` whose .grad is not None: all-reduce its .grad in
    place and divide by p (dist.all_reduce sums), so every rank's .grad holds the average
    (1/p) sum_r g_r in the same tensor as before (its storage, not a new one). Parameters
    without a gradient are skipped (not counted, .grad stays None).

    Cost: one collective per parameter tensor, so the per-message latency alpha is paid
    n_tensors times; bytes per rank 2(p-1)/p x Psi x b with a ring. Returns the number of
    collectives launched (= the number of parameters with a gradient)."""
    world = dist.get_world_size(group)
    launched = 0
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            param.grad /= world
            launched += 1
    return launched


# exercise average-gradients (continued)
def flat_all_reduce_gradients(module: nn.Module, *, group: Group = None) -> int:
    """Call after backward, on every rank of `group`. Concatenate every gradient (the
    parameters whose .grad is not None, in parameters() order, each flattened) into one flat
    buffer of shape (Psi,), all-reduce it once, divide by p (before or after: equal up to
    rounding), and copy each slice back into its .grad in place (the buffer is a copy: without
    that, .grad keeps the local gradient). Afterwards every rank's .grad, the same tensor as
    before, holds (1/p) sum_r g_r, as `naive_all_reduce_gradients` leaves it.

    Cost: one collective (alpha paid once) for the same 2(p-1)/p x Psi x b bytes, at the price
    of a copy in and out and a temporary buffer of Psi elements. Returns 1 (collectives)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    return 1


# ============================================================================ 3. buckets


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


# ============================================================================ 4. bucketed + overlapped


class BucketedDDP(nn.Module):
    """Our DistributedDataParallel: the averaged gradient, communicated during backward.

    Contract (torch DDP's, for the arguments both have): `BucketedDDP(module, *,
    broadcast_buffers=True, process_group=None, bucket_cap_mb=None,
    find_unused_parameters=False)` works over the p ranks of `process_group` (None: all; "rank
    0" is its rank 0). It broadcasts rank 0's parameters (and buffers, if broadcast_buffers),
    then groups the parameters that require grad (`module.parameters()`: a tied weight once)
    into `self.buckets` (`assign_buckets`; bucket_cap_mb None: 25 MiB with a 1 MiB bucket 0,
    as torch). Calling it runs `module` unchanged. After `loss.backward()`, every parameter's
    .grad holds the average over ranks, (1/p) sum_r g_r, unless that forward ran inside
    `no_sync()`: then .grad keeps the local gradient, accumulated as usual. A parameter with no
    gradient in a synchronised backward: without find_unused_parameters, backward raises a
    RuntimeError naming it; with it, as in torch DDP, it counts as zero here (plus any gradient
    accumulated under no_sync), its .grad gets the average if some rank used it since the last
    synchronised backward, and stays untouched (None stays None) if no rank did.

    How: a post-accumulate-grad hook per parameter; complete buckets start async all-reduces
    strictly in index order (every rank issues the same collectives in one order); a callback
    at the end of backward waits, divides by p, copies back. `forward` decides, as torch DDP,
    whether its backward synchronises (`_sync_this_backward`) and what it left out (`_unused`).
    Cost per synchronised backward: len(self.buckets) all-reduces, 2(p-1)/p x Psi x b bytes per
    rank, a copy of each gradient in and out; find_unused: a graph walk and an all-reduce of a
    flag per parameter; broadcast_buffers: a broadcast per forward. `on_event(kind, bucket)`
    hears ("launch", i), ("backward_end", -1), ("reduced", i): to observe, never to change.
    """

    def __init__(self, module: nn.Module, *, broadcast_buffers: bool = True,
                 process_group: Group = None, bucket_cap_mb: float | None = None,
                 find_unused_parameters: bool = False,
                 on_event: Callable[[str, int], None] | None = None):
        super().__init__()
        self.module, self.process_group, self.on_event = module, process_group, on_event
        self.broadcast_buffers, self.find_unused_parameters = broadcast_buffers, find_unused_parameters
        buffers = list(module.buffers()) if broadcast_buffers else []  # as torch: then not at all
        broadcast_tensors([*module.parameters(), *buffers], group=process_group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {id(p): name for name, p in module.named_parameters()}
        cap = DEFAULT_BUCKET_CAP_BYTES if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
        first = DDP_FIRST_BUCKET_BYTES if bucket_cap_mb is None else None
        self.buckets = assign_buckets(self.params, cap, first)
        self.bucket_of = {index: b for b, bucket in enumerate(self.buckets) for index in bucket}
        self.require_backward_grad_sync = self.require_forward_param_sync = True  # torch's names
        self._sync_this_backward = False
        self._used: set[int] = set()  # indices with a gradient since the last synchronised backward
        self._start_backward()
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(self._make_hook(index))

    def _start_backward(self) -> None:
        """The bookkeeping of one backward, reset by every forward."""
        self._pending = [set(bucket) for bucket in self.buckets]  # [b]: not ready yet in bucket b
        self._next_bucket = 0  # the next bucket to launch: strictly in index order
        self._inflight: list[tuple[int, torch.Tensor, dist.Work]] = []  # (bucket, flat, work)
        self._callback_queued = False  # is `_finish` queued for the end of this backward?
        self._unused: list[int] = []  # indices forward found unused (find_unused_parameters)

    def _sync_buffers(self) -> None:
        """Rank 0's buffers to every rank, in place, version counters kept (torch's too)."""
        buffers = tuple(self.module.buffers())
        with torch.autograd._unsafe_preserve_version_counter(buffers):
            broadcast_tensors(list(buffers), group=self.process_group)

    def _notify(self, kind: str, bucket: int) -> None:
        if self.on_event is not None:
            self.on_event(kind, bucket)

    # exercise no-sync (2 points): Decide at forward; no_sync() for gradient accumulation
    # hint: decide in forward, never in backward (buffers first, before the module runs);
    #   no_sync: save the flag, clear it, yield inside try, restore the saved value in finally.
    def forward(self, *args, **kwargs):
        """Run `self.module(*args, **kwargs)` and return its output, in this order:
        1. if `broadcast_buffers` and `require_forward_param_sync` (True after construction,
           then whether the previous forward synchronised), `self._sync_buffers()`: rank 0's
           buffers before the module reads them (as torch DDP: none after a no_sync forward);
        2. decide whether the backward of this forward synchronises: only if
           `require_backward_grad_sync` is set (no_sync() clears it) and grad mode is on
           (torch.is_grad_enabled()); store it in `self._sync_this_backward` (the hooks read
           it: changing the flag after forward is too late, as in torch DDP) and in
           `require_forward_param_sync`;
        3. reset the bookkeeping: `self._start_backward()`, once per forward;
        4. run the module; if this backward synchronises and `find_unused_parameters` is set,
           `self._unused = find_unused.unused_parameters(output, self.params)`;
        5. with find_unused_parameters, return `find_unused.through_sink(output)` (the same
           values; an output the loss leaves out brings its parameters' hooks a None gradient,
           as in torch DDP), else `output` itself."""
        if self.broadcast_buffers and self.require_forward_param_sync:
            self._sync_buffers()
        self._sync_this_backward = self.require_backward_grad_sync and torch.is_grad_enabled()
        self.require_forward_param_sync = self._sync_this_backward
        self._start_backward()
        output = self.module(*args, **kwargs)
        if self._sync_this_backward and self.find_unused_parameters:
            self._unused = find_unused.unused_parameters(output, self.params)
        return find_unused.through_sink(output) if self.find_unused_parameters else output

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
        param.grad holds this backward's (accumulated) gradient, or None (an output the loss
        left out: see `forward`). First, always, record a use if param.grad is not None
        (`self._used.add(index)`: a gradient since the last synchronised backward, no_sync
        ones included). Then, on an unsynchronised backward (`self._sync_this_backward`
        False), nothing more. Otherwise: at the first gradient of this backward queue
        `_finish` as an autograd-engine callback (once per backward, `_callback_queued`) and
        mark every index of `self._unused` ready; mark `index` ready (remove it from
        `_pending[self.bucket_of[index]]`), then launch every complete bucket from
        `_next_bucket` on, in index order (a complete bucket waits for its predecessors: every
        rank then issues the same all-reduces in the same order)."""
        def hook(param: torch.Tensor) -> None:
            if param.grad is not None:  # None: forward ran it, the loss did not use it
                self._used.add(index)
            if not self._sync_this_backward:
                return
            if not self._callback_queued:  # first gradient of this backward
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
                self._callback_queued = True
                for unused in self._unused:  # no gradient will come: ready now
                    self._pending[self.bucket_of[unused]].discard(unused)
            self._pending[self.bucket_of[index]].discard(index)
            while self._next_bucket < len(self.buckets) and not self._pending[self._next_bucket]:
                self._launch(self._next_bucket)
                self._next_bucket += 1
        return hook

    # exercise bucketed-reducer (continued)
    def _launch(self, bucket: int) -> None:
        """Flatten the bucket's gradients into a new 1-D buffer (each .grad reshaped to 1-D, in
        the order of `self.buckets[bucket]`; zeros for a .grad that is None), start
        `dist.all_reduce(flat, group=self.process_group, async_op=True)` (returns at once with a
        Work), append (bucket, flat, work) to `self._inflight`, then
        `self._notify("launch", bucket)`."""
        grads = [self.params[i].grad for i in self.buckets[bucket]]
        flat = torch.cat([(g if g is not None else torch.zeros_like(self.params[i])).reshape(-1)
                          for i, g in zip(self.buckets[bucket], grads)])
        work = dist.all_reduce(flat, group=self.process_group, async_op=True)
        self._inflight.append((bucket, flat, work))
        self._notify("launch", bucket)

    # exercise bucketed-reducer (continued)
    def _finish(self) -> None:
        """End of backward (the autograd engine calls it once, after every hook ran). Every
        bucket must have launched: if not, some parameter got no gradient, so switch
        `_sync_this_backward` off and raise a RuntimeError naming every parameter still
        pending (by its name in `self.names[id(param)]`, e.g. 'spare.weight'). Else
        `self._notify("backward_end", -1)`; with find_unused_parameters, which parameters any
        rank used: all-reduce one flag per parameter (1 if in `self._used`) over the group.
        Then for each (bucket, flat, work) of `_inflight` in launch order: wait for the work,
        divide flat by p (the group's size), copy each slice back into its .grad in place (the
        order of `_launch`; a .grad that is None gets a new tensor), skipping a parameter no
        rank used, `self._notify("reduced", bucket)`. At the end `_inflight` is empty and
        `_used` too. Afterwards every .grad holds (1/p) sum_r g_r."""
        if self._next_bucket < len(self.buckets):
            missing = [self.names[id(self.params[i])]
                       for pending in self._pending for i in sorted(pending)]
            self._sync_this_backward = False
            raise RuntimeError(
                f"parameters {missing} received no gradient in this backward, so their bucket "
                "never filled and its all-reduce (and every later bucket's) would never start "
                "(torch DDP raises at the next forward); pass find_unused_parameters=True if a "
                "forward may leave them out, and make every output of forward part of the loss")
        self._notify("backward_end", -1)
        used = torch.tensor([float(i in self._used) for i in range(len(self.params))],
                            device=self.params[0].device)  # 1 where used here, then summed
        if self.find_unused_parameters:
            dist.all_reduce(used, group=self.process_group)
        world = dist.get_world_size(self.process_group)
        for bucket, flat, work in self._inflight:
            work.wait()  # on a GPU: the current stream waits for the all-reduce
            flat /= world
            offset = 0
            for i in self.buckets[bucket]:
                param, piece = self.params[i], flat[offset:offset + self.params[i].numel()]
                if not self.find_unused_parameters or used[i] > 0:  # no rank used it: untouched
                    param.grad = (piece.view_as(param).clone() if param.grad is None
                                  else param.grad.copy_(piece.view_as(param)))
                offset += param.numel()
            self._notify("reduced", bucket)
        self._inflight, self._used = [], set()


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness
    run_harness(__file__)
