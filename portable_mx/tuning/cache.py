"""The config cache: tuned GEMM configs per device, as JSON validated by pydantic
(design.md, "Config cache").

**Files.** One file per device, Triton release and schema version, in the user cache dir
(``PORTABLE_MX_CACHE_DIR``, default ``~/.cache/portable_mx``) and among the caches shipped
in the package (``portable_mx/tuning/configs/``)::

    <arch>-<device slug>.triton-<triton version>.schema-<schema version>.json
    e.g. sm_90-nvidia-h100-80gb-hbm3.triton-3.6.0.schema-2.json

A process reads and writes only the file of its own Triton release and schema, so that
processes under different releases (two virtual environments sharing one cache dir, an
upgrade) or different portable_mx schemas keep their tuned configs side by side and never
replace each other's. ``<arch>-<device slug>.json`` (the name before the release and schema
were part of it) is read too, after the file of this release, when its content is for
this arch, release and schema; it is never written, and a new file of this release starts
from its entries.

**Document.** ``{"schema_version": 2, "device_name", "arch", "triton_version",
"kernel_hash", "entries": {key: entry}}``: entries keyed by (op, operand kinds, shape
bucket) -> config + measured time + the baseline it was compared with
(:class:`ConfigEntry`). The operand kinds (format, macro block and outliers of each GEMM
operand, e.g. ``a:e2m1/MBS-128 b:e2m1/MBS-128/OF-1``; ``a:bf16/quant`` for 16-bit tokens the
kernel quantizes itself) are the part of a recipe the kernel sees; the shape bucket is M rounded up to a power of two, N exact, and K the padded K
(a multiple of 32: the K the kernel loops over; design.md says "K exact", and the padded K
is exact for every K the kernel sees: 70 and 96 launch the same loop).

**Reading** (:func:`load`, once per file and process):

- A file that cannot be used as a whole is ignored with one warning naming it: unreadable,
  not UTF-8 (a leading byte order mark is allowed), not JSON, not a cache document (a key
  outside the entries written twice, ``"entries"`` or ``"arch"`` say, is one: JSON's
  last-wins would hide the first silently), or written for another schema version, arch
  or Triton release.
- Each entry is checked on its own: its key (one a GEMM can look up, :func:`key_problem`),
  its :class:`ConfigEntry` fields, and its config
  against what the GEMM kernels can launch (``backends/triton/config_rules.py``: this
  version's GemmConfig fields, ints, power-of-two tiles, warps, ``group_m`` in 1 .. 64,
  ``split_k`` within the shape's K tiles, ...). Its numbers are checked strictly: JSON
  numbers, not ``true`` or ``"1.5"``; times finite and positive. An entry that writes a
  key twice in one of its objects (``"time_ms"``, ``"config.block_m"``) is malformed. An
  entry that fails is not used, with one warning naming the file, the entry and why; its
  shape takes the next file's entry or the backend's default config. The other entries
  are used.
- An entry key the file holds more than once: the last of its entries is used (JSON's
  rule), with one warning.
- A file whose ``device_name`` is not the device's (another name with the same
  :func:`slug`) is used (the arch is checked: its configs launch), with one warning that
  they were measured on another device.
- Entries measured with another GEMM kernel source (an entry's own ``kernel_hash``, or
  else the file's, differs from this version's :func:`kernel_hash`) are warned about once
  per file and still used (they are configs that compiled and ran correctly; re-tuning
  refreshes them).

**Writing** (:func:`record`) never deletes what it could not read. Under an exclusive
lock on a sidecar ``.lock`` file the current file is read, the new entries are merged and
the result is written atomically (temp file + fsync + rename), so concurrent tuning
processes lose nothing and adding an entry never invalidates the others.

- New entries are checked like the ones read; an invalid one is refused (ValueError).
  An entry with the same key as a readable one replaces it only when faster, or when the
  old one was measured with another kernel source. The file's ``kernel_hash`` becomes
  this version's; a carried entry measured with another one (readable or not, and one
  kept aside) gets that hash as its own ``kernel_hash``, so that re-tuning some shapes
  never makes the others look fresh.
- Entries this version cannot use (a field it lacks, written by a newer portable_mx;
  values the kernels cannot launch; a malformed entry) and top-level fields it does not
  know are carried through verbatim (an entry that writes a key twice is written back with
  both). When a new entry takes the key of such an entry, the old one is first written
  to ``<name>.replaced.json``.
- A file that cannot be used as a whole is first set aside, renamed to
  ``<name>.<why>.json`` (why: ``corrupt``, ``unreadable``, ``schema-1`` for a file of
  schema version 1, ``arch-sm_90``, ``triton-3.5.0``), then a fresh file is written;
  ``<name>`` is the file's name without ``.json``. An earlier file set aside is never
  replaced: the next one is ``<name>.<why>.2.json``, and so on.
- The entries a repeated key hid (all but its last) are first written to
  ``<name>.duplicates.json`` (one more file per further repetition).
- A file that is a symbolic link stays one: the file it points to is replaced. A cache
  dir that is a file is a NotADirectoryError naming it (``portable-mx tune`` checks
  before it searches).

**Lookup order:** the user cache dir's file of this release, its older-named file, then the
package's two, then the backend's heuristics. Files are read once per process and user
cache dir into a dict; a launch-time lookup is a dict lookup (:func:`lookup`). Pointing
``PORTABLE_MX_CACHE_DIR`` elsewhere moves :func:`generation`, so the GEMM's launch plans
are made again from the new folder's entries.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
import re
import secrets
import threading
import warnings
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._forking import in_child
from ..registry import _env_reader
from . import files

SCHEMA_VERSION = 2
"""2: entries say how many configs survived static pruning and which strategy found them;
configs carry every GemmConfig field (``split_k``). Version 1 files are ignored."""
ENV_CACHE_DIR = "PORTABLE_MX_CACHE_DIR"
SHIPPED_DIR = Path(__file__).with_name("configs")
KERNEL_ENTRY_POINTS = ("gemm.py", "gemm_upcast.py")
"""The modules of ``backends/triton`` that define the GEMM kernels a config is tuned for
(``tl.dot_scaled`` and the upcast kernel)."""
KERNEL_SOURCES = ("encode.py", "gemm.py", "gemm_upcast.py", "layouts.py", "launch.py", "numerics.py", "quantize.py",
                  "splitk.py", "upcast.py")
"""Those modules and every module of ``backends/triton`` they import (the tests check the
list against the imports): a change to any of them is a new kernel hash."""


class ConfigEntry(BaseModel):
    """One tuned config: the GemmConfig's fields, its median time, the time of the
    baseline it was compared with (the backend's default config, measured in the same
    run), the configs measured (``trials``) out of the ``survivors`` of static pruning,
    the search ``strategy`` ("ranked", "ranked-tpe", "tpe" or "exhaustive"), and the
    ``kernel_hash`` of the GEMM kernel source it was measured with where that is not the
    file's (empty: the file's ``kernel_hash``; :func:`record` writes it on the entries it
    carries over from an earlier kernel source)."""

    model_config = ConfigDict(extra="forbid")

    config: dict[str, Any]
    time_ms: float = Field(gt=0, allow_inf_nan=False)
    baseline: str = "default config"
    baseline_ms: Optional[float] = Field(default=None, gt=0, allow_inf_nan=False)
    trials: int = Field(default=0, ge=0)
    survivors: int = Field(default=0, ge=0)
    strategy: str = ""
    tuned_at: str = ""
    kernel_hash: str = ""


class ConfigCache(BaseModel):
    """The JSON document of one cache file whose every entry this version can read."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    device_name: str
    arch: str
    triton_version: str
    kernel_hash: str
    entries: dict[str, ConfigEntry] = Field(default_factory=dict)


