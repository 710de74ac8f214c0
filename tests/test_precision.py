"""The reference GEMMs and the high-precision backward run their fp32 matmuls in full fp32
whatever the caller set: an autocast region, torch's legacy or per-backend precision
settings, other threads. Expected values: the same call outside those settings (full
fp32 is what the reference backend computes there; its accuracy against float64 is held by
test_matmul.py), and the caller's settings left as they were."""

import threading

import pytest
import torch

import portable_mx as pmx
from portable_mx._precision import HighestPrecision
from portable_mx.recipe import QuantRecipe as QR


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def restore_precision():
    """Put torch's matmul precision settings back after the test, whichever API it used."""
    legacy = torch.get_float32_matmul_precision()
    backends = [getattr(getattr(torch.backends, n, None), "matmul", None) for n in ("cuda", "mkldnn")]
    backends = [m for m in backends if m is not None and hasattr(m, "fp32_precision")]
    saved = [(m, m.fp32_precision) for m in backends]
    yield backends
    for m, v in saved:
        m.fp32_precision = v
    torch.set_float32_matmul_precision(legacy)


@pytest.mark.parametrize("recipe", [QR(macro_block=64), QR(activations="bf16", grad_input="high", grad_weight="high")],
                         ids=["mbs", "w4a16-high-backward"])
def test_autocast_does_not_narrow_the_reference_gemms(recipe):
    """Inside torch.autocast("cpu", bf16): pmx.matmul, without and with autograd (forward
    and both gradients), gives the dtype and the bits of the same calls outside it (the
    reference's fp32 matmul and the high-precision backward were autocast to bf16
    before). The functional ops take their operands as they are; the MX layers apply
    autocast's casts to x and bias, and their GEMMs are these (test_autocast.py)."""
    x = randn(6, 64, seed=1).requires_grad_()
    w = randn(64, 24, seed=2)
    wg = w.clone().requires_grad_()
    dy = randn(6, 24, seed=3)

    def run():
        x.grad = wg.grad = None
        y = pmx.matmul(x.detach(), w, recipe)
        out = pmx.matmul(x, wg, recipe)
        out.backward(dy)
        return y, out.detach(), x.grad.clone(), wg.grad.clone()

    want = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run()
    for g, w_ in zip(got, want):
        assert g.dtype == w_.dtype == torch.float32 and torch.equal(g, w_)


def test_the_per_backend_precision_api_alone_is_honoured_and_kept(restore_precision):
    """A caller who set only torch's per-backend precision (the legacy getter then raises
    on the mix) gets full-fp32 reference GEMMs and keeps the setting."""
    if not restore_precision:
        pytest.skip("this torch has no per-backend fp32_precision")
    a, b = randn(5, 64, seed=4), randn(64, 7, seed=5)
    want = pmx.matmul(a, b)
    mkldnn = torch.backends.mkldnn.matmul
    mkldnn.fp32_precision = "bf16"
    assert torch.equal(pmx.matmul(a, b), want)
    assert mkldnn.fp32_precision == "bf16"


def test_threads_leave_the_callers_precision_as_it_was(restore_precision):
    """Reference GEMMs in several threads at once: the process's precision comes back to
    the caller's "medium" (each context used to restore what it saw on entry, which a
    thread entering during another's call saw as "highest")."""
    torch.set_float32_matmul_precision("medium")
    a, b = randn(32, 64, seed=6), randn(64, 32, seed=7)
    errors = []

    def work():
        try:
            for _ in range(20):
                pmx.matmul(a, b)
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and torch.get_float32_matmul_precision() == "medium"


def test_highest_precision_nests_and_restores_on_errors(restore_precision):
    torch.set_float32_matmul_precision("high")
    with pytest.raises(ValueError):
        with HighestPrecision():
            with HighestPrecision():
                assert torch.get_float32_matmul_precision() == "highest"
            assert torch.get_float32_matmul_precision() == "highest"
            raise ValueError
    assert torch.get_float32_matmul_precision() == "high"


def test_a_precision_set_while_another_context_is_inside_is_kept(restore_precision):
    """Another thread of the caller's sets its precision while a portable_mx GEMM is inside
    the context (simulated here in one thread, in the order two threads can interleave):
    the last context to leave used to put back the setting found first, undoing the
    caller's new one for good (the audit: 'medium' lost in 3340 of 3341 checks). Now the
    new setting stays, and a context entered after it still runs in full fp32."""
    torch.set_float32_matmul_precision("high")
    with HighestPrecision():
        torch.set_float32_matmul_precision("medium")  # the other thread
    assert torch.get_float32_matmul_precision() == "medium"

    torch.set_float32_matmul_precision("high")
    outer = HighestPrecision()
    outer.__enter__()
    torch.set_float32_matmul_precision("medium")  # the other thread
    with HighestPrecision():  # a GEMM entering now: full fp32 again
        assert torch.get_float32_matmul_precision() == "highest"
    outer.__exit__(None, None, None)
    assert torch.get_float32_matmul_precision() == "medium"  # the caller's latest, not "high"


def test_the_per_backend_setting_changed_while_inside_is_kept(restore_precision):
    if not restore_precision:
        pytest.skip("this torch has no per-backend fp32_precision")
    mkldnn = torch.backends.mkldnn.matmul
    mkldnn.fp32_precision = "bf16"
    with HighestPrecision():
        assert mkldnn.fp32_precision == "ieee"
        mkldnn.fp32_precision = "tf32"  # the other thread
    assert mkldnn.fp32_precision == "tf32"
    with HighestPrecision():
        assert mkldnn.fp32_precision == "ieee"
    assert mkldnn.fp32_precision == "tf32"
