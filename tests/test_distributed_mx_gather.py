"""The MXFP4 all-gather of MXLinear weights under FSDP2 (``pmx.nn.enable_fsdp_mx_all_gather``)
on 2 gloo ranks on the CPU: bit-identical training to FSDP2's high-precision gather
(fp32 and bf16 param_dtype, each recipe that can use it), the gathered bytes equal to
quantizing the full weight, the fallbacks with their one warning per layer, the bytes on
the wire against the bf16 and fp32 gathers, and a clear error where ranks disagree.
Activation checkpointing works with it. One spawned job runs every check; the tests read
its results."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import portable_mx as pmx

from dist_harness import run_ranks
from dist_training import (DIMS, LR, MATRIX_STEPS, RECIPES, assert_params, batch, check, fsdp_model, full_params,
                           loss_fn, make_model, result, rows_of, train_ranks)

MX_RECIPES = ("default", "mbs", "of", "w4a16")
"""Recipes the MXFP4 gather serves (with DIMS, MBS-64 serves layer 0, N = 128, and falls
back on layer 2, N = 64: 32 rows per rank)."""
FALLBACKS = {
    "sr": (RECIPES["sr"], DIMS),
    "grad_input_high": (pmx.QuantRecipe(grad_input="high"), DIMS),
    "rows": (RECIPES["default"], (64, 96, 33)),  # 48 rows per rank; 33 rows: uneven, padded
}


def _policy(dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return None if dtype == "fp32" else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _pair(rank, world, recipe, dtype="fp32", dims=DIMS):
    """(high-precision gather, MXFP4 gather, its warnings): parameters after the same
    training."""
    mp = _policy(dtype)
    pd = None if mp is None else torch.bfloat16
    hp = train_ranks(fsdp_model(recipe, mp, dims=dims), rank, world, MATRIX_STEPS, param_dtype=pd, dims=dims)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mx = train_ranks(fsdp_model(recipe, mp, dims=dims, mx_gather=True), rank, world, MATRIX_STEPS,
                         param_dtype=pd, dims=dims)
    ours = [(w.category.__name__, str(w.message)) for w in caught if w.category is pmx.nn.MXAllGatherFallback]
    return hp, mx, ours


def _gathered_bytes_equal_quantize(rank, world, recipe, dtype):
    """After a step, unshard each layer and compare its gathered bytes with quantizing
    the full high-precision weight (cast to the gather dtype) along K and along N."""
    mp = _policy(dtype)
    pd = None if mp is None else torch.bfloat16
    model = fsdp_model(recipe, mp, mx_gather=True)
    train_ranks(model, rank, world, 1, param_dtype=pd)
    out = {}
    for name in ("0", "2"):
        layer = model[int(name)]
        full = model.state_dict()[f"{name}.weight"].full_tensor().to(pd or torch.float32)
        layer.unshard()
        w = layer.weight
        kind = type(w).__name__
        if kind == "MXGathered":
            want_k = pmx.quantize(full, recipe, axis=1).parts()
            want_n = pmx.quantize(full, recipe, axis=0).rows().parts()
            same = all(torch.equal(a, b) for a, b in zip(w._payload.k_parts, want_k)) and \
                len(w._payload.k_parts) == len(want_k) and len(w._payload.n_parts) == len(want_n) and \
                all(torch.equal(a, b) for a, b in zip(w._payload.n_parts, want_n))
            try:
                w.sum()
                same = False  # the high-precision values are not there: any other op must raise
            except RuntimeError as e:
                same = same and f"layer {name!r}" in str(e) and "holds only its MXFP4 bytes" in str(e)
        else:
            same = torch.equal(w.detach(), full)
        layer.reshard()
        out[name] = (kind, same)
    return out


def _wire_bytes(rank, world, mx_gather, dtype):
    """Bytes this rank sends to FSDP2's all-gathers in one training step (counted at
    FSDP2's all-gather collective, weights and biases), and what
    pmx.nn.gathered_bytes reports for the weights."""
    import torch.distributed as dist

    sent = [0]
    # FSDP2's all-gather: all_gather_single from torch 2.13, all_gather_into_tensor before
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    real = getattr(dist, gather)

    def counting(output_tensor, input_tensor, *args, **kwargs):
        sent[0] += input_tensor.numel() * input_tensor.element_size()
        return real(output_tensor, input_tensor, *args, **kwargs)

    mp = _policy(dtype)
    model = fsdp_model(RECIPES["default"], mp, mx_gather=mx_gather)
    setattr(dist, gather, counting)
    try:
        train_ranks(model, rank, world, 1, param_dtype=None if mp is None else torch.bfloat16)
    finally:
        setattr(dist, gather, real)
    return sent[0], pmx.nn.gathered_bytes(model)


class _Checkpointed(torch.nn.Module):
    """Activation checkpointing around ``inner`` (recomputed in the backward)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, x, use_reentrant=False)


