"""The grouped GEMM's dispatch: validated operands -> the rows view -> the backend that
serves "grouped_matmul" on the device (the twin of :mod:`portable_mx._dispatch` for the
grouped op; nothing here checks arguments again).

The left operand becomes what a backend takes (:func:`portable_mx._dispatch.left_operand`:
an MXTensor in the rows layout, quantized along K with the recipe when it is a float
tensor, or rounded to 16 bits for W4A16; on upcast targets an A4W4 call at decode sizes
or with a wide output gets its quantized values instead, as the dense GEMM does:
:func:`portable_mx._dispatch.backend_left_operand`, with the mean rows per expert as M),
the expert weights their rows view (E*N, K)
(quantized along K first when they are a float tensor [E, N, K]), and a scattering call
adds the backend's deterministic k-way combine after the GEMM, whose rows it keeps in
fp32 so that the result is rounded once. The backward's high-precision ragged products
(:func:`ragged_rows`, :func:`ragged_k`) go to the same backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from .. import _dispatch, registry
from ..recipe import QuantRecipe

if TYPE_CHECKING:
    from ..tensor import MXTensor

Operand = Union[torch.Tensor, "MXTensor"]
_Tensor = torch.Tensor


def weight_rows(w: Operand, recipe: QuantRecipe) -> "MXTensor":
    """The expert weights [E, N, K] as the rows-layout MXTensor (E*N, K) a backend takes:
    an MXTensor along K as it is (views), a float tensor quantized along K (axis 2)."""
    if isinstance(w, _Tensor):
        return _dispatch.quantize(w, recipe, 2).rows()
    return w.rows()


def grouped(x: Operand, w: Operand, recipe: QuantRecipe, offsets: torch.Tensor, gather: Optional[torch.Tensor],
            scatter: Optional[torch.Tensor], weights: Optional[torch.Tensor], k: int, bias: Optional[torch.Tensor],
            activation: Optional[str], out_dtype: torch.dtype, schedule: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The grouped GEMM without autograd (see :func:`portable_mx.grouped_matmul`).

    x: float [X, K] or an MXTensor (X, K) along K; w: float [E, N, K] or an MXTensor
    [E, N, K] along axis 2 (or its rows view); offsets: int32 [E] ends of the R sorted
    rows; gather: None or int32 [R] (row i reads x's row gather[i]); scatter: None or
    int32 [T*k], the sorted row of each (t, j), with ``weights`` [T, k] (None: 1): the
    output is then [T, N'] (the weighted k-way sum), else [R, N']. R, K, N > 0.
    """
    num_experts = offsets.shape[0]
    wr = weight_rows(w, recipe)
    backend = registry.select("grouped_matmul", wr.device)
    sorted_rows = x.shape[0] if gather is None else gather.shape[0]
    a = _dispatch.backend_left_operand(backend, x, recipe, -(-sorted_rows // num_experts),
                                       wr.shape[0] // num_experts)
    rows = backend.grouped_matmul(a, wr, num_experts, offsets, gather, bias, activation,
                                  torch.float32 if scatter is not None else out_dtype, schedule)
    if scatter is None:
        return rows
    return backend.combine(rows, scatter, weights, k, out_dtype)


def combine(rows: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], k: int,
            out_dtype: torch.dtype) -> torch.Tensor:
    """The selected backend's deterministic k-way sum (:meth:`Backend.combine`)."""
    return registry.select("grouped_matmul", rows.device).combine(rows, index, weights, k, out_dtype)


def ragged_rows(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The selected backend's high-precision ragged-M product (:meth:`Backend.ragged_rows`)."""
    return registry.select("grouped_matmul", a.device).ragged_rows(a, b, offsets)


def ragged_k(a: torch.Tensor, b: Optional[torch.Tensor], offsets: torch.Tensor,
             out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The selected backend's high-precision ragged-K product, or column sums without
    ``b`` (:meth:`Backend.ragged_k`)."""
    return registry.select("grouped_matmul", a.device).ragged_k(a, b, offsets, out_dtype)
