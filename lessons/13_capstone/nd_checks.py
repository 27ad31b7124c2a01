"""The proof of nd.py: every layout trains what one process trains.

* `layout_worker`: one rank of one launch, which trains several runs of the same world size
  one after the other (`train_layout`): the mesh's groups (for the test that holds them to
  `nd.dimension_groups`), a run of `nd.NDTrainer` on given global batches, checkpoints through
  lesson 06's protocol and a resume from them in this or another layout, and the final state
  as checkpoint shards (joined by `nd_placement.assemble` into the global tensors);
* the proof's data, the same global batches for every layout: `random_batches` (every
  position a target), `padded_batches` (rows of other lengths, padding ignored) and
  `packed_batches` (documents packed into rows, each document's last target ignored);
* `run_layouts` (one launch per world size) and `compare_layouts`: each layout's largest
  difference from `nd_model.train_one_process` (the tests and the notebook call them);
* `CorpusNDTrainer`: the N-D trainer behind the capstone's run on the shipped corpus
  (`--dp --tp --pp --cp`), with the interface of main.py's GPTTrainer; `one_process_gap`, the
  demo's check of that run against one process.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
from pathlib import Path

import torch
import torch.distributed as dist

from lessons._launch import RankContext, launch

from . import nd, nd_model, nd_placement

capstone = importlib.import_module("lessons.13_capstone.main")  # resume()
checkpointing = importlib.import_module("lessons.06_checkpointing.main")  # Checkpointer


def random_batches(config: nd_model.GPTConfig, steps: int, seed: int = 7) -> list[torch.Tensor]:
    """`steps` global batches (global_batch, seq + 1) of random tokens, the same everywhere."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, config.vocab, (config.global_batch, config.seq + 1), generator=generator)
            for _ in range(steps)]


