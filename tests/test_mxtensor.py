"""MXTensor(...) and dataclasses.replace check that the parts agree with shape, axis and
recipe (what a hand-built or edited MXTensor must hold); the library's own MXTensors pass
the same checks."""

import dataclasses

import pytest
import torch

import portable_mx as pmx
from portable_mx.tensor import MXTensor

MBS_OF = pmx.QuantRecipe(macro_block=64, outliers_per_block=1)


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fields(mx):
    return {f.name: getattr(mx, f.name) for f in dataclasses.fields(mx)}


@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(), MBS_OF])
def test_the_library_s_own_mxtensors_are_consistent(recipe):
    """Every layout the library makes (3-D along a middle axis, its rows view, zeros,
    moved) rebuilds through the checked constructor unchanged."""
    mx = pmx.quantize(_x(2, 70, 3), recipe, axis=1)
    for t in (mx, mx.rows(), mx.rows().unrows(mx.shape, 1), MXTensor.zeros(torch.Size((0, 5)), torch.float32, 1, recipe,
                                                                         torch.device("cpu")), mx.to("cpu")):
        again = MXTensor(**_fields(t))
        assert again.shape == t.shape and again.axis == t.axis and again.recipe == t.recipe
        assert torch.equal(pmx.dequantize(again), pmx.dequantize(t))
        dataclasses.replace(t)  # the same checks through replace


@pytest.mark.parametrize("change,words", [
    ({"shape": torch.Size((4, 70, 3))}, "qdata must be torch.uint8 (4, 3, 48)"),  # lead dims disagree
    ({"shape": torch.Size((2, 200, 3))}, "qdata must be torch.uint8 (2, 3, 112)"),  # K disagrees
    ({"axis": 0}, "qdata must be"),
    ({"axis": 3}, "axis must be an int in [0, 3)"),
    ({"recipe": pmx.QuantRecipe(macro_block=128, outliers_per_block=1)}, "macro_scales must be torch.float32 (2, 3, 1)"),
    ({"recipe": pmx.QuantRecipe(macro_block=64)}, "outlier_values is set but the recipe"),
    ({"recipe": pmx.QuantRecipe(macro_block=64, outliers_per_block=2)}, "outlier_values must be torch.bfloat16"),
    ({"recipe": pmx.QuantRecipe(outliers_per_block=1)}, "macro_scales is set but the recipe"),
    ({"macro_scales": None}, "macro_scales is missing"),
    ({"outlier_indices": None}, "outlier_indices is missing"),
    ({"scales": torch.zeros(2, 3, 3, dtype=torch.int8)}, "scales must be torch.uint8 (2, 3, 3)"),
    ({"scales": torch.zeros(2, 3, 3, dtype=torch.uint8, device="meta")}, "on cpu (qdata's device)"),
    ({"dtype": torch.int32}, "dtype (the original tensor's) must be one of"),
    ({"shape": (2, -70, 3)}, "shape must be a tuple of non-negative ints"),
])
def test_an_edited_mxtensor_that_disagrees_with_its_data_is_refused(change, words):
    mx = pmx.quantize(_x(2, 70, 3), MBS_OF, axis=1)
    with pytest.raises((ValueError, TypeError)) as err:
        dataclasses.replace(mx, **change)
    assert words in str(err.value), str(err.value)
    with pytest.raises((ValueError, TypeError)):
        MXTensor(**{**_fields(mx), **change})


def test_a_hand_built_mxtensor_is_normalised_and_usable():
    mx = pmx.quantize(_x(5, 40))
    built = MXTensor(qdata=mx.qdata, scales=mx.scales, shape=(5, 40), dtype=torch.float32, axis=1,
                     recipe=pmx.QuantRecipe())
    assert isinstance(built.shape, torch.Size)
    assert torch.equal(pmx.dequantize(built), pmx.dequantize(mx))
    with pytest.raises(ValueError, match=r"qdata must be torch.uint8 \(6, 32\)"):  # one row short
        MXTensor(qdata=mx.qdata, scales=mx.scales, shape=(6, 40), dtype=torch.float32, axis=1,
                 recipe=pmx.QuantRecipe())