class _Header(BaseModel):
    """A cache document's fields other than its entries (fields it does not know are
    kept)."""

    model_config = ConfigDict(extra="allow", strict=True)

    schema_version: int
    device_name: str
    arch: str
    triton_version: str
    kernel_hash: str


# ----------------------------------------------------------------------------- keys


def shape_bucket(m: int, n: int, k: int) -> str:
    """M rounded up to a power of two (at least 1), N and ``k`` as given (callers pass
    the padded K, a multiple of 32): ``"M16xN8192xK8192"``."""
    mb = 1 << max(0, int(m) - 1).bit_length()
    return f"M{mb}xN{int(n)}xK{int(k)}"


def operand_tag(fmt: str, macro_block: Optional[int] = None, outliers: int = 0, quant: bool = False) -> str:
    """``e2m1``, ``bf16``, ``e2m1/MBS-128/OF-1``: what the GEMM kernel sees of one operand;
    ``bf16/quant``: 16-bit tokens the kernel quantizes itself (the one-launch A4W4 at
    decode, ``gemm.Operand.quant``: another kernel than the W4A16 one, tuned apart),
    whatever their 16-bit format: the kernel quantizes them and multiplies bf16 values
    either way, and the tuner times it with bf16 tokens (an fp16 call had a key of its own
    that no tuning run wrote: it launched the default config)."""
    parts = ["bf16" if quant else fmt]
    if quant:
        parts.append("quant")
    if macro_block:
        parts.append(f"MBS-{macro_block}")
    if outliers:
        parts.append(f"OF-{outliers}")
    return "/".join(parts)


def entry_key(op: str, a_tag: str, b_tag: str, m: int, n: int, k: int) -> str:
    """``"matmul|a:e2m1 b:e2m1/MBS-128|M16xN8192xK8192"``."""
    return f"{op}|a:{a_tag} b:{b_tag}|{shape_bucket(m, n, k)}"


