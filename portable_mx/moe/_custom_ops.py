"""The grouped GEMM as ``portable_mx::`` torch custom ops with their autograd rule (the
twin of :mod:`portable_mx._custom_ops` for the grouped op; same conventions: registered
with ``Library.define``/``impl``, fake implementations for ``torch.compile`` and meta
tensors, recipes as their JSON, MXTensor operands as their parts in the rows layout).

``portable_mx::grouped_mm(Tensor x, Tensor w, Tensor[] x_parts, Tensor[] w_parts,
Tensor offsets, Tensor? gather_index, Tensor? scatter_index, Tensor? topk_weights,
Tensor? bias, Tensor? schedule, int schedule_tile_m, bool gather, bool scatter, int k,
str activation, str recipe, str x_recipe, str w_recipe) -> Tensor``
    The forward of :func:`portable_mx.grouped_matmul`. x: float ``[X, K]``; w: float
    ``[E, N, K]``; offsets: int32 ``[E]``, the ends of the R expert-sorted rows. An operand
    with empty parts is quantized inside with ``recipe`` (x along K, or rounded to 16 bits
    for W4A16; w along K); non-empty parts are its MXTensor's (x: rows ``[X, ...]``, w:
    rows ``[E*N, ...]``) with its recipe's JSON, and its values only serve the backward.
    With a routing, gather_index and scatter_index are its int32 ``[R]`` indices (both
    given whenever ``gather`` or ``scatter`` is set: the backward of a gather sums through
    the scatter index) and ``k`` its slots per token; ``gather``: row i reads x's row
    ``gather_index[i]``; ``scatter``: the output is ``[T, N']``, out[t] the sum over j in
    order of topk_weights[t, j] (``[T, k]``) times the row of (t, j). bias: float
    ``[E, N]``; activation: "" or a name of :mod:`.activations`; schedule: the routing's
    precomputed tile schedule for tiles of ``schedule_tile_m`` rows, or None. Returns
    ``[R or T, N']`` in x's dtype. Differentiable in x, w, bias and topk_weights.

``portable_mx::grouped_mm_grad(Tensor grad, <grouped_mm's inputs but the schedule>,
bool[4] needs) -> Tensor[]``
    The four gradients (x, w, bias, topk_weights) of ``grouped_mm``, each an empty tensor
    where ``needs`` says it is not wanted. Its own backward raises (no double backward).

Backward (straight-through: the quantizers' derivative is 1). With A the left rows (x,
gathered), H = A W_e^T + b_e (fp32, recomputed by the forward GEMM when the activation or
the router gradient needs it), Z = act(H), dY the output gradient:

- dZ: with a scatter, the row of (t, j) gets ``topk_weights[t, j] * dY[t]``, and
  ``d topk_weights[t, j] = <dY[t], Z[row of (t, j)]>`` (fp32); else dZ = dY.
- dH = dZ * act'(H); ``d bias[e]`` = the sum of expert e's rows of dH (fp32).
- dX = dH @ W_e per row's expert: ``recipe.grad_input == "mxfp4"``: the grouped GEMM of
  dH (quantized along N, or rounded to 16 bits with 16-bit ``activations``) and W
  quantized along N (from w's values: a float w's, or an MXTensor's dequantized ones);
  "high": the high-precision product with W's values. A gathering call then sums each
  token's k rows in slot order (the backend's combine), rounded once to x's dtype.
- dW[e] = dH_e^T A_e over expert e's rows: quantized (both along the rows, each expert's
  rows padded to a multiple of 32, or of the macro block, so that no block spans two
  experts) when ``recipe.grad_weight == "mxfp4"`` and the activations are MXFP4, high
  precision otherwise, with A's values (x's, unrounded; an MXTensor x's dequantized).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import _dispatch
from .._custom_ops import _op_operand, placeholder, recipe_from_json, recipe_json
from .._transforms import _transforms_active, batched, refuse_func_transforms
from ..recipe import QuantRecipe
from ..tensor import FLOAT_DTYPES, MXTensor, part_specs
from . import _ragged, activations
from . import _dispatch as moe_dispatch
from .routing import tile_schedule

_LIB = torch.library.Library("portable_mx", "FRAGMENT")
_ARGS = ("Tensor x, Tensor w, Tensor[] x_parts, Tensor[] w_parts, Tensor offsets, Tensor? gather_index, "
         "Tensor? scatter_index, Tensor? topk_weights, Tensor? bias")
_FLAGS = "bool gather, bool scatter, int k, str activation, str recipe, str x_recipe, str w_recipe"
_LIB.define(f"grouped_mm({_ARGS}, Tensor? schedule, int schedule_tile_m, {_FLAGS}) -> Tensor")
_LIB.define(f"grouped_mm_grad(Tensor grad, {_ARGS}, {_FLAGS}, bool[4] needs) -> Tensor[]")


# ----------------------------------------------------------------------------- checks


def _fail(msg: str) -> None:
    raise ValueError(f"grouped_mm: {msg}")


def _check_parts(parts, recipe_text: str, rows: int, k: int, device, name: str) -> None:
    if not parts:
        if recipe_text:
            _fail(f"{name}_recipe is set but {name}_parts is empty")
        return
    spec = part_specs(recipe_from_json(recipe_text), rows, k)
    if len(parts) != len(spec):
        _fail(f"{name}_parts must be [{', '.join(s[0] for s in spec)}]; got {len(parts)} tensor(s)")
    for p, (what, dtype, shape) in zip(parts, spec):
        if p.dtype != dtype or tuple(p.shape) != shape or p.device != device:
            _fail(f"{name}_parts {what} must be {dtype} {shape} on {device}; got {p.dtype} {tuple(p.shape)} "
                  f"on {p.device}")


def _index(t: Optional[Tensor], name: str, rows: int, device) -> None:
    if t is not None and (t.dtype != torch.int32 or tuple(t.shape) != (rows,) or t.device != device):
        _fail(f"{name} must be int32 [{rows}] on {device}; got {t.dtype} {tuple(t.shape)} on {t.device}")


def _check(x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias, gather, scatter, k,
           activation, recipe, x_recipe, w_recipe) -> tuple[int, int, int]:
    """Validate the op's inputs; return (R sorted rows, T tokens or 0, N')."""
    for name, t, nd in (("x", x, 2), ("w", w, 3)):
        if not isinstance(t, Tensor) or t.dtype not in FLOAT_DTYPES or t.dim() != nd:
            _fail(f"{name} must be a {nd}-D float tensor; got {getattr(t, 'dtype', t)} {tuple(getattr(t, 'shape', ()))}")
    e, n, kk = w.shape
    if x.shape[1] != kk:
        _fail(f"x is {tuple(x.shape)} but w is {tuple(w.shape)}: K differs")
    device = w.device
    recipe_from_json(recipe)
    _check_parts(x_parts, x_recipe, x.shape[0], kk, device, "x")
    _check_parts(w_parts, w_recipe, e * n, kk, device, "w")
    if offsets.dtype != torch.int32 or tuple(offsets.shape) != (e,) or offsets.device != device:
        _fail(f"offsets must be int32 [{e}] on {device}; got {offsets.dtype} {tuple(offsets.shape)}")
    if (gather or scatter) and (gather_index is None or scatter_index is None or k < 1):
        _fail("gather and scatter need the routing's gather_index, scatter_index and k")
    rows = gather_index.shape[0] if gather_index is not None else x.shape[0]
    _index(gather_index, "gather_index", rows, device)
    _index(scatter_index, "scatter_index", rows, device)
    if rows % max(k, 1) and (gather or scatter):
        _fail(f"the rows ({rows}) are not a multiple of k={k}")
    tokens = rows // k if (gather or scatter) else 0
    if not gather and x.shape[0] != rows:
        _fail(f"x must have the {rows} expert-sorted rows without gather; got {x.shape[0]}")
    if gather and x.shape[0] != tokens:
        _fail(f"x must have the {tokens} tokens with gather; got {x.shape[0]}")
    if scatter and (topk_weights is None or tuple(topk_weights.shape) != (tokens, k)):
        _fail(f"scatter needs topk_weights [{tokens}, {k}]")
    if bias is not None and tuple(bias.shape) != (e, n):
        _fail(f"bias must be [{e}, {n}]; got {tuple(bias.shape)}")
    act = activations.check(activation or None)
    if act is not None and n % 2:
        _fail(f"a gated activation needs an even N; got N={n}")
    return rows, tokens, n // 2 if act else n


# ----------------------------------------------------------------------------- operands


def _operands(x, w, x_parts, w_parts, x_recipe, w_recipe):
    e, n, k = w.shape
    x_op = MXTensor.from_parts(x_parts, x.shape, x.dtype, 1, recipe_from_json(x_recipe)) if x_parts else x
    w_op = MXTensor.from_parts(w_parts, (e * n, k), w.dtype, 1, recipe_from_json(w_recipe)) if w_parts else w
    return x_op, w_op


def _forward(x_op, w_op, r: QuantRecipe, offsets, gather_index, scatter_index, topk_weights, bias, gather, scatter,
             k, act, out_dtype, schedule=None, schedule_tile_m=0):
    rows = gather_index.shape[0] if gather_index is not None else x_op.shape[0]

    def sched(tile_m: int) -> Tensor:
        if schedule is not None and tile_m == schedule_tile_m:
            return schedule
        return tile_schedule(offsets, rows, tile_m)

    return moe_dispatch.grouped(x_op, w_op, r, offsets, gather_index if gather else None,
                                scatter_index if scatter else None, topk_weights, k, bias, act, out_dtype, sched)


# ----------------------------------------------------------------------------- the ops


def _grouped_mm(x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias, schedule,
                schedule_tile_m, gather, scatter, k, activation, recipe, x_recipe, w_recipe):
    rows, tokens, n_out = _check(x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias,
                                 gather, scatter, k, activation, recipe, x_recipe, w_recipe)
    if rows == 0:
        return x.new_zeros(tokens if scatter else rows, n_out)
    x_op, w_op = _operands(x, w, x_parts, w_parts, x_recipe, w_recipe)
    return _forward(x_op, w_op, recipe_from_json(recipe), offsets, gather_index, scatter_index, topk_weights, bias,
                    gather, scatter, k, activation or None, x.dtype, schedule, schedule_tile_m)


def _grouped_mm_fake(x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias, schedule,
                     schedule_tile_m, gather, scatter, k, activation, recipe, x_recipe, w_recipe):
    rows, tokens, n_out = _check(x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias,
                                 gather, scatter, k, activation, recipe, x_recipe, w_recipe)
    return x.new_empty(tokens if scatter else rows, n_out)


def _grouped_mm_grad(grad, x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias, gather,
                     scatter, k, activation, recipe, x_recipe, w_recipe, needs):
    rows, tokens, n_out = _check(x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias,
                                 gather, scatter, k, activation, recipe, x_recipe, w_recipe)
    r = recipe_from_json(recipe)
    act = activation or None
    e, n, kk = w.shape
    out = [grad.new_empty(0) for _ in range(4)]  # a gradient not asked for: its own empty tensor (outputs of
    if rows == 0:  # a custom op must not alias each other)
        return [t.new_zeros(t.shape) if need and t is not None else out[i]  # contiguous, as the fake says
                for i, (need, t) in enumerate(zip(needs, (x, w, bias, topk_weights)))]
    x_op, w_op = _operands(x, w, x_parts, w_parts, x_recipe, w_recipe)
    g = grad.to(torch.float32) if grad.dtype != torch.float64 else grad
    need_z = scatter and needs[3]
    h = None
    if act is not None or need_z:
        h = _forward(x_op, w_op, r, offsets, gather_index, scatter_index, topk_weights, bias, gather, False, k, None,
                     torch.float32)
    z = activations.apply(h, act) if h is not None else None
    if scatter:
        idx = scatter_index.to(torch.int64)
        weighted = (g[:, None, :] * topk_weights.to(g.dtype)[:, :, None]).reshape(rows, n_out)
        dz = torch.empty_like(weighted)
        dz[idx] = weighted
        if need_z:
            out[3] = (g[:, None, :] * z[idx].view(tokens, k, n_out)).sum(-1).to(topk_weights.dtype)
    else:
        dz = g
    dh = activations.backward(h, dz, act) if act is not None else dz
    if needs[0]:
        out[0] = _grad_x(dh, x, w, w_op, r, offsets, gather_index, scatter_index, gather, k)
    if needs[1]:
        out[1] = _grad_w(dh, x, x_op, r, offsets, gather_index, gather, w.dtype)
    if needs[2]:
        out[2] = moe_dispatch.ragged_k(dh, None, offsets, bias.dtype)
    return [t.contiguous() for t in out]  # the fake's strides: a transposed w or strided x gets a contiguous grad


def _weight_values(w: Tensor, w_op) -> Tensor:
    """w's high-precision values [E, N, K]: a float w itself, an MXTensor's dequantized
    (exact, fp32)."""
    if isinstance(w_op, Tensor):
        return w
    e, n, k = w.shape
    return _dispatch.dequantize(w_op, torch.float32).reshape(e, n, k)


def _grad_x(dh, x, w, w_op, r: QuantRecipe, offsets, gather_index, scatter_index, gather, k) -> Tensor:
    """dX: dH [R, N] times each row's expert weight [N, K], summed per token when gathered."""
    wv = _weight_values(w, w_op)
    rows = dh.shape[0]
    if r.grad_input == "mxfp4":
        wt = _dispatch.quantize(wv, r, 1).rows()  # W^T [E, K, N] along N: rows (E*K, N)
        da = moe_dispatch.grouped(dh, wt, r, offsets, None, None, None, k, None, None, torch.float32,
                                  lambda tile_m: tile_schedule(offsets, rows, tile_m))
    else:
        da = moe_dispatch.ragged_rows(dh, wv, offsets)
    if gather:  # (fp64 products, of fp64 operands' high-precision dX, are summed in fp64)
        da = da if da.dtype == torch.float64 else da.to(torch.float32)
        return moe_dispatch.combine(da, scatter_index, None, k, x.dtype)
    return da.to(x.dtype)


