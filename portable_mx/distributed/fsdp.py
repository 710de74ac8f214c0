"""The MXFP4 all-gather of MXLinear weights under FSDP2 (``fully_shard``).

FSDP2 keeps each weight ``W`` ``[N = out_features, K = in_features]`` sharded along N
(rank r holds rows ``[r*n, (r+1)*n)``, ``n = N / world``) and all-gathers the full
weight before each forward and each backward. By default it gathers the high-precision
shard (4 bytes per element in fp32, 2 under ``MixedPrecisionPolicy(param_dtype=bf16)``)
and MXLinear quantizes the full weight afterwards. :func:`enable_fsdp_mx_all_gather`
makes each rank quantize its own shard instead and gather only MXFP4 bytes:

- the forward copy, quantized along K (the forward GEMM's reduction axis): a block lies
  inside one row, so the rows of a shard quantize to the rows of the full weight;
- the dX copy, quantized along N (the reduction axis of ``dX = dY W``): a block is 32
  consecutive rows of one column, whole on one rank iff ``n`` is a multiple of 32 (and
  of the macro block under MBS, whose factor is a function of the macro block alone).

Both are sent at every gather (codes and E8M0 scales, plus macro factors / outliers), so
a forward recomputed under activation checkpointing finds its copy: 1.0625 bytes per
weight element for the default recipe (K a multiple of 32), against 2 for a bf16 gather
and 4 for fp32. Under those conditions the gathered bytes are exactly those of
quantizing the gathered high-precision weight, so training is **bit-identical** to
FSDP2's high-precision gather (and the dW GEMM never reads W). No collective is needed
to choose scales: MX scales are per block.

A layer gathers in high precision instead, with one warning naming it and the reason,
when the rows per rank are not a multiple of 32 (or of the macro block), under stochastic
rounding (a rank's counters are not the full tensor's), or with ``grad_input="high"``
(the dX GEMM needs the high-precision weight). The choice is made at the layer's first
all-gather, when every rank checks (one small collective, once per layer) that all ranks
agree on the layer's name, shape, dtype and recipe: a disagreement raises a ValueError on
every rank instead of gathering garbage or hanging.

Pieces (FSDP2's extension points, torch >= 2.5: ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the sharded parameter's local tensor):

- :class:`MXWeight`: the sharded weight, a wrapper tensor around the high-precision
  shard that every op (optimizer updates included) sees as that shard; its
  ``fsdp_pre_all_gather`` quantizes the shard.
- :class:`MXGathered`: the unsharded weight FSDP2 hands the layer, ``[N, K]`` in the
  parameter dtype but holding only the two MXFP4 copies; MXLinear's forward finds its
  ``__pmx_linear__`` and runs the GEMMs on those bytes (:class:`_GatheredLinear`: the
  ``portable_mx::mm`` op with the forward copy as the weight's parts, the dX GEMM with
  the dX copy as its weight's parts, the dW GEMM as MXLinear's own).
- state dict hooks keep the wrapper out of every state dict (plain tensors and
  DTensors only: a checkpoint does not depend on the gather setting, and
  ``torch.distributed.checkpoint`` loads it with the weights-only unpickler).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_map

from .. import ops
from .._custom_ops import recipe_json
from ..format import BLOCK_SIZE
from ..nn.linear import MXLinear
from ..recipe import QuantRecipe

aten = torch.ops.aten

__all__ = ["MXAllGatherFallback", "MXGathered", "MXWeight", "enable_fsdp_mx_all_gather", "gathered_bytes"]


class MXAllGatherFallback(UserWarning):
    """A layer prepared for the MXFP4 all-gather gathers its weight in high precision
    (the message names the layer and the reason)."""


# ----------------------------------------------------------------------------- per-layer state


@dataclasses.dataclass
class _Plan:
    """What a layer's all-gathers send, fixed at its first gather (FSDP2 sizes its
    buffers then): ``mode`` "mx" or "high", the recipe and dtype it was decided for,
    the number of forward-copy parts, and the weight's full shape."""

    mode: str
    recipe: QuantRecipe
    dtype: torch.dtype
    shape: tuple[int, int]
    num_k_parts: int = 0
    reason: str = ""


