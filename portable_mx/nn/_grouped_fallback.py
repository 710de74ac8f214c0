"""TEMPORARY: a per-expert loop with the contract of ``pmx.route`` / ``pmx.grouped_matmul``,
until the grouped GEMM lands (branch moe-kernel). Deleted at that merge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import ops
from ..recipe import QuantRecipe
from ..tensor import MXTensor


@dataclass
class Routing:
    order: torch.Tensor  # [T*k] (token, slot) pairs sorted by expert (stable)
    offsets: torch.Tensor  # int32 [E] cumulative ends
    gather_indx: torch.Tensor  # [T*k] token of each sorted row
    weights: Optional[torch.Tensor]  # [T*k] in sorted order
    num_tokens: int
    k: int
    num_experts: int


def route(topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor], num_experts: int) -> Routing:
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    w = None if topk_weights is None else topk_weights.reshape(-1)[order]
    return Routing(order, offsets, order // k, w, t, k, num_experts)


def _swiglu_oai(h: torch.Tensor) -> torch.Tensor:
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(max=7.0)
    up = up.clamp(-7.0, 7.0)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _expert_weight(w, e: int):
    """[K, N] operand of expert e: an MXTensor along axis 0, or float w[e].T."""
    if isinstance(w, MXTensor):
        q = w.qdata[e]
        s = w.scales[e]
        n, k = w.shape[1], w.shape[2]
        macro = None if w.macro_scales is None else w.macro_scales[e]
        ov = None if w.outlier_values is None else w.outlier_values[e]
        oi = None if w.outlier_indices is None else w.outlier_indices[e]
        return MXTensor(qdata=q, scales=s, shape=torch.Size((k, n)), dtype=w.dtype, axis=0, recipe=w.recipe,
                        macro_scales=macro, outlier_values=ov, outlier_indices=oi)
    return w[e].T


def grouped_matmul(x, w, *, offsets=None, routing=None, gather=False, scatter=False, bias=None, activation=None,
                   recipe: Optional[QuantRecipe] = None):
    recipe = QuantRecipe() if recipe is None else recipe
    r = routing
    rows = x[r.gather_indx] if gather else x
    e_count = w.shape[0]
    outs = []
    start = 0
    ends = r.offsets.tolist()
    for e in range(e_count):
        end = ends[e]
        if end > start:
            xe = rows[start:end]
            we = _expert_weight(w, e)
            if isinstance(we, MXTensor) and we.dtype != xe.dtype:
                we = MXTensor(qdata=we.qdata, scales=we.scales, shape=we.shape, dtype=xe.dtype, axis=0,
                              recipe=we.recipe, macro_scales=we.macro_scales, outlier_values=we.outlier_values,
                              outlier_indices=we.outlier_indices)
            y = ops.matmul(xe, we, recipe).float()
            if bias is not None:
                y = y + bias[e].float()
            outs.append(y)
        start = end
    y = torch.cat(outs) if outs else x.new_zeros(0, w.shape[1]).float()
    if activation == "swiglu_oai":
        y = _swiglu_oai(y)
    elif activation == "swiglu":
        y = _swiglu(y)
    if not scatter:
        return y.to(x.dtype)
    out = torch.zeros(r.num_tokens * r.k, y.shape[1], dtype=torch.float32)
    wts = r.weights.float()[:, None] if r.weights is not None else 1.0
    out = out.index_copy(0, r.order, y * wts)
    return out.view(r.num_tokens, r.k, -1).sum(1).to(x.dtype)
