"""transformers' expert modules -> :class:`MXExperts` (what :func:`portable_mx.nn.convert`
and :func:`portable_mx.checkpoints.gpt_oss.load_experts` use).

Recognised by class name (transformers is never imported here), with the attributes its
``use_experts_implementation`` decorator sets checked, so that a layout this module does
not know is left alone rather than misread:

==================  =========================  ==========  ============================
class               weights                    activation  biases
==================  =========================  ==========  ============================
``GptOssExperts``   [E, in, out] (transposed)  swiglu_oai  gate_up_proj_bias, down_proj_bias
``Qwen3MoeExperts`` [E, out, in]               swiglu      none
others (below)      [E, out, in]               swiglu      none
==================  =========================  ==========  ============================

(transformers >= 5 stores Qwen3-MoE's experts stacked, ``gate_up_proj`` [E, 2I, H] with
[gate | up] rows and ``down_proj`` [E, H, I]; its loader stacks the per-expert
``mlp.experts.N.{gate,up,down}_proj.weight`` tensors of the published checkpoints.)

Other families (Mixtral, Qwen2-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE, ...) copy Qwen3-MoE's
expert class under their own names; one is taken as Qwen3-MoE's when the attributes
transformers' ``use_experts_implementation`` decorator gives it say the same layout and
math (:func:`stacked_swiglu`). transformers runs its grouped_mm and batched_mm
implementations on any decorated class by exactly those attributes. Any other
transformers ``*Experts`` module stays in float, and :func:`portable_mx.nn.convert`
names it in a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from .._sharding import is_fsdp_module
from ..tensor import MXTensor
from ._takeover import carry_additions, refuse_compiled, take_hooks
from .experts import _BUFFERS, MXExperts

__all__ = ["FAMILIES", "STACKED_SWIGLU", "experts_from_module", "family_of", "stacked_swiglu"]

FAMILIES: dict[str, dict[str, Any]] = {
    "GptOssExperts": {"activation": "swiglu_oai", "transposed": True, "bias": True, "concatenated": False},
    "Qwen3MoeExperts": {"activation": "swiglu", "transposed": False, "bias": False, "concatenated": True},
}
"""class name -> how its experts map onto MXExperts."""

_OAI_ALPHA, _OAI_LIMIT = 1.702, 7.0


STACKED_SWIGLU = FAMILIES["Qwen3MoeExperts"]
"""The family of every other transformers expert class with Qwen3-MoE's layout (Mixtral,
Qwen2-MoE, OLMoE, DeepSeek-V3, GLM-4-MoE, ... in transformers >= 5): see
:func:`stacked_swiglu`."""

_LAYOUT = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
           "has_post_expert_norm": False}
"""The ``use_experts_implementation`` attributes of Qwen3-MoE's layout."""


def _class_of(module: torch.nn.Module) -> type:
    """The module's class, or under FSDP2's fully_shard (FSDP<class>: FSDPModule, then the
    class) the class it wrapped, so that convert can refuse FSDPGptOssExperts, and for a
    module ``torch.nn.utils.parametrize`` made a subclass (Parametrized<class>) the class
    it was made from, so that convert can name it."""
    mro = type(module).__mro__
    cls = mro[2] if is_fsdp_module(module) and len(mro) > 2 else mro[0]
    if torch.nn.utils.parametrize.is_parametrized(module) and cls.__module__ == torch.nn.utils.parametrize.__name__:
        cls = cls.__mro__[1]
    return cls