def _sharded_layers(mx_gather, each=None):
    """The test MLP (after enable_fsdp_mx_all_gather with ``mx_gather``) with fully_shard on
    each Linear, then ``each(layer)``; the root is left to the caller."""
    from torch.distributed.fsdp import fully_shard

    model = make_model(RECIPES["default"])
    if mx_gather:
        pmx.nn.enable_fsdp_mx_all_gather(model)
    for layer in (model[0], model[2]):
        fully_shard(layer)
        if each is not None:
            each(layer)
    return model


def _activation_checkpointing(rank, world):
    """(high-precision gather, MXFP4 gather) parameters with layer 0 and the GELU under
    activation checkpointing (the forward recomputed from the re-gathered weight)."""
    from torch.distributed.fsdp import fully_shard

    def build(mx_gather):
        model = _sharded_layers(mx_gather)
        model = torch.nn.Sequential(_Checkpointed(torch.nn.Sequential(model[0], model[1])), model[2])
        fully_shard(model)
        return model

    rename = {"0.inner.0.weight": "0.weight", "0.inner.0.bias": "0.bias", "1.weight": "2.weight", "1.bias": "2.bias"}
    return [{rename[k]: v for k, v in train_ranks(build(m), rank, world, MATRIX_STEPS).items()} for m in (False, True)]


def _compiled_layers(rank, world):
    """(high-precision gather, MXFP4 gather with each sharded layer torch.compile-d)
    parameters after the same training: compiled, the gathered GEMM's autograd Function
    was traced apart from the weight, whose gradient came out None (only the biases
    trained, silently)."""
    from torch.distributed.fsdp import fully_shard

    def build(mx_gather):
        model = _sharded_layers(mx_gather, (lambda layer: layer.compile(backend="aot_eager")) if mx_gather else None)
        fully_shard(model)
        return model

    return [train_ranks(build(m), rank, world, MATRIX_STEPS) for m in (False, True)]


def _assign_after_first_gather(rank, world):
    """(high-precision gather, MXFP4 gather, the MXFP4 layer's local weight type) after a
    first step, load_state_dict(other weights, assign=True), then training: assign put a
    plain shard in, and the next forward failed inside FSDP2 (its gather buffers were
    sized for the MXFP4 parts)."""
    out = []
    for mx_gather in (False, True):
        model = fsdp_model(RECIPES["default"], mx_gather=mx_gather)
        x, y = batch(0)
        loss_fn(model(x[rows_of(rank, world)]), y[rows_of(rank, world)]).backward()  # the first gathers
        model.zero_grad(set_to_none=True)
        other = fsdp_model(RECIPES["default"], seed=3).state_dict()
        model.load_state_dict({k: v.detach().clone() for k, v in other.items()}, assign=True)
        out.append(train_ranks(model, rank, world, MATRIX_STEPS))
    return out + [type(model[0].weight._local_tensor).__name__]


def _disagree(rank, world, what):
    """Rank 1 builds layer 0 differently; the first forward must raise on every rank,
    after which the process group still works."""
    import torch.distributed as dist

    recipe, dims = RECIPES["default"], DIMS
    if rank == 1 and what == "recipe":
        recipe = RECIPES["of"]
    if rank == 1 and what == "shape":
        dims = (64, 192, 64)
    model = fsdp_model(recipe, dims=dims, mx_gather=True)
    try:
        model(torch.zeros(4, 64))
        message = None
    except ValueError as e:
        message = str(e)
    dist.barrier()
    return message


