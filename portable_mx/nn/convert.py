"""convert: swap the ``torch.nn.Linear`` layers of a model for :class:`MXLinear`, and its
transformers expert modules (GptOss, Qwen3-MoE and the families with its layout) for
:class:`MXExperts`."""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable
from typing import Any, Union

import torch

from .. import ops
from .._sharding import has_dtensor_parameters as sharded, is_fsdp_module
from ._takeover import hand_over
from .experts import MXExperts
from .hf_experts import expert_class, expert_like, experts_from_module, known_family
from .linear import MXLinear
from .streams import layer_recipe

SkipRule = Union[str, Callable[[str, torch.nn.Module], bool]]

__all__ = ["convert"]


def _skip_rules(skip: Any) -> list[SkipRule]:
    if skip is None:
        return []
    rules = [skip] if isinstance(skip, str) or callable(skip) else skip
    try:
        rules = list(rules)
    except TypeError:
        raise TypeError(f"skip must be a pattern, a predicate or an iterable of them; got {type(skip).__name__}") from None
    for r in rules:
        if not (isinstance(r, str) or callable(r)):
            raise TypeError(f"skip entries must be fnmatch patterns (str) or predicates (name, module) -> bool; got {r!r}")
    return rules


def convert(model: torch.nn.Module, recipe: Any = None, *, skip: Any = ()) -> torch.nn.Module:
    """Swap every ``torch.nn.Linear`` of ``model`` for an :class:`MXLinear` sharing its
    Parameters, and every transformers expert module it knows (``GptOssExperts``,
    ``Qwen3MoeExperts`` and the other families with Qwen3-MoE's layout, Mixtral, Qwen2-MoE,
    OLMoE, DeepSeek-V3, ...: :mod:`portable_mx.nn.hf_experts`) for a float-mode
    :class:`MXExperts` sharing its Parameters (one grouped GEMM per projection), in
    place, and return the model. A transformers expert module it does not know stays in
    float, with one ``UserWarning`` naming it (unless ``skip`` keeps it).

    Only modules whose type is exactly ``nn.Linear`` (or one of those expert classes)
    are swapped (a subclass may override ``forward``; existing MXLinear and MXExperts
    layers are left as they are, so converting twice is a no-op); the other linear layers
    (a subclass of nn.Linear but a ``*Router``, transformers' ``Conv1D`` of GPT-2) stay
    as they are, with one ``UserWarning`` naming them (unless ``skip`` keeps them), and so
    do the LoRA adapters of a peft model (the Linear layers in its ``lora_A`` / ``lora_B``
    module dicts: quantizing a rank-r adapter rounds it along r; ``convert(layer.lora_A)``
    quantizes them if meant), and MX layers already converted with another recipe keep
    theirs, with one warning (set ``layer.recipe``); ``skip`` rules apply
    to expert modules too (e.g. ``"*.experts"``). Embeddings, norms etc. are not Linear and stay. ``skip`` excludes layers: a
    fnmatch pattern matched against the qualified module name (as in
    ``model.named_modules()``, e.g. ``"lm_head"``, ``"*.embed*"``, ``"layers.0.*"``) and
    against the names of the modules around it, so that a pattern naming a container
    skips every layer inside it (``"layers.0"``, ``"model.layers.*.self_attn"``: a
    checkpoint's ``modules_to_not_convert`` such as
    :data:`portable_mx.checkpoints.gpt_oss.QUANTIZATION_CONFIG`'s works as it is), a
    predicate ``(name, module) -> bool``, or an iterable of both; a layer matching any
    rule is kept. A pattern that matches no module of the model skips nothing: one
    ``UserWarning`` lists such patterns with some of the Linear layers' names (a typo).
    A Linear shared by several parents (several names) becomes one shared MXLinear, or
    stays one float Linear when a rule skips any of its names. A Linear inside a converted
    Linear (a child module a user added) is converted too, inside the new layer. A Linear that
    ``torch.nn.utils.parametrize`` made a subclass (weight_norm, spectral_norm, ...) stays
    in float with one ``UserWarning`` naming it (unless ``skip`` keeps it), and so does such
    a transformers expert module: convert first, then parametrize the MXLinear or
    MXExperts. A converted layer takes over the hooks registered on the one it replaces
    and the Parameters, buffers and child modules a user added to it
    (:meth:`MXLinear.from_linear`, :func:`portable_mx.nn.hf_experts.experts_from_module`).
    A model already sharded by FSDP2's ``fully_shard`` (a Linear of its becomes an
    ``FSDPLinear``, or holds DTensor parameters) is refused with a TypeError unless a
    skip rule keeps each sharded layer: convert before ``fully_shard``. Predicates are
    asked about the expert modules too; one written for Linear layers that fails on an
    expert module (reads ``out_features``) skips nothing there. When
    ``model`` itself is an ``nn.Linear`` a new MXLinear is returned (use the return
    value). Count the converted layers with
    ``sum(isinstance(m, MXLinear) for m in model.modules())``. Under a recipe that rounds
    stochastically each layer made gets the recipe with the seed
    :func:`~portable_mx.nn.layer_seed` ``(recipe.seed, name)`` (its first name), so that
    layers draw apart (:mod:`portable_mx.nn.streams`; :func:`~portable_mx.nn.reseed` gives
    a model new ones); layers converted before, by another seed only, keep theirs silently.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert expects a torch.nn.Module; got {type(model).__name__}")
    recipe = ops._recipe(recipe)
    rules = _skip_rules(skip)
    patterns = [r for r in rules if isinstance(r, str)]
    linear_names: list[str] = []  # every Linear the rules were asked about

    def converted(module: torch.nn.Module, name: str) -> Any:
        own = layer_recipe(recipe, name)  # (stochastic rounding: a stream of the layer's own)
        if type(module) is torch.nn.Linear:
            try:
                return MXLinear.from_linear(module, own)
            except TypeError as err:  # (the layer named; skip=[name] keeps it)
                raise TypeError(f"convert: layer {name!r}: {err}; or pass skip=[{name!r}]") from None
        try:
            return experts_from_module(module, own)
        except (TypeError, ValueError) as err:  # a configuration MXExperts cannot run; skip keeps it
            raise type(err)(f"convert: layer {name!r}: {err}; or pass skip=[{name!r}]") from None

    parametrized: list[str] = []
    float_experts: dict[int, tuple[str, str]] = {}  # expert modules no family maps: (first name, class)
    kept_experts: set[int] = set()  # ... of which a skip rule names one place: nothing to say
    other_linear: dict[int, tuple[str, str]] = {}  # linear layers of another type: (first name, class)
    other_recipe: dict[int, tuple[str, str]] = {}  # MX layers already, with another recipe: (first name, recipe)
    kept_others: set[int] = set()  # ... of which a skip rule names one place: nothing to say
    adapters: dict[int, str] = {}  # peft's LoRA adapter Linears, kept in float: first name
    every = _every_name(model)  # (walked once: the names stay those of the converted model)
    adapter_ids = _lora_adapters(every)

    def skipped(name: str, module: torch.nn.Module) -> bool:
        """Whether a rule skips ``module`` at ``name``. Predicates are asked about expert
        modules and the layers convert leaves as they are (to say nothing of them) too; one
        written for Linear layers that fails on another module (reads ``out_features``)
        skips nothing there: convert does not fail on it."""
        for r in rules:
            if isinstance(r, str):
                if _pattern_skips(name, r):
                    return True
            elif type(module) is torch.nn.Linear:
                if r(name, module):
                    return True
            else:
                try:
                    if r(name, module):
                        return True
                except Exception:  # noqa: BLE001  (see above)
                    pass
        return False

    def keep(name: str, module: torch.nn.Module) -> bool:
        # (the class alone: an expert module in a configuration MXExperts cannot run is
        # refused when converted, so that a skip rule can keep it)
        family = known_family(module) is not None
        if ((isinstance(module, torch.nn.Linear) or family)
                and (sharded(module) or is_fsdp_module(module))):  # (an FSDP<class>, unsharded just now too)
            if skipped(name, module):  # kept as it is: a skip rule may keep a sharded layer
                return True
            raise TypeError(f"convert: layer {name!r} is already sharded by FSDP2's fully_shard (its parameters "
                            "are DTensors): convert the model before fully_shard, or skip it")
        if type(module) is not torch.nn.Linear and not family:
            if torch.nn.utils.parametrize.is_parametrized(module) and (isinstance(module, torch.nn.Linear)
                                                                         or expert_like(module)):
                if not skipped(name, module):
                    parametrized.append(name)
            elif expert_like(module):
                float_experts.setdefault(id(module), (name, expert_class(module)))
                if skipped(name, module):
                    kept_experts.add(id(module))
            elif (like := _linear_like(module)) or (isinstance(module, (MXLinear, MXExperts))
                                                    and not _same_recipe(module.recipe, recipe)):
                if skipped(name, module):
                    kept_others.add(id(module))
                elif like:
                    other_linear.setdefault(id(module), (name, type(module).__name__))
                else:
                    other_recipe.setdefault(id(module), (name, module.recipe.describe()))
            return True
        linear_names.append(name)
        if skipped(name, module):
            return True
        if id(module) in adapter_ids:
            adapters.setdefault(id(module), name)
            return True
        return False

    if not keep("", model):
        return converted(model, "")
    # every place each module sits (a module shared by several parents, or registered
    # twice in one, has several names), then one decision per module: it stays when any of
    # its names is skipped (a shared Linear is never split into a float and an MX copy)
    modules: dict[int, tuple[torch.nn.Module, list[str]]] = {}
    places: list[tuple[torch.nn.Module, str, int]] = []  # set once every layer converted: an error changes nothing
    for parent_name, parent in every:  # (every name of a shared parent)
        # _modules, not named_children(): that skips a child registered twice in one parent
        for child_name, child in list(parent._modules.items()):
            if child is None:
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            modules.setdefault(id(child), (child, []))[1].append(name)
            places.append((parent, child_name, id(child)))
    swapped: dict[int, torch.nn.Module] = {}
    for key, (child, names) in modules.items():
        if not any([keep(name, child) for name in names]):  # (every name asked: patterns match through any)
            swapped[key] = converted(child, names[0])
    for key, new in swapped.items():
        hand_over(modules[key][0], new)
    for parent, child_name, key in places:
        if key in swapped:
            # a child of a converted layer (its new layer holds the same children) goes
            # into the new layer, so that the model's tree holds the converted child
            setattr(swapped.get(id(parent), parent), child_name, swapped[key])
    found = [v for k, v in float_experts.items() if k not in kept_experts]
    if found:
        _warn(f"{len(found)} transformers expert module(s) stay in float", (f"{n!r} ({c})" for n, c in found),
              "their layout or activation is not one MXExperts maps (portable_mx.nn.hf_experts); skip=[...] "
              "silences this, pmx.nn.MXExperts.from_mx takes their weights directly")
    if adapters:
        _warn(f"{len(adapters)} LoRA adapter layer(s) stay in float", map(repr, adapters.values()),
              "quantizing an adapter of rank r would round it along r, padded to a 32-block; convert the adapter "
              "modules themselves to quantize them (convert(layer.lora_A)); skip=['*lora_A', '*lora_B'] silences "
              "this")
    found = [v for k, v in other_recipe.items() if k not in kept_others]
    if found:
        _warn(f"{len(found)} layer(s) are MXLinear or MXExperts already and keep their recipe, not this call's "
              f"{recipe.describe()}", (f"{_shown(n)} ({r})" for n, r in found),
              "set layer.recipe = ... to change it; skip=[...] silences this")
    found = [v for k, v in other_linear.items() if k not in kept_others]
    if found:
        _warn(f"{len(found)} linear layer(s) of another type than nn.Linear stay as they are",
              (f"{_shown(n)} ({c})" for n, c in found),
              "convert swaps only modules of type exactly nn.Linear (a subclass may override forward; "
              "transformers' Conv1D, GPT-2's, stores its weight [in, out]); skip=[...] silences this")
    if parametrized:
        _warn(f"{len(parametrized)} parametrized layer(s) (nn.Linear or transformers experts) stay in float",
              map(repr, parametrized), "torch.nn.utils.parametrize computes their weights; convert first, then "
              "register the parametrization on the MXLinear or MXExperts")
    # (a pattern naming any module, a container included, is no typo)
    names = [n for n, _ in every if n]
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]
    if unmatched:
        _warn_unmatched(unmatched, [n for n in linear_names if n])
    return model


_ADAPTERS = frozenset(("lora_A", "lora_B"))
"""Names of the module dicts in which peft's LoRA layers hold their adapter Linears."""