_BUCKET = re.compile(r"\|M\d+xN\d+xK(\d+)$")
_KEY = re.compile(r"(?P<op>[^|]*)\|a:(?P<a>[^ |]*) b:(?P<b>[^ |]*)\|M(?P<m>\d+)xN(?P<n>\d+)xK(?P<k>\d+)")
_PART = re.compile(r"quant|MBS-(?P<mbs>[1-9]\d*)|OF-(?P<of>[1-9]\d*)")
_LEFT_FORMATS, _RIGHT_FORMATS = ("e2m1", "bf16", "fp16"), ("e2m1",)


def key_problem(key: str) -> Optional[str]:
    """Why no GEMM can look up ``key`` (None: one can): not of :func:`entry_key`'s form,
    an op other than "matmul", operand kinds the GEMM never launches or written in another
    order than :func:`operand_tag`'s, M not a power of two, K not a multiple of 32 (the
    padded K). Such an entry would be counted as in use and never read."""
    found = _KEY.fullmatch(key) if isinstance(key, str) else None
    if found is None:
        return "the key is not of the form 'matmul|a:<kind> b:<kind>|M<m>xN<n>xK<k>'"
    if found["op"] != "matmul":
        return f"the op {found['op']!r} is not one the GEMM looks up ('matmul')"
    for side, formats in (("a", _LEFT_FORMATS), ("b", _RIGHT_FORMATS)):
        fmt, *rest = found[side].split("/")
        parts = [_PART.fullmatch(part) for part in rest]
        kinds = [part.lastgroup or part[0] for part in parts if part is not None]
        if fmt not in formats or None in parts or len(set(kinds)) != len(kinds) or (side == "b" and "quant" in kinds):
            return f"{side}:{found[side]} is no operand kind the GEMM launches"
        fields = {part.lastgroup: int(part[part.lastgroup]) for part in parts if part.lastgroup}
        canonical = operand_tag(fmt, fields.get("mbs"), fields.get("of", 0), "quant" in kinds)
        if canonical != found[side]:
            return f"{side}:{found[side]} is written {side}:{canonical} in a key the GEMM looks up"
    m, n, k = int(found["m"]), int(found["n"]), int(found["k"])
    if m < 1 or m & (m - 1) or n < 1 or k < 32 or k % 32:
        return (f"the shape M{m}xN{n}xK{k} is no bucket (M a power of two, N at least 1, K the padded K: a "
                "multiple of 32)")
    return None


def key_kp(key: str) -> Optional[int]:
    """The padded K of an :func:`entry_key` (None for a key of another form)."""
    found = _BUCKET.search(key)
    return int(found.group(1)) if found else None


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
    """A file-name-safe form of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"
    (an ASCII name: its lower-case letters and digits, each run of anything else one "-").
    A name with characters outside ASCII gets the first 8 hex digits of the sha256 of its
    UTF-8 bytes appended ("GPU α" -> "gpu-<hash>"), so that two names the ASCII form would
    make one ("GPU α", "GPU β") get files of their own."""
    out = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    if not name.isascii():
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        return f"{out}-{digest}" if out else f"device-{digest}"
    return out or "device"


def cache_dir() -> Path:
    """The user cache dir: ``PORTABLE_MX_CACHE_DIR`` or ``~/.cache/portable_mx``."""
    return _dir_of(os.environ.get(ENV_CACHE_DIR, ""))


def _dir_of(env: str) -> Path:
    """The user cache dir for the value ``env`` of ``PORTABLE_MX_CACHE_DIR``."""
    env = env.strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "portable_mx"


def _base(arch: str, device_name: str) -> str:
    return f"{arch}-{slug(device_name)}"


def cache_file(arch: str, device_name: str, directory: Optional[Path] = None) -> Path:
    """The file this process reads first and writes for the device (in the user cache dir
    unless ``directory``): ``<arch>-<device slug>.triton-<release>.schema-<n>.json``."""
    release = re.sub(r"[^A-Za-z0-9.+-]+", "_", triton_version())  # a PEP 440 version as it is
    return Path(directory or cache_dir()) / f"{_base(arch, device_name)}.triton-{release}.schema-{SCHEMA_VERSION}.json"


def legacy_file(arch: str, device_name: str, directory: Optional[Path] = None) -> Path:
    """``<arch>-<device slug>.json``, the name of the device's file before the Triton
    release and schema were part of it: read, never written."""
    return Path(directory or cache_dir()) / f"{_base(arch, device_name)}.json"


# ----------------------------------------------------------------------------- reading


@dataclass
class CacheFile:
    """One cache file as read: its top-level fields but the entries (``header``, verbatim),
    every entry verbatim (``raw``), those this version can use (``entries``) and why each
    of the others cannot be (``unreadable``)."""

    path: Path
    header: dict[str, Any]
    raw: dict[str, Any]
    entries: dict[str, ConfigEntry]
    unreadable: dict[str, str]
    duplicates: list = dataclasses.field(default_factory=list)
    """(key, value) of every entry whose key the file holds again later, in file order:
    JSON's rule (and this reader's) uses the last; :func:`record` keeps these aside."""