def _grad_w(dh, x, x_op, r: QuantRecipe, offsets, gather_index, gather, dtype) -> Tensor:
    """dW [E, N, K] = dH_e^T A_e over each expert's rows."""
    xv = x if isinstance(x_op, Tensor) else _dispatch.dequantize(x_op, torch.float32)
    a = xv.index_select(0, gather_index.to(torch.int64)) if gather else xv
    rows = dh.shape[0]
    if r.grad_weight == "mxfp4" and r.quantizes_activations:
        block = r.macro_block or 32
        pos, poffs, prows = _ragged.pad_experts(offsets, rows, block)
        ap = _ragged.scatter_rows(a.to(torch.float32) if a.dtype != torch.float64 else a, pos, prows)
        gp = _ragged.scatter_rows(dh, pos, prows)
        # without macro factors every dequantized value is a bf16 number: bf16 operands
        # where the gradient is bf16 (k_product then rounds the fp32 sums once)
        vdtype = torch.bfloat16 if dtype is torch.bfloat16 and r.macro_block is None else torch.float32
        aq = _dispatch.dequantize(_dispatch.quantize(ap, _dispatch.left_recipe(r), 0), vdtype)  # (X^T: the left)
        gq = _dispatch.dequantize(_dispatch.quantize(gp, r, 0), vdtype)
        dw = moe_dispatch.ragged_k(gq, aq, poffs, dtype)
    else:
        dw = moe_dispatch.ragged_k(dh, a, offsets, dtype)
    return dw  # (ragged_k rounded it to dtype)