def _lora_adapters(every: list[tuple[str, torch.nn.Module]]) -> set[int]:
    """ids of the modules that peft's LoRA layers hold as adapters, from a model's
    :func:`_every_name`: the entries of an nn.ModuleDict registered as ``lora_A`` or
    ``lora_B`` (``q_proj.lora_A.default``). A module dict given to convert itself
    (``convert(layer.lora_A)``) is not one."""
    return {id(child) for name, m in every
            if name and name.rpartition(".")[2] in _ADAPTERS and isinstance(m, torch.nn.ModuleDict)
            for child in m._modules.values() if child is not None}


def _same_recipe(held: Any, recipe: Any) -> bool:
    """Whether a layer's recipe is ``recipe``, but for the seed when both round
    stochastically (convert gives each layer a seed of its own, :func:`reseed` new ones)."""
    if held == recipe:
        return True
    return (held.rounding == recipe.rounding == "stochastic"
            and held.model_copy(update={"seed": recipe.seed}) == recipe)


def _shown(name: str) -> str:
    return repr(name) if name else "the model"


def _warn(what: str, names: Any, why: str) -> None:
    """One of convert's warnings: what stays as it is, the first names, why (called from
    :func:`convert`: the warning points at its caller)."""
    warnings.warn(f"convert: {what} ({_listed(names)}): {why}", UserWarning, stacklevel=3)


