"""The library's caches under CUDA graph capture (portable_mx/_graphs.py).

While a stream is captured, device work is recorded, not run. So (1) nothing built during a
capture may be kept for later eager calls (an MXTensor's memos, the GEMM operand's swizzled
storage, the weight cache): until the graph replays, that memory holds nothing; and (2) a
capture must not read the weight cache, whose entries are freed when the block ends and
replaced after an optimizer step: the graph would replay freed memory or the old weight.

Any machine: the capture is simulated (``_graphs.capturing`` patched). On a GPU: real
captures, checked against eager calls made with nothing cached.
"""

import pytest
import torch

import portable_mx as pmx
from portable_mx import _graphs, registry
from portable_mx.nn import MXLinear

from conftest import kernel_backends, no_kernels_reason

_no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def needs_gpu(test):
    """Marks a test ``gpu`` (``pytest -m gpu`` selects it) and skips it without a GPU."""
    return pytest.mark.gpu(_no_gpu(test))


def rand(*shape, seed=0, device="cpu", dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


@pytest.fixture
def capture(monkeypatch):
    """A switch: while ``capture[0]`` is True every tensor counts as captured."""
    state = [False]
    monkeypatch.setattr(_graphs, "capturing", lambda t: state[0])
    return state


def counted(fn):
    """``fn`` and the list its calls append to."""
    calls = []

    def wrapper(*args):
        calls.append(1)
        return fn(*args)

    return wrapper, calls


@pytest.mark.parametrize("copies", [True, False])
def test_a_memo_built_in_a_capture_is_not_kept(capture, copies):
    mx = pmx.quantize(rand(8, 64, seed=1), axis=1)
    build, calls = counted(lambda t: t.qdata.clone())
    capture[0] = True
    first, second = mx.memo("k", build, copies=copies), mx.memo("k", build, copies=copies)
    assert len(calls) == 2 and first is not second and "k" not in mx.__dict__.get("_memo", {})
    capture[0] = False
    kept = mx.memo("k", build, copies=copies)
    assert len(calls) == 3 and mx.memo("k", build, copies=copies) is kept and torch.equal(kept, mx.qdata)
    capture[0] = True  # one kept before the capture is read in it (a view's or a copy's of unchanged parts)
    assert mx.memo("k", build, copies=copies) is kept and len(calls) == 3


@pytest.mark.triton
def test_the_gemm_operands_storage_made_in_a_capture_is_not_kept(capture):
    from portable_mx.backends.triton.backend import _weight_operand

    mx = pmx.quantize(rand(8, 64, seed=2), axis=1)
    op = _weight_operand(mx)
    build, calls = counted(lambda t: (t.qdata.clone(),))
    capture[0] = True
    op.storage(mx, "layout", build)
    op.storage(mx, "layout", build)
    assert len(calls) == 2 and "layout" not in (op.stored or {})
    assert _weight_operand(mx) is op  # (kept before the capture)
    capture[0] = False
    kept = op.storage(mx, "layout", build)
    assert op.storage(mx, "layout", build) is kept and len(calls) == 3


@pytest.mark.triton
def test_the_gemm_operands_storage_is_refreshed_in_place_after_a_write(capture):
    """Its swizzled copies made again after an in-place write of the weight's parts land in
    the kept tensors (a graph captured before reads their addresses): the same tensors,
    the new bytes; a part the storage passes as it is (no copy) is never written; a
    rebuild of another shape replaces the kept value; in a capture nothing is touched."""
    from portable_mx.backends.triton.backend import _weight_operand

    mx = pmx.quantize(rand(8, 64, seed=2), axis=1)
    other = pmx.quantize(rand(8, 64, seed=9), axis=1)
    op = _weight_operand(mx)
    swizzle = lambda t: (t.qdata.flip(0).contiguous(), t.scales, t.scales.float() + 1)  # noqa: E731
    kept = op.storage(mx, "layout", swizzle)
    addresses = [t.data_ptr() for t in kept]
    with torch.no_grad():
        mx.qdata.copy_(other.qdata)
        mx.scales.copy_(other.scales)
    capture[0] = True  # in a capture: built for the graph, the kept one left alone
    built = op.storage(mx, "layout", swizzle)
    assert built is not kept and torch.equal(built[0], other.qdata.flip(0))
    assert not torch.equal(kept[0], other.qdata.flip(0))
    capture[0] = False
    again = op.storage(mx, "layout", swizzle)
    assert again is kept and [t.data_ptr() for t in again] == addresses
    assert torch.equal(kept[0], other.qdata.flip(0)) and torch.equal(kept[2], other.scales.float() + 1)
    assert kept[1] is mx.scales  # (the part itself: already the new bytes, nothing copied into it)
    with torch.no_grad():
        mx.qdata.zero_()
    wider = op.storage(mx, "layout", lambda t: (t.qdata.repeat(2, 1), t.scales, t.scales.float()))
    assert wider is not kept and wider[0].shape[0] == 16


@pytest.mark.triton
def test_the_prepared_layouts_kept_with_a_storage(capture):
    """layouts._kept (the swizzled copies and largest scale byte kept with a weight's
    storage): in a capture made for the graph, nothing read or kept; after an in-place
    write, made again into the kept tensor (one copy in memory, at its address)."""
    from portable_mx.backends.triton import layouts

    plain = torch.arange(64, dtype=torch.uint8).reshape(8, 8)
    make, calls = counted(lambda t: t.flip(0).contiguous())
    capture[0] = True
    built = layouts._kept(plain, ("test",), make)
    assert len(calls) == 1 and not any(k[-1] == "test" for k in layouts._PREPARED)
    capture[0] = False
    kept = layouts._kept(plain, ("test",), make)
    assert kept is not built and layouts._kept(plain, ("test",), make) is kept and len(calls) == 2
    capture[0] = True  # an entry is not read in a capture either
    assert layouts._kept(plain, ("test",), make) is not kept and len(calls) == 3
    capture[0] = False
    address = kept.data_ptr()
    with torch.no_grad():
        plain.mul_(2)
    again = layouts._kept(plain, ("test",), make)
    assert again is kept and kept.data_ptr() == address and torch.equal(kept, plain.flip(0))
    assert sum(k[-1] == "test" for k in layouts._PREPARED) == 1


@pytest.mark.triton
def test_a_stale_gemm_operand_is_refreshed_into_its_own_copies(capture):
    """A weight whose scales are not contiguous (sliced from a wider buffer): its GEMM
    operand holds a contiguous copy; after an in-place write the operand is made again
    into that copy (the same operand, address and storage layouts), in a capture a new
    one that is not kept."""
    from portable_mx.backends.triton.backend import _weight_operand

    full = pmx.quantize(rand(8, 64, seed=2), axis=1)
    wide = torch.cat([full.scales, full.scales], dim=1)
    mx = pmx.MXTensor(qdata=full.qdata, scales=wide[:, :2], shape=full.shape, dtype=full.dtype, axis=full.axis,
                      recipe=full.recipe)
    op = _weight_operand(mx)
    assert op.copied is not None and op.parts[1].data_ptr() != wide.data_ptr()
    address = op.parts[1].data_ptr()
    kept = op.storage(mx, "layout", lambda t: (_weight_operand(t).parts[1].flip(0).contiguous(),))
    with torch.no_grad():
        wide[:, :2].add_(1)
    capture[0] = True
    assert _weight_operand(mx) is not op
    capture[0] = False
    again = _weight_operand(mx)
    assert again is op and op.fresh() and op.parts[1].data_ptr() == address
    assert torch.equal(op.parts[1], wide[:, :2])
    layout = op.storage(mx, "layout", lambda t: (_weight_operand(t).parts[1].flip(0).contiguous(),))
    assert layout is kept and torch.equal(kept[0], wide[:, :2].flip(0))


def test_a_captured_forward_records_no_macro_block_check(capture):
    """MXExperts' check of its macro-block buffer: in a capture a device assertion only
    (run at replay), and nothing recorded as checked, so the next eager forward checks
    on the host."""
    from portable_mx.nn import MXExperts

    r = pmx.QuantRecipe(macro_block=64)
    experts = MXExperts.from_mx(pmx.quantize(rand(2, 16, 64, seed=1), r, axis=-1),
                                pmx.quantize(rand(2, 64, 8, seed=2), r, axis=-1),
                                recipe=pmx.QuantRecipe(activations="bf16"))
    block = experts.gate_up_proj_macro_block
    capture[0] = True
    experts._check_macro_block("gate_up_proj", block, False)
    assert "gate_up_proj" not in experts._mx_checked
    capture[0] = False
    experts._check_macro_block("gate_up_proj", block, False)
    assert experts._mx_checked["gate_up_proj"][0] is block

def test_refill_never_writes_into_the_weights_own_parts():
    """A kept tensor that shares memory with one of the MXTensor's parts, where the rebuilt
    one does not: not written (False), whatever the shapes."""
    mx = pmx.quantize(rand(8, 64, seed=2), axis=1)
    parts = (mx.qdata, mx.scales, None, None, None)
    before = mx.qdata.clone()
    assert not _graphs.refill((mx.qdata,), (mx.qdata.clone().add_(1),), parts)
    assert torch.equal(mx.qdata, before)
    assert not _graphs.refill((mx.qdata[:4],), (mx.qdata[:4].clone(),), parts)
    old, new = (torch.zeros(3), 5, None), (torch.ones(3), 5, None)
    assert _graphs.refill(old, new, parts) and torch.equal(old[0], torch.ones(3))
    assert not _graphs.refill((torch.zeros(3), 5), (torch.ones(3), 6), parts)
    assert not _graphs.refill((torch.zeros(3),), (torch.ones(4),), parts)
    assert not _graphs.refill((torch.zeros(3),), (torch.ones(3, dtype=torch.float64),), parts)
    assert not _graphs.refill((torch.zeros(6)[::2],), (torch.ones(3),), parts)


def test_capturing_asks_the_tensors_own_device(monkeypatch):
    """A capture on cuda:1's stream with cuda:0 made current inside it (a user's
    torch.cuda.device(0) in the captured code, the layer's tensors on cuda:1): the caches
    must see cuda:1's capture, as the split-K buffers do; the current device was asked,
    and memory of the graph's pool was kept (audit). Simulated: which device is current,
    and whose stream is being captured."""
    import contextlib
    import types

    from portable_mx.backends.triton import splitk

    state = {"current": 0, "capturing": {0: False, 1: True}}

    @contextlib.contextmanager
    def device(index):
        before, state["current"] = state["current"], index
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: state["current"], raising=False)
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: state["capturing"][state["current"]],
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
    monkeypatch.setattr(torch.cuda, "device", device)
    on = {i: types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", i), get_device=lambda i=i: i)
          for i in (0, 1)}
    assert _graphs.capturing(on[1]) and not _graphs.capturing(on[0])
    assert splitk._stream(torch.device("cuda", 1))[1] and not splitk._stream(torch.device("cuda", 0))[1]
    assert state["current"] == 0  # (asked under a switch, and back)
    state["current"] = 1  # the other way round: the current device's own answer
    assert _graphs.capturing(on[1]) and not _graphs.capturing(on[0])
    assert not _graphs.capturing(torch.zeros(1))  # a CPU tensor: no query