def _recipe_changes_after_first_gather(rank, world):
    model = fsdp_model(RECIPES["default"], mx_gather=True)
    model(torch.zeros(4, 64))
    model[0].recipe = RECIPES["of"]
    try:
        model(torch.zeros(4, 64))
    except RuntimeError as e:
        return str(e)
    return None


def _first_forward_under_inference_mode(rank, world):
    """The first forward of a sharded model (FSDP2's lazy init) under inference_mode, with
    the MXFP4 gather and the high-precision one: their outputs (a RuntimeError 'Cannot set
    version_counter for inference tensor' broke the MXFP4-gathered model)."""
    out = []
    for mx_gather in (False, True):
        model = fsdp_model(RECIPES["default"], mx_gather=mx_gather)
        with torch.inference_mode():
            y = model(torch.randn(4, 64, generator=torch.Generator().manual_seed(rank)))
        out.append(y.clone())
    return out


def _shard_along_dim_1(rank, world):
    """shard_placement_fn returning Shard(1) with the MXFP4 gather: the error message
    (it failed inside FSDP2 with a reshape error, or a negative-size tensor on layers
    that were to fall back)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    model = make_model(RECIPES["default"])
    pmx.nn.enable_fsdp_mx_all_gather(model)
    for layer in model:
        if isinstance(layer, pmx.nn.MXLinear):
            fully_shard(layer, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
    fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
    try:
        model(torch.zeros(4, 64))
    except RuntimeError as e:
        return str(e)
    return None


def _under_autocast(rank, world, recipe):
    """(high-precision gather, MXFP4 gather): fp32 parameters after MATRIX_STEPS AdamW
    steps with the forward under torch.autocast("cpu", bf16) (x and the biases cast to
    bf16, the codes quantized from the fp32 weights: the same in both)."""
    out = []
    for mx_gather in (False, True):
        model = fsdp_model(recipe, mx_gather=mx_gather)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for step in range(MATRIX_STEPS):
            x, y = batch(step)
            mine = rows_of(rank, world)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out_ = model(x[mine])
            assert out_.dtype == torch.bfloat16, out_.dtype
            loss_fn(out_, y[mine]).backward()
            opt.step()
            opt.zero_grad()
        out.append(full_params(model))
    return out


def mx_job(rank, world):
    results: dict = {}
    for name in MX_RECIPES:
        for dtype in ("fp32", "bf16"):
            check(results, f"pair/{name}/{dtype}", _pair, rank, world, RECIPES[name], dtype)
    for name, (recipe, dims) in FALLBACKS.items():
        check(results, f"fallback/{name}", _pair, rank, world, recipe, "fp32", dims)
    for name in ("default", "mbs", "of"):
        check(results, f"bytes_equal/{name}", _gathered_bytes_equal_quantize, rank, world, RECIPES[name],
              "bf16" if name == "of" else "fp32")
    for mx_gather, dtype in ((True, "fp32"), (True, "bf16"), (False, "fp32"), (False, "bf16")):
        check(results, f"wire/{'mx' if mx_gather else 'hp'}/{dtype}", _wire_bytes, rank, world, mx_gather, dtype)
    check(results, "activation_checkpointing", _activation_checkpointing, rank, world)
    for name in ("default", "w4a16"):
        check(results, f"autocast/{name}", _under_autocast, rank, world, RECIPES[name])
    check(results, "compiled_layers", _compiled_layers, rank, world)
    check(results, "assign", _assign_after_first_gather, rank, world)
    for what in ("recipe", "shape"):
        check(results, f"disagree/{what}", _disagree, rank, world, what)
    check(results, "recipe_change", _recipe_changes_after_first_gather, rank, world)
    check(results, "inference_mode", _first_forward_under_inference_mode, rank, world)
    check(results, "shard_dim_1", _shard_along_dim_1, rank, world)
    return results


@pytest.fixture(scope="module")
def mx_results():
    return run_ranks(mx_job, 2)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("recipe", MX_RECIPES)
def test_mx_gather_is_bit_identical_to_the_high_precision_gather(mx_results, recipe, dtype):
    """3 AdamW steps with the MXFP4 all-gather give FSDP2's high-precision gather's
    parameters bit for bit (fp32 params, and MixedPrecisionPolicy(param_dtype=bf16))."""
    hp, mx, warned = result(mx_results, f"pair/{recipe}/{dtype}")
    assert_params(mx, hp, what=f"{recipe}/{dtype}")
    if recipe == "mbs":  # layer 2: 32 rows per rank, not a multiple of the macro block 64
        assert len(warned) == 1 and "'2'" in warned[0][1] and "macro block 64" in warned[0][1], warned
    else:
        assert warned == []


def test_mx_gather_falls_back_to_high_precision_with_one_warning_per_layer(mx_results):
    """Stochastic rounding, grad_input="high", rows per rank not a multiple of 32 (48)
    and uneven sharding (33 rows over 2 ranks) gather in high precision: the same
    parameters as FSDP2's own gather, and one MXAllGatherFallback per layer naming the
    layer and the reason."""
    reasons = {"sr": ["stochastic rounding"] * 2, "grad_input_high": ["grad_input='high'"] * 2,
               "rows": ["48 rows per rank", "16.5 rows per rank"]}
    for name, expected in reasons.items():
        hp, mx, warned = result(mx_results, f"fallback/{name}")
        assert_params(mx, hp, what=name)
        assert len(warned) == 2, (name, warned)
        for (_, message), layer, reason in zip(warned, ("'0'", "'2'"), expected):
            assert layer in message and reason in message and "high precision" in message, message


@pytest.mark.parametrize("recipe", ["default", "w4a16"])
def test_mx_gather_under_autocast_is_bit_identical_to_the_high_precision_gather(mx_results, recipe):
    """fp32 parameters, forward under torch.autocast(bf16): the MXFP4 gather (codes made
    from the fp32 shards) trains to FSDP2's high-precision gather's parameters (MXLinear
    quantizing the gathered fp32 weight) bit for bit, and the parameters moved."""
    hp, mx = result(mx_results, f"autocast/{recipe}")
    assert_params(mx, hp, what=f"autocast/{recipe}")
    start = make_model(RECIPES[recipe]).state_dict()
    assert all(not torch.equal(hp[k], v) for k, v in start.items())


def test_mx_gather_under_activation_checkpointing(mx_results):
    """With layer 0 under activation checkpointing (its forward recomputed in the
    backward from the re-gathered weight) both gathers give the parameters of the run
    without checkpointing, bit for bit."""
    hp, mx = result(mx_results, "activation_checkpointing")
    plain, _, _ = result(mx_results, "pair/default/fp32")
    assert_params(hp, plain, what="high-precision gather:")
    assert_params(mx, plain, what="MXFP4 gather:")


def test_mx_gather_of_compiled_layers_trains_the_weights(mx_results):
    """Each sharded MXLinear torch.compile-d (aot_eager) under the MXFP4 all-gather: the
    gathered GEMM runs eagerly inside the compiled layer, and training gives FSDP2's
    high-precision gather's parameters bit for bit (the weights got no gradient)."""
    hp, mx = result(mx_results, "compiled_layers")
    assert_params(mx, hp, what="compiled")


