"""MXLinear never serves a quantized weight whose values changed (issue: stale weights under
fused optimizers and ``.data`` writes).

Every way a training loop or a user changes a weight: optimizers with ``fused=True`` (which
leave the version counter as it was), writes through ``weight.data``, numpy views, a new
``weight.data`` twice in a row (the allocator reuses the address), plus the ordinary ones.
After each, the layer's forward must equal that of a freshly built MXLinear holding the
same state (the oracle: no history, nothing cached). Inside a ``pmx.nn.weight_cache``
block the tracked updates (optimizer steps of every kind, version-bumping in-place updates,
load_state_dict, a new Parameter) must be seen as well, and the quantized weight must be
reused between them."""

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import portable_mx as pmx
from portable_mx.nn import MXLinear

IN, OUT = 64, 16
RECIPES = [pmx.QuantRecipe(), pmx.QuantRecipe(macro_block=64, outliers_per_block=1),
           pmx.QuantRecipe(activations="bf16")]


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def fresh_output(layer: MXLinear, x: torch.Tensor) -> torch.Tensor:
    """The oracle: a new MXLinear with the layer's recipe and a copy of its state."""
    ref = MXLinear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                   dtype=layer.weight.dtype, recipe=layer.recipe)
    ref.load_state_dict({k: v.detach().clone() for k, v in layer.state_dict().items()})
    with torch.no_grad():
        return ref(x)


def assert_fresh(layer: MXLinear, x: torch.Tensor, what: str) -> None:
    want = fresh_output(layer, x)
    with torch.no_grad():
        got = layer(x)
    assert torch.equal(got, want), f"no_grad forward after {what} used a stale weight"
    got = layer(x.clone().requires_grad_())
    assert torch.equal(got.detach(), want), f"autograd forward after {what} used a stale weight"


