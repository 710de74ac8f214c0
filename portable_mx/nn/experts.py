"""MXExperts: the experts of a mixture-of-experts layer, with MXFP4 expert weights.

E experts, each a gated MLP from ``hidden_size`` H through ``intermediate_size`` I and
back; a token t routed to experts ``ids[t, 0..k-1]`` with router weights ``w[t, :]`` gets

    y[t] = sum_j w[t, j] * (W2[e] @ act(W1[e] @ x[t] + b1[e]) + b2[e]),   e = ids[t, j]

where W1 = ``gate_up_proj`` [E, 2I, H] and W2 = ``down_proj`` [E, H, I] (both [out, in],
each quantized along its input axis, K) and ``act`` is

- ``"swiglu_oai"`` (gpt-oss): rows of W1 interleave gate (even) and up (odd) units;
  ``gate = min(gate, 7)``, ``up = clamp(up, -7, 7)``, ``act = gate * sigmoid(1.702 gate)
  * (up + 1)``;
- ``"swiglu"`` (Qwen3-MoE, Mixtral, ...): W1's rows are [gate | up] concatenated;
  ``act = silu(gate) * up``.

The forward is two grouped GEMMs (:func:`portable_mx.grouped_matmul`) over one routing
(:func:`portable_mx.route`, built on the device with no host sync): W1 with the input
rows gathered in expert order, bias and activation fused; W2 with bias and the
router-weighted sum over the k slots (a fixed order: deterministic). One launch per
projection, whatever E.

The expert weights are held in one of two ways:

- **float Parameters** (training; what :func:`portable_mx.nn.convert` makes of a model's
  experts, sharing its Parameters): ``gate_up_proj``, ``down_proj`` in the layout of the
  module they came from (``transposed=True``: [E, in, out], transformers' GptOss layout;
  else [E, out, in]), quantized along K with ``recipe`` on every forward, or, inside a
  :func:`~portable_mx.nn.weight_cache` block, once and reused until an optimizer step,
  a version-bumping update or a replaced weight (the rule of
  :mod:`portable_mx.nn.weight_cache`); a forward that needs the weights' gradients
  hands the float weights to the grouped GEMM, which quantizes them itself, block or
  not. Autograd reaches x, the weights, the biases and the router weights.
- **frozen MXTensors** (inference from a checkpoint; :meth:`MXExperts.from_mx`,
  :func:`portable_mx.checkpoints.gpt_oss.load_experts`): buffers ``gate_up_proj_blocks``
  uint8 [E, N, K/32, 16] and ``gate_up_proj_scales`` uint8 [E, N, K/32] (the gpt-oss
  checkpoint's own names and bytes: the module's ``state_dict`` *is* that layout), plus
  ``_macro_scales`` (fp32 bits as int32) / ``_outlier_values`` (bf16 bits as int16) /
  ``_outlier_indices`` where the MXTensor has them (as bits, so that ``model.to(dtype)``
  leaves them alone), with macro-block factors also ``_macro_block`` (int64, the block
  size: loading a state dict quantized with another size is refused); never dequantized.
  Gradients reach x, the biases and the router weights.

Biases ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H] are optional
Parameters. What is exact: each expert's GEMM is the fp32-accumulated product of the
dequantized operands (x per ``recipe.activations``: quantized for A4W4, rounded to bf16
/ fp16 for W4A16), as :func:`portable_mx.matmul` defines it; bias, activation and the
weighted sum follow :func:`portable_mx.grouped_matmul`'s contract. The intermediate (the
activation of the first GEMM) is rounded to x's dtype, as the first GEMM returns it, before
the second GEMM takes it per the recipe: fp16 x can overflow there (as transformers' own
fp16 experts do) where fp32 x would not.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import replace
from typing import Any, Optional

import torch
from torch import Tensor

from .. import _graphs, ops
from .._flags import as_bool
from ..moe import grouped_matmul, route
from ..format import BLOCK_SIZE
from ..recipe import QuantRecipe
from ..tensor import FLOAT_DTYPES, MXTensor, version_of
from ._autocast import any_enabled as any_autocast, autocast_dtype, cast
from ._members import member as _member
from .weight_cache import WeightCache

__all__ = ["ACTIVATIONS", "MXExperts"]

ACTIVATIONS = ("swiglu_oai", "swiglu")
"""The expert activations: gpt-oss's interleaved clamped SwiGLU, and SwiGLU on
concatenated [gate | up] rows."""

PROJECTIONS = ("gate_up_proj", "down_proj")
_PARTS = ("blocks", "scales", "macro_scales", "outlier_values", "outlier_indices")
_BUFFERS = {proj: tuple(f"{proj}_{part}" for part in _PARTS) for proj in PROJECTIONS}
"""The buffer names of each projection's frozen parts, in ``_PARTS`` order."""