def known_family(module: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The :data:`FAMILIES` entry of a transformers expert module's class
    (:data:`STACKED_SWIGLU` for a class :func:`stacked_swiglu` accepts), or None for any
    other module, a parametrized one included (``torch.nn.utils.parametrize`` computes its
    weights: convert leaves it in float and says so); nothing more about a named family's
    configuration is checked (:func:`family_of` does)."""
    cls = _class_of(module)
    if not cls.__module__.startswith("transformers.") or torch.nn.utils.parametrize.is_parametrized(module):
        return None
    family = FAMILIES.get(cls.__name__)
    if family is not None:
        return family
    return STACKED_SWIGLU if stacked_swiglu(module) else None


def stacked_swiglu(module: torch.nn.Module) -> bool:
    """Whether ``module`` (of a transformers class other than the named families) is a
    transformers >= 5 expert module with Qwen3-MoE's layout and math, which transformers
    itself declares through its ``use_experts_implementation`` decorator (the attributes
    its grouped_mm / batched_mm implementations run any such class by):

    - ``has_gate``, ``is_concatenated`` ([gate | up] rows), not ``is_transposed``, no
      ``has_bias``, no ``has_post_expert_norm``, not expert-parallel;
    - the decorator's own gate (``_default_apply_gate``: ``act_fn(gate) * up``) and an
      ``act_fn`` that is SiLU (torch's, transformers', or ``F.silu``);
    - ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] Parameters, E =
      ``num_experts``.

    A module this does not accept stays in float (convert warns, naming it)."""
    if any(not hasattr(module, attr) or bool(getattr(module, attr)) != want for attr, want in _LAYOUT.items()):
        return False
    if getattr(module, "_is_expert_parallel", False):
        return False
    gate = getattr(_class_of(module), "_apply_gate", None)
    if getattr(gate, "__name__", None) != "_default_apply_gate" or \
            getattr(gate, "__module__", "") != "transformers.integrations.moe":
        return False
    if not _is_silu(getattr(module, "act_fn", None)):
        return False
    w1, w2 = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(w1, torch.nn.Parameter) and isinstance(w2, torch.nn.Parameter) and w1.dim() == w2.dim() == 3):
        return False
    e, two_i, h = w1.shape
    return (two_i % 2 == 0 and tuple(w2.shape) == (e, h, two_i // 2)
            and getattr(module, "num_experts", e) == e)


def expert_class(module: torch.nn.Module) -> str:
    """The name of ``module``'s class (the class FSDP2 wrapped, for an FSDP<class>)."""
    return _class_of(module).__name__


def _is_silu(act: Any) -> bool:
    """Whether a module's ``act_fn`` is SiLU: torch's module, transformers' SiLUActivation,
    or the function itself (LFM2-MoE keeps ``F.silu``)."""
    return (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
            or act is torch.nn.functional.silu)


def expert_like(module: torch.nn.Module) -> bool:
    """Whether ``module`` looks like a transformers expert module (its class from
    transformers, named ``*Experts``, holding 3-D Parameters, or weights (2-D or more)
    outside any nn.Linear anywhere inside it (DBRX's experts keep theirs stacked 2-D in
    a child module: they stayed in float without a word), or parametrized by
    ``torch.nn.utils.parametrize``, which moves them): one convert leaves in float unless
    :func:`known_family` knows it, and says so. One made of nn.Linear experts is not:
    convert swaps those Linears."""
    cls = _class_of(module)
    return (cls.__module__.startswith("transformers.") and cls.__name__.endswith("Experts")
            and (any(p.dim() == 3 for p in module.parameters(recurse=False))
                 or torch.nn.utils.parametrize.is_parametrized(module)
                 or any(p.dim() >= 2 for m in module.modules() if not isinstance(m, torch.nn.Linear)
                        for p in m.parameters(recurse=False))))


