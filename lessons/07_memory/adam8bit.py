"""Lesson 07, part 3 (after mixed_precision.py): Adam with 8-bit states, block-wise.

Adam's m and v are 8 of a mixed-precision step's 16 bytes per parameter. Dettmers et al. ("8-bit
Optimizers via Block-wise Quantization") store each as one byte per value plus one fp32 absmax
per block of B values, 2(n + 4n/B) bytes instead of 8n (checks.py trains with both):

1. `dynamic_codebook`: at most 256 values in [-1, 1] or [0, 1], dense near zero;
2. `quantize_blockwise` / `dequantize_blockwise`: one absmax per block, the nearest code;
3. `adam8bit_state_bytes`: the cost;
4. `Adam8bit`: each step dequantizes m and v, applies Adam exactly as torch does, quantizes
   them back (with quantization off it is torch.optim.Adam, bitwise: lesson 08 uses it so).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BLOCK = 2048  # the paper's block size (Dettmers et al.); bitsandbytes' optimizers use 256
# smaller tensors keep 32-bit states: they save few bytes, and they are often biases (highly
# variable) or norm weights (need precision): bitsandbytes' docs give both reasons
MIN_8BIT_NUMEL = 4096


def dynamic_codebook(signed: bool) -> torch.Tensor:
    """Sorted values in [-1, 1] (signed) or [0, 1]: 0, and m x 2^-e for 8 mantissas m in
    (0.5, 1] and exponents e = 0..14 (signed: 241 codes) or 0..30 (unsigned: 249 codes).

    This lesson's own codebook, a small float with a fixed 3-bit mantissa: in every binade the
    half-gap to the next code is 2^-e / 32, 3.1% to 6.25% of the value; the smallest nonzero
    code is 0.5625 x 2^-14 ~ 3.4e-5 (signed). It is dense near 0 like Dettmers et al.'s
    dynamic map but is not it: bitsandbytes' `create_dynamic_map` works in base-10 decades
    whose fraction bits shrink decade by decade (smallest code 5.5e-7)."""
    exponents = 15 if signed else 31
    magnitudes = torch.tensor([2.0 ** -e * (1 - j / 16) for e in range(exponents) for j in range(8)])
    values = torch.cat([magnitudes, -magnitudes, torch.zeros(1)]) if signed else \
        torch.cat([magnitudes, torch.zeros(1)])
    return values.sort().values


CODEBOOKS = {True: dynamic_codebook(True), False: dynamic_codebook(False)}


# exercise blockwise-quant (3 points): Block-wise 8-bit quantization for Adam's states
# hint: F.pad to a multiple of B, .view(-1, B), one absmax per row (amax(dim=1));
#   torch.bucketize against the midpoints of the codebook finds the nearest code
def quantize_blockwise(x: torch.Tensor, signed: bool,
                       block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, n elements, float) -> (codes uint8 (ceil(n/B), B), absmax (ceil(n/B),)).

    Pad x with zeros to a multiple of B, cut it into blocks of B, divide each block by its own
    absmax (at least the smallest normal float32, so a zero block stays 0), and store for each
    value the index of the nearest code of CODEBOOKS[signed] (ties to the lower code).
    Memory: n + 4 ceil(n/B) bytes instead of 4n."""
    flat = x.reshape(-1)
    blocks = F.pad(flat, (0, (-flat.numel()) % block)).view(-1, block)
    absmax = blocks.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
    codebook = CODEBOOKS[signed].to(x.dtype)
    midpoints = (codebook[1:] + codebook[:-1]) / 2
    codes = torch.bucketize(blocks / absmax[:, None], midpoints).to(torch.uint8)
    return codes, absmax


# exercise blockwise-quant (continued)
def dequantize_blockwise(codes: torch.Tensor, absmax: torch.Tensor, signed: bool,
                         shape: torch.Size) -> torch.Tensor:
    """The inverse: CODEBOOKS[signed][code] x its block's absmax, padding dropped, in `shape`
    (dtype of absmax). Error per value: at most half the gap between neighbouring codes x absmax."""
    values = CODEBOOKS[signed].to(absmax.dtype)[codes.long()] * absmax[:, None]
    return values.reshape(-1)[: math.prod(shape)].view(shape)


def adam8bit_state_bytes(numel: int, block: int = BLOCK) -> int:
    """Two states: 1 byte per (padded) element each, plus one fp32 absmax per block each;
    tensors below MIN_8BIT_NUMEL keep two fp32 states (8 bytes per element)."""
    if numel < MIN_8BIT_NUMEL:
        return 8 * numel
    blocks = -(-numel // block)
    return 2 * (blocks * block + 4 * blocks)


class Adam8bit(torch.optim.Optimizer):
    """Adam whose m and v live as block-wise 8-bit codes between steps (Dettmers et al.).

    Each step: dequantize m, v, apply Adam exactly as torch does, quantize them back (m signed,
    v unsigned). Tensors with fewer than `min_8bit_numel` elements keep full-precision states
    (set it to math.inf and this is plain Adam, bitwise equal to torch.optim.Adam)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 min_8bit_numel: float = MIN_8BIT_NUMEL, block: int = BLOCK) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        self.min_8bit_numel, self.block = min_8bit_numel, block

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step for every parameter that has a gradient (one without is skipped and
        its step count stays, as in torch); `closure` as torch's optimizers take it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                quantized = param.numel() >= self.min_8bit_numel
                if not state:
                    zeros = torch.zeros_like(param)
                    state["step"] = 0  # per parameter: bias correction counts its own steps
                    state.update(self._store(zeros, True, quantized, "m"))
                    state.update(self._store(zeros, False, quantized, "v"))
                state["step"] += 1
                m = self._load(state, True, quantized, "m", param.shape)
                v = self._load(state, False, quantized, "v", param.shape)
                m.lerp_(param.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
                denom = (v.sqrt() / math.sqrt(bias2)).add_(group["eps"])
                param.addcdiv_(m, denom, value=-group["lr"] / bias1)
                state.update(self._store(m, True, quantized, "m"))
                state.update(self._store(v, False, quantized, "v"))
        return loss

    def _store(self, value: torch.Tensor, signed: bool, quantized: bool, name: str) -> dict:
        if not quantized:
            return {name: value.clone()}
        codes, absmax = quantize_blockwise(value, signed, self.block)
        return {f"{name}_codes": codes, f"{name}_absmax": absmax}

    @staticmethod
    def _load(state: dict, signed: bool, quantized: bool, name: str, shape) -> torch.Tensor:
        if not quantized:
            return state[name]
        return dequantize_blockwise(state[f"{name}_codes"], state[f"{name}_absmax"], signed, shape)
