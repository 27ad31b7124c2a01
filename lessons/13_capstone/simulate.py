"""Lesson 13's planner checked at the scale it plans for, without the hardware.

nd.py's real training step, for one rank of a layout of 64 to 1024 GPUs at the planned model
size, runs on this CPU in seconds to minutes: every tensor is a fake one (torch's
`FakeTensorMode`: shapes, dtypes and sizes, no memory behind them, no arithmetic) and the
process group is torch's fake backend (`FakeStore`, backend "fake": this process is rank r
of W; every collective and `batch_isend_irecv` returns at once, nothing is sent). What the
step allocates and what it sends are still those of the real run:

* `simulate_rank`: one rank's step (after AdamW made its states), its peak of live bytes by
  lesson 07's `MemoryTracker` and the bytes it sends by `CollectiveCounter` (lesson 01's ring
  counts: a ring rank sends 2(p-1)/p of an all-reduced tensor, (p-1)/p of a reduce-scattered
  or all-gathered one, every byte of a point-to-point message), each collective filed under
  the mesh dimensions its group spans;
* `simulate_layout`: one rank of each distinct pipeline position (the first stage, the
  middle stage that holds the most micro-batches, the last stage);
* `compare`: the planner's prediction for the same rank beside it (`planner.memory_per_stage`,
  `planner.communication`), and `format_comparison`, the README's table.

Three things make nd.py's step run on fake tensors, none of them in nd.py: integer tensors
(positions, token ids, masks: what ring attention decides its tiles from) stay real
(`RealIntegers`), `.item()` on a fake number returns 0 (the loss and norm the step logs), and
`nn.Module.to` keeps a module already on its device and dtype as it is (torch cannot swap a
fake parameter for itself). Simplified: torch's CPU autocast stands for CUDA's (on nd.py's step
they pick the same dtypes: matmuls in bf16, LayerNorm on fp32 input and the loss on fp32
logits in fp32), and the fake backend sends nothing, so the bytes are what a ring algorithm
would send, not what NCCL's tree or NVLS algorithms send.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import arg_tree_leaves

from . import nd, nd_model, planner
from .planner import GB
from .planner_checks import breakdown_before_reduce, recompute_blocks

collectives = importlib.import_module("lessons.01_collectives.main")  # ring byte counts, Traffic
memory = importlib.import_module("lessons.07_memory.main")  # MemoryTracker

# ========================================================================= 1. fake tensors that still decide

ARANGE = {torch.ops.aten.arange.default, torch.ops.aten.arange.start, torch.ops.aten.arange.start_step}


class RealIntegers(TorchDispatchMode):
    """Above FakeTensorMode: an op with no fake input runs for real when it is `arange` or has
    real tensor inputs and neither they nor its (broadcast) output exceed REAL_LIMIT elements
    (the positions nd.py computes from its layout: ring attention picks its tiles by comparing
    positions, data that must exist); every other op goes on to the fake mode (a causal mask
    of a tile, the batch's token ids: only their shapes matter). `.item()` of a fake tensor
    returns 0 (the loss and gradient norm nd.py logs have no value without arithmetic)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        kwargs = kwargs or {}
        tensors = [a for a in arg_tree_leaves(*args, **kwargs) if isinstance(a, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):
            if func is torch.ops.aten._local_scalar_dense.default:
                return 0.0 if args[0].is_floating_point() else 0
            return func(*args, **kwargs)
        if func in ARANGE or tensors and small(tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


REAL_LIMIT = 1 << 20  # elements: a sequence's positions are real, a tile's mask is not


def small(tensors: list[torch.Tensor]) -> bool:
    """Whether real inputs this small, and their broadcast, stay within REAL_LIMIT elements."""
    try:
        out = math.prod(torch.broadcast_shapes(*(t.shape for t in tensors)))
    except RuntimeError:  # not broadcastable: cat, index, ...: bounded by the inputs
        out = 0
    return max(out, sum(t.numel() for t in tensors)) <= REAL_LIMIT


@contextlib.contextmanager
def modules_stay_put():
    """nn.Module.to(device, dtype) returns the module itself when every parameter is already
    there (NDTrainer moves its Stage to the device; a fake parameter cannot be swapped for a
    copy of itself). Any real move still goes through torch's own `to`."""
    original = nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        params = list(self.parameters())
        if all((device is None or p.device == torch.device(device)) and (dtype is None or p.dtype == dtype)
               for p in params):
            return self
        return original(self, *args, **kwargs)

    nn.Module.to = to
    try:
        yield
    finally:
        nn.Module.to = original


# ======================================================================== 2. the bytes each collective sends


class CollectiveCounter(TorchDispatchMode):
    """Bytes this rank sends, by the mesh dimensions each collective's group spans (e.g.
    ("tp",), ("dp", "cp"), or every dimension for the world), in lesson 01's `Traffic`:
    all-reduce 2(p-1)/p x S, reduce-scatter and all-gather (p-1)/p x S (S the whole vector:
    `collectives.ring_bytes_sent`, exact for uneven chunks), send every byte, receive none.
    A collective it does not know raises, so none goes uncounted."""

    def __init__(self, layout: nd.Layout, rank: int):
        super().__init__()
        self.layout, self.rank = layout, rank
        self.traffic: dict[tuple[str, ...], collectives.Traffic] = {}
        self.calls: dict[str, int] = {}

    def dims_of(self, ranks: list[int]) -> tuple[str, ...]:
        coords = [self.layout.coordinates(r) for r in ranks]
        return tuple(d for d in nd.DIMS if len({c[d] for c in coords}) > 1)

    def record(self, group, nbytes: int) -> None:
        self.record_between(dist.get_process_group_ranks(group), nbytes)

    def record_between(self, ranks: list[int], nbytes: int) -> None:
        traffic = self.traffic.setdefault(self.dims_of(ranks), collectives.Traffic())
        traffic.bytes_sent += nbytes
        traffic.messages += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            name = func._schema.name.split("::")[1]
            self.calls[name] = self.calls.get(name, 0) + 1
            group = next(dist.ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)
                         and a._type().qualified_name().endswith("c10d.ProcessGroup"))
            p, r = group.size(), group.rank()
            if name == "allreduce_":
                for t in args[0]:
                    self.record(group, collectives.ring_bytes_sent(t.numel(), t.element_size(), p,
                                                                   r)["all_reduce"])
            elif name == "_allgather_base_":
                out = args[0]
                self.record(group, collectives.ring_bytes_sent(out.numel(), out.element_size(), p,
                                                               r)["all_gather"])
            elif name == "_reduce_scatter_base_":
                inp = args[1]
                self.record(group, collectives.ring_bytes_sent(inp.numel(), inp.element_size(), p,
                                                               r)["reduce_scatter"])
            elif name == "send":  # filed by the two ranks it connects (a ring's messages may
                peer = dist.get_global_rank(group, args[2])  # name global ranks on the world group)
                self.record_between([self.rank, peer], sum(t.numel() * t.element_size() for t in args[0]))
            elif name == "broadcast_":
                root = args[2]
                self.record(group, sum(t.numel() * t.element_size() for t in args[0]) if r == root else 0)
            elif name not in ("recv_", "barrier"):
                raise NotImplementedError(f"CollectiveCounter does not count c10d.{name}")
        return func(*args, **(kwargs or {}))

    def bytes_by(self) -> dict[tuple[str, ...], int]:
        return {dims: t.bytes_sent for dims, t in self.traffic.items()}


# ============================================================================ 3. one rank's step


@dataclasses.dataclass
class Simulated:
    """One simulated rank: its coordinates, its peak of live bytes and what was live then
    (MemoryTracker's categories), the bytes it sent by dimensions, the CPU seconds it took."""

    rank: int
    coords: dict[str, int]
    peak: int
    peak_breakdown: dict[str, int]
    states: int
    sent: dict[tuple[str, ...], int]
    zero_world: int
    seconds: float


def simulate_rank(config: nd_model.GPTConfig, layout: nd.Layout, rank: int, bf16: bool = True,
                  dtype: torch.dtype = torch.float32, recompute: bool = False) -> Simulated:
    """Rank `rank` of `layout` runs one nd.NDTrainer.train_step of `config` on fake tensors
    with the fake process group (`layout.world` ranks; this process must have no process
    group of its own). Before it, AdamW's states are made by one optimizer step on zero
    gradients (as after a first training step). `bf16`: nd.py's GPU run (fp32 weights, bf16
    autocast, attention in fp32); `dtype` the weights'; `recompute`: every block's forward
    replayed in backward (planner_checks.recompute_blocks). Measured: the peak of live bytes
    (parameters and optimizer states marked as such, everything the step makes followed
    until freed) and what each collective sends."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulate_rank needs a process without a process group (it makes a fake one)")
    started = time.process_time()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    try:
        mesh = nd.build_mesh(layout, "cpu")
        generator = torch.Generator().manual_seed(0)
        windows = torch.randint(0, config.vocab, (config.global_batch, config.seq + 1), generator=generator)
        with FakeTensorMode(allow_non_fake_inputs=True), RealIntegers(), modules_stay_put():
            trainer = nd.NDTrainer(config, layout, mesh, torch.device("cpu"), dtype, bf16=bf16)
            for shard in trainer.zero.shards:  # AdamW makes exp_avg, exp_avg_sq in its first step
                shard.grad = torch.zeros_like(shard)
            trainer.zero.optimizer.step()
            trainer.zero.optimizer.zero_grad(set_to_none=True)
            tracker, counter = memory.MemoryTracker(), CollectiveCounter(layout, rank)
            tracker.mark(trainer.stage.parameters(), "parameter")
            tracker.mark(memory.optimizer_tensors(trainer.zero.optimizer), "optimizer")
            states = tracker.live_bytes
            seen = breakdown_before_reduce(trainer, tracker)
            with tracker, counter, recompute_blocks(trainer.stage) if recompute else contextlib.nullcontext():
                trainer.train_step(windows)
        return Simulated(rank, layout.coordinates(rank), tracker.peak_bytes, tracker.peak_breakdown(),
                         states + seen.get("gradient", 0), counter.bytes_by(), trainer.zero.world,
                         time.process_time() - started)
    finally:
        dist.destroy_process_group()


def positions_of(layout: nd.Layout) -> list[int]:
    """The pipeline stages to simulate: the first, the middle one that holds the most
    micro-batches (stage 1), the last (one rank each: every rank of a stage allocates and
    sends the same bytes, whatever its dp, cp or tp coordinate)."""
    return sorted({0, min(1, layout.pp - 1), layout.pp - 1})


def simulate_layout(config: nd_model.GPTConfig, layout: nd.Layout, bf16: bool = True,
                    recompute: bool = False) -> list[Simulated]:
    """`simulate_rank` for rank (pp = d, dp = cp = tp = 0) of each stage d of positions_of."""
    return [simulate_rank(config, layout, layout.rank_of({"pp": d, "dp": 0, "cp": 0, "tp": 0}), bf16,
                          recompute=recompute) for d in positions_of(layout)]


# ============================================================================ 4. beside the planner

TOLERANCE = 0.10  # the planner must agree with the simulation within 10% (peak and bytes per step)
ZERO_DIMS = {("dp",): "dp", ("dp", "cp"): "dp", ("cp",): "cp", ("tp",): "tp", ("pp",): "pp"}


@functools.cache
def nd_folds_cp() -> bool:
    """Whether nd.py's ZeRO group holds the cp ranks (torchtitan's choice) or dp alone:
    one tiny simulated cp2 rank tells (its ZeRO group's size)."""
    config = nd_model.GPTConfig(global_batch=2, microbatches=1, layers=1)
    return simulate_rank(config, nd.Layout(cp=2), 0).zero_world == 2


def nd_run(run: planner.Run) -> planner.Run:
    """The planner's Run for what nd.py builds: the nd engine, nd.py's GPU recipe, cp in
    ZeRO's group as nd.py has it; the batch, MFU, headroom and overlap of `run`."""
    return planner.Run.for_engine("nd", run.global_batch, "nd-autocast", mfu=run.mfu,
                                  headroom=run.headroom, overlap=run.overlap, fold_cp=nd_folds_cp())


def config_of(model: planner.Model, strategy: planner.Strategy, run: planner.Run) -> nd_model.GPTConfig:
    """nd.py's config for `model` trained with `strategy` (the course's block only)."""
    course = planner.Model(model.layers, model.hidden, model.heads, model.vocab, model.seq)
    if model != course:
        raise ValueError("nd.py builds only the course's block (multi-head attention, a 4h GeLU MLP, "
                         "LayerNorm, biases, learned positions, an untied head): simulate such a model")
    return nd_model.GPTConfig(vocab=model.vocab, hidden=model.hidden, heads=model.heads, layers=model.layers,
                              seq=model.seq, global_batch=run.global_batch,
                              microbatches=planner.microbatches(run, strategy))


def compare(model: planner.Model, cluster: planner.Cluster, run: planner.Run,
            strategy: planner.Strategy, simulated: list[Simulated]) -> list[dict]:
    """For each simulated rank: the planner's prediction for its stage beside what it
    measured: peak bytes, bytes sent per step in all and by dimension (collectives of the
    whole world, the loss's and the norm's few bytes, are in the total only), and whether
    both agree within TOLERANCE."""
    predicted = planner.memory_per_stage(model, run, strategy, cluster)
    rows = []
    for sim in simulated:
        stage = sim.coords["pp"]
        traffic = planner.communication(model, cluster, run, strategy, stage)
        sent = {dim: 0 for dim in ("tp", "cp", "pp", "dp")}
        for dims, nbytes in sim.sent.items():
            if dims in ZERO_DIMS:
                sent[ZERO_DIMS[dims]] += nbytes
        pred_bytes = sum(t.bytes for t in traffic.values())
        sim_bytes = sum(sim.sent.values())
        row = {"strategy": strategy, "stage": stage, "rank": sim.rank,
               "peak_predicted": predicted[stage].peak, "peak_simulated": sim.peak,
               "states_predicted": predicted[stage].states, "states_simulated": sim.states,
               "bytes_predicted": pred_bytes, "bytes_simulated": sim_bytes,
               "by_dim_predicted": {d: t.bytes for d, t in traffic.items()}, "by_dim_simulated": sent,
               "peak_breakdown": sim.peak_breakdown, "seconds": sim.seconds}
        row["agrees"] = (abs(sim.peak - row["peak_predicted"]) <= TOLERANCE * sim.peak and
                         abs(sim_bytes - pred_bytes) <= TOLERANCE * max(sim_bytes, 1))
        rows.append(row)
    return rows


def chosen(candidates: list[planner.Candidate], fitting: list[planner.Candidate],
           top: int) -> list[planner.Candidate]:
    """The plan's `top` rows, then the three best layouts that use every dimension (dp, tp,
    pp and cp all above 1: from the plan, else from every candidate)."""
    every = [c for c in fitting if min(c.layout.dp, c.layout.tp, c.layout.pp, c.layout.cp) > 1]
    if len(every) < 3:
        seen = {c.layout for c in every}
        for c in candidates:
            if min(c.layout.dp, c.layout.tp, c.layout.pp, c.layout.cp) > 1 and c.layout not in seen:
                every.append(c)
                seen.add(c.layout)
    out = fitting[:top]
    return out + [c for c in every[:3] if c not in out]


def simulate_plan(model: planner.Model, cluster: planner.Cluster, run: planner.Run,
                  top: int = 5) -> list[dict]:
    """The planner's nd-engine plan of `model` on `cluster` (`nd_run`), its `top` layouts and
    three that use every dimension, each simulated (`simulate_layout`) and compared."""
    run = nd_run(run)
    candidates = planner.evaluate(model, cluster, run)
    rows = []
    for c in chosen(candidates, planner.plan(model, cluster, run, candidates), top):
        config = config_of(model, c.strategy, run)
        simulated = simulate_layout(config, c.layout, recompute=c.strategy.recompute == "full")
        rows += compare(model, cluster, run, c.strategy, simulated)
    return rows


def format_comparison(rows: list[dict]) -> str:
    """Predicted beside simulated, one row per simulated rank, as a markdown table (GB =
    1e9 bytes; sent: bytes per step, then tp / cp / pp / dp simulated)."""
    lines = ["| strategy | stage | peak GB predicted | simulated | sim / pred | GB sent predicted | "
             "simulated | "
             "sim / pred | tp / cp / pp / dp GB simulated |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        by = " / ".join(f"{r['by_dim_simulated'][d] / GB:.2f}" for d in ("tp", "cp", "pp", "dp"))
        lines.append(f"| {planner.strategy_name(r['strategy'])} | {r['stage']} | "
                     f"{r['peak_predicted'] / GB:.2f} | "
                     f"{r['peak_simulated'] / GB:.2f} | {r['peak_simulated'] / r['peak_predicted']:.3f} | "
                     f"{r['bytes_predicted'] / GB:.2f} | {r['bytes_simulated'] / GB:.2f} | "
                     f"{r['bytes_simulated'] / max(r['bytes_predicted'], 1):.3f} | {by} |")
    return "\n".join(lines)


def row_json(row: dict) -> dict:
    """A comparison row as plain data for --json."""
    out = {k: v for k, v in row.items() if k != "strategy"}
    out["strategy"] = planner.strategy_name(row["strategy"])
    out["layout"] = dataclasses.asdict(row["strategy"].layout)
    return out
