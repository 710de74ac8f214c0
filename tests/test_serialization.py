"""MXTensors (quantized inference weights) through a state dict of plain tensors:
torch.save / torch.load(weights_only=True) and safetensors round trips are bit-exact,
the loaded weight serves the GEMM like the original, and bad files raise clear errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch

import portable_mx as pmx
from portable_mx import serialization

needs_safetensors = pytest.mark.skipif(importlib.util.find_spec("safetensors") is None,
                                       reason="safetensors is an optional extra (pip install safetensors)")


def weights() -> dict:
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(96, 48, generator=gen)
    return {
        "layer.weight": pmx.quantize(w, axis=0),  # [K, N] along K: a GEMM's right operand
        "experts": pmx.quantize(torch.randn(2, 40, 70, generator=gen).bfloat16(),
                                pmx.QuantRecipe(macro_block=64, outliers_per_block=2), axis=1),
        "layer.bias": torch.randn(48, generator=gen),
    }


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        g = got[k]
        assert type(g) is type(w), k
        if isinstance(w, torch.Tensor):
            assert torch.equal(g, w) and g.dtype == w.dtype, k
            continue
        assert (g.shape, g.dtype, g.axis, g.recipe) == (w.shape, w.dtype, w.axis, w.recipe), k
        for part in ("qdata", "scales", "macro_scales", "outlier_values", "outlier_indices"):
            a, b = getattr(g, part), getattr(w, part)
            assert (a is None) == (b is None), (k, part)
            assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), (k, part)


def test_state_dict_through_torch_save_weights_only(tmp_path):
    tensors = weights()
    sd = serialization.state_dict(tensors)
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert {"layer.weight.qdata", "layer.weight.scales", "layer.weight.mx_meta", "experts.macro_scales",
            "experts.outlier_values", "experts.outlier_indices", "layer.bias"} <= sd.keys()
    torch.save(sd, tmp_path / "w.pt")
    loaded = serialization.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True))
    assert_same(loaded, tensors)


@pytest.mark.parametrize("k", [40, 41, 63])
def test_non_zero_padding_is_refused_at_load(k):
    """Codes past K (a file whose shape was edited to a smaller K, or damaged bytes): the
    reference decoded K elements, the Triton GEMM summed the whole padded block, and the
    two backends gave another product (9.25 apart on values of 7.6). The quantizer writes
    zeros there: anything else is refused at load; the quantizer's own padding, and an
    outlier of value 0 in it, pass."""
    gen = torch.Generator().manual_seed(9)
    full = pmx.quantize(torch.randn(3, 64, generator=gen) + 1)
    edited = dataclasses.replace(full, shape=torch.Size((3, k)))
    with pytest.raises(ValueError, match=rf"w holds non-zero values past its K = {k}"):
        serialization.load_state_dict(serialization.state_dict({"w": edited}))
    x = torch.randn(3, k, generator=gen)
    for recipe in (pmx.QuantRecipe(), pmx.QuantRecipe(outliers_per_block=2)):
        own = pmx.quantize(x, recipe)  # (k < 64: the last block is part padding)
        loaded = serialization.load_state_dict(serialization.state_dict({"w": own}))["w"]
        assert torch.equal(loaded.qdata, own.qdata)
    tail = torch.zeros(3, 33)
    tail[:, :1] = 1.0  # a block with one value: the second outlier is a zero, possibly in the padding
    serialization.load_state_dict(serialization.state_dict({"w": pmx.quantize(tail, pmx.QuantRecipe(outliers_per_block=2))}))


def test_a_state_dict_loaded_to_the_meta_device_is_refused_clearly(tmp_path):
    """torch.load(map_location="meta") leaves mx_meta without bytes: the error says so and
    what to do (it was torch's "Cannot copy out of meta tensor")."""
    torch.save(serialization.state_dict(weights()), tmp_path / "w.pt")
    sd = torch.load(tmp_path / "w.pt", weights_only=True, map_location="meta")
    with pytest.raises(ValueError, match=r"layer\.weight\.mx_meta is on the meta device.*map_location='cpu'"):
        serialization.load_state_dict(sd)
    mapped = serialization.load_state_dict(torch.load(tmp_path / "w.pt", weights_only=True, mmap=True))
    assert_same(mapped, weights())


@needs_safetensors
def test_safetensors_round_trip_serves_the_gemm(tmp_path):
    tensors = weights()
    serialization.save_safetensors(tensors, tmp_path / "w.safetensors", metadata={"model": "test"})
    loaded = serialization.load_safetensors(tmp_path / "w.safetensors")
    assert_same(loaded, tensors)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(6))
    w4a16 = pmx.QuantRecipe(activations="bf16")
    assert torch.equal(pmx.matmul(x, loaded["layer.weight"], w4a16), pmx.matmul(x, tensors["layer.weight"], w4a16))
    assert torch.equal(pmx.dequantize(loaded["experts"]), pmx.dequantize(tensors["experts"]))


