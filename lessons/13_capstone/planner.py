"""Lesson 13's planner: which dp x tp x pp x cp layouts fit a model on a cluster, best first.

The Ultra-Scale Playbook's method as a tool: list the layouts nd.py can build, predict each
one's memory per GPU with the earlier lessons' formulas, drop those that do not fit, and rank
the rest by an estimated step time (compute, the pipeline bubble, the communication on the
link each dimension uses). In the order the planner meets them:

1. the inputs: `Model` (the course GPT's shape; `Model.parameters()` is nd_model.GPT's count),
   `Cluster` (GPUs, memory, links, peak FLOP/s) and `Run` (batch, bytes per element, MFU);
2. the layouts nd.py accepts, plus tp x cp inside a node: `why_refused`, `enumerate_layouts`;
3. memory per GPU, each term from the lesson that taught it: `stage_parameters`,
   `model_state_bytes` (lesson 03's ZeRO-1), `block_activation_bytes` (lesson 04's sequence
   parallel block, with lesson 11's ring attention in it), `stage_activation_bytes`,
   `memory_per_stage` (lesson 05's 1F1B in-flight count);
4. communication per step per GPU: `communication` (lessons 01, 03, 04, 05, 11), each
   dimension on its link (`link_of`);
5. the ranking: `evaluate`, `plan`, `why_empty`, `format_plan`;
6. named models and GPUs (`MODELS`, `H100_80GB`) for the CLI; the CLI hook and the check of
   the predictions against measured bytes are in planner_checks.py.

Simplified: the step time is compute / (1 - bubble) + every collective's time, nothing
overlapped (nd.py overlaps nothing; production trainers overlap dp's gradient reduction with
backward, the Playbook's first data-parallel optimization, and the ring's transfers with
attention, as ring attention is designed to); collectives use bandwidth only (no latency term) at the
slowest link they cross; compute is 6 N tokens at an assumed MFU (attention FLOPs left out);
the memory prediction leaves out the backward pass's working set and the allocator's
fragmentation (a headroom fraction of memory is kept free for them).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import math

from . import nd, nd_model

collectives = importlib.import_module("lessons.01_collectives.main")  # ring byte counts
zero = importlib.import_module("lessons.03_zero.main")  # ZeRO's memory and traffic
tensor_parallel = importlib.import_module("lessons.04_tensor_parallel.main")  # SP block costs
pipeline = importlib.import_module("lessons.05_pipeline.main")  # bubble, in-flight, messages
memory = importlib.import_module("lessons.07_memory.main")  # parameter count, MemoryTracker
context_parallel = importlib.import_module("lessons.11_context_parallel.main")  # ring bytes

GB = 1e9  # the planner's gigabyte: 10^9 bytes (lesson 03's memory_table_gb too)
STEP_COUNTER_BYTES = 4  # torch's AdamW keeps one float32 `step` per parameter tensor

# ============================================================================ 1. the inputs


@dataclasses.dataclass(frozen=True)
class Model:
    """The course GPT (nd_model.GPT): `layers` pre-norm blocks of width `hidden` with `heads`
    attention heads and a 4h GeLU MLP, learned positions for `seq` tokens, an untied head."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")

    @classmethod
    def of(cls, config: nd_model.GPTConfig) -> Model:
        return cls(config.layers, config.hidden, config.heads, config.vocab, config.seq)

    def parameters(self) -> int:
        """N = L (12 h^2 + 13 h) + (V + s) h + 2 h + V h: lesson 07's `gpt_param_count` (per
        block QKV, O, the 4h MLP, their biases, two LayerNorms; token and position tables; the
        final LayerNorm), plus the V x h head that nd_model.GPT does not tie to the token table."""
        return memory.gpt_param_count(self.layers, self.hidden, self.vocab, self.seq) + \
            self.vocab * self.hidden


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`gpus` in nodes of `gpus_per_node`; per GPU: `memory_bytes`, bandwidth in bytes/s one
    way inside a node (`intra_bandwidth`, NVLink) and to other nodes (`inter_bandwidth`, the
    network), dense `peak_flops`."""

    gpus: int
    gpus_per_node: int
    memory_bytes: float
    intra_bandwidth: float
    inter_bandwidth: float
    peak_flops: float

    def __post_init__(self):
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"gpus ({self.gpus}) and gpus per node ({self.gpus_per_node}) must be >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(f"{self.gpus} GPUs do not fill whole nodes of {self.gpus_per_node}")
        for name in ("memory_bytes", "intra_bandwidth", "inter_bandwidth", "peak_flops"):
            if not getattr(self, name) > 0:
                raise ValueError(f"cluster {name} must be > 0, got {getattr(self, name)!r}")


PRECISIONS = {  # bytes per element: (weights, gradients, optimizer states per parameter, activations)
    "bf16-mixed": (2, 2, 12, 2),  # 12 = fp32 master + Adam's m and v (ZeRO's K)
    "fp32": (4, 4, 8, 4),
    "fp64": (8, 8, 16, 8),  # the CPU check's float64
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One optimizer step: `global_batch` sequences of the model's seq tokens, `micro_batch`
    sequences per micro-batch; bytes per element of each kind of tensor (`PRECISIONS`); the
    MFU the compute time assumes; the share of GPU memory kept free (`headroom`)."""

    global_batch: int
    micro_batch: int = 1
    param_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    activation_bytes: int = 2
    mfu: float = 0.4
    headroom: float = 0.1

    def __post_init__(self):
        if self.global_batch < 1 or self.micro_batch < 1:
            raise ValueError(f"global batch ({self.global_batch}) and micro-batch "
                             f"({self.micro_batch}) must be >= 1")
        if not 0 < self.mfu <= 1 or not 0 <= self.headroom < 1:
            raise ValueError(f"mfu must be in (0, 1] and headroom in [0, 1), got {self.mfu}, {self.headroom}")

    @classmethod
    def with_precision(cls, precision: str, global_batch: int, **kwargs) -> Run:
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; use one of {sorted(PRECISIONS)}")
        weights, grads, optimizer, activations = PRECISIONS[precision]
        return cls(global_batch, param_bytes=weights, grad_bytes=grads, optimizer_bytes=optimizer,
                   activation_bytes=activations, **kwargs)


