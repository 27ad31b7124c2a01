"""Lesson 13's planner: which layouts and strategies fit a model on a cluster, best first.

The Ultra-Scale Playbook's method as a tool: list the ways to split a training step over the
cluster, predict each one's memory per GPU with the earlier lessons' formulas, drop those that
do not fit, and rank the rest by an estimated step time (the slowest pipeline stage's compute,
the bubble, the communication on the link each dimension uses). In the order the planner
meets them:

1. the inputs: `Model` (a decoder: the course GPT's block, or Llama's with grouped-query
   attention, SwiGLU and RMSNorm; `Model.parameters()` is nd_model.GPT's count for the
   course's block), `Cluster` (GPUs in nodes, memory, links, peak FLOP/s), `Recipe` (bytes per
   element of each kind of tensor, each recipe with its source), `Run` (the global batch, the
   recipe, the engine, the assumed MFU, what the search may choose);
2. the strategies: a `Strategy` is a layout (dp x tp x pp x cp, nd.Layout) and the choices
   made with it (micro-batch size, ZeRO stage, recomputation, interleaved chunks, layers moved
   off the first and last stages); `why_refused`, `strategies`, `enumerate_layouts`;
3. memory per GPU, each term from the lesson that taught it: `stage_layers`,
   `stage_parameters`, `model_state_bytes` (lesson 03's ZeRO stages), `block_activation_bytes`
   (lesson 04's sequence-parallel block, lesson 11's ring attention, Korthikanti et al.'s
   recomputation), `head_activation_bytes`, `stage_activation_bytes`, `inflight` (lesson 05's
   1F1B and interleaved schedules), `ring_tile_bytes`, `head_gradient_bytes`, `working_set_bytes`,
   `memory_per_stage`;
4. communication per step per GPU: `communication` (lessons 01, 03, 04, 05, 11), each
   dimension on its link (`link_of`);
5. compute: `stage_flops` (PaLM's 6N + attention per token, per stage: the embedding on the
   first, the head on the last) and `compute_seconds` (the slowest stage sets the pace);
6. the ranking: `evaluate`, `plan` (each layout's best strategy), `why_empty`, `format_plan`;
7. named models, GPUs and published runs (`MODELS`, `GPUS`, `PUBLISHED`) for the CLI; the CLI
   hook and the check of the predictions against measured bytes are in planner_checks.py, the
   check at full scale (nd.py's step on fake tensors) in simulate.py.

Two engines: "megatron" plans what production trainers run (Megatron-LM's and torchtitan's
choices: flash attention, a vocabulary-parallel head and loss, every ZeRO stage, interleaving,
uneven stages, cp folded into the data-parallel group); "nd" plans what nd.py builds (ring
attention keeping its own output, the vocabulary whole on every tp rank, ZeRO-1, 1F1B, equal
stages, autocast's bf16 weight copies), which the CPU and the simulation measure.

Simplified: collectives use bandwidth only (no latency term) at the slowest link they cross;
compute runs at an assumed MFU whatever the layout (tensor parallelism shrinks each matmul and
a micro-batch of one sequence feeds smaller ones, so real efficiency falls where this does not
see it); nothing overlaps unless `Run.overlap` (then dp's, pp's and cp's traffic hides behind
compute, tp's never: it sits between a layer's matmuls); the memory prediction is the live
bytes of the step (checked against the simulation), not the allocator's reserved memory (a
headroom fraction of memory is kept free for fragmentation and the runtime).
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
memory = importlib.import_module("lessons.07_memory.main")  # parameter count
context_parallel = importlib.import_module("lessons.11_context_parallel.main")  # ring bytes

GB = 1e9  # the planner's gigabyte: 10^9 bytes (lesson 03's memory_table_gb too)
STEP_COUNTER_BYTES = 4  # torch's AdamW keeps one float32 `step` per parameter tensor

# ============================================================================ 1. the inputs


@dataclasses.dataclass(frozen=True)
class Model:
    """A decoder of `layers` pre-norm blocks of width `hidden`: `heads` query heads and
    `kv_heads` key/value heads (grouped-query attention; 0: as many as heads), an MLP of width
    `ffn` (0: 4 hidden), "gelu" (up, down) or "swiglu" (gate, up, down: Llama), "layernorm"
    (gain and shift) or "rmsnorm" (gain), biases on every linear but the head (`bias`),
    "learned" positions (a seq x hidden table) or "rope" (none), a head `tied` to the token
    table or not; `seq` tokens per sequence. Defaults: the course's GPT (nd_model.GPT)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    kv_heads: int = 0
    ffn: int = 0
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    positions: str = "learned"
    tied: bool = False

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "vocab", "seq"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}")
        for name, default in (("kv_heads", self.heads), ("ffn", 4 * self.hidden)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, value or default)
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} are not a multiple of kv_heads {self.kv_heads}")
        for name, allowed in (("mlp", ("gelu", "swiglu")), ("norm", ("layernorm", "rmsnorm")),
                              ("positions", ("learned", "rope"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"model {name} must be one of {allowed}, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, config: nd_model.GPTConfig) -> Model:
        """The course GPT of an nd_model.GPTConfig."""
        return cls(config.layers, config.hidden, config.heads, config.vocab, config.seq)

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): kv_heads x head dim."""
        return self.kv_heads * (self.hidden // self.heads)

    def norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.hidden

    def block_matmul_weights(self) -> int:
        """Elements of a block's four matmul weights: Q and O h x h each, K and V h x kv_width
        each, the MLP 2 (gelu) or 3 (swiglu) h x ffn. All split over tp."""
        return 2 * self.hidden ** 2 + 2 * self.hidden * self.kv_width + \
            (2 if self.mlp == "gelu" else 3) * self.hidden * self.ffn

    def block_split(self) -> int:
        """A block's parameters split over tp: its matmul weights and the biases of the
        column-parallel layers (Q, K, V; up, and gate)."""
        biases = self.hidden + 2 * self.kv_width + (1 if self.mlp == "gelu" else 2) * self.ffn
        return self.block_matmul_weights() + (biases if self.bias else 0)

    def block_replicated(self) -> int:
        """A block's parameters every tp rank holds whole: both norms, the row-parallel
        biases (O, down): 6 h for the course's block, 2 h for Llama's."""
        return 2 * self.norm_params() + (2 * self.hidden if self.bias else 0)

    def block_tensors(self) -> int:
        """Parameter tensors per block as nd.py and Megatron hold them (Q, K, V fused; gate
        and up fused): norms 4 (layernorm) or 2, four weights, four biases."""
        return (4 if self.norm == "layernorm" else 2) + 4 + (4 if self.bias else 0)

    def parameters(self) -> int:
        """N = L (block_split + block_replicated) + V h (tokens) + s h (learned positions) +
        the final norm + V h (an untied head). For the course GPT: L (12 h^2 + 13 h) + (V + s) h
        + 2 h + V h, lesson 07's `gpt_param_count` plus the head nd_model.GPT does not tie."""
        table = self.vocab * self.hidden
        return self.layers * (self.block_split() + self.block_replicated()) + table + \
            (self.seq * self.hidden if self.positions == "learned" else 0) + self.norm_params() + \
            (0 if self.tied else table)

    def matmul_parameters(self) -> int:
        """The N of 6N (as flops.matmul_params counts it): every parameter but the position
        table and, for an untied head, the token table (lookups, not matmuls)."""
        return self.parameters() - (self.seq * self.hidden if self.positions == "learned" else 0) - \
            (0 if self.tied else self.vocab * self.hidden)


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

    @classmethod
    def of(cls, gpu: str, gpus: int, gpus_per_node: int = 8) -> Cluster:
        """`gpus` of a named kind (`GPUS`)."""
        spec = GPUS[gpu]
        return cls(gpus, gpus_per_node, spec["memory_gb"] * GB, spec["nvlink_gbs"] * GB,
                   spec["network_gbs"] * GB, spec["peak_tflops"] * 1e12)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Bytes per element of each kind of tensor a training step keeps.

    States (per parameter): `weights` (what the forward reads), `grads` (what accumulates
    over micro-batches and is reduced: also the bytes on the wire of the gradient
    reduction), `master` (an fp32 copy when the weights are 16-bit, else 0) and `moments`
    (Adam's m and v). Activations (per element kept for backward): `compute` (matmul inputs
    and outputs), `residual` (the residual stream, the norms' inputs, what a stage sends),
    `attention` (q, k, v, the attention output and its log-sum-exp), `stats` (norm
    statistics), `logits` (the loss's log-probabilities), `cast` (per matmul weight and
    micro-batch in flight: autocast's 16-bit copy of an fp32 weight, which autograd keeps)."""

    name: str
    weights: int
    grads: int
    master: int
    moments: int
    compute: int
    residual: int
    attention: int
    stats: int
    logits: int
    cast: int
    source: str

    @property
    def optimizer(self) -> int:
        """ZeRO's K: what the optimizer keeps per parameter (master + moments)."""
        return self.master + self.moments


RECIPES = {recipe.name: recipe for recipe in (
    Recipe("bf16", 2, 4, 4, 8, 2, 2, 2, 4, 4, 0,
           "Megatron-LM --bf16 (megatron/training/arguments.py: 'bfloat16 requires gradient "
           "accumulation and all-reduce to be done in fp32'; fp32 main params and Adam states, "
           "optimizer_config.py), 18 bytes per parameter, 6 + 12/d with the distributed "
           "optimizer (docs/user-guide/features/dist_optimizer.md); NeMo's bf16_mixed plugin "
           "(params_dtype bf16, grad_reduce_in_fp32=True); Llama 3 (arXiv 2407.21783, 3.3.2: "
           "FP32 gradient accumulation and reduce-scatter); the loss in fp32 "
           "(megatron/core/tensor_parallel/cross_entropy.py upcasts the logits)"),
    Recipe("bf16-reduce-bf16", 2, 2, 4, 8, 2, 2, 2, 4, 4, 0,
           "Megatron-LM --grad-reduce-in-bf16 (gradients accumulated and reduced in bf16): "
           "2 + 2 + 12 bytes per parameter"),
    Recipe("fp16-zero", 2, 2, 4, 8, 2, 2, 2, 4, 4, 0,
           "the ZeRO paper's mixed-precision Adam (arXiv 1910.02054, Fig. 1): fp16 weights and "
           "gradients, K = 12 (fp32 master, momentum, variance); with loss scaling"),
    Recipe("nd-autocast", 4, 4, 0, 8, 2, 4, 4, 4, 4, 2,
           "nd.py's GPU run: fp32 weights, gradients and AdamW moments, the forward under bf16 "
           "autocast (matmuls in bf16, the residual stream and norms in fp32), the ring "
           "attention in fp32, the loss on fp32 logits"),
    Recipe("fp32", 4, 4, 0, 8, 4, 4, 4, 4, 4, 0, "fp32 Adam: 4 + 4 + 8"),
    Recipe("fp64", 8, 8, 0, 16, 8, 8, 8, 8, 8, 0, "the CPU checks' float64: 8 + 8 + 16"),
)}
DEFAULT_RECIPE = "bf16"
ZERO_STAGES = ("zero1", "zero2", "zero3", "hsdp")
RECOMPUTE = ("none", "selective", "full")
ENGINES = ("megatron", "nd")


@dataclasses.dataclass(frozen=True)
class Run:
    """One optimizer step: `global_batch` sequences of the model's seq tokens; the `recipe`;
    the `engine` ("megatron": production's choices; "nd": what nd.py builds); the MFU the
    compute time assumes; the share of GPU memory kept free (`headroom`); whether dp, pp and
    cp traffic overlaps compute (`overlap`); whether cp joins the ZeRO group (`fold_cp`, as
    torchtitan and Megatron-LM do; False: gradients all-reduced over cp, then ZeRO over dp).
    What the search may choose: `micro_batches` (sequences per micro-batch), `zero`,
    `recompute`, `interleave` (more than one model chunk per pipeline rank), `shift`
    (layers moved off the first and last stages). Run.for_engine fills these per engine."""

    global_batch: int
    recipe: Recipe = RECIPES[DEFAULT_RECIPE]
    engine: str = "megatron"
    mfu: float = 0.4
    headroom: float = 0.1
    overlap: bool = False
    fold_cp: bool = True
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    zero: tuple[str, ...] = ZERO_STAGES
    recompute: tuple[str, ...] = RECOMPUTE
    interleave: bool = True
    shift: bool = True

    def __post_init__(self):
        if self.global_batch < 1 or not self.micro_batches or min(self.micro_batches) < 1:
            raise ValueError(f"global batch ({self.global_batch}) and micro-batches "
                             f"({self.micro_batches}) must be >= 1")
        if not 0 < self.mfu <= 1 or not 0 <= self.headroom < 1:
            raise ValueError(f"mfu must be in (0, 1] and headroom in [0, 1), got {self.mfu}, {self.headroom}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; use one of {ENGINES}")
        for name, allowed in (("zero", ZERO_STAGES), ("recompute", RECOMPUTE)):
            if not getattr(self, name) or not set(getattr(self, name)) <= set(allowed):
                raise ValueError(f"{name} must be some of {allowed}, got {getattr(self, name)!r}")

    @classmethod
    def for_engine(cls, engine: str, global_batch: int, recipe: str | None = None, **kwargs) -> Run:
        """A Run whose choices are the engine's: "nd" is nd.py (its GPU recipe, ZeRO-1, ring
        attention with the recomputation it has by construction, or every block recomputed
        as planner_checks.recompute_blocks adds from outside, 1F1B, equal stages, cp folded
        into ZeRO's group as in torchtitan); "megatron" searches every choice."""
        name = recipe or ("nd-autocast" if engine == "nd" else DEFAULT_RECIPE)
        if name not in RECIPES:
            raise ValueError(f"unknown recipe {name!r}; use one of {sorted(RECIPES)}")
        if engine == "nd":
            kwargs = {"zero": ("zero1",), "recompute": ("selective", "full"), "interleave": False,
                      "shift": False, **kwargs}
        return cls(global_batch, RECIPES[name], engine, **kwargs)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A layout and the choices made with it: `micro_batch` sequences per micro-batch, the
    ZeRO stage (`zero`: "zero1" optimizer states sharded, "zero2" gradients too, "zero3"
    weights too, gathered for each block's forward and backward, "hsdp" zero3 inside a node
    and replicated across nodes), `recompute` (Korthikanti et al.: "none" keeps the attention
    probabilities, "selective" recomputes them in backward as flash and ring attention do,
    "full" keeps only each block's input and runs its forward again), `chunks` model chunks
    per pipeline rank (interleaved 1F1B when > 1) and `shift` layers moved off the first and
    the last stage each (Llama 3 405B: one each; Megatron-LM's
    account_for_embedding_in_pipeline_split)."""

    layout: nd.Layout
    micro_batch: int = 1
    zero: str = "zero1"
    recompute: str = "selective"
    chunks: int = 1
    shift: int = 0


# ============================================================================ 2. the strategies


def layout_refused(model: Model, cluster: Cluster, layout: nd.Layout) -> str | None:
    """Why no strategy of `layout` can run whatever its choices, or None: what the model
    needs of a layout (nd.py's checks, Megatron-LM's): heads and kv_heads % tp (attention
    splits whole heads), ffn % tp, seq % 2 cp (lesson 11's zig-zag chunks), (seq / cp) % tp
    (sequence parallelism's positions). The planner's: tp divides a node's GPUs, so no tp
    group leaves a node: its collectives run inside every layer, forward and backward, on
    the critical path, and need NVLink (Megatron-LM: tensor parallelism up to the GPUs of a
    server; the Playbook: TP+SP within a node); tp x cp divides a node or fills whole nodes
    (cp's ring may cross nodes, as Llama 3 405B's cp 16 x tp 8 did, at the network's
    bandwidth)."""
    if layout.world != cluster.gpus:
        return f"dp x tp x pp x cp = {layout.world}, the cluster has {cluster.gpus} GPUs"
    if model.heads % layout.tp or model.kv_heads % layout.tp:
        return f"{model.heads} heads ({model.kv_heads} key/value) do not split over tp = {layout.tp}"
    if model.ffn % layout.tp:
        return f"ffn {model.ffn} does not split over tp = {layout.tp}"
    if model.layers % layout.pp and model.layers < layout.pp:
        return f"{model.layers} layers do not fill pp = {layout.pp} stages"
    if model.seq % (2 * layout.cp):
        return f"seq {model.seq} is not divisible by 2 cp = {2 * layout.cp}"
    if (model.seq // layout.cp) % layout.tp:
        return f"seq / cp = {model.seq // layout.cp} positions do not split over tp = {layout.tp}"
    if cluster.gpus_per_node % layout.tp:
        return (f"tp = {layout.tp} does not divide a node's {cluster.gpus_per_node} GPUs (its "
                "per-layer collectives need NVLink)")
    span, node = layout.tp * layout.cp, cluster.gpus_per_node
    if node % span and span % node:
        return (f"tp x cp = {span} neither divides a node's {node} GPUs nor fills whole nodes "
                "(cp's ring would mix links)")
    return None


def why_refused(model: Model, cluster: Cluster, run: Run, strategy: Strategy) -> str | None:
    """Why `strategy` cannot run, or None: `layout_refused`, then the stages' layers
    (`stage_layers`), the batch into dp replicas of micro-batches (lesson 05's
    `microbatch_count`; interleaving needs m % pp == 0, as Megatron-LM does), HSDP's
    groups."""
    layout, b = strategy.layout, strategy.micro_batch
    reason = layout_refused(model, cluster, layout)
    if reason is not None:
        return reason
    try:
        stage_layers(model, strategy)
    except ValueError as exc:
        return str(exc)
    if run.global_batch % (layout.dp * b):
        return f"global batch {run.global_batch} is not a multiple of dp {layout.dp} x micro-batch {b}"
    if strategy.chunks > 1 and microbatches(run, strategy) % layout.pp:
        return (f"interleaving needs micro-batches ({microbatches(run, strategy)}) a multiple "
                f"of pp = {layout.pp}")
    if strategy.zero == "hsdp" and not 1 < hsdp_shards(cluster, run, layout) < zero_group(run, layout):
        return "hsdp needs the ZeRO group to span nodes with more than one of its ranks per node"
    return None


def all_layouts(gpus: int) -> list[nd.Layout]:
    """Every (dp, tp, pp, cp) of positive integers whose product is `gpus`."""
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    return [nd.Layout(dp=gpus // (tp * pp * cp), tp=tp, pp=pp, cp=cp)
            for tp, pp, cp in itertools.product(divisors, repeat=3) if gpus % (tp * pp * cp) == 0]


def strategies(model: Model, cluster: Cluster, run: Run, layout: nd.Layout) -> list[Strategy]:
    """Every Strategy of `layout` the run's choices allow and `why_refused` lets through:
    micro-batch sizes, ZeRO stages, recomputation, 2 to 8 chunks when interleaving (pp > 1),
    shifts of 1 to 4 layers when allowed (pp > 1)."""
    if layout_refused(model, cluster, layout) is not None:
        return []
    pp = layout.pp
    chunks = [1] + ([v for v in range(2, min(8,
                                             model.layers // pp) + 1)] if run.interleave and pp > 1 else [])
    shifts = [0] + ([1, 2, 3, 4] if run.shift and pp > 1 else [])
    out = []
    for v, k, b in itertools.product(chunks, shifts, run.micro_batches):
        first = Strategy(layout, b, run.zero[0], run.recompute[0], v, k)
        if why_refused(model, cluster, run, first) is not None and \
                why_refused(model, cluster, run, dataclasses.replace(first, zero="zero1")) is not None:
            continue
        for z, r in itertools.product(run.zero, run.recompute):
            candidate = Strategy(layout, b, z, r, v, k)
            if z != "hsdp" or why_refused(model, cluster, run, candidate) is None:
                out.append(candidate)
    return out


def enumerate_layouts(model: Model, cluster: Cluster, run: Run) -> list[nd.Layout]:
    """The layouts of `cluster.gpus` ranks with at least one strategy."""
    return [layout for layout in all_layouts(cluster.gpus) if strategies(model, cluster, run, layout)]


# ============================================================================ 3. memory per GPU


def microbatches(run: Run, strategy: Strategy) -> int:
    """m = global batch / (dp x micro-batch): lesson 05's `microbatch_count`."""
    return pipeline.microbatch_count(run.global_batch, strategy.layout.dp, strategy.micro_batch)


def stage_layers(model: Model, strategy: Strategy) -> list[int]:
    """Blocks on each pipeline rank. Even: L / pp each. With v chunks and a shift k, every
    chunk holds c = (L + 2k) / (pp v) blocks but the first stage's first and the last
    stage's last, which hold c - k (Llama 3 405B: 126 layers, pp 16, k = 1: 7, 8 x 14, 7; the
    embedding and the loss take the place of the missing layers). ValueError when it does
    not divide, or k >= c."""
    return list(_stage_layers(model.layers, strategy.layout.pp, strategy.chunks, strategy.shift))


@functools.lru_cache(maxsize=4096)  # the search asks again for every ZeRO stage, recomputation, b
def _stage_layers(layers: int, pp: int, v: int, k: int) -> tuple[int, ...]:
    if (layers + 2 * k) % (pp * v) or (pp == 1 and (k or v > 1)):
        return _refuse(f"{layers} layers (+ 2 x {k} shifted) do not split into pp = {pp} x {v} chunks")
    c = (layers + 2 * k) // (pp * v)
    if k and (k >= c or pp < 2):
        return _refuse(f"a shift of {k} layers leaves the end chunks of {c} empty")
    out = [v * c] * pp
    out[0] -= k
    out[-1] -= k
    return tuple(out)


def _refuse(message: str):
    raise ValueError(message)


def stage_parameters(model: Model, run: Run, strategy: Strategy, stage: int) -> tuple[int, int]:
    """(parameters, parameter tensors) one rank of pipeline stage `stage` holds: its blocks
    (block_split / tp + block_replicated each, block_tensors tensors); stage 0 the token
    table (V h, / tp when the engine splits the vocabulary) and learned positions (s h); the
    last stage the final norm and the head (V h, / tp when split; a tied head is the token
    table, held again on the last stage when pp > 1, as Megatron-LM does)."""
    layout, tp = strategy.layout, strategy.layout.tp
    blocks = stage_layers(model, strategy)[stage]
    params = blocks * (model.block_split() // tp + model.block_replicated())
    tensors = blocks * model.block_tensors()
    table = model.vocab * model.hidden // (tp if run.engine == "megatron" else 1)
    norm_tensors = 2 if model.norm == "layernorm" else 1
    if stage == 0:
        positions = model.seq * model.hidden if model.positions == "learned" else 0
        params, tensors = params + table + positions, tensors + 1 + (positions > 0)
    if stage == layout.pp - 1:
        head = 0 if model.tied and layout.pp == 1 else table
        params, tensors = params + model.norm_params() + head, tensors + norm_tensors + (head > 0)
    return params, tensors


def zero_group(run: Run, layout: nd.Layout) -> int:
    """Ranks the optimizer (and, from ZeRO-2, gradients; ZeRO-3, weights) is sharded over:
    dp x cp when cp is folded into the data-parallel group, else dp."""
    return layout.dp * (layout.cp if run.fold_cp else 1)


def hsdp_shards(cluster: Cluster, run: Run, layout: nd.Layout) -> int:
    """HSDP's shard group: the ZeRO group's ranks inside one node (its ranks are
    tp (x cp when not folded) apart in nd.DIMS order), replicated across nodes."""
    stride = layout.tp * (1 if run.fold_cp else layout.cp)
    return math.gcd(zero_group(run, layout), max(1, cluster.gpus_per_node // stride))


def model_state_bytes(model: Model, run: Run, strategy: Strategy, stage: int,
                      cluster: Cluster | None = None) -> float:
    """Weights, gradients and optimizer states of one rank of `stage`: lesson 03's
    `zero_bytes_per_device(zero, Psi, d, k=master + moments, param_bytes, grad_bytes)` on this
    rank's Psi = stage_parameters and d = its ZeRO group (hsdp: zero3 over `hsdp_shards`),
    plus AdamW's float32 step counter per tensor (sharded tensors keep one per shard).
    Exact when d divides every tensor; else rank 0's shards hold up to one element more per
    tensor (lesson 03's shard_bounds)."""
    psi, tensors = stage_parameters(model, run, strategy, stage)
    d = zero_group(run, strategy.layout)
    kind = strategy.zero
    if kind == "hsdp":
        d, kind = hsdp_shards(cluster, run, strategy.layout), "zero3"
    recipe = run.recipe
    return zero.zero_bytes_per_device(kind, psi, d, k=recipe.optimizer, param_bytes=recipe.weights,
                                      grad_bytes=recipe.grads) + STEP_COUNTER_BYTES * tensors


def zero1_state_bytes(params: float, dp: int, param_bytes: float, grad_bytes: float,
                      optimizer_bytes: float) -> float:
    """ZeRO-1's bytes for `params` parameters over dp ranks (lesson 03's
    `zero_bytes_per_device("zero1", ...)`): (param_bytes + grad_bytes) Psi whole, plus
    optimizer_bytes Psi / dp. 7.53e9 parameters on dp 64: 75.3 GB with Megatron-LM's bf16
    recipe (2 + 4 + 12), 61.2 GB with nd.py's fp32 4 + 4 + 8, 31.5 GB with ZeRO's 2 + 2 + 12."""
    return zero.zero_bytes_per_device("zero1", params, dp, k=optimizer_bytes,
                                      param_bytes=param_bytes, grad_bytes=grad_bytes)


def block_activation_bytes(model: Model, run: Run, strategy: Strategy) -> int:
    """Bytes one rank keeps for backward in one block, per micro-batch: n = s / cp positions of
    its cp rank, b sequences, t = tp, h, a heads, w = kv_width, f = ffn, recipe bytes r_*.

    Sequence parallel (lesson 04's `saved_activation_bytes` counts these for the course's
    block): the norms' inputs 2 (n/t) b h r_residual and statistics (4 values per position
    for LayerNorm, 2 for RMSNorm) (n/t) b r_stats; the QKV and MLP inputs, gathered over tp,
    2 n b h r_compute in nd (lesson 04's SequenceParallelBlock keeps the gathered input),
    2 (n/t) b h r_compute in megatron (Megatron-LM's linear layers keep this rank's shard and
    gather it again in backward, lesson 04's save_shard; megatron/core/tensor_parallel/
    layers.py); the attention's q, k, v and output, n b (2h + 2w) / t r_attention, and
    log-sum-exp, (a/t) b n r_stats (flash and ring attention keep these instead of the
    probabilities: Korthikanti et al.'s selective recomputation by construction); the MLP's
    gelu input and output 2 n b f / t, or swiglu's gate, up and product 3 n b f / t, r_compute.
    The nd engine adds O's own input (nd's ring returns its output in fp32 and O reads a bf16,
    re-laid-out copy) n b h / t r_compute. "none" adds the probabilities (a/t) n s b r_compute
    (Korthikanti's 5as/h term without dropout); "full" keeps only the block's input,
    (n/t) b h r_residual. For the course block at tp = 1 in 16-bit this is lesson 11's
    `activation_bytes_per_rank` (34 (s/cp) b h) plus the norm statistics and log-sum-exp."""
    layout, b, r = strategy.layout, strategy.micro_batch, run.recipe
    n, t, h = model.seq // layout.cp, layout.tp, model.hidden
    if strategy.recompute == "full":
        return n // t * b * h * r.residual
    stats = (4 if model.norm == "layernorm" else 2) * (n // t) * b * r.stats
    gathered = n if run.engine == "nd" else n // t  # megatron keeps the shard, gathers it again
    kept = 2 * (n // t) * b * h * r.residual + stats + 2 * gathered * b * h * r.compute
    kept += n * b * (2 * h + 2 * model.kv_width) // t * r.attention + model.heads // t * b * n * r.stats
    kept += (2 if model.mlp == "gelu" else 3) * n * b * model.ffn // t * r.compute
    if run.engine == "nd":
        kept += n * b * h // t * r.compute
    if strategy.recompute == "none":
        kept += model.heads // t * n * model.seq * b * r.compute
    return kept


def head_activation_bytes(model: Model, run: Run, strategy: Strategy) -> int:
    """Bytes the last stage keeps for backward after its blocks, per micro-batch, n = s /
    (cp tp) positions: the final norm's input n b h r_residual and statistics; then
    nd: the head's input (the norm's output) n b h r_compute, the log-probabilities of
    cross-entropy n b V r_logits, the int64 targets, two scalars (the loss and nll's total
    weight); megatron (vocabulary-parallel, Megatron-LM's cross_entropy.py): the head's input
    shard n b h r_compute (gathered again in backward), the fp32 softmax of this rank's V / tp
    columns at the s/cp positions, their target mask (1 byte) and masked targets (int64)."""
    layout, b, r = strategy.layout, strategy.micro_batch, run.recipe
    n, full, h = model.seq // (layout.cp * layout.tp), model.seq // layout.cp, model.hidden
    norm = n * b * h * r.residual + (2 if model.norm == "layernorm" else 1) * n * b * r.stats
    if run.engine == "nd":
        return norm + n * b * (h * r.compute + model.vocab * r.logits + 8) + 2 * r.logits
    return norm + n * b * h * r.compute + full * b * (model.vocab // layout.tp * r.logits + 1 + 8)


def cast_bytes(model: Model, run: Run, strategy: Strategy, stage: int) -> int:
    """Autocast's 16-bit copies of the fp32 matmul weights one micro-batch's forward keeps
    for its backward (r_cast per element; nd.py's GPU recipe only): the blocks' matmul
    weights / tp, and the head's V h on the last stage."""
    if not run.recipe.cast:
        return 0
    blocks = stage_layers(model, strategy)[stage]
    weights = blocks * model.block_matmul_weights() // strategy.layout.tp
    if stage == strategy.layout.pp - 1:
        weights += model.vocab * model.hidden // (strategy.layout.tp if run.engine == "megatron" else 1)
    return weights * run.recipe.cast


def stage_activation_bytes(model: Model, run: Run, strategy: Strategy, stage: int) -> int:
    """One micro-batch's bytes kept on a rank of `stage` until its backward: its blocks; on
    every stage but the last, the output it sent (n b h r_residual, n = s / (cp tp), held by
    lesson 05's pipeline_step until its gradient comes back); on the last, the head's
    (`head_activation_bytes`); autocast's weight copies (`cast_bytes`). Stage 0's embedding
    output is its first block's input (counted there)."""
    layout = strategy.layout
    n, b = model.seq // (layout.cp * layout.tp), strategy.micro_batch
    blocks = stage_layers(model, strategy)[stage] * block_activation_bytes(model, run, strategy)
    end = head_activation_bytes(model, run, strategy) if stage == layout.pp - 1 else \
        n * b * model.hidden * run.recipe.residual
    return blocks + end + cast_bytes(model, run, strategy, stage)


def inflight(run: Run, strategy: Strategy, stage: int) -> float:
    """Micro-batches whose activations `stage` holds at its peak, in whole stages: lesson 05's
    `peak_inflight_closed_form`, 1F1B min(pp - stage, m), interleaved (pp - stage - 1) x 2 +
    (v - 1) pp + 1 chunk forwards of 1/v stage each (capped at m)."""
    kind = "interleaved" if strategy.chunks > 1 else "1f1b"
    return pipeline.peak_inflight_closed_form(kind, strategy.layout.pp, microbatches(run, strategy),
                                              strategy.chunks, device=stage)


def ring_tile_bytes(model: Model, run: Run, strategy: Strategy) -> int:
    """nd.py's ring attention computes a query chunk against a key chunk at a time, each
    s / (2 cp) positions (lesson 11's zig-zag halves): its backward (attend_block_backward)
    holds the scores, the probabilities, the gradient of the probabilities and of the
    scores of one tile at once, 4 (a / t) (s / 2cp)^2 r_attention, and a causal tile's mask
    and its negation, 2 (s / 2cp)^2 bytes. FlashAttention's tiles (a few kB) live in on-chip
    memory: 0 for the megatron engine."""
    if run.engine != "nd":
        return 0
    half = model.seq // (2 * strategy.layout.cp)
    return 4 * model.heads // strategy.layout.tp * half * half * run.recipe.attention + 2 * half * half


def head_gradient_bytes(model: Model, run: Run, strategy: Strategy) -> int:
    """The head's new weight gradient beside the accumulated one, on the last stage from its
    second micro-batch on (nd engine): torch makes it whole (V h: nd's head is not split)
    before AccumulateGrad adds it to the .grad the earlier micro-batches left
    (torch/csrc/autograd/functions/accumulate_grad.h: `variable_grad += new_grad`; the first
    micro-batch's is stolen as .grad, counted in the states). Under autocast the matmul's
    16-bit gradient, V h r_cast, and its fp32 copy for the fp32 weight, V h r_grads
    (ToCopyBackward), are live at once, while the linear's backward has freed the 16-bit
    weight copy (V h r_cast, `cast_bytes`), the loss's log-probabilities (n b V r_logits) and
    the head's 16-bit input (n b h r_compute), whose gradient is now the norm output's, n b h
    r_residual. On top of the micro-batch's activations, n = s / (cp tp):

        V h r_grads - n b V r_logits + n b h (r_residual - r_compute)

    (without autocast the same: no copy, no cast). It outweighs the loss's backward (2 n b V
    r_logits) once n b < about h r_grads / (3 r_logits) = h / 3 at fp32: for 8192 positions
    and h = 4096, at cp tp >= 6 (tp4 x cp4: n = 512, 1.84 GB against 0.53). 0 with one
    micro-batch, and for the megatron engine: Megatron-LM adds a weight gradient into the
    fp32 main_grad inside its GEMM (gradient_accumulation_fusion:
    megatron/core/tensor_parallel/layers.py, wgrad_gemm_accum_fp32)."""
    if run.engine != "nd" or microbatches(run, strategy) == 1:
        return 0
    n, b, r = model.seq // (strategy.layout.cp * strategy.layout.tp), strategy.micro_batch, run.recipe
    return (model.vocab * model.hidden * r.grads - n * b * model.vocab * r.logits
            + n * b * model.hidden * (r.residual - r.compute))


def working_set_bytes(model: Model, run: Run, strategy: Strategy, stage: int) -> int:
    """What backward makes on top of what the forward kept, at the peak (the simulation
    measures it): the largest of
    (a) a block's backward: the gradients passing through, 2 n b h r_residual (n = s / (cp
        tp)), ring attention's tile (`ring_tile_bytes`), and under "full" recomputation the
        block's own activations, rebuilt for its backward;
    (b) on the last stage, the loss's backward: nd, the gradients of the log-probabilities
        and of the logits, 2 n b V r_logits (cross-entropy's nll and log-softmax backward);
        megatron, the 16-bit gradient of the logits shard, (s/cp) b (V/t) r_compute (the fp32
        one is computed in place of the saved softmax);
    (b') on the last stage, from the second micro-batch on, the head's new weight gradient
        beside the accumulated one (`head_gradient_bytes`);
    (c) on the first stage, the token table's new gradient beside the accumulated one,
        V' h r_grads, once the micro-batch's own activations are freed (less them);
    ZeRO-3 (and hsdp) adds two blocks' gathered weights and one block's gathered gradients."""
    layout, b, r = strategy.layout, strategy.micro_batch, run.recipe
    n = model.seq // (layout.cp * layout.tp)
    block = 2 * n * b * model.hidden * r.residual + ring_tile_bytes(model, run, strategy)
    if strategy.recompute == "full":
        block += block_activation_bytes(model, run, dataclasses.replace(strategy, recompute="selective"))
    phases = [block]
    if stage == layout.pp - 1:
        phases.append(2 * n * b * model.vocab * r.logits if run.engine == "nd" else
                      model.seq // layout.cp * b * (model.vocab // layout.tp) * r.compute)
        phases.append(head_gradient_bytes(model, run, strategy))
    if stage == 0:
        table = model.vocab * model.hidden // (layout.tp if run.engine == "megatron" else 1)
        phases.append(table * r.grads - stage_activation_bytes(model, run, strategy, stage))
    out = max(phases)
    if strategy.zero in ("zero3", "hsdp"):
        out += (model.block_split() // layout.tp + model.block_replicated()) * (2 * r.weights + r.grads)
    return out


@dataclasses.dataclass(frozen=True)
class Memory:
    """One rank's prediction: model states, micro-batches in flight at the peak, activations
    held then (in flight x one micro-batch's), backward's working set, the stage, and the
    gradient bytes not yet made at the peak (`unmade`: see memory_per_stage)."""

    stage: int
    states: float
    inflight: float
    activations: float
    working: float
    unmade: float = 0.0

    @property
    def peak(self) -> float:
        return self.states - self.unmade + self.activations + self.working


def positions(pp: int) -> list[int]:
    """The stages that decide a layout: the first, stage 1 (of the middle stages, which hold
    the same blocks, the one with the most micro-batches in flight and as many sends as any),
    the last."""
    return sorted({0, min(1, pp - 1), pp - 1})


def memory_per_stage(model: Model, run: Run, strategy: Strategy, cluster: Cluster | None = None,
                     stages: list[int] | None = None) -> list[Memory]:
    """Each stage's Memory (or those of `stages`): states + inflight x stage_activation_bytes
    + working set. A stage that runs every forward before its first backward (1F1B with
    m <= pp - stage: no steady state) never holds its in-flight micro-batches beside every
    gradient: it peaks as its first backward starts (all in flight, ZeRO-1's gradients not
    yet made: `unmade`) or once that backward made them (one micro-batch fewer), whichever is
    more (the simulation found the first stage 21% below states + 2 micro-batches at m = pp = 2).
    Not under "full" recomputation: its kept inputs are small beside the gradients, which its
    first backward makes while rebuilding each block (the CPU measures states + m inputs)."""
    out = []
    for stage in range(strategy.layout.pp) if stages is None else stages:
        held = inflight(run, strategy, stage)
        act = stage_activation_bytes(model, run, strategy, stage)
        mem = Memory(stage, model_state_bytes(model, run, strategy, stage, cluster), held, held * act,
                     working_set_bytes(model, run, strategy, stage))
        if strategy.chunks == 1 and strategy.zero == "zero1" and strategy.recompute != "full" and \
                microbatches(run, strategy) <= strategy.layout.pp - stage:
            grads = stage_parameters(model, run, strategy, stage)[0] * run.recipe.grads
            after = dataclasses.replace(mem, inflight=held - 1, activations=(held - 1) * act)
            mem = max(dataclasses.replace(mem, unmade=grads), after, key=lambda m: m.peak)
        out.append(mem)
    return out


# ============================================================================ 4. communication


@functools.cache
def link_of(cluster: Cluster, layout: nd.Layout, dims: str | tuple[str, ...]) -> str:
    """"nvlink" if every group over `dims` (one dimension, or several that one collective
    spans: ("dp", "cp") when cp is folded into ZeRO's group) lies inside one node, else
    "network" (a ring runs at its slowest hop). Ranks are row-major over nd.DIMS (tp
    fastest): a group is a base rank plus offsets sum_d i_d stride_d over `dims`, so every
    group fits in a node of N GPUs exactly when the largest base residue (mod N) plus the
    largest offset stays below N (only dimensions whose stride N does not divide change a
    base's residue, and their first N coordinates already give every residue they can). A
    test holds this to nd.dimension_groups, group by group."""
    dims = (dims,) if isinstance(dims, str) else tuple(dims)
    node, sizes = cluster.gpus_per_node, dict(zip(nd.DIMS, layout.sizes()))
    stride = {d: math.prod(sizes[e] for e in nd.DIMS[nd.DIMS.index(d) + 1:]) for d in nd.DIMS}
    reach = sum((sizes[d] - 1) * stride[d] for d in dims)
    inner = [d for d in nd.DIMS if d not in dims and stride[d] % node and sizes[d] > 1]
    residues = {sum(i * stride[d] for i, d in zip(index, inner)) % node
                for index in itertools.product(*(range(min(sizes[d], node)) for d in inner))}
    return "nvlink" if max(residues) + reach < node else "network"


def pipeline_sends(stages: int, chunks: int, stage: int) -> int:
    """Messages `stage` sends per micro-batch under (interleaved) 1F1B: each of its v chunks
    sends its activation forward but the last stage's last chunk, and its gradient back but
    the first stage's first chunk: lesson 05's `p2p_plan` counts v = 1 (tested)."""
    return 2 * chunks - (stage == stages - 1) - (stage == 0) if stages > 1 else 0


@dataclasses.dataclass(frozen=True)
class LinkTraffic:
    """Bytes one rank sends per step over one dimension, its link and the time at its bandwidth."""

    bytes: float
    link: str
    seconds: float


@functools.lru_cache(maxsize=1 << 16)  # pure; the search repeats the same sizes many times
def ring(size_bytes: float, world: int, kind: str) -> float:
    """Bytes a ring rank sends: all_reduce 2(p-1)/p S, reduce_scatter and all_gather (p-1)/p S
    (lesson 01's `ring_all_reduce_bytes_formula` and its halves)."""
    half = collectives.ring_all_reduce_bytes_formula(size_bytes, world) / 2
    return 2 * half if kind == "all_reduce" else half


@functools.lru_cache(maxsize=1 << 14)
def _tp_bytes_per_block(s: int, b: int, h: int, t: int, element_bytes: float) -> float:
    """lesson 04's tp_bytes_per_block (plain sequence parallelism), remembered for the search."""
    return tensor_parallel.tp_bytes_per_block(s, b, h, t, element_bytes, False)


@functools.lru_cache(maxsize=1 << 14)
def _ring_attention_bytes(seq: int, kv_heads: int, head_dim: int, cp: int, element_bytes: float):
    """lesson 11's ring_bytes_per_rank, remembered for the search."""
    return context_parallel.ring_bytes_per_rank(seq, kv_heads, head_dim, cp, element_bytes)


def communication(model: Model, cluster: Cluster, run: Run, strategy: Strategy,
                  stage: int) -> dict[str, LinkTraffic]:
    """Bytes one rank of `stage` sends per optimizer step, by dimension (m micro-batches of b
    sequences; B blocks on this stage; r_* the recipe's bytes; Psi this rank's parameters):

    tp  m B x lesson 04's `tp_bytes_per_block(s/cp, b, h, tp, .)`: 4 all-gathers and 4
        reduce-scatters of (s/cp) b h, half of them of the norms' outputs (r_residual) and
        half of the matmuls' (r_compute), the bytes of 4 all-reduces (megatron: + the two
        all-gathers backward repeats, as lesson 04's save_shard); once per step, after the
        last micro-batch, the all-reduce of the gradients every tp rank holds whole: the
        blocks' norms and row-parallel biases (lesson 04's `sp_grad_all_reduce_bytes`, 6 h per
        course block, whatever m), and in nd the tables, the final norm and the head;
        megatron's vocabulary-parallel ends add,
        per micro-batch, the embedding's reduce-scatter and the head's all-gather of (s/cp) b h
        (their backward twins, and the head's gather again), and the loss's three all-reduces
        of (s/cp) b fp32 values;
        under "full" recomputation the forward's four are sent again;
    cp  m B b x lesson 11's `ring_bytes_per_rank(s, kv_heads / tp, h / heads, cp, r_attention)`
        forward and backward (only K and V travel: grouped-query attention cuts it by
        heads / kv_heads; "full" recomputation sends the forward again); when cp is not folded
        into ZeRO's group, an all-reduce of every gradient over cp;
    pp  the activations and gradients of (interleaved) 1F1B, `pipeline_sends` x m messages of
        n b h r_residual;
    dp  ZeRO over its group (lesson 03's `zero_communication_elements`): zero1 a reduce-scatter
        of the gradients (r_grads) and an all-gather of the weights (r_weights) per step; zero2
        a reduce-scatter per micro-batch; zero3 per micro-batch two all-gathers and a
        reduce-scatter; hsdp zero3 inside the node plus an all-reduce of the shard over the
        replicas.
    """
    layout, b, r = strategy.layout, strategy.micro_batch, run.recipe
    s, h, t = model.seq // layout.cp, model.hidden, layout.tp
    m, blocks = microbatches(run, strategy), stage_layers(model, strategy)[stage]
    psi, _ = stage_parameters(model, run, strategy, stage)
    full = strategy.recompute == "full"
    per_block = (_tp_bytes_per_block(s, b, h, t, r.residual) + _tp_bytes_per_block(s, b, h, t, r.compute)) / 2
    if run.engine == "megatron":  # the QKV and MLP inputs gathered again in backward
        per_block += 2 * ring(s * b * h * r.compute, t, "all_gather")
    tp_bytes = m * blocks * per_block * (1.5 if full else 1)  # full: the forward's half again
    # once per step, after the last micro-batch: lesson 04's all-reduce of sequence
    # parallelism's replicated gradients, 6 h per course block (a Llama block's 2 h: scaled)
    tp_bytes += tensor_parallel.sp_grad_all_reduce_bytes(h, t, r.grads,
                                                         blocks) * model.block_replicated() / (6 * h)
    ends = (stage == 0) + (stage == layout.pp - 1)
    if run.engine == "nd":  # and of the tables, the final norm and the head, whole on every tp rank
        replicated = psi - blocks * (model.block_split() // t + model.block_replicated())
    else:
        replicated = model.norm_params() if stage == layout.pp - 1 else 0
        tp_bytes += m * ends * 2 * ring(s * b * h * r.compute, t, "all_reduce")
        tp_bytes += m * (stage == layout.pp - 1) * ring(s * b * h * r.compute, t, "all_gather")
        tp_bytes += m * (stage == layout.pp - 1) * 3 * ring(s * b * 4, t, "all_reduce")
    tp_bytes += ring(replicated * r.grads, t, "all_reduce")
    ring_attention = _ring_attention_bytes(model.seq, model.kv_heads // t, h // model.heads, layout.cp,
                                           r.attention)
    attention, forward = sum(ring_attention), ring_attention.forward
    cp_bytes = m * blocks * b * (attention + (forward if full else 0))
    if not run.fold_cp:
        cp_bytes += ring(psi * r.grads, layout.cp, "all_reduce")
    pp_bytes = pipeline_sends(layout.pp, strategy.chunks, stage) * m * (s // t) * b * h * r.residual
    d, kind = zero_group(run, layout), strategy.zero
    gather, scatter = ring(psi * r.weights, d, "all_gather"), ring(psi * r.grads, d, "reduce_scatter")
    if kind == "zero1":
        dp_bytes = scatter + gather
    elif kind == "zero2":
        dp_bytes = m * scatter + gather
    elif kind == "zero3":
        dp_bytes = m * (2 * gather + scatter)
    else:
        shards = hsdp_shards(cluster, run, layout)
        dp_bytes = m * (2 * ring(psi * r.weights, shards, "all_gather") +
                        ring(psi * r.grads, shards, "reduce_scatter"))
        dp_bytes += ring(psi / shards * r.grads, d // shards, "all_reduce")
    zero_dims = ("dp", "cp") if run.fold_cp else ("dp",)
    sent = {"tp": (tp_bytes, ("tp",)), "cp": (cp_bytes, ("cp",)), "pp": (pp_bytes, ("pp",)),
            "dp": (dp_bytes, zero_dims)}
    out = {}
    for dim, (nbytes, dims) in sent.items():
        link = link_of(cluster, layout, dims)
        if kind == "hsdp" and dim == "dp":
            link = "network"  # the replicas' all-reduce crosses nodes
        bandwidth = cluster.intra_bandwidth if link == "nvlink" else cluster.inter_bandwidth
        out[dim] = LinkTraffic(nbytes, link, nbytes / bandwidth)
    return out


# ============================================================================ 5. compute


def stage_flops(model: Model, run: Run, strategy: Strategy, stage: int) -> float:
    """Training FLOPs one rank of `stage` does per micro-batch: per token 6 x the matmul
    parameters it holds (PaLM's 6N; 2N forward, 4N backward) plus attention's 12 h s per
    block (PaLM's 12 L H Q T, by layer), over its b (s/cp) tokens and split over tp; the head's
    6 V h on the last stage; "full" recomputation one more forward of every block (2N + 4 h s
    per token: Megatron-LM's appendix counts 4 x instead of 3 x). The embedding's lookup is
    not a matmul."""
    layout = strategy.layout
    tokens = strategy.micro_batch * model.seq // layout.cp
    blocks = stage_layers(model, strategy)[stage]
    matmul = model.block_matmul_weights() + (model.block_split() - model.block_matmul_weights()) + \
        model.block_replicated()
    per_token = blocks * (6 * matmul + 12 * model.hidden * model.seq)
    if strategy.recompute == "full":
        per_token += blocks * (2 * matmul + 4 * model.hidden * model.seq)
    if stage == layout.pp - 1:
        per_token += 6 * (model.vocab * model.hidden + model.norm_params())
    return tokens * per_token / layout.tp


def compute_seconds(model: Model, cluster: Cluster, run: Run, strategy: Strategy) -> tuple[float, float]:
    """(step compute seconds, bubble share): the slowest stage's time per micro-batch t =
    max stage_flops / (peak x MFU) sets the pace, (m + (pp - 1) / v) t, of which (pp-1)/v t is
    lesson 05's bubble ((interleaved) 1F1B's closed form). Equal stages: 6 N tokens / (GPUs x
    peak x MFU) / (1 - bubble)."""
    layout = strategy.layout
    m = microbatches(run, strategy)
    slowest = max(stage_flops(model, run, strategy, d) for d in positions(layout.pp))
    per_micro = slowest / (cluster.peak_flops * run.mfu)
    kind = "interleaved" if strategy.chunks > 1 else "1f1b"
    bubble = pipeline.bubble_closed_form(kind, layout.pp, m, strategy.chunks)
    return m * per_micro / (1 - bubble), bubble


# ============================================================================ 6. the ranking


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One strategy's prediction: its worst stage's memory, the slowest stage's traffic, the
    compute time (the bubble in it) and the step time: compute + every collective's time, or
    with `overlap` compute + tp's time + whatever of dp's, pp's and cp's exceeds compute."""

    strategy: Strategy
    microbatches: int
    memory: Memory
    fits: bool
    traffic: dict[str, LinkTraffic]
    compute_s: float
    bubble: float
    overlap: bool = False

    @property
    def layout(self) -> nd.Layout:
        return self.strategy.layout

    @property
    def communication_s(self) -> float:
        return sum(t.seconds for t in self.traffic.values())

    @property
    def step_s(self) -> float:
        if not self.overlap:
            return self.compute_s + self.communication_s
        hidden = sum(t.seconds for dim, t in self.traffic.items() if dim != "tp")
        return self.compute_s + self.traffic["tp"].seconds + max(0.0, hidden - self.compute_s)


def candidate(model: Model, cluster: Cluster, run: Run, strategy: Strategy,
              memories: list[Memory] | None = None) -> Candidate:
    """`strategy` predicted: memory per stage (the worst kept; `memories`: memory_per_stage's
    at `positions`, if at hand), traffic per stage (the slowest kept), compute."""
    usable = cluster.memory_bytes * (1 - run.headroom)
    stages = positions(strategy.layout.pp)
    if memories is None:
        memories = memory_per_stage(model, run, strategy, cluster, stages)
    worst = max(memories, key=lambda mem: mem.peak)
    traffic = max((communication(model, cluster, run, strategy, d) for d in stages),
                  key=lambda t: sum(x.seconds for x in t.values()))
    compute, bubble = compute_seconds(model, cluster, run, strategy)
    return Candidate(strategy, microbatches(run, strategy), worst, worst.peak <= usable, traffic,
                     compute, bubble, run.overlap)


def evaluate(model: Model, cluster: Cluster, run: Run) -> list[Candidate]:
    """Every strategy of every layout, predicted, fastest first (fitting or not)."""
    out = [candidate(model, cluster, run, s) for layout in all_layouts(cluster.gpus)
           for s in strategies(model, cluster, run, layout)]
    return sorted(out, key=lambda c: (c.step_s, c.memory.peak))


def plan(model: Model, cluster: Cluster, run: Run,
         candidates: list[Candidate] | None = None) -> list[Candidate]:
    """Each layout's fastest fitting strategy, best (lowest estimated step time) first.
    Without `candidates`, each layout's strategies are searched cheapest-compute first and
    the search stops where even compute alone is slower than the best found (a step is never
    faster than its compute), so clusters of thousands of GPUs plan in seconds to a minute;
    the result is the same as from `evaluate`'s full list (a test holds them equal)."""
    if candidates is None:
        return _plan_by_bound(model, cluster, run)
    best: dict[nd.Layout, Candidate] = {}
    for c in candidates:
        if c.fits and c.layout not in best:
            best[c.layout] = c
    return sorted(best.values(), key=lambda c: (c.step_s, c.memory.peak))


def _plan_by_bound(model: Model, cluster: Cluster, run: Run) -> list[Candidate]:
    """plan() without the full list: branch and bound on compute_seconds, a lower bound of
    step_s (communication adds time; overlapped, it never takes compute's away). Ties are
    broken as evaluate's stable sort breaks them: by enumeration order."""
    usable = cluster.memory_bytes * (1 - run.headroom)
    best: list[tuple] = []  # (step_s, peak, enumeration index, Candidate), one per layout
    index = 0
    for layout in all_layouts(cluster.gpus):
        found = None
        numbered = []
        for strategy in strategies(model, cluster, run, layout):
            numbered.append((compute_seconds(model, cluster, run, strategy)[0], index, strategy))
            index += 1
        for bound, number, strategy in sorted(numbered, key=lambda item: item[:2]):
            if found is not None and bound > found[0]:
                break
            memories = memory_per_stage(model, run, strategy, cluster, positions(layout.pp))
            if max(mem.peak for mem in memories) > usable:
                continue
            c = candidate(model, cluster, run, strategy, memories)
            key = (c.step_s, c.memory.peak, number)
            if found is None or key < found[:3]:
                found = (*key, c)
        if found is not None:
            best.append(found)
    return [item[3] for item in sorted(best, key=lambda item: item[:3])]


def why_empty(model: Model, cluster: Cluster, run: Run,
              candidates: list[Candidate] | None = None) -> str:
    """Why `plan` is empty (or "" when it is not); `candidates`: evaluate's, if at hand."""
    candidates = evaluate(model, cluster, run) if candidates is None else candidates
    if not candidates:
        reasons = sorted({why_refused(model, cluster, run, Strategy(layout, min(run.micro_batches)))
                          for layout in all_layouts(cluster.gpus)} - {None})
        return f"no layout of {cluster.gpus} GPUs can be built: " + "; ".join(reasons)
    if any(c.fits for c in candidates):
        return ""
    smallest = min(candidates, key=lambda c: c.memory.peak)
    return (f"no layout fits in {cluster.memory_bytes * (1 - run.headroom) / GB:.1f} GB per GPU "
            f"(memory less {run.headroom:.0%} headroom): the smallest predicted peak is "
            f"{smallest.memory.peak / GB:.1f} GB ({strategy_name(smallest.strategy)}, stage "
            f"{smallest.memory.stage})")


def layout_name(layout: nd.Layout) -> str:
    """dp32xtp2: the dimensions above 1 (one GPU: "1")."""
    return "x".join(f"{dim}{getattr(layout, dim)}" for dim in ("dp", "tp", "pp", "cp")
                    if getattr(layout, dim) > 1) or "1"


def strategy_name(strategy: Strategy) -> str:
    """dp8xtp2xpp4 b1 zero1 sel v2 k1: the layout, the micro-batch, ZeRO, recomputation, and
    the chunks and shift when used."""
    short = {"none": "keep", "selective": "sel", "full": "full"}[strategy.recompute]
    extra = (f" v{strategy.chunks}" if strategy.chunks > 1 else "") + \
        (f" k{strategy.shift}" if strategy.shift else "")
    return f"{layout_name(strategy.layout)} b{strategy.micro_batch} {strategy.zero} {short}{extra}"


def format_plan(model: Model, cluster: Cluster, run: Run, top: int = 10,
                candidates: list[Candidate] | None = None) -> str:
    """The plan as text: the inputs, then one row per layout (its best strategy), best first
    (or why none fits); `candidates`: evaluate's, if at hand."""
    r = run.recipe
    lines = [
        f"model: {model.layers} layers, hidden {model.hidden}, {model.heads} heads ({model.kv_heads} "
        f"key/value), {model.mlp} {model.ffn}, vocab {model.vocab}, seq {model.seq}: "
        f"{model.parameters() / 1e9:.2f} B parameters",
        f"cluster: {cluster.gpus} GPUs, {cluster.gpus_per_node} per node, "
        f"{cluster.memory_bytes / GB:.0f} GB each ({run.headroom:.0%} kept free), NVLink "
        f"{cluster.intra_bandwidth / GB:.0f} GB/s, network {cluster.inter_bandwidth / GB:.0f} GB/s "
        f"per GPU, {cluster.peak_flops / 1e12:.0f} TFLOP/s peak",
        f"run: {run.global_batch} sequences x {model.seq} tokens, engine {run.engine}, recipe {r.name} "
        f"(weights {r.weights} grads {r.grads} optimizer {r.optimizer} bytes), MFU {run.mfu:.0%}, "
        f"cp {'in' if run.fold_cp else 'beside'} ZeRO's group",
        "step = slowest stage's compute / (1 - bubble) + communication" +
        (" (dp, pp, cp overlapped with compute)" if run.overlap else " (simplified: nothing overlapped)"),
    ]
    fitting = plan(model, cluster, run, candidates)
    if not fitting:
        return "\n".join(lines + ["", why_empty(model, cluster, run, candidates)])
    buildable = len({c.layout for c in candidates}) if candidates is not None else \
        len(enumerate_layouts(model, cluster, run))
    lines += ["", f"{'#':>3}  {'strategy':<34}{'m':>5}  {'GB/GPU':>7} {'states':>7} {'act':>6}  "
              f"{'tp GB':>8} {'cp GB':>8} {'pp GB':>7} {'dp GB':>7}  {'bubble':>6}  "
              f"{'comm s':>7} {'step s':>7}"]
    for i, c in enumerate(fitting[:top], 1):
        t = c.traffic
        link = {dim: "*" if t[dim].link == "network" and t[dim].bytes else " " for dim in t}
        lines.append(
            f"{i:>3}  {strategy_name(c.strategy):<34}{c.microbatches:>5}  {c.memory.peak / GB:>7.1f} "
            f"{c.memory.states / GB:>7.1f} {(c.memory.activations + c.memory.working) / GB:>6.1f}  "
            + " ".join(f"{t[dim].bytes / GB:>{w}.2f}{link[dim]}" for dim, w in
                       (("tp", 7), ("cp", 7), ("pp", 6), ("dp", 6)))
            + f"  {c.bubble:>6.1%}  {c.communication_s:>7.2f} {c.step_s:>7.2f}")
    lines.append(f"({len(fitting)} of {buildable} buildable layouts fit; "
                 "* = over the network, else NVLink; act = activations + backward's working set)")
    return "\n".join(lines)


# ============================================================================ 7. named models, GPUs, runs

MODELS = {  # named shapes for --plan-model
    "llama3-8b-class": Model(layers=32, hidden=4096, heads=32, vocab=128256, seq=8192),  # our block
    "llama3-8b": Model(32, 4096, 32, 128256, 8192, kv_heads=8, ffn=14336, mlp="swiglu", norm="rmsnorm",
                       bias=False, positions="rope"),
    "llama3-70b": Model(80, 8192, 64, 128256, 8192, kv_heads=8, ffn=28672, mlp="swiglu", norm="rmsnorm",
                        bias=False, positions="rope"),
    "llama3-405b": Model(126, 16384, 128, 128256, 8192, kv_heads=8, ffn=53248, mlp="swiglu",
                         norm="rmsnorm", bias=False, positions="rope"),
    "gpt3-175b": Model(96, 12288, 96, 51200, 2048, tied=True),
    "gpt2-xl": Model(**memory.GPT2_XL, tied=True),
    "tiny": Model.of(nd_model.GPTConfig()),
}
GPUS = {  # per GPU; NVLink one way; the network one way (one NIC per GPU)
    "h100": {"memory_gb": 80.0, "nvlink_gbs": 450.0, "network_gbs": 50.0, "peak_tflops": 989.0},
    "a100": {"memory_gb": 80.0, "nvlink_gbs": 300.0, "network_gbs": 25.0, "peak_tflops": 312.0},
}
H100_80GB = GPUS["h100"]


@dataclasses.dataclass(frozen=True)
class Published:
    """A published training run: the model, the cluster, the global batch in sequences, and
    the layout and choices it used (`used`, words), with where that is written."""

    name: str
    model: str
    gpu: str
    gpus: int
    global_batch: int
    seq: int
    used: nd.Layout
    choices: str
    source: str


PUBLISHED = [
    Published("Llama 3 405B, 8K", "llama3-405b", "h100", 8192, 2048, 8192, nd.Layout(dp=64, tp=8, pp=16),
              "FSDP without resharding after forward, interleaved 1F1B, one layer off the first and "
              "last stages, no activation checkpointing, fp32 gradient reduce-scatter",
              "Llama 3 (arXiv 2407.21783), Table 4 and 3.3.2"),
    Published("Llama 3 405B, 8K, 16K GPUs", "llama3-405b", "h100", 16384, 2048, 8192,
              nd.Layout(dp=128, tp=8, pp=16), "as above", "Llama 3 (arXiv 2407.21783), Table 4"),
    Published("Llama 3 405B, 128K", "llama3-405b", "h100", 16384, 128, 131072,
              nd.Layout(dp=8, tp=8, pp=16, cp=16), "as above, cp 16 (all-gather of K and V)",
              "Llama 3 (arXiv 2407.21783), Table 4 and 3.3.2"),
    Published("GPT-3 175B", "gpt3-175b", "a100", 1536, 1536, 2048, nd.Layout(dp=16, tp=8, pp=12),
              "model-parallel size 96 (tp 8, a node, as 5.4.1 finds best; so pp 12), micro-batch "
              "1, interleaved schedule, activation recomputation, 141 TFLOP/s per GPU",
              "Narayanan et al. (arXiv 2104.04473), Table 2 and 5.1"),
]


def published_check(run: Published) -> tuple[Candidate, int, int]:
    """The planner asked about the layout a published run used (megatron engine, the default
    bf16 recipe and 10% headroom, every choice searched): (its fastest fitting strategy, or
    the one with the smallest peak if none fits; the strategies that fit; those searched)."""
    model = dataclasses.replace(MODELS[run.model], seq=run.seq)
    cluster, plan_run = Cluster.of(run.gpu, run.gpus), Run(run.global_batch)
    searched = [candidate(model, cluster, plan_run, s) for s in strategies(model, cluster, plan_run,
                                                                           run.used)]
    fitting = sorted((c for c in searched if c.fits), key=lambda c: (c.step_s, c.memory.peak))
    best = fitting[0] if fitting else min(searched, key=lambda c: c.memory.peak)
    return best, len(fitting), len(searched)


def plan_published(run: Published) -> tuple[list[Candidate], int | None]:
    """The planner's own ranking at a published run's scale (its model, sequence, cluster
    and global batch; the defaults otherwise): (the ranked layouts, the 1-based rank of the
    layout the run used, None when it does not fit)."""
    model = dataclasses.replace(MODELS[run.model], seq=run.seq)
    ranked = plan(model, Cluster.of(run.gpu, run.gpus), Run(run.global_batch))
    rank = next((i for i, c in enumerate(ranked, 1) if c.layout == run.used), None)
    return ranked, rank


def format_published_plans() -> str:
    """PUBLISHED as a markdown table of what the planner itself picks at each run's scale,
    beside the layout the run used: its rank and predicted step time against the pick's
    (minutes on a CPU: `python -m lessons.13_capstone.planner_checks --published`)."""
    lines = ["| run | planner's pick | step s | GB/GPU | layout used: rank, its best strategy | step s |",
             "|---|---|---|---|---|---|"]
    for run in PUBLISHED:
        ranked, rank = plan_published(run)
        top, used = ranked[0], ranked[rank - 1] if rank else None
        lines.append(f"| {run.name} | {strategy_name(top.strategy)} | {top.step_s:.2f} | "
                     f"{top.memory.peak / GB:.1f} | "
                     + (f"{rank} of {len(ranked)}, {strategy_name(used.strategy)} | {used.step_s:.2f} |"
                        if used else f"does not fit (of {len(ranked)}) | - |"))
    return "\n".join(lines)


def format_published() -> str:
    """PUBLISHED as a markdown table, each run's layout and the planner's verdict on it."""
    lines = ["| run | GPUs | global batch x seq | layout used | fits / searched | planner's best strategy "
             "for it | GB/GPU |", "|---|---|---|---|---|---|---|"]
    for run in PUBLISHED:
        best, fits, searched = published_check(run)
        lines.append(f"| {run.name} | {run.gpus} {run.gpu.upper()} | {run.global_batch} x {run.seq} | "
                     f"{layout_name(run.used)} | {fits} / {searched} | {strategy_name(best.strategy)} | "
                     f"{best.memory.peak / GB:.1f} |")
    return "\n".join(lines)
