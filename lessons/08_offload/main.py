"""Lesson 08: offloading with chunks, and a cost model that plans what stays on the device.

The technique in two files, in reading order. This one, main.py, runs a step offloaded:

1. `pack_chunks`: the transformer blocks' parameters are packed, in order, into fixed-size
   chunks (a parameter never straddles two). The first `n_persist` chunks live on the device
   for good; the others live in host memory (pinned when the device is a GPU).
2. `BufferPool`: a few device buffers, least recently used first out, and `access_plan`: which
   chunks a block needs, plus one prefetch for the next block.
3. `ChunkManager`: before a block runs (forward, backward or recomputation) its chunks are
   copied into the pool. Weights that autograd saves for backward are stored as references to
   their chunk (saved-tensor hooks), so a buffer can be reused: backward fetches the chunk
   again. Gradients of offloaded chunks go to host memory as soon as they are ready; any
   torch.optim class (ZeroRedundancyOptimizer's `optimizer_class, **defaults` contract) steps
   the host copies. Blocks may also be recomputed (lesson 07).

The cost model that plans a configuration without running it (ProTrain's, in miniature:
`predict_peak`, `count_fetches`, `predict_time`, and `plan` under a memory budget) is in
cost_model.py, read after this file.

The proof (bitwise equality with plain training, the profiler, the measured peaks against
lesson 07's tracker, the CLI) is in checks.py. Run: `python lessons/08_offload/main.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from collections import OrderedDict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `lessons` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn as nn

memory = importlib.import_module("lessons.07_memory.main")  # lesson 07's technique
tiny_gpt = importlib.import_module("lessons.07_memory.tiny_gpt")  # lesson 07's TinyGPT, markov_batches


def make_offload_model(config: dict, seed: int) -> tiny_gpt.TinyGPT:
    """Lesson 07's TinyGPT without dropout, from a config dict (vocab, hidden, heads, layers,
    seq, device). Its `layers` get chunked; model.recompute = {indices} recomputes some."""
    torch.manual_seed(seed)
    return tiny_gpt.TinyGPT(config["vocab"], config["hidden"], config["heads"], config["layers"],
                          config["seq"], dropout=0.0).to(config.get("device", "cpu"))


def fixed_parameters(model: tiny_gpt.TinyGPT) -> list[nn.Parameter]:
    """The parameters outside the blocks (embeddings, tied head, final LayerNorm): always on
    the device, never chunked."""
    return [model.embed.weight, model.pos.weight, model.norm.weight, model.norm.bias]


# ============================================================================ 1. chunks


@dataclasses.dataclass
class Slot:
    """Where one parameter lives: chunk index, offset and element count inside the chunk.
    `master` (set by ChunkManager): the parameter-shaped view of its chunk that the optimizer
    steps, on the device (persistent chunk) or in host memory; its `.grad` is a view of the
    chunk's gradient in a step that produced one, else None (the optimizer skips it)."""

    param: nn.Parameter
    block: int
    chunk: int
    offset: int
    numel: int
    shape: torch.Size
    master: torch.Tensor | None = None


def pack_chunks(blocks: nn.ModuleList, chunk_numel: int) -> tuple[list[Slot], list[int]]:
    """Pack every block's parameters, in order, into chunks of at most `chunk_numel` elements.

    A parameter that does not fit in the current chunk starts the next one. Returns the slots
    and the number of elements used in each chunk."""
    slots, used = [], [0]
    for block_index, block in enumerate(blocks):
        for param in block.parameters():
            if param.numel() > chunk_numel:
                raise ValueError(f"a parameter of {param.numel()} elements does not fit in a chunk "
                                 f"of {chunk_numel}: raise the chunk size")
            if used[-1] + param.numel() > chunk_numel:
                used.append(0)
            slots.append(Slot(param, block_index, len(used) - 1, used[-1], param.numel(), param.shape))
            used[-1] += param.numel()
    return slots, used


def chunks_of_block(slots: list[Slot], n_blocks: int) -> list[list[int]]:
    """For each block, the sorted chunk indices its parameters live in."""
    found = [set() for _ in range(n_blocks)]
    for slot in slots:
        found[slot.block].add(slot.chunk)
    return [sorted(chunks) for chunks in found]