class _LayerState:
    """Shared by every wrapper FSDP2 derives from one layer's weight (chunks, views)."""

    __slots__ = ("name", "plan", "bytes_sent")

    def __init__(self, name: str) -> None:
        self.name = name
        self.plan: Optional[_Plan] = None
        self.bytes_sent = 0


def _fallback_reason(recipe: QuantRecipe, rows: int, world: int) -> str:
    """Why a weight of ``rows`` out_features cannot be gathered in MXFP4 on ``world``
    ranks with ``recipe`` ("" when it can)."""
    if world == 1:
        return ("one rank: FSDP2 gathers nothing there (its single-rank path takes the first of a weight's "
                "all-gather inputs only, so the MXFP4 parts would not reach the forward)")
    if recipe.rounding == "stochastic":
        return ("stochastic rounding: a rank quantizing its shard would draw other random numbers "
                "than quantizing the full weight")
    if recipe.grad_input == "high":
        return "grad_input='high': the backward's dX GEMM multiplies the high-precision weight"
    unit = BLOCK_SIZE if recipe.macro_block is None else math.lcm(BLOCK_SIZE, recipe.macro_block)
    if rows % world or (rows // world) % unit:
        what = "32" if recipe.macro_block is None else f"{unit} (32 and the macro block {recipe.macro_block})"
        per_rank = f"{rows / world:g}" if rows % world else str(rows // world)
        return (f"{per_rank} rows per rank ({rows} out_features over {world} ranks) is not a multiple of "
                f"{what}: the dX copy's blocks along out_features would straddle ranks")
    return ""


def _describe(state: _LayerState, plan: _Plan) -> tuple:
    return (state.name, plan.shape, str(plan.dtype), plan.recipe.model_dump_json(), plan.mode)


def _agree(state: _LayerState, plan: _Plan, mesh: Any) -> None:
    """Raise on every rank unless all ranks of ``mesh`` hold the same layer, shape,
    dtype and recipe (one all_gather_object, at the layer's first gather)."""
    import torch.distributed as dist

    group = mesh.get_group() if mesh.ndim == 1 else mesh.get_group(mesh.ndim - 1)
    mine = _describe(state, plan)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(d != mine for d in everyone):
        lines = "\n".join(
            f"  rank {r}: layer {d[0]!r}, weight {list(d[1])}, {d[2]}, recipe {QuantRecipe.model_validate_json(d[3]).describe()}"
            for r, d in enumerate(everyone))
        raise ValueError(
            f"MXFP4 all-gather of layer {state.name!r}: the ranks disagree on the layer they gather:\n{lines}\n"
            "Every rank must build the same model with the same recipes (and the same dtype) before fully_shard."
        )


def _make_plan(state: _LayerState, mesh: Any, shape: torch.Size, recipe: QuantRecipe, dtype: torch.dtype) -> _Plan:
    world = mesh.size()
    reason = _fallback_reason(recipe, shape[0], world)
    plan = _Plan(mode="high" if reason else "mx", recipe=recipe, dtype=dtype, shape=(shape[0], shape[1]),
                 reason=reason)
    _agree(state, plan, mesh)
    if reason:
        warnings.warn(f"MXFP4 all-gather: layer {state.name!r} gathers its weight in high precision ({dtype}): "
                      f"{reason}", MXAllGatherFallback, stacklevel=2)
    return plan


# ----------------------------------------------------------------------------- the sharded side

_PRESERVE = {
    aten.empty_like.default, aten.new_zeros.default, aten.new_empty.default, aten.slice.Tensor,
    aten.copy_.default, aten.view.default, aten.as_strided.default, aten._to_copy.default,
    aten._pin_memory.default, aten.split.Tensor, aten.split_with_sizes.default, aten.clone.default,
    aten.alias.default, aten.detach.default,
}
"""Ops whose results stay MXWeight: what FSDP2 does to a parameter at ``fully_shard``
(chunk, pad, copy, view, narrow), moves and copies. Everything else (the optimizer's
math, ``zeros_like`` for its state, the GEMMs of a forward outside FSDP2) runs on the
high-precision tensor and returns plain tensors."""


class MXWeight(Tensor):
    """The high-precision weight (or its FSDP2 shard) of a layer prepared by
    :func:`enable_fsdp_mx_all_gather`: a wrapper tensor with the shape, dtype and
    values of ``_tensor``, which every op reads and writes (in-place ops, the
    optimizer's included, update ``_tensor``). What it adds is FSDP2's all-gather
    extension: :meth:`fsdp_pre_all_gather` quantizes the shard, and
    :meth:`fsdp_post_all_gather` assembles the :class:`MXGathered` weight."""

    _tensor: Tensor
    _state: _LayerState
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, tensor: Tensor, state: _LayerState, requires_grad: bool = False) -> "MXWeight":
        return Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, device=tensor.device, layout=tensor.layout, requires_grad=requires_grad)

    def __init__(self, tensor: Tensor, state: _LayerState, requires_grad: bool = False) -> None:
        self._tensor = tensor
        self._state = state

    def __repr__(self) -> str:
        return f"MXWeight(layer={self._state.name!r}, {self._tensor!r})"

    @property
    def data(self) -> Tensor:
        """``Tensor.data``: a detached alias (an MXWeight of the same ``_tensor``)."""
        return torch._C.TensorBase.data.__get__(self, type(self))

    @data.setter
    def data(self, value: Tensor) -> None:
        # Tensor's own setter swapped the wrapper's storage and left ``_tensor``, which
        # every op reads: the forward, the state dict and the gather kept the old weight
        # (``w.data = t``, ``vector_to_parameters``, FSDP1's use_orig_params; audit of
        # 2026-11-28). The weight becomes ``value``'s tensor, as for a plain parameter.
        inner = value._tensor if isinstance(value, MXWeight) else value
        if not isinstance(inner, Tensor) or type(inner) is not Tensor and not isinstance(inner, nn.Parameter):
            raise TypeError(f"MXWeight of layer {self._state.name!r}: .data must be a plain tensor; got "
                            f"{type(value).__name__}")
        if inner.shape != self.shape or inner.dtype != self.dtype or inner.device != self.device:
            raise ValueError(
                f"MXWeight of layer {self._state.name!r}: .data must keep the weight's shape, dtype and device "
                f"({tuple(self.shape)}, {self.dtype}, {self.device}); got ({tuple(inner.shape)}, {inner.dtype}, "
                f"{inner.device}). A layer prepared by enable_fsdp_mx_all_gather is FSDP2's (fully_shard), which "
                "never does this; FSDP1 and other wrappers that resize parameters through .data cannot hold it: "
                "set a new nn.Parameter, or skip enable_fsdp_mx_all_gather for them")
        self._tensor = inner.detach() if isinstance(inner, nn.Parameter) else inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = None

        def unwrap(t):
            nonlocal state
            if isinstance(t, MXWeight):
                state = t._state
                return t._tensor
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func not in _PRESERVE:
            return out
        if args and isinstance(args[0], MXWeight) and out is args[0]._tensor:
            return args[0]  # in place (copy_): the same wrapper
        if torch.is_inference_mode_enabled():
            # a view FSDP2 takes at its lazy init, when the first forward runs under
            # inference_mode: a wrapper made there would be an inference tensor, whose
            # version counter autograd cannot tie to the base's (a RuntimeError that
            # left the model broken); made outside, it is an ordinary view
            with torch.inference_mode(False):
                return tree_map(lambda t: MXWeight(t, state) if type(t) is Tensor else t, out)
        return tree_map(lambda t: MXWeight(t, state) if type(t) is Tensor else t, out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._state

    @staticmethod
    def __tensor_unflatten__(inner: dict, state: _LayerState, outer_size, outer_stride) -> "MXWeight":
        return MXWeight(inner["_tensor"], state)

    @classmethod
    def __metadata_guard__(cls, original: _LayerState, current: _LayerState) -> bool:
        # torch.compile guards on a deep copy of the flatten context, which the default
        # (identity) equality never matched: "Guard failed on the same frame it was created"
        return original.name == current.name

    # ------------------------------------------------------------------ FSDP2's extension

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """This rank's all-gather inputs (FSDP2 calls it under no_grad with the local
        shard ``[n, K]``): the MXFP4 parts of the shard (cast to the policy's
        param_dtype first, as FSDP2's own gather would) quantized along K, then those
        quantized along N sent transposed (the shard dimension first); or the
        high-precision shard for a layer that falls back."""
        state = self._state
        recipe = module.recipe
        w = self._tensor
        if w.dim() != 2 or w.shape[1] != outer_size[1]:
            raise RuntimeError(
                f"MXFP4 all-gather of layer {state.name!r}: its weight {list(outer_size)} is sharded along dim 1 "
                f"(this rank holds {list(w.shape)}: a shard_placement_fn returning Shard(1)); the MXFP4 gather "
                "serves FSDP2's default dim-0 sharding only: shard MX layers with Shard(0), or do not call "
                "enable_fsdp_mx_all_gather")
        dtype = mp_policy.param_dtype if mp_policy is not None and mp_policy.param_dtype is not None else w.dtype
        plan = state.plan
        if plan is None:
            plan = state.plan = _make_plan(state, mesh, outer_size, recipe, dtype)
        elif (recipe is not plan.recipe and recipe != plan.recipe) or dtype != plan.dtype:
            raise RuntimeError(
                f"MXFP4 all-gather of layer {state.name!r}: its recipe or dtype changed after its first all-gather "
                f"({plan.recipe.describe()}, {plan.dtype} -> {recipe.describe()}, {dtype}); FSDP2 sizes the "
                "gather's buffers at the first gather: set recipes before training starts.")
        w = w.to(dtype)
        if plan.mode == "high":
            rows = -(-plan.shape[0] // mesh.size())  # FSDP2's padded shard (uneven sharding)
            if w.shape[0] != rows:
                w = torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])])
            inputs: tuple[Tensor, ...] = (w.contiguous(),)
        else:
            k_copy = ops.quantize(w, recipe, axis=1).parts()  # [n, Kp/2], [n, Kp/32], ...
            n_copy = ops.quantize(w, recipe, axis=0).rows().parts()  # [K, n/2], [K, n/32], ...
            plan.num_k_parts = len(k_copy)
            inputs = (*k_copy, *(p.movedim(1, 0).contiguous() for p in n_copy))
        if mesh.size() > 1:  # on one rank FSDP2 copies the inputs out without a collective
            state.bytes_sent += sum(t.numel() * t.element_size() for t in inputs)
        return inputs, plan

    def fsdp_post_all_gather(self, outputs, metadata: _Plan, param_dtype, *, out=None):
        """The unsharded weight from the gathered inputs (each the ranks' inputs
        concatenated along dim 0): high precision, or an :class:`MXGathered` whose dX
        copy is transposed back (``[K, N/2]``, ...) into tensors FSDP2 frees at
        reshard. With ``out`` (every gather after the first) ``out`` is refilled in
        place."""
        plan = metadata
        if plan.mode == "high":
            if out is None:
                return outputs[0][: plan.shape[0]], ()
            return None  # ``out`` views FSDP2's gather buffer, refilled already
        k_parts = list(outputs[: plan.num_k_parts])
        n_gathered = outputs[plan.num_k_parts:]
        # FSDP2 writes every gather into the same buffers (freed and regrown in place) under
        # torch.autograd._unsafe_preserve_version_counter: their versions never moved, and
        # the GPU backends' prepared copies of the parts (swizzled values and scales, kept
        # per storage and version: layouts._kept) served the first step's weight to every
        # later forward (sm_90 / gfx942 / sm_100 / gfx950 routes; audit of 2026-11-28)
        _written(k_parts)
        if out is None:
            n_parts = [t.movedim(0, 1).contiguous() for t in n_gathered]
            payload = _Payload(k_parts, n_parts, plan, self._state.name)
            return MXGathered(payload, param_dtype, outputs[0].device), tuple(n_parts)
        payload = out._payload
        for dst, src in zip(payload.n_parts, n_gathered):
            dst.copy_(src.movedim(0, 1))
        _written(payload.n_parts)  # (copy_ counts, except where FSDP2 runs this under the same guard)
        payload.k_parts = k_parts
        return None