def _grouped_mm_grad_fake(grad, x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias,
                          gather, scatter, k, activation, recipe, x_recipe, w_recipe, needs):
    _check(x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias, gather, scatter, k,
           activation, recipe, x_recipe, w_recipe)
    # contiguous whatever the strides of x or w (a transposed expert weight, GptOss's layout): the
    # real op's are, and inductor reads the real gradients with the strides said here
    return [t.new_empty(t.shape) if need and t is not None else grad.new_empty(0)
            for need, t in zip(needs, (x, w, bias, topk_weights))]


for _name, _impl, _fake in (("grouped_mm", _grouped_mm, _grouped_mm_fake),
                            ("grouped_mm_grad", _grouped_mm_grad, _grouped_mm_grad_fake)):
    _LIB.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"portable_mx::{_name}", _fake, lib=_LIB)


# ----------------------------------------------------------------------------- autograd

_N_TENSORS = 9  # x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias


def _setup_context(ctx, inputs, output) -> None:
    (x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias, _, _, *flags) = inputs
    ctx.num_parts = (len(x_parts), len(w_parts))
    ctx.absent = tuple(t is None for t in (gather_index, scatter_index, topk_weights, bias))
    present = [t for t in (gather_index, scatter_index, topk_weights, bias) if t is not None]
    # an MXTensor operand's x / w is a placeholder of its shape and dtype (its parts are its
    # values): not saved (a hook that copies saved tensors, save_on_cpu(pin_memory=True),
    # made each a dense buffer of its full size), made again in the backward
    ctx.placeholders = tuple((t.shape, t.dtype, t.device) if parts else None
                             for t, parts in ((x, x_parts), (w, w_parts)))
    ctx.save_for_backward(None if x_parts else x, None if w_parts else w, *x_parts, *w_parts, offsets, *present)
    ctx.flags = flags


