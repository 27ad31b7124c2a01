"""Functions that lesson 02's tests run on spawned ranks (importable by their dotted name).

`exercise_checks` runs one section per exercise on every rank and returns plain data; a section
that raises (a stub, a bug) comes back as {"error": "..."} so that the other exercises' sections
still run and are graded on their own. Each section depends on its own exercise only:

* the reducer (`bucketed-reducer`) runs on a GIVEN bucket assignment (`given_buckets`) and
  arms each backward itself (`synchronised_backward`), instead of through `forward`;
* `forward` and `no_sync` (`no-sync`) run on `SyncRecorder`, a BucketedDDP whose hooks only
  record the decision `forward` took (no reducer involved).
"""

from __future__ import annotations

import contextlib
import importlib

import torch
import torch.nn.functional as F

data_parallel = importlib.import_module("lessons.02_data_parallel.main")
checks = importlib.import_module("lessons.02_data_parallel.checks")

PAIRS_6 = [[5, 4], [3, 2], [1, 0]]  # TinyMLP's six parameters, two per bucket, head first
UNEVEN_6 = [[5], [4, 3, 2], [1, 0]]
PAIRS_8 = [[7, 6], [5, 4], [3, 2], [1, 0]]  # with the unused layer: bucket 0 = spare


def all_checks(ctx, seed: int, steps: int, batch: int, bench: bool = False) -> dict:
    """Every check of the demo on this rank; with `bench`, also one step of the benchmark on a
    32-wide model (its plumbing, not its timings)."""
    result = checks.verify_worker(ctx, seed, steps, batch, None, 0)
    if bench:
        result["bench"] = importlib.import_module("lessons.02_data_parallel.bench").bench_worker(
            ctx, 32, 1, [2048, 64 * 1024])
    return result


class BackwardsMLP(data_parallel.TinyMLP):
    """Applies head, then fc2, then fc1 (square layers): the gradients of fc1 (the LAST bucket)
    arrive first and those of head (bucket 0) last, the opposite of parameters() order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.relu(self.fc2(F.relu(self.head(x * self.input_scale)))))


@contextlib.contextmanager
def given_buckets(assignment: list[list[int]]):
    """BucketedDDP built inside gets `assignment` as its buckets, whatever `assign_buckets`
    does: the reducer is graded apart from the bucket-assignment exercise."""
    original = data_parallel.assign_buckets
    data_parallel.assign_buckets = lambda params, cap, first=None: [list(b) for b in assignment]
    try:
        yield
    finally:
        data_parallel.assign_buckets = original


def synchronised_backward(wrapped, x: torch.Tensor, y: torch.Tensor, sync: bool = True) -> None:
    """One forward and backward through `wrapped.module`, armed as `forward` arms it (the
    decision in `_sync_this_backward`, fresh bookkeeping), without calling `forward`."""
    wrapped._sync_this_backward = sync
    wrapped._start_backward()
    F.mse_loss(wrapped.module(x), y).backward()


def flat_grads(model) -> list[float]:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).tolist()


def guarded(section, *args) -> dict:
    """Run one exercise's section; an exception comes back as its first line."""
    try:
        return section(*args)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
        return {"error": f"{type(exc).__name__}: {exc}"}


def average_section(ctx, seed: int) -> dict:
    """naive and flat all-reduce on a model with an unused layer (no .grad there), and naive
    DDP without the broadcast (ranks stay different)."""
    x, y = checks.shard_of_step(ctx, 0, 4 * ctx.world_size, seed)
    result = {}
    for kind, reduce in (("naive", data_parallel.naive_all_reduce_gradients),
                         ("flat", data_parallel.flat_all_reduce_gradients)):
        model = data_parallel.make_model(seed, unused=True)  # the same on every rank
        F.mse_loss(model(x), y).backward()
        count = reduce(model)
        result[kind] = {"count": count, "grads": flat_grads(model),
                        "spare_has_no_grad": all(p.grad is None for p in model.spare.parameters())}
    model = data_parallel.make_model(seed + ctx.rank)  # no broadcast: every rank different
    F.mse_loss(model(x), y).backward()
    data_parallel.naive_all_reduce_gradients(model)
    with torch.no_grad():  # one SGD step by hand (building a torch optimizer in a fresh rank
        for param in model.parameters():  # imports torch._dynamo: seconds of CPU)
            param -= 0.05 * param.grad
    result["no_broadcast"] = data_parallel.flat_params(model).tolist()
    return result