def test_load_state_dict_with_assign_keeps_the_mx_gather(mx_results):
    """load_state_dict(assign=True) after the first gather: the incoming weight is wrapped
    for the MXFP4 gather again, and training goes on like the high-precision gather's."""
    hp, mx, kind = result(mx_results, "assign")
    assert kind == "MXWeight"
    assert_params(mx, hp, what="assign")


@pytest.mark.parametrize("recipe", ["default", "mbs", "of"])
def test_gathered_bytes_are_the_full_weight_quantized(mx_results, recipe):
    """An unsharded layer holds exactly quantize(full weight) along K (the forward's
    copy) and along N (the dX GEMM's copy), and refuses other ops with an error naming
    it: MBS-64's layer 2 holds its high-precision weight (fallback); OF runs under bf16
    param_dtype (the shard cast before quantizing)."""
    got = result(mx_results, f"bytes_equal/{recipe}")
    want_kind = {"0": "MXGathered", "2": "Parameter" if recipe == "mbs" else "MXGathered"}
    assert {k: v[0] for k, v in got.items()} == {"0": want_kind["0"], "2": want_kind["2"]}
    assert all(same for _, same in got.values()), got


def test_bytes_on_the_wire_against_the_bf16_gather(mx_results, record_property):
    """Per training step (one forward and one backward gather of each layer), the bytes
    a rank sends: 1.0625 per weight element with the MXFP4 gather (codes 0.5 + scales
    1/32, for each of the two copies) whatever the param dtype, against 2 with FSDP2's
    bf16 gather and 4 with fp32; pmx.nn.gathered_bytes counts the weights' share of it
    (the rest is the biases)."""
    shard = DIMS[0] * DIMS[1] // 2 + DIMS[1] * DIMS[2] // 2  # weight elements per rank, both layers
    bias = (DIMS[1] + DIMS[2]) // 2
    gathers = 2  # forward and backward (reshard_after_forward)
    figures = {}
    for mode, dtype in (("mx", "fp32"), ("mx", "bf16"), ("hp", "fp32"), ("hp", "bf16")):
        wire, counted = result(mx_results, f"wire/{mode}/{dtype}")
        size = 4 if dtype == "fp32" else 2
        weights = math.floor(1.0625 * shard) if mode == "mx" else size * shard
        assert wire == gathers * (weights + size * bias), (mode, dtype, wire)
        assert counted == (gathers * weights if mode == "mx" else 0), (mode, dtype, counted)
        figures[f"{mode}/{dtype}"] = wire
    ratio = figures["mx/bf16"] / figures["hp/bf16"]
    record_property("bytes_per_step", figures)
    print(f"\nall-gather bytes per rank per step: {figures}; MXFP4 / bf16 gather = {ratio:.3f}")
    assert ratio < 0.55


