"""gpt-oss-layout MXFP4 checkpoints: read into MXTensors, write back byte for byte.

The layout (openai/gpt-oss-20b and -120b, the Hugging Face files at the repository root;
transformers' ``Mxfp4HfQuantizer`` reads the same names), per MoE layer ``p =
model.layers.N.mlp.experts`` with E experts, hidden size H and intermediate size I:

==============================  =====  ==================  ==============================
tensor                          dtype  shape               meaning
==============================  =====  ==================  ==============================
``p.gate_up_proj_blocks``       U8     [E, 2I, H/32, 16]   W1 codes, [out, in], K = H
``p.gate_up_proj_scales``       U8     [E, 2I, H/32]       E8M0, one per 32 inputs
``p.gate_up_proj_bias``         BF16   [E, 2I]
``p.down_proj_blocks``          U8     [E, H, I/32, 16]    W2 codes, K = I
``p.down_proj_scales``          U8     [E, H, I/32]
``p.down_proj_bias``            BF16   [E, H]
everything else                 BF16                       not quantized
==============================  =====  ==================  ==============================

Byte ``j`` of a 16-byte row holds element 2j in its low nibble and 2j+1 in its high one,
the codes are E2M1 (``sign << 3 | magnitude``) and a scale byte s means 2^(s-127)
(openai/gpt-oss ``gpt_oss/torch/weights.py``, transformers ``convert_moe_packed_tensors``):
exactly portable_mx's bytes (:mod:`portable_mx.format`). So a ``_blocks`` / ``_scales``
pair *is* the :class:`~portable_mx.MXTensor` of the [E, N, K] weight quantized along K
(axis 2): :func:`wrap` is a reshape, no copy and no decoding, and :func:`unwrap` its
inverse. Rows of gate_up interleave gate (even) and up (odd) units. ``config.json``
carries ``quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [...]}``.

:class:`GptOssCheckpoint` opens a checkpoint (one ``model.safetensors`` or shards with
``model.safetensors.index.json``), checks every quantized tensor against its partner and
``config.json`` from the file headers alone, and reads tensors one at a time (safetensors'
``safe_open``): never the whole checkpoint at once. :func:`save` writes a mapping of
tensors and MXTensors back in the same layout; :func:`load_experts` puts a checkpoint's
experts into a model as :class:`portable_mx.nn.MXExperts` holding the checkpoint's bytes,
whose ``state_dict`` carries the checkpoint's names, so save -> load -> save writes the
same bytes. transformers' ``save_pretrained`` of a dequantized gpt-oss instead drops
``quantization_config`` and writes the experts in bf16: 5.23 under the ``_blocks`` names
(a reload re-initializes the experts), 5.24 under the plain names. :func:`save` refuses
float expert weights, :class:`GptOssCheckpoint` refuses a float tensor under a
``_blocks`` name, and :func:`load_experts` a checkpoint with no quantized experts, each
naming the tensor or the file.

Needs the optional ``safetensors`` package (``pip install "portable_mx[hf]"``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..format import BLOCK_SIZE
from ..recipe import QuantRecipe
from ..tensor import FLOAT_DTYPES, MXTensor
from ._optional import require

__all__ = [
    "CheckpointError",
    "GptOssCheckpoint",
    "QUANTIZATION_CONFIG",
    "check_layout",
    "load_experts",
    "quantize_experts",
    "save",
    "unwrap",
    "wrap",
]

QUANTIZATION_CONFIG: dict[str, Any] = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}
"""config.json's ``quantization_config`` of openai/gpt-oss-20b and -120b (what
transformers' ``Mxfp4Config.to_dict()`` writes); :func:`save` adds it where the config
has none."""

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
PROJECTIONS = ("gate_up_proj", "down_proj")
_BLOCKS, _SCALES = "_blocks", "_scales"
_DTYPES = {
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "BOOL": torch.bool, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_PROJ_RE = re.compile(r"^(?P<module>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")

Tensorish = Union[torch.Tensor, MXTensor]


class CheckpointError(ValueError):
    """A checkpoint tensor that does not fit the gpt-oss layout (the message names it)."""


def _safetensors() -> Any:
    return require("safetensors", "reading and writing gpt-oss checkpoints")


def _stored_recipe(recipe: Any) -> QuantRecipe:
    """``recipe`` (a QuantRecipe, a mapping of its fields, or None: the default) as a
    QuantRecipe, refused where a gpt-oss checkpoint cannot hold what it makes."""
    from ..ops import _recipe

    recipe = _recipe(recipe)
    if recipe.macro_block is not None or recipe.outliers_per_block:
        raise ValueError(
            f"a gpt-oss checkpoint stores plain MXFP4 (codes and E8M0 scales only); recipe {recipe.describe()} "
            "has macro-block factors or outliers, which it cannot hold"
        )
    return recipe


# ----------------------------------------------------------------------------- bytes <-> MXTensor


def wrap(blocks: torch.Tensor, scales: torch.Tensor, *, name: str = "weight", dtype: torch.dtype = torch.bfloat16,
         recipe: Optional[QuantRecipe] = None) -> MXTensor:
    """A ``_blocks`` / ``_scales`` pair as the MXTensor of the [E, N, K] weight quantized
    along K (axis 2): ``qdata = blocks.reshape(E, N, K/2)`` (a view of the same bytes),
    ``scales`` as it is; no decoding, exact by construction.

    ``blocks``: uint8 [E, N, K/32, 16]; ``scales``: uint8 [E, N, K/32]; ``name``: the
    weight's name for errors (``...experts.gate_up_proj``); ``dtype``: the original dtype
    the MXTensor reports (gpt-oss: bf16); ``recipe``: its recipe (a checkpoint records no
    scale rule; default ``QuantRecipe()``). A wrong dtype or shape raises a ValueError
    naming the tensor.
    """
    _check_pair(name, tuple(blocks.shape), _dtype_name(blocks.dtype), tuple(scales.shape), _dtype_name(scales.dtype))
    e, n, g, _ = blocks.shape
    return MXTensor(qdata=blocks.reshape(e, n, g * 16), scales=scales, shape=torch.Size((e, n, g * BLOCK_SIZE)),
                    dtype=dtype, axis=2, recipe=_stored_recipe(recipe))


def unwrap(mx: MXTensor, *, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`wrap`: (blocks uint8 [E, N, K/32, 16], scales uint8
    [E, N, K/32]), views of ``mx``'s tensors.

    ``mx``: a plain MXFP4 MXTensor (no macro-block factors, no outliers) of an [E, N, K]
    weight quantized along K (axis 2), or of the transposed [E, K, N] weight quantized
    along axis 1 (transformers' GptOss parameter layout: the same bytes), K a multiple
    of 32 (the layout has no padding).
    """
    if not isinstance(mx, MXTensor):
        raise TypeError(f"{name}: expected an MXTensor; got {type(mx).__name__}")
    if mx.macro_scales is not None or mx.outlier_values is not None:
        extra = "macro-block factors" if mx.macro_scales is not None else "outliers"
        raise ValueError(f"{name}: a gpt-oss checkpoint stores plain MXFP4; this MXTensor has {extra} "
                         f"({mx.recipe.describe()})")
    if len(mx.shape) != 3 or mx.axis not in (1, 2):
        raise ValueError(f"{name}: expected an MXTensor of shape [E, N, K] quantized along axis 2 (or [E, K, N] along "
                         f"axis 1); got shape {tuple(mx.shape)} along axis {mx.axis}")
    if mx.k % BLOCK_SIZE:
        raise ValueError(f"{name}: K = {mx.k} is not a multiple of {BLOCK_SIZE}; the gpt-oss layout has no padding")
    e, n = mx.lead_shape
    g = mx.k // BLOCK_SIZE
    return mx.qdata.reshape(e, n, g, 16), mx.scales.reshape(e, n, g)


