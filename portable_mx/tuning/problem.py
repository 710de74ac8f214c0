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
``a``, ``b`` with ``config`` and returns fp32 [M, N]."""


@dataclass(frozen=True)
class Problem:
    """One GEMM to tune: ``a`` [M, K] @ ``w`` [K, N] with the operand kinds of ``recipe``
    (A4W4 or W4A16, macro blocks, outliers; the scale rule and rounding do not change the
    GEMM kernel)."""

    m: int
    n: int
    k: int
    recipe: QuantRecipe = QuantRecipe()
    op: str = "matmul"

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
        return Operand(torch.bfloat16 if r.activations == "bf16" else torch.float16, None, 0), b

    def launched(self, backend: Any, target: Optional["Target"]) -> "Problem":
        """The problem the dispatch launches for this one on ``target``: an A4W4 matmul
        that ``backend`` runs as the W4A16 GEMM on the activations' quantized values
        (``left_values_on``: upcast targets, at decode sizes and wide outputs; the same
        products) is that W4A16 problem, whose cache entry the call reads; any other
        problem is itself. Tuning the A4W4 kernel there would time a kernel no call
        launches and write an entry no call reads."""
        if self.op != "matmul" or not self.recipe.quantizes_activations:
            return self
        on = getattr(backend, "left_values_on", None)
        if on is None or not on(target, self.m, self.n, self.recipe):
            return self
        return dataclasses.replace(self, recipe=QuantRecipe(activations="bf16"))

    def key(self) -> str:
        """The config-cache key (``cache.entry_key``)."""
        a, b = self.operands()
        return cache.entry_key(self.op, a.tag(), b.tag(), self.m, self.n, self.kp)

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
    a = ops.left_operand(x, problem.recipe)
    if isinstance(a, MXTensor):
        a = ops._mx_rows(a)
    return a, ops._mx_rows(ops.quantize(w, problem.recipe, axis=0))



def kernel_launcher(backend: Any, target: Optional["Target"]) -> Launcher:
    """The backend's GEMM kernel with a given config (what ``backend.matmul`` launches)."""

    def launcher(a, b, config: GemmConfig) -> Callable[[], torch.Tensor]:
        if hasattr(backend, "run_gemm"):  # the kernel the backend routes to (gemm_route)

            def fn() -> torch.Tensor:
                with backend.running():
                    return backend.run_gemm(a, b, config, target)

            return fn
        from ..backends.triton import gemm

        options, layout = backend.options(config), backend.scale_layout(target)

        def fn() -> torch.Tensor:
            with backend.running():
                return gemm.matmul(a, b, config, options, layout)

        return fn

    return launcher
