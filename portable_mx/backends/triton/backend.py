"""The backend half shared by every Triton backend: it turns the registry's canonical
rows problems into kernel launches. A vendor backend (cuda.py, rocm.py) or the
interpreter backend (interpret.py) says which devices it serves, which targets it
compiles for, and which tile configs and launch options it uses; nothing vendor-specific
lives here."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ...decompose import Decomposition
from ...recipe import QuantRecipe
from ...registry import Backend
from ...tensor import MXTensor
from ..targets import Target, probe
from . import mode_problem
from .launch import KernelLaunch, TileConfig

# Recipes the compile matrix compiles for each target: every kernel specialization that
# changes the generated code in kind (rules differ by a few integer ops; the heaviest
# combination is included), fp32/bf16/fp16 inputs.
_AOT_RECIPES = (
    QuantRecipe(),
    QuantRecipe(scale_rule="even"),
    QuantRecipe(rounding="stochastic", seed=1),
    QuantRecipe(macro_block=128),
    QuantRecipe(macro_block=4096),
    QuantRecipe(outliers_per_block=1),
    QuantRecipe(outliers_per_block=2, macro_block=256, rounding="stochastic", seed=1),
)
_AOT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


class TritonBackend(Backend):
    """quantize, dequantize and decompose with the Triton kernels of this package.

    Subclasses set ``name``, ``priority``, ``targets`` and ``tiles`` and implement
    :meth:`unavailable_reason` and :meth:`target`.
    """

    ops = frozenset({"quantize", "dequantize", "decompose"})
    targets: tuple[str, ...] = ()
    """Names of the compile targets (targets.TARGETS) this backend launches on."""

    def target(self, device: torch.device) -> Optional[Target]:
        """The compile target of ``device`` (None for the interpreter)."""
        raise NotImplementedError

    tiles: dict[str, TileConfig] = {}
    """Default tile config per kernel: "quantize", "quantize-heavy" (stochastic rounding or
    outliers), "dequantize", "decompose"."""

    def tile_config(self, op: str, target: Optional[Target], recipe: Optional[QuantRecipe]) -> TileConfig:
        """The tile config and launch options of ``op`` on ``target`` for ``recipe``."""
        heavy = recipe is not None and (recipe.rounding == "stochastic" or recipe.outliers_per_block > 0)
        return self.tiles["quantize-heavy" if op == "quantize" and heavy else op]

    def options(self, config: TileConfig) -> dict:
        """Launch options: the config's, and no FMA contraction (results must match the
        reference's separately rounded multiplies and adds)."""
        return {**config.options(), "enable_fp_fusion": False}

    def running(self):
        """Context every kernel launch runs in (nothing by default)."""
        return contextlib.nullcontext()

    def _config(self, op: str, device: torch.device, recipe: Optional[QuantRecipe]) -> tuple[TileConfig, dict]:
        config = self.tile_config(op, self.target(device), recipe)
        return config, self.options(config)

    # ------------------------------------------------------------------- the ops

    def quantize(self, x: torch.Tensor, recipe: QuantRecipe) -> MXTensor:
        from .quantize import quantize

        config, options = self._config("quantize", x.device, recipe)
        with self.running():
            qdata, scales, macro, ov, oi = quantize(_rows_contiguous(x), recipe, config, options)
        return MXTensor(qdata=qdata, scales=scales, shape=torch.Size(x.shape), dtype=x.dtype, axis=1,
                        recipe=recipe, macro_scales=macro, outlier_values=ov, outlier_indices=oi)

    def dequantize(self, mx: MXTensor) -> torch.Tensor:
        from .dequantize import dequantize

        config, options = self._config("dequantize", mx.device, mx.recipe)
        with self.running():
            return dequantize(mx, config, options)

    def decompose(self, x: torch.Tensor, recipe: QuantRecipe, definition: str, full: bool) -> Decomposition:
        from .decompose import decompose

        config, options = self._config("decompose", x.device, recipe)
        with self.running():
            return decompose(_rows_contiguous(x), recipe, definition, full, config, options)

    # ------------------------------------------------------------------- for AOT

    def launches(self, target: Target) -> list[KernelLaunch]:
        """Every (kernel, specialization, config) this backend launches on ``target``,
        for the compile matrix."""
        from . import decompose, dequantize, quantize

        out = []
        for recipe in _AOT_RECIPES:
            dtypes = _AOT_DTYPES if recipe == QuantRecipe() else _AOT_DTYPES[:1]
            config = self.tile_config("quantize", target, recipe)
            out += [quantize.launch_spec(d, recipe, config, self.options(config)) for d in dtypes]
        for has_macro, n_out in ((False, 0), (True, 0), (False, 2), (True, 2)):
            recipe = QuantRecipe(macro_block=128 if has_macro else None, outliers_per_block=n_out)
            config = self.tile_config("dequantize", target, recipe)
            out.append(dequantize.launch_spec(has_macro, n_out, config, self.options(config)))
        for recipe, definition, full in ((QuantRecipe(), "gain", False),
                                         (_AOT_RECIPES[-1], "counterfactual", True),
                                         (QuantRecipe(macro_block=4096), "gain", True)):
            config = self.tile_config("decompose", target, recipe)
            out.append(decompose.launch_spec(torch.float32, recipe, definition, full, config, self.options(config)))
        return out


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """The kernels index rows by stride and need unit stride along K."""
    return x if x.stride(-1) == 1 else x.contiguous()


class CompiledTritonBackend(TritonBackend):
    """A Triton backend that compiles its kernels for the GPUs of its ``targets``."""

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        target, why = probe(device)
        if target is None:
            return why
        if target.name not in self.targets:
            return f"{target.name} ({target.vendor}) is not a {self.name} target ({', '.join(self.targets)})"
        return mode_problem(interpreted=False)

    def target(self, device: torch.device) -> Optional[Target]:
        return probe(device)[0]

    def path(self, device: torch.device, op: str) -> str:
        return "native"