def family_of(module: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The :data:`FAMILIES` entry of a transformers expert module, or None for any other
    module. Raises a ValueError for a known class in a configuration MXExperts cannot
    run (expert parallelism, another SwiGLU clamp, another activation)."""
    family = known_family(module)
    if family is None:
        return None
    name = type(module).__name__
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"{name}: expert-parallel experts (sentinel expert ids) are not supported by MXExperts")
    for attr, want in (("is_transposed", family["transposed"]), ("has_bias", family["bias"]),
                       ("is_concatenated", family["concatenated"]), ("has_gate", True),
                       ("has_post_expert_norm", False)):
        if hasattr(module, attr) and bool(getattr(module, attr)) != want:
            raise ValueError(f"{name}: {attr}={getattr(module, attr)!r}, expected {want!r}; this layout is not the one "
                             "MXExperts maps")
    if family["activation"] == "swiglu_oai":
        alpha, limit = float(getattr(module, "alpha", _OAI_ALPHA)), float(getattr(module, "limit", _OAI_LIMIT))
        if (alpha, limit) != (_OAI_ALPHA, _OAI_LIMIT):
            raise ValueError(f"{name}: swiglu alpha={alpha}, limit={limit}; MXExperts' swiglu_oai is gpt-oss's "
                             f"(alpha {_OAI_ALPHA}, limit {_OAI_LIMIT})")
    else:
        act = getattr(module, "act_fn", None)
        if not _is_silu(act):
            raise ValueError(f"{name}: activation {type(act).__name__}; MXExperts' swiglu is SiLU(gate) * up")
    return family


def experts_from_module(module: torch.nn.Module, recipe: Any, *,
                        weights: Optional[Mapping[str, Any]] = None) -> Optional[MXExperts]:
    """An :class:`MXExperts` for ``module``, or None when ``module`` is not an expert
    module this library maps (or is an MXExperts and no ``weights`` are given).

    Without ``weights``: float-mode MXExperts sharing ``module``'s Parameters (no copy;
    same layout, so the state dict keeps its names and shapes) and training mode.
    With ``weights`` (``{"gate_up_proj": MXTensor, "down_proj": MXTensor,
    "gate_up_proj_bias": Tensor, "down_proj_bias": Tensor}``, biases optional): frozen
    MXExperts holding them, moved to ``module``'s device, with ``module``'s activation;
    ``module``'s own weights are not used.

    Either way the new module takes over ``module``'s hooks (the same hook tables, as
    :meth:`MXLinear.from_linear` does: hook calls get the same arguments, the forward's
    are transformers' order; the load-state-dict pre-hooks registered with ``module`` are
    bound to the new one when convert or load_experts swaps it in) and the Parameters,
    buffers and child modules a user added to it, as the same objects (a name MXExperts
    uses itself is refused with a TypeError); its plain attributes (config, sizes) are not
    carried. A module with a ``forward`` set on the instance (by a wrapper) or compiled in
    place (``module.compile()``) is refused with a TypeError.
    """
    if isinstance(module, MXExperts):
        if weights is None:
            return None
        activation = module.activation
        # (a frozen module's codes: its biases may be None, and a bias-less module's
        # device was then taken from the weights')
        device = (module.gate_up_proj_blocks if module.frozen else module.gate_up_proj).device
        e, h, i = module.num_experts, module.hidden_size, module.intermediate_size
    else:
        family = family_of(module)
        if family is None:
            return None
        activation = family["activation"]
        device = module.gate_up_proj.device
        e, g, d = module.gate_up_proj.shape[0], module.gate_up_proj.shape, module.down_proj.shape
        h, i = (g[1], d[1]) if family["transposed"] else (g[2], d[2])
    if weights is not None:
        missing = [p for p in ("gate_up_proj", "down_proj") if not isinstance(weights.get(p), MXTensor)]
        if missing:
            raise ValueError(f"{type(module).__name__}: no MXTensor for {missing} among the weights {sorted(weights)}")
        # the weights [E, N, K] must be the experts this module was built for
        for proj, want in (("gate_up_proj", (e, 2 * i, h)), ("down_proj", (e, h, i))):
            got = tuple(weights[proj].shape)
            if got != want:
                raise ValueError(f"{type(module).__name__}: {proj} weights of shape {list(got)} (experts, out, in); "
                                 f"this module has {e} experts of hidden size {h} and intermediate size {i}, "
                                 f"which take {list(want)}")
        dev = weights["gate_up_proj"].device if device is None or device.type == "meta" else device

        def moved(x: Any) -> Any:
            return None if x is None else x.to(dev)

        new = MXExperts.from_mx(moved(weights["gate_up_proj"]), moved(weights["down_proj"]),
                                moved(weights.get("gate_up_proj_bias")), moved(weights.get("down_proj_bias")),
                                activation=activation, recipe=recipe)
        new.train(module.training)
        _take_over(module, new)
        return new
    w1, w2 = module.gate_up_proj, module.down_proj
    e = w1.shape[0]
    if family["transposed"]:
        h, i = w1.shape[1], w2.shape[1]
    else:
        h, i = w1.shape[2], w2.shape[2]
    new = MXExperts(e, h, i, bias=family["bias"], activation=activation, transposed=family["transposed"],
                    recipe=recipe, device="meta", dtype=w1.dtype)
    for proj in ("gate_up_proj", "down_proj"):
        want = tuple(getattr(new, proj).shape)
        got = tuple(getattr(module, proj).shape)
        if got != want:
            raise ValueError(f"{type(module).__name__}.{proj}: shape {list(got)}, expected {list(want)}")
        setattr(new, proj, getattr(module, proj))
        if family["bias"]:
            setattr(new, f"{proj}_bias", getattr(module, f"{proj}_bias"))
    new.train(module.training)
    _take_over(module, new)
    return new


_OWN = frozenset(("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias", "act_fn",
                  *(name for names in _BUFFERS.values() for name in names),
                  *(f"{proj}_macro_block" for proj in _BUFFERS)))
"""What a transformers expert module or an MXExperts holds itself: the weights, biases,
activation module and frozen parts the new module replaces."""


def _take_over(module: torch.nn.Module, new: MXExperts) -> None:
    """``new`` takes over ``module``'s hooks and what a user added to it (Parameters,
    buffers, child modules: :mod:`portable_mx.nn._takeover`); the plain attributes of a
    transformers expert module (its config, sizes, layout flags) are not carried."""
    what = "experts_from_module"
    refuse_compiled(module, what)
    carry_additions(module, new, what, own=_OWN, attributes=False)
    take_hooks(module, new)
