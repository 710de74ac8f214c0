"""The config cache: tuned GEMM configs per device, as JSON validated by pydantic
(design.md, "Config cache").

One file per device, ``<arch>-<device slug>.json``, holding the schema version, device
name, arch, triton version, kernel source hash and entries keyed by (op, operand kinds,
shape bucket) -> config + measured time + the baseline it was compared with. The operand
kinds (format, macro block and outliers of each GEMM operand, e.g.
``a:e2m1/MBS-128 b:e2m1/MBS-128/OF-1``) are the part of a recipe the kernel sees; the shape
bucket is M rounded up to a power of two, N and K exact.

- Writes (:func:`record`) are atomic (temp file + rename) and merged under an exclusive
  lock on a sidecar ``.lock`` file: concurrent tuning processes lose nothing, and adding an
  entry never invalidates the others.
- A corrupt file, or one whose schema version, arch or triton version does not match, is
  ignored with one warning (per file and process). An entry whose config has a field
  this version's GemmConfig lacks (written by a newer kernel) is dropped with a warning. A different kernel source hash is
  warned about once and the entries are still used (they are configs that compiled and
  ran correctly; re-tuning refreshes them).
- Lookup order: the user cache dir (``PORTABLE_MX_CACHE_DIR``, default
  ``~/.cache/portable_mx``), then the caches shipped in the package
  (``portable_mx/tuning/configs/``), then the backend's heuristics. Files are read once
  per process into a dict; a launch-time lookup is a dict lookup (:func:`lookup`).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import re
import threading
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from . import files

SCHEMA_VERSION = 2
"""2: entries say how many configs survived static pruning and which strategy found them;
configs carry every GemmConfig field (``split_k``). Version 1 files are ignored."""
ENV_CACHE_DIR = "PORTABLE_MX_CACHE_DIR"
SHIPPED_DIR = Path(__file__).with_name("configs")
KERNEL_ENTRY_POINTS = ("gemm.py", "gemm_upcast.py")
"""The modules of ``backends/triton`` that define the GEMM kernels a config is tuned for
(``tl.dot_scaled`` and the upcast kernel)."""
KERNEL_SOURCES = ("gemm.py", "gemm_upcast.py", "layouts.py", "launch.py", "splitk.py", "upcast.py")
"""Those modules and every module of ``backends/triton`` they import (the tests check the
list against the imports): a change to any of them is a new kernel hash."""


class ConfigEntry(BaseModel):
    """One tuned config: the GemmConfig's fields, its median time, the time of the
    baseline it was compared with (the backend's default config, measured in the same
    run), the configs measured (``trials``) out of the ``survivors`` of static pruning,
    and the search ``strategy`` ("ranked", "ranked-tpe", "tpe" or "exhaustive")."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any]
    time_ms: float = Field(gt=0)
    baseline: str = "default config"
    baseline_ms: Optional[float] = Field(default=None, gt=0)
    trials: int = Field(default=0, ge=0)
    survivors: int = Field(default=0, ge=0)
    strategy: str = ""
    tuned_at: str = ""


class ConfigCache(BaseModel):
    """The JSON document of one device's cache file."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    device_name: str
    arch: str
    triton_version: str
    kernel_hash: str
    entries: dict[str, ConfigEntry] = Field(default_factory=dict)


# ----------------------------------------------------------------------------- keys


def shape_bucket(m: int, n: int, k: int) -> str:
    """M rounded up to a power of two (at least 1), N and K exact: ``"M16xN8192xK8192"``."""
    mb = 1 << max(0, int(m) - 1).bit_length()
    return f"M{mb}xN{int(n)}xK{int(k)}"


def operand_tag(fmt: str, macro_block: Optional[int] = None, outliers: int = 0) -> str:
    """``e2m1``, ``bf16``, ``e2m1/MBS-128/OF-1``: what the GEMM kernel sees of one operand."""
    parts = [fmt]
    if macro_block:
        parts.append(f"MBS-{macro_block}")
    if outliers:
        parts.append(f"OF-{outliers}")
    return "/".join(parts)


def entry_key(op: str, a_tag: str, b_tag: str, m: int, n: int, k: int) -> str:
    """``"matmul|a:e2m1 b:e2m1/MBS-128|M16xN8192xK8192"``."""
    return f"{op}|a:{a_tag} b:{b_tag}|{shape_bucket(m, n, k)}"


# ----------------------------------------------------------------------------- identity


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:  # noqa: BLE001  (a missing triton means no Triton backend)
        return "none"


@functools.lru_cache(maxsize=None)
def kernel_hash() -> str:
    """sha256 (16 hex digits) of the GEMM kernel sources a tuned config was measured with."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent / "backends" / "triton"
    for name in KERNEL_SOURCES:
        h.update((root / name).read_bytes())
    return h.hexdigest()[:16]