def _written(parts: list[Tensor]) -> None:
    """Count a write into each of ``parts`` (``torch.autograd.graph.increment_version``):
    what reads their versions (the prepared copies of layouts._kept, weight caches) then
    sees new bytes. An inference tensor has no version (nothing keeps a copy of one)."""
    for t in parts:
        if not t.is_inference():
            torch.autograd.graph.increment_version(t)


# ----------------------------------------------------------------------------- the unsharded side


class _Payload:
    """The gathered MXFP4 copies of a weight ``[N, K]``: ``k_parts`` (rows layout
    ``[N, Kp/2]``, ``[N, Kp/32]``, ...: quantized along K) and ``n_parts`` (``[K, N/2]``,
    ``[K, N/32]``, ...: quantized along N), shared by every alias of one MXGathered."""

    __slots__ = ("k_parts", "n_parts", "plan", "name")

    def __init__(self, k_parts: list[Tensor], n_parts: list[Tensor], plan: _Plan, name: str) -> None:
        self.k_parts, self.n_parts, self.plan, self.name = k_parts, n_parts, plan, name


_ALIASES = {aten.detach.default, aten.alias.default, aten.as_strided.default, aten.view.default}
_FRESH = {aten.zeros_like.default, aten.empty_like.default}


class MXGathered(Tensor):
    """The all-gathered weight of an MXLinear under the MXFP4 all-gather: shape
    ``[out_features, in_features]`` and the parameter dtype, like the weight it stands
    for, but holding only its MXFP4 copies (:class:`_Payload`). MXLinear's forward
    runs its GEMMs on them (``__pmx_linear__``); aliasing ops (what FSDP2 does to an
    unsharded parameter) keep the bytes, ``zeros_like`` / ``empty_like`` give plain
    tensors, and any other op raises: the high-precision values are not here."""

    _payload: _Payload
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, payload: _Payload, dtype: torch.dtype, device: torch.device,
                requires_grad: bool = False) -> "MXGathered":
        return Tensor._make_wrapper_subclass(cls, payload.plan.shape, dtype=dtype, device=device,
                                             requires_grad=requires_grad)

    def __init__(self, payload: _Payload, dtype: torch.dtype, device: torch.device,
                 requires_grad: bool = False) -> None:
        self._payload = payload

    def __repr__(self) -> str:
        return f"MXGathered(layer={self._payload.name!r}, shape={list(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0]
        if func in _ALIASES and isinstance(src, MXGathered):
            if func in (aten.as_strided.default, aten.view.default) and list(args[1]) != list(src.shape):
                raise RuntimeError(f"MXGathered (layer {src._payload.name!r}): {func} to another shape is not supported")
            return MXGathered(src._payload, src.dtype, src.device)
        if func in _FRESH:
            return func(torch.empty(src.shape, dtype=src.dtype, device=src.device), **kwargs)
        name = next((a._payload.name for a in args if isinstance(a, MXGathered)), "?")
        raise RuntimeError(
            f"{func} on the MXFP4-gathered weight of layer {name!r}: under "
            "pmx.nn.enable_fsdp_mx_all_gather an unsharded weight holds only its MXFP4 bytes, which "
            "MXLinear's forward uses; read the high-precision weight from the sharded parameter "
            "(model.state_dict(), or outside the forward), or leave the layer out of the MXFP4 all-gather")

    @torch.compiler.disable
    def __pmx_linear__(self, x2: Tensor, layer: MXLinear, bias: Optional[Tensor]) -> Tensor:
        """MXLinear's GEMM ``x2 @ W^T + bias`` (x2 ``[M, K]``) on the gathered bytes.
        Never traced by ``torch.compile`` (it runs eagerly there, a graph break): traced,
        the autograd Function's output did not depend on the weight, whose gradient
        silently came out None."""
        return _GatheredLinear.apply(x2, self, layer._recipe_json, bias)