def quantize_experts(state_dict: Mapping[str, torch.Tensor], recipe: Optional[QuantRecipe] = None
                     ) -> dict[str, Tensorish]:
    """transformers' GptOss state dict with float expert weights -> the same mapping
    with every ``*.experts.gate_up_proj`` / ``*.experts.down_proj`` an MXTensor, ready
    for :func:`save`.

    The float expert weights are transformers' GptOss parameters, [E, in, out]
    (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]); each is quantized along
    ``in`` (axis 1) with ``recipe`` (default ``QuantRecipe()``, OCP floor scales; no
    macro blocks or outliers, which the layout cannot hold). Everything else is passed
    through unchanged (cast it first if the file should hold bf16).
    """
    from .. import ops

    recipe = _stored_recipe(recipe)
    out: dict[str, Tensorish] = {}
    for name, t in state_dict.items():
        if _PROJ_RE.match(name) and isinstance(t, torch.Tensor) and t.is_floating_point():
            if t.dim() != 3:
                raise ValueError(f"{name}: expected an expert weight [E, in, out]; got shape {tuple(t.shape)}")
            out[name] = ops.quantize(t.detach(), recipe, axis=1)
        else:
            out[name] = t
    return out


# ----------------------------------------------------------------------------- checks


def _dtype_name(dtype: torch.dtype) -> str:
    for k, v in _DTYPES.items():
        if v == dtype:
            return k
    return str(dtype)


