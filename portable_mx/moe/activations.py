"""The gated activations a grouped GEMM can fuse into its epilogue, in fp32: the
definition every backend follows (the Triton epilogue is its twin: grouped_gemm.py).

A gated activation reads the N columns of a projection's output h (bias included) as
N/2 (gate, up) pairs and returns N/2 columns:

- ``"swiglu_oai"`` (gpt-oss, interleaved): gate = h[:, 0::2], up = h[:, 1::2];
  g = min(gate, 7), u = clamp(up, -7, 7); out = (g * sigmoid(1.702 * g)) * (u + 1).
  The formula of transformers' ``GptOssExperts`` (alpha 1.702, limit 7.0; openai/gpt-oss
  ``swiglu``), here evaluated in fp32.
- ``"swiglu"`` (Qwen3-MoE, Mixtral, Llama: concatenated halves): gate = h[:, :N/2],
  up = h[:, N/2:]; out = (gate * sigmoid(gate)) * up (SiLU(gate) * up).

:func:`backward` is the derivative of each, the clamps passing the gradient where the
input lies inside them, bounds included (``torch.clamp``'s convention).
"""

from __future__ import annotations

from typing import Optional

import torch

ACTIVATIONS = ("swiglu_oai", "swiglu")
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def check(name: Optional[str]) -> Optional[str]:
    """``name`` if it is None or one of :data:`ACTIVATIONS`, else ValueError."""
    if name is not None and name not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}; got {name!r}")
    return name


def gate_up(h: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) columns of h [R, N] for activation ``name``."""
    if name == "swiglu_oai":
        return h[:, 0::2], h[:, 1::2]
    half = h.shape[1] // 2
    return h[:, :half], h[:, half:]


def apply(h: torch.Tensor, name: Optional[str]) -> torch.Tensor:
    """The activation of fp32 h [R, N] -> fp32 [R, N/2] (h itself for None)."""
    if name is None:
        return h
    gate, up = gate_up(h, name)
    if name == "swiglu_oai":
        g = gate.clamp(max=SWIGLU_OAI_LIMIT)
        u = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (g * torch.sigmoid(SWIGLU_OAI_ALPHA * g)) * (u + 1)
    return (gate * torch.sigmoid(gate)) * up


def backward(h: torch.Tensor, grad: torch.Tensor, name: Optional[str]) -> torch.Tensor:
    """d loss / d h [R, N] (fp32) from ``grad`` = d loss / d apply(h, name) [R, N/2]."""
    if name is None:
        return grad
    gate, up = gate_up(h, name)
    if name == "swiglu_oai":
        lim = SWIGLU_OAI_LIMIT
        g = gate.clamp(max=lim)
        u = up.clamp(min=-lim, max=lim)
        s = torch.sigmoid(SWIGLU_OAI_ALPHA * g)
        d_gate = grad * (u + 1) * (s + SWIGLU_OAI_ALPHA * g * s * (1 - s)) * (gate <= lim)
        d_up = grad * (g * s) * ((up >= -lim) & (up <= lim))
    else:
        s = torch.sigmoid(gate)
        d_gate = grad * up * (s + gate * s * (1 - s))
        d_up = grad * (gate * s)
    out = torch.empty_like(h)
    if name == "swiglu_oai":
        out[:, 0::2], out[:, 1::2] = d_gate, d_up
    else:
        half = h.shape[1] // 2
        out[:, :half], out[:, half:] = d_gate, d_up
    return out