class _GatheredLinear(torch.autograd.Function):
    """``y = x @ W^T + bias`` with W an :class:`MXGathered`: the same GEMMs, on the same
    bytes, as MXLinear's custom op on the high-precision weight (see
    :mod:`portable_mx._custom_ops`): forward ``portable_mx::mm`` with the forward copy
    as the weight's parts and the bias in its epilogue; d(bias) dY summed over rows; dX ``portable_mx::mm(dY, ., [], dX copy)``, i.e. dY
    quantized (or rounded) per the recipe against W quantized along N; dW the
    ``portable_mx::grad_mm`` of X^T and dY, returned ``[N, K]`` for the gathered leaf."""

    @staticmethod
    def forward(ctx, x2: Tensor, w: MXGathered, rj: str, bias: Optional[Tensor]) -> Tensor:
        n, k = w.shape
        payload = w._payload
        b = torch.zeros((), dtype=x2.dtype, device=x2.device).expand(k, n)  # never read: the parts are
        y = torch.ops.portable_mx.mm(x2, b, [], payload.k_parts, rj, "", rj, bias)
        ctx.save_for_backward(x2)
        ctx.payload, ctx.rj = payload, rj  # the dX copy is read at backward (FSDP2 may re-gather it)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor):
        (x2,) = ctx.saved_tensors
        payload, rj = ctx.payload, ctx.rj
        recipe = payload.plan.recipe
        n, k = payload.plan.shape
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            b = torch.zeros((), dtype=dy.dtype, device=dy.device).expand(n, k)
            dx = torch.ops.portable_mx.mm(dy, b, [], payload.n_parts, rj, "", rj)
        if ctx.needs_input_grad[1]:
            quantized = recipe.grad_weight == "mxfp4" and recipe.quantizes_activations
            dw = torch.ops.portable_mx.grad_mm(x2.T, dy, rj, quantized).T.contiguous()
        return dx, dw, None, dy.sum(0) if ctx.needs_input_grad[3] else None


