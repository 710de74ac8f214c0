"""What the tuner tunes and how it runs one candidate: a GEMM :class:`Problem`, its
seeded operands (:func:`make_operands`) and the launcher that runs the backend's GEMM
kernel with a given config (:func:`kernel_launcher`). Shared by the search
(:mod:`.search`) and the compile warm-up workers (:mod:`.warm`), which import nothing
else of each other."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from ..backends.triton.launch import GemmConfig
from ..recipe import QuantRecipe
from . import cache

if TYPE_CHECKING:
    from ..backends.targets import Target

Launcher = Callable[[Any, Any, GemmConfig], Callable[[], torch.Tensor]]
"""``launcher(a, b, config) -> fn``: ``fn()`` runs the GEMM of rows-layout operands
``a``, ``b`` with ``config`` and returns [M, N] (in :attr:`Problem.out_dtype` for
:func:`kernel_launcher`'s)."""


@dataclass(frozen=True)
class Problem:
    """One GEMM to tune: ``a`` [M, K] @ ``w`` [K, N] with the operand kinds of ``recipe``
    (A4W4 or W4A16, macro blocks, outliers; the scale rule and rounding do not change the
    GEMM kernel). ``token_quant``: set by :meth:`launched` only, the scale rule's id with
    which the GEMM kernel quantizes the 16-bit tokens itself (``gemm.Operand.quant``; the
    one-launch A4W4 at decode sizes), a kernel of its own with a cache key of its own."""

    m: int
    n: int
    k: int
    recipe: QuantRecipe = QuantRecipe()
    op: str = "matmul"
    token_quant: Optional[int] = None

    @property
    def kp(self) -> int:
        return -(-self.k // 32) * 32

    def operands(self):
        """(a, b) as ``gemm.Operand``: what the kernel sees of each side."""
        from ..backends.triton.gemm import Operand

        r = self.recipe
        b = Operand(None, r.macro_block, r.outliers_per_block)
        if r.quantizes_activations:
            return b, b
        return Operand(torch.bfloat16 if r.activations == "bf16" else torch.float16, None, 0, self.token_quant), b

    def launched(self, backend: Any, target: Optional["Target"]) -> "Problem":
        """The problem the dispatch launches for this one on ``target``: an A4W4 matmul
        that ``backend`` runs as the W4A16 GEMM on the activations' quantized values
        (``left_values_on``: upcast targets, at decode sizes and wide outputs; the same
        products) is that W4A16 problem, whose cache entry the call reads, and where the
        GEMM kernel quantizes the tokens itself (``token_quant_on``: M <= 16, nearest
        rounding) that one-launch kernel's problem (``token_quant`` set, its own key);
        any other problem is itself. Tuning the A4W4 kernel there would time a kernel no
        call launches and write an entry no call reads."""
        if self.op != "matmul" or not self.recipe.quantizes_activations:
            return self
        on = getattr(backend, "left_values_on", None)
        if on is None or not on(target, self.m, self.n, self.recipe):
            return self
        rule = getattr(backend, "token_quant_on", lambda *args: None)(target, self.m, self.n, self.recipe)
        return dataclasses.replace(self, recipe=QuantRecipe(activations="bf16"), token_quant=rule)

    def key(self) -> str:
        """The config-cache key (``cache.entry_key``)."""
        a, b = self.operands()
        return cache.entry_key(self.op, a.tag(), b.tag(), self.m, self.n, self.kp)

    @property
    def out_dtype(self) -> torch.dtype:
        """The dtype the tuner's GEMM stores, as the dispatch's does for the calls this
        problem stands for (``pmx.matmul`` stores a's dtype): W4A16 the activations'
        16-bit format; A4W4 bf16, a bf16 model's call (an fp32 caller stores twice the
        output bytes with the same config). Not part of the cache key: a config serves
        every output dtype, so it is timed and compiled with the one models use."""
        return torch.float16 if self.recipe.activations == "fp16" else torch.bfloat16

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


def make_operands(problem: Problem, device: torch.device, seed: int = 0):
    """Seeded standard-normal activations [M, K] and weight [K, N] on ``device``, in the
    rows layout the backends take: (a: MXTensor (M, K) or a 16-bit tensor, b: MXTensor
    (N, K))."""
    from .. import ops
    from ..tensor import MXTensor

    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(problem.m, problem.k, generator=gen, device=device)
    w = torch.randn(problem.k, problem.n, generator=gen, device=device)
    if problem.token_quant is not None:
        # tokens the kernel quantizes: values MXFP4 holds already (quantizing them again
        # keeps them), so that the reference's product of the bf16 tokens is the kernel's
        from ..backends.triton.numerics import RULE_IDS

        rule = {v: getattr(k, "value", k) for k, v in RULE_IDS.items()}[problem.token_quant]
        x = ops.dequantize(ops.quantize(x, QuantRecipe(scale_rule=rule)), dtype=torch.float32)
    a = ops.left_operand(x, problem.recipe)
    if isinstance(a, MXTensor):
        a = ops._mx_rows(a)
    return a, ops._mx_rows(ops.quantize(w, problem.recipe, axis=0))



def kernel_launcher(backend: Any, target: Optional["Target"], token_quant: Optional[int] = None,
                    out_dtype: torch.dtype = torch.float32) -> Launcher:
    """The backend's GEMM kernel with a given config (what ``backend.matmul`` launches),
    storing ``out_dtype`` (the search passes :attr:`Problem.out_dtype`); ``token_quant``:
    the kernel quantizes 16-bit tokens with that rule (``Problem.token_quant``)."""

    def launcher(a, b, config: GemmConfig) -> Callable[[], torch.Tensor]:
        if hasattr(backend, "run_gemm"):  # the kernel the backend routes to (gemm_route)
            quant = {} if token_quant is None else {"quant": token_quant}

            def fn() -> torch.Tensor:
                with backend.running():
                    return backend.run_gemm(a, b, config, target, out_dtype, **quant)

            return fn
        if token_quant is not None:
            raise ValueError(f"{getattr(backend, 'name', backend)} has no kernel that quantizes its tokens")
        from ..backends.triton import gemm

        options, layout = backend.options(config), backend.scale_layout(target)
        store = out_dtype if target is not None else torch.float32  # (the interpreter's casts truncate)

        def fn() -> torch.Tensor:
            with backend.running():
                c = gemm.matmul(a, b, config, options, layout, store)
            return c if c.dtype == out_dtype else c.to(out_dtype)

        return fn

    return launcher
