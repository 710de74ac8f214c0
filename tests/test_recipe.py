"""QuantRecipe validation: invalid recipes name the field and the allowed values."""

import pydantic
import pytest

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