class MXExperts(torch.nn.Module):
    """E experts with MXFP4 weights (see the module doc for the math and the two ways
    the weights are held).

    ``MXExperts(num_experts, hidden_size, intermediate_size, *, bias=True,
    activation="swiglu_oai", transposed=False, recipe=None, device=None, dtype=None)``
    makes float Parameters, initialised like ``nn.Linear`` per expert (uniform in
    ±1/sqrt(in)). ``recipe``: the :class:`QuantRecipe` of the GEMMs (default A4W4;
    ``QuantRecipe(activations="bf16")`` for W4A16), assignable.

    Forward: ``x`` [..., H] (the weights' dtype in float mode; any float dtype frozen),
    ``top_k_index`` [..., k] int32 or int64 expert ids in [0, E), ``top_k_weights`` [..., k]
    router weights (or None: all 1) -> [..., H] in x's dtype. The argument order is that
    of transformers' expert modules (``hidden_states, router_indices, routing_weights``).
    Under ``torch.autocast`` (dtype D), x and the biases are cast to D first, as
    ``F.linear``'s autocast casts them (fp64 excepted); the weights are quantized from
    their own values and the layer returns D.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, bias: bool = True,
                 activation: str = "swiglu_oai", transposed: bool = False, recipe: Any = None,
                 device: Any = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
        if dtype is not None and dtype not in FLOAT_DTYPES:  # (float8 passed is_floating_point, then failed in init)
            raise TypeError(f"MXExperts: dtype must be a float dtype, one of {FLOAT_DTYPES} (the float weights'); got {dtype!r}")
        for what, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{what} must be a positive int; got {v!r}")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.activation = activation
        self.transposed = as_bool(transposed, "MXExperts: transposed")  # ("no" was True)
        self._mx_meta: dict[str, tuple[torch.Size, torch.dtype, QuantRecipe]] = {}
        self._mx_memo: dict[str, tuple[tuple, MXTensor, tuple, tuple]] = {}  # (buffers, their MXTensor, addresses, ids)
        self._mx_checked: dict[str, tuple[Tensor, Optional[int]]] = {}  # (_check_macro_block)
        self.recipe = recipe
        kw = dict(device=device, dtype=dtype)
        e, h, i = num_experts, hidden_size, intermediate_size
        shapes = {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}
        for proj, (ee, n, k) in shapes.items():
            shape = (ee, k, n) if self.transposed else (ee, n, k)
            self.register_parameter(proj, torch.nn.Parameter(torch.empty(shape, **kw)))
            self.register_parameter(f"{proj}_bias", torch.nn.Parameter(torch.empty(ee, n, **kw)) if bias else None)
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    # ------------------------------------------------------------------ construction

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation, per expert: weights and biases uniform in
        ±1/sqrt(in_features) (float mode only)."""
        if self.frozen:
            raise RuntimeError("MXExperts: frozen MXFP4 weights have no initialisation")
        with torch.no_grad():
            for proj, k in (("gate_up_proj", self.hidden_size), ("down_proj", self.intermediate_size)):
                bound = 1.0 / math.sqrt(k)
                getattr(self, proj).uniform_(-bound, bound)
                b = getattr(self, f"{proj}_bias")
                if b is not None:
                    b.uniform_(-bound, bound)

    @classmethod
    def from_mx(cls, gate_up_proj: MXTensor, down_proj: MXTensor, gate_up_proj_bias: Optional[Tensor] = None,
                down_proj_bias: Optional[Tensor] = None, *, activation: str = "swiglu_oai",
                recipe: Any = None) -> "MXExperts":
        """Frozen experts holding these MXTensors (no copy, never dequantized).

        ``gate_up_proj``: the MXTensor of W1 [E, 2I, H] quantized along H (axis 2), or of
        its transpose [E, H, 2I] along axis 1 (the same bytes); ``down_proj``: W2
        [E, H, I] along I likewise. Biases: float [E, 2I] and [E, H] or None, kept as
        Parameters with ``requires_grad=False`` (set it to train them).
        """
        w1, w2 = (_as_out_in(w, name) for w, name in ((gate_up_proj, "gate_up_proj"), (down_proj, "down_proj")))
        e, n1, h = w1.shape
        e2, h2, i = w2.shape
        if n1 % 2 or e2 != e or h2 != h or n1 != 2 * i:
            raise ValueError(f"expert weights do not fit together: gate_up_proj {list(w1.shape)} must be "
                             f"[E, 2I, H] and down_proj {list(w2.shape)} [E, H, I] ([out, in] views)")
        new = cls(e, h, i, bias=False, activation=activation, recipe=recipe, device="meta")
        for proj, w, bias, n in (("gate_up_proj", w1, gate_up_proj_bias, n1), ("down_proj", w2, down_proj_bias, h)):
            new.register_parameter(proj, None)
            new._set_mx(proj, w)
            if bias is not None:
                if not isinstance(bias, Tensor) or tuple(bias.shape) != (e, n) or bias.dtype not in FLOAT_DTYPES:
                    got = f"{getattr(bias, 'dtype', type(bias).__name__)} {list(getattr(bias, 'shape', []))}"
                    raise ValueError(f"{proj}_bias must be a float32, bfloat16, float16 or float64 tensor [{e}, {n}]; "
                                     f"got {got}")
                if bias.device != w.device:
                    raise ValueError(f"{proj}_bias is on {bias.device} but the weight is on {w.device}")
                new.register_parameter(f"{proj}_bias", torch.nn.Parameter(bias.detach(), requires_grad=False))
        return new

    def _set_mx(self, proj: str, w: MXTensor) -> None:
        e, n, k = w.shape
        g = w.k_padded // BLOCK_SIZE
        # float parts stored as their bits (int32, int16) so that model.to(dtype) / .half() leave them alone
        parts = {"blocks": w.qdata.reshape(e, n, g, 16), "scales": w.scales,
                 "macro_scales": None if w.macro_scales is None else w.macro_scales.view(torch.int32),
                 "outlier_values": None if w.outlier_values is None else w.outlier_values.view(torch.int16),
                 "outlier_indices": w.outlier_indices}
        for part, name in zip(_PARTS, _BUFFERS[proj]):
            self.register_buffer(name, parts[part])
        # the macro-block size, which the factors' shape alone does not fix (K = 192 has 2 factors
        # per row with blocks of 96 or 128): in the state dict, so that loading one quantized with
        # another size is refused (_load_from_state_dict)
        self.register_buffer(f"{proj}_macro_block", None if w.macro_scales is None else
                             torch.tensor(w.recipe.macro_block, dtype=torch.int64, device=w.qdata.device))
        self._mx_meta[proj] = (w.shape, w.dtype, w.recipe)
        self._mx_memo.pop(proj, None)
        self._mx_checked.pop(proj, None)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # a mismatch copies nothing into this module: its buffers (and the MXTensors they came
        # from) keep their bytes, so that a caller who catches the error keeps a working module
        refused = len(error_msgs)
        for proj in PROJECTIONS:
            meta = self._mx_meta.get(proj)
            key = f"{prefix}{proj}_macro_block"
            if meta is None or meta[2].macro_block is None or key not in state_dict:
                continue
            got = state_dict[key]
            if isinstance(got, Tensor) and got.numel() == 1 and not got.is_meta and int(got) != meta[2].macro_block:
                error_msgs.append(
                    f"{key}: the state dict's {proj} was quantized with macro blocks of {int(got)} elements, this "
                    f"module's with {meta[2].macro_block}: its macro-block factors would be applied to the wrong "
                    f"elements (build the module from MXTensors quantized with macro_block={int(got)})")
        if len(error_msgs) > refused:
            return
        missing = len(missing_keys)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._forget_buffers()  # (assign=True put other tensors in: the old ones are not held)
        # a state dict saved before the size was kept (it holds this projection's factors, not
        # its size): loaded as before, the size unchecked, with a warning; a load that leaves
        # the projection out altogether (strict=False) reports the key missing as any other
        old = [f"{prefix}{proj}_macro_block" for proj in PROJECTIONS
               if f"{prefix}{proj}_macro_block" in missing_keys[missing:]
               and f"{prefix}{proj}_macro_scales" in state_dict]
        if old:
            for k in old:
                missing_keys.remove(k)
            level, frame = 1, sys._getframe()
            while frame is not None and frame.f_code.co_filename in (__file__, torch.nn.modules.module.__file__):
                frame, level = frame.f_back, level + 1
            warnings.warn(f"MXExperts: the state dict has no {', '.join(old)} (saved by an older portable_mx): the "
                          "macro-block factors are applied with this module's block size, which the state dict "
                          "cannot confirm", UserWarning, stacklevel=level)

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.cpu()``, ``.half()`` ...: the MXTensors made of buffers this moved
        away from (and the backends' prepared copies they keep) are let go with them. They
        were held until the next forward: a frozen rollout model offloaded to the CPU
        between phases of an RL step gave none of its GPU memory back (found by the
        long-run audit). Buffers an ``_apply`` left in place (a move to where they are)
        keep theirs: a CUDA graph captured before reads the prepared copy still."""
        out = super()._apply(fn, *args, **kwargs)
        self._forget_buffers()
        return out

    def _forget_buffers(self) -> None:
        """Drop what the forwards kept of weight buffers the module no longer holds (the
        kept MXTensor is rebuilt at the next forward)."""
        memo = self.__dict__.get("_mx_memo")
        for proj in list(memo or ()):
            if memo[proj][3] != tuple(map(id, self._weight_buffers(proj))):  # (as _frozen_mx compares them)
                del memo[proj]
        checked = self.__dict__.get("_mx_checked")
        for proj in list(checked or ()):
            if checked[proj][0] is not self._buffers.get(f"{proj}_macro_block"):
                del checked[proj]

    def _weight_buffers(self, proj: str) -> tuple:
        """The buffers ``proj``'s MXTensor is made of (blocks, scales, macro factors,
        outliers; None where absent), read from the module's dict."""
        table = self._buffers
        return tuple([_member(self, table, name) for name in _BUFFERS[proj]])  # (a list: no generator frames)

    # ------------------------------------------------------------------ state

    @property
    def frozen(self) -> bool:
        """True when the expert weights are MXTensors (buffers), False for float Parameters."""
        return getattr(self, "gate_up_proj", None) is None

    @property
    def recipe(self) -> QuantRecipe:
        """The :class:`QuantRecipe` of the GEMMs (assignable): how x is quantized or
        rounded, and, in float mode, how the weights are quantized."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe: Any) -> None:
        self._recipe = ops._recipe(recipe)
        cache = self.__dict__.get("_pmx_weight_cache")
        if cache is None:
            self._pmx_weight_cache = WeightCache()
        else:
            cache.clear()

    def quantized_weight(self, proj: str) -> MXTensor:
        """The MXTensor of ``proj`` ("gate_up_proj" or "down_proj") as the GEMM takes it:
        [E, N, K] quantized along K (axis 2). Frozen: a view of the buffers. Float: the
        cached one inside :func:`~portable_mx.nn.weight_cache`, else quantized now with
        the recipe."""
        if proj not in PROJECTIONS:
            raise ValueError(f"proj must be one of {PROJECTIONS}; got {proj!r}")
        if self.frozen:
            return self._frozen_mx(proj)
        w = getattr(self, proj)  # (read once: a parametrized weight is computed on each read)
        ops.refuse_distributed(f"MXExperts.{proj}", w)  # (FSDP2's shard between forwards)
        return self._pmx_weight_cache.get(proj, w, self._recipe, self._quantizer(proj))

    def _frozen_mx(self, proj: str) -> MXTensor:
        # the buffers read from the module's dict (_member); the MXTensor is rebuilt only
        # when one of them was replaced (model.to(...), load_state_dict into new tensors, a
        # reassignment) or its storage was (``buf.set_(...)``, ``buf.data = ...``: the same
        # tensor object on other bytes). The memo's parts are views of the storage they were
        # made from and keep it alive, so a replaced storage is at another address: the
        # addresses tell, and in-place writes to the same storage need no rebuild.
        bufs = self._weight_buffers(proj)
        compiling = torch.compiler.is_compiling()
        block = self._buffers.get(f"{proj}_macro_block")
        if block is not None:
            self._check_macro_block(proj, block, compiling)
        hit = None if compiling else self._mx_memo.get(proj)
        if hit is not None and hit[3] == tuple(map(id, bufs)) and hit[2] == _addresses(bufs):
            return hit[1]  # (the ids of buffers the memo holds cannot be reused while it does)
        shape, dtype, recipe = self._mx_meta[proj]
        blocks, scales, macro, ov, oi = bufs
        e, n, g, _ = blocks.shape
        mx = MXTensor(qdata=blocks.reshape(e, n, g * 16), scales=scales, shape=shape, dtype=dtype, axis=2,
                      recipe=recipe, macro_scales=None if macro is None else macro.view(torch.float32),
                      outlier_values=None if ov is None else ov.view(torch.bfloat16), outlier_indices=oi)
        if not torch.compiler.is_compiling() and mx.qdata.data_ptr() == blocks.data_ptr():
            # (a non-contiguous blocks buffer is reshaped into a copy, which in-place
            # writes to the buffer would not reach: such a weight is rebuilt every call)
            self._mx_memo[proj] = (bufs, mx, _addresses(bufs), tuple(map(id, bufs)))
        return mx

    def _check_macro_block(self, proj: str, block: Tensor, compiling: bool) -> None:
        """Refuse a forward whose ``{proj}_macro_block`` buffer holds another size than the
        module applies: written in place with another recipe's bytes (torch.distributed.
        checkpoint's load copies into the module's own tensors and never calls
        _load_from_state_dict; a load that refused afterwards leaves them there too), the
        factors would fall on the wrong elements. Eager: one host read after the buffer
        changed (its identity or version; an inference tensor, its identity), none in a
        CUDA graph capture or under torch.compile, where a device assertion checks it."""
        if not compiling:
            version = version_of(block)
            seen = self._mx_checked.get(proj)
            if seen is not None and seen[0] is block and seen[1] == version:
                return
        want = self._mx_meta[proj][2].macro_block
        why = ("its buffers were overwritten with weights quantized with another macro block (a torch.distributed."
               "checkpoint load writes into the module before any check); build the module from MXTensors of the "
               "checkpoint's recipe, or load a checkpoint of this module's")
        if compiling or _graphs.capturing(block):  # (checked at run time only: nothing recorded as checked)
            torch._assert_async(block == want, f"MXExperts: {proj}_macro_block does not hold {want}, the "
                                               f"macro-block size this module applies: {why}")
            return
        if not block.is_meta and int(block) != want:
            raise RuntimeError(f"MXExperts: {proj}_macro_block holds {int(block)} but this module applies macro "
                               f"blocks of {want}: {why}")
        self._mx_checked[proj] = (block, version)

    def _quantizer(self, proj: str):
        transposed, recipe = self.transposed, self._recipe

        def build(w: Tensor) -> MXTensor:
            with torch.no_grad():
                mx = ops.quantize(w.detach(), recipe, axis=1 if transposed else 2)
            return _as_out_in(mx, proj)

        return build

    # ------------------------------------------------------------------ forward

    def forward(self, x: Tensor, top_k_index: Tensor, top_k_weights: Optional[Tensor] = None) -> Tensor:
        # the hot path of a converted model's every MoE layer: the module's tensors read
        # from its dicts (_member), no reshape of inputs that are already [T, H] / [T, k]
        h, k_ids = self.hidden_size, top_k_index
        if not isinstance(x, Tensor) or not x.is_floating_point():
            got = type(x).__name__ if not isinstance(x, Tensor) or isinstance(x, MXTensor) else x.dtype
            raise TypeError(f"MXExperts expects a float tensor x; got {got}")
        shape = x.shape
        if not shape or shape[-1] != h:
            raise ValueError(f"MXExperts: x must be [..., {h}]; got shape {tuple(shape)}")
        if not isinstance(k_ids, Tensor) or k_ids.is_floating_point() or k_ids.dim() == 0 or \
                k_ids.shape[:-1] != shape[:-1]:
            raise ValueError(f"MXExperts: top_k_index must be an integer tensor [..., k] with x's leading dims "
                             f"{tuple(shape[:-1])}; got {getattr(k_ids, 'dtype', None)} "
                             f"{tuple(getattr(k_ids, 'shape', ()))}")
        if top_k_weights is not None and (not isinstance(top_k_weights, Tensor) or top_k_weights.shape != k_ids.shape):
            if not isinstance(top_k_weights, Tensor):
                raise TypeError(f"MXExperts: top_k_weights must be a float tensor or None; got "
                                f"{type(top_k_weights).__name__}")
            raise ValueError(f"MXExperts: top_k_weights {tuple(top_k_weights.shape)} must have top_k_index's shape "
                             f"{tuple(k_ids.shape)}")
        params = self._parameters
        w1 = _member(self, params, "gate_up_proj")  # None when frozen (the MXTensors are buffers)
        w2 = _member(self, params, "down_proj")
        b1, b2 = _member(self, params, "gate_up_proj_bias"), _member(self, params, "down_proj_bias")
        amp = any_autocast() and autocast_dtype(x.device)
        if amp:  # F.linear's autocast casts of x and the biases (nn._autocast); the weights are quantized as they are
            x, b1, b2 = cast(x, amp), cast(b1, amp), cast(b2, amp)
        elif w1 is not None and x.dtype != w1.dtype:
            raise TypeError(f"MXExperts: x is {x.dtype} but the weights are {w1.dtype}; cast one of them, or run "
                            "the layer under torch.autocast")
        if w1 is not None and w2 is not None and w2.dtype != w1.dtype:  # (the second GEMM's x is the first's output)
            raise TypeError(f"MXExperts: gate_up_proj is {w1.dtype} but down_proj is {w2.dtype}; give both weights "
                            "one dtype (model.to(dtype) does)")
        if len(shape) == 2:
            x2, ids, wts = x, k_ids, top_k_weights
        else:
            t, k = x.numel() // h, k_ids.shape[-1]
            x2, ids = x.reshape(t, h), k_ids.reshape(t, k)
            wts = None if top_k_weights is None else top_k_weights.reshape(t, k)
        try:
            routing = route(ids, wts, self.num_experts)
        except (TypeError, ValueError) as err:  # (route's message named its own arguments, not this forward's)
            text = str(err).replace("topk_ids", "top_k_index").replace("topk_weights", "top_k_weights")
            raise type(err)(f"MXExperts: {text}") from None
        g1, g2 = self._gemm_weights(x2, w1, w2, b1, b2)
        recipe = self._recipe
        mid = grouped_matmul(x2, g1, routing=routing, gather=True, bias=b1, activation=self.activation, recipe=recipe)
        y = grouped_matmul(mid, g2, routing=routing, scatter=True, bias=b2, recipe=recipe)
        return y if len(shape) == 2 else y.reshape(shape)

    def _gemm_weights(self, x: Tensor, w1: Optional[Tensor], w2: Optional[Tensor], b1: Optional[Tensor],
                      b2: Optional[Tensor]) -> tuple[Any, Any]:
        """The two weights as grouped_matmul takes them: MXTensors [E, N, K] along K
        (frozen, or float weights where no gradient flows), or the float [E, N, K] views
        (autograd, or compiled code: the GEMM quantizes them itself). Float weights that
        need no gradient of their own still go as floats when x or a bias needs one: the
        backward's dX re-quantizes the weight along N from its float values, and from an
        MXTensor it would re-quantize the dequantized codes (another dX: 15% of it on
        N(0, 1) weights, and another bias gradient). ``w1``, ``w2``: the float weight
        Parameters, None when frozen."""
        if w1 is None:  # frozen
            return self._frozen_mx("gate_up_proj"), self._frozen_mx("down_proj")
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and (
                x.requires_grad or w1.requires_grad or w2.requires_grad
                or any(b is not None and b.requires_grad for b in (b1, b2)))):
            if self.transposed:  # the float weights as [E, N, K] views
                return w1.transpose(1, 2), w2.transpose(1, 2)
            return w1, w2
        cache, recipe = self._pmx_weight_cache, self._recipe
        return (cache.get("gate_up_proj", w1, recipe, self._quantizer("gate_up_proj")),
                cache.get("down_proj", w2, recipe, self._quantizer("down_proj")))

    def extra_repr(self) -> str:
        where = "frozen MXFP4" if self.frozen else ("float [E, in, out]" if self.transposed else "float [E, out, in]")
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, activation={self.activation}, "
                f"bias={self.gate_up_proj_bias is not None}, weights={where}, recipe={self._recipe.describe()}")

    def __getstate__(self) -> dict:
        """The module without its memos: they are rebuilt on use (``__setstate__``), and the
        MXTensor a frozen module's memo holds views its int32 / int16 buffers as fp32 /
        bf16, which ``torch.save`` refuses to store beside the buffers."""
        state = super().__getstate__()
        state.pop("_mx_memo", None)
        state.pop("_mx_checked", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._pmx_weight_cache = WeightCache()  # (its own, always: copy.copy passes the original's dict)
        self._mx_memo = {}
        self._mx_checked = {}


def _addresses(bufs: tuple) -> tuple:
    """Where each buffer's bytes start (None for an absent one)."""
    return tuple([None if b is None else b.data_ptr() for b in bufs])


def _as_out_in(w: MXTensor, name: str) -> MXTensor:
    """An expert weight's MXTensor as [E, N, K] along axis 2: as it is, or relabelled
    from [E, K, N] along axis 1 (the same bytes: both store [E, N, K/2])."""
    if not isinstance(w, MXTensor):
        raise TypeError(f"{name}: expected an MXTensor; got {type(w).__name__}")
    if len(w.shape) != 3 or w.axis not in (1, 2):
        raise ValueError(f"{name}: expected an MXTensor [E, N, K] along axis 2 (or [E, K, N] along axis 1); got shape "
                         f"{tuple(w.shape)} along axis {w.axis}")
    if w.axis == 2:
        return w
    e, k, n = w.shape
    return replace(w, shape=torch.Size((e, n, k)), axis=2)
