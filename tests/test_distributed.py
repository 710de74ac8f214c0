"""MXLinear under FSDP2 and DDP on 2 gloo ranks on the CPU, against one process.

The model is the issue's: ``convert(Linear(64, 128), GELU, Linear(128, 64))``; each step
trains AdamW on a fresh seeded batch of 64 rows, half per rank. Two references, both one
process with no process group, computed in the test process:

- the full batch (64 rows in one forward): what the ranks compute up to the fp32
  summation order of the gradient (the dW GEMM sums 64 rows in one GEMM there, two
  sums of 32 plus an all-reduce here), for recipes with nearest rounding;
- the ranks' micro-batches (32 rows each, gradients averaged): the same arithmetic as
  the ranks, including stochastic rounding (whose counters restart in every GEMM), so
  DDP and FSDP2 must give it bit for bit.

One spawned job runs every check of a group on one process group and returns results;
the tests below read them (a failing check fails its own test, with the rank's
traceback).
"""

from __future__ import annotations

import pytest
import torch

import portable_mx as pmx

from dist_harness import run_ranks
from dist_training import (DEFAULT, FP32_ORDER, MATRIX_STEPS, RECIPES, ROWS, assert_params, check, ddp_model,
                           fsdp_model, full_batch_rows, result, train_ranks, train_reference)

# ----------------------------------------------------------------------------- the FSDP2 / DDP job

CACHE_REPEATS = 3
"""Times the cache regression trains its fresh FSDP2 model (6 steps each)."""


def _cache_regression(rank, world):
    return [train_ranks(fsdp_model(DEFAULT), rank, world) for _ in range(CACHE_REPEATS)]


def _cache_regression_in_block(rank, world):
    model = fsdp_model(DEFAULT)
    with pmx.nn.weight_cache(model) as cached_layers:
        params = train_ranks(model, rank, world)
    return cached_layers, params


def _cache_on_a_submodule(rank, world):
    """fully_shard on the root only, weight_cache on a child (which cannot see the root):
    (the layers caching, max |y - fresh| after an in-place update inside the block)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(0)
        return pmx.nn.convert(nn.Sequential(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))))

    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    model, fresh = build(), build()
    fully_shard(model, reshard_after_forward=True)
    with pmx.nn.weight_cache(model[0]) as cached_layers, torch.no_grad():
        model(x)
        model(x)
        for p in (*model.parameters(), *fresh.parameters()):
            p.mul_(0.5)
        y = model(x)
        want = fresh(x)
    return cached_layers, (y - want).abs().max().item()


def _convert_after_fully_shard(rank, world):
    """convert on a model fully_shard already sharded (each layer, or the root only): the
    TypeError messages, or "converted" where convert went through."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    out = []
    for per_layer in (True, False):
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
        if per_layer:
            fully_shard(model[0])
        fully_shard(model)
        try:
            pmx.nn.convert(model)
            out.append("converted")
        except TypeError as err:
            out.append(str(err) if all(type(m) is not pmx.nn.MXLinear for m in model) else f"half: {err}")
    # a skip rule keeps a sharded layer: the others convert
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    fully_shard(model[0])
    pmx.nn.convert(model, skip="0")
    out.append(f"skipped: {type(model[0]).__name__} {type(model[2]).__name__}")
    return out


