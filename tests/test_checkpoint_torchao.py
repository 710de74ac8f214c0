"""portable_mx MXTensor <-> torchao MXTensor (portable_mx.checkpoints.torchao): no copy,
bit-exact both ways, and torchao's to_mx writes portable_mx's bytes for all four scale
rules. Needs torchao (the `hf` extra); skips with the install command elsewhere."""

import dataclasses

import pytest
import torch

import portable_mx as pmx
from portable_mx.checkpoints.torchao import from_torchao, to_torchao

pytest.importorskip("torchao", reason='needs torchao: pip install "portable_mx[hf]"')
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import MXTensor as AOMXTensor  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference  # noqa: E402

RULES = ["floor", "rceil", "even", "ceil"]


def awkward(dtype: torch.dtype) -> torch.Tensor:
    """[64, 256]: magnitudes over 1e-3..1e3 along K, a zero block, -0.0, a tiny block, a
    NaN block, a block of ties, and an Inf in block (4, 2)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 256)
    x[0, :32] = 0
    x[1, 5] = -0.0
    x[2, :32] = 1e-30
    x[3, 40] = float("nan")
    x[4, 70] = float("inf")
    x[5, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)
    return x.to(dtype)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and \
        a.storage_offset() == b.storage_offset()


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_mx_writes_pmx_bytes(rule, dtype):
    """Equal scales and codes, except: inside a NaN block (scale 0xFF) torchao leaves junk
    codes where portable_mx writes 0, and a block holding an Inf gets a finite scale from
    torchao (253 floor, 254 rceil) where portable_mx writes a NaN block (numerics.md)."""
    x = awkward(dtype)
    scale, qdata = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode(rule))
    mx = pmx.quantize(x, pmx.QuantRecipe(scale_rule=rule))
    scale = scale.view(torch.uint8)
    inf_block = torch.zeros_like(mx.scales, dtype=torch.bool)
    inf_block[4, 2] = True
    assert mx.scales[4, 2] == 0xFF and (mx.scales == 0xFF).sum() == 2
    assert torch.equal(scale[~inf_block], mx.scales[~inf_block])
    finite = (mx.scales != 0xFF).repeat_interleave(16, dim=-1)
    assert torch.equal(qdata.view(torch.uint8)[finite], mx.qdata[finite])
    # and torchao's own tensor read through from_torchao: the same values bit for bit
    ao = AOMXTensor(qdata, scale.view(torch.float8_e8m0fnu), torch.float4_e2m1fn_x2, 32, dtype,
                    KernelPreference.EMULATED, None, False)
    ours, theirs = pmx.dequantize(from_torchao(ao), dtype=torch.float32), ao.dequantize(torch.float32)
    assert torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_to_mx_differs_only_in_blocks_of_scale_byte_0_where_ours_are_the_oracles(rule, dtype):
    """Blocks whose largest magnitude is 2**-149 .. 2**-100: torchao's to_mx writes other
    codes than portable_mx only where the scale byte is 0 (it divides by 2**-126, the
    byte's value 2**-127 clamped, so its codes decode to half the values; audit), and there
    portable_mx's codes are the float64 oracle's (tests/test_oracle.py)."""
    from test_oracle import oracle_tensor, unpack_codes

    exps = torch.arange(-149, -99)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(exps), 32, generator=g, dtype=torch.float64)
    x = (x / x.abs().amax(1, keepdim=True) * torch.pow(2.0, exps.double()).unsqueeze(1) * 1.3).to(dtype)
    scale, qdata = to_mx(x, torch.float4_e2m1fn_x2, 32, ScaleCalculationMode(rule))
    mx = pmx.quantize(x, pmx.QuantRecipe(scale_rule=rule))
    assert torch.equal(scale.view(torch.uint8), mx.scales)
    differ = (qdata.view(torch.uint8) != mx.qdata).any(1)
    assert differ.any() and (mx.scales[differ] == 0).all()  # (4 or 5 of these blocks)
    want = oracle_tensor(x.float().numpy(), rule)
    assert (unpack_codes(mx.qdata) == want["codes"]).all() and (mx.scales.numpy() == want["scales"]).all()


def test_dequantize_to_fp16_differs_only_where_torchaos_scale_leaves_fp16():
    """Every scale byte with every code: portable_mx's dequantize is the float64 product
    rounded once, in fp32, bf16 and fp16; torchao's equals it bit for bit in fp32 and bf16,
    and in fp16 it is the fp16 product of the code's value and the scale cast to fp16
    (audit), so the two differ exactly where that scale leaves fp16's range: bytes 100-102
    (torchao 0 for fp16 subnormals), byte 143 (+-0.5 gives +-inf, not +-32768) and bytes
    143-254 (code 0 gives NaN, 0 * inf), as the README says."""
    qd = torch.tensor([(2 * j) | ((2 * j + 1) << 4) for j in range(8)] * 2, dtype=torch.uint8).repeat(255, 1)
    sc = torch.arange(255, dtype=torch.uint8).reshape(255, 1)  # row b: scale byte b, codes 0..15 twice
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    values = torch.cat([grid, -grid]).repeat(2).expand(255, 32)
    scale = torch.pow(2.0, sc.double() - 127)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        mx = pmx.MXTensor(qd, sc, torch.Size([255, 32]), dtype, 1, pmx.QuantRecipe())
        ours, theirs = pmx.dequantize(mx, dtype=dtype), to_torchao(mx).dequantize(dtype)
        assert torch.equal(ours, (values * scale).to(dtype))
        cast_first = values.half() * scale.half() if dtype == torch.float16 else ours
        assert torch.equal(theirs.isnan(), cast_first.isnan())
        assert torch.equal(theirs.nan_to_num(7.0), cast_first.nan_to_num(7.0))
    differ = ~((ours == theirs) | (ours.isnan() & theirs.isnan()))
    pairs = {(b, abs(float(values[b, e]))) for b, e in differ.nonzero().tolist()}
    assert {b for b, _ in pairs} == {100, 101, 102, *range(143, 255)}
    assert {v for b, v in pairs if b >= 143} == {0.0, 0.5} and {v for b, v in pairs if b == 143} == {0.0, 0.5}
    assert {v for b, v in pairs if b > 143} == {0.0}


@pytest.mark.parametrize("shape", [(48, 96), (4, 40, 64)])
def test_round_trip_shares_storage_and_is_bit_exact(shape):
    g = torch.Generator().manual_seed(3)
    mx = pmx.quantize(torch.randn(*shape, generator=g).bfloat16())
    ao = to_torchao(mx)
    assert isinstance(ao, AOMXTensor) and tuple(ao.shape) == shape and ao.dtype == torch.bfloat16
    assert same_storage(ao.qdata, mx.qdata) and same_storage(ao.scale, mx.scales)
    assert ao.scale.dtype == torch.float8_e8m0fnu
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ao.dequantize(dtype), pmx.dequantize(mx, dtype=dtype))
    back = from_torchao(ao)
    assert same_storage(back.qdata, mx.qdata) and same_storage(back.scales, mx.scales)
    assert back.shape == mx.shape and back.axis == mx.axis and back.dtype == mx.dtype
    assert torch.equal(back.qdata, mx.qdata) and torch.equal(back.scales, mx.scales)


def test_what_torchao_cannot_hold_is_refused():
    x = torch.randn(8, 64)
    with pytest.raises(ValueError, match="macro-block"):
        to_torchao(pmx.quantize(x, pmx.QuantRecipe(macro_block=64)))
    with pytest.raises(ValueError, match="outliers"):
        to_torchao(pmx.quantize(x, pmx.QuantRecipe(outliers_per_block=1)))
    with pytest.raises(ValueError, match="last dimension; this one is quantized along axis 0"):
        to_torchao(pmx.quantize(x, axis=0))
    with pytest.raises(ValueError, match="multiple of 32"):
        to_torchao(pmx.quantize(torch.randn(8, 40)))
    with pytest.raises(TypeError, match="torchao's MXTensor"):
        from_torchao(torch.zeros(2))
    # strided views, which portable_mx dequantizes, but torchao's kernels read as contiguous bytes
    mx = pmx.quantize(torch.randn(8, 128))
    rows = dataclasses.replace(mx, qdata=mx.qdata[::2], scales=mx.scales[::2], shape=torch.Size((4, 128)))
    cols = dataclasses.replace(mx, qdata=mx.qdata[:, :32], scales=mx.scales[:, :2], shape=torch.Size((8, 64)))
    for view, values in ((rows, pmx.dequantize(mx)[::2]), (cols, pmx.dequantize(mx)[:, :64])):
        assert torch.equal(pmx.dequantize(view), values)
        with pytest.raises(ValueError, match="needs contiguous qdata and scales"):
            to_torchao(view)


def test_from_torchao_takes_a_recipe_as_the_ops_do():
    """A mapping of recipe fields, as pmx.quantize takes (it raised AttributeError), and
    a clear TypeError for anything else."""
    q = pmx.quantize(torch.randn(4, 64), pmx.QuantRecipe(scale_rule="rceil"))
    back = from_torchao(to_torchao(q), recipe={"scale_rule": "rceil"})
    assert back.recipe == pmx.QuantRecipe(scale_rule="rceil") and torch.equal(back.qdata, q.qdata)
    with pytest.raises(TypeError, match="recipe must be"):
        from_torchao(to_torchao(q), recipe="rceil")