@dataclass(frozen=True)
class Problem:
    """Why a whole file cannot be used (``why``) and the tag of the name it is set aside
    under when it is this process's file (``tag``)."""

    why: str
    tag: str


def _errors(err: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'document'}: {e['msg']}" for e in err.errors()[:3])


def check_entry(key: str, value: Any, arch: str) -> tuple[Optional[ConfigEntry], Optional[str]]:
    """(the entry, None) when this version can use ``value`` as the entry ``key`` of a
    cache for ``arch``, else (None, why not). The fields are checked strictly: numbers are
    JSON numbers (not booleans or strings), times finite and positive, counts ints."""
    from ..backends.triton import config_rules

    try:
        entry = ConfigEntry.model_validate(value, strict=True)  # (true or "1.5" is no time)
    except ValidationError as err:
        return None, _errors(err)
    found = config_rules.problems(entry.config, arch, key_kp(key))
    unreachable = key_problem(key)
    if unreachable:
        found = [unreachable, *found]
    return (None, "; ".join(found)) if found else (entry, None)


def read(path: Path, arch: str) -> tuple[Optional[CacheFile], Optional[Problem]]:
    """(the file, None); (None, None) when there is none; (None, why) when it cannot be
    used as a whole (see the module doc). Warns about nothing (:func:`load` does)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, None
    except OSError as err:
        return None, Problem(f"unreadable ({type(err).__name__}: {err})", "unreadable")
    try:
        text = data.decode("utf-8-sig")  # (a byte order mark, as some editors save one, is no content)
    except UnicodeDecodeError as err:
        return None, Problem(f"not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})", "corrupt")
    try:
        doc = json.loads(text, object_pairs_hook=_object)
    except (ValueError, RecursionError) as err:
        return None, Problem(f"not JSON ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})",
                             "corrupt")
    if not isinstance(doc, dict):
        return None, Problem(f"not a config cache (a JSON {type(doc).__name__}, not an object)", "corrupt")
    twice = _repeat({k: v for k, v in doc.items() if k != "entries"}) or _repeat(doc, top=True)
    if twice:
        return None, Problem(f"not a config cache (the key {twice!r} is written more than once; JSON keeps "
                             "the last, which would hide the others)", "corrupt")
    version = doc.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        return None, Problem(f"not a config cache (schema_version {version!r} is not an integer)", "corrupt")
    if version != SCHEMA_VERSION:
        return None, Problem(f"schema version {version}, expected {SCHEMA_VERSION}", f"schema-{version}")
    raw = doc.get("entries", {})
    if not isinstance(raw, dict):
        return None, Problem(f"not a config cache (entries is a JSON {type(raw).__name__})", "corrupt")
    header = {k: v for k, v in doc.items() if k != "entries"}
    try:
        fields = _Header.model_validate(header)
    except ValidationError as err:
        return None, Problem(f"not a config cache ({_errors(err)})", "corrupt")
    if fields.arch != arch:
        return None, Problem(f"written for arch {fields.arch}, this device is {arch}", f"arch-{fields.arch}")
    if fields.triton_version != triton_version():
        return None, Problem(f"written with triton {fields.triton_version}, this is triton {triton_version()}",
                             f"triton-{fields.triton_version}")
    entries, unreadable = {}, {}
    for key, value in raw.items():
        entry, why = _read_entry(key, value, arch)
        if entry is None:
            unreadable[key] = why
        else:
            entries[key] = entry
    return CacheFile(path, header, dict(raw), entries, unreadable, _hidden(raw)), None


def _read_entry(key: str, value: Any, arch: str) -> tuple[Optional[ConfigEntry], Optional[str]]:
    """:func:`check_entry` of an entry as read from a file, where a key written twice in
    one of its objects (``"time_ms"``, ``"config.block_m"``) makes it unreadable too: JSON
    would keep the last value, and which one was meant is not known."""
    twice = _repeat(value)
    if twice:
        return None, f"malformed: the key {twice!r} is written more than once in it; neither value is used"
    return check_entry(key, value, arch)


class _Pairs(dict):
    """A JSON object that names a key more than once: the dict ``json`` makes of it (each
    key's last value) and, in ``pairs``, every (key, value) in file order, so that it is
    written back as it was read (:func:`_dumps`)."""

    pairs: list


def _object(pairs: list) -> dict:
    """A JSON object as ``json`` makes it (a repeated key: its last value); a
    :class:`_Pairs` when a key is repeated."""
    out = dict(pairs)
    if len(out) == len(pairs):
        return out
    found = _Pairs(out)
    found.pairs = pairs
    return found


def _repeat(value: Any, top: bool = False) -> Optional[str]:
    """The first key that ``value`` (as :func:`_object` made it) writes twice in one
    object, as a dotted path from ``value`` (``"config.block_m"``); None when there is none.
    ``top``: look at ``value``'s own keys only, not into its values."""
    if isinstance(value, _Pairs):
        seen = set()
        for key, _ in value.pairs:
            if key in seen:
                return key
            seen.add(key)
    if top:
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = _repeat(item)
        if inner:
            return f"{key}.{inner}"
    return None


def _hidden(value: Any) -> list:
    """(key, value) of every pair of an object that a later pair with the same key hides
    (JSON's rule uses the last), in file order; [] for an object without repeated keys."""
    if not isinstance(value, _Pairs):
        return []
    last = {key: i for i, (key, _) in enumerate(value.pairs)}
    return [(key, item) for i, (key, item) in enumerate(value.pairs) if last[key] != i]


def _newer(value: Any) -> bool:
    """Whether the entry ``value`` names an entry field or a GemmConfig field this version
    lacks: maybe written by a newer portable_mx, rather than malformed."""
    from ..backends.triton.launch import GemmConfig

    if not isinstance(value, dict):
        return False
    config = value.get("config")
    return bool(set(value) - set(ConfigEntry.model_fields)) or \
        (isinstance(config, dict) and bool(set(config) - {f.name for f in dataclasses.fields(GemmConfig)}))


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def load(path: Path, arch: str, quiet_mismatch: bool = False, written_here: bool = False,
         device_name: Optional[str] = None) -> Optional[CacheFile]:
    """The file at ``path`` if it exists and can be used for ``arch`` (and this Triton),
    else None. Warns once per process about a file that cannot be used (not about one
    written for another schema, arch or release when ``quiet_mismatch``; saying that
    tuning replaces it when ``written_here``, the user's file of this release), about each
    entry that cannot, about another kernel source hash, and about a file tuned on a
    device whose name is not ``device_name`` (exact string comparison; given)."""
    path = Path(path)
    cache, problem = read(path, arch)
    if problem is not None:
        mismatch = problem.tag not in ("corrupt", "unreadable")
        if not (quiet_mismatch and mismatch):
            repair = ""
            if written_here:
                repair = (f"; the next tuning run on this device sets it aside as "
                          f"{files.aside_path(path, problem.tag).name} and writes a new file")
            _warn_once(f"{path}: {problem.why}",
                       f"portable_mx config cache {path} ignored: {problem.why}; default configs are used{repair}")
        return None
    if cache is None:
        return None
    for key in dict.fromkeys(key for key, _ in cache.duplicates):
        _warn_once(f"{path}: {key}: repeated",
                   f"portable_mx config cache {path}: entry {key!r} appears more than once; the last one is used "
                   f"(the next tuning run on this device keeps the others in "
                   f"{files.aside_path(path, 'duplicates').name})")
    for key, why in cache.unreadable.items():
        _warn_once(f"{path}: {key}: {why}",
                   f"portable_mx config cache {path}: entry {key!r} ignored ({why}); that shape uses the next cache "
                   "file's entry or the default config. Re-tune it (portable-mx tune) or correct the entry; "
                   "the entry is kept in the file as it is")
    tuned_on = cache.header.get("device_name")
    if device_name is not None and tuned_on != device_name:
        _warn_once(f"{path}: device {tuned_on!r} {device_name!r}",
                   f"portable_mx config cache {path} was tuned on {tuned_on!r}, not on this device "
                   f"{device_name!r} (their names make one file name); its configs are used (they launch: the "
                   "arch is checked) but may not be the fastest here. Re-tune on this device to refresh them (a file "
                   "names the last device that recorded into it), or give each device its own PORTABLE_MX_CACHE_DIR")
    stale = stale_keys(cache)
    if stale:
        _warn_once(f"{path}: kernel: {len(stale)}",
                   f"portable_mx config cache {path}: {len(stale)} of its {len(cache.entries)} entries were tuned "
                   "for another version of the GEMM kernel source; their configs are used, re-tune to refresh them")
    return cache


def measured_with(entry: ConfigEntry, header: dict[str, Any]) -> Any:
    """The kernel source hash ``entry`` was measured with: its own, else its file's."""
    return entry.kernel_hash or header.get("kernel_hash")


def stale_keys(cache: CacheFile) -> list[str]:
    """The keys of the usable entries of ``cache`` measured with another GEMM kernel
    source than this version's."""
    current = kernel_hash()
    return [key for key, entry in cache.entries.items() if measured_with(entry, cache.header) != current]


# ----------------------------------------------------------------------------- the index

_lock = threading.Lock()
_index: dict[tuple[str, str, str], dict[str, ConfigEntry]] = {}


@in_child
def _renew_after_fork() -> None:
    global _lock
    _lock = threading.Lock()  # (one another thread held at the fork would stay held in the child)


def _sources(arch: str, device_name: str, user_dir: Optional[Path] = None) -> list[Path]:
    """Cache files in lookup order: the user's (in ``user_dir``, default
    :func:`cache_dir`), then the shipped ones (each dir: the file of this Triton release
    and schema, then the older-named one)."""
    dirs = (user_dir or cache_dir(), SHIPPED_DIR)
    return [fn(arch, device_name, d) for d in dirs for fn in (cache_file, legacy_file)]


def other_files(arch: str, device_name: str, directory: Optional[Path] = None) -> list[Path]:
    """The device's files in ``directory`` (the user cache dir) that this process does
    not read: those of other Triton releases or schemas, and files set aside."""
    directory = Path(directory or cache_dir())
    own = {cache_file(arch, device_name, directory), legacy_file(arch, device_name, directory)}
    try:
        found = sorted(directory.glob(f"{_base(arch, device_name)}.*.json"))
    except OSError:
        return []
    return [p for p in found if p not in own]


def _exists(path: Path) -> bool:
    """Whether ``path`` exists; False where the process may not look (a folder it cannot
    search, such as another user's home in a container run under another uid: Python
    before 3.12 raises PermissionError there, and every GEMM on a Triton backend raised it;
    the default configs serve instead)."""
    try:
        return path.exists()
    except OSError:
        return False


def entries(arch: str, device_name: str) -> dict[str, ConfigEntry]:
    """Every entry valid for this device, the user cache over the shipped one; read from
    disk once per process and user cache dir (and again after :func:`record` or
    :func:`clear`): pointing ``PORTABLE_MX_CACHE_DIR`` elsewhere reads that folder."""
    env = os.environ.get(ENV_CACHE_DIR, "")
    key = (arch, device_name, env)
    found = _index.get(key)
    if found is None:
        with _lock:
            found = {}
            # the files of the folder the key names (one read of the variable: a thread that
            # changed it in between had the other folder's entries stored under this key)
            sources = _sources(arch, device_name, _dir_of(env))
            for path in reversed(sources):
                # an older-named file of another release is expected beside this release's file
                quiet = path.name == legacy_file(arch, device_name).name and \
                    _exists(cache_file(arch, device_name, path.parent))
                cache = load(path, arch, quiet_mismatch=quiet, written_here=path == sources[0],
                             device_name=device_name)
                if cache is not None:
                    found.update(cache.entries)
            if not any(_exists(p) for p in sources[:2]):
                _note_other_releases(arch, device_name)
            if not any(_exists(p) for p in sources):  # (a shipped file of another release alone)
                _note_other_releases(arch, device_name, shipped=True)
            _index[key] = found
    return found


def _other_release(arch: str, device_name: str) -> re.Pattern:
    """Matches the names of the device's files of any Triton release and schema (groups:
    the release, the schema version); files set aside have a longer name."""
    return re.compile(re.escape(_base(arch, device_name)) + r"\.triton-([A-Za-z0-9.+_-]+?)\.schema-(\d+)\.json$")


def _note_other_releases(arch: str, device_name: str, shipped: bool = False) -> None:
    """One warning when the user cache dir (``shipped``: the package's configs) holds this
    device's configs only for other Triton releases or schemas (an upgrade: they are kept,
    not read)."""
    pattern = _other_release(arch, device_name)
    directory = SHIPPED_DIR if shipped else cache_dir()
    others = [p.name for p in other_files(arch, device_name, directory) if pattern.match(p.name)]
    if others and shipped:
        _warn_once(f"{directory}: {arch} {device_name}: others",
                   f"portable_mx config cache: no tuned configs for {arch} {device_name} under triton "
                   f"{triton_version()} (schema {SCHEMA_VERSION}); the package ships them for other releases "
                   f"({', '.join(others)}), not read: the GEMMs use their default configs. `portable-mx tune` on "
                   "this release writes configs of its own")
    elif others:
        _warn_once(f"{directory}: {arch} {device_name}: others",
                   f"portable_mx config cache: no tuned configs for {arch} {device_name} under triton "
                   f"{triton_version()} (schema {SCHEMA_VERSION}) in {directory}; the files of other releases "
                   f"there ({', '.join(others)}) are kept, not read. Re-tune on this release to use tuned configs")


def lookup(arch: str, device_name: str, key: str) -> Optional[dict[str, Any]]:
    """The tuned config fields for ``key`` (:func:`entry_key`) on this device, or None.
    They passed ``backends/triton/config_rules.py``: ``GemmConfig(**fields)`` (``extra``
    as tuples) launches."""
    entry = entries(arch, device_name).get(key)
    return None if entry is None else entry.config


def file_report(arch: str, device_name: str) -> list[dict[str, Any]]:
    """Per cache file of this device (the lookup order, then the user dir's and the
    shipped dir's files not read): ``{"file", "entries" (used), "unreadable" (entries kept, not used), "why"}``;
    ``why`` is empty for a file in use."""
    out = []
    for path in _sources(arch, device_name):
        if not _exists(path):
            continue
        cache, problem = read(path, arch)
        if cache is None:
            out.append({"file": str(path), "entries": 0, "unreadable": 0,
                        "why": f"ignored: {problem.why if problem else 'unreadable'}"})
        else:
            notes = []
            newer = sum(_newer(cache.raw[key]) for key in cache.unreadable)
            if len(cache.unreadable) > newer:
                notes.append(f"{len(cache.unreadable) - newer} entries malformed, not launchable or under keys no GEMM looks up, not used, kept")
            if newer:
                notes.append(f"{newer} entries not readable by this version (fields it lacks), kept")
            if cache.header.get("device_name") != device_name:
                notes.append(f"tuned on {cache.header.get('device_name')!r}")
            stale = stale_keys(cache)
            if stale:
                notes.append(f"{len(stale)} entries tuned for another kernel source, used; re-tune to refresh")
            why = "; ".join(notes)
            out.append({"file": str(path), "entries": len(cache.entries), "unreadable": len(cache.unreadable),
                        "why": why})
    release = _other_release(arch, device_name)
    for path in other_files(arch, device_name):
        found = release.match(path.name)
        why = (f"not read: for triton {found.group(1)}, schema {found.group(2)}" if found
               else "not read: set aside")
        out.append({"file": str(path), "entries": 0, "unreadable": 0, "why": why})
    for path in other_files(arch, device_name, SHIPPED_DIR):  # (shipped for another release)
        found = release.match(path.name)
        if found:
            out.append({"file": str(path), "entries": 0, "unreadable": 0,
                        "why": f"not read: shipped for triton {found.group(1)}, schema {found.group(2)}"})
    return out


def clear() -> None:
    """Forget what was read (the next lookup reads the files again) and bump
    :func:`generation`."""
    global _generation
    with _lock:
        _index.clear()
        _generation += 1


_cache_dir = _env_reader(ENV_CACHE_DIR)
"""``PORTABLE_MX_CACHE_DIR`` as ``os.environ`` holds it, read without decoding it
(registry's reader: ~50 ns, where ``os.environ.get`` takes ~500 ns on every GEMM,
:func:`generation`). It changes exactly when the text the index is keyed by changes."""

_generation = 0
_generation_dir = _cache_dir()
"""``PORTABLE_MX_CACHE_DIR`` as :func:`generation` last saw it."""


def generation() -> int:
    """A counter bumped by every :func:`clear` (and so by every :func:`record`), and by
    the first call that finds ``PORTABLE_MX_CACHE_DIR`` (the text the index is keyed by)
    changed since the call before: whoever memoises a lookup (the GEMM launch plans)
    keeps the generation it read and looks up again when it has moved."""
    global _generation, _generation_dir
    directory = _cache_dir()
    if directory != _generation_dir:
        with _lock:
            if directory != _generation_dir:
                _generation_dir = directory
                _generation += 1
    return _generation


# ----------------------------------------------------------------------------- writing


def _document(header: dict[str, Any], entries: dict[str, Any]) -> str:
    return _dumps({**header, "entries": entries}) + "\n"


def _dumps(value: Any, indent: Optional[int] = 1) -> str:
    """``json.dumps(value, indent=indent)``, where a :class:`_Pairs` (an object read with
    a repeated key) is written with every pair it was read with, in their order (on one
    line): an entry carried through verbatim keeps all its values."""
    marks: dict[str, _Pairs] = {}
    nonce = secrets.token_hex(8)

    def swap(item: Any) -> Any:
        if isinstance(item, _Pairs):
            mark = f"\x00pairs-{nonce}-{len(marks)}"
            marks[mark] = item
            return mark
        if isinstance(item, dict):
            return {k: swap(v) for k, v in item.items()}
        if isinstance(item, list):
            return [swap(v) for v in item]
        return item

    text = json.dumps(swap(value), indent=indent)
    for mark, item in marks.items():
        pairs = ", ".join(f"{json.dumps(key)}: {_dumps(v, None)}" for key, v in item.pairs)
        text = text.replace(json.dumps(mark), "{" + pairs + "}", 1)
    return text


def _stamped(value: Any, file_hash: Any) -> Any:
    """An entry carried over from a file whose ``kernel_hash`` is ``file_hash``, with that
    hash as its own ``kernel_hash`` where it names none (no such key, or ``""``: the
    file's); a value that is no JSON object, or names a hash, is returned as it is."""
    if not isinstance(value, dict) or value.get("kernel_hash", "") != "":
        return value
    if isinstance(value, _Pairs):
        pairs = [(k, file_hash if k == "kernel_hash" else v) for k, v in value.pairs]
        out = _Pairs({**value, "kernel_hash": file_hash})
        out.pairs = pairs if "kernel_hash" in value else [*pairs, ("kernel_hash", file_hash)]
        return out
    return {**value, "kernel_hash": file_hash}


class Recorded(NamedTuple):
    """What :func:`record` did: the file (``path``), the keys whose new entry it wrote
    (``written``), and the existing entries it kept instead of a slower new one, by key
    (``kept``)."""

    path: Path
    written: tuple[str, ...]
    kept: dict[str, ConfigEntry]


def record(
    arch: str,
    device_name: str,
    new_entries: dict[str, ConfigEntry],
    directory: Optional[Path] = None,
    *,
    replace: bool = False,
) -> Recorded:
    """Merge ``new_entries`` into this device's file of this Triton release
    (:func:`cache_file`, in the user cache dir unless ``directory``) and say what it did
    (:class:`Recorded`). ``replace``: write every new entry, even over a faster one.

    Each new entry must pass :func:`check_entry` (ValueError naming it otherwise). Under
    the file's lock the current file is read; one that cannot be used as a whole is set
    aside first (``<name>.<why>.json``, never replacing an earlier one); a file that does
    not exist yet starts from the older-named file's entries. The new entries are added
    (an entry with the same key is replaced only by a faster one, by any with ``replace``, or by any after the
    kernel source changed; one this version cannot read is replaced and kept in
    ``<name>.replaced.json``), every other entry and unknown field is carried through
    verbatim, and the result is written atomically."""
    path = cache_file(arch, device_name, directory)
    checked = {}
    for key, entry in new_entries.items():
        good, why = check_entry(key, entry.model_dump(mode="json") if isinstance(entry, ConfigEntry) else entry, arch)
        if good is None:
            raise ValueError(f"config cache entry {key!r} for {arch} not recorded: {why}")
        checked[key] = good
    with files.locked(path):
        current, problem = read(path, arch)
        if problem is not None:
            aside = files.set_aside(path, problem.tag)
            warnings.warn(f"portable_mx config cache {path} set aside as {aside.name} ({problem.why}); "
                          "a new file is written in its place", RuntimeWarning, stacklevel=2)
        if current is None:
            current, _ = read(legacy_file(arch, device_name, directory), arch)
        if current is None:
            current = CacheFile(path, {"device_name": device_name}, {}, {}, {})
        now, file_hash = kernel_hash(), current.header.get("kernel_hash")
        old_hash = file_hash if isinstance(file_hash, str) and file_hash != now else None
        out, replaced, written, kept = dict(current.raw), {}, [], {}
        for key in stale_keys(current):  # carried over: keep the hash they were measured with
            if not current.entries[key].kernel_hash and isinstance(out[key], dict):
                out[key] = {**out[key], "kernel_hash": str(file_hash)}
        if old_hash:  # those it cannot read too (they are not the new kernel source's)
            out.update({key: _stamped(out[key], old_hash) for key in current.unreadable})
        for key, entry in checked.items():
            old = current.entries.get(key)
            if key in current.unreadable:
                replaced[key] = out[key]
            elif old is not None and not (replace or entry.time_ms <= old.time_ms
                                          or measured_with(old, current.header) != now):
                kept[key] = old
                continue
            written.append(key)
            fields = entry.model_dump(mode="json")
            if fields["kernel_hash"] in ("", now):
                fields.pop("kernel_hash")  # (the file's)
            out[key] = fields
        header = {"schema_version": SCHEMA_VERSION, "device_name": device_name,  # the last device to record
                  "arch": arch, "triton_version": triton_version(), "kernel_hash": now}
        header.update({k: v for k, v in current.header.items() if k not in header})
        hidden = [(key, _stamped(value, old_hash) if old_hash else value) for key, value in current.duplicates] \
            if current.path == path else []
        while hidden:  # the values a repeated key hid, one file per repetition (a JSON object holds one)
            batch, rest = {}, []
            for key, value in hidden:
                if key in batch:
                    rest.append((key, value))
                else:
                    batch[key] = value
            hidden = rest
            aside = files.write_aside(path, "duplicates", _document(header, batch))
            warnings.warn(f"portable_mx config cache {path}: entries {', '.join(map(repr, batch))} appeared more "
                          f"than once; the earlier ones, which JSON's last-wins rule hid, are kept in {aside.name}",
                          RuntimeWarning, stacklevel=2)
        if replaced:
            aside = files.write_aside(path, "replaced", _document(header, replaced))
            warnings.warn(f"portable_mx config cache {path}: entries {', '.join(map(repr, replaced))}, which this "
                          f"version cannot read, were replaced by new tuning; the old ones are kept in {aside.name}",
                          RuntimeWarning, stacklevel=2)
        files.write_atomic(path, _document(header, out))
    clear()
    return Recorded(path, tuple(written), kept)


def make_entry(config: Any, time_ms: float, baseline_ms: Optional[float] = None, trials: int = 0,
               baseline: str = "default config", survivors: int = 0, strategy: str = "") -> ConfigEntry:
    """A :class:`ConfigEntry` for a GemmConfig (or a mapping of its fields)."""
    fields = asdict(config) if not isinstance(config, dict) else dict(config)
    fields["extra"] = [list(kv) for kv in fields.get("extra", ())]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return ConfigEntry(config=fields, time_ms=time_ms, baseline=baseline, baseline_ms=baseline_ms,
                       trials=trials, survivors=survivors, strategy=strategy, tuned_at=now)