# ============================================================================ 2. the layouts


def why_refused(model: Model, cluster: Cluster, run: Run, layout: nd.Layout) -> str | None:
    """Why nd.py (or the node) cannot run `layout`, or None. nd.py's own checks: heads % tp
    (lesson 04 splits attention by heads), layers % pp (lesson 05's equal stages), seq % 2 cp
    (lesson 11's zig-zag chunks), (seq / cp) % tp (sequence parallelism's positions), the
    batch into dp replicas of micro-batches (lesson 05's `microbatch_count`). The planner's:
    tp x cp divides a node's GPUs, so no tp or cp group leaves a node (tp innermost, then cp,
    in nd.DIMS): their collectives run inside every layer, forward and backward, and need
    NVLink (Megatron-LM: tensor parallelism up to the GPUs of a server, pipeline across them;
    the Playbook: TP+SP within a node). Simplified for cp: Llama 3 ran cp across nodes."""
    if layout.world != cluster.gpus:
        return f"dp x tp x pp x cp = {layout.world}, the cluster has {cluster.gpus} GPUs"
    if model.heads % layout.tp:
        return f"{model.heads} heads do not split over tp = {layout.tp}"
    if model.layers % layout.pp:
        return f"{model.layers} layers do not split over pp = {layout.pp}"
    if model.seq % (2 * layout.cp):
        return f"seq {model.seq} is not divisible by 2 cp = {2 * layout.cp}"
    if (model.seq // layout.cp) % layout.tp:
        return f"seq / cp = {model.seq // layout.cp} positions do not split over tp = {layout.tp}"
    if run.global_batch % (layout.dp * run.micro_batch):
        return (f"global batch {run.global_batch} is not a multiple of dp {layout.dp} x "
                f"micro-batch {run.micro_batch}")
    if cluster.gpus_per_node % (layout.tp * layout.cp):
        return (f"tp x cp = {layout.tp * layout.cp} does not divide a node's "
                f"{cluster.gpus_per_node} GPUs (their per-layer collectives need NVLink)")
    return None


def all_layouts(gpus: int) -> list[nd.Layout]:
    """Every (dp, tp, pp, cp) of positive integers whose product is `gpus`."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    return [nd.Layout(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp)
            for tp, pp, cp in itertools.product(divisors, repeat=3) if gpus % (tp * pp * cp) == 0]


def enumerate_layouts(model: Model, cluster: Cluster, run: Run) -> list[nd.Layout]:
    """The layouts of `cluster.gpus` ranks that `why_refused` lets through."""
    return [layout for layout in all_layouts(cluster.gpus)
            if why_refused(model, cluster, run, layout) is None]


# ============================================================================ 3. memory per GPU


def microbatches(run: Run, layout: nd.Layout) -> int:
    """m = global batch / (dp x micro-batch): lesson 05's `microbatch_count`."""
    return pipeline.microbatch_count(run.global_batch, layout.dp, run.micro_batch)


def stage_parameters(model: Model, layout: nd.Layout, stage: int) -> tuple[int, int]:
    """(parameters, parameter tensors) one rank of pipeline stage `stage` holds.

    A block: 12 h^2 + 7 h split over tp (the QKV, O, up and down weights; the QKV and up
    biases), 6 h replicated (both LayerNorms, the O and down biases), 12 tensors; lesson 07's
    12 h^2 + 13 h at tp = 1. Stage 0 adds the token and position tables (V + s) h, 2 tensors;
    the last stage the final LayerNorm and the head, 2 h + V h, 3 tensors (not split over tp:
    nd.py keeps the vocabulary whole). L / pp blocks per stage."""
    h, blocks = model.hidden, model.layers // layout.pp
    params = blocks * ((12 * h * h + 7 * h) // layout.tp + 6 * h)
    tensors = 12 * blocks
    if stage == 0:
        params, tensors = params + (model.vocab + model.seq) * h, tensors + 2
    if stage == layout.pp - 1:
        params, tensors = params + 2 * h + model.vocab * h, tensors + 3
    return params, tensors


def zero1_state_bytes(params: float, dp: int, param_bytes: float, grad_bytes: float,
                      optimizer_bytes: float) -> float:
    """One rank's weights, gradients and optimizer states under ZeRO-1 over dp, lesson 03's
    `zero_bytes_per_device("zero1", ...)`: (param_bytes + grad_bytes) Psi whole, plus
    optimizer_bytes Psi / dp (7.53e9 parameters on dp 64: 31.5 GB with 2 + 2 + 12 bytes, 61.2 GB
    with nd.py's fp32 4 + 4 + 8)."""
    return zero.zero_bytes_per_device("zero1", params, dp, k=optimizer_bytes,
                                      param_bytes=param_bytes, grad_bytes=grad_bytes)


def model_state_bytes(model: Model, layout: nd.Layout, run: Run, stage: int) -> float:
    """Weights, gradients and optimizer states of one rank of `stage`: lesson 03's
    `zero_bytes_per_device("zero1", Psi, dp cp)` on this rank's Psi = stage_parameters (what
    nd.py's ZeRO-1 over the dp x cp ranks keeps: the whole weights and gradients, K Psi /
    (dp cp) of optimizer state), plus AdamW's float32 step counter per tensor. Exact when dp cp
    divides every tensor; else rank 0's shards hold up to one element more per tensor (lesson
    03's shard_bounds)."""
    psi, tensors = stage_parameters(model, layout, stage)
    return zero1_state_bytes(psi, layout.dp * layout.cp, run.param_bytes, run.grad_bytes,
                             run.optimizer_bytes) + \
        STEP_COUNTER_BYTES * tensors


def block_activation_bytes(model: Model, layout: nd.Layout, run: Run) -> int:
    """Bytes one rank keeps for backward in one nd.ParallelBlock, per micro-batch.

    Lesson 04's `saved_activation_bytes` (sequence parallel, the gathered QKV and up inputs
    kept) on the s / cp positions of this cp rank counts a block whose attention keeps the
    softmax output a (s/cp)^2 b / tp and the (s/cp)^2 boolean mask. nd's attention is lesson
    11's ring (`RingAttention`): it keeps q, k, v, out and the log-sum-exp instead, so take
    those two terms out and add what the ring keeps beyond lesson 04's count: its own copy
    of out (O's input is a second, reshaped copy), (s/cp) b h / tp, and the log-sum-exp,
    (a/tp) b (s/cp). Result: e [(2 + 15/tp) (s/cp) b h + 4 (s/cp) b / tp + (a/tp) b (s/cp)].
    Lesson 11's `activation_bytes_per_rank` (lesson 07's Korthikanti count split over cp) is
    not used: it has no tp, is 16-bit only and counts two 1-byte dropout masks, which nd does
    not have; at tp = 1 and e = 2 its 34 (s/cp) b h equals our 17 x 2 by coincidence (the
    ring's second copy of out in place of the masks), less our LayerNorm statistics and
    log-sum-exp (the suite holds the two together)."""
    s, b, e, tp = model.seq // layout.cp, run.micro_batch, run.activation_bytes, layout.tp
    counted = tensor_parallel.saved_activation_bytes(s, b, model.hidden, model.heads, tp, e, True)
    softmax_and_mask = model.heads * s * s * b // tp * e + s * s
    ring = (s * b * model.hidden // tp + model.heads // tp * b * s) * e
    return counted - softmax_and_mask + ring


def stage_activation_bytes(model: Model, layout: nd.Layout, run: Run, stage: int) -> int:
    """One micro-batch's bytes kept on a rank of `stage` until its backward: its L / pp blocks;
    then, on every stage but the last, the output it sent (n b h e, n = s / (cp tp) positions,
    held by lesson 05's pipeline_step until its gradient comes back); on the last stage the
    head's instead: the final LayerNorm's input, output and statistics, the log-probabilities
    (n b V: cross-entropy's log-softmax), the int64 targets, two scalars (the loss and nll's
    total weight). Stage 0's embedding output is its first block's input (counted there)."""
    n, b, e = model.seq // (layout.cp * layout.tp), run.micro_batch, run.activation_bytes
    blocks = model.layers // layout.pp * block_activation_bytes(model, layout, run)
    if stage < layout.pp - 1:
        return blocks + n * b * model.hidden * e
    return blocks + n * b * ((2 * model.hidden + model.vocab + 2) * e + 8) + 2 * e


@dataclasses.dataclass(frozen=True)
class Memory:
    """One rank's prediction: model states, activations held at the peak (in-flight
    micro-batches x one micro-batch's), their sum, and the stage."""

    stage: int
    states: float
    inflight: float
    activations: float

    @property
    def peak(self) -> float:
        return self.states + self.activations


def memory_per_stage(model: Model, layout: nd.Layout, run: Run) -> list[Memory]:
    """Each stage's Memory: states + in-flight x stage_activation_bytes, where a 1F1B stage d
    holds min(pp - d, m) micro-batches at its peak (lesson 05's `peak_inflight_closed_form`:
    stage 0 the most)."""
    m = microbatches(run, layout)
    out = []
    for stage in range(layout.pp):
        inflight = pipeline.peak_inflight_closed_form("1f1b", layout.pp, m, device=stage)
        out.append(Memory(stage, model_state_bytes(model, layout, run, stage), inflight,
                          inflight * stage_activation_bytes(model, layout, run, stage)))
    return out


# ============================================================================ 4. communication


@functools.cache
def link_of(cluster: Cluster, layout: nd.Layout, dim: str) -> str:
    """"nvlink" if every group of `dim` (nd.dimension_groups) lies inside one node, else
    "network" (a ring runs at its slowest hop). A group is `size` ranks `stride` apart
    (stride = the sizes of the dimensions after `dim` in nd.DIMS), spanning size x stride:
    when that span divides a node every group is inside one; when a node divides it, none
    is; otherwise the groups are enumerated."""
    size = getattr(layout, dim)
    stride = math.prod(getattr(layout, d) for d in nd.DIMS[nd.DIMS.index(dim) + 1:])
    node = cluster.gpus_per_node
    if size == 1 or node % (size * stride) == 0:
        return "nvlink"
    if (size * stride) % node == 0:
        return "network"
    inside = all(len({rank // node for rank in group}) == 1
                 for group in nd.dimension_groups(layout, dim))
    return "nvlink" if inside else "network"


@functools.cache
def pipeline_sends(stages: int, microbatches: int, stage: int) -> int:
    """Messages `stage` sends per step under 1F1B: the sends of lesson 05's `p2p_plan`
    (m activations forward unless last, m gradients back unless first)."""
    order = pipeline.one_f_one_b_order(stages, microbatches)[stage]
    return sum(t.send for transfers, _ in pipeline.p2p_plan(order, stage, stages) for t in transfers)


@dataclasses.dataclass(frozen=True)
class LinkTraffic:
    """Bytes one rank sends per step over one dimension, its link and the time at its bandwidth."""

    bytes: float
    link: str
    seconds: float


def communication(model: Model, cluster: Cluster, layout: nd.Layout, run: Run,
                  stage: int) -> dict[str, LinkTraffic]:
    """Bytes one rank of `stage` sends per optimizer step, by dimension (m micro-batches, each
    through L / pp blocks; b sequences per micro-batch; e, g, w bytes per activation, gradient
    and weight element; Psi this rank's parameters):

    tp  m (L/pp) lesson 04's `tp_bytes_per_block(s/cp, b, h, tp, e, sequence_parallel)` (4
        all-gathers + 4 reduce-scatters of (s/cp) b h, and the block's 6 h replicated
        gradients all-reduced: nd does that once per step, not per micro-batch, a few kB
        over-counted), plus one all-reduce of the tables and head nd.py replicates over tp
        (2 (tp-1)/tp x their gradients);
    cp  m (L/pp) b x lesson 11's `ring_bytes_per_rank(s, a/tp, h/a, cp, e)` forward and
        backward, plus the all-reduce of every gradient over cp (nd.py sums them there);
    pp  the activations and gradients lesson 05's `p2p_plan` sends under 1F1B, n b h e each;
    dp  lesson 03's `zero_communication_elements("zero1", Psi)`: a reduce-scatter of the
        gradients and an all-gather of the weights, (dp-1)/dp of each sent by a ring rank.
    """
    s, b, e, h = model.seq // layout.cp, run.micro_batch, run.activation_bytes, model.hidden
    m, blocks = microbatches(run, layout), model.layers // layout.pp
    psi, _ = stage_parameters(model, layout, stage)
    replicated = ((model.vocab + model.seq) * h if stage == 0 else 0) + \
        ((2 * h + model.vocab * h) if stage == layout.pp - 1 else 0)
    sent = {
        "tp": m * blocks * tensor_parallel.tp_bytes_per_block(s, b, h, layout.tp, e, True)
        + collectives.ring_all_reduce_bytes_formula(replicated * run.grad_bytes, layout.tp),
        "cp": m * blocks * b * sum(context_parallel.ring_bytes_per_rank(
            model.seq, model.heads // layout.tp, h // model.heads, layout.cp, e))
        + collectives.ring_all_reduce_bytes_formula(psi * run.grad_bytes, layout.cp),
        "pp": pipeline_sends(layout.pp, m, stage) * (s // layout.tp) * b * h * e,
        "dp": (layout.dp - 1) / layout.dp * zero.zero_communication_elements("zero1", psi)
        * (run.grad_bytes + run.param_bytes) / 2,  # half gradients, half weights
    }
    out = {}
    for dim, nbytes in sent.items():
        link = link_of(cluster, layout, dim)
        bandwidth = cluster.intra_bandwidth if link == "nvlink" else cluster.inter_bandwidth
        out[dim] = LinkTraffic(nbytes, link, nbytes / bandwidth)
    return out


# ============================================================================ 5. the ranking


def compute_seconds(model: Model, cluster: Cluster, run: Run) -> float:
    """6 N x tokens / (GPUs x peak x MFU): the step's training FLOPs (PaLM's 6N per token,
    attention left out) shared evenly by every GPU at the assumed MFU."""
    tokens = run.global_batch * model.seq
    return 6 * model.parameters() * tokens / (cluster.gpus * cluster.peak_flops * run.mfu)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout's prediction: its worst stage's memory, the slowest stage's traffic, the
    1F1B bubble (share of total time), and the step time compute / (1 - bubble) + the
    traffic's seconds (simplified: nothing overlapped)."""

    layout: nd.Layout
    microbatches: int
    memory: Memory
    fits: bool
    traffic: dict[str, LinkTraffic]
    compute_s: float
    bubble: float

    @property
    def communication_s(self) -> float:
        return sum(t.seconds for t in self.traffic.values())

    @property
    def step_s(self) -> float:
        return self.compute_s / (1 - self.bubble) + self.communication_s


def evaluate(model: Model, cluster: Cluster, run: Run) -> list[Candidate]:
    """Every layout nd.py can build on the cluster, predicted, fastest first (fitting or not).
    A layout fits when its worst stage's peak <= memory x (1 - headroom)."""
    usable = cluster.memory_bytes * (1 - run.headroom)
    compute = compute_seconds(model, cluster, run)
    out = []
    for layout in enumerate_layouts(model, cluster, run):
        m = microbatches(run, layout)
        worst = max(memory_per_stage(model, layout, run), key=lambda mem: mem.peak)
        traffic = max((communication(model, cluster, layout, run, stage) for stage in range(layout.pp)),
                      key=lambda t: sum(x.seconds for x in t.values()))
        out.append(Candidate(layout, m, worst, worst.peak <= usable, traffic, compute,
                             pipeline.bubble_closed_form("1f1b", layout.pp, m)))
    return sorted(out, key=lambda c: (c.step_s, c.memory.peak))


def plan(model: Model, cluster: Cluster, run: Run) -> list[Candidate]:
    """The layouts that fit, best (lowest estimated step time) first."""
    return [c for c in evaluate(model, cluster, run) if c.fits]


def why_empty(model: Model, cluster: Cluster, run: Run,
              candidates: list[Candidate] | None = None) -> str:
    """Why `plan` is empty (or "" when it is not); `candidates`: evaluate's, if at hand."""
    candidates = evaluate(model, cluster, run) if candidates is None else candidates
    if not candidates:
        reasons = sorted({why_refused(model, cluster, run, layout) for layout in all_layouts(cluster.gpus)})
        return f"no layout of {cluster.gpus} GPUs can be built: " + "; ".join(reasons)
    if any(c.fits for c in candidates):
        return ""
    smallest = min(candidates, key=lambda c: c.memory.peak)
    return (f"no layout fits in {cluster.memory_bytes * (1 - run.headroom) / GB:.1f} GB per GPU "
            f"(memory less {run.headroom:.0%} headroom): the smallest predicted peak is "
            f"{smallest.memory.peak / GB:.1f} GB ({layout_name(smallest.layout)}, stage "
            f"{smallest.memory.stage})")


def layout_name(layout: nd.Layout) -> str:
    """dp32xtp2: the dimensions above 1 (one GPU: "1")."""
    return "x".join(f"{dim}{getattr(layout, dim)}" for dim in ("dp", "tp", "pp", "cp")
                    if getattr(layout, dim) > 1) or "1"


def format_plan(model: Model, cluster: Cluster, run: Run, top: int = 10) -> str:
    """The plan as text: the inputs, then one row per fitting layout, best first (or why none)."""
    lines = [
        f"model: {model.layers} layers, hidden {model.hidden}, {model.heads} heads, vocab "
        f"{model.vocab}, seq {model.seq}: {model.parameters() / 1e9:.2f} B parameters",
        f"cluster: {cluster.gpus} GPUs, {cluster.gpus_per_node} per node, "
        f"{cluster.memory_bytes / GB:.0f} GB each ({run.headroom:.0%} kept free), NVLink "
        f"{cluster.intra_bandwidth / GB:.0f} GB/s, network {cluster.inter_bandwidth / GB:.0f} GB/s "
        f"per GPU, {cluster.peak_flops / 1e12:.0f} TFLOP/s peak",
        f"run: {run.global_batch} sequences x {model.seq} tokens, micro-batch {run.micro_batch}, "
        f"bytes/element weights {run.param_bytes} grads {run.grad_bytes} optimizer "
        f"{run.optimizer_bytes} activations {run.activation_bytes}, ZeRO-1 over dp, 1F1B, MFU "
        f"{run.mfu:.0%}",
        "step = compute / (1 - bubble) + communication (simplified: nothing overlapped)",
    ]
    candidates = evaluate(model, cluster, run)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        return "\n".join(lines + ["", why_empty(model, cluster, run, candidates)])
    lines += ["", f"{'#':>3}  {'layout':<16}{'m':>5}  {'GB/GPU':>7} {'states':>7} {'act':>6}  "
              f"{'tp GB':>8} {'cp GB':>8} {'pp GB':>7} {'dp GB':>7}  {'bubble':>6}  "
              f"{'comm s':>7} {'step s':>7}"]
    for i, c in enumerate(fitting[:top], 1):
        t = c.traffic
        link = {dim: "*" if t[dim].link == "network" and t[dim].bytes else " " for dim in t}
        lines.append(
            f"{i:>3}  {layout_name(c.layout):<16}{c.microbatches:>5}  {c.memory.peak / GB:>7.1f} "
            f"{c.memory.states / GB:>7.1f} {c.memory.activations / GB:>6.1f}  "
            + " ".join(f"{t[dim].bytes / GB:>{w}.2f}{link[dim]}" for dim, w in
                       (("tp", 7), ("cp", 7), ("pp", 6), ("dp", 6)))
            + f"  {c.bubble:>6.1%}  {c.communication_s:>7.2f} {c.step_s:>7.2f}")
    lines.append(f"({len(fitting)} of {len(candidates)} buildable layouts fit; "
                 "* = over the network, else NVLink)")
    return "\n".join(lines)


# ============================================================================ 6. named models and GPUs

MODELS = {  # named shapes for --plan-model
    "llama3-8b-class": Model(layers=32, hidden=4096, heads=32, vocab=128256, seq=8192),
    "gpt2-xl": Model(**memory.GPT2_XL),
    "tiny": Model.of(nd_model.GPTConfig()),
}
H100_80GB = {"memory_gb": 80.0, "nvlink_gbs": 450.0, "network_gbs": 50.0, "peak_tflops": 989.0}