def step(layer: MXLinear, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    layer(x).pow(2).mean().backward()
    opt.step()


OPTIMIZERS = {
    "AdamW": lambda p, **kw: torch.optim.AdamW(p, lr=1e-2, **kw),
    "Adam": lambda p, **kw: torch.optim.Adam(p, lr=1e-2, **kw),
    "SGD": lambda p, **kw: torch.optim.SGD(p, lr=1e-1, momentum=0.9, **kw),
    "Adagrad": lambda p, **kw: torch.optim.Adagrad(p, lr=1e-1, **kw),
}
IMPLS = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


# ----------------------------------------------------------------------------- outside the block


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_optimizer_steps_reach_the_forward(name):
    """A fused step leaves ``_version`` unchanged; every forward must still see it."""
    torch.manual_seed(0)
    layer = MXLinear(IN, OUT)
    opt = OPTIMIZERS[name](layer.parameters(), fused=True)
    x = rand(8, IN, seed=1)
    for i in range(3):
        v = layer.weight._version
        step(layer, opt, x)
        assert layer.weight._version == v  # the premise: fused steps do not bump the counter
        assert_fresh(layer, x, f"{name}(fused=True) step {i}")


def test_fused_adamw_regression_learns_the_weight():
    """The issue's regression: MXLinear(64, 1) fitted with fused AdamW learns as with the
    single-tensor AdamW (with a stale weight only the bias learned: in the issue's 200-step
    run the loss stayed at 56.8 against 4.3)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, generator=g)
    w_true = torch.randn(1, 64, generator=g)
    y = x @ w_true.T * 3
    losses = {}
    for impl in ("single", "fused"):
        torch.manual_seed(0)
        layer = MXLinear(64, 1)
        opt = torch.optim.AdamW(layer.parameters(), lr=0.1, **IMPLS[impl])
        for _ in range(60):
            opt.zero_grad()
            loss = (layer(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
        losses[impl] = loss.item()
    start = y.pow(2).mean().item()
    assert losses["single"] < 0.2 * start, losses
    assert losses["fused"] < 0.2 * start and abs(losses["fused"] - losses["single"]) < 0.05 * start, losses


def _write_ways():
    """(name, fn(layer, new_values)) for every untracked or tracked write of new values."""

    def data_copy(layer, w):
        layer.weight.data.copy_(w)

    def data_mul(layer, w):
        layer.weight.data.mul_(0.5)

    def data_setitem(layer, w):
        layer.weight.data[:] = w

    def data_clamp(layer, w):
        layer.weight.data.clamp_(-0.05, 0.05)

    def numpy_view(layer, w):
        if w.dtype == torch.bfloat16:  # numpy has no bf16: write the bits through an int16 view
            layer.weight.detach().view(torch.int16).numpy()[:] = w.view(torch.int16).numpy()
        else:
            layer.weight.detach().numpy()[:] = w.numpy()

    def data_assign_twice(layer, w):
        layer.weight.data = w.clone()
        layer.weight.data = (w * 2).clone()  # the allocator may hand out the freed address

    def no_grad_copy(layer, w):
        with torch.no_grad():
            layer.weight.copy_(w)

    def load_state(layer, w):
        layer.load_state_dict({"weight": w, "bias": layer.bias.detach().clone()})

    def new_parameter(layer, w):
        layer.weight = nn.Parameter(w.clone())

    return [data_copy, data_mul, data_setitem, data_clamp, numpy_view, data_assign_twice, no_grad_copy,
            load_state, new_parameter]


@pytest.mark.parametrize("write", _write_ways(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.describe())
def test_every_write_reaches_the_forward(write, recipe):
    layer = MXLinear(IN, OUT, recipe=recipe)
    if recipe.activations == "bf16":
        layer = layer.to(torch.bfloat16)
    x = rand(8, IN, seed=2).to(layer.weight.dtype)
    with torch.no_grad():
        layer(x)  # a first forward (the old cache was filled here)
    layer(x.clone().requires_grad_())
    for i in range(2):
        write(layer, rand(OUT, IN, seed=10 + i).to(layer.weight.dtype))
        assert_fresh(layer, x, f"{write.__name__} #{i}")


# ----------------------------------------------------------------------------- inside the block


@pytest.mark.parametrize("impl", IMPLS)
def test_weight_cache_block_sees_every_optimizer_step(impl, monkeypatch):
    builds = []
    real = MXLinear._quantize_weight
    monkeypatch.setattr(MXLinear, "_quantize_weight", lambda self, w: builds.append(1) or real(self, w))
    torch.manual_seed(0)
    layer = MXLinear(IN, OUT)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2, **IMPLS[impl])
    x = rand(8, IN, seed=4)
    with pmx.nn.weight_cache(layer):
        for i in range(3):
            step(layer, opt, x)
            builds.clear()
            assert_fresh(layer, x, f"AdamW({impl}) step {i} inside weight_cache")
            assert len(builds) == 1  # built once, then reused by the second forward
            with torch.no_grad():
                layer(x)
            assert len(builds) == 1


def test_weight_cache_skips_fsdp_managed_layers():
    """FSDP2 refills its unsharded weights under a preserved version counter: layers under
    an FSDPModule never cache, even inside the block."""
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    model = nn.Sequential(MXLinear(IN, OUT), nn.Sequential(MXLinear(OUT, OUT)))
    # the type test is what weight_cache relies on; make the inner block look FSDP-managed
    managed = type("FSDPSequential", (fsdp.FSDPModule, nn.Sequential), {})
    model[1].__class__ = managed
    with pmx.nn.weight_cache(model) as n:
        assert n == 1 and model[0]._pmx_weight_cache.active and not model[1][0]._pmx_weight_cache.active


# ----------------------------------------------------------------------------- property


ACTIONS = ["opt_single", "opt_foreach", "opt_fused", "sgd_fused", "data_copy", "data_mul", "data_setitem",
           "numpy", "data_assign", "no_grad_add", "load_state", "new_param", "forward"]
TRACKED = ["opt_single", "opt_foreach", "opt_fused", "sgd_fused", "no_grad_add", "load_state", "new_param",
           "forward"]


def _apply(action: str, layer: MXLinear, opts: dict, x: torch.Tensor, seed: int) -> None:
    w = rand(OUT, IN, seed=seed)
    if action.startswith(("opt_", "sgd_")):
        step(layer, opts[action], x)
    elif action == "data_copy":
        layer.weight.data.copy_(w)
    elif action == "data_mul":
        layer.weight.data.mul_(-1.5)
    elif action == "data_setitem":
        layer.weight.data[: OUT // 2] = w[: OUT // 2]
    elif action == "numpy":
        layer.weight.detach().numpy()[:, :3] = np.float32(seed % 7 - 3)
    elif action == "data_assign":
        layer.weight.data = w
    elif action == "no_grad_add":
        with torch.no_grad():
            layer.weight.add_(w, alpha=0.1)
    elif action == "load_state":
        layer.load_state_dict({"weight": w, "bias": layer.bias.detach() + 1})
    elif action == "new_param":
        layer.weight = nn.Parameter(w)
        for o in opts.values():  # the optimizers keep training the layer's current weight
            o.param_groups[0]["params"][0] = layer.weight
            o.state.clear()


def _optimizers(layer: MXLinear) -> dict:
    return {
        "opt_single": torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=False),
        "opt_foreach": torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=True),
        "opt_fused": torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True),
        "sgd_fused": torch.optim.SGD(layer.parameters(), lr=1e-1, fused=True),
    }


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(st.sampled_from(ACTIONS), min_size=1, max_size=6),
       recipe=st.sampled_from(RECIPES[:2]), seed=st.integers(0, 1000))
def test_random_update_sequences_match_a_fresh_layer(actions, recipe, seed):
    torch.manual_seed(seed)
    layer = MXLinear(IN, OUT, recipe=recipe)
    opts = _optimizers(layer)
    x = rand(4, IN, seed=seed + 1)
    for i, action in enumerate(actions):
        _apply(action, layer, opts, x, seed + 2 + i)
        assert_fresh(layer, x, f"{actions[: i + 1]}")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(st.sampled_from(TRACKED), min_size=1, max_size=6),
       recipe=st.sampled_from(RECIPES[:2]), seed=st.integers(0, 1000))
def test_random_tracked_updates_inside_weight_cache_match_a_fresh_layer(actions, recipe, seed):
    torch.manual_seed(seed)
    layer = MXLinear(IN, OUT, recipe=recipe)
    opts = _optimizers(layer)
    x = rand(4, IN, seed=seed + 1)
    with pmx.nn.weight_cache(layer):
        for i, action in enumerate(actions):
            _apply(action, layer, opts, x, seed + 2 + i)
            assert_fresh(layer, x, f"{actions[: i + 1]} inside weight_cache")


def test_weight_cache_under_swap_module_params_on_conversion():
    """With torch.__future__.set_swap_module_params_on_conversion(True), module.half() and
    load_state_dict swap the Parameter's contents in place (torch.utils.swap_tensors),
    which refuses a tensor with a weakref: the cache held one and both raised inside a
    weight_cache block. Each forward in the block equals the uncached forward of the same
    weights."""
    torch.manual_seed(0)
    layer = pmx.nn.convert(nn.Linear(64, 32))
    x = torch.randn(4, 64)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        outs = []
        with torch.no_grad():
            fresh = copy.deepcopy(layer)(x)
            with pmx.nn.weight_cache(layer):
                outs.append(layer(x))
                assert torch.equal(outs[0], fresh)
                layer.half()
                outs.append(layer(x.half()))
                layer.load_state_dict({k: v * 2 for k, v in layer.state_dict().items()})
                outs.append(layer(x.half()))
            assert torch.equal(outs[2], layer(x.half()))  # uncached: the same weights
            layer.load_state_dict({k: v / 2 for k, v in layer.state_dict().items()})
            assert torch.equal(outs[1], layer(x.half()))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def test_weight_cache_keeps_a_replaced_weights_storage_until_the_next_forward():
    """``weight.data = other`` (or a swap) frees the weight's old storage, and the allocator
    hands its address to the next tensor of the same size: with the same Parameter object,
    version counter and address, the cache key matched and the old quantized weight came
    back (an audit saw it in 4 of 20 trials of two ``.data`` assignments). The cache now
    holds the cached weight's storage, so a new one cannot take its address; the storage
    is released when the entry is replaced. Checked on the storage's lifetime (the
    address reuse itself depends on the allocator), then on the outputs."""
    import gc
    import weakref

    torch.manual_seed(0)
    layer = MXLinear(256, 128, bias=False)
    x = torch.randn(4, 256)
    with torch.no_grad(), pmx.nn.weight_cache(layer):
        layer(x)
        old = weakref.ref(layer.weight.untyped_storage())
        layer.weight.data = torch.randn(128, 256)
        layer.weight.data = torch.randn(128, 256)
        gc.collect()
        assert old() is not None  # its address cannot be handed out while the entry lives
        y = layer(x)
        gc.collect()
        assert old() is None  # released once the entry was replaced
    with torch.no_grad():
        assert torch.equal(y, layer(x))  # uncached: the same weight
        for _ in range(20):
            with pmx.nn.weight_cache(layer):
                layer(x)
                layer.weight.data = torch.randn(128, 256)
                layer.weight.data = torch.randn(128, 256)
                y = layer(x)
            assert torch.equal(y, layer(x))


def test_writes_into_the_handed_out_quantized_weight_do_not_reach_later_forwards():
    """quantized_weight() hands out the cached MXTensor inside a block; writing into its
    parts made every later forward use those bytes (the audit: max difference ~1.5). The
    entry now checks its parts' versions and is rebuilt from the weight."""
    torch.manual_seed(0)
    lin = MXLinear(128, 64, bias=False)
    x = torch.randn(4, 128)
    with torch.no_grad():
        want = lin(x)  # uncached
        with pmx.nn.weight_cache(lin):
            lin(x)
            lin.quantized_weight().scales.add_(1)
            assert torch.equal(lin(x), want)
            lin.quantized_weight().qdata.zero_()
            assert torch.equal(lin(x), want)
            assert lin.quantized_weight() is lin.quantized_weight()  # still cached when untouched