def test_rows_of_parts_that_need_a_copy_follow_in_place_writes():
    """An MXTensor [E, N, K] whose parts allow no rows view (an N-slice of wider buffers;
    transposed lead dims): after an in-place write of the buffers, dequantize, matmul and
    the grouped GEMM see the new bytes (the rows copy was kept before and went stale), and
    a second call without a write reuses the kept rows."""
    e, n, k = 2, 32, 64
    big = pmx.quantize(_x(e, 2 * n, k, seed=20), axis=-1)
    sliced = MXTensor(qdata=big.qdata[:, :n], scales=big.scales[:, :n], shape=torch.Size((e, n, k)),
                      dtype=torch.float32, axis=2, recipe=big.recipe)
    q = torch.empty(n, e, k // 2, dtype=torch.uint8).transpose(0, 1)
    s = torch.empty(n, e, k // 32, dtype=torch.uint8).transpose(0, 1)
    q.copy_(big.qdata[:, :n])
    s.copy_(big.scales[:, :n])
    transposed = MXTensor(qdata=q, scales=s, shape=torch.Size((e, n, k)), dtype=torch.float32, axis=2,
                          recipe=big.recipe)
    x = _x(4, k, seed=21)
    offsets = torch.tensor([2, 4], dtype=torch.int32)
    for mx, write in ((sliced, lambda new: (big.qdata.copy_(new.qdata), big.scales.copy_(new.scales))),
                      (transposed, lambda new: (q.copy_(new.qdata[:, :n]), s.copy_(new.scales[:, :n])))):
        pmx.dequantize(mx)
        pmx.grouped_matmul(x, mx, offsets=offsets)
        assert mx.rows() is mx.rows()  # kept while nothing is written
        new = pmx.quantize(_x(e, 2 * n, k, seed=22) * 100, axis=-1)
        write(new)
        fresh = MXTensor(qdata=mx.qdata.clone(), scales=mx.scales.clone(), shape=mx.shape, dtype=mx.dtype, axis=2,
                         recipe=mx.recipe)  # the same bytes, nothing kept
        assert torch.equal(pmx.dequantize(mx), pmx.dequantize(fresh))
        assert torch.equal(pmx.grouped_matmul(x, mx, offsets=offsets), pmx.grouped_matmul(x, fresh, offsets=offsets))
        b = _x(k, 8, seed=23)
        assert torch.equal(pmx.matmul(mx, b), pmx.matmul(fresh, b))


@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(), MBS_OF], ids=lambda r: r.describe())
def test_parts_in_any_layout_decode_alike_on_every_backend(mx_backend, recipe):
    """An MXTensor whose scales are stored transposed (the constructor checks dtype,
    shape and device, not strides) dequantizes and multiplies as the contiguous one: the
    reference's decode raised 'view size is not compatible' while the Triton backend,
    which makes its parts contiguous, answered."""
    q = pmx.quantize(_x(4, 64), recipe)
    odd = dataclasses.replace(q, scales=q.scales.t().contiguous().t())
    assert not odd.scales.is_contiguous()
    assert torch.equal(pmx.dequantize(odd), pmx.dequantize(q))
    w = pmx.quantize(_x(64, 8, seed=1), recipe, axis=0)
    w_odd = dataclasses.replace(w, scales=w.scales.t().contiguous().t())
    a = _x(3, 64, seed=2)
    assert torch.equal(pmx.matmul(a, w_odd, recipe), pmx.matmul(a, w, recipe))


def test_mxtensors_compare_by_identity():
    """== and `in` answer (by identity, as a torch.Tensor hashes): the dataclass's field-wise
    == compared tensors and raised 'Boolean value of Tensor ... is ambiguous'."""
    import copy

    q = pmx.quantize(_x(4, 64))
    twin = copy.deepcopy(q)
    assert (q == twin) is False and q == q and q in [twin, q] and q not in [twin]
    assert q != pmx.quantize(_x(2, 64)) and len({q, twin, q}) == 2


def test_clear_errors_for_the_wrong_kind_of_input():
    q = pmx.quantize(_x(4, 64))
    with pytest.raises(TypeError, match="already an MXTensor"):
        pmx.quantize(q)
    with pytest.raises(TypeError, match="already an MXTensor"):
        pmx.decompose(q)
    with pytest.raises(TypeError, match="takes a device, not a dtype"):
        q.to(torch.float16)
    with pytest.raises(TypeError, match="dense"):
        pmx.quantize(_x(4, 64).to_sparse())
    # sparse operands of the GEMMs and layers failed deep in a backend ("unsupported memory
    # format option Contiguous"); each is named now
    x, w = _x(4, 64), _x(64, 32)
    experts, offsets = pmx.quantize(_x(2, 32, 64), axis=-1), torch.tensor([2, 4], dtype=torch.int32)
    for call, words in ((lambda: pmx.matmul(x.to_sparse(), w), "a must be a dense"),
                        (lambda: pmx.matmul(x, w.to_sparse()), "b must be a dense"),
                        (lambda: pmx.nn.MXLinear(64, 32)(x.to_sparse()), "MXLinear: x must be a dense"),
                        (lambda: pmx.grouped_matmul(x.to_sparse(), experts, offsets=offsets), "x must be a dense"),
                        (lambda: pmx.grouped_matmul(x, _x(2, 32, 64).to_sparse(), offsets=offsets),
                         "w must be a dense")):
        with pytest.raises(TypeError, match=words):
            call()