@pytest.mark.parametrize("grad", [False, True])
def test_a_captured_forward_neither_reads_nor_fills_the_weight_cache(capture, monkeypatch, grad):
    layer = MXLinear(64, 16, recipe=pmx.QuantRecipe(activations="bf16"))
    quantize, calls = counted(layer._quantize_weight)
    monkeypatch.setattr(layer, "_quantize_weight", quantize)
    x = rand(4, 64, seed=3).requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        eager = layer(x)
        with pmx.nn.weight_cache(layer):
            capture[0] = True
            for _ in range(2):
                assert torch.equal(layer(x), eager)
            assert len(calls) == 2 and not layer._pmx_weight_cache.entries  # quantized each time, not kept
            capture[0] = False
            layer(x)
            entry = dict(layer._pmx_weight_cache.entries)
            assert entry and len(calls) == 3
            capture[0] = True  # an entry made before the capture is not read in it either
            assert torch.equal(layer(x), eager)
            assert len(calls) == 4 and layer._pmx_weight_cache.entries == entry


# ----------------------------------------------------------------------------- GPU


def captured(call, warm):
    """(graph, its output) of ``call()`` captured on the current GPU, after ``warm()`` ran
    on a side stream (the warm-up torch asks for before a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def _gpu_backend(monkeypatch):
    """The Triton backend of this GPU, made the default."""
    names = [name for name, where in kernel_backends("matmul") if where == "cuda"]
    if not names:
        pytest.skip(no_kernels_reason("matmul"))
    monkeypatch.setenv(registry.ENV_BACKEND, names[0])
    return registry.get(names[0])


@needs_gpu
@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(activations="bf16"), pmx.QuantRecipe()], ids=["W4A16", "A4W4"])
def test_gpu_a_weight_first_used_in_a_capture_is_right_in_eager_calls_before_any_replay(monkeypatch, recipe):
    """A weight whose GEMM operand and storage layouts are first made inside a capture
    (its plan and kernels made by a twin weight before): the eager calls after the
    capture, before and after a replay, equal those of a copy of the weight that was
    never near a graph; so does the replay."""
    _gpu_backend(monkeypatch)
    device = torch.device("cuda", torch.cuda.current_device())
    x = rand(16, 1024, seed=4, device=device, dtype=torch.bfloat16)
    w, twin = (pmx.quantize(rand(1024, 512, seed=s, device=device), recipe, axis=0) for s in (5, 6))
    fresh = pmx.quantize(rand(1024, 512, seed=5, device=device), recipe, axis=0)
    graph, y = captured(lambda: pmx.matmul(x, w, recipe), lambda: pmx.matmul(x, twin, recipe))
    want = pmx.matmul(x, fresh, recipe)
    assert torch.equal(pmx.matmul(x, w, recipe), want)
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(y, want) and torch.equal(pmx.matmul(x, w, recipe), want)


@needs_gpu
def test_gpu_a_forward_captured_in_a_weight_cache_block_replays_the_current_weight(monkeypatch):
    """A W4A16 MXLinear forward captured inside a weight_cache block (warmed up in it, so
    the cache held the quantized weight), replayed after the block ended (which freed the
    cached weight) and an SGD step: equal to an eager forward with nothing cached (a graph
    that read the cache would replay the old weight)."""
    _gpu_backend(monkeypatch)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    layer = MXLinear(1024, 512, device=device, dtype=torch.bfloat16, recipe=pmx.QuantRecipe(activations="bf16"))
    x = rand(16, 1024, seed=7, device=device, dtype=torch.bfloat16)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    with pmx.nn.weight_cache(layer), torch.no_grad():
        graph, y = captured(lambda: layer(x), lambda: layer(x))
    for _ in range(2):
        layer(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        graph.replay()
        with torch.no_grad():
            want = layer(x)
        assert torch.equal(y, want)


@needs_gpu
@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(activations="bf16"), pmx.QuantRecipe()], ids=["W4A16", "A4W4"])
def test_gpu_a_graph_replays_a_weight_written_in_place_once_an_eager_call_saw_it(monkeypatch, recipe):
    """A GEMM captured with a pre-quantized weight (its storage layouts made before the
    capture); the weight's parts then overwritten in place with another weight's bytes (a
    rollout model's weights synced from the trainer); one eager call (which rebuilds the
    layouts, into the kept tensors); the replay equals a GEMM with the other weight."""
    _gpu_backend(monkeypatch)
    device = torch.device("cuda", torch.cuda.current_device())
    x = rand(16, 1024, seed=10, device=device, dtype=torch.bfloat16)
    w, new = (pmx.quantize(rand(1024, 512, seed=s, device=device), recipe, axis=0) for s in (11, 12))
    graph, y = captured(lambda: pmx.matmul(x, w, recipe), lambda: pmx.matmul(x, w, recipe))
    want = pmx.matmul(x, new, recipe)
    with torch.no_grad():
        w.qdata.copy_(new.qdata)
        w.scales.copy_(new.scales)
    assert torch.equal(pmx.matmul(x, w, recipe), want)
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(y, want)