@pytest.mark.parametrize("what", ["recipe", "shape"])
def test_ranks_that_disagree_on_a_layer_get_a_clear_error(mx_results, what):
    """Rank 1 builds layer 0 with another recipe (OF-1) or shape (192 out_features):
    the first forward raises a ValueError on both ranks naming the layer and each
    rank's view of it, and the process group still works (no hang, no garbage)."""
    messages = [res[f"disagree/{what}"] for res in mx_results]
    for status, message in messages:
        assert status == "ok", message
        assert message is not None and "layer '0'" in message and "ranks disagree" in message, message
        if what == "recipe":
            assert "rank 0" in message and "OF-1" in message
        else:
            assert "[128, 64]" in message and "[192, 64]" in message


def test_the_first_forward_under_inference_mode(mx_results):
    hp, mx = result(mx_results, "inference_mode")
    assert torch.equal(hp, mx)


def test_sharding_along_dim_1_is_refused_clearly(mx_results):
    message = result(mx_results, "shard_dim_1")
    assert message is not None and "sharded along dim 1" in message and "Shard(0)" in message, message


def test_a_recipe_change_after_the_first_gather_raises(mx_results):
    message = result(mx_results, "recipe_change")
    assert message is not None and "layer '0'" in message and "changed after its first all-gather" in message


# ----------------------------------------------------------------------------- one process, no process group


def _one_rank(rank, world):
    return _pair(rank, world, RECIPES["default"])


def _swizzled_route_job(rank, world, route):
    """Forwards of a model under FSDP2's MXFP4 gather on the interpreter's Triton backend
    made to route as a GPU that keeps prepared copies of the weight's parts (sm_90's
    swizzled values, sm_100's swizzled scales), against the reference backend on the
    same gathered bytes and an unsharded model trained alike, after each SGD step: the
    largest relative difference of each."""
    import os

    from portable_mx import registry
    from portable_mx.backends.triton import layouts
    from portable_mx.backends.triton.backend import GemmRoute
    from portable_mx.backends.triton.gemm_upcast import UpcastRoute
    from torch.distributed.fsdp import fully_shard

    interp = registry.get("triton-interpret")
    if interp.op_problem("matmul") or interp.unavailable_reason(torch.device("cpu")):
        return None
    forced = (GemmRoute("upcast", upcast=UpcastRoute(layouts.HOPPER_VALUES)) if route == "upcast"
              else GemmRoute("scaled", scales=layouts.BLACKWELL))
    interp.gemm_route = lambda target, a, b: forced
    interp._devices.clear()
    recipe = pmx.QuantRecipe(activations="bf16") if route == "upcast" else pmx.QuantRecipe()

    def make():
        torch.manual_seed(0)
        return pmx.nn.convert(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                                  torch.nn.Linear(64, 64)), recipe)

    model, plain = make(), make()
    pmx.nn.enable_fsdp_mx_all_gather(model)
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, plain)]
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    diffs = []
    for _ in range(3):
        with torch.no_grad():
            os.environ[registry.ENV_BACKEND] = "triton-interpret"
            got = model(x).float()
            os.environ[registry.ENV_BACKEND] = "reference"
            want = model(x).float()
            os.environ[registry.ENV_BACKEND] = "triton-interpret"
            unsharded = plain(x).float()
        diffs.append(((got - want).abs().max() / want.abs().max()).item())
        diffs.append(((got - unsharded).abs().max() / unsharded.abs().max()).item())
        for m, opt in zip((model, plain), opts):
            opt.zero_grad()
            (m(x).float() - 1).pow(2).mean().backward()
            opt.step()
    return diffs


