"""The backend half shared by every Triton backend: it turns the registry's canonical
rows problems into kernel launches. A vendor backend (cuda.py, rocm.py) or the
interpreter backend (interpret.py) says which devices it serves, which targets it
compiles for, and which tile configs and launch options it uses; nothing vendor-specific
lives here."""

from __future__ import annotations

import contextlib
import functools
from typing import Optional

import torch

from ...decompose import Decomposition
from ...recipe import QuantRecipe
from ...registry import Backend
from ...tensor import MXTensor
from ..targets import Target, probe
from . import mode_problem
from .launch import GemmConfig, KernelLaunch, TileConfig

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


def _aot_gemms():
    """The operand kinds the compile matrix compiles the GEMM for: A4W4 plain, MBS (per
    tile and in the epilogue) and OF on both sides; W4A16 in bf16 and fp16, with MBS and
    with weight outliers."""
    from .gemm import Operand

    mx, bf16 = Operand(None, None, 0), Operand(torch.bfloat16, None, 0)
    return (
        (mx, mx), (Operand(None, 128, 0), Operand(None, 128, 0)), (Operand(None, 8192, 0), Operand(None, 8192, 0)),
        (Operand(None, None, 1), Operand(None, 128, 2)),
        (bf16, mx), (Operand(torch.float16, None, 0), mx), (bf16, Operand(None, 128, 0)), (bf16, Operand(None, None, 2)),
    )


