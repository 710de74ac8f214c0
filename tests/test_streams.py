"""A stochastic-rounding stream per layer (portable_mx.nn.streams): layers converted with
one stochastic recipe, or given one seed by reseed, round independently of each other.

The oracle of independence: two layers with the same weight fed the same input. Under one
stream they round every element alike and give bit-identical outputs; under two
independent streams the chance of that is nil (each of the thousands of elements that
lie between two grid points rounds up with a probability strictly between 0 and 1)."""

import copy
import hashlib
import warnings

import pytest
import torch
from torch import nn

import portable_mx as pmx
from portable_mx.nn import MXLinear

SR = pmx.QuantRecipe(scale_rule="rceil", rounding="stochastic", seed=7)


def twins(recipe):
    """Two Linear layers with one weight, in a Sequential, converted with ``recipe``."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=gen)
    model = nn.Sequential(nn.Linear(128, 64, bias=False), nn.Linear(128, 64, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(w)
        model[1].weight.copy_(w)
    return pmx.nn.convert(model, recipe), torch.randn(16, 128, generator=gen)


def test_layers_converted_with_one_stochastic_recipe_round_apart():
    model, x = twins(SR)
    with torch.no_grad():
        a, b = model[0](x), model[1](x)
    assert not torch.equal(a, b)
    # the same two layers on one stream (the recipe as given, set by hand) round alike: the
    # difference above is the streams', nothing else
    model[0].recipe = model[1].recipe = SR
    with torch.no_grad():
        assert torch.equal(model[0](x), model[1](x))


def test_each_layer_holds_the_recipe_with_a_seed_from_the_recipes_seed_and_its_name():
    model, _ = twins(SR)
    for name in ("0", "1"):
        layer = model.get_submodule(name)
        # the seed as the docstring defines it (BLAKE2b, 8 bytes, little-endian, 63 bits),
        # computed here from hashlib itself
        want = int.from_bytes(hashlib.blake2b(f"7\0{name}".encode(), digest_size=8).digest(), "little") % 2**63
        assert layer.recipe == SR.model_copy(update={"seed": want})
        assert pmx.nn.layer_seed(7, name) == want


def test_a_recipe_that_rounds_to_nearest_is_shared_as_it_is():
    nearest = pmx.QuantRecipe(macro_block=64, seed=7)
    model, x = twins(nearest)
    assert model[0].recipe is nearest and model[1].recipe is nearest
    with torch.no_grad():
        assert torch.equal(model[0](x), model[1](x))


def test_converting_again_with_the_same_stochastic_recipe_changes_nothing_and_says_nothing():
    model, _ = twins(SR)
    before = [model[0].recipe, model[1].recipe]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pmx.nn.convert(model, SR)
    assert [model[0].recipe, model[1].recipe] == before
    with pytest.warns(UserWarning, match="keep their recipe"):  # another recipe, not another seed
        pmx.nn.convert(model, SR.model_copy(update={"scale_rule": "ceil"}))


def test_reseed_gives_a_step_new_independent_streams_reproducibly():
    model, x = twins(SR)
    with torch.no_grad():
        first = model[0](x)
        pmx.nn.reseed(model, 1)
        one = (model[0](x), model[1](x))
        assert not torch.equal(one[0], first) and not torch.equal(one[0], one[1])
        pmx.nn.reseed(model, 1)  # the same step again: the same draws
        assert torch.equal(model[0](x), one[0]) and torch.equal(model[1](x), one[1])
        pmx.nn.reseed(model, 7)  # convert's seeds come back
        assert torch.equal(model[0](x), first)
    assert model[0].recipe.model_copy(update={"seed": 0}) == SR.model_copy(update={"seed": 0})


def test_reseed_leaves_nearest_layers_and_float_layers_alone():
    nearest = pmx.QuantRecipe()
    model = nn.Sequential(MXLinear(64, 32, recipe=nearest), nn.Linear(32, 32))
    float_weight = model[1].weight.detach().clone()
    assert pmx.nn.reseed(model, 3) is model
    assert model[0].recipe is nearest and torch.equal(model[1].weight, float_weight)


def test_reseed_drops_a_cached_weight_of_the_old_seed():
    model, x = twins(SR)
    with torch.no_grad(), pmx.nn.weight_cache(model):
        model[0](x)
        pmx.nn.reseed(model, 11)
        got = model[0](x)
    fresh = copy.deepcopy(model)  # (no cache: quantized now with the new seed)
    with torch.no_grad():
        assert torch.equal(got, fresh[0](x))


def test_experts_get_their_own_stream_too():
    model = nn.ModuleDict({"a": pmx.nn.MXExperts(2, 32, 32, recipe=SR), "b": pmx.nn.MXExperts(2, 32, 32, recipe=SR)})
    pmx.nn.reseed(model, 5)
    assert model["a"].recipe.seed != model["b"].recipe.seed
    assert model["a"].recipe.seed == pmx.nn.layer_seed(5, "a")


def test_a_numpy_seed_is_a_seed_as_the_recipe_takes_it():
    import numpy as np

    assert pmx.nn.layer_seed(np.int64(7), "0") == pmx.nn.layer_seed(7, "0")
    model, _ = twins(SR)
    pmx.nn.reseed(model, np.int32(7))
    assert model[0].recipe.seed == pmx.nn.layer_seed(7, "0")


@pytest.mark.parametrize("seed", [-1, 2**63, True, 1.0, "3"])
def test_bad_seeds_are_refused_before_anything_changes(seed):
    model, _ = twins(SR)
    before = model[0].recipe
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\)"):
        pmx.nn.reseed(model, seed)
    assert model[0].recipe is before
    with pytest.raises(TypeError, match="torch.nn.Module"):
        pmx.nn.reseed("model", 1)