@pytest.mark.parametrize("route", ["upcast", "scaled"])
def test_mx_gather_on_routes_that_keep_prepared_copies_sees_every_step(route):
    """FSDP2 refills its gather buffers in place without counting a write (under
    torch.autograd._unsafe_preserve_version_counter), and the GPU backends keep their
    swizzled copies of a weight's parts per storage and version: every forward after the
    first optimizer step used the first step's weight (off by 0.27-0.51 of the output on
    the sm_90 and sm_100 routes, no error; audit of 2026-11-28). Each gather now counts a
    write: the forwards equal the reference backend's on the same bytes, and the unsharded
    model's, at every step."""
    results = run_ranks(_swizzled_route_job, 2, route=route)
    if results[0] is None:
        pytest.skip("the interpreter does not run the GEMM here")
    for diffs in results:
        assert max(diffs) < 1e-5, diffs  # (fp32 outputs: the backends' GEMMs differ at most in summation order)


def test_one_rank_falls_back_to_high_precision():
    """FSDP2 on one rank (torchrun --nproc_per_node 1) gathers nothing: its single-rank
    path copies a weight's first all-gather input only, and the first forward failed
    ("b_parts must be [qdata, scales] ... got 1 tensor(s)"). Each layer now keeps its
    high-precision weight, warning once, and trains like FSDP2's own gather."""
    hp, mx, warned = run_ranks(_one_rank, 1)[0]
    assert_params(mx, hp, what="one rank")
    assert len(warned) == 2 and all("one rank" in message for _, message in warned), warned


def test_prepared_model_trains_like_the_plain_model_outside_fsdp():
    """enable_fsdp_mx_all_gather changes nothing outside FSDP2: the wrapped weights train
    bit for bit like the plain ones, the state dict holds plain tensors, and the
    optimizer's state is plain."""
    from dist_training import batch, loss_fn, make_model

    plain, wrapped = make_model(RECIPES["default"]), make_model(RECIPES["default"])
    assert pmx.nn.enable_fsdp_mx_all_gather(wrapped) == 2
    assert pmx.nn.enable_fsdp_mx_all_gather(wrapped) == 2  # idempotent
    assert type(wrapped[0].weight).__name__ == "MXWeight" and wrapped[0].weight.requires_grad
    assert all(type(v) is torch.Tensor for v in wrapped.state_dict().values())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, wrapped)]
    for step in range(2):
        x, y = batch(step)
        for model, opt in zip((plain, wrapped), opts):
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert_params(wrapped.state_dict(), plain.state_dict())
    assert type(opts[1].state[wrapped[0].weight]["exp_avg"]) is torch.Tensor
    wrapped.load_state_dict(make_model(RECIPES["default"], seed=3).state_dict())  # in place, into the wrapper
    assert type(wrapped[0].weight).__name__ == "MXWeight"
    assert torch.equal(wrapped.state_dict()["0.weight"], make_model(RECIPES["default"], seed=3)[0].weight)
    wrapped.load_state_dict(make_model(RECIPES["default"], seed=4).state_dict(), assign=True)  # replaced, rewrapped
    assert type(wrapped[0].weight).__name__ == "MXWeight" and wrapped[0].weight.requires_grad
    assert torch.equal(wrapped.state_dict()["0.weight"], make_model(RECIPES["default"], seed=4)[0].weight)