def _backward(ctx, grad: Tensor):
    saved = list(ctx.saved_tensors)
    nx, nw = ctx.num_parts
    x, w = (t if meta is None else placeholder(*meta) for t, meta in zip(saved[:2], ctx.placeholders))
    x_parts, w_parts = saved[2:2 + nx], saved[2 + nx:2 + nx + nw]
    offsets = saved[2 + nx + nw]
    rest = iter(saved[3 + nx + nw:])
    gather_index, scatter_index, topk_weights, bias = (None if absent else next(rest) for absent in ctx.absent)
    needs = [bool(ctx.needs_input_grad[i]) for i in (0, 1, 8, 7)]
    if not any(needs):
        return (None,) * 2 + ([None] * nx, [None] * nw) + (None,) * 14
    if _transforms_active() or batched(grad):  # (torch's vmap fallback cannot batch an op returning a list)
        raise RuntimeError(
            "portable_mx grouped_matmul's backward does not take batched gradients (torch.autograd.grad("
            "is_grads_batched=True), torch.autograd.functional.jacobian(vectorize=True), vmap): loop over the "
            "gradient outputs instead, one torch.autograd.grad(..., retain_graph=True) each")
    dx, dw, db, dweights = torch.ops.portable_mx.grouped_mm_grad(
        grad.contiguous(), x, w, x_parts, w_parts, offsets, gather_index, scatter_index, topk_weights, bias,
        *ctx.flags, needs)
    pick = lambda t, need: t if need else None  # noqa: E731
    return (pick(dx, needs[0]), pick(dw, needs[1]), [None] * nx, [None] * nw, None, None, None,
            pick(dweights, needs[3]), pick(db, needs[2]), None, None, None, None, None, None, None, None, None)