def test_a_block_in_one_thread_does_not_cache_for_another():
    """A weight_cache block covers the thread that entered it. Another thread's forward,
    outside any block, made no promise about untracked writes, and must see its own
    .data write (the block's depth was shared by every thread: it got the stale weight,
    max difference 0.85 in the audit)."""
    import threading

    torch.manual_seed(0)
    lin = MXLinear(128, 64, bias=False)
    x = torch.randn(4, 128)
    cached, release, errors = threading.Event(), threading.Event(), []

    def rollouts():
        try:
            with torch.no_grad(), pmx.nn.weight_cache(lin):
                lin(x)
                cached.set()
                release.wait(10)
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    t = threading.Thread(target=rollouts)
    t.start()
    try:
        assert cached.wait(10)
        with torch.no_grad():
            lin.weight.data.mul_(0.5)  # untracked: allowed outside a block
            fresh = copy.deepcopy(lin)
            assert torch.equal(lin(x), fresh(x))
    finally:
        release.set()
        t.join(10)
    assert not errors


def _broadcast_inside_weight_cache(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # a different weight on each rank
    layer = MXLinear(64, 32, bias=False)  # (a bias is read as it is at every forward)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7))
    out = {}
    with torch.no_grad(), pmx.nn.weight_cache(layer):
        out["before"] = layer(x)
        torch.distributed.broadcast(layer.weight, src=0)  # (the trainer's weights, rank 0's)
        out["unseen"] = layer(x)
        for p in layer.parameters():
            torch.autograd.graph.increment_version(p)
        out["seen"] = layer(x)
    with torch.no_grad():
        out["fresh"] = layer(x)  # outside the block: quantized from the weight as it is
    return out


def test_a_collective_write_inside_weight_cache_is_seen_after_increment_version():
    """torch.distributed collectives write a tensor in place without bumping its version
    counter (gloo, checked here; audit): a rollout model that receives the trainer's
    weights by broadcast inside a weight_cache block keeps its old quantized weight, as the
    module doc and the README say. The remedy they give, increment_version on the
    weights after the collective, makes the next forward use the new weights."""
    from dist_harness import run_ranks

    results = run_ranks(_broadcast_inside_weight_cache, world_size=2)
    receiver = results[1]
    assert torch.equal(receiver["fresh"], results[0]["fresh"])  # rank 1 holds rank 0's weights now
    assert not torch.equal(receiver["fresh"], receiver["before"])
    assert torch.equal(receiver["unseen"], receiver["before"])  # the write the cache cannot see
    assert torch.equal(receiver["seen"], receiver["fresh"])


def test_weight_cache_keeps_its_weights_under_inference_mode(monkeypatch):
    """torch.inference_mode, the usual serving context: the value built there was made of
    inference tensors, which have no version counters, so the entry was dropped and every
    forward quantized the weight again (MXLinear: once a forward; float MXExperts: twice).
    Built outside inference mode it is kept, and an in-place write made inside inference
    mode is still seen (the next forward equals a fresh layer's)."""
    builds = []
    real = pmx.ops.quantize
    monkeypatch.setattr(pmx.ops, "quantize", lambda *a, **kw: builds.append(1) or real(*a, **kw))
    torch.manual_seed(0)
    layer = MXLinear(IN, OUT)
    experts = pmx.nn.MXExperts(4, IN, 32, recipe=pmx.QuantRecipe(activations="bf16"))
    x, ids = rand(8, IN, seed=4), torch.randint(0, 4, (8, 2), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), pmx.nn.weight_cache(layer), pmx.nn.weight_cache(experts):
        first, first_experts = layer(x), experts(x, ids)
        builds.clear()
        assert torch.equal(layer(x), first) and torch.equal(experts(x, ids), first_experts)
        assert builds == []  # nothing quantized again
        layer.weight.mul_(0.5)  # allowed in inference mode on a normal tensor; its version moves
        fresh = copy.deepcopy(layer)
        assert torch.equal(layer(x), fresh(x)) and not torch.equal(layer(x), first)
        builds.clear()
        layer(x)
        assert builds == []


class _Counting(nn.Module):
    """A parametrization whose n-th evaluation returns n * W: an evaluation more or less
    than the forward's one shows as a weight scaled by another integer."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def forward(self, w):
        self.n += 1
        return w * self.n


def test_a_parametrized_weight_is_computed_once_per_forward_inside_a_block_under_autograd():
    # the forward read the weight, then read it twice more to look up the cache: a stateful
    # parametrization (spectral_norm's power iteration in training) stepped three times, the
    # GEMM used the third value (4 W here) and the backward the first (2 W)
    import torch.nn.utils.parametrize as P

    layer = MXLinear(IN, OUT, recipe=RECIPES[1])
    with torch.no_grad():
        layer.weight.copy_(rand(OUT, IN, seed=1))
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    P.register_parametrization(layer, "weight", _Counting())  # (registration evaluates it: n = 1)
    count = layer.parametrizations.weight[0]
    x = rand(5, IN, seed=2).requires_grad_()
    with pmx.nn.weight_cache(layer):
        y = layer(x)
        assert count.n == 2  # one evaluation: the forward's (2 W)
        (dx,) = torch.autograd.grad(y.sum(), x)
        layer.quantized_weight()
        assert count.n == 3  # and one for quantized_weight()

    oracle = MXLinear(IN, OUT, recipe=RECIPES[1])
    with torch.no_grad():
        oracle.weight.copy_(2 * w)
        oracle.bias.copy_(b)
    assert torch.equal(y.detach(), oracle(x).detach())
    (dx_oracle,) = torch.autograd.grad(oracle(x).sum(), x)
    assert torch.equal(dx, dx_oracle)


def test_the_experts_parametrized_weight_is_computed_once_by_quantized_weight():
    import torch.nn.utils.parametrize as P

    experts = pmx.nn.MXExperts(2, 32, 32, recipe=RECIPES[0])
    P.register_parametrization(experts, "down_proj", _Counting())
    count = experts.parametrizations.down_proj[0]
    before = count.n
    experts.quantized_weight("down_proj")
    assert count.n == before + 1


@pytest.mark.parametrize("kind", ["linear", "experts"])
def test_a_shallow_copy_of_a_layer_gets_a_cache_of_its_own(kind):
    # copy.copy of an nn.Module shares the original's __dict__ values: a block entered on
    # the copy covered the original, whose .data writes (allowed outside a block) then went
    # unseen by its forward
    if kind == "linear":
        a = MXLinear(IN, OUT, recipe=RECIPES[0])
    else:
        a = pmx.nn.MXExperts(2, 32, 32, recipe=RECIPES[0])
    b = copy.copy(a)
    assert b._pmx_weight_cache is not a._pmx_weight_cache
    if kind == "experts":
        assert b._mx_memo is not a._mx_memo and b._mx_checked is not a._mx_checked
    with pmx.nn.weight_cache(b):
        assert a._pmx_weight_cache.depth == 0 and b._pmx_weight_cache.depth == 1

    if kind == "linear":  # the stale read the shared cache allowed
        b._parameters = dict(a._parameters)  # (its own table, as a shallow view of a model builds)
        b.weight = nn.Parameter(a.weight.detach().clone())
        x = rand(3, IN, seed=4)
        with torch.no_grad(), pmx.nn.weight_cache(b):
            a(x)
            a.weight.data.mul_(-1)
            got = a(x)
        assert torch.equal(got, fresh_output(a, x))


def test_a_block_closed_from_another_thread_ends_for_the_thread_that_entered_it():
    """A weight_cache block inside a generator that another thread finishes (a server that
    drives a sync generator from a thread pool; a generator the GC finalizes elsewhere):
    the exit counted down the closing thread's depth, so the entering thread stayed inside
    for good and its later forwards served the quantized weight of before a .data write
    (allowed outside a block)."""
    import threading

    layer = MXLinear(IN, OUT, recipe=RECIPES[0])
    x = rand(4, IN, seed=7)

    def stream():  # (no torch.no_grad() in it: its exit on the closing thread left this thread's grad mode off)
        with pmx.nn.weight_cache(layer):
            yield layer(x).detach()

    g = stream()
    next(g)
    closer = threading.Thread(target=g.close)
    closer.start()
    closer.join()
    assert layer._pmx_weight_cache.depth == 0 and not layer._pmx_weight_cache.entries
    with torch.no_grad():
        layer(x)
        layer.weight.data.mul_(-1)
        assert torch.equal(layer(x), fresh_output(layer, x))
    assert torch.is_grad_enabled()