def test_data_assignment_reaches_a_prepared_weight():
    """``weight.data = t`` on a prepared layer (what ``vector_to_parameters`` and FSDP1's
    use_orig_params do): the forward, the state dict and later in-place writes to ``t``
    all see ``t``, as for a plain weight. Torch's setter swapped the wrapper's storage and
    left the tensor every op reads: the forward kept the old weight (|y - bias| 1.7 for a
    zero weight), FSDP1 on one rank trained wrong without a word. A tensor of another
    shape is refused with a message (FSDP1 on several ranks empties a parameter that way;
    it crashed in the optimizer)."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters
    from dist_training import DIMS, make_model

    x = torch.randn(8, DIMS[0], generator=torch.Generator().manual_seed(9))
    wrapped = make_model(RECIPES["default"])
    pmx.nn.enable_fsdp_mx_all_gather(wrapped)
    layer = wrapped[0]
    zero = torch.zeros_like(layer.weight._tensor)
    layer.weight.data = zero
    assert torch.equal(layer(x), layer.bias.expand(8, -1))  # x @ 0 + bias, exactly
    assert torch.equal(wrapped.state_dict()["0.weight"], zero)
    other = make_model(RECIPES["default"], seed=5)
    with torch.no_grad():
        zero.copy_(other[0].weight)  # a write to the assigned tensor reaches the layer
        layer.bias.copy_(other[0].bias)
    assert torch.equal(layer(x), other[0](x))
    vector_to_parameters(parameters_to_vector(other.parameters()), wrapped.parameters())
    assert type(layer.weight).__name__ == "MXWeight"
    assert torch.equal(wrapped(x), other(x))
    with pytest.raises(ValueError, match="must keep the weight's shape"):
        layer.weight.data = torch.zeros(0)


def test_prepared_model_compiles_outside_fsdp():
    """A prepared model compiled without FSDP2: torch.compile guarded on a deep copy of the
    weight's flatten context, which never matched ("Guard failed on the same frame it was
    created", an AssertionError from dynamo); it now trains like the plain model."""
    from dist_training import batch, loss_fn, make_model

    plain, wrapped = make_model(RECIPES["default"]), make_model(RECIPES["default"])
    pmx.nn.enable_fsdp_mx_all_gather(wrapped)
    compiled = torch.compile(wrapped, backend="aot_eager")
    x, y = batch(0)
    loss_fn(plain(x), y).backward()
    loss_fn(compiled(x), y).backward()
    for (name, p), q in zip(plain.named_parameters(), wrapped.parameters()):
        assert q.grad is not None and torch.equal(q.grad, p.grad), name


def test_enable_rejects_bad_input_and_skips_tied_weights():
    with pytest.raises(TypeError, match="expects a torch.nn.Module"):
        pmx.nn.enable_fsdp_mx_all_gather("model")
    model = pmx.nn.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)))
    model[1].weight = model[0].weight
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert pmx.nn.enable_fsdp_mx_all_gather(model) == 0
    assert [str(w.message).split(" shares")[0] for w in caught] == [
        "MXFP4 all-gather: layer '0'", "MXFP4 all-gather: layer '1'"]
    assert model[1].weight is model[0].weight
    # a parametrized weight falls back per layer (it was refused for the whole model as "already sharded")
    model = pmx.nn.convert(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)))
    torch.nn.utils.parametrizations.weight_norm(model[0])
    with pytest.warns(pmx.nn.MXAllGatherFallback, match="layer '0' computes its weight through a parametrization"):
        assert pmx.nn.enable_fsdp_mx_all_gather(model) == 1
    assert type(model[1].weight).__name__ == "MXWeight"


def test_the_single_process_path_never_loads_the_distributed_code():
    """import portable_mx, convert, forward and backward: portable_mx.distributed stays
    unloaded (the pmx.nn names load it on first use)."""
    code = ("import sys, torch, portable_mx as pmx\n"
            "m = pmx.nn.convert(torch.nn.Linear(32, 16))\n"
            "m(torch.randn(4, 32)).sum().backward()\n"
            "assert 'portable_mx.distributed' not in sys.modules, 'loaded'\n"
            "pmx.nn.enable_fsdp_mx_all_gather\n"
            "assert 'portable_mx.distributed.fsdp' in sys.modules\n")
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
