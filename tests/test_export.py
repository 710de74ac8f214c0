"""torch.export and torch.jit.trace of code that quantizes: a program exported with a dynamic
token count runs at every count in its range and equals eager bit for bit; what is not
supported says so. The expected values are eager calls of the same code on the same
backend (torch.export must not change what runs), not outputs the test copied."""

import pytest
import torch
from torch.export import Dim, export

import portable_mx as pmx
from portable_mx.moe import routing


class QuantizedMatmul(torch.nn.Module):
    """A4W4 with the activations quantized in the program (an MXTensor built from a
    tensor whose rows are a symbolic size under export)."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, x):
        return pmx.matmul(pmx.quantize(x), self.w)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_a_program_that_quantizes_activations_exports_with_a_dynamic_batch(strict):
    """torch.export's default (non-strict) tracing passes symbolic sizes through Python:
    the MXTensor's shape check refused them ("shape must be a tuple of non-negative ints;
    got torch.Size([s77, 96])"), so no such program could be exported."""
    torch.manual_seed(0)
    model = QuantizedMatmul(torch.randn(96, 40))
    ep = export(model, (torch.randn(8, 96),), dynamic_shapes={"x": {0: Dim("m", min=1, max=1024)}}, strict=strict)
    for m in (1, 7, 33, 300):
        x = torch.randn(m, 96)
        assert torch.equal(ep.module()(x), model(x)), m


def test_mxtensor_still_refuses_a_negative_or_non_integer_size():
    mx = pmx.quantize(torch.randn(4, 64))
    for shape in ((4, -64), (4, 64.0), (True, 64)):
        with pytest.raises(TypeError, match="non-negative ints"):
            pmx.MXTensor(mx.qdata, mx.scales, shape, mx.dtype, 1, mx.recipe)


class Experts(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.experts = experts

    def forward(self, x, ids, weights):
        return self.experts(x, ids, weights)


def _tokens(t: int, hidden: int, num_experts: int, k: int):
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
    return torch.randn(t, hidden, generator=g), ids, torch.rand(t, k, generator=g)


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_frozen_experts_export_with_a_dynamic_token_count(strict):
    """route's tile height depended on the token count (a band per power of two): the
    exported program was guarded to one band (Dim(1..4096) refused, with a suggestion of
    Dim(max=32); Dim.AUTO exported a program that failed at 33 tokens). Under export a
    routing built under export takes routing.EXPORT_TILE_M (strict export shows the count
    to Python as an int), and every count gives eager's bits."""
    torch.manual_seed(0)
    num_experts, hidden, inter, k = 4, 64, 32, 2
    model = Experts(pmx.nn.MXExperts(num_experts, hidden, inter).requires_grad_(False))
    t = Dim("t", min=1, max=4096)
    ep = export(model, _tokens(16, hidden, num_experts, k), dynamic_shapes={"x": {0: t}, "ids": {0: t},
                                                                          "weights": {0: t}}, strict=strict)
    for tokens in (1, 16, 33, 300):
        args = _tokens(tokens, hidden, num_experts, k)
        assert torch.equal(ep.module()(*args), model(*args)), tokens


def test_the_export_tile_height_is_one_of_the_choices_and_eager_keeps_the_band():
    assert routing.EXPORT_TILE_M in routing.TILE_M_CHOICES
    assert [routing.default_tile_m(rows, 8) for rows in (1, 8 * 17, 8 * 33, 8 * 65, 10**6)] == [16, 32, 64, 128, 128]


def test_jit_trace_of_a_quantized_tensor_says_it_is_not_supported():
    """torch.jit.trace records sizes as tensors: the MXTensor check failed with "shape must
    be a tuple of non-negative ints; got torch.Size([40, 64])", which named no cause."""
    lin = pmx.nn.MXLinear(64, 32).requires_grad_(False)
    with pytest.raises(TypeError, match="torch.jit.trace .* use torch.export.export or torch.compile"):
        torch.jit.trace(lin, (torch.randn(40, 64),))