def slug(name: str) -> str:
    """A file-name-safe form of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def cache_dir() -> Path:
    """The user cache dir: ``PORTABLE_MX_CACHE_DIR`` or ``~/.cache/portable_mx``."""
    env = os.environ.get(ENV_CACHE_DIR, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "portable_mx"


def cache_file(arch: str, device_name: str, directory: Optional[Path] = None) -> Path:
    return Path(directory or cache_dir()) / f"{arch}-{slug(device_name)}.json"


# ----------------------------------------------------------------------------- reading

_warned: set[str] = set()


def _warn_once(path: Path, why: str) -> None:
    key = f"{path}: {why}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"portable_mx config cache {path} ignored: {why}", RuntimeWarning, stacklevel=3)


def load(path: Path, arch: str) -> Optional[ConfigCache]:
    """The cache at ``path`` if it exists and is valid for ``arch`` (and this triton),
    else None (with one warning for a corrupt or mismatched file)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as err:
        _warn_once(path, f"unreadable ({err})")
        return None
    try:
        raw = json.loads(text)
        if isinstance(raw, dict) and raw.get("schema_version") != SCHEMA_VERSION:
            _warn_once(path, f"schema version {raw.get('schema_version')!r}, expected {SCHEMA_VERSION}")
            return None
        cache = ConfigCache.model_validate(raw)
    except (ValueError, ValidationError) as err:
        _warn_once(path, f"corrupt ({type(err).__name__}: {str(err).splitlines()[0]})")
        return None
    if cache.arch != arch:
        _warn_once(path, f"written for arch {cache.arch}, this device is {arch}")
        return None
    if cache.triton_version != triton_version():
        _warn_once(path, f"written with triton {cache.triton_version}, this is triton {triton_version()}")
        return None
    unknown = {key: sorted(set(e.config) - _config_fields()) for key, e in cache.entries.items()
               if set(e.config) - _config_fields()}
    if unknown:
        for key, fields in unknown.items():
            _warn_once(path, f"entry {key!r} dropped: GemmConfig has no field {', '.join(fields)} in this version")
        cache = cache.model_copy(update={"entries": {k: e for k, e in cache.entries.items() if k not in unknown}})
    if cache.kernel_hash != kernel_hash():
        key = f"{path}: kernel"
        if key not in _warned:
            _warned.add(key)
            warnings.warn(f"portable_mx config cache {path} was tuned for another version of the GEMM "
                          "kernel source; its configs are used, re-tune to refresh them", RuntimeWarning, stacklevel=3)
    return cache


# ----------------------------------------------------------------------------- the index

_lock = threading.Lock()
_index: dict[tuple[str, str], dict[str, ConfigEntry]] = {}


def _sources(arch: str, device_name: str) -> list[Path]:
    """Cache files in lookup order: the user's, then the shipped one."""
    return [cache_file(arch, device_name), cache_file(arch, device_name, SHIPPED_DIR)]


def entries(arch: str, device_name: str) -> dict[str, ConfigEntry]:
    """Every entry valid for this device, the user cache over the shipped one; read from
    disk once per process (and again after :func:`record` or :func:`clear`)."""
    key = (arch, device_name)
    found = _index.get(key)
    if found is None:
        with _lock:
            found = {}
            for path in reversed(_sources(arch, device_name)):
                cache = load(path, arch)
                if cache is not None:
                    found.update(cache.entries)
            _index[key] = found
    return found


def lookup(arch: str, device_name: str, key: str) -> Optional[dict[str, Any]]:
    """The tuned config fields for ``key`` (:func:`entry_key`) on this device, or None."""
    entry = entries(arch, device_name).get(key)
    return None if entry is None else entry.config


def clear() -> None:
    """Forget what was read (the next lookup reads the files again) and bump
    :func:`generation`."""
    global _generation
    with _lock:
        _index.clear()
        _generation += 1


_generation = 0


def generation() -> int:
    """A counter bumped by every :func:`clear` (and so by every :func:`record`): whoever
    memoises a lookup (the GEMM launch plans) keeps the generation it read and looks up
    again when it has moved."""
    return _generation


# ----------------------------------------------------------------------------- writing


def record(
    arch: str,
    device_name: str,
    new_entries: dict[str, ConfigEntry],
    directory: Optional[Path] = None,
) -> Path:
    """Merge ``new_entries`` into this device's cache file (the user cache dir unless
    ``directory``) and return its path. Under the file's lock the current file is read
    (a corrupt or mismatched one is replaced), the entries are added (an entry with the
    same key is replaced only by a faster one), and the result is written atomically."""
    path = cache_file(arch, device_name, directory)
    with files.locked(path):
        current = load(path, arch)
        if current is None:
            current = ConfigCache(device_name=device_name, arch=arch, triton_version=triton_version(),
                                  kernel_hash=kernel_hash())
        merged = dict(current.entries)
        for key, entry in new_entries.items():
            old = merged.get(key)
            if old is None or entry.time_ms <= old.time_ms or current.kernel_hash != kernel_hash():
                merged[key] = entry
        doc = current.model_copy(update={"entries": merged, "kernel_hash": kernel_hash(),
                                         "triton_version": triton_version()})
        files.write_atomic(path, doc.model_dump_json(indent=1) + "\n")
    clear()
    return path


def make_entry(config: Any, time_ms: float, baseline_ms: Optional[float] = None, trials: int = 0,
               baseline: str = "default config", survivors: int = 0, strategy: str = "") -> ConfigEntry:
    """A :class:`ConfigEntry` for a GemmConfig (or a mapping of its fields)."""
    fields = asdict(config) if not isinstance(config, dict) else dict(config)
    fields["extra"] = [list(kv) for kv in fields.get("extra", ())]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return ConfigEntry(config=fields, time_ms=time_ms, baseline=baseline, baseline_ms=baseline_ms,
                       trials=trials, survivors=survivors, strategy=strategy, tuned_at=now)


@functools.lru_cache(maxsize=None)
def _config_fields() -> frozenset:
    """The field names of this version's GemmConfig."""
    import dataclasses

    from ..backends.triton.launch import GemmConfig

    return frozenset(f.name for f in dataclasses.fields(GemmConfig))