# ============================================================================ 2. the buffer pool


class BufferPool:
    """Least-recently-used residency of chunks in `n_buffers` device buffers.

    `resident` maps chunk -> buffer index, least recently used first; `fetches` counts the
    host-to-device copies made so far. The same policy runs for real (ChunkManager) and in the
    cost model (count_fetches), so the predicted number of copies is the counted one."""

    def __init__(self, n_buffers: int) -> None:
        self.n_buffers = n_buffers
        self.resident: OrderedDict[int, int] = OrderedDict()
        self.fetches = 0

    # exercise buffer-pool (3 points): The LRU buffer pool and the prefetch plan
    # hint: an OrderedDict keeps the least recently used first: move_to_end on a hit; the victim
    #   is the first chunk in it that is neither needed now nor kept
    def acquire(self, chunks: list[int], keep: tuple[int, ...] = ()) -> list[tuple[int, int, bool]]:
        """Make every chunk in `chunks` resident, in order; returns (chunk, buffer, fetched).

        A resident chunk becomes the most recently used (fetched False). A missing one takes
        the lowest free buffer, or else evicts the least recently used chunk that is neither
        in `chunks` nor in `keep`, and counts one fetch. ValueError when len(chunks) +
        len(keep) > n_buffers (the block could not run). Cost: O(n_buffers) per chunk."""
        if len(chunks) + len(keep) > self.n_buffers:
            raise ValueError(f"a block needs {len(chunks)} offloaded chunks at once but there are "
                             f"only {self.n_buffers} buffers")
        placed = []
        for chunk in chunks:
            if chunk in self.resident:
                self.resident.move_to_end(chunk)
                placed.append((chunk, self.resident[chunk], False))
                continue
            free = set(range(self.n_buffers)) - set(self.resident.values())
            if free:
                buffer = min(free)
            else:
                victim = next(c for c in self.resident if c not in chunks and c not in keep)
                buffer = self.resident.pop(victim)
            self.resident[chunk] = buffer
            self.fetches += 1
            placed.append((chunk, buffer, True))
        return placed

    def clear(self) -> None:
        self.resident.clear()


def offloaded_chunks(block_chunks: list[list[int]], n_persist: int, block: int) -> list[int]:
    return [c for c in block_chunks[block] if c >= n_persist]


# exercise buffer-pool (continued)
def access_plan(block_chunks: list[list[int]], n_persist: int, block: int, direction: int,
                pool: BufferPool) -> list[tuple[list[int], tuple[int, ...]]]:
    """What to acquire when `block` is about to run: its offloaded chunks, then (prefetch) the
    first chunk of the next block in `direction` that is not resident, keeping this block's."""
    wanted = offloaded_chunks(block_chunks, n_persist, block)
    plan = [(wanted, ())]
    following = block + direction
    if 0 <= following < len(block_chunks):
        missing = [c for c in offloaded_chunks(block_chunks, n_persist, following)
                   if c not in wanted and c not in pool.resident]
        if missing and len(wanted) < pool.n_buffers:
            plan.append(([missing[0]], tuple(wanted)))
    return plan


# ============================================================================ 3. the manager


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    n_persist: int  # chunks kept on the device
    n_checkpoint: int  # blocks recomputed (the first ones: their activations live longest)