# ----------------------------------------------------------------------------- state dicts


def _unwrap_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook: the layer's weight as a plain tensor (or a DTensor of a
    plain local tensor) sharing the MXWeight's storage."""
    key = prefix + "weight"
    v = state_dict.get(key)
    if isinstance(v, MXWeight):
        state_dict[key] = v._tensor
        return
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor) and isinstance(v._local_tensor, MXWeight):
        state_dict[key] = DTensor.from_local(v._local_tensor._tensor, v.device_mesh, v.placements, run_check=False,
                                             shape=v.shape, stride=v.stride())


def _rewrap_assigned(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, *args: Any) -> None:
    """Load-state-dict pre-hook: with ``assign=True`` the incoming weight replaces the
    layer's, so it is wrapped as the layer's MXWeight first (a plain tensor, or a DTensor
    of one), with the layer's state; otherwise the layer silently left the MXFP4 gather,
    or, after its first gather, FSDP2's gather buffers (sized for the MXFP4 parts) met a
    high-precision shard and its forward failed deep inside FSDP2."""
    if not local_metadata.get("assign_to_params_buffers", False):
        return
    key = prefix + "weight"
    v = state_dict.get(key)
    state = module._pmx_mx_gather
    if type(v) is Tensor or type(v) is nn.Parameter:
        state_dict[key] = MXWeight(v.detach(), state)
        return
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor) and type(v._local_tensor) in (Tensor, nn.Parameter):
        state_dict[key] = DTensor.from_local(MXWeight(v._local_tensor.detach(), state), v.device_mesh, v.placements,
                                             run_check=False, shape=v.shape, stride=v.stride())