def reducer_section(ctx, seed: int) -> dict:
    """BucketedDDP's hooks on given buckets: the event order with gradients in parameter order
    (overlap) and in reverse bucket order, the averages, an unsynchronised backward, uneven
    buckets, two backwards in a row, and a parameter without gradient."""
    x, y = checks.shard_of_step(ctx, 0, 4 * ctx.world_size, seed)
    result = {}

    def observed(model, assignment, cap=1024):
        events: list[tuple[str, int]] = []
        for index, param in enumerate(model.parameters()):  # registered first: run before ours
            param.register_post_accumulate_grad_hook(
                lambda p, index=index: events.append(("grad", index)))
        with given_buckets(assignment):
            wrapped = data_parallel.BucketedDDP(
                model, cap, on_event=lambda kind, bucket: events.append((kind, bucket)))
        return wrapped, events

    wrapped, events = observed(data_parallel.make_model(seed + 1000 + ctx.rank), PAIRS_6)
    synchronised_backward(wrapped, x, y)  # weights differ per rank until the broadcast
    result["in_order"] = {"events": [list(e) for e in events], "grads": flat_grads(wrapped.module)}
    wrapped.module.zero_grad(set_to_none=True)
    events.clear()
    synchronised_backward(wrapped, x, y)
    result["second_backward"] = {"events": [list(e) for e in events],
                                 "grads": flat_grads(wrapped.module)}
    wrapped.module.zero_grad(set_to_none=True)
    events.clear()
    synchronised_backward(wrapped, x, y, sync=False)
    result["unsynchronised"] = {"events": [list(e) for e in events],
                                "grads": flat_grads(wrapped.module)}

    torch.manual_seed(seed)
    backwards = BackwardsMLP(d_in=8, hidden=8, d_out=8).double()
    wrapped, events = observed(backwards, PAIRS_6, cap=100)
    bx, by = checks.shard_of_step(ctx, 1, 4 * ctx.world_size, seed, d_in=8, d_out=8)
    synchronised_backward(wrapped, bx, by)
    result["reversed"] = {"buckets": wrapped.buckets, "events": [list(e) for e in events],
                          "grads": flat_grads(backwards)}

    wrapped, _ = observed(data_parallel.make_model(seed), UNEVEN_6)
    synchronised_backward(wrapped, x, y)
    result["uneven"] = {"grads": flat_grads(wrapped.module)}

    wrapped, _ = observed(data_parallel.make_model(seed, unused=True), PAIRS_8)
    try:
        synchronised_backward(wrapped, x, y)
        result["unused"] = {"raised": "", "message": ""}
    except Exception as exc:  # noqa: BLE001 - the test reads which error, if any
        result["unused"] = {"raised": type(exc).__name__, "message": str(exc)}
    return result


class SyncRecorder(data_parallel.BucketedDDP):
    """BucketedDDP whose hooks only record `_sync_this_backward` (the decision `forward` took)
    and whose `_start_backward` counts its calls: `forward` and `no_sync` without the reducer."""

    def __init__(self, module):
        with given_buckets(PAIRS_6):
            super().__init__(module, 1024)
        self.seen: list[bool] = []

    def _start_backward(self) -> None:
        super()._start_backward()
        self.starts = getattr(self, "starts", 0) + 1

    def _make_hook(self, index: int):
        def hook(param) -> None:
            self.seen.append(self._sync_this_backward)
        return hook