def _check_pair(name: str, b_shape: tuple, b_dtype: str, s_shape: tuple, s_dtype: str) -> None:
    """blocks / scales of the weight ``name``: uint8, [E, N, K/32, 16] and [E, N, K/32]."""
    if b_dtype != "U8":
        hint = ""
        if _DTYPES.get(b_dtype, torch.uint8).is_floating_point:
            hint = (" (a float tensor under a _blocks name is what transformers' save_pretrained writes for a "
                    "dequantized gpt-oss: that file holds no MXFP4 bytes; quantize the float weights and write them "
                    "with portable_mx.checkpoints.gpt_oss.save)")
        raise CheckpointError(f"{name}{_BLOCKS}: dtype {b_dtype}, expected U8 (uint8 MXFP4 codes){hint}")
    if len(b_shape) != 4 or b_shape[-1] != 16:
        raise CheckpointError(f"{name}{_BLOCKS}: shape {list(b_shape)}, expected [E, N, K/32, 16] (16 bytes hold the "
                              f"32 codes of one block)")
    if s_dtype != "U8":
        raise CheckpointError(f"{name}{_SCALES}: dtype {s_dtype}, expected U8 (E8M0 scale bytes)")
    if tuple(s_shape) != tuple(b_shape[:3]):
        raise CheckpointError(f"{name}{_SCALES}: shape {list(s_shape)}, expected {list(b_shape[:3])} (one scale per "
                              f"block of {name}{_BLOCKS} {list(b_shape)})")