def padded_batches(config: nd_model.GPTConfig, steps: int, seed: int = 7, pad: int = 0
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches (tokens, targets), each (global_batch, seq): row i holds a
    document of L_i + 1 random tokens, L_i drawn from 0..seq (the first row of every batch is
    empty, the second full), then `pad` tokens whose targets are nd_model.IGNORE_INDEX. The
    dp replicas, micro-batches and cp/tp pieces of a layout then hold different numbers of
    real targets, some none: a mean of their means is not the batch's mean."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        windows = torch.randint(0, config.vocab, (config.global_batch, config.seq + 1), generator=generator)
        lengths = torch.randint(0, config.seq + 1, (config.global_batch,), generator=generator)
        lengths[0], lengths[1] = 0, config.seq
        real = torch.arange(config.seq) < lengths[:, None]
        tokens = torch.where(real, windows[:, :-1], pad)
        targets = torch.where(real, windows[:, 1:], nd_model.IGNORE_INDEX)
        batches.append((tokens, targets))
    return batches


def packed_batches(config: nd_model.GPTConfig, steps: int, seed: int = 7
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches (tokens, targets), each (global_batch, seq), of documents packed
    end to end (lengths drawn from 1..seq // 2, the last one cut at the row's end): every
    position holds a real token, but a document's last token predicts nothing (its target is
    nd_model.IGNORE_INDEX: the next token opens another document). Attention still runs
    causally across the documents of a row, in one process as in every layout."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        windows = torch.randint(0, config.vocab, (config.global_batch, config.seq + 1), generator=generator)
        targets = windows[:, 1:].clone()
        for row in targets:
            end = 0
            while True:
                end += int(torch.randint(1, max(2, config.seq // 2 + 1), (1,), generator=generator))
                if end > config.seq:
                    break
                row[end - 1] = nd_model.IGNORE_INDEX  # the document's last token
        batches.append((windows[:, :-1], targets))
    return batches


def dcp_state(trainer: nd.NDTrainer) -> dict:
    """The same state as shard_state(), for torch.distributed.checkpoint: every parameter and
    AdamW moment of this rank as a DTensor on the mesh's (dp, cp, tp) ranks of its stage,
    replicated over dp and cp, Shard(dim) over tp (fused QKV as its q, k and v parts, each a
    plain Shard(0)). ZeRO-1's dp x cp slices of the moments are all-gathered first: DCP's
    DTensor has no placement for "a flat slice of a tp piece"."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    submesh = trainer.mesh["dp", "cp", "tp"]
    state = {}
    for shard, (param, placement) in zip(trainer.zero.shards, trainer.stage.placements):
        moments = trainer.zero.optimizer.state.get(shard, {})
        tensors = {"params": param.detach()}
        for key in ("exp_avg", "exp_avg_sq"):
            if key in moments:
                rows, bounds = trainer.zero.padded(torch.zeros(param.numel(), dtype=param.dtype,
                                                               device=param.device))
                mine = rows.new_zeros(rows.shape[1])
                mine[:shard.numel()] = moments[key]
                dist.all_gather_single(rows.view(-1), mine, group=trainer.zero.group)
                tensors[key] = torch.cat([row[:end - start] for row, (start, end)
                                          in zip(rows, bounds)]).view_as(param)
        tp_place = Replicate() if placement.dim is None else Shard(placement.dim)
        for key, local in tensors.items():
            for part, piece in enumerate(local.chunk(placement.parts, placement.dim or 0)):
                name = f"{key}/{placement.name}" + (f"/{'qkv'[part]}" if placement.parts > 1 else "")
                state[name] = DTensor.from_local(piece.contiguous(), submesh,
                                                 [Replicate(), Replicate(), tp_place], run_check=False)
    return state


def dcp_matches_ours(trainer: nd.NDTrainer, dcp_dir: str) -> dict:
    """Load `dcp_dir` (saved by dcp_state in any layout) into this layout's DTensors and compare
    with what load_shards put in the trainer: {"tensors": compared, "max_abs_diff"}."""
    import torch.distributed.checkpoint as dcp

    ours = dcp_state(trainer)
    loaded = {name: torch.distributed.tensor.DTensor.from_local(
        torch.zeros_like(t.to_local()), t.device_mesh, t.placements, run_check=False)
        for name, t in ours.items()}
    dcp.load(loaded, checkpoint_id=dcp_dir)
    worst = max((loaded[n].to_local() - ours[n].to_local()).abs().max().item() for n in ours)
    return {"tensors": len(ours), "max_abs_diff": worst}


@dataclasses.dataclass
class LayoutRun:
    """One run of a layout, as `train_layout` trains it: `batches` (one global batch per step,
    nd_model.inputs_and_targets) from step 0 or from `ckpt_dir`'s latest checkpoint (`resume`,
    any layout's), saving every `save_every` steps into `ckpt_dir`; with `dcp_dir`, the end
    saved with torch.distributed.checkpoint there (`dcp_save`) or loaded and compared with
    ours; `bf16`: forwards under bf16 autocast (the GPU run's precision, on the CPU here)."""

    config: nd_model.GPTConfig
    layout: nd.Layout
    batches: list
    ckpt_dir: str | None = None
    save_every: int = 0
    resume: bool = False
    dcp_dir: str | None = None
    dcp_save: bool = False
    bf16: bool = False


def train_layout(ctx: RankContext, run: LayoutRun) -> dict:
    """One rank of one run: build the mesh and an NDTrainer (float64 on CPU; float32 weights
    with `bf16`), resume if asked (lesson 06's verified load, then load_shards), train until
    step len(run.batches) saving as asked, and return plain data: {"coords", "groups": {dim:
    ranks of this rank's group, "dp_cp" too}, "history": [(loss, norm)] of the steps it ran,
    "resumed_from", "dcp", "state": shard_state() at the end, serialised}."""
    config, layout = run.config, run.layout
    mesh = nd.build_mesh(layout, ctx.device.type)
    dtype = torch.float64 if ctx.device.type == "cpu" and not run.bf16 else torch.float32
    trainer = nd.NDTrainer(config, layout, mesh, ctx.device, dtype, bf16=run.bf16)
    ckpt_dir = None if run.ckpt_dir is None else Path(run.ckpt_dir)
    resumed_from = capstone.resume(trainer, ckpt_dir, reshard=True) if run.resume else None
    checkpointer = (checkpointing.Checkpointer(ckpt_dir, keep=4, save_every=run.save_every)
                    if ckpt_dir and run.save_every else None)
    history = []
    while trainer.step < len(run.batches):
        history.append(trainer.train_step(run.batches[trainer.step]))
        if checkpointer is not None:
            checkpointer.maybe_save(trainer)
    dcp_result = None
    if run.dcp_dir and run.dcp_save:
        import torch.distributed.checkpoint as dcp
        dcp.save(dcp_state(trainer), checkpoint_id=run.dcp_dir)
    elif run.dcp_dir:
        dcp_result = dcp_matches_ours(trainer, run.dcp_dir)
    return {"coords": trainer.coords, "resumed_from": resumed_from, "history": history, "dcp": dcp_result,
            "groups": {dim: dist.get_process_group_ranks(group) for dim, group in trainer.groups.items()},
            "state": checkpointing.serialize(trainer.shard_state())}


def layout_worker(ctx: RankContext, runs: list[LayoutRun]) -> list[dict]:
    """One rank of one launch: `train_layout` for each run in turn (all of this world size)."""
    return [train_layout(ctx, run) for run in runs]


def run_layouts(runs: list[LayoutRun], device: str = "cpu", timeout_s: float = 120.0) -> list[list[dict]]:
    """Every run's results (one dict per rank, in rank order, states loaded), in the order of
    `runs`: one launch per world size, its runs one after the other on the same ranks."""
    out: list[list[dict] | None] = [None] * len(runs)
    for world in dict.fromkeys(run.layout.world for run in runs):
        chosen = [i for i, run in enumerate(runs) if run.layout.world == world]
        per_rank = launch(layout_worker, world, ([runs[i] for i in chosen],), device=device,
                          timeout_s=timeout_s * len(chosen))
        for slot, i in enumerate(chosen):
            out[i] = [rank_results[slot] for rank_results in per_rank]
            for result in out[i]:
                result["state"] = torch.load(io.BytesIO(result["state"]), weights_only=True)
    return out


def run_layout(config: nd_model.GPTConfig, layout: nd.Layout, batches: list, device: str = "cpu",
               ckpt_dir: Path | None = None, save_every: int = 0, resume: bool = False,
               dcp_dir: Path | None = None, dcp_save: bool = False, bf16: bool = False,
               timeout_s: float = 120.0) -> list[dict]:
    """One run (`LayoutRun`) in a launch of its own: its results in rank order."""
    return run_layouts([LayoutRun(config, layout, batches, None if ckpt_dir is None else str(ckpt_dir),
                                  save_every, resume, None if dcp_dir is None else str(dcp_dir),
                                  dcp_save, bf16)], device, timeout_s)[0]


# The proof's configs: sizes no degree divides (hidden 20: ZeRO shards of 7, 7, 6 on 3 ranks and
# 4, 4, 3, 3, 3, 3 on 6; vocabulary 37), 12 positions (cp3: 2 zig-zag chunks of 2 per rank), 12
# sequences; PIPE has 3 layers for pp3 (a middle stage) and 4 micro-batches (m != pp); HEADS 3
# heads of 7 for tp3 (tp splits whole heads).
DATA = nd_model.GPTConfig(vocab=37, hidden=20, heads=4, layers=2, seq=12, global_batch=12,
                          microbatches=2, steps=4)
PIPE = dataclasses.replace(DATA, layers=3, microbatches=4)
HEADS = dataclasses.replace(DATA, hidden=21, heads=3)
# name -> (layout, config, batches): a degree of 3 in each dimension, then two compositions of 6
PROOF = {"dp3": (nd.Layout(dp=3), DATA, "padded"), "cp3": (nd.Layout(cp=3), DATA, "packed"),
         "pp3": (nd.Layout(pp=3), PIPE, "padded"), "tp3": (nd.Layout(tp=3), HEADS, "packed"),
         "tp2xpp3": (nd.Layout(tp=2, pp=3), PIPE, "packed"),
         "dp3xcp2": (nd.Layout(dp=3, cp=2), DATA, "padded")}


def make_batches(config: nd_model.GPTConfig, kind: str, steps: int | None = None) -> list:
    """`steps` (default config.steps) global batches of `kind`: "random", "padded", "packed"."""
    return globals()[f"{kind}_batches"](config, steps or config.steps)


def proof_table(names: list[str] | None = None, device: str = "cpu") -> list[dict]:
    """PROOF's layouts (or `names` of them) against one process each, one launch per world
    size: [{"layout", "batches", "loss", "norm", "params"}] (max |diff|)."""
    names = names or list(PROOF)
    runs = [LayoutRun(PROOF[n][1], PROOF[n][0], make_batches(PROOF[n][1], PROOF[n][2])) for n in names]
    rows = []
    for name, run, results in zip(names, runs, run_layouts(runs, device)):
        reference, model = nd_model.train_one_process(run.config, run.batches)
        rows.append({"layout": str(run.layout), "batches": PROOF[name][2],
                     **largest_differences(results, reference, model)})
    return rows


def largest_differences(results: list[dict], reference: list[tuple[float, float]],
                        model: nd_model.GPT) -> dict[str, float]:
    """Max |difference| from the one-process run over every rank and step: of the loss, of the
    gradient norm, and of every final parameter (the shards joined into global tensors)."""
    offset = len(reference) - len(results[0]["history"])
    pairs = [(mine, reference[offset + i]) for r in results for i, mine in enumerate(r["history"])]
    loss = max(abs(mine[0] - theirs[0]) for mine, theirs in pairs)
    norm = max(abs(mine[1] - theirs[1]) for mine, theirs in pairs)
    params = nd_placement.assemble([r["state"] for r in results])["params"]
    expected = nd_model.global_state(model)
    if set(params) != set(expected):
        raise AssertionError(f"the shards hold {sorted(set(params) ^ set(expected))[:3]} differently")
    weights = max((params[name] - expected[name]).abs().max().item() for name in expected)
    return {"loss": loss, "norm": norm, "params": weights}


def compare_layouts(layouts: list[nd.Layout], config: nd_model.GPTConfig | None = None, steps: int = 4,
                    device: str = "cpu", batches: list | None = None) -> list[dict]:
    """Each layout against one process on the same `batches` (default: `steps` random_batches):
    [{"layout", "loss", "norm", "params"}] (max |diff|); one launch per world size."""
    config = config or nd_model.GPTConfig(steps=steps)
    batches = batches if batches is not None else random_batches(config, steps)
    reference, model = nd_model.train_one_process(config, batches)
    results = run_layouts([LayoutRun(config, layout, batches) for layout in layouts], device)
    return [{"layout": str(layout), **largest_differences(result, reference, model)}
            for layout, result in zip(layouts, results)]


class CorpusNDTrainer(nd.NDTrainer):
    """NDTrainer with GPTTrainer's interface, for main.py's `train` and the CLI: train_step
    takes the corpus and returns the loss (`history` keeps (step, loss, norm) of every step
    this process ran); evaluate and `dense_model` join every rank's shards into the
    one-process model (a collective). float64 on CPU (so that the demo's one-process check
    is exact to rounding), fp32 weights under bf16 autocast on GPUs."""

    def __init__(self, run: capstone.GPTRunConfig, layout: nd.Layout, device: torch.device, vocab: int):
        config = nd_model.GPTConfig(vocab=vocab, hidden=run.hidden, heads=run.heads, layers=run.layers,
                                    seq=run.seq, global_batch=run.global_batch, microbatches=run.accum,
                                    steps=run.steps, lr=run.lr, warmup=run.warmup, clip=run.clip,
                                    weight_decay=run.weight_decay, seed=run.seed)
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        super().__init__(config, layout, nd.build_mesh(layout, device.type), device, dtype)
        self.history: list[tuple[int, float, float]] = []

    def batch(self, data: torch.Tensor, step: int) -> torch.Tensor:
        """Step `step`'s global batch (windows): main.py's global_windows."""
        return capstone.global_windows(data, self.config.seed, step, self.config.global_batch,
                                       self.config.seq)

    def train_step(self, data: torch.Tensor) -> float:
        step = self.step
        loss, norm = super().train_step(self.batch(data, step))
        self.history.append((step, loss, norm))
        return loss

    def dense_model(self) -> nd_model.GPT:
        """The one-process model holding every rank's current weights (all ranks call it)."""
        states: list = [None] * self.world
        dist.all_gather_object(states, self.shard_state())
        model = nd_model.build_gpt(self.config, self.stage.dtype).to(self.device)
        return nd_model.load_global_state(model, nd_placement.assemble(states)["params"])

    @torch.no_grad()
    def evaluate(self, data: torch.Tensor, windows: int = 64) -> float:
        """GPTTrainer.evaluate's loss (the same 64 held-out windows) of `dense_model()`."""
        model = self.dense_model()
        batch = capstone.held_out_windows(data, windows, self.config.seq).to(self.device)
        logits = model(batch[:, :-1])
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       batch[:, 1:].reshape(-1)))


# The demo's tolerances against one process. float64 (CPU): both runs do the same arithmetic in
# another summation order, a few ulps per operation; AdamW divides each gradient by its own
# running RMS and so magnifies the rounding of the small ones step after step: measured on
# the default run (80 steps, lr 1e-2) below 1e-11 in the losses and norms and below 1e-9 in the
# weights; a wrong composition moves the first step's loss or norm by 1e-4 or more. bf16
# autocast (GPUs): two runs that round differently drift apart as training amplifies the
# difference, so only the first step, taken from the same weights, is held to bf16's
# rounding: |loss - one process| <= 4 x 2^-9 x loss (a few roundings of 8 significant bits,
# each 2^-9 relative); the whole run's differences are reported, not checked.
DEMO_TOLERANCE = {"float64": {"loss": 1e-9, "norm": 1e-9, "params": 1e-7},
                  "bf16": {"first_loss_relative": 4 * 2.0 ** -9}}


def one_process_gap(trainer: CorpusNDTrainer, model: nd_model.GPT, data: torch.Tensor) -> dict:
    """The demo's check: the same model trained by one process on the same global batches
    (nd_model.train_one_process, this rank's device, the trainer's precision), against the
    steps this trainer ran (`history`) and its final weights (`model`, its dense_model()).
    Returns {"loss", "norm", "params": max |difference|, "steps", "precision", "passed"
    (None: nothing this run can hold, a bf16 run resumed after step 1), "detail"}, and in
    bf16 "first_loss_relative" (step 1's, None when it did not run here)."""
    batches = [trainer.batch(data, step) for step in range(trainer.step)]
    bf16 = trainer.stage.bf16
    reference, dense = nd_model.train_one_process(trainer.config, batches, trainer.stage.dtype, bf16,
                                                  trainer.device)
    pairs = [((loss, norm), reference[step]) for step, loss, norm in trainer.history]
    gap = {"loss": max((abs(a[0] - b[0]) for a, b in pairs), default=0.0),
           "norm": max((abs(a[1] - b[1]) for a, b in pairs), default=0.0),
           "params": max((a - b).abs().max().item() for a, b in
                         zip(nd_model.global_state(model).values(), nd_model.global_state(dense).values())),
           "steps": len(pairs), "precision": "bf16" if bf16 else str(trainer.stage.dtype).split(".")[-1]}
    if bf16:  # the first step from the same weights only: a resumed run starts from drifted ones
        first = [abs(a[0] - b[0]) / abs(b[0]) for (a, b), (step, _, _) in zip(pairs, trainer.history)
                 if step == 0]
        limit = DEMO_TOLERANCE["bf16"]["first_loss_relative"]
        gap["first_loss_relative"] = first[0] if first else None
        gap["passed"] = first[0] <= limit if first else None
        gap["detail"] = ((f"bf16: step 1's loss {first[0]:.1e} relative (<= {limit:.1e}); " if first else
                          "bf16, resumed (step 1 not run here): ")
                         + f"over {gap['steps']} steps max |loss diff| {gap['loss']:.1e}, "
                           f"weights {gap['params']:.1e}")
    else:
        limits = DEMO_TOLERANCE.get(gap["precision"])
        if limits is None:
            raise ValueError(f"no tolerance for {trainer.stage.dtype} without bf16 autocast")
        gap["passed"] = all(gap[key] <= limit for key, limit in limits.items())
        gap["detail"] = (f"{gap['precision']}, {gap['steps']} steps: max |diff| loss {gap['loss']:.1e}, "
                         f"norm {gap['norm']:.1e}, weights {gap['params']:.1e} (tolerances "
                         + ", ".join(f"{limit:.0e}" for limit in limits.values()) + ")")
    return gap


if __name__ == "__main__":  # the README's table of the proof: python -m lessons.13_capstone.nd_checks
    print("| layout | batches | loss | gradient norm | final weights |\n|---|---|---|---|---|")
    for row in proof_table():
        print(f"| {row['layout']} | {row['batches']} | {row['loss']:.1e} | {row['norm']:.1e} | "
              f"{row['params']:.1e} |")
