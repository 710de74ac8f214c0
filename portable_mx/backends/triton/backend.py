"""The backend half shared by every Triton backend: it turns the registry's canonical
rows problems into kernel launches. A vendor backend (cuda.py, rocm.py) or the
interpreter backend (interpret.py) says which devices it serves, which targets it
compiles for, and which tile configs and launch options it uses; nothing vendor-specific
lives here."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

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


@dataclass(frozen=True)
class GemmRoute:
    """Which GEMM kernel a launch uses and how it reads the weight: ``kernel`` "scaled"
    (gemm.py, ``tl.dot_scaled``: native block-scaled MMA, weight scales in ``scales``) or
    "upcast" (gemm_upcast.py, the MXFP4 tiles decoded in registers, read as ``upcast``
    says)."""

    kernel: str
    scales: Any = None
    upcast: Any = None


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
    outliers), "dequantize", "decompose"."""

    def tile_config(self, op: str, target: Optional[Target], recipe: Optional[QuantRecipe]) -> TileConfig:
        """The tile config and launch options of ``op`` on ``target`` for ``recipe``."""
        heavy = recipe is not None and (recipe.rounding == "stochastic" or recipe.outliers_per_block > 0)
        return self.tiles["quantize-heavy" if op == "quantize" and heavy else op]

    gemm_tiles: dict[str, dict[str, GemmConfig]] = {}
    """GEMM configs per target name ("interpret" for the interpreter), keyed "a4w4" or
    "w4a16" (16-bit left operand), plus "-small" for M <= SMALL_M, plus "-heavy" when an
    operand has macro factors or outliers (their extra accumulator and correction dots
    need smaller tiles to stay in registers); a missing "-heavy" key falls back to the
    key without it."""

    SMALL_M = 16

    scale_layouts: dict[str, str] = {}
    """The storage layout of the weight's scales in the ``tl.dot_scaled`` GEMM per target
    name (``layouts.LAYOUTS``; "plain" where absent)."""

    upcast_layouts: dict[str, str] = {}
    """The weight's value layout in the upcast GEMM per target name
    (``layouts.VALUE_LAYOUTS``; "plain" where absent; its scale layout goes with it)."""

    upcast_asm: tuple[str, ...] = ()
    """Targets whose upcast GEMM decodes bf16 with inline assembly (upcast.py)."""

    scaled_outliers: tuple[str, ...] = ()
    """Upcast targets on which launches with outliers (OF) use the ``tl.dot_scaled``
    kernel (where it compiles and has been measured)."""

    gemm_sms: dict[str, int] = {}
    """Nominal SM / CU count per target name: what ``split_k = 0`` assumes for the
    ahead-of-time compile (a live device reports its own)."""

    casts_in_kernel = True
    """Whether the GEMM kernel's store writes the output dtype (else fp32, cast after)."""

    def scale_layout(self, target: Optional[Target]):
        from .layouts import LAYOUTS

        return LAYOUTS[self.scale_layouts.get(target.name, "plain") if target is not None else "plain"]

    MID_M = 128

    def default_gemm_config(self, target: Optional[Target], m: int, a_format: Optional[torch.dtype],
                            heavy: bool) -> GemmConfig:
        """The heuristic GEMM config for an M-row left operand of ``a_format`` (None:
        MXFP4), ``heavy`` when an operand has macro factors or outliers: the first that
        ``gemm_tiles`` has of "<kind>-small" (M <= SMALL_M; "-small-heavy" first when
        heavy) or "<kind>-mid" (M <= MID_M; "-mid-heavy" and "-heavy" first when heavy),
        then "<kind>" ("-heavy" first when heavy)."""
        base = "a4w4" if a_format is None else "w4a16"
        if m <= self.SMALL_M:
            keys = [base + "-small-heavy", base + "-small"] if heavy else [base + "-small"]
        elif m <= self.MID_M:
            keys = [base + "-mid-heavy", base + "-heavy", base + "-mid"] if heavy else [base + "-mid"]
        else:
            keys = []
        keys += [base + "-heavy", base] if heavy else [base]
        tiles = self.gemm_tiles[target.name if target is not None else "interpret"]
        for key in keys:
            if key in tiles:
                return tiles[key]
        raise KeyError(f"no GEMM config for {base} at M={m} in gemm_tiles")

    def gemm_route(self, target: Optional[Target], a, b) -> GemmRoute:
        """The GEMM kernel and weight layouts of operands like ``a``, ``b``
        (``gemm.Operand``) on ``target`` (None: the interpreter, which runs the
        ``tl.dot_scaled`` kernel): the native block-scaled MMA where the target has one,
        else the upcast kernel (outliers may stay on ``tl.dot_scaled`` where
        ``scaled_outliers`` says so)."""
        from .gemm_upcast import UpcastRoute
        from .layouts import VALUE_LAYOUTS

        if target is None or target.native_mx or ((a.outliers or b.outliers) and target.name in self.scaled_outliers):
            return GemmRoute("scaled", scales=self.scale_layout(target))
        values = VALUE_LAYOUTS[self.upcast_layouts.get(target.name, "plain")]
        return GemmRoute("upcast", upcast=UpcastRoute(values, asm=target.name in self.upcast_asm))

    def sm_count(self, device: torch.device, target: Optional[Target]) -> int:
        """Streaming multiprocessors (CUs) of ``device``: what ``split_k = 0`` fills."""
        return self.gemm_sms.get(target.name, 132) if target is not None else 4

    def resolve_split_k(self, config: GemmConfig, m: int, n: int, kp: int, sms: int) -> GemmConfig:
        """``config`` with ``split_k = 0`` (auto) made concrete for an M x N output and
        padded K ``kp`` on ``sms`` SMs: the largest split (at most 16, and at least 2 K
        tiles per split) that keeps the programs within one wave, counting 2 programs per
        SM for small tiles (M tiles of at most 32 rows) and 1 for the others."""
        if config.split_k != 0:
            return config
        tiles = -(-m // config.block_m) * -(-n // config.block_n)
        k_tiles = -(-kp // config.block_k)
        per_sm = 2 if config.block_m <= 32 else 1
        split = 1
        while split < 16 and split * 2 <= k_tiles // 2 and tiles * split * 2 <= per_sm * sms:
            split *= 2
        return dataclasses.replace(config, split_k=split)

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

    def matmul(self, a: MXTensor | torch.Tensor, b: MXTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from .gemm import Operand

        target = self.target(b.device)  # probed once per launch
        config = self._gemm_config(b.device, target, Operand.of(a), Operand.of(b), a.shape[0], b.shape[0],
                                   b.k_padded)
        with self.running():
            return self.run_gemm(a, b, config, target, out_dtype)

    def run_gemm(self, a: MXTensor | torch.Tensor, b: MXTensor, config: GemmConfig, target: Optional[Target],
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[M, N] in ``out_dtype`` = a @ b^T with ``config``: the launch :meth:`matmul`
        makes (and the tuner times), through :meth:`gemm_route`'s kernel. The kernel's
        store writes ``out_dtype``, except where ``casts_in_kernel`` is False (the
        interpreter, whose casts truncate): fp32 there, cast after."""
        from . import gemm, gemm_upcast
        from .gemm import Operand

        route = self.gemm_route(target, Operand.of(a), Operand.of(b))
        config = self.resolve_split_k(config, a.shape[0], b.shape[0], b.k_padded, self.sm_count(b.device, target))
        kernel_dtype = out_dtype if self.casts_in_kernel else torch.float32
        if route.kernel == "upcast":
            c = gemm_upcast.matmul(a, b, config, self.options(config), route.upcast, kernel_dtype,
                                   interpreted=target is None)
        else:
            c = gemm.matmul(a, b, config, self.options(config), route.scales, kernel_dtype)
        return c if c.dtype == out_dtype else c.to(out_dtype)

    def gemm_launch_spec(self, target: Target, a, b, config: GemmConfig, m: int = SMALL_M, n: int = 8192,
                         kp: int = 8192, out_dtype: torch.dtype = torch.float32) -> KernelLaunch:
        """The launch :meth:`run_gemm` makes on ``target`` for operands like ``a``, ``b``
        (``gemm.Operand``) with ``config`` at M x N x ``kp`` (which resolves ``split_k = 0``
        with the target's nominal SM count), as data for the compile matrix and the tuner."""
        from . import gemm, gemm_upcast

        route = self.gemm_route(target, a, b)
        config = self.resolve_split_k(config, m, n, kp, self.gemm_sms.get(target.name, 132))
        if route.kernel == "upcast":
            return gemm_upcast.launch_spec(a, b, config, self.options(config), route.upcast, kp=kp, out_dtype=out_dtype)
        return gemm.launch_spec(a, b, config, self.options(config), route.scales, kp=kp, out_dtype=out_dtype)

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
        seen = set()
        for a, b in _aot_gemms():
            heavy = a.heavy or b.heavy
            # decode (M = 1), the edges of the small and mid classes and a large M: every
            # tile config, split and output dtype the defaults launch at N = K = 8192
            for m in (1, self.SMALL_M, self.SMALL_M + 1, self.MID_M, self.MID_M + 1, 4096):
                config = self.default_gemm_config(target, m, a.format, heavy)
                out_dtype = torch.float32 if a.format is None else a.format
                launch = self.gemm_launch_spec(target, a, b, config, m=m, out_dtype=out_dtype)
                if launch.label not in seen:
                    seen.add(launch.label)
                    out.append(launch)
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

    def sm_count(self, device: torch.device, target: Optional[Target]) -> int:
        return _sm_count(torch.device(device))


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