def _listed(items: Any, shown: int = 6) -> str:
    """The first ``shown`` items joined by commas, then ', ...' when there are more."""
    items = list(items)
    return ", ".join(items[:shown]) + (", ..." if len(items) > shown else "")


def _linear_like(module: torch.nn.Module) -> bool:
    """A layer that computes a linear map but that convert does not swap: a subclass of
    nn.Linear (not an MXLinear, nor the out_proj of nn.MultiheadAttention, whose parent reads
    its weight directly, nor a router, ``*Router``: transformers' Llama4Router and
    PhimoeTopKRouter, which stay in float as a checkpoint's routers do) or transformers'
    Conv1D (GPT-2's projections)."""
    cls = type(module)
    if isinstance(module, torch.nn.Linear):
        return not (isinstance(module, (MXLinear, torch.nn.modules.linear.NonDynamicallyQuantizableLinear))
                    or cls.__name__.endswith("Router"))
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers.")


def _every_name(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) for every place a module sits, a shared module under each
    of its names (``named_modules`` names it once), and no module inside itself: a module
    registered within its own subtree is not walked again (``named_modules(remove_duplicate
    =False)`` recursed without end there)."""
    out: list[tuple[str, torch.nn.Module]] = []
    _walk("", model, out, set())
    return out


def _walk(name: str, module: torch.nn.Module, out: list, path: set[int]) -> None:
    """:func:`_every_name`'s walk, a module-level function: as a nested one it referred to
    itself through its closure, a reference cycle that kept ``out`` (every module of the
    model) alive after convert returned, until the cyclic garbage collector ran (a model
    converted and dropped was not freed, and its GPU memory not returned, before then)."""
    out.append((name, module))
    path.add(id(module))
    for child_name, child in module._modules.items():
        if child is not None and id(child) not in path:
            _walk(f"{name}.{child_name}" if name else child_name, child, out, path)
    path.discard(id(module))


def _pattern_skips(name: str, pattern: str) -> bool:
    """A pattern skips the module it matches and everything inside it: it is matched
    against the qualified name and the name of every module around it
    (``"model.layers.*.self_attn"`` skips ``model.layers.0.self_attn.q_proj``, as a
    checkpoint's ``modules_to_not_convert`` means)."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(len(parts), 0, -1))


def _warn_unmatched(unmatched: list[str], linear_names: list[str]) -> None:
    if linear_names:
        shown = _listed(repr(n) for n in linear_names)
        where = f"its {len(linear_names)} Linear layer(s) are named {shown}"
    else:
        where = "it has no nn.Linear layer (besides the converted ones)"
    warnings.warn(
        f"convert: skip pattern(s) {unmatched} match no module of the model and skip nothing; "
        f"{where} (patterns are fnmatch globs on the full name, e.g. 'layers.0.*')",
        UserWarning,
        stacklevel=3,
    )