def test_bad_state_dicts_raise_clear_errors():
    sd = serialization.state_dict(weights())
    bad = dict(sd, **{"experts.scales": sd["experts.scales"][:, :1]})
    with pytest.raises(ValueError, match=r"experts.scales is torch.uint8 \(2, 1, 2\).*needs torch.uint8 \(2, 70, 2\)"):
        serialization.load_state_dict(bad)
    missing = {k: v for k, v in sd.items() if k != "experts.outlier_values"}
    with pytest.raises(ValueError, match="experts.outlier_values is absent"):
        serialization.load_state_dict(missing)
    with pytest.raises(ValueError, match="layer.weight.*unreadable MXTensor metadata"):
        serialization.load_state_dict(dict(sd, **{"layer.weight.mx_meta": torch.tensor([1, 2], dtype=torch.uint8)}))
    with pytest.raises(ValueError, match="two entries would be saved as 'w.qdata'"):
        serialization.state_dict({"w": pmx.quantize(torch.randn(4, 32)), "w.qdata": torch.zeros(1)})
    with pytest.raises(TypeError, match="must be an MXTensor or a torch.Tensor"):
        serialization.state_dict({"w": 1.0})


def test_a_tensor_named_like_an_mxtensors_part_is_refused_on_saving():
    """A plain tensor named ``w.macro_scales`` beside an MXTensor ``w`` of a recipe without
    macro factors (or ``w.outlier_values``, ..., or any name ending in ``.mx_meta``) was
    saved without a word, and load_state_dict of the file then failed: it reads every
    ``w.<part>`` as w's (audit). Now saving refuses it, naming it; other names pass."""
    mx = pmx.quantize(torch.randn(4, 64))
    for part in ("macro_scales", "outlier_values", "outlier_indices"):
        with pytest.raises(ValueError, match=rf"the tensor 'w.{part}' has a name load_state_dict reads as a part of "
                                             r"the MXTensor 'w'.*rename it"):
            serialization.state_dict({f"w.{part}": torch.ones(4, 2), "w": mx})
    with pytest.raises(ValueError, match=r"'v.mx_meta' has a name load_state_dict reads as a part of an MXTensor"):
        serialization.state_dict({"v.mx_meta": torch.zeros(3, dtype=torch.uint8)})
    fine = {"w": mx, "w.macro": torch.ones(2), "wx.macro_scales": torch.ones(2), "w.qdata.bias": torch.ones(1)}
    assert_same(serialization.load_state_dict(serialization.state_dict(fine)), fine)


def test_careless_state_dicts_and_paths_are_refused_by_name(tmp_path):
    """A plain tensor named like an MXTensor beside its parts (two dicts merged by hand)
    replaced the MXTensor without a word; a non-string name and a part that is no tensor
    raised AttributeErrors; the safetensors helpers wrote None and bytes paths as files
    named 'None' and "b'...'" (audit)."""
    sd = serialization.state_dict(weights())
    with pytest.raises(ValueError, match=r"'layer.weight' is both a tensor and the MXTensor"):
        serialization.load_state_dict(dict(sd, **{"layer.weight": torch.zeros(3)}))
    with pytest.raises(TypeError, match="names must be strings; got 3"):
        serialization.load_state_dict({**sd, 3: torch.zeros(1)})
    with pytest.raises(ValueError, match=r"layer.weight.scales is a list, not a tensor"):
        serialization.load_state_dict(dict(sd, **{"layer.weight.scales": [1, 2]}))
    for path in (None, b"w.safetensors", ""):
        with pytest.raises(TypeError, match="path must be a non-empty str or os.PathLike"):
            serialization.save_safetensors(weights(), path)
        with pytest.raises(TypeError, match="path must be a non-empty str or os.PathLike"):
            serialization.load_safetensors(path)