def test_memos_of_inference_tensors_are_rebuilt_not_read():
    """Parts made under torch.inference_mode have no version counter, and reading one
    raises: MXTensor.memo(copies=True) (the GPU GEMM's swizzled-weight memo: every GEMM on
    sm_90, and sm_100/gfx950) and rows() of parts that need a copy raised 'Inference
    tensors do not track version counter' (an MXLinear under inference_mode on an H100
    would have). Such values are now built on every call."""
    builds = []
    with torch.inference_mode():
        w = pmx.quantize(_x(64, 64), axis=0)
        for _ in range(2):
            assert w.memo("k", lambda m: builds.append(1) or len(builds), copies=True) == len(builds)
        assert len(builds) == 2
        w3 = pmx.quantize(_x(4, 64, 64, seed=1), axis=-1)
        shard = dataclasses.replace(w3, qdata=w3.qdata[:, :32], scales=w3.scales[:, :32], shape=(4, 32, 64))
        assert torch.equal(pmx.dequantize(shard), pmx.dequantize(w3)[:, :32])


def test_a_copies_memo_sees_writes_to_every_part():
    """The copies memo keyed on the codes' and scales' versions only: an in-place write to
    the macro factors (or outliers) it copied left the old copy in use."""
    w = pmx.quantize(_x(64, 128, seed=2), MBS_OF, axis=-1)
    first = w.memo("copy", lambda m: m.macro_scales.clone(), copies=True)
    w.macro_scales.mul_(2)
    again = w.memo("copy", lambda m: m.macro_scales.clone(), copies=True)
    assert torch.equal(again, w.macro_scales) and not torch.equal(again, first)


def test_inference_mode_operands_with_strided_parts_on_every_backend(mx_backend):
    """A strided MXTensor (half of a weight's rows) made under inference_mode: the Triton
    backend's operand copy read its version and raised; the reference answered."""
    with torch.inference_mode():
        w = pmx.quantize(_x(64, 64, seed=3), axis=0)
        half = MXTensor(qdata=w.qdata[::2], scales=w.scales[::2], shape=(64, 32), dtype=torch.float32, axis=0,
                        recipe=w.recipe)
        x = _x(4, 64, seed=4)
        out = pmx.matmul(x, half)
        a, b = pmx.dequantize(pmx.quantize(x)).double(), pmx.dequantize(w).double()[:, ::2]
    bound = 64 * 2.0**-24 * (a.abs() @ b.abs())  # fp32 accumulation over K = 64
    assert ((out.double() - a @ b).abs() <= bound).all()


def test_what_treats_an_mxtensor_as_a_tensor_is_refused_with_what_to_call():
    """An MXTensor is no torch.Tensor: bool() was always True (``mx or default``, ``if mx:``
    took the wrong branch), numpy made a 0-d object array, indexing and ``.to(other_tensor)``
    failed with errors that named no way out (the latter called the MXTensor corrupt, or
    went through for a uint8 tensor). Each now says what to call."""
    import numpy as np

    mx = pmx.quantize(torch.zeros(1, 32))
    for call in (lambda: bool(mx), lambda: mx[0], lambda: np.asarray(mx), lambda: list(mx)):
        with pytest.raises(TypeError, match=r"not a torch.Tensor.*pmx.dequantize\(mx\)"):
            call()
    for other in (torch.zeros(1), torch.zeros(1, dtype=torch.uint8)):
        with pytest.raises(TypeError, match="takes a device.*other.device"):
            mx.to(other)
    with pytest.raises(TypeError, match="gives the values in a float dtype"):
        mx.to(torch.uint8)
    assert mx.to("cpu").qdata.device.type == "cpu"


def test_dequantize_takes_its_dtype_by_position_as_the_method_does():
    mx = pmx.quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(5)))
    got = pmx.dequantize(mx, torch.float16)
    assert got.dtype == torch.float16 and torch.equal(got, pmx.dequantize(mx, dtype=torch.float16))
    assert torch.equal(got, mx.dequantize(torch.float16))


def test_a_linear_layout_weight_gets_the_relabel_that_works():
    """pmx.matmul(x, quantize(W)) with W in nn.Linear's [N, K] layout: the error now names
    the relabel (no copy) that makes it the [K, N] operand, and following it gives the
    float64 product of the dequantized operands."""
    gen = torch.Generator().manual_seed(6)
    w, x = torch.randn(48, 96, generator=gen), torch.randn(5, 96, generator=gen)
    for weight in (pmx.quantize(w), pmx.quantize(torch.randn(96, 96, generator=gen))):
        with pytest.raises(ValueError, match=r"dataclasses.replace\(b, shape=torch.Size") as err:
            pmx.matmul(x, weight)
        n, k = weight.shape
        assert f"torch.Size(({k}, {n}))" in str(err.value)
        b = dataclasses.replace(weight, shape=torch.Size((k, n)), axis=0)
        recipe = pmx.QuantRecipe(activations="bf16")  # (the tokens as they are: one rounding to bf16)
        exact = x.bfloat16().double() @ pmx.dequantize(weight, torch.float64).T
        bound = x.bfloat16().double().abs() @ pmx.dequantize(weight, torch.float64).abs().T * 2.0**-20
        assert ((pmx.matmul(x, b, recipe).double() - exact).abs() <= bound).all()