# ----------------------------------------------------------------------------- the public functions


def enable_fsdp_mx_all_gather(model: nn.Module) -> int:
    """Prepare every :class:`~portable_mx.nn.MXLinear` of ``model`` to all-gather its
    weight in MXFP4 under FSDP2; returns the number of layers prepared.

    Call it on every rank, after ``convert`` and after moving the model to its device,
    and before ``fully_shard`` and before creating the optimizer (each weight becomes
    a new Parameter wrapping the same storage; its values, ``requires_grad``, the
    state dict and every op on it are unchanged). At each layer's first all-gather the
    ranks check that they agree on the layer, and the layer gathers MXFP4 bytes when
    there is more than one rank, its rows per rank are a multiple of 32 (and of the
    macro block), its rounding is
    nearest and ``grad_input`` is "mxfp4", otherwise its high-precision weight (warning
    :class:`MXAllGatherFallback` once, naming the layer and the reason). Training is
    bit-identical to FSDP2's high-precision gather either way. A weight shared with
    another module (tied), or computed by a parametrization, is left as it is (warning
    :class:`MXAllGatherFallback`). Inside ``torch.compile`` the gathered GEMM runs
    eagerly (a graph break per layer), with the same gradients. ``load_state_dict(...,
    assign=True)`` wraps the incoming weights for the MXFP4 gather again. Not supported
    with ``reshard_after_forward=<int>`` (FSDP2 has no extension for it).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_fsdp_mx_all_gather expects a torch.nn.Module; got {type(model).__name__}")
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    from torch.distributed.tensor import DTensor

    prepared = 0
    for name, module in model.named_modules():
        if not isinstance(module, MXLinear):
            continue
        if torch.nn.utils.parametrize.is_parametrized(module, "weight"):
            warnings.warn(f"MXFP4 all-gather: layer {name!r} computes its weight through a parametrization "
                          "(weight_norm, ...); it keeps FSDP2's high-precision gather", MXAllGatherFallback,
                          stacklevel=2)
            continue
        w = module.weight
        if isinstance(w, MXWeight):
            prepared += 1
            continue
        if isinstance(w, DTensor) or not isinstance(w, nn.Parameter):
            raise RuntimeError(f"enable_fsdp_mx_all_gather: layer {name!r} is already sharded or its weight is "
                               f"not a Parameter ({type(w).__name__}); call it before fully_shard")
        if owners.get(id(w), 0) > 1:
            warnings.warn(f"MXFP4 all-gather: layer {name!r} shares its weight with another module (tied "
                          "weights); it keeps FSDP2's high-precision gather", MXAllGatherFallback, stacklevel=2)
            continue
        state = _LayerState(name or type(module).__name__)
        module.weight = nn.Parameter(MXWeight(w.data, state), requires_grad=w.requires_grad)
        module._pmx_mx_gather = state
        module.register_state_dict_post_hook(_unwrap_state_dict)
        module.register_load_state_dict_pre_hook(_rewrap_assigned)
        prepared += 1
    return prepared


def gathered_bytes(model: nn.Module, *, reset: bool = True) -> int:
    """Bytes of weights this rank has sent to FSDP2's all-gathers (forward and
    backward) since the last reset, summed over the layers of ``model`` prepared by
    :func:`enable_fsdp_mx_all_gather` (those in MXFP4 and those that fell back to high
    precision); each rank receives ``world_size`` times as much. Those layers' weights
    only: FSDP2 gathers the other parameters (biases, norms, embeddings, layers not
    prepared) in the same collectives, uncounted here. 0 on a one-rank mesh, where FSDP2
    runs no collective. Call it once per step for a per-step figure (``reset=True``
    starts the next count at zero)."""
    total = 0
    for module in model.modules():
        state = getattr(module, "_pmx_mx_gather", None)
        if isinstance(state, _LayerState):
            total += state.bytes_sent
            if reset:
                state.bytes_sent = 0
    return total

