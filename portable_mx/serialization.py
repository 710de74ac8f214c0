"""MXTensors in state dicts and safetensors files: quantized inference weights saved as
their bytes (4.25 bits per element plus macro factors / outliers) and loaded back
bit for bit.

An MXTensor named ``w`` becomes plain tensors under ``w.`` (its :meth:`MXTensor.parts`
by name: ``w.qdata`` uint8, ``w.scales`` uint8, and with the recipe's corrections
``w.macro_scales`` fp32, ``w.outlier_values`` bf16, ``w.outlier_indices`` uint8; in the
MXTensor's own layout, the quantized axis last) and ``w.mx_meta``: a uint8 tensor
holding the JSON of its shape, dtype, axis and recipe. Only tensors, so the same dict
goes through ``torch.save`` / ``torch.load(weights_only=True)``, distributed
checkpoints and safetensors, which store nothing else. Plain tensors pass through
under their own names, but for those: a tensor named like a part of an MXTensor of the
same dict (``w.macro_scales`` beside an MXTensor ``w``, whether its recipe has the part or
not) or ending in ``.mx_meta`` is refused on saving. Loading checks every part's dtype and shape against the
metadata and raises a ValueError naming the entry otherwise.

safetensors is optional (``pip install safetensors``, or the ``hf`` extra); :func:`save_safetensors`
and :func:`load_safetensors` raise an ImportError saying so where it is missing.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from .format import BLOCK_SIZE as BLOCK
from .recipe import QuantRecipe
from .tensor import FLOAT_DTYPES, MXTensor

Entry = Union[MXTensor, torch.Tensor]

__all__ = ["load_safetensors", "load_state_dict", "save_safetensors", "state_dict"]

META = "mx_meta"
FORMAT = "portable_mx.MXTensor/1"
_PARTS = ("qdata", "scales", "macro_scales", "outlier_values", "outlier_indices")
_DTYPES = {str(d).removeprefix("torch."): d for d in FLOAT_DTYPES}


def _meta(mx: MXTensor) -> torch.Tensor:
    text = json.dumps({"format": FORMAT, "shape": list(mx.shape), "dtype": str(mx.dtype).removeprefix("torch."),
                       "axis": mx.axis, "recipe": json.loads(mx.recipe.model_dump_json())}, sort_keys=True)
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def state_dict(tensors: Mapping[str, Entry]) -> dict[str, torch.Tensor]:
    """``tensors`` (names -> MXTensor or tensor) as a dict of plain tensors (see the
    module doc for the names). Shares storage with the MXTensors (no copies)."""
    if not isinstance(tensors, Mapping):
        raise TypeError(f"state_dict takes a mapping of names to MXTensors or tensors; got {type(tensors).__name__}")
    out: dict[str, torch.Tensor] = {}
    # the names load_state_dict reads as an MXTensor's, every part its recipe may have
    reserved = {f"{n}.{p}": n for n, t in tensors.items() if isinstance(t, MXTensor) and isinstance(n, str)
                for p in (*_PARTS, META)}

    def put(key: str, value: torch.Tensor) -> None:
        if key in out:
            raise ValueError(f"state_dict: two entries would be saved as {key!r}; rename one")
        out[key] = value

    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"state_dict: names must be non-empty strings; got {name!r}")
        if isinstance(t, MXTensor):
            for part in _PARTS:
                value = getattr(t, part)
                if value is not None:
                    put(f"{name}.{part}", value)
            put(f"{name}.{META}", _meta(t))
        elif isinstance(t, torch.Tensor):
            if name not in out and (name in reserved or name.endswith("." + META)):
                # (saved, it would be read back as a part of an MXTensor, and the load would fail)
                whose = f"the MXTensor {reserved[name]!r}" if name in reserved else "an MXTensor"
                raise ValueError(f"state_dict: the tensor {name!r} has a name load_state_dict reads as a part of "
                                 f"{whose} (<name>.{{{', '.join((*_PARTS, META))}}}); rename it")
            put(name, t)
        else:
            raise TypeError(f"state_dict: {name!r} must be an MXTensor or a torch.Tensor; got {type(t).__name__}")
    return out


def _mx_from(name: str, state: Mapping[str, torch.Tensor]) -> MXTensor:
    raw = state[f"{name}.{META}"]
    if isinstance(raw, torch.Tensor) and raw.is_meta:
        raise ValueError(f"load_state_dict: {name}.{META} is on the meta device (torch.load(map_location='meta')?), "
                         "which holds no bytes: the MXTensor's shape, dtype and recipe cannot be read; load with "
                         "map_location='cpu' (or mmap=True, which reads nothing until used)")
    try:
        if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
            raise TypeError(f"{META} must be a 1-D uint8 tensor (UTF-8 JSON); got {_what(raw)}")
        meta = json.loads(bytes(raw.cpu().tolist()).decode())
        if not isinstance(meta, dict):
            raise TypeError(f"the JSON is a {type(meta).__name__}, not an object")
        if meta.get("format") != FORMAT:
            raise ValueError(f"unknown format {meta.get('format')!r} (this version reads {FORMAT!r})")
        missing = [k for k in ("shape", "axis", "dtype", "recipe") if k not in meta]
        if missing:  # (the message was the bare key: "('axis')")
            raise ValueError(f"missing field(s) {', '.join(map(repr, missing))}")
        if not isinstance(meta["dtype"], str) or meta["dtype"] not in _DTYPES:  # (it was "(None)", "('int32')")
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}; got {meta['dtype']!r}")
        dims, axis = meta["shape"], meta["axis"]
        if not (isinstance(dims, list) and dims and all(type(d) is int and 0 <= d < 2**62 for d in dims)):
            raise ValueError(f"shape must be a non-empty list of sizes >= 0; got {dims!r}")
        if type(axis) is not int or not 0 <= axis < len(dims):
            raise ValueError(f"axis must be an int in [0, {len(dims)}); got {axis!r}")
        padded = math.prod(dims) // max(dims[axis], 1) * (-(-dims[axis] // 32) * 32)
        if padded >= 2**58:  # (the parts' sizes in bytes overflowed torch's storage size: a RuntimeError)
            raise ValueError(f"shape {dims!r} holds {padded} elements once padded along axis {axis}: no tensor has "
                             "that many")
        shape, dtype = torch.Size(dims), _DTYPES[meta["dtype"]]
        recipe = QuantRecipe.model_validate(meta["recipe"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"load_state_dict: {name!r}: unreadable MXTensor metadata ({e})") from None
    parts = {p: state.get(f"{name}.{p}") for p in _PARTS}
    for p, v in parts.items():
        if v is not None and not isinstance(v, torch.Tensor):
            raise ValueError(f"load_state_dict: {name}.{p} is a {type(v).__name__}, not a tensor")
    device = parts["qdata"].device if parts["qdata"] is not None else torch.device("cpu")
    expected = MXTensor.zeros(shape, dtype, axis, recipe, torch.device("meta"))
    for p in _PARTS:
        want, got = getattr(expected, p), parts[p]
        if want is None and got is None:
            continue
        if want is None or got is None or got.dtype != want.dtype or got.shape != want.shape:
            what = "absent" if got is None else f"{got.dtype} {tuple(got.shape)}"
            need = "absent" if want is None else f"{want.dtype} {tuple(want.shape)}"
            raise ValueError(f"load_state_dict: {name}.{p} is {what}; an MXTensor of shape {tuple(shape)} "
                             f"quantized along axis {axis} with {recipe.describe()} needs {need}")
        if got.device != device:
            raise ValueError(f"load_state_dict: the parts of {name!r} are on different devices")
    has_bytes = device.type != "meta"  # (parts on the meta device beside a readable mx_meta: nothing to check)
    if has_bytes:
        _check_outlier_indices(name, parts["outlier_indices"])
        _check_macro_scales(name, parts["macro_scales"])
    mx = MXTensor(shape=shape, dtype=dtype, axis=axis, recipe=recipe, **{p: parts[p] for p in _PARTS})
    if has_bytes:
        _check_padding(name, mx)
    return mx


def _check_padding(name: str, mx: MXTensor) -> None:
    """A file's padding (the elements past K of the last block) must hold zeros, as the
    quantizer writes it (K zero-padded to a multiple of 32): the reference decodes only
    the K elements, while the Triton GEMMs sum the whole padded block, so non-zero padding
    (a file whose shape was edited, or damaged bytes) gave each backend another product.
    Codes of magnitude 0 (+-0) and outliers of value 0 there. One read, at load only."""
    k, kp = mx.k, mx.k_padded
    if k == kp or mx.qdata.numel() == 0:
        return
    q = mx.qdata
    first = k // 2
    bad = False
    if k % 2:  # (element k sits in the high nibble of byte k // 2)
        bad = bool(((q[..., first] >> 4) & 0x7).any())
        first += 1
    if first < q.shape[-1]:
        bad = bad or bool((q[..., first:] & 0x77).any())
    if mx.outlier_indices is not None and mx.outlier_indices.numel():
        in_padding = mx.outlier_indices[..., -1, :].long() >= k - (kp - BLOCK)
        bad = bad or bool((in_padding & (mx.outlier_values[..., -1, :] != 0)).any())
    if bad:
        raise ValueError(f"load_state_dict: {name} holds non-zero values past its K = {k} (in the padding of its "
                         f"last block, up to {kp}): the quantizer writes zeros there; the file is damaged (or its "
                         "shape was edited)")


def _check_outlier_indices(name: str, idx: Optional[torch.Tensor]) -> None:
    """A file's outlier positions must each name an element of its block (0..31) and
    differ within the block, as the quantizer writes them; the kernels do not check the
    bytes (MXTensor's doc). A position >= 32 decodes differently on each backend (the
    reference raises in the GEMM, the Triton kernels skip the outlier); a repeated one
    decodes alike on both but loses an outlier (its element's code was zeroed when it was
    set aside). Either means a damaged file. One read of the bytes, at load only."""
    if idx is None or idx.numel() == 0:
        return
    if int(idx.max()) >= BLOCK:
        raise ValueError(f"load_state_dict: {name}.outlier_indices holds a position >= {BLOCK} "
                         f"(largest {int(idx.max())}): not an element of its block; the file is damaged")
    if idx.shape[-1] > 1:
        s = idx.sort(-1).values
        if bool((s[..., 1:] == s[..., :-1]).any()):
            raise ValueError(f"load_state_dict: {name}.outlier_indices repeats a position within a block; "
                             "the file is damaged")


def _check_macro_scales(name: str, m: Optional[torch.Tensor]) -> None:
    """A file's macro factors must be what the quantizer writes (numerics.md section 4,
    :func:`format.macro_factor`): m = k / 128 with k an integer in [128, 256], a bf16
    value in [1, 2]. The kernels do not check them (MXTensor's doc): a negative, zero,
    NaN or infinite factor decodes differently on each backend, and any other value
    scales its macro block by a factor no quantizer chose. Either means a damaged file.
    One read of the values, at load only."""
    if m is None or m.numel() == 0:
        return
    k = m.double() * 128
    bad = ~((k >= 128) & (k <= 256) & (k == k.round()))
    if bool(bad.any()):
        first = m.flatten()[bad.flatten()][0].item()
        raise ValueError(f"load_state_dict: {name}.macro_scales holds {int(bad.sum())} value(s) that no "
                         f"quantizer writes (first {first!r}; a macro factor is k/128 for an integer k in "
                         "[128, 256]): the file is damaged")


def _what(x: Any) -> str:
    return f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def load_state_dict(state: Mapping[str, torch.Tensor]) -> dict[str, Entry]:
    """The inverse of :func:`state_dict`: names -> MXTensor (for every ``name.mx_meta``)
    or tensor (everything else), sharing the tensors' storage."""
    if not isinstance(state, Mapping):
        raise TypeError(f"load_state_dict takes a mapping of names to tensors; got {type(state).__name__}")
    for k in state:
        if not isinstance(k, str):
            raise TypeError(f"load_state_dict: names must be strings; got {k!r}")
    names = [k[: -len(META) - 1] for k in state if k.endswith("." + META)]
    taken = {f"{n}.{p}" for n in names for p in (*_PARTS, META)}
    out: dict[str, Entry] = {n: _mx_from(n, state) for n in names}
    for k, v in state.items():
        if k not in taken:
            if k in out:  # (two dicts merged by hand: the MXTensor was replaced without a word)
                raise ValueError(f"load_state_dict: {k!r} is both a tensor and the MXTensor whose parts are "
                                 f"{k}.qdata, {k}.scales, ...; rename one")
            out[k] = v
    orphans = sorted(k[: -len(".qdata")] for k in state if k.endswith(".qdata") and k not in taken
                     and _is_uint8(state[k]) and _is_uint8(state.get(k[: -len(".qdata")] + ".scales")))
    if orphans:
        shown = ", ".join(repr(n) for n in orphans[:4]) + (", ..." if len(orphans) > 4 else "")
        warnings.warn(f"load_state_dict: {len(orphans)} entr{'y' if len(orphans) == 1 else 'ies'} ({shown}) "
                      f"hold uint8 qdata and scales but no {META}: they look like MXTensors whose metadata was "
                      "lost, and are returned as plain tensors", UserWarning, stacklevel=2)
    return out


def _is_uint8(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError("saving and loading MXTensors as safetensors needs the optional safetensors package: "
                          "pip install safetensors (or \"portable_mx[hf]\")") from None
    return safetensors.torch


def _path(path: Any) -> str:
    """A file path given as a str or an ``os.PathLike`` (None and bytes were made into
    files named 'None' and "b'...'")."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise TypeError(f"path must be a non-empty str or os.PathLike; got {path!r}")
    return path


def save_safetensors(tensors: Mapping[str, Entry], path: Any, metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (names -> MXTensor or tensor) to a safetensors file at ``path``
    (a str or ``os.PathLike``)."""
    path = _path(path)
    st = _safetensors()
    st.save_file({k: v.contiguous() for k, v in state_dict(tensors).items()}, path,
                 metadata=dict(metadata) if metadata else None)


def load_safetensors(path: Any, device: Any = "cpu") -> dict[str, Entry]:
    """Read a file written by :func:`save_safetensors` at ``path`` (a str or
    ``os.PathLike``): names -> MXTensor or tensor."""
    return load_state_dict(_safetensors().load_file(_path(path), device=str(device)))