class ChunkManager:
    """Runs `model` with chunks [0, n_persist) on `device` and the rest in host memory, and
    steps it with `optimizer_class(params, **defaults)`: the contract of torch's
    ZeroRedundancyOptimizer, with the model in place of params (the manager must own its
    parameters to move them). Any torch.optim class works (Adam, AdamW, SGD with momentum...).

    Device memory: the fixed parameters, persistent chunks (weights, gradients, optimizer
    states), `n_buffers` chunk buffers, activations. Host memory: offloaded chunks' weights
    (pinned on a GPU box: the source of the non-blocking fetches), their gradients and the host
    optimizer's states (pageable). Two optimizer instances, one on the device (fixed
    parameters and persistent chunks) and one on the host, each over parameter-shaped views
    of the chunks (`Slot.master`), so a parameter without a gradient in a step (frozen, or
    unused) is skipped exactly as torch skips it, and an optimizer that is not element-wise
    sees each parameter's shape. `phase(name)` and `observe(name)` are no-ops a profiler may
    replace (the checks put lesson 07's tracker there)."""

    def __init__(self, model: tiny_gpt.TinyGPT, config: OffloadConfig, chunk_numel: int,
                 optimizer_class: type[torch.optim.Optimizer] = torch.optim.Adam, *,
                 device: str = "cpu", n_buffers: int | None = None, **defaults) -> None:
        self.model, self.config, self.device = model, config, torch.device(device)
        self.slots, self.used = pack_chunks(model.layers, chunk_numel)
        self.block_chunks = chunks_of_block(self.slots, len(model.layers))
        n_chunks = len(self.used)
        if not 0 <= config.n_persist <= n_chunks:
            raise ValueError(f"n_persist {config.n_persist} is not in [0, {n_chunks}]")
        if not 0 <= config.n_checkpoint <= len(model.layers):
            raise ValueError(f"n_checkpoint {config.n_checkpoint} is not in [0, {len(model.layers)}]")
        pin = self.device.type == "cuda"  # pinned host memory: asynchronous host-to-device copies
        self.flat, self.grad = [], []
        for chunk, numel in enumerate(self.used):
            on_device = chunk < config.n_persist
            flat = torch.zeros(numel, device=self.device if on_device else "cpu",
                               pin_memory=pin and not on_device)
            self.flat.append(flat)
            self.grad.append(torch.zeros_like(flat))  # pageable: _grad_ready's .to() blocks
        for slot in self.slots:  # move each weight into its chunk
            slot.master = self._view(self.flat[slot.chunk], slot)
            slot.master.copy_(slot.param.data)
            slot.param.data = (slot.master if slot.chunk < config.n_persist
                               else torch.empty(0, device=self.device))
            if slot.param.requires_grad:  # a frozen parameter never gets a gradient
                slot.param.register_post_accumulate_grad_hook(self._grad_ready)
        self.slot_of = {id(slot.param): slot for slot in self.slots}
        self.slots_in_chunk = [[s for s in self.slots if s.chunk == c] for c in range(n_chunks)]
        if n_buffers is None:  # a block's offloaded chunks plus one to prefetch the next block's
            n_buffers = max(len(offloaded_chunks(self.block_chunks, config.n_persist, b))
                            for b in range(len(model.layers))) + 1 if n_chunks > config.n_persist else 0
        self.buffers = [torch.zeros(chunk_numel, device=self.device) for _ in range(n_buffers)]
        self.pool = BufferPool(n_buffers)
        self.chunk_in_buffer: dict[int, int] = {}
        persistent = [s.master for s in self.slots if s.chunk < config.n_persist]
        self.device_optimizer = optimizer_class(fixed_parameters(model) + persistent, **defaults)
        host = [s.master for s in self.slots if s.chunk >= config.n_persist]
        self.host_optimizer = optimizer_class(host, **defaults) if host else None
        model.recompute = set(range(config.n_checkpoint))
        for index, block in enumerate(model.layers):  # fetch before forward and before backward
            block.register_forward_pre_hook(lambda _m, _a, index=index: self.fetch_block(index))
            block.register_full_backward_pre_hook(lambda _m, _g, index=index: self.fetch_block(index))
        self.in_backward = False
        self.phase = lambda name: contextlib.nullcontext()
        self.observe = lambda name: None

    @staticmethod
    def _view(flat: torch.Tensor, slot: Slot) -> torch.Tensor:
        return flat[slot.offset:slot.offset + slot.numel].view(slot.shape)

    # exercise chunk-manager (4 points): Fetch a block's chunks; save weights as chunk references
    # hint: direction is -1 in backward; for each (chunk, buffer, fetched) the pool returns, point
    #   the old owner of the buffer at nothing, copy the chunk in, point its weights at the buffer;
    #   _pack finds the buffer by storage data_ptr, _unpack rebuilds with as_strided
    def fetch_block(self, block: int) -> None:
        """Make `block`'s offloaded chunks resident and point its weights at them, then prefetch
        the next block's first missing chunk (next: block + 1 in forward, block - 1 in backward,
        recomputation included), as `access_plan` says. For each chunk the pool fetched: the
        chunk that held that buffer is evicted (its weights become empty tensors, so a use of
        them fails loudly), the chunk's used elements are copied host -> device into the start
        of the buffer (non-blocking from pinned memory, but on the current stream, so the copy
        overlaps no kernel: README), and its weights become views into the buffer."""
        direction = -1 if self.in_backward else 1
        for chunks, keep in access_plan(self.block_chunks, self.config.n_persist, block, direction,
                                        self.pool):
            for chunk, buffer, fetched in self.pool.acquire(chunks, keep):
                if fetched:
                    for other, held in list(self.chunk_in_buffer.items()):
                        if held == buffer:  # evicted: its weights point nowhere until fetched again
                            del self.chunk_in_buffer[other]
                            self._point(other, None)
                    self.buffers[buffer][: self.used[chunk]].copy_(self.flat[chunk], non_blocking=True)
                    self.chunk_in_buffer[chunk] = buffer
                self._point(chunk, self.buffers[buffer])

    def _point(self, chunk: int, buffer: torch.Tensor | None) -> None:
        for slot in self.slots_in_chunk[chunk]:
            slot.param.data = (torch.empty(0, device=self.device) if buffer is None
                               else self._view(buffer, slot))

    # exercise chunk-manager (continued)
    def _pack(self, tensor: torch.Tensor):
        """Autograd saves `tensor` for backward. A view into one of the chunk buffers becomes
        (chunk, shape, stride, storage offset), since by backward that buffer may hold another
        chunk; any other tensor is kept as it is."""
        key = tensor.untyped_storage().data_ptr()
        for chunk, buffer in self.chunk_in_buffer.items():
            if self.buffers[buffer].untyped_storage().data_ptr() == key:
                return (chunk, tensor.shape, tensor.stride(), tensor.storage_offset())
        return tensor

    # exercise chunk-manager (continued)
    def _unpack(self, packed):
        """Backward needs a saved tensor back: rebuild a packed weight view (as_strided) from the
        buffer its chunk is resident in now (the block's backward pre-hook fetched it);
        RuntimeError if it is not resident."""
        if isinstance(packed, torch.Tensor):
            return packed
        chunk, shape, stride, offset = packed
        if chunk not in self.chunk_in_buffer:  # the backward pre-hook fetched the block's chunks
            raise RuntimeError(f"chunk {chunk} is needed in backward but is not resident")
        return self.buffers[self.chunk_in_buffer[chunk]].as_strided(shape, stride, offset)

    def _grad_ready(self, param: nn.Parameter) -> None:
        """A block weight's gradient is complete: add it into its chunk's gradient (device, or
        host: a blocking device-to-host copy), hand that view to the optimizer as the
        master's .grad, and free the device copy."""
        slot = self.slot_of[id(param)]
        target = self._view(self.grad[slot.chunk], slot)
        target.add_(param.grad.to(target.device))
        slot.master.grad = target
        param.grad = None

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> float:
        """One training step: forward and backward with chunks fetched on demand, the device
        optimizer, the host optimizer, then every resident copy is stale (the host weights
        changed). observe() is called at the end of forward, of backward and of the optimizer
        steps."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            with self.phase("forward"):
                loss = self.model.loss(tokens, targets)
            self.observe("forward_peak")
            with self.phase("backward"):
                self.in_backward = True
                try:
                    loss.backward()
                finally:
                    self.in_backward = False
        self.observe("backward_peak")
        with self.phase("optimizer"):
            self.device_optimizer.step()
        if self.host_optimizer is not None:
            if self.device.type == "cuda":  # copies still in flight read the pinned host chunks
                torch.cuda.current_stream(self.device).synchronize()
            with self.phase("host"):
                self.host_optimizer.step()
        self.observe("step_peak")
        for grad in self.grad:
            grad.zero_()
        for slot in self.slots:  # the next step's gradients decide who is stepped
            slot.master.grad = None
        for param in fixed_parameters(self.model):
            param.grad = None
        for chunk in list(self.chunk_in_buffer):
            self._point(chunk, None)
        self.chunk_in_buffer.clear()
        self.pool.clear()
        return float(loss.detach())


if __name__ == "__main__":  # the checks, the report and the CLI: checks.py
    from lessons._report import run_harness

    run_harness(__file__)
