"""Stochastic-rounding streams of a model's MX layers: one per layer.

Stochastic rounding draws element i of a quantized tensor from the Philox stream keyed
by the recipe's seed at counter i (README, "numerics"): every tensor quantized under one
seed rounds with the same numbers at the same positions. Layers that shared one recipe
therefore rounded together (two layers' round-up decisions correlated at about 0.5 in
the audit of 2026-11-28), and on non-negative data (post-ReLU activations, softmax
probabilities) their errors added instead of averaging out. :func:`convert` gives each
layer it makes its own seed, :func:`layer_seed` of the recipe's seed and the layer's
name; :func:`reseed` gives every MX layer of a model a new one (a step's, or a
micro-batch's, so that those draw apart too).
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Any

import torch
from numpy import bool_ as numpy_bool

__all__ = ["layer_seed", "reseed"]

_SEED_LIMIT = 2**63  # (QuantRecipe's seed range; torch's generators take no larger one)


def layer_seed(seed: int, name: str) -> int:
    """The seed of the layer named ``name`` (its qualified name in the model, as
    ``model.named_modules()`` gives it; "" for the model itself) under ``seed``: the first
    63 bits of the BLAKE2b hash of both, an int in [0, 2**63). The same on every machine
    and Python process (not Python's ``hash``, which is salted per process)."""
    if isinstance(seed, (bool, numpy_bool)) or not isinstance(seed, numbers.Integral) \
            or not 0 <= int(seed) < _SEED_LIMIT:  # (a numpy int is one, as QuantRecipe takes it)
        raise ValueError(f"seed must be an int in [0, 2**63); got {seed!r}")
    seed = int(seed)
    if not isinstance(name, str):
        raise TypeError(f"name must be a str (a qualified module name); got {type(name).__name__}")
    digest = hashlib.blake2b(f"{seed}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_LIMIT


def layer_recipe(recipe: Any, name: str) -> Any:
    """``recipe`` for the layer named ``name``: with its seed :func:`layer_seed` when it
    rounds stochastically, else ``recipe`` itself (a seed that nothing draws from)."""
    if recipe.rounding != "stochastic":
        return recipe
    return recipe.model_copy(update={"seed": layer_seed(recipe.seed, name)})


def reseed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every :class:`~portable_mx.nn.MXLinear` and :class:`~portable_mx.nn.MXExperts`
    of ``model`` (``model`` itself included) whose recipe rounds stochastically the seed
    ``layer_seed(seed, name)`` (its first name in ``model.named_modules()``), the rest of
    its recipe unchanged; layers that round to nearest are left alone. Returns ``model``.

    Call it with a new ``seed`` for each step (or micro-batch) whose rounding should be
    independent of the others': under one seed a layer rounds the same tensor the same way
    on every call. Setting a recipe drops the layer's cached quantized weight (a
    :func:`~portable_mx.nn.weight_cache` block quantizes it again). Under ``torch.compile``
    a recipe is a constant of the graph: a new seed compiles again (README, stochastic
    rounding)."""
    from .experts import MXExperts
    from .linear import MXLinear

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"reseed expects a torch.nn.Module; got {type(model).__name__}")
    layer_seed(seed, "")  # (the seed checked once, before any layer changes)
    for name, module in model.named_modules():  # (each module once, under its first name)
        if isinstance(module, (MXLinear, MXExperts)) and module.recipe.rounding == "stochastic":
            module.recipe = module.recipe.model_copy(update={"seed": layer_seed(seed, name)})
    return model
