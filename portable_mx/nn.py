"""Autograd for MXFP4 matmul.

For now one Function: the forward multiplies the MXFP4 operands; the backward is
straight-through (the quantizer's derivative taken as 1), i.e. the exact gradients of
the product of the dequantized operands, computed in fp32. Quantized backward GEMMs,
MXLinear and convert() build on this module.
"""

from __future__ import annotations

from typing import Union

import torch

from .recipe import QuantRecipe
from .tensor import MXTensor

Operand = Union[torch.Tensor, MXTensor]


class _MXMatmulSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: Operand, b: Operand, recipe: QuantRecipe) -> torch.Tensor:  # type: ignore[override]
        from .ops import _as_mx, _flatten_batch, dequantize, gemm

        a_mx, b_mx = _as_mx(a, recipe, -1), _as_mx(b, recipe, 0)
        out_dtype = a_mx.dtype
        ctx.dtypes = (a_mx.dtype, b_mx.dtype)
        ctx.save_for_backward(dequantize(a_mx, dtype=torch.float32), dequantize(b_mx, dtype=torch.float32))
        return gemm(_flatten_batch(a_mx), b_mx, recipe).reshape(*a_mx.shape[:-1], -1).to(out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        aq, bq = ctx.saved_tensors
        g = grad_out.to(torch.float32)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = (g @ bq.T).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            k, n = bq.shape
            grad_b = (aq.reshape(-1, k).T @ g.reshape(-1, n)).to(ctx.dtypes[1])
        return grad_a, grad_b, None


def mx_matmul(a: Operand, b: Operand, recipe: QuantRecipe) -> torch.Tensor:
    """MXFP4 ``a @ b`` (see :func:`portable_mx.matmul`) with a straight-through backward."""
    return _MXMatmulSTE.apply(a, b, recipe)
