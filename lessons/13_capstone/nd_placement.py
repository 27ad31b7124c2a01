"""The capstone in N dimensions: where each piece of a global tensor lives.

A tp rank holds a replicated tensor whole, or a piece of it along one dimension; the fused QKV
weight holds piece r of each of Q, K and V side by side. `Placement` says which, `cut` takes a
rank's piece of a global tensor and `join` puts the pieces back together (an exercise);
`BLOCK_PLACEMENTS` lists how each parameter of nd.ParallelBlock is split. A checkpoint
(`checkpoint_state`) saves each rank's ZeRO slice (over dp x cp) of its piece with its
placement; `assemble` joins any layout's slices into the global tensors, refusing a missing or
overlapping slice, and `load_checkpoint_state` cuts this layout's pieces and ZeRO slices from
them.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import torch

checkpointing = importlib.import_module("lessons.06_checkpointing.main")  # CheckpointError

@dataclasses.dataclass
class Placement:
    """Where a rank's tensor sits in the global one: replicated (dim None), or rank r of the
    tp ranks holds, along `dim`, piece r of each of `parts` equal parts (fused QKV: 3)."""

    name: str
    shape: tuple[int, ...]
    dim: int | None = None
    parts: int = 1


# exercise placements (3 points): A tp rank's piece of a global tensor, and back
# hint: fused QKV is 3 parts: rank r holds piece r of EACH part, side by side.
def cut(full: torch.Tensor, placement: Placement, rank: int, size: int) -> torch.Tensor:
    """The piece of the global tensor `full` that tp rank `rank` of `size` holds: along
    placement.dim, piece `rank` of `size` equal pieces of each of the `parts` equal parts,
    side by side (a copy); the whole tensor when replicated (dim None). A dimension that does
    not split into parts x size equal pieces: ValueError naming the tensor (tp splits whole
    heads and columns; lesson 04's layers refuse the rest)."""
    if placement.dim is None:
        return full.clone()
    if full.shape[placement.dim] % (placement.parts * size):
        raise ValueError(f"{placement.name}: dim {placement.dim} of {tuple(full.shape)} does not "
                         f"split into {placement.parts} x {size} equal pieces")
    return torch.cat([part.chunk(size, placement.dim)[rank]
                      for part in full.chunk(placement.parts, placement.dim)], placement.dim)


# exercise placements (continued)
def join(pieces: list[torch.Tensor], placement: Placement) -> torch.Tensor:
    """`cut`'s inverse: the global tensor from every tp rank's piece, in tp-rank order (a new
    tensor; a replicated one is pieces[0]'s copy)."""
    if placement.dim is None:
        return pieces[0].clone()
    split = [piece.chunk(placement.parts, placement.dim) for piece in pieces]
    return torch.cat([torch.cat([s[j] for s in split], placement.dim)
                      for j in range(placement.parts)], placement.dim)


BLOCK_PLACEMENTS = {  # local name in a ParallelBlock -> (global suffix, dim, parts)
    "ln1.weight": ("ln1.weight", None, 1), "ln1.bias": ("ln1.bias", None, 1),
    "ln2.weight": ("ln2.weight", None, 1), "ln2.bias": ("ln2.bias", None, 1),
    "qkv.weight": ("qkv.weight", 0, 3), "qkv.bias": ("qkv.bias", 0, 3),  # column-parallel
    "o.weight": ("o.weight", 1, 1), "o.bias": ("o.bias", None, 1),  # row-parallel
    "up.weight": ("up.weight", 0, 1), "up.bias": ("up.bias", 0, 1),
    "down.weight": ("down.weight", 1, 1), "down.bias": ("down.bias", None, 1),
}


def assemble(shards: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Every saved rank's shard_state() -> {"params" | "exp_avg" | "exp_avg_sq": {name: the
    global tensor}}: per tp rank, the ZeRO slices in order must tile its piece exactly, then
    `join` puts the tp pieces together. A missing or overlapping slice: CheckpointError
    naming the tensor and the tp rank."""
    found: dict[str, dict[int, list]] = {}
    meta: dict[str, tuple] = {}
    for shard in shards:
        for name, entry in shard["tensors"].items():
            meta[name] = entry["placement"], entry["tp"][1]
            found.setdefault(name, {}).setdefault(entry["tp"][0], []).append(entry)
    out: dict[str, dict[str, torch.Tensor]] = {"params": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, by_tp in found.items():
        (shape, dim, parts), tp = meta[name]
        placement = Placement(name, tuple(shape), dim, parts)
        local_numel = math.prod(shape) // (tp if dim is not None else 1)
        local_shape = [s // tp if d == dim else s for d, s in enumerate(shape)]
        for key in out:
            pieces = []
            for tp_rank in range(tp if dim is not None else 1):
                entries = sorted(by_tp.get(tp_rank, []), key=lambda e: e["flat"][0])
                covered = 0
                for entry in entries:
                    if entry["flat"][0] != covered:
                        raise checkpointing.CheckpointError(
                            f"{name}: tp rank {tp_rank}'s elements from {covered} are missing "
                            f"or overlap (a slice starts at {entry['flat'][0]})")
                    covered = entry["flat"][1]
                if covered != local_numel:
                    raise checkpointing.CheckpointError(
                        f"{name}: tp rank {tp_rank}'s slices cover {covered} of {local_numel} "
                        "elements")
                if key != "params" and any(key not in e for e in entries):
                    break
                pieces.append(torch.cat([e[key] for e in entries]).view(local_shape))
            else:
                out[key][name] = join(pieces, placement)
    return out


def checkpoint_state(trainer) -> dict:
    """nd.NDTrainer `trainer`'s part of a checkpoint: for every tensor it holds a piece of
    (replicated ones on tp rank 0 only), its ZeRO shard (over dp x cp) of the parameter and of
    AdamW's moments, with where the shard sits: {"tensors": {name: {"placement": [shape, dim,
    parts], "tp": [tp rank, tp size], "flat": [start, end], "params", "exp_avg",
    "exp_avg_sq": 1-D CPU tensors}}, "step", "adam_step", "scheduler", "lr", "layout",
    "world_size", "fingerprint"}."""
    tensors = {}
    for shard, (start, end), (_, placement) in zip(trainer.zero.shards, trainer.zero.bounds,
                                                   trainer.stage.placements):
        if placement.dim is None and trainer.coords["tp"]:
            continue
        state = trainer.zero.optimizer.state.get(shard, {})
        tensors[placement.name] = {
            "placement": [list(placement.shape), placement.dim, placement.parts],
            "tp": [trainer.coords["tp"], trainer.layout.tp], "flat": [start, end],
            **{key: t.detach().cpu().clone() for key, t in
               (("params", shard), ("exp_avg", state.get("exp_avg")),
                ("exp_avg_sq", state.get("exp_avg_sq"))) if t is not None}}
    adam_step = next((s["step"].item() for s in trainer.zero.optimizer.state.values()), 0)
    return {"step": trainer.step, "rank": trainer.rank, "world_size": trainer.world,
            "layout": dataclasses.asdict(trainer.layout), "fingerprint": trainer.config.fingerprint(),
            "tensors": tensors, "adam_step": adam_step,
            "scheduler": trainer.scheduler.state_dict(),
            "lr": [group["lr"] for group in trainer.zero.optimizer.param_groups]}

def load_checkpoint_state(trainer, shards: list[dict]) -> None:
    """Continue from any layout's shards: each global tensor is joined from the saved
    pieces (`assemble`), then this rank cuts its own piece and ZeRO shard from it."""
    full = assemble(shards)
    for _, placement in trainer.stage.placements:
        saved = full["params"].get(placement.name)
        if saved is None or tuple(saved.shape) != placement.shape:
            raise checkpointing.CheckpointError(
                f"{placement.name}: the checkpoint holds "
                f"{'no such tensor' if saved is None else tuple(saved.shape)}, this model "
                f"needs {placement.shape}: not a checkpoint of this model")
    for shard, (start, end), (param, placement) in zip(trainer.zero.shards, trainer.zero.bounds,
                                                        trainer.stage.placements):
        pieces = {key: cut(full[key][placement.name], placement, trainer.coords["tp"],
                           trainer.layout.tp).to(param.device)
                  for key in ("params", "exp_avg", "exp_avg_sq") if placement.name in full[key]}
        with torch.no_grad():
            param.copy_(pieces.pop("params"))
        if pieces:
            trainer.zero.optimizer.state[shard] = {
                "step": torch.tensor(float(shards[0]["adam_step"]), dtype=torch.float32),
                **{key: t.reshape(-1)[start:end].clone() for key, t in pieces.items()}}
    trainer.step = shards[0]["step"]
    trainer.scheduler.load_state_dict(shards[0]["scheduler"])
    for group, lr in zip(trainer.zero.optimizer.param_groups, shards[0]["lr"]):
        group["lr"] = lr
