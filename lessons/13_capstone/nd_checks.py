"""The proof of nd.py: every layout trains what one process trains.

* `layout_worker`: one rank of a layout: the mesh's groups (for the test that holds them to
  `nd.dimension_groups`), a run of `nd.NDTrainer` on given global batches, checkpoints through
  lesson 06's protocol and a resume from them in this or another layout, and the final state
  as checkpoint shards (joined by `nd_placement.assemble` into the global tensors);
* `random_batches`: the proof's data, the same global batches for every layout;
* `compare_layouts`: run layouts and report each one's largest difference from
  `nd_model.train_one_process` (the tests and the notebook call it);
* `CorpusNDTrainer`: the N-D trainer behind the capstone's run on the shipped corpus
  (`--dp --tp --pp --cp`), with the interface of main.py's GPTTrainer.
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


def dcp_state(trainer: nd.NDTrainer) -> dict:
    """The same state as shard_state(), for torch.distributed.checkpoint: every parameter and
    AdamW moment of this rank as a DTensor on the mesh's (dp, cp, tp) ranks of its stage,
    replicated over dp and cp, Shard(dim) over tp (fused QKV as its q, k and v parts, each a
    plain Shard(0)). ZeRO-1's dp slices of the moments are all-gathered first: DCP's DTensor
    has no placement for "a flat slice of a tp piece"."""
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
                dist.all_gather_single(rows.view(-1), mine, group=trainer.groups["dp"])
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


def layout_worker(ctx: RankContext, config: dict, layout: dict, batches: list[torch.Tensor],
                  ckpt_dir: str | None = None, save_every: int = 0, resume: bool = False,
                  dcp_dir: str | None = None, dcp_save: bool = False, bf16: bool = False) -> dict:
    """One rank: build the mesh and an NDTrainer (float64 on CPU), resume from `ckpt_dir`'s
    latest checkpoint if asked (any layout's: lesson 06's verified load, then load_shards),
    train until step len(batches) saving every `save_every` steps, and return plain data:
    {"coords", "groups": {dim: ranks of this rank's group}, "history": [(loss, norm)] of the
    steps it ran, "resumed_from", "state": shard_state() at the end, serialised}. With
    `dcp_dir`: at the end, save the same state with torch.distributed.checkpoint there
    (`dcp_save`) or load it and compare with ours ("dcp"). `bf16`: forwards under bf16 autocast
    (the GPU run's precision, here on the CPU)."""
    config, layout = nd_model.GPTConfig(**config), nd.Layout(**layout)
    mesh = nd.build_mesh(layout, ctx.device.type)
    dtype = torch.float64 if ctx.device.type == "cpu" and not bf16 else torch.float32
    trainer = nd.NDTrainer(config, layout, mesh, ctx.device, dtype, bf16=bf16)
    resumed_from = capstone.resume(trainer, Path(ckpt_dir), reshard=True) if resume else None
    checkpointer = (checkpointing.Checkpointer(Path(ckpt_dir), keep=4, save_every=save_every)
                    if ckpt_dir and save_every else None)
    history = []
    while trainer.step < len(batches):
        history.append(trainer.train_step(batches[trainer.step]))
        if checkpointer is not None:
            checkpointer.maybe_save(trainer)
    dcp_result = None
    if dcp_dir and dcp_save:
        import torch.distributed.checkpoint as dcp
        dcp.save(dcp_state(trainer), checkpoint_id=dcp_dir)
    elif dcp_dir:
        dcp_result = dcp_matches_ours(trainer, dcp_dir)
    return {"coords": trainer.coords, "resumed_from": resumed_from, "history": history, "dcp": dcp_result,
            "groups": {dim: dist.get_process_group_ranks(trainer.groups[dim]) for dim in nd.DIMS},
            "state": checkpointing.serialize(trainer.shard_state())}


def run_layout(config: nd_model.GPTConfig, layout: nd.Layout, batches: list[torch.Tensor],
               device: str = "cpu", ckpt_dir: Path | None = None, save_every: int = 0,
               resume: bool = False, dcp_dir: Path | None = None, dcp_save: bool = False,
               bf16: bool = False, timeout_s: float = 120.0) -> list[dict]:
    """`layout_worker` on layout.world ranks; its results in rank order, states loaded."""
    results = launch(layout_worker, layout.world,
                     (dataclasses.asdict(config), dataclasses.asdict(layout), batches,
                      None if ckpt_dir is None else str(ckpt_dir), save_every, resume,
                      None if dcp_dir is None else str(dcp_dir), dcp_save, bf16),
                     device=device, timeout_s=timeout_s)
    for result in results:
        result["state"] = torch.load(io.BytesIO(result["state"]), weights_only=True)
    return results


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
                    device: str = "cpu") -> list[dict]:
    """Each layout against one process: [{"layout", "loss", "norm", "params"}] (max |diff|)."""
    config = config or nd_model.GPTConfig(steps=steps)
    batches = random_batches(config, steps)
    reference, model = nd_model.train_one_process(config, batches)
    return [{"layout": str(layout), **largest_differences(run_layout(config, layout, batches, device),
                                                            reference, model)}
            for layout in layouts]


class CorpusNDTrainer(nd.NDTrainer):
    """NDTrainer with GPTTrainer's interface, for main.py's `train` and the CLI: train_step
    takes the corpus and returns the loss; evaluate and `dense_model` join every rank's shards
    into the one-process model (a collective)."""

    def __init__(self, run: capstone.GPTRunConfig, layout: nd.Layout, device: torch.device, vocab: int):
        config = nd_model.GPTConfig(vocab=vocab, hidden=run.hidden, heads=run.heads, layers=run.layers,
                              seq=run.seq, global_batch=run.global_batch, microbatches=run.accum,
                              steps=run.steps, lr=run.lr, warmup=run.warmup, clip=run.clip,
                              weight_decay=run.weight_decay, seed=run.seed)
        super().__init__(config, layout, nd.build_mesh(layout, device.type), device)

    def train_step(self, data: torch.Tensor) -> float:
        windows = capstone.global_windows(data, self.config.seed, self.step, self.config.global_batch,
                                          self.config.seq)
        return super().train_step(windows)[0]

    def dense_model(self) -> nd_model.GPT:
        """The one-process model holding every rank's current weights (all ranks call it)."""
        states: list = [None] * self.world
        dist.all_gather_object(states, self.shard_state())
        model = nd_model.build_gpt(self.config).to(self.device)
        return nd_model.load_global_state(model, nd_placement.assemble(states)["params"])

    @torch.no_grad()
    def evaluate(self, data: torch.Tensor, windows: int = 64) -> float:
        """GPTTrainer.evaluate's loss (the same 64 held-out windows) of `dense_model()`."""
        model = self.dense_model()
        batch = capstone.held_out_windows(data, windows, self.config.seq).to(self.device)
        logits = model(batch[:, :-1])
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       batch[:, 1:].reshape(-1)))
