"""Lesson 13's cost model: FLOPs per token (PaLM, appendix B) and model FLOPs utilisation.

`DEVICE_PEAK_FLOPS` and `peak_flops_for` (a device's dense bf16 peak by its exact name),
`matmul_params` (the N of 6N), `flops_per_token` (6N + attention), `mfu` (achieved FLOP/s
over every device's peak). main.py's `train` measures the tokens/s these turn into MFU.
"""

from __future__ import annotations

import importlib

tiny_gpt = importlib.import_module("lessons.07_memory.tiny_gpt")  # lesson 07's TinyGPT, markov_batches

# Dense bf16 tensor-core peaks (FLOP/s) by the EXACT name torch.cuda.get_device_name() gives
# (NVIDIA's driver README, "Compatible GPUs", open-gpu-kernel-modules 560.31.02): half of the
# "with sparsity" figures on nvidia.com/en-us/data-center/a100/, /h100/ and /h200/ (as
# torchtitan's get_peak_flops cites them). An unlisted device gets no MFU, never a guess.
DEVICE_PEAK_FLOPS = {
    "NVIDIA A100-SXM4-40GB": 312e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100-PCIE-40GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,
    "NVIDIA H100 80GB HBM3": 989e12,  # H100 SXM
    "NVIDIA H100 PCIe": 756e12,
    "NVIDIA H100 NVL": 835e12,
    "NVIDIA H200": 989e12,  # H200 SXM (the H200 NVL reports "NVIDIA H200 NVL": not listed)
}


def peak_flops_for(device_name: str) -> float | None:
    """The table's peak for exactly this device name, else None ("NVIDIA L4" is not
    "NVIDIA L40S", and no substring of a name picks a peak)."""
    return DEVICE_PEAK_FLOPS.get(device_name)


# exercise flops-mfu (2 points): The cost model: FLOPs per token and MFU
# hint: forward 2N, backward 4N; MFU compares with the peak of all the ranks together.
def matmul_params(model: tiny_gpt.TinyGPT) -> int:
    """N for 6N: every parameter of `model` but the position table model.pos (an add, not a
    matmul); the tied token embedding model.embed counts once, for the output head's matmul
    (its lookup is not a matmul). An int."""
    return sum(p.numel() for p in model.parameters()) - model.pos.weight.numel()


# exercise flops-mfu (continued)
def flops_per_token(n_params: int, layers: int, hidden: int, seq: int) -> int:
    """Training FLOPs per token (PaLM, appendix B): 6N for the weight matmuls (2N forward:
    a multiply and an add per weight; 4N backward: the gradients of the inputs and of the
    weights), plus 12 L H Q T for attention scores and values (H Q = hidden, T = seq). An int."""
    return 6 * n_params + 12 * layers * hidden * seq


# exercise flops-mfu (continued)
def mfu(tokens_per_s: float, per_token: int, world: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: the share of the ranks' combined peak that the model's own
    FLOPs use, tokens_per_s x per_token / (world x peak), with tokens_per_s over all ranks,
    per_token from flops_per_token() (recomputation and padding do not count) and `peak` one
    device's dense FLOP/s. None when peak is None (CPU, or a device the table lacks)."""
    return None if peak is None else tokens_per_s * per_token / (world * peak)
