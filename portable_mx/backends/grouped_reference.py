"""The reference grouped GEMM over ragged experts: a loop over the experts of the dense
reference product (reference.py), the oracle of every grouped kernel.

Per expert e with sorted rows [start, end): the rows of the left operand (gathered when
asked), dequantized exactly to fp32, times expert e's dequantized weight [N, K]
transposed, in fp32 at the highest matmul precision, plus bias[e] in fp32, then the
activation (:mod:`portable_mx.moe.activations`), rounded once to the output dtype.
Empty experts are skipped. The loop reads the offsets on the host (a sync): the
reference is for exactness, not speed; the Triton backend needs no sync.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional

import torch

from .._precision import HighestPrecision
from ..tensor import MXTensor


def take_rows(mx: MXTensor, index: torch.Tensor) -> MXTensor:
    """The rows ``index`` (int [R]) of a rows-layout MXTensor (X, K), axis 1: (R, K)."""
    idx = index.to(torch.int64)

    def pick(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.index_select(0, idx)

    return replace(mx, qdata=pick(mx.qdata), scales=pick(mx.scales), shape=torch.Size((idx.shape[0], mx.k)),
                   macro_scales=pick(mx.macro_scales), outlier_values=pick(mx.outlier_values),
                   outlier_indices=pick(mx.outlier_indices))


def slice_rows(mx: MXTensor, start: int, end: int) -> MXTensor:
    """Rows [start, end) of a rows-layout MXTensor (X, K), axis 1 (views)."""

    def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t[start:end]

    return replace(mx, qdata=cut(mx.qdata), scales=cut(mx.scales), shape=torch.Size((end - start, mx.k)),
                   macro_scales=cut(mx.macro_scales), outlier_values=cut(mx.outlier_values),
                   outlier_indices=cut(mx.outlier_indices))


def grouped_matmul(a: MXTensor | torch.Tensor, w: MXTensor, num_experts: int, offsets: torch.Tensor,
                   gather: Optional[torch.Tensor], bias: Optional[torch.Tensor], activation: Optional[str],
                   out_dtype: torch.dtype, decode_rows: Callable[[MXTensor], torch.Tensor]) -> torch.Tensor:
    """:meth:`portable_mx.registry.Backend.grouped_matmul` in plain torch, with
    ``decode_rows`` the reference's exact dequantization of a rows-layout MXTensor to
    fp32 [R, Kp] (reference.decode_rows)."""
    from ..moe import activations

    k = w.k
    n = w.shape[0] // num_experts
    if isinstance(a, torch.Tensor):
        aq = a.to(torch.float32)
        if gather is not None:
            aq = aq.index_select(0, gather.to(torch.int64))
    else:
        aq = decode_rows(a if gather is None else take_rows(a, gather))[:, :k]
    rows = aq.shape[0]
    h = torch.zeros(rows, n, dtype=torch.float32, device=aq.device)
    start = 0
    with HighestPrecision():
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                we = decode_rows(slice_rows(w, e * n, (e + 1) * n))[:, :k]
                h[start:end] = aq[start:end] @ we.T
                if bias is not None:
                    h[start:end] += bias[e].to(torch.float32)
            start = end
    out = activations.apply(h, activation)
    return out if out_dtype == torch.float32 else out.to(out_dtype)


def combine(rows: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor], k: int,
            out_dtype: torch.dtype) -> torch.Tensor:
    """:meth:`portable_mx.registry.Backend.combine` in plain torch: the k terms added in
    slot order, each product and sum one fp32 operation (fp64 for fp64 rows)."""
    idx = index.to(torch.int64).view(-1, k)
    w = None if weights is None else weights.to(torch.float32)
    acc = None
    for j in range(k):
        term = rows.index_select(0, idx[:, j])
        if w is not None:
            term = term * w[:, j:j + 1]
        acc = term if acc is None else acc + term
    return acc if out_dtype == torch.float32 else acc.to(out_dtype)
