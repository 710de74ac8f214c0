"""The public grouped GEMM: validate once, then hand the problem down (to the custom op
when a gradient is needed or when compiled, else straight to the dispatch)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from .._flags import as_bool
from .._sharding import is_dtensor
from .._transforms import refuse_func_transforms
from ..ops import _recipe, dense_error, refuse_distributed
from ..recipe import QuantRecipe
from ..tensor import FLOAT_DTYPES, MXTensor
from . import _custom_ops, activations
from . import _dispatch as moe_dispatch
from .routing import Routing, check_routing, tile_schedule

Operand = Union[torch.Tensor, MXTensor]


def _fail(msg: str, kind=ValueError):
    raise kind(f"grouped_matmul: {msg}")


def _check_offsets(offsets: torch.Tensor, rows: int) -> None:
    """Non-decreasing, in [0, rows], ending at rows: raised here on the CPU, asserted on
    the device elsewhere (no host sync)."""
    if offsets.device.type == "meta":
        return
    ends = offsets.to(torch.int64)
    bad = (ends[-1] != rows) | (ends < 0).any() | (ends[1:] < ends[:-1]).any()
    compiling = torch.compiler.is_compiling()
    if offsets.device.type == "cpu" and not compiling:
        if bad:
            _fail(f"offsets must be non-decreasing cumulative ends of the {rows} rows (offsets[-1] == {rows}); "
                  f"got {offsets.tolist()}")
        return
    # traced, no row count in the message: formatting it made the compiled graph's row count a
    # constant (one graph per count; mark_dynamic refused)
    ends_of = "x's rows (offsets[-1] == the number of rows)" if compiling else \
        f"the {rows} rows (offsets[-1] == {rows})"
    torch._assert_async(~bad, f"grouped_matmul: offsets must be non-decreasing cumulative ends of {ends_of}")


def grouped_matmul(x: Operand, w: Operand, *, offsets: Optional[torch.Tensor] = None,
                   routing: Optional[Routing] = None, gather: bool = False, scatter: bool = False,
                   bias: Optional[torch.Tensor] = None, activation: Optional[str] = None,
                   recipe: Optional[QuantRecipe] = None) -> torch.Tensor:
    """A grouped GEMM over ragged experts: every row times the weight of its expert.

    Operands:

    - ``w``: the expert weights, an MXTensor of shape [E, N, K] quantized along K (axis 2:
      the gpt-oss checkpoint bytes, ``pmx.quantize(w, axis=-1)``; MBS and OF recipes
      allowed), or a float tensor [E, N, K], quantized along K with ``recipe``
      (differentiable). Its dtype may differ from x's: it is quantized from its own
      values (its gradient is computed and returned in its dtype).
    - ``x``: float [X, K] (fp32, bf16, fp16; fp64 is rounded to fp32 where it is
      quantized), quantized along K with ``recipe``, or rounded to 16 bits with
      ``recipe.activations`` "bf16"/"fp16" (W4A16); or an MXTensor [X, K] along K (A4W4).
    - exactly one of ``offsets``: int32 [E], the cumulative ends of x's rows, already
      sorted by expert (``torch.nn.functional.grouped_mm``'s ``offs``: expert e owns rows
      ``offsets[e-1] .. offsets[e] - 1``; ``offsets[-1] == X``), and ``routing`` (from
      :func:`portable_mx.route`, T tokens, k slots, R = T*k expert-sorted rows):

      - ``gather=True``: x is [T, K] in token order; row i of the result (R rows in
        expert-sorted order) is ``x[routing.gather_index[i]] @ W[e]^T``. In A4W4, x is
        quantized as given ([T, K]), then its rows gathered.
      - ``scatter=True``: the result is [T, N'], ``out[t] = sum over j = 0 .. k-1, in
        that order, of weights[t, j] * (the row of (t, j))`` in fp32 (deterministic; the
        rows' bias and activation come first, as in gpt-oss); without ``gather`` x is
        the [R, K] expert-sorted rows.
      - both: one projection from tokens to tokens; neither: x [R, K] sorted -> [R, N'].

    - ``bias``: float [E, N], added in fp32 before the activation; ``activation``: None,
      "swiglu_oai" (gpt-oss: interleaved gate/up, clamped) or "swiglu" (concatenated
      [gate | up], SiLU(gate) * up): then N' = N/2, else N' = N
      (:mod:`portable_mx.moe.activations`).

    Returns x's dtype (an MXTensor x's original dtype): the fp32-accumulated product of
    the dequantized operands, plus bias, activated and (with scatter) combined in fp32,
    rounded once; exact up to fp32 accumulation order (with fp16 activations on a GPU,
    for expert block scales 2**-23 .. 2**13: see :func:`portable_mx.matmul`). Empty experts, ragged and skewed
    routings, any T and k work; nothing reads device memory from the host (the checks of
    offsets and ids are device assertions off the CPU), so the call can be captured in a
    CUDA graph and traced by ``torch.compile(fullgraph=True)`` (as one
    ``portable_mx::grouped_mm`` op).

    Autograd: differentiable in a float x, a float w, bias and ``routing.weights`` (the
    router). The backward GEMMs follow ``recipe.grad_input`` / ``recipe.grad_weight`` as
    :func:`portable_mx.matmul`'s do (:mod:`portable_mx.moe._custom_ops`).
    """
    if recipe.__class__ is not QuantRecipe:
        recipe = _recipe(recipe)
    activation = activations.check(activation)
    x_mx, w_mx = isinstance(x, MXTensor), isinstance(w, MXTensor)
    if w_mx:
        if len(w.shape) != 3 or w.axis != 2:
            _fail(f"an MXTensor w must be [E, N, K] quantized along K (axis 2, "
                  f"pmx.quantize(w, axis=-1)); got shape {tuple(w.shape)} along axis {w.axis}")
    elif not isinstance(w, torch.Tensor) or w.dtype not in FLOAT_DTYPES or w.dim() != 3:
        _fail(f"w must be an MXTensor or a float tensor [E, N, K]; got "
              f"{type(w).__name__} {tuple(getattr(w, 'shape', ()))}", TypeError)
    if x_mx:
        if len(x.shape) != 2 or x.axis != 1:
            _fail(f"an MXTensor x must be [X, K] quantized along K (axis 1); got shape {tuple(x.shape)} "
                  f"along axis {x.axis}")
    elif not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES or x.dim() != 2:
        _fail(f"x must be a float tensor [X, K] or an MXTensor; got {type(x).__name__} "
              f"{getattr(x, 'dtype', '')} {tuple(getattr(x, 'shape', ()))}", TypeError)
    for name, t in (("x", x), ("w", w), ("bias", bias)):
        if isinstance(t, torch.Tensor):
            if t.layout is not torch.strided:
                _fail(dense_error(name, t), TypeError)
            if is_dtensor(t):  # (the message formatted only then: ~0.1 us a tensor on the hot path)
                refuse_distributed(f"grouped_matmul: {name}", t)
    num_experts, n, k = w.shape
    rows_x, kx = x.shape
    device = w.device
    if kx != k:
        _fail(f"x is [{rows_x}, {kx}] but w is {tuple(w.shape)}: K differs")
    if x.device != device:
        _fail(f"x and w must be on the same device; got {x.device} and {device}")
    if num_experts < 1 or n < 1 or k < 1:
        _fail(f"w must have E, N, K >= 1; got {tuple(w.shape)}")
    if activation is not None and n % 2:
        _fail(f"activation {activation!r} needs an even N (gate/up pairs); got N={n}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype not in FLOAT_DTYPES or tuple(bias.shape) != (num_experts, n):
            _fail(f"bias must be a float tensor [E, N] = [{num_experts}, {n}]; got "
                  f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
        if bias.device != device:
            _fail(f"bias must be on w's device {device}; got {bias.device}")

    gather, scatter = as_bool(gather, "grouped_matmul: gather"), as_bool(scatter, "grouped_matmul: scatter")
    if (offsets is None) == (routing is None):
        _fail("give exactly one of offsets (rows already sorted by expert) and routing (pmx.route)")
    if offsets is not None:
        if gather or scatter:
            _fail("gather and scatter need a routing (pmx.route), not offsets")
        if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int32 or offsets.shape != (num_experts,):
            _fail(f"offsets must be an int32 tensor [E] = [{num_experts}] of cumulative row ends; got "
                  f"{getattr(offsets, 'dtype', type(offsets).__name__)} {tuple(getattr(offsets, 'shape', ()))}")
        if offsets.device != device:
            _fail(f"offsets must be on w's device {device}; got {offsets.device}")
        _check_offsets(offsets, rows_x)
        rows, tokens = rows_x, 0
    else:
        if not isinstance(routing, Routing):
            _fail(f"routing must be a pmx.Routing (pmx.route); got {type(routing).__name__}", TypeError)
        if routing.num_experts != num_experts:
            _fail(f"the routing is over {routing.num_experts} experts, w has {num_experts}")
        if routing.device != device:
            _fail(f"the routing must be on w's device {device}; got {routing.device}")
        check_routing(routing)  # (one built by hand: its indices address memory)
        rows, tokens = routing.rows, routing.num_tokens
        want = tokens if gather else rows
        if rows_x != want:
            what = "tokens (gather=True)" if gather else "expert-sorted rows (gather=False)"
            _fail(f"x must have the routing's {want} {what}; got {rows_x} rows")
        offsets = routing.offsets
    out_rows = tokens if scatter else rows
    n_out = n // 2 if activation else n
    if out_rows == 0 or rows == 0:
        out = torch.zeros(out_rows, n_out, dtype=x.dtype, device=device)
        if torch.is_grad_enabled():  # in the graph: zero gradients (not none) for what needs one
            for t in (None if x_mx else x, None if w_mx else w, bias, routing.weights if scatter else None):
                if t is not None and t.requires_grad:
                    out = out + t.reshape(-1)[:0].sum().to(out.dtype)  # (an empty sum: 0, never NaN)
        return out

    grad = torch.is_grad_enabled() and (
        (not x_mx and x.requires_grad) or (not w_mx and w.requires_grad)
        or (bias is not None and bias.requires_grad) or (scatter and routing.weights.requires_grad))
    refuse_func_transforms("grouped_matmul", x, w, bias, None if routing is None else routing.weights)
    if torch.compiler.is_compiling():
        return _custom_ops.mx_grouped_matmul(x, w, recipe, offsets, routing, gather, scatter, bias, activation)
    if grad:
        return _custom_ops.mx_grouped_matmul(x, w, recipe, offsets, routing, gather, scatter, bias, activation)
    if routing is not None:
        return moe_dispatch.grouped(x, w, recipe, offsets, routing.gather_index if gather else None,
                                    routing.scatter_index if scatter else None, routing.weights, routing.k, bias,
                                    activation, x.dtype, routing.schedule)
    return moe_dispatch.grouped(x, w, recipe, offsets, None, None, None, 0, bias, activation, x.dtype,
                                lambda tile_m: tile_schedule(offsets, rows, tile_m))
