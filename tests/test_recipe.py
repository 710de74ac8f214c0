"""QuantRecipe validation: invalid recipes name the field and the allowed values; every
way of obtaining a recipe validates it or is refused where the recipe enters the library;
the macro-block bound; recipes built inside ``torch.compile(fullgraph=True)``."""

import copy
import pickle

import pydantic
import pytest
import torch

import portable_mx as pmx


def test_defaults():
    r = pmx.QuantRecipe()
    assert (r.scale_rule, r.rounding, r.seed, r.macro_block, r.outliers_per_block) == ("floor", "nearest", 0, None, 0)


def test_macro_block_selects_rceil_and_rejects_other_rules():
    assert pmx.QuantRecipe(macro_block=128).scale_rule == "rceil"
    with pytest.raises(pydantic.ValidationError, match="scale_rule must be 'rceil' when macro_block"):
        pmx.QuantRecipe(macro_block=128, scale_rule="floor")


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"scale_rule": "round"}, ["scale_rule", "'floor'", "'rceil'", "'even'", "'ceil'"]),
        ({"rounding": "up"}, ["rounding", "'nearest'", "'stochastic'"]),
        ({"macro_block": 48}, ["macro_block", "multiple of 32", "48"]),
        ({"macro_block": 0}, ["macro_block", "multiple of 32"]),
        ({"outliers_per_block": 3}, ["outliers_per_block", "0", "1", "2"]),
        ({"seed": -1}, ["seed", "greater than or equal to 0"]),
        ({"block_size": 16}, ["block_size", "Extra inputs are not permitted"]),
        # pydantic's lax mode used to read these as 1, 3, 5, 1 and 64: seed=True (meant as
        # "stochastic") gave seed 1 with nearest rounding, silently
        ({"seed": True}, ["seed must be an integer; got bool True"]),
        ({"seed": "3"}, ["seed must be an integer; got str '3'"]),
        ({"seed": 5.0}, ["seed must be an integer; got float 5.0"]),
        ({"outliers_per_block": True}, ["outliers_per_block must be an integer; got bool True"]),
        ({"macro_block": "64"}, ["macro_block must be an integer; got str '64'"]),
        ({"macro_block": 64.0}, ["macro_block must be an integer; got float 64.0"]),
    ],
)
def test_invalid_recipes_name_field_and_allowed_values(kwargs, words):
    with pytest.raises(pydantic.ValidationError) as err:
        pmx.QuantRecipe(**kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_frozen_and_hashable():
    r = pmx.QuantRecipe(outliers_per_block=1)
    with pytest.raises(pydantic.ValidationError):
        r.outliers_per_block = 2
    assert {r: 1}[pmx.QuantRecipe(outliers_per_block=1)] == 1
    assert r.describe() == "floor/nearest/OF-1"


# ----------------------------------------------------------------------------- every way of getting a recipe validates


def test_model_copy_validates_like_the_constructor():
    with pytest.raises(pydantic.ValidationError, match="scale_rule must be 'rceil' when macro_block"):
        pmx.QuantRecipe().model_copy(update={"macro_block": 64, "scale_rule": "floor"})
    with pytest.raises(pydantic.ValidationError, match="scale_rule must be 'rceil' when macro_block"):
        pmx.QuantRecipe(macro_block=64).model_copy(update={"scale_rule": "floor"})
    with pytest.raises(pydantic.ValidationError, match="outliers_per_block"):
        pmx.QuantRecipe().model_copy(update={"outliers_per_block": 40})
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        pmx.QuantRecipe().model_copy(update={"block_size": 16})
    # an unset scale_rule is selected as by the constructor; set fields are kept
    copied = pmx.QuantRecipe(rounding="stochastic", seed=3).model_copy(update={"macro_block": 64})
    assert (copied.scale_rule, copied.rounding, copied.seed, copied.macro_block) == ("rceil", "stochastic", 3, 64)
    r = pmx.QuantRecipe(outliers_per_block=1)
    assert r.model_copy() is r and r.model_copy(update={"outliers_per_block": 2}).outliers_per_block == 2


def test_model_construct_validates():
    with pytest.raises(pydantic.ValidationError, match="outliers_per_block"):
        pmx.QuantRecipe.model_construct(outliers_per_block=40)
    with pytest.raises(pydantic.ValidationError, match="scale_rule must be 'rceil'"):
        pmx.QuantRecipe.model_construct(scale_rule="floor", macro_block=64)
    assert pmx.QuantRecipe.model_construct(macro_block=64) == pmx.QuantRecipe(macro_block=64)


def test_unpickling_and_copies_validate():
    good = pmx.QuantRecipe(macro_block=128, outliers_per_block=1)
    assert pickle.loads(pickle.dumps(good)) == good
    assert copy.copy(good) is good and copy.deepcopy(good) is good  # immutable: a copy is itself
    state = good.__getstate__()
    state["__dict__"] = {**state["__dict__"], "outliers_per_block": 40}
    blank = pmx.QuantRecipe.__new__(pmx.QuantRecipe)
    with pytest.raises(pydantic.ValidationError, match="outliers_per_block"):
        blank.__setstate__(state)


def _bypassed(**fields):
    """A QuantRecipe made around every validating path (pydantic's own model_construct)."""
    return pydantic.BaseModel.model_construct.__func__(pmx.QuantRecipe, **fields)


@pytest.mark.parametrize("fields,words", [
    ({"scale_rule": "floor", "macro_block": 64}, "scale_rule must be 'rceil'"),
    ({"outliers_per_block": 40}, "outliers_per_block"),
    ({"rounding": "stochastic", "seed": True}, "seed must be an integer"),
])
def test_a_recipe_built_around_validation_is_refused_where_it_enters(fields, words):
    bad = _bypassed(**fields)
    x, w = torch.randn(4, 64), torch.randn(64, 8)
    calls = {
        "quantize": lambda: pmx.quantize(x, bad),
        "decompose": lambda: pmx.decompose(x, bad),
        "matmul": lambda: pmx.matmul(x, w, bad),
        "MXLinear": lambda: pmx.nn.MXLinear(64, 8, recipe=bad),
        "convert": lambda: pmx.nn.convert(torch.nn.Sequential(torch.nn.Linear(64, 8)), bad),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match=words):
            call()
    empty = pmx.QuantRecipe.__new__(pmx.QuantRecipe)  # no fields at all
    with pytest.raises(ValueError, match=r"not built by QuantRecipe\(\.\.\.\)"):
        pmx.quantize(x, empty)


def test_integer_fields_take_numpy_and_torch_integers():
    import numpy as np
    r = pmx.QuantRecipe(rounding="stochastic", seed=np.int64(7), macro_block=np.int32(64),
                        outliers_per_block=torch.tensor(2))
    assert (r.seed, r.macro_block, r.outliers_per_block) == (7, 64, 2)
    assert all(type(v) is int for v in (r.seed, r.macro_block, r.outliers_per_block))
    assert r == pmx.QuantRecipe(rounding="stochastic", seed=7, macro_block=64, outliers_per_block=2)


def test_the_same_arguments_give_the_same_recipe():
    a = pmx.QuantRecipe(activations="bf16", seed=1)
    assert a is pmx.QuantRecipe(seed=1, activations="bf16")
    assert pmx.QuantRecipe(seed=1) is not pmx.QuantRecipe(seed=2)
    with pytest.raises(pydantic.ValidationError, match="seed must be an integer"):
        pmx.QuantRecipe(seed=True)  # the key tells True from 1: no interned seed-1 recipe comes back
    assert pmx.QuantRecipe() == pmx.recipe.DEFAULT_RECIPE


# ----------------------------------------------------------------------------- macro_block bound


def test_macro_block_is_bounded():
    with pytest.raises(pydantic.ValidationError, match="macro_block must be at most 65536"):
        pmx.QuantRecipe(macro_block=2**40)
    with pytest.raises(pydantic.ValidationError, match="at most 65536"):
        pmx.QuantRecipe(macro_block=65536 + 32)
    assert pmx.QuantRecipe(macro_block=65536).macro_block == 65536


def test_a_macro_block_longer_than_the_row_holds_the_whole_row():
    """K = 70 (padded 96): macro blocks of 128, 4096 and 65536 all make one macro factor
    per row and write the same bytes."""
    x = torch.randn(3, 70, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 70)
    outs = [pmx.quantize(x, pmx.QuantRecipe(macro_block=mb)) for mb in (128, 4096, 65536)]
    for mx in outs:
        assert mx.macro_scales.shape == (3, 1)
        for name in ("qdata", "scales", "macro_scales"):
            assert torch.equal(getattr(mx, name), getattr(outs[0], name)), name


# ----------------------------------------------------------------------------- recipes built inside torch.compile


def test_a_recipe_built_inside_a_compiled_function_is_a_graph_constant():
    """fullgraph=True raises on any graph break: the recipes are built inside, and used by
    matmul, quantize and an MXLinear whose recipe is set inside; one compilation serves
    later calls, also after other recipes were made eagerly."""
    import torch._dynamo.testing

    x, w = torch.randn(4, 64), torch.randn(64, 8)
    lin = pmx.nn.MXLinear(64, 8)

    def f(x, w):
        w4a16 = pmx.QuantRecipe(activations="bf16")
        mbs = pmx.QuantRecipe(macro_block=64, outliers_per_block=1)
        lin.recipe = mbs
        y = pmx.matmul(x, w, w4a16) + pmx.matmul(x, w, pmx.QuantRecipe()) + lin(x)
        q = pmx.quantize(x, mbs, axis=0)
        return y, q.qdata, q.scales, q.macro_scales

    want = f(x, w)
    lin.recipe = None
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=counter)
    for _ in range(2):
        got = compiled(x, w)
        assert all(torch.equal(g, v) for g, v in zip(got, want))
        assert lin.recipe == pmx.QuantRecipe(macro_block=64, outliers_per_block=1)
        pmx.QuantRecipe(seed=12345)  # a new recipe made eagerly between calls
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_blocks_converted_with_their_own_default_recipe_compile_once():
    """``QuantRecipe()`` is one object (the default recipe), as equal arguments are: a new
    object per call made each block compiled one by one its own graph under torch 2.13
    (dynamo guards on the recipe's identity; ten blocks: 8 graphs, then eager; audit of
    2026-11-28). Pickling and validation still give equal recipes."""
    import pickle

    import torch._dynamo.testing

    from portable_mx.recipe import DEFAULT_RECIPE

    assert pmx.QuantRecipe() is pmx.QuantRecipe() is DEFAULT_RECIPE
    assert pmx.QuantRecipe.model_validate({}) == pmx.QuantRecipe.model_validate_json("{}") == DEFAULT_RECIPE
    assert pickle.loads(pickle.dumps(DEFAULT_RECIPE)) == DEFAULT_RECIPE
    blocks = []
    for i in range(6):
        torch.manual_seed(i)
        blocks.append(pmx.nn.convert(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                                         torch.nn.Linear(64, 32)), pmx.QuantRecipe()))
    x = torch.randn(8, 64)
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    for block in blocks:
        assert torch.equal(torch.compile(block, backend=counter)(x), block(x))
    assert counter.frame_count == 1
    torch._dynamo.reset()