def no_sync_flag_section(ctx, seed: int) -> dict:
    """`require_backward_grad_sync` inside, after, after an exception, nested, preset False."""
    recorder = SyncRecorder(data_parallel.make_model(seed))
    states = {"before": recorder.require_backward_grad_sync}
    with recorder.no_sync():
        states["inside"] = recorder.require_backward_grad_sync
    states["after"] = recorder.require_backward_grad_sync
    try:
        with recorder.no_sync():
            raise KeyError("raised inside no_sync")
    except KeyError:
        pass
    states["after_exception"] = recorder.require_backward_grad_sync
    with recorder.no_sync():
        with recorder.no_sync():
            states["nested_inside"] = recorder.require_backward_grad_sync
        states["after_inner"] = recorder.require_backward_grad_sync
    states["after_outer"] = recorder.require_backward_grad_sync
    recorder.require_backward_grad_sync = False
    with recorder.no_sync():
        pass
    states["preset_false_after"] = recorder.require_backward_grad_sync
    return states


def no_sync_decision_section(ctx, seed: int) -> dict:
    """What each backward's hooks saw, by where forward and backward ran; forward's output and
    its `_start_backward` calls; the decision of a forward under torch.no_grad()."""
    x, y = checks.shard_of_step(ctx, 0, 4 * ctx.world_size, seed)
    recorder = SyncRecorder(data_parallel.make_model(seed))
    result = {"starts_after_init": recorder.starts}

    def seen(forward_inside: bool, backward_inside: bool) -> list[bool]:
        with recorder.no_sync() if forward_inside else contextlib.nullcontext():
            loss = F.mse_loss(recorder(x), y)
        recorder.seen.clear()
        with recorder.no_sync() if backward_inside else contextlib.nullcontext():
            loss.backward()
        return sorted(set(recorder.seen))

    result["plain"] = seen(False, False)
    result["both_inside"] = seen(True, True)
    result["forward_inside_only"] = seen(True, False)
    result["backward_inside_only"] = seen(False, True)
    result["accumulation"] = [seen(micro < 2, micro < 2) for micro in range(3)]
    before = recorder.starts
    for _ in range(3):
        recorder(x)
    result["starts_per_forward"] = (recorder.starts - before) / 3
    result["output_unchanged"] = bool(torch.equal(recorder(x), recorder.module(x)))
    with torch.no_grad():
        recorder(x)
    result["no_grad_decision"] = bool(recorder._sync_this_backward)
    return result


def exercise_checks(ctx, seed: int) -> dict:
    """Every exercise's section on this rank (no torch optimizer here: building one in a fresh
    rank imports torch._dynamo, seconds of CPU per rank, and each planted bug pays this launch)."""
    return {"average": guarded(average_section, ctx, seed),
            "reducer": guarded(reducer_section, ctx, seed),
            "no_sync_flag": guarded(no_sync_flag_section, ctx, seed),
            "no_sync_decision": guarded(no_sync_decision_section, ctx, seed)}


def reference_gradient(model_seed: int, batch_seed: int, world_size: int,
                       unused: bool = False) -> list[float]:
    """The single-process gradient of make_model(model_seed) on the global batch that the
    sections shard (4 rows per rank, drawn from `batch_seed`)."""
    model = data_parallel.make_model(model_seed, unused=unused)
    x, y = data_parallel.global_batch(0, 4 * world_size, batch_seed)
    F.mse_loss(model(x), y).backward()
    return flat_grads(model)


def local_gradient(model_seed: int, batch_seed: int, world_size: int, rank: int) -> list[float]:
    """Rank `rank`'s own gradient (its shard of that batch only, nothing averaged)."""
    model = data_parallel.make_model(model_seed)
    x, y = data_parallel.global_batch(0, 4 * world_size, batch_seed)
    F.mse_loss(model(data_parallel.local_shard(x, rank, world_size)),
               data_parallel.local_shard(y, rank, world_size)).backward()
    return flat_grads(model)


def reference_reordered_gradient(seed: int, world_size: int) -> list[float]:
    """The single-process gradient of BackwardsMLP on the global batch."""
    torch.manual_seed(seed)
    model = BackwardsMLP(d_in=8, hidden=8, d_out=8).double()
    x, y = data_parallel.global_batch(1, 4 * world_size, seed, d_in=8, d_out=8)
    F.mse_loss(model(x), y).backward()
    return flat_grads(model)