class TritonBackend(Backend):
    """quantize, dequantize, decompose and matmul with the Triton kernels of this package.

    Subclasses set ``name``, ``priority``, ``targets``, ``tiles`` and ``gemm_tiles`` and
    implement :meth:`unavailable_reason` and :meth:`target`.
    """

    ops = frozenset({"quantize", "dequantize", "decompose", "matmul"})
    targets: tuple[str, ...] = ()
    """Names of the compile targets (targets.TARGETS) this backend launches on."""

    def target(self, device: torch.device) -> Optional[Target]:
        """The compile target of ``device`` (None for the interpreter)."""
        raise NotImplementedError

    tiles: dict[str, TileConfig] = {}
    """Default tile config per kernel: "quantize", "quantize-heavy" (stochastic rounding or
    outliers), "dequantize", "decompose" (statistics only), "decompose-full" (with the
    element tensors)."""

    target_tiles: dict[str, dict[str, TileConfig]] = {}
    """Per target name, tile configs that replace those of ``tiles`` there."""

    def tile_config(self, op: str, target: Optional[Target], recipe: Optional[QuantRecipe]) -> TileConfig:
        """The tile config and launch options of ``op`` on ``target`` for ``recipe``."""
        heavy = recipe is not None and (recipe.rounding == "stochastic" or recipe.outliers_per_block > 0)
        key = "quantize-heavy" if op == "quantize" and heavy else op
        own = self.target_tiles.get(target.name, {}) if target is not None else {}
        return own.get(key, self.tiles[key])

    gemm_tiles: dict[str, dict[str, GemmConfig]] = {}
    """GEMM configs per target name ("interpret" for the interpreter), keyed "a4w4" or
    "w4a16" (16-bit left operand), plus "-small" for M <= SMALL_M, plus "-heavy" when an
    operand has macro factors or outliers (their extra accumulator and correction dots
    need smaller tiles to stay in registers); a missing "-heavy" key falls back to the
    key without it."""

    SMALL_M = 16

    scale_layouts: dict[str, str] = {}
    """The storage layout of the weight's scales in the GEMM per target name
    (``layouts.LAYOUTS``; "plain" where absent)."""

    def scale_layout(self, target: Optional[Target]):
        from .layouts import LAYOUTS

        return LAYOUTS[self.scale_layouts.get(target.name, "plain") if target is not None else "plain"]

    def default_gemm_config(self, target: Optional[Target], m: int, a_format: Optional[torch.dtype],
                            heavy: bool) -> GemmConfig:
        """The heuristic GEMM config for an M-row left operand of ``a_format`` (None:
        MXFP4), ``heavy`` when an operand has macro factors or outliers."""
        key = ("a4w4" if a_format is None else "w4a16") + ("-small" if m <= self.SMALL_M else "")
        tiles = self.gemm_tiles[target.name if target is not None else "interpret"]
        return tiles.get(key + "-heavy", tiles[key]) if heavy else tiles[key]

    def options(self, config: TileConfig | GemmConfig) -> dict:
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

    def dequantize(self, mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from .dequantize import OUT_KINDS, dequantize

        config, options = self._config("dequantize", mx.device, mx.recipe)
        written = dtype if dtype in OUT_KINDS else torch.float32  # float64: exact from fp32
        with self.running():
            out = dequantize(mx, written, config, options)
        return out if written == dtype else out.to(dtype)

    def decompose(self, x: torch.Tensor, recipe: QuantRecipe, definition: str, full: bool) -> Decomposition:
        from .decompose import decompose

        target = self.target(x.device)
        config = self.tile_config("decompose-full" if full else "decompose", target, recipe)
        with self.running():
            return decompose(_rows_contiguous(x), recipe, definition, full, config, self.options(config),
                             warp_size=target.warp_size if target is not None else 32)

    def device_identity(self, device: torch.device) -> tuple[str, str]:
        """(arch, device name) under which tuned configs of ``device`` are cached."""
        return self._identity(device, self.target(device))

    def _identity(self, device: torch.device, target: Optional[Target]) -> tuple[str, str]:
        raise NotImplementedError

    def gemm_config(self, device: torch.device, a, b, m: int, n: int, kp: int) -> GemmConfig:
        """The config of a GEMM of operands like ``a``, ``b`` (``gemm.Operand``) with M, N
        rows and padded K ``kp`` on ``device``: the tuned one from the config cache when
        there is one for its key, else the backend's heuristic default."""
        return self._gemm_config(device, self.target(device), a, b, m, n, kp)

    def _gemm_config(self, device: torch.device, target: Optional[Target], a, b, m: int, n: int,
                     kp: int) -> GemmConfig:
        from ...tuning import cache

        arch, name = self._identity(device, target)
        tuned = cache.lookup(arch, name, cache.entry_key("matmul", a.tag(), b.tag(), m, n, kp))
        if tuned is not None:
            return GemmConfig(**{**tuned, "extra": tuple(tuple(kv) for kv in tuned.get("extra", ()))})
        return self.default_gemm_config(target, m, a.format, a.heavy or b.heavy)

    def matmul(self, a: MXTensor | torch.Tensor, b: MXTensor) -> torch.Tensor:
        from .gemm import Operand, matmul

        target = self.target(b.device)  # probed once per launch
        config = self._gemm_config(b.device, target, Operand.of(a), Operand.of(b), a.shape[0], b.shape[0],
                                   b.k_padded)
        with self.running():
            return matmul(a, b, config, self.options(config), self.scale_layout(target))

    # ------------------------------------------------------------------- for AOT

    def launches(self, target: Target) -> list[KernelLaunch]:
        """Every (kernel, specialization, config) this backend launches on ``target``,
        for the compile matrix."""
        from . import decompose, dequantize, gemm, quantize

        out = []
        for recipe in _AOT_RECIPES:
            dtypes = _AOT_DTYPES if recipe == QuantRecipe() else _AOT_DTYPES[:1]
            config = self.tile_config("quantize", target, recipe)
            out += [quantize.launch_spec(d, recipe, config, self.options(config)) for d in dtypes]
        # the masked variant (ragged tiles) of the plainest and of the heaviest recipe
        for recipe in (QuantRecipe(), _AOT_RECIPES[-1]):
            config = self.tile_config("quantize", target, recipe)
            out.append(quantize.launch_spec(torch.bfloat16, recipe, config, self.options(config), even=False))
        for has_macro, n_out in ((False, 0), (True, 0), (False, 2), (True, 2)):
            recipe = QuantRecipe(macro_block=128 if has_macro else None, outliers_per_block=n_out)
            config = self.tile_config("dequantize", target, recipe)
            dtypes = (torch.bfloat16, torch.float32, torch.float16) if not (has_macro or n_out) else (
                torch.bfloat16, torch.float32)
            out += [dequantize.launch_spec(has_macro, n_out, d, config, self.options(config)) for d in dtypes]
        out.append(dequantize.launch_spec(True, 2, torch.bfloat16, config, self.options(config), even=False))
        for dtype, recipe, definition, full, even in (
                (torch.bfloat16, QuantRecipe(), "gain", False, True),
                (torch.bfloat16, QuantRecipe(), "gain", True, True),
                (torch.float32, QuantRecipe(), "gain", False, False),
                (torch.float32, _AOT_RECIPES[-1], "counterfactual", True, True),
                (torch.float32, QuantRecipe(macro_block=4096), "gain", True, True)):
            config = self.tile_config("decompose-full" if full else "decompose", target, recipe)
            out.append(decompose.launch_spec(dtype, recipe, definition, full, config, self.options(config), even,
                                             warp_size=target.warp_size))
        seen = set()
        for a, b in _aot_gemms():
            heavy = a.heavy or b.heavy
            for m in (self.SMALL_M, self.SMALL_M + 1):
                config = self.default_gemm_config(target, m, a.format, heavy)
                if (a, b, config) not in seen:
                    seen.add((a, b, config))
                    out.append(gemm.launch_spec(a, b, config, self.options(config), self.scale_layout(target)))
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

    def _identity(self, device: torch.device, target: Optional[Target]) -> tuple[str, str]:
        return target.name, _device_name(torch.device(device))


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)