def test_interned_recipes_stay_bounded_and_compiled_ones_are_kept(monkeypatch):
    """Recipes made per call (a seed per step) do not accumulate; one that a compiled graph
    was built on survives the eviction (no recompilation)."""
    import torch._dynamo.testing

    from portable_mx import recipe as recipe_module

    monkeypatch.setattr(recipe_module, "_MAX_INTERNED", len(recipe_module._NAMES) + 4)
    x = torch.randn(2, 32)
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: pmx.quantize(t, pmx.QuantRecipe(rounding="stochastic", seed=987654)).qdata,
                             fullgraph=True, backend=counter)
    want = compiled(x)
    for seed in range(40):
        pmx.QuantRecipe(rounding="stochastic", seed=10**6 + seed)
    assert len(recipe_module._NAMES) <= recipe_module._MAX_INTERNED + len(recipe_module._PINNED)
    assert torch.equal(compiled(x), want) and counter.frame_count == 1
    torch._dynamo.reset()


def test_equal_recipes_give_equal_copies_and_the_rule_follows_the_macro_block():
    """model_copy works on the recipe's values: one read back from JSON (a checkpoint's
    metadata; pydantic marks every field of it as set) copies like the one it was made
    from (adding a macro block raised: its explicit-looking "floor"), and removing a macro
    block gives the default rule back (the implied "rceil" stayed, other bytes)."""
    r = pmx.QuantRecipe(outliers_per_block=1)
    loaded = pmx.QuantRecipe.model_validate_json(r.model_dump_json())
    assert loaded == r
    for recipe in (r, loaded):
        copied = recipe.model_copy(update={"macro_block": 64})
        assert (copied.scale_rule, copied.macro_block, copied.outliers_per_block) == ("rceil", 64, 1)
    assert pmx.QuantRecipe(macro_block=64).model_copy(update={"macro_block": None}) == pmx.QuantRecipe()
    assert pmx.QuantRecipe(scale_rule="ceil").model_copy(update={"seed": 3}).scale_rule == "ceil"
    assert pmx.QuantRecipe(scale_rule="rceil").model_copy(update={"macro_block": None}).scale_rule == "rceil"
