"""Lesson 07, part 2 (after main.py): mixed precision, the recipes main.py's formula counts.

16-bit weights, gradients and activations halve the activation bytes and run the matmuls
faster (torch.autocast picks each operator's dtype; checks.py measures it). Two things break,
and each piece here repairs one:

1. `MixedPrecisionAdam`: a bf16 weight cannot take a small update, so the optimizer keeps fp32
   master weights (mixed precision saves no model-state memory: still 16 B/param) and, with
   Megatron's fp32 `main_grad` accumulator, 18 or 20 B/param.
2. `DynamicLossScaler`: fp16's 5 exponent bits flush small gradients to zero; scaling the loss
   lifts them, with torch.amp.GradScaler's rules for backing off on overflow and growing again.
3. FP8, briefly: `fp8_round_trip`, a tensor cast to E4M3 or E5M2 with a per-tensor scale, the
   way an FP8 matmul receives its inputs (the states the optimizer keeps are unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from .main import optimizer_tensors

# ============================================================================ 1. master weights


class MixedPrecisionAdam:
    """Adam for a 16-bit model: fp32 master weights updated by torch's Adam, copied back.

    Why the master: a bf16 weight has 8 significant bits. Its neighbours at 1.0 are 1 + 2^-7
    above and 1 - 2^-8 below, so an increase up to half the upward step (2^-8 ~ 0.0039: 1.0 +
    0.0038 stays 1.0, 1.0 + 0.004 becomes 1.0078) or a decrease up to 2^-9 ~ 0.002 rounds
    back to 1.0 and is lost, however many steps apply it.
    With `fp32_accumulation`, `accumulate()` adds each 16-bit gradient into a persistent fp32
    buffer (Megatron's main_grad); `free_model_grads` then frees the 16-bit .grad, as
    Megatron's backward hook does (18 B/param instead of 20)."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-3,
                 fp32_accumulation: bool = False, free_model_grads: bool = False) -> None:
        self.params = list(params)
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.inner = torch.optim.Adam(self.master, lr=lr, foreach=False)
        self.main_grads = [torch.zeros_like(m) for m in self.master] if fp32_accumulation else None
        self.free_model_grads = free_model_grads
        self.state = self.inner.state  # so optimizer_tensors() sees m and v

    def accumulate(self) -> None:
        """main_grad += .grad for every parameter (then .grad = None when freeing)."""
        if self.main_grads is not None:
            for buffer, param in zip(self.main_grads, self.params):
                if param.grad is not None:
                    buffer.add_(param.grad)
                    if self.free_model_grads:
                        param.grad = None

    def step(self) -> None:
        self.accumulate()
        for index, (master, param) in enumerate(zip(self.master, self.params)):
            master.grad = (self.main_grads[index] if self.main_grads is not None
                           else param.grad.float())
        self.inner.step()
        for master, param in zip(self.master, self.params):
            master.grad = None
            with torch.no_grad():
                param.copy_(master)

    def tensors(self) -> list[torch.Tensor]:
        """Everything this optimizer keeps between steps (filed as "optimizer" or "gradient")."""
        return self.master + optimizer_tensors(self.inner)


# ============================================================================ 2. loss scaling


class DynamicLossScaler:
    """Loss scaling from scratch, with torch.amp.GradScaler's rules and defaults.

    fp16 keeps 5 exponent bits: a gradient at or below 2^-25 (~3e-8) rounds to 0. Scale the loss
    by S so the gradients are S times larger, divide them by S before the step:
    scale(loss) = loss x S; unscale_(opt): grad x (1/S) for every grad (1/S computed in float64,
    applied in float32, as GradScaler does), found_inf = any grad not finite;
    step(opt): the optimizer step, skipped when found_inf; update(): see its docstring.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000) -> None:
        self.scale_value = torch.tensor(init_scale, dtype=torch.float32)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.clean_steps = growth_interval, 0
        self.found_inf = False
        self.unscaled: set[int] = set()  # id of each optimizer unscaled since the last update()

    # exercise loss-scaler (4 points): Dynamic loss scaling with GradScaler's rules
    # hint: check isfinite before multiplying by 1/S; on overflow skip optimizer.step(), halve S and
    #   reset the counter; grow S only when growth_interval clean steps have passed in a row
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x S (in the loss's dtype): backward then produces gradients S times larger."""
        return loss * self.scale_value.to(loss.dtype)

    # exercise loss-scaler (continued)
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Every .grad of the optimizer's parameters x (1/S), in place (the same tensor objects:
        a clip or a hook between unscale_ and step sees them), with 1/S computed in float64 and
        rounded to float32 (GradScaler's arithmetic, so the weights match bitwise); found_inf
        = True if any gradient of THIS call holds an inf or a NaN (checked before scaling).
        Records the optimizer as unscaled; a second unscale_ of it before update() raises
        RuntimeError, as GradScaler's does (the gradients would be divided twice)."""
        if id(optimizer) in self.unscaled:
            raise RuntimeError("unscale_() has already been called on this optimizer since the "
                               "last update()")
        self.unscaled.add(id(optimizer))
        inv_scale = self.scale_value.double().reciprocal().float()
        self.found_inf = False
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self.found_inf |= not bool(torch.isfinite(param.grad).all())
                    param.grad.mul_(inv_scale)

    # exercise loss-scaler (continued)
    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (unless unscale_ was already called for this optimizer since the last
        update(), e.g. to clip: GradScaler's rule) and step unless a gradient overflowed; True
        when the step was taken."""
        if id(optimizer) not in self.unscaled:
            self.unscale_(optimizer)
        if not self.found_inf:
            optimizer.step()
        return not self.found_inf

    # exercise loss-scaler (continued)
    def update(self) -> None:
        """After each step. An overflow (found_inf): S x backoff_factor and the clean-step
        counter restarts at 0. Otherwise the counter grows by one; when it reaches
        growth_interval, S x growth_factor and the counter restarts at 0. Every optimizer may be
        unscaled again afterwards."""
        self.unscaled.clear()
        if self.found_inf:
            self.scale_value = self.scale_value * self.backoff_factor
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale_value = self.scale_value * self.growth_factor
                self.clean_steps = 0

    def get_scale(self) -> float:
        return float(self.scale_value)


# ============================================================================ 3. FP8, briefly

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # max 448 (no inf) and 57,344


def fp8_round_trip(x: torch.Tensor, fmt: str, scaled: bool = True) -> tuple[torch.Tensor, float]:
    """x -> (the values an FP8 matmul would see, back in x's dtype; the scale used).

    FP8 formats (Micikevicius et al., arXiv 2209.05433): E4M3 (4 exponent bits, 3 mantissa
    bits, max 448) for weights and activations, E5M2 (max 57,344) for gradients. Their range
    is too narrow for raw tensors, so each tensor is multiplied by a scale before the cast and
    divided after: here current per-tensor scaling, scale = max_fp8 / amax(x), so the largest
    |x| lands on the largest code (Transformer Engine's delayed scaling takes amax from a
    history of earlier steps instead). `scaled=False` casts with scale 1: values below the
    format's smallest subnormal flush to 0. Relative error of a normal value: at most half a
    mantissa step, 2^-4 (E4M3) or 2^-3 (E5M2)."""
    dtype = FP8[fmt]
    amax = float(x.abs().max()) if x.numel() else 0.0
    scale = torch.finfo(dtype).max / amax if scaled and amax > 0 else 1.0
    return (x * scale).to(dtype).to(x.dtype) / scale, scale
