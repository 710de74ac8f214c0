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
==================  =========================  ==========  ============================

(transformers >= 5 stores Qwen3-MoE's experts stacked, ``gate_up_proj`` [E, 2I, H] with
[gate | up] rows and ``down_proj`` [E, H, I]; its loader stacks the per-expert
``mlp.experts.N.{gate,up,down}_proj.weight`` tensors of the published checkpoints.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch

from .._sharding import is_fsdp_module
from ..tensor import MXTensor
from .experts import MXExperts

__all__ = ["FAMILIES", "experts_from_module", "family_of"]

FAMILIES: dict[str, dict[str, Any]] = {
    "GptOssExperts": {"activation": "swiglu_oai", "transposed": True, "bias": True, "concatenated": False},
    "Qwen3MoeExperts": {"activation": "swiglu", "transposed": False, "bias": False, "concatenated": True},
}
"""class name -> how its experts map onto MXExperts."""

_OAI_ALPHA, _OAI_LIMIT = 1.702, 7.0


def known_family(module: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The :data:`FAMILIES` entry of a transformers expert module's class, or None for any
    other module; nothing about its configuration is checked (:func:`family_of` does)."""
    mro = type(module).__mro__
    # the class itself, or under FSDP2's fully_shard (FSDP<class>: FSDPModule, then the class) the class
    # it wrapped, so that convert can refuse FSDPGptOssExperts; no other subclass of a family's class
    classes = (mro[2],) if is_fsdp_module(module) and len(mro) > 2 else mro[:1]
    for cls in classes:
        family = FAMILIES.get(cls.__name__)
        if family is not None and cls.__module__.startswith("transformers."):
            return family
    return None


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
        if not isinstance(act, torch.nn.SiLU) and type(act).__name__ != "SiLUActivation":
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
    """
    if isinstance(module, MXExperts):
        if weights is None:
            return None
        activation = module.activation
        device = (module.gate_up_proj_bias if module.frozen else module.gate_up_proj)
        device = None if device is None else device.device
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
    return new