class GptOssExperts(torch.nn.Module):
    """Stands for transformers' class of that name (convert knows a family by the class's
    name and module, and refuses a sharded one before reading anything else of it)."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(4, 64, 64))


GptOssExperts.__module__ = "transformers.models.gpt_oss.modeling_gpt_oss"


def _dtensors_refused(rank, world):
    """What takes a float weight, given FSDP2's shard (a DTensor) between forwards: the
    TypeError messages (the audit: its quantized bytes were wrong, torch's DTensor
    dropping ``<<``), and convert on sharded transformers experts, which stayed float."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    linear = pmx.nn.convert(nn.Sequential(nn.Linear(64, 64)))
    experts = pmx.nn.MXExperts(4, 64, 32, transposed=True)
    fully_shard(linear)
    fully_shard(experts)
    out = []
    for call in (lambda: linear[0].quantized_weight(), lambda: experts.quantized_weight("gate_up_proj"),
                 lambda: pmx.quantize(experts.down_proj, axis=1),
                 lambda: pmx.matmul(torch.randn(2, 64), linear[0].weight.T),
                 lambda: pmx.grouped_matmul(torch.randn(3, 64), experts.down_proj.transpose(1, 2),
                                            offsets=torch.tensor([1, 2, 3, 3], dtype=torch.int32))):
        try:
            call()
            out.append("went through")
        except TypeError as err:
            out.append(str(err))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp = parallelize_module(pmx.nn.convert(nn.Sequential(nn.Linear(64, 64))), init_device_mesh("cpu", (world,)),
                            {"0": ColwiseParallel()})
    for grad in (False, True):  # (without autograd the layer used to quantize the DTensor's bytes, wrongly)
        try:
            with torch.set_grad_enabled(grad):
                tp(torch.randn(2, 64))
            out.append("went through")
        except TypeError as err:
            out.append(str(err))
    for how in ("per layer", "root", "per layer, unsharded now"):
        model = nn.Sequential(nn.GELU(), GptOssExperts())
        if how != "root":
            fully_shard(model[1])
        fully_shard(model)
        if how.endswith("now"):
            model[1].unshard()  # plain parameters, still FSDP2's (FSDPGptOssExperts)
        try:
            pmx.nn.convert(model)
            out.append("converted")
        except TypeError as err:
            out.append(str(err))
    return out


def fsdp_job(rank, world, only_cache: bool = False):
    results: dict = {}
    check(results, "cache", _cache_regression, rank, world)
    if only_cache:
        return results
    check(results, "cache_block", _cache_regression_in_block, rank, world)
    check(results, "cache_sub", _cache_on_a_submodule, rank, world)
    check(results, "convert_after", _convert_after_fully_shard, rank, world)
    check(results, "dtensors", _dtensors_refused, rank, world)
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    n = MATRIX_STEPS
    for name, recipe in RECIPES.items():
        rows = full_batch_rows(recipe)
        check(results, f"fsdp/{name}/fp32", lambda: train_ranks(fsdp_model(recipe), rank, world, n, rows=rows))
        check(results, f"fsdp/{name}/bf16",
              lambda: train_ranks(fsdp_model(recipe, bf16), rank, world, n, param_dtype=torch.bfloat16))
        check(results, f"ddp/{name}", lambda: train_ranks(ddp_model(recipe), rank, world, n, rows=rows))
    return results


@pytest.fixture(scope="module")
def fsdp_results():
    return run_ranks(fsdp_job, 2)


def test_fsdp2_mxlinear_matches_one_process_full_batch(fsdp_results):
    """The issue's defect (a quantized weight cached across FSDP2's in-place refills of
    the unsharded weight: the forward used an earlier step's weight, parameters off by
    4e-2): fresh FSDP2 runs of 6 AdamW steps on 2 ranks agree with one process on the
    full batch within fp32 summation order, every time."""
    want = train_reference(DEFAULT)
    runs = result(fsdp_results, "cache")
    diffs = [max((got[k] - want[k]).abs().max().item() for k in want) for got in runs]
    assert max(diffs) <= FP32_ORDER, f"max |diff| of each run: {[f'{d:.2g}' for d in diffs]} (> {FP32_ORDER:g})"
    for got in runs:
        assert_params(got, want, FP32_ORDER)


def test_fsdp2_inside_weight_cache_block(fsdp_results):
    """The same inside ``pmx.nn.weight_cache(model)``: FSDP-managed layers never cache
    (the block reports 0 caching layers) and training is unchanged."""
    cached_layers, got = result(fsdp_results, "cache_block")
    assert_params(got, train_reference(DEFAULT), FP32_ORDER)
    assert cached_layers == 0