def test_damaged_outlier_positions_are_refused_at_load():
    """A position >= 32 or one repeated within a block used to load: the reference then
    raised in the GEMM and the Triton kernels skipped it (a silently different product)."""
    sd = serialization.state_dict(weights())
    idx = sd["experts.outlier_indices"]
    assert int(idx.max()) < 32
    over = idx.clone()
    over[1, 5, 0, 0] = 32
    with pytest.raises(ValueError, match=r"experts.outlier_indices holds a position >= 32 \(largest 32\)"):
        serialization.load_state_dict(dict(sd, **{"experts.outlier_indices": over}))
    twice = idx.clone()
    twice[0, 3, 1, 1] = twice[0, 3, 1, 0]
    with pytest.raises(ValueError, match="experts.outlier_indices repeats a position within a block"):
        serialization.load_state_dict(dict(sd, **{"experts.outlier_indices": twice}))
    assert_same(serialization.load_state_dict(sd), weights())  # the quantizer's own positions load


def _tampered(**meta_update):
    sd = serialization.state_dict({"w": pmx.quantize(torch.randn(3, 70))})
    meta = json.loads(bytes(sd["w.mx_meta"].tolist()).decode())
    meta.update(meta_update)
    sd["w.mx_meta"] = torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)
    return sd


@pytest.mark.parametrize("update,why", [
    (dict(axis=5), "axis must be an int in"), (dict(axis=-1), "axis must be an int in"),
    (dict(axis=1.9), "axis must be an int in"), (dict(axis=True), "axis must be an int in"),
    (dict(shape=[]), "shape must be"), (dict(shape=[-3, 70]), "shape must be"),
    (dict(shape=[2**63, 70]), "shape must be"), (dict(shape=[True, 70]), "shape must be"),
])
def test_tampered_shape_or_axis_is_a_value_error_naming_the_entry(update, why):
    """Each raised IndexError, RuntimeError, a C++ overflow, or a message about a nonsense
    shape, from inside MXTensor.zeros."""
    with pytest.raises(ValueError, match=f"'w': unreadable MXTensor metadata.*{why}"):
        serialization.load_state_dict(_tampered(**update))


def test_metadata_that_is_no_json_object_or_no_tensor_and_a_state_that_is_no_mapping():
    sd = _tampered()
    sd["w.mx_meta"] = torch.tensor(list(b"[1, 2]"), dtype=torch.uint8)
    with pytest.raises(ValueError, match="not an object"):
        serialization.load_state_dict(sd)
    sd["w.mx_meta"] = "x"
    with pytest.raises(ValueError, match="1-D uint8 tensor"):
        serialization.load_state_dict(sd)
    with pytest.raises(TypeError, match="mapping"):
        serialization.load_state_dict([("w", torch.zeros(1))])
    with pytest.raises(TypeError, match="mapping"):
        serialization.state_dict([("w", pmx.quantize(torch.randn(3, 70)))])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.5, 0.0, 0.5, 2.5, 1.0 + 1 / 256])
def test_damaged_macro_factors_are_refused_at_load(value):
    """A macro factor is k/128 for an integer k in [128, 256] (numerics.md section 4: a
    bf16 value in [1, 2]). A negative or NaN one used to load and decode differently on
    the two backends; any other value scaled its macro block silently."""
    sd = serialization.state_dict(weights())
    m = sd["experts.macro_scales"]
    k = m.double() * 128
    assert bool(((k >= 128) & (k <= 256) & (k == k.round())).all())  # what the quantizer wrote
    bad = m.clone()
    bad[1, 2, 0] = value
    with pytest.raises(ValueError, match=r"experts.macro_scales holds 1 value\(s\) that no quantizer writes"):
        serialization.load_state_dict(dict(sd, **{"experts.macro_scales": bad}))
    edge = m.clone()
    edge[0, 0, 0], edge[0, 1, 0] = 1.0, 2.0  # both ends of the range load
    serialization.load_state_dict(dict(sd, **{"experts.macro_scales": edge}))


