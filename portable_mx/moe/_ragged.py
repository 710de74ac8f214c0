"""Ragged (per-expert) helpers of the grouped GEMM's backward, on the device without a
host sync where torch allows it.

- :func:`expert_of_rows`: the expert of each expert-sorted row.
- :func:`rows_product` (ragged M), :func:`k_product` (ragged K) and :func:`column_sums`:
  the high-precision grouped products (fp32, fp64 for fp64 input, at the highest matmul
  precision) of the backward GEMMs that quantize nothing, through
  ``torch.nn.functional.grouped_mm`` where this torch has it and takes the operands,
  else a loop over the experts (which reads the offsets on the host). These are the
  torch forms of :meth:`portable_mx.registry.Backend.ragged_rows` / ``ragged_k``: on a
  GPU, grouped_mm too reads the offsets on the host except for bf16 on sm_90 / sm_100,
  so the Triton backends run their own kernels (backends/triton/ragged.py).
- :func:`pad_experts`: the rows of each expert moved to a segment that starts at a
  multiple of ``block`` and is zero-padded to one, so that quantizing along the rows
  (the dW GEMM's reduction axis) never puts two experts in one block.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._precision import HighestPrecision


def _starts(ends: torch.Tensor) -> torch.Tensor:
    return torch.cat([ends.new_zeros(1), ends[:-1]])


def expert_of_rows(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 [rows]: the expert e of each sorted row (offsets[e-1] <= row < offsets[e])."""
    r = torch.arange(rows, device=offsets.device, dtype=torch.int64)
    return torch.searchsorted(offsets.to(torch.int64), r, right=True)


def _dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor):
    """``torch.nn.functional.grouped_mm(a, b, offs=offsets)``, or None where this torch
    lacks it or refuses the operands (dtype, device, alignment)."""
    fn = getattr(torch.nn.functional, "grouped_mm", None)
    if fn is None:
        return None
    try:
        return fn(a, b, offs=offsets)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return None


def rows_product(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[R, Q]: row i of expert e is ``a[i] @ b[e]``; a [R, P] (expert-sorted rows), b
    [E, P, Q], offsets int32 [E] (the rows' ends), in high precision."""
    dtype = _dtype(a, b)
    a, b = a.to(dtype).contiguous(), b.to(dtype).contiguous()
    with HighestPrecision():
        out = _grouped_mm(a, b, offsets)
        if out is not None:
            return out
        out = a.new_zeros(a.shape[0], b.shape[2])
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                out[start:end] = a[start:end] @ b[e]
            start = end
    return out


def k_product(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
              out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """[E, P, Q]: ``a_e^T @ b_e`` over the rows of each expert e (zero for an empty one);
    a [R, P], b [R, Q] (expert-sorted rows), offsets int32 [E], in high precision.

    With bf16 ``a`` and ``b`` and ``out_dtype`` bf16 the products are exact in fp32 and the
    result is rounded once to bf16 in any case, so bf16's grouped_mm serves (fp32
    accumulation, one rounding; CUDA's grouped_mm takes bf16 only and returns the input's
    dtype, where fp32 operands fall back to a loop over the experts that reads the
    offsets on the host)."""
    if out_dtype is torch.bfloat16 and a.dtype is torch.bfloat16 and b.dtype is torch.bfloat16:
        out = _k_grouped(a, b, offsets)
        if out is not None:
            return out
    dtype = _dtype(a, b)
    a, b = a.to(dtype), b.to(dtype).contiguous()
    with HighestPrecision():
        out = _k_grouped(a, b, offsets)
        if out is not None:
            return out
        out = a.new_zeros(offsets.shape[0], a.shape[1], b.shape[1])
        start = 0
        for e, end in enumerate(offsets.tolist()):
            if end > start:
                out[e] = a[start:end].T @ b[start:end]
            start = end
    return out


def column_sums(a: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[E, P]: the sum of the rows of each expert e (zero for an empty one); a [R, P]
    (expert-sorted rows), offsets int32 [E], in high precision (the bias gradient)."""
    return k_product(a, a.new_ones(a.shape[0], 1), offsets)[:, :, 0]


def grouped_k_product(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> Optional[torch.Tensor]:
    """:func:`k_product` of bf16 ``a`` and ``b`` into bf16 by grouped_mm (fp32
    accumulation, one rounding), or None where grouped_mm refuses them. On a CUDA GPU
    every expert's row count must be a multiple of 8 (grouped_mm's kernel asserts on the
    device otherwise): :func:`pad_experts`."""
    return _k_grouped(a, b, offsets)


def _k_grouped(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor):
    """:func:`k_product` by grouped_mm in a's dtype, its empty experts zeroed (grouped_mm
    leaves their outputs as they come), or None where grouped_mm refuses the operands."""
    out = _grouped_mm(a.T.contiguous(), b.contiguous(), offsets)
    if out is None or out.shape != (offsets.shape[0], a.shape[1], b.shape[1]):
        return None
    empty = (offsets - torch.cat([offsets.new_zeros(1), offsets[:-1]])) == 0
    return torch.where(empty[:, None, None], 0.0, out)


def pad_experts(offsets: torch.Tensor, rows: int, block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(positions int64 [rows], padded offsets int32 [E], padded rows Rp): sorted row i
    of expert e goes to position ``padded_start[e] + (i - start[e])``, each expert's
    segment starting at a multiple of ``block`` and ``Rp`` (a multiple of ``block``) a
    bound of the padded rows that depends on the shapes alone."""
    ends = offsets.to(torch.int64)
    starts = _starts(ends)
    counts = ends - starts
    padded = (counts + block - 1) // block * block
    pends = torch.cumsum(padded, 0)
    pstarts = pends - padded
    e = expert_of_rows(offsets, rows)
    pos = pstarts[e] + torch.arange(rows, device=offsets.device, dtype=torch.int64) - starts[e]
    bound = rows + min(offsets.shape[0], rows) * (block - 1)
    return pos, pends.to(torch.int32), -(-bound // block) * block


def scatter_rows(x: torch.Tensor, pos: torch.Tensor, rows: int) -> torch.Tensor:
    """A zero [rows, *x.shape[1:]] tensor with x's row i at ``pos[i]``."""
    out = x.new_zeros(rows, *x.shape[1:])
    out[pos] = x
    return out