def test_weight_cache_on_a_child_of_a_sharded_model(fsdp_results):
    """fully_shard on the root only and weight_cache(model[0]): the child cannot see the
    root's FSDPModule type, so its layers cached, and after an in-place update FSDP's
    refill at the same address hit the cache: outputs off by 0.2-0.5 (found by the audit).
    The block now finds FSDP2's states: no layer caches, the output is the fresh one."""
    cached_layers, diff = result(fsdp_results, "cache_sub")
    assert cached_layers == 0 and diff == 0.0, (cached_layers, diff)


def test_convert_after_fully_shard_is_refused(fsdp_results):
    """convert after fully_shard: a per-layer sharded Linear (an FSDPLinear) was skipped
    silently (that layer trained in fp32), and with the root alone sharded the forward
    failed in torch ('mixed torch.Tensor and DTensor'). Now a TypeError saying to convert
    first, and the model left as it was; a skip rule naming the sharded layer keeps it
    and converts the rest."""
    *refused, skipped = result(fsdp_results, "convert_after")
    assert len(refused) == 2
    for message in refused:
        assert "already sharded by FSDP2's fully_shard" in message and "convert the model before" in message, message
    assert skipped == "skipped: FSDPLinear MXLinear", skipped  # a skip rule keeps the sharded layer


def test_sharded_weights_are_refused_not_quantized_wrongly(fsdp_results):
    """quantized_weight of a sharded MXLinear or MXExperts, pmx.quantize / matmul /
    grouped_matmul of a DTensor: a TypeError saying to gather it, where the bytes were
    wrong before (scales and codes off, NaN after a round trip through a checkpoint). A
    tensor-parallel plan (ColwiseParallel) on an MXLinear: a TypeError saying tensor
    parallelism is not supported (without autograd the layer quantized the DTensor
    weight's bytes, wrongly, until a table lookup failed in torch). And
    convert of transformers experts sharded per layer (FSDP2's FSDPGptOssExperts, its
    parameters sharded or unsharded at the moment) or by the root is refused as a sharded
    Linear is: the first stayed float without a word."""
    messages = result(fsdp_results, "dtensors")
    assert len(messages) == 10
    for message in messages[:5]:
        assert "is a DTensor" in message and "full_tensor()" in message, message
    for message in messages[5:7]:  # a tensor-parallel plan, with and without autograd
        assert "MXLinear: the weight is a DTensor" in message and "Tensor parallelism" in message, message
    for message in messages[7:]:
        assert "already sharded by FSDP2's fully_shard" in message and "'1'" in message, message


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("engine", ["fsdp/{}/fp32", "fsdp/{}/bf16", "ddp/{}"])
def test_ranks_equal_one_process_on_their_micro_batches(fsdp_results, engine, recipe):
    """DDP (static graph, gradients as bucket views) and FSDP2 (high-precision gather;
    fp32, and MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)) give the
    parameters of one process that averages the gradients of the ranks' micro-batches,
    bit for bit, for every recipe (stochastic rounding included)."""
    name = engine.format(recipe)
    r = RECIPES[recipe]
    bf16 = name.endswith("bf16")
    want = train_reference(r, MATRIX_STEPS, micro_batches=2, param_dtype=torch.bfloat16 if bf16 else None,
                           rows=ROWS if bf16 else full_batch_rows(r))
    assert_params(result(fsdp_results, name), want, what=name)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if RECIPES[r].rounding == "nearest"])
@pytest.mark.parametrize("engine", ["fsdp/{}/fp32", "ddp/{}"])
def test_ranks_equal_one_process_on_the_full_batch(fsdp_results, engine, recipe):
    """The same fp32 runs against one process on the full batch, for the recipes with
    nearest rounding: equal within fp32 summation order (stochastic rounding draws
    different numbers for a row in a batch of 32 than in one of 64)."""
    name = engine.format(recipe)
    r = RECIPES[recipe]
    want = train_reference(r, MATRIX_STEPS, rows=full_batch_rows(r))
    assert_params(result(fsdp_results, name), want, FP32_ORDER, what=name)