torch.library.register_autograd("portable_mx::grouped_mm", _backward, setup_context=_setup_context, lib=_LIB)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(
        "double backward through the MXFP4 grouped GEMM is not supported: portable_mx::grouped_mm has a "
        "straight-through first derivative only. Compute that term with a high-precision model, or detach it.")


torch.library.register_autograd("portable_mx::grouped_mm_grad", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None, lib=_LIB)


# ----------------------------------------------------------------------------- the op path


def mx_grouped_matmul(x, w, recipe: QuantRecipe, offsets: Tensor, routing, gather: bool, scatter: bool,
                      bias: Optional[Tensor], activation: Optional[str]) -> Tensor:
    """:func:`portable_mx.grouped_matmul` through the ``portable_mx::grouped_mm`` op,
    differentiable in a float x, a float w, bias and the routing's weights (what the
    public op runs when a gradient is needed or when compiled). Inputs must be validated.
    An MXTensor operand enters as its parts (its values a placeholder, never saved): the
    backward dequantizes from them what a gradient needs, for that step only."""
    if not torch.compiler.is_compiling():
        refuse_func_transforms("grouped_matmul")
    # an MXTensor operand goes in as its parts, its values a placeholder: the op and its
    # backward read the parts (dequantizing what a gradient needs there; a dequantized copy
    # made here was saved for the backward and never read: for frozen gpt-oss-20b experts
    # about 1.6 GB a layer held from forward to backward)
    x_vals, x_parts, x_json = _op_operand(x)
    w_vals, w_parts, w_json = _op_operand(w)
    k = routing.k if routing is not None else 0
    schedule = routing.tile_schedule if routing is not None else None
    return torch.ops.portable_mx.grouped_mm(
        x_vals, w_vals, x_parts, w_parts, offsets,
        routing.gather_index if routing is not None else None,
        routing.scatter_index if routing is not None else None,
        routing.weights if (routing is not None and scatter) else None, bias, schedule,
        routing.tile_m if routing is not None else 0, gather, scatter, k, activation or "",
        recipe_json(recipe), x_json, w_json)
