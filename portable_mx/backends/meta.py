"""The meta backend: shape propagation on the ``meta`` device.

Model-building tools (``torch.device("meta")`` initialisation, ``torch.compile``'s fake
tensors, memory planners) run a model on tensors that carry a shape, a dtype and a device
but no data. This backend answers every op there with outputs of the right shapes and
dtypes and no values, as the ``portable_mx::`` custom ops' fake implementations do; it
serves the meta device only, ahead of every other backend.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..decompose import Decomposition, zeros_decomposition
from ..recipe import QuantRecipe
from ..registry import Backend
from ..tensor import MXTensor


class MetaBackend(Backend):
    """Every op on the meta device: outputs with shapes and dtypes, no data."""

    name = "meta"
    priority = 1000
    ops = frozenset({"quantize", "dequantize", "decompose", "matmul", "grouped_matmul"})

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        return None if device.type == "meta" else "serves the meta device only (shape propagation)"

    def path(self, device: torch.device, op: str) -> str:
        return "shapes only"

    def quantize(self, x: torch.Tensor, recipe: QuantRecipe) -> MXTensor:
        return MXTensor.empty(tuple(x.shape), x.dtype, recipe, x.device)

    def dequantize(self, mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(mx.shape[0], mx.k_padded, dtype=dtype, device=mx.device)

    def decompose(self, x: torch.Tensor, recipe: QuantRecipe, definition: str, full: bool) -> Decomposition:
        return zeros_decomposition(x.shape[0], x.shape[1], recipe, definition, full, x.device)

    def matmul(self, a: "MXTensor | torch.Tensor", b: MXTensor, out_dtype: torch.dtype = torch.float32, *,
               bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=b.device)

    def grouped_matmul(self, a, w, num_experts, offsets, gather, bias, activation, out_dtype, schedule):
        rows = a.shape[0] if gather is None else gather.shape[0]
        n = w.shape[0] // num_experts
        return torch.empty(rows, n // 2 if activation else n, dtype=out_dtype, device=w.device)

    def combine(self, rows, index, weights, k, out_dtype):
        return torch.empty(index.shape[0] // k, rows.shape[1], dtype=out_dtype, device=rows.device)