def test_parts_whose_metadata_was_lost_are_warned_about():
    """A file holding ``w.qdata`` and ``w.scales`` (uint8) but no ``w.mx_meta`` (lost, or
    dropped by a tool that filtered keys) loaded them as plain tensors, silently."""
    import warnings

    sd = serialization.state_dict(weights())
    del sd["experts.mx_meta"]
    with pytest.warns(UserWarning, match=r"1 entry \('experts'\) hold uint8 qdata and scales but no mx_meta"):
        out = serialization.load_state_dict(sd)
    assert isinstance(out["experts.qdata"], torch.Tensor) and isinstance(out["layer.weight"], pmx.MXTensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        serialization.load_state_dict(serialization.state_dict(weights()))  # whole: silent
        serialization.load_state_dict({"norm.qdata": torch.zeros(3), "norm.scales": torch.ones(3)})  # floats: silent


def test_parts_on_the_meta_device_beside_a_readable_mx_meta_load_as_meta_mxtensors():
    """Shapes without bytes (a model built on the meta device, its state dict's parts moved
    there, mx_meta kept readable): the damaged-file checks have no bytes to read and are
    skipped; the MXTensor keeps the file's shape, recipe and parts. They raised torch's
    "Tensor.item() cannot be called on meta tensors" for an OF or MBS recipe or a ragged K."""
    gen = torch.Generator().manual_seed(3)
    for shape, recipe in [((8, 100), pmx.QuantRecipe()), ((8, 128), pmx.QuantRecipe(macro_block=64)),
                          ((8, 70), pmx.QuantRecipe(outliers_per_block=2))]:
        mx = pmx.quantize(torch.randn(*shape, generator=gen), recipe)
        sd = {k: v if k.endswith(".mx_meta") else v.to("meta") for k, v in serialization.state_dict({"w": mx}).items()}
        got = serialization.load_state_dict(sd)["w"]
        assert got.qdata.is_meta and got.shape == mx.shape and got.recipe == mx.recipe
        for part in ("qdata", "scales", "macro_scales", "outlier_values", "outlier_indices"):
            want = getattr(mx, part)
            assert (getattr(got, part) is None) == (want is None)
            if want is not None:
                assert getattr(got, part).shape == want.shape and getattr(got, part).dtype == want.dtype


def test_a_pickled_mxtensor_is_checked_as_it_is_loaded():
    # torch.load under torch.serialization.safe_globals (what torch's own error names as the
    # way to load one) or pickle gave back an MXTensor whose parts disagreed with its shape
    # unchecked: the GEMM then failed inside the kernel wrapper, or read past qdata on a GPU
    import io
    import pickle

    from portable_mx.recipe import QuantRecipe
    from portable_mx.tensor import MXTensor

    q = pmx.quantize(torch.randn(64, 96, generator=torch.Generator().manual_seed(3)),
                     pmx.QuantRecipe(macro_block=64, outliers_per_block=1), axis=0)
    back = pickle.loads(pickle.dumps(q))
    assert all(torch.equal(a, b) for a, b in zip(q.parts(), back.parts()))
    assert (back.shape, back.axis, back.recipe, back.dtype) == (q.shape, q.axis, q.recipe, q.dtype)

    bad = pickle.loads(pickle.dumps(q))
    bad.__dict__["qdata"] = q.qdata[:, :8].clone()  # (a file of other code: a quarter of the codes)
    with pytest.raises(ValueError, match="qdata must be"):
        pickle.loads(pickle.dumps(bad))
    buf = io.BytesIO()
    torch.save(bad, buf)
    buf.seek(0)
    with torch.serialization.safe_globals([MXTensor, QuantRecipe]), pytest.raises(ValueError, match="qdata must be"):
        torch.load(buf)


def test_metadata_whose_shape_has_too_many_elements_is_unreadable_metadata():
    # each size was bounded but not their product: torch's "Storage size calculation
    # overflowed" came out of MXTensor.zeros (a fuzz of edited files)
    sd = serialization.state_dict({"w": pmx.quantize(torch.randn(4, 64))})
    meta = json.loads(bytes(sd["w.mx_meta"].tolist()).decode())
    meta["shape"] = [2**40, 2**40]
    bad = dict(sd, **{"w.mx_meta": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)})
    with pytest.raises(ValueError, match=r"'w': unreadable MXTensor metadata \(shape \[1099511627776, "
                                         r"1099511627776\] holds"):
        serialization.load_state_dict(bad)


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.pop("axis"), "missing field(s) 'axis'"),
    (lambda m: m.update(dtype=None), "dtype must be one of ['bfloat16', 'float16', 'float32', 'float64']; got None"),
    (lambda m: m.update(dtype="int32"), "got 'int32'"),
    (lambda m: m.update(dtype={}), "got {}"),
])
def test_metadata_errors_name_the_field(edit, words):
    # the messages were the bare key or value: "(None)", "('int32')", "('axis')",
    # "(unhashable type: 'dict')"
    sd = serialization.state_dict({"w": pmx.quantize(torch.randn(4, 64))})
    meta = json.loads(bytes(sd["w.mx_meta"].tolist()).decode())
    edit(meta)
    bad = dict(sd, **{"w.mx_meta": torch.tensor(list(json.dumps(meta).encode()), dtype=torch.uint8)})
    with pytest.raises(ValueError) as err:
        serialization.load_state_dict(bad)
    assert "unreadable MXTensor metadata" in str(err.value) and words in str(err.value), str(err.value)