def _expected_shapes(config: Optional[Mapping[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """projection -> (E, N, K) from a gpt-oss config.json, or {} without one."""
    if not config:
        return {}
    try:
        e, h, i = int(config["num_local_experts"]), int(config["hidden_size"]), int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError):
        return {}
    return {"gate_up_proj": (e, 2 * i, h), "down_proj": (e, h, i)}


_BIAS_RE = re.compile(r"^(?P<base>.*\.experts\.(?:gate_up_proj|down_proj))_bias$")
_EXTRA_PART_RE = re.compile(r"^(?P<base>.*\.experts\.(?:gate_up_proj|down_proj))_"
                            r"(?P<part>macro_scales|macro_block|outlier_values|outlier_indices)$")
"""The names under which a module's state dict holds an expert weight's macro-block factors
or outliers (:class:`~portable_mx.nn.MXExperts`' frozen buffers): parts the layout has no
place for."""


def check_layout(infos: Mapping[str, tuple[str, tuple[int, ...]]], config: Optional[Mapping[str, Any]]) -> None:
    """Check stored tensors against the gpt-oss layout, from their dtypes and shapes alone
    (stored name -> (safetensors dtype such as "U8" / "BF16", shape)); ``config``:
    config.json's content or None. What :class:`GptOssCheckpoint` checks on opening and
    :func:`save` before writing: each ``X_blocks`` has its ``X_scales`` and the reverse,
    both uint8 and shaped [E, N, K/32, 16] and [E, N, K/32]; the expert weights as the
    config says (E = ``num_local_experts``; gate_up N = 2 ``intermediate_size``, K =
    ``hidden_size``; down the other way round); an expert bias float [E, N]; no
    macro-block factors or outliers of an expert weight (a frozen MXExperts' state dict
    names them ``X_macro_scales``, ``X_outlier_values``, ``X_outlier_indices``). Raises a
    ValueError naming the first tensor that does not fit."""
    expected = _expected_shapes(config)
    for name, (dtype, shape) in infos.items():
        extra = _EXTRA_PART_RE.match(name)
        if extra:  # (before the pairing check: "..._macro_scales" ends like scales)
            what = "macro-block factors" if extra["part"].startswith("macro") else "outliers"
            raise CheckpointError(
                f"{name}: the experts {extra['base']} carry {what}, which a gpt-oss checkpoint cannot hold (it "
                "stores plain MXFP4: _blocks, _scales and _bias only; written, they would be ignored on reading "
                "and the experts read back without them). Quantize the experts without macro blocks or "
                "outliers to save them in this layout, or save this state dict with torch.save")
        for suffix, partner in ((_BLOCKS, _SCALES), (_SCALES, _BLOCKS)):
            if name.endswith(suffix) and name[: -len(suffix)] + partner not in infos:
                base = name[: -len(suffix)]
                raise CheckpointError(
                    f"{base}{partner} is missing: {name} is stored without it, and MXFP4 "
                    f"{'codes need their E8M0 scales' if suffix == _BLOCKS else 'scales need their codes'} "
                    f"(a gpt-oss checkpoint stores {base}{_BLOCKS} and {base}{_SCALES} together)"
                )
        if name.endswith(_BLOCKS):
            base = name[: -len(_BLOCKS)]
            s_dtype, s_shape = infos[base + _SCALES]
            _check_pair(base, shape, dtype, s_shape, s_dtype)
            m = _PROJ_RE.match(base)
            if m and m["proj"] in expected:
                e, n, k = expected[m["proj"]]
                want = (e, n, k // BLOCK_SIZE, 16)
                if tuple(shape) != want:
                    raise CheckpointError(
                        f"{name}: shape {list(shape)}, expected {list(want)} from config.json (E={e}, N={n}, "
                        f"K={k}: {m['proj']} is [E, N, K] stored as [E, N, K/32, 16])"
                    )
        m = _BIAS_RE.match(name)
        if m and m["base"] + _BLOCKS in infos:
            want = tuple(infos[m["base"] + _BLOCKS][1][:2])
            if tuple(shape) != want:
                raise CheckpointError(f"{name}: shape {list(shape)}, expected {list(want)} ([E, N] of "
                                      f"{m['base']}{_BLOCKS})")
            if _DTYPES.get(dtype) not in FLOAT_DTYPES:  # (the dtypes the grouped GEMM adds: no float8)
                raise CheckpointError(f"{name}: dtype {dtype}, expected a BF16, F16, F32 or F64 bias (gpt-oss: BF16)")


# ----------------------------------------------------------------------------- reading


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not valid JSON ({err})") from None


def _read_config(path: Path) -> dict[str, Any]:
    config = _read_json(path)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object (a model config); got a {type(config).__name__}")
    return config


def _check_shard_name(file: Any, where: str) -> None:
    """A shard is a file of the checkpoint's own directory: a plain file name, so that
    neither reading nor writing reaches outside it."""
    if not isinstance(file, str) or file in ("", ".", "..") or "\\" in file or Path(file).name != file:
        raise CheckpointError(f"{where}: shard {file!r} is not a plain file name (a checkpoint's shards are files of "
                              "its own directory)")


def _read_index(path: Path) -> dict[str, Any]:
    index = _read_json(path)
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{path}: not a safetensors index (no \"weight_map\" object of tensor names to files)")
    for name, file in index["weight_map"].items():
        _check_shard_name(file, f"{path}: {name}")
    return index


def _check_quant_method(config: Optional[Mapping[str, Any]], where: Any, quantized: bool) -> None:
    """A checkpoint that stores MXFP4 experts must not declare another quantization."""
    qc = None if config is None else config.get("quantization_config")
    if qc is None or not quantized:
        return
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "mxfp4":
        method = qc.get("quant_method") if isinstance(qc, Mapping) else qc
        raise CheckpointError(f"{where}: quantization_config's quant_method is {method!r}, but the checkpoint stores "
                              "MXFP4 experts (_blocks / _scales), which a gpt-oss checkpoint declares as 'mxfp4': "
                              "transformers would read them with another quantizer")


class GptOssCheckpoint(Mapping):
    """A gpt-oss-layout safetensors checkpoint, open for reading tensor by tensor.

    ``path``: a directory holding ``model.safetensors`` or shards listed in
    ``model.safetensors.index.json`` (and usually ``config.json``), or one
    ``.safetensors`` file. Opening reads the file headers and ``config.json`` only, and
    checks every quantized weight there: each ``X_blocks`` needs its ``X_scales`` (and
    the reverse), both uint8, shaped [E, N, K/32, 16] and [E, N, K/32], the expert
    weights and their ``_bias`` shaped as ``config.json`` says (E =
    ``num_local_experts``, gate_up N = 2 ``intermediate_size``, K = ``hidden_size``;
    down the other way round); any mismatch raises a ``ValueError`` naming the tensor.

    As a mapping: keys are the logical names, in file order; a quantized weight appears
    once, without its suffix (``model.layers.0.mlp.experts.gate_up_proj``), and reads as
    the MXTensor of the [E, N, K] weight along axis 2 (:func:`wrap`: the file's bytes,
    never dequantized); every other key reads as the stored tensor. Each access reads
    that tensor (or pair) from disk and keeps nothing.

    Attributes: ``config`` (config.json as a dict, or None), ``shards`` (file ->
    stored tensor names, in file order), ``file_metadata`` (file -> the safetensors
    header's ``__metadata__``), ``index_metadata`` (the index's ``metadata``, or None),
    ``dtype`` (the original dtype the MXTensors report, default bf16), ``recipe``.
    """

    def __init__(self, path: Union[str, os.PathLike], *, dtype: torch.dtype = torch.bfloat16,
                 recipe: Optional[QuantRecipe] = None) -> None:
        st = _safetensors()
        path = Path(path)
        if path.is_file():
            root, files = path.parent, [path.name]
            index = None
        elif (path / INDEX_FILE).is_file():
            if (path / SINGLE_FILE).is_file():
                raise CheckpointError(
                    f"{path}: holds both {SINGLE_FILE} and {INDEX_FILE}, two different checkpoints (transformers "
                    f"reads {SINGLE_FILE}, this reader the index): remove the stale one, or open the file itself")
            root = path
            index = _read_index(path / INDEX_FILE)
            files = list(dict.fromkeys(index["weight_map"].values()))
        elif (path / SINGLE_FILE).is_file():
            root, files, index = path, [SINGLE_FILE], None
        else:
            raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (a gpt-oss checkpoint directory "
                                    "holds one)")
        self.path = root
        self.dtype = dtype
        self.recipe = _stored_recipe(recipe)
        self.index_metadata = None if index is None else index.get("metadata")
        config_path = root / CONFIG_FILE
        self.config: Optional[dict[str, Any]] = _read_config(config_path) if config_path.is_file() else None
        self.shards: dict[str, list[str]] = {}
        self.file_metadata: dict[str, Optional[dict[str, str]]] = {}
        self._entries: dict[str, tuple[str, str, tuple[int, ...]]] = {}  # stored name -> (file, dtype, shape)
        weight_map = None if index is None else index["weight_map"]
        for file in files:
            with st.safe_open(str(root / file), framework="pt") as f:
                self.file_metadata[file] = f.metadata()
                names = list(f.keys())
                for name in names:
                    if name in self._entries:  # (readers disagree on which copy: refused, not guessed)
                        raise CheckpointError(
                            f"{name}: stored in both {self._entries[name][0]} and {file} (a stale copy?): readers "
                            f"disagree on which one they read (transformers takes the last file's"
                            + (f", the index names {weight_map.get(name)}" if weight_map is not None else "")
                            + "); remove one")
                    sl = f.get_slice(name)
                    self._entries[name] = (file, sl.get_dtype(), tuple(sl.get_shape()))
            self.shards[file] = names
        if weight_map is not None:
            missing = sorted(n for n, file in weight_map.items() if self._entries.get(n, ("",))[0] != file)
            if missing:
                where = self._entries.get(missing[0], (None,))[0]
                raise CheckpointError(f"{missing[0]}: listed in {INDEX_FILE} under {weight_map[missing[0]]} but "
                                      + ("not stored in the checkpoint" if where is None else f"stored in {where}"))
        _check_quant_method(self.config, config_path, any(n.endswith(_BLOCKS) for n in self._entries))
        self._keys = self._check()

    def _check(self) -> list[str]:
        """Validate the layout from the headers; return the logical names in file order."""
        infos = {name: (dtype, shape) for name, (_, dtype, shape) in self._entries.items()}
        check_layout(infos, self.config)
        return [name[: -len(_BLOCKS)] if name.endswith(_BLOCKS) else name
                for name in infos if not name.endswith(_SCALES)]

    # Mapping interface -------------------------------------------------------------

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and ((name in self._entries and not name.endswith((_BLOCKS, _SCALES)))
                                          or name + _BLOCKS in self._entries)

    def __getitem__(self, name: str) -> Tensorish:
        if name + _BLOCKS in self._entries:
            return wrap(self.stored(name + _BLOCKS), self.stored(name + _SCALES), name=name, dtype=self.dtype,
                        recipe=self.recipe)
        if name in self._entries and not name.endswith((_BLOCKS, _SCALES)):
            return self.stored(name)
        raise KeyError(name)

    def stored(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name`` (a file name, ``_blocks`` / ``_scales``
        included), read from disk now."""
        if name not in self._entries:
            raise KeyError(name)
        file = self._entries[name][0]
        with _safetensors().safe_open(str(self.path / file), framework="pt") as f:
            return f.get_tensor(name)

    def stored_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype, shape) of the tensor stored under ``name``, from the header."""
        _, dtype, shape = self._entries[name]
        return dtype, shape

    def expert_modules(self) -> list[str]:
        """Qualified names of the modules whose expert weights the checkpoint quantizes
        (``model.layers.N.mlp.experts``), in file order."""
        out = []
        for key in self._keys:
            m = _PROJ_RE.match(key)
            if m and key + _BLOCKS in self._entries and m["module"] not in out:
                out.append(m["module"])
        return out

    def experts(self, module: Union[int, str]) -> dict[str, Tensorish]:
        """The expert tensors of one MoE module: a layer index (``model.layers.N.mlp.experts``)
        or a qualified module name -> ``{"gate_up_proj": MXTensor, "gate_up_proj_bias":
        Tensor, "down_proj": ..., "down_proj_bias": ...}`` (biases only where stored)."""
        prefix = f"model.layers.{module}.mlp.experts" if isinstance(module, int) else module
        out: dict[str, Tensorish] = {}
        for proj in PROJECTIONS:
            if f"{prefix}.{proj}{_BLOCKS}" not in self._entries:
                raise KeyError(f"{prefix}.{proj}{_BLOCKS}: not in the checkpoint at {self.path}")
            out[proj] = self[f"{prefix}.{proj}"]
            if f"{prefix}.{proj}_bias" in self._entries:
                out[f"{proj}_bias"] = self.stored(f"{prefix}.{proj}_bias")
        return out

    def __repr__(self) -> str:
        return (f"GptOssCheckpoint({str(self.path)!r}, {len(self._keys)} tensors, {len(self.expert_modules())} expert "
                f"modules, {len(self.shards)} file(s))")


# ----------------------------------------------------------------------------- writing


def _stored_tensors(name: str, value: Any) -> list[tuple[str, torch.Tensor]]:
    """The (stored name, tensor) entries of one mapping item."""
    if isinstance(value, MXTensor):
        blocks, scales = unwrap(value, name=name)
        return [(name + _BLOCKS, blocks), (name + _SCALES, scales)]
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or an MXTensor; got {type(value).__name__}")
    if _PROJ_RE.match(name) and value.is_floating_point():
        raise CheckpointError(
            f"{name}: a float expert weight {list(value.shape)} {value.dtype}; the gpt-oss layout stores it as MXFP4 "
            "(_blocks and _scales): quantize it first (portable_mx.checkpoints.gpt_oss.quantize_experts), or pass the "
            "MXTensor"
        )
    return [(name, value)]


def _json_text(obj: Any) -> str:
    """transformers' JSON formatting (``indent=2, sort_keys=True``, trailing newline), so
    files written here match those written there key for key."""
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def _with_quantization_config(config: Any) -> Optional[dict[str, Any]]:
    if config is None:
        return None
    if not isinstance(config, Mapping) and callable(getattr(config, "to_dict", None)):
        config = config.to_dict()  # (a transformers PretrainedConfig)
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be config.json's content as a dict (e.g. model.config.to_dict()) or None; got "
                        f"{type(config).__name__}")
    config = dict(config)
    qc = config.get("quantization_config")
    if qc is None:
        config["quantization_config"] = json.loads(json.dumps(QUANTIZATION_CONFIG))
    elif not isinstance(qc, Mapping) or qc.get("quant_method") != "mxfp4":
        raise ValueError(f"config.json's quantization_config is {qc!r}; a gpt-oss MXFP4 checkpoint has "
                         "quant_method 'mxfp4'")
    return config


def save(path: Union[str, os.PathLike], tensors: Mapping[str, Any], config: Optional[Mapping[str, Any]], *,
         shards: Optional[Mapping[str, list[str]]] = None,
         metadata: Optional[Mapping[str, Optional[Mapping[str, str]]]] = None,
         index_metadata: Optional[Mapping[str, Any]] = None) -> list[Path]:
    """Write ``tensors`` as a gpt-oss-layout checkpoint in the directory ``path``; return
    the files written.

    ``tensors``: name -> ``torch.Tensor`` or :class:`~portable_mx.MXTensor` (a model's
    ``state_dict()``, :func:`quantize_experts`' output, or a :class:`GptOssCheckpoint`).
    An MXTensor named ``X`` is stored as ``X_blocks`` / ``X_scales`` (:func:`unwrap`:
    its bytes as they are); a tensor as it is, under its name and dtype (a model's
    ``X_blocks`` / ``X_scales`` buffers included). Everything is checked as
    :class:`GptOssCheckpoint` checks a file, before any file is written; a float tensor
    under an expert weight's name (``*.experts.gate_up_proj``) raises: that is the
    save_pretrained pitfall (see the module doc), not a checkpoint. Names that share
    memory (tied weights) raise too: a checkpoint stores a tensor once.

    ``config``: config.json's content (a dict, e.g. ``model.config.to_dict()`` or
    :attr:`GptOssCheckpoint.config`, or a transformers config, whose ``to_dict()`` is
    taken), written with ``quantization_config`` set to :data:`QUANTIZATION_CONFIG`
    where it has none (one with another ``quant_method`` raises); None writes no
    config.json (and leaves one already there). ``shards``: file name (a plain name in
    ``path``) -> stored names (as :attr:`GptOssCheckpoint.shards`), written with
    ``model.safetensors.index.json``; default one ``model.safetensors``.
    ``metadata``: file -> the safetensors header's ``__metadata__`` (a file it does not
    name: ``{"format": "pt"}``, what transformers writes; None: no ``__metadata__``, as
    in a file read without one); ``index_metadata``: the index's ``metadata``
    (``total_size`` is recomputed). When ``tensors`` is a :class:`GptOssCheckpoint`, its
    shards and metadata are the defaults and each file is written from its own tensors
    only, read one file's worth at a time; an in-memory mapping's tensors are written as
    they are (no copies but a ``.contiguous()`` where needed).

    The folder: every file is written under a temporary name and renamed once all are
    written, so a checkpoint can be saved over its own source, resharded or not, and an
    error leaves the folder as it was. An earlier checkpoint's weight files that a reader
    would take instead of the new one, or mix into it, are then removed, as transformers'
    ``save_pretrained`` cleans its folder: ``model.safetensors`` when writing shards
    (transformers prefers it to an index), the index when writing one file, and the
    shards the old index names that are not written now. Other files are left alone.

    Byte identity: the files are written by safetensors' own writer (which orders the
    tensors by dtype alignment and name, whatever the mapping's order) and the JSON
    files in transformers' format, so writing what was read writes the same bytes. One
    exception, safetensors' own: it orders the keys of a ``__metadata__`` holding more
    than one differently in each process, so such a header is rewritten with the same
    content but not always the same bytes.
    """
    st_torch = require("safetensors.torch", "writing gpt-oss checkpoints")
    root = Path(path)
    lazy = isinstance(tensors, GptOssCheckpoint)
    if lazy:
        shards = tensors.shards if shards is None else shards
        metadata = tensors.file_metadata if metadata is None else metadata
        index_metadata = tensors.index_metadata if index_metadata is None else index_metadata
        infos = {s: tensors.stored_info(s) for s in tensors._entries}
    else:
        stored = {s: t for n in tensors for s, t in _stored_tensors(n, tensors[n])}
        infos = {s: (_dtype_name(t.dtype), tuple(t.shape)) for s, t in stored.items()}
        _check_no_shared_memory(stored)
    config = _with_quantization_config(config)
    check_layout(infos, config)
    if shards is None:
        shards = {SINGLE_FILE: list(infos)}
    for file in shards:
        _check_shard_name(file, "save")
        if file in (INDEX_FILE, CONFIG_FILE):
            raise ValueError(f"save: a shard cannot be named {file!r} (the checkpoint writes that file itself)")
    if SINGLE_FILE in shards and len(shards) > 1:
        raise ValueError(f"save: {SINGLE_FILE} is the name of a one-file checkpoint; with several shards a reader "
                         "would take it alone (transformers) or refuse the folder: name the shards otherwise")
    listed = [s for names in shards.values() for s in names]
    extra, unlisted = sorted(set(listed) - set(infos)), sorted(set(infos) - set(listed))
    if extra or unlisted or len(listed) != len(set(listed)):
        raise ValueError(f"shards must list every stored tensor once: not among the tensors {extra[:3]}, in no shard "
                         f"{unlisted[:3]}" + (", some listed twice" if len(listed) != len(set(listed)) else ""))
    root.mkdir(parents=True, exist_ok=True)
    stale = _stale_files(root, set(shards))  # (read before anything is written: the old index names them)
    # every file goes to a temporary name first and is renamed once all are written, so that a
    # lazy source in the same folder reads its own files to the end, and an error leaves the
    # folder as it was
    pending: list[tuple[Path, Path]] = []  # (temporary, final)

    def temporary(final: Path) -> Path:
        tmp = final.with_name(f".{final.name}.{os.getpid()}.partial")
        pending.append((tmp, final))
        return tmp

    try:
        total = 0
        for file, names in shards.items():
            if lazy:
                entries = {s: tensors.stored(s) for s in names}
            else:
                entries = {s: stored[s].detach().contiguous() for s in names}
            if metadata is None or file not in metadata:
                meta = {"format": "pt"}
            else:  # (None: a file read without __metadata__ is written without one)
                meta = None if metadata[file] is None else dict(metadata[file])
            st_torch.save_file(entries, str(temporary(root / file)), metadata=meta)
            total += sum(t.numel() * t.element_size() for t in entries.values())
            del entries
        if list(shards) != [SINGLE_FILE]:
            index = {"metadata": {**dict(index_metadata or {}), "total_size": total},
                     "weight_map": {s: file for file, names in shards.items() for s in names}}
            temporary(root / INDEX_FILE).write_text(_json_text(index))
        if config is not None:
            temporary(root / CONFIG_FILE).write_text(_json_text(config))
    except BaseException:
        for tmp, _ in pending:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, final in pending:
        os.replace(tmp, final)
    for old in stale:
        old.unlink(missing_ok=True)
    return [final for _, final in pending]


def _check_no_shared_memory(stored: Mapping[str, torch.Tensor]) -> None:
    """A checkpoint stores each tensor once: names whose bytes overlap (tied weights) are
    refused before anything is written, naming them. Views of one buffer that do not
    overlap (``vector_to_parameters`` makes them), empty tensors and non-contiguous views
    (written from a copy) pass, as safetensors takes them."""
    spans: dict[tuple, list[tuple[int, int, str]]] = {}
    for name, t in stored.items():
        if t.numel() == 0 or not t.is_contiguous():
            continue
        start = t.storage_offset() * t.element_size()
        spans.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(
            (start, start + t.numel() * t.element_size(), name))
    for group in spans.values():
        group.sort()
        for (_, end, first), (start, _, second) in zip(group, group[1:]):
            if start < end:
                raise CheckpointError(
                    f"{first} and {second} share memory (tied weights, e.g. lm_head.weight and "
                    "model.embed_tokens.weight under tie_word_embeddings): a checkpoint stores a tensor once; leave "
                    "the tied name out of the mapping (transformers' loader ties it again from config.json), or pass "
                    "a clone")


def _stale_files(root: Path, shards: set[str]) -> list[Path]:
    """The weight files of an earlier checkpoint in ``root`` that the new one does not
    overwrite and a reader would take instead of it, or mix in: ``model.safetensors``
    (transformers prefers it to an index), the index (this reader prefers it), and the
    shards the old index names. :func:`save` removes them after writing, as transformers'
    ``save_pretrained`` cleans its folder."""
    stale = []
    if SINGLE_FILE not in shards and (root / SINGLE_FILE).is_file():
        stale.append(root / SINGLE_FILE)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            old = json.loads(index_path.read_text()).get("weight_map", {})
            files = set(old.values()) if isinstance(old, dict) else set()
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            files = set()
        for file in sorted(f for f in files if isinstance(f, str)):
            try:
                _check_shard_name(file, str(index_path))
            except CheckpointError:
                continue  # (never a file outside the folder)
            if file not in shards and file.endswith(".safetensors") and (root / file).is_file():
                stale.append(root / file)
        if list(shards) == [SINGLE_FILE]:
            stale.append(index_path)
    return stale


# ----------------------------------------------------------------------------- models


def load_experts(model: torch.nn.Module, checkpoint: Union[str, os.PathLike, GptOssCheckpoint], *,
                 recipe: Any = None) -> torch.nn.Module:
    """Put the checkpoint's experts into ``model``, in place, and return it.

    Each module the checkpoint quantizes (``model.layers.N.mlp.experts``,
    :meth:`GptOssCheckpoint.expert_modules`) is replaced by a frozen
    :class:`portable_mx.nn.MXExperts` holding the checkpoint's bytes (read one tensor
    at a time, never dequantized) and biases (in the checkpoint's dtype, so that
    :func:`save` writes them back unchanged), on the device of the module it replaces; a
    bias that module has and the checkpoint lacks raises. That module (transformers' ``GptOssExperts``, or an
    MXExperts) gives the activation (gpt-oss's clamped SwiGLU, its ``alpha`` and
    ``limit``); its weights are dropped. ``recipe``: the experts' GEMM recipe (default
    ``QuantRecipe(activations="bf16")``, W4A16: the activations rounded to bf16, the
    checkpoint's weights exact). The converted model's ``state_dict()`` holds the
    checkpoint's names, dtypes and bytes for the experts, so :func:`save` of it writes
    them back unchanged. Where the model has a transformers config (``model.config``
    with ``to_dict``) without a ``quantization_config`` (transformers drops it when it
    dequantizes the experts), it gets the checkpoint's (or :data:`QUANTIZATION_CONFIG`,
    as :func:`save` writes it): the model's ``save_pretrained`` then writes MXFP4
    experts that transformers reads as such (without it, its ``from_pretrained`` took
    them for unknown tensors and re-initialized every expert, saying so only in its log).
    """
    from ..nn._takeover import hand_over
    from ..nn.hf_experts import experts_from_module

    ckpt = checkpoint if isinstance(checkpoint, GptOssCheckpoint) else GptOssCheckpoint(checkpoint)
    recipe = QuantRecipe(activations="bf16") if recipe is None else recipe
    modules = dict(model.named_modules())
    if not ckpt.expert_modules():
        raise CheckpointError(
            f"{ckpt.path}: the checkpoint quantizes no experts (no *.experts.gate_up_proj_blocks / _scales): it is "
            "not an MXFP4 gpt-oss checkpoint (a dequantized model saved by transformers' save_pretrained is not one; "
            "quantize its experts with quantize_experts and write them with save)"
        )
    replaced = []  # (every module built before any is set: a mismatch leaves the model as it was)
    for qualified in ckpt.expert_modules():
        if qualified not in modules:
            raise KeyError(f"{qualified}: the checkpoint quantizes it, but the model has no module of that name")
        old = modules[qualified]
        tensors = ckpt.experts(qualified)
        for proj in ("gate_up_proj", "down_proj"):
            if getattr(old, f"{proj}_bias", None) is not None and f"{proj}_bias" not in tensors:
                raise CheckpointError(
                    f"{qualified}.{proj}_bias: the model's {type(old).__name__} has this bias but the checkpoint "
                    "stores none (a gpt-oss checkpoint stores both projections' biases); loading would drop it")
        try:
            new = experts_from_module(old, recipe, weights=tensors)
        except ValueError as err:  # the checkpoint's experts are not the ones the model was built for
            raise CheckpointError(f"{ckpt.path}: {qualified}: {err}") from None
        except TypeError as err:  # a module whose hooks or additions the new one cannot take over
            raise TypeError(f"load_experts: {qualified}: {err}") from None
        if new is None:
            raise CheckpointError(f"{qualified}: the checkpoint quantizes it, but the model's {type(old).__name__} "
                                  "there is no expert module this library maps")
        replaced.append((qualified, old, new))
    for qualified, old, new in replaced:
        parent_name, _, child = qualified.rpartition(".")
        setattr(modules[parent_name] if parent_name else model, child, new)
        hand_over(old, new)
    config = getattr(model, "config", None)
    if hasattr(config, "to_dict") and getattr(config, "quantization_config", None) is None:
        quantization = (ckpt.config or {}).get("quantization_config") or QUANTIZATION_CONFIG  # (as save writes it)
        config.quantization_config = json.loads(json.dumps(quantization))  # (a copy)
    return model

