"""The config cache keeps what it cannot read, and never launches a config the kernels
cannot run (issue 25, items 2 and 5, and its unclear errors about caches).

- ``record`` carries entries this version cannot use through verbatim (a field of a newer
  portable_mx, a malformed entry, values the kernels cannot launch), keeps the files of
  other Triton releases, sets a file it cannot use aside under a name that says why
  (never replacing an earlier one), and merges concurrent writers;
- a tuned config the kernels cannot launch (negative or non-power-of-two tiles, zero
  warps, ``group_m`` 0, strings, ``split_k`` out of range), in the user's cache or in a
  shipped one, is not used: one warning names the file and the entry, and the GEMM
  launches the default config and returns the right product (float64 of the dequantized
  operands);
- a cache file that is not UTF-8 is a warning naming it (the GEMM and ``portable-mx
  info`` go on), and re-tuning sets it aside and writes a fresh file.

Reference values are the files' own bytes and a float64 product, never the cache code.
"""

import dataclasses
import json
import multiprocessing
import warnings
from pathlib import Path

import pytest
import torch

from portable_mx import cli, registry
from portable_mx.backends.reference import ReferenceBackend
from portable_mx.backends.targets import TARGETS
from portable_mx.backends.triton import config_rules
from portable_mx.backends.triton.launch import GemmConfig
from portable_mx.recipe import QuantRecipe
from portable_mx.tuning import cache
from portable_mx.tuning.space import config_to_json, gemm_space

from conftest import NEEDS_TRITON, assert_second_waits_for_first

# The GEMM's operands (Operand) are defined beside the GEMM kernels, which import triton.
pytest.importorskip("triton", reason=f"tests/test_config_cache.py {NEEDS_TRITON}")
from portable_mx.backends.triton.gemm import Operand  # noqa: E402

CPU = torch.device("cpu")
INTERPRET = registry.get("triton-interpret")
REF = ReferenceBackend()
MX = Operand(None, None, 0)
KEY = cache.entry_key("matmul", "e2m1", "e2m1", 32, 64, 128)
_NO_GEMM = INTERPRET.op_problem("matmul") or INTERPRET.unavailable_reason(CPU)
interpreted = pytest.mark.skipif(_NO_GEMM is not None, reason=f"the interpreter does not run the GEMM here: {_NO_GEMM}")


@pytest.fixture(autouse=True)
def cache_env(tmp_path, monkeypatch):
    """An empty user cache dir of this test's own, and no shipped caches."""
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "SHIPPED_DIR", tmp_path / "shipped")
    cache.clear()
    yield tmp_path / "cache"
    cache.clear()


def _entry(config: GemmConfig = GemmConfig(16, 32, 64, group_m=1), ms: float = 1.0) -> dict:
    """An entry as a cache file holds it."""
    return cache.make_entry(config, ms).model_dump(mode="json")


def _fields(**changes) -> dict:
    """GemmConfig fields as JSON, with ``changes`` (which may break them)."""
    d = dataclasses.asdict(GemmConfig(16, 16, 32, group_m=1))
    d["extra"] = []
    d.update(changes)
    return d


def _doc(entries: dict, **header) -> dict:
    doc = {"schema_version": 2, "device_name": "cpu", "arch": "interpret", "triton_version": cache.triton_version(),
           "kernel_hash": cache.kernel_hash()}
    doc.update(header)
    doc["entries"] = entries
    return doc


def _write(path: Path, doc) -> bytes:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught]


def _info_rows(monkeypatch) -> list[dict]:
    """The config-cache rows of ``portable-mx info`` for the CPU (where the interpreter
    serves the GEMM; else what info would list, ``cache.file_report``)."""
    if _NO_GEMM is not None:
        return cache.file_report("interpret", "cpu")
    monkeypatch.setenv(registry.ENV_BACKEND, "triton-interpret")
    return cli._config_caches([CPU])


# ----------------------------------------------------------------------------- nothing deleted


def test_record_carries_entries_this_version_cannot_read_verbatim():
    """One file holds a good entry, an entry of a newer portable_mx (a config field this
    version lacks), a malformed entry (time_ms -1), one the kernels cannot launch (block_m
    -16) and a top-level field this version does not know: recording a new shape keeps
    every one of them byte for byte (the old code dropped the newer entry, and called the
    whole file corrupt and rewrote it without any of them)."""
    path = cache.cache_file("interpret", "cpu")
    newer = {**_entry(), "config": {**_entry()["config"], "persistent": 1}}
    malformed = {**_entry(), "time_ms": -1}
    unlaunchable = {**_entry(), "config": _fields(block_m=-16)}
    good_key, newer_key, bad_key, worse_key = (cache.entry_key("matmul", "e2m1", "e2m1", 32, n, 128) for n in
                                               (16, 32, 48, 80))
    original = _doc({good_key: _entry(), newer_key: newer, bad_key: malformed, worse_key: unlaunchable},
                    written_by="a newer portable_mx")
    _write(path, original)
    new = {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}
    _caught(lambda: cache.record("interpret", "cpu", new))
    doc = json.loads(path.read_text())
    for key, value in original["entries"].items():
        assert doc["entries"][key] == value, key
    assert doc["written_by"] == "a newer portable_mx"
    assert doc["entries"][KEY]["config"]["block_m"] == 32
    cache.clear()
    _, messages = _caught(lambda: [cache.lookup("interpret", "cpu", k) for k in (newer_key, bad_key, worse_key)])
    assert cache.lookup("interpret", "cpu", good_key)["block_n"] == 32
    assert cache.lookup("interpret", "cpu", KEY)["block_m"] == 32
    assert all(cache.lookup("interpret", "cpu", k) is None for k in (newer_key, bad_key, worse_key))
    for key, why in ((newer_key, "persistent"), (bad_key, "time_ms"), (worse_key, "block_m -16")):
        assert [m for m in messages if repr(key) in m and why in m and str(path) in m], (key, messages)


def test_record_keeps_the_files_of_other_triton_releases(cache_env):
    """A file written under another Triton release, at the name every version so far wrote
    (``<arch>-<device>.json``), is left byte for byte as it was when this release records
    its own configs (the old code replaced it: every shape tuned there was gone)."""
    legacy = cache_env / "interpret-cpu.json"
    before = _write(legacy, _doc({KEY: _entry()}, triton_version="3.5.0"))
    cache.clear()
    _, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert any(str(legacy) in m and "3.5.0" in m for m in messages)  # ignored, with a warning
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}))
    assert legacy.read_bytes() == before
    assert cache.lookup("interpret", "cpu", KEY)["block_m"] == 32
    assert cache.cache_file("interpret", "cpu") != legacy


def test_files_written_by_the_previous_version_are_still_read_and_never_written(cache_env):
    """``<arch>-<device>.json`` of this release and schema (what portable_mx wrote until
    now) is read; a new file of this release starts from its entries; it is not touched."""
    legacy = cache_env / "interpret-cpu.json"
    old_key = cache.entry_key("matmul", "bf16", "e2m1", 8, 64, 128)
    before = _write(legacy, _doc({old_key: _entry(GemmConfig(16, 64, 64))}))
    assert cache.lookup("interpret", "cpu", old_key)["block_n"] == 64
    path = cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}).path
    assert legacy.read_bytes() == before
    assert set(json.loads(path.read_text())["entries"]) == {old_key, KEY}
    assert cache.lookup("interpret", "cpu", old_key)["block_n"] == 64


def test_the_files_of_another_release_are_named_when_none_is_for_this_one(cache_env, monkeypatch):
    """After a Triton upgrade the old release's file is not read (its configs were
    measured with other compiled code): one warning names it, and info lists it."""
    other = cache_env / "interpret-cpu.triton-0.0.1.schema-2.json"
    _write(other, _doc({KEY: _entry()}, triton_version="0.0.1"))
    found, messages = _caught(lambda: (cache.lookup("interpret", "cpu", KEY), cache.lookup("interpret", "cpu", KEY)))
    assert found == (None, None)
    assert len([m for m in messages if other.name in m and "kept" in m]) == 1
    rows = [r for r in _info_rows(monkeypatch) if r["file"] == str(other)]
    assert len(rows) == 1 and "triton 0.0.1" in rows[0]["why"]


def test_shipped_files_of_another_release_are_named_when_nothing_is_read(cache_env, monkeypatch):
    """A package whose shipped configs are for another Triton release than the user's: the
    GEMMs used their defaults without a word, and info did not list the file (the user
    cache dir's files of other releases were named). Now one warning names it, and info
    lists it; once a file of this release is read, no warning."""
    shipped = cache.SHIPPED_DIR / "interpret-cpu.triton-0.0.1.schema-2.json"
    _write(shipped, _doc({KEY: _entry()}, triton_version="0.0.1"))
    found, messages = _caught(lambda: (cache.lookup("interpret", "cpu", KEY), cache.lookup("interpret", "cpu", KEY)))
    assert found == (None, None)
    assert len([m for m in messages if shipped.name in m and "ships them for other releases" in m]) == 1, messages
    rows = [r for r in _info_rows(monkeypatch) if r["file"] == str(shipped)]
    assert len(rows) == 1 and "shipped for triton 0.0.1" in rows[0]["why"], rows
    cache.clear()
    cache._warned.clear()
    _write(cache.cache_file("interpret", "cpu"), _doc({KEY: _entry()}))
    found, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert found is not None and not [m for m in messages if shipped.name in m]


@pytest.mark.parametrize("content, why", [
    (b"{not json", "corrupt"),
    (json.dumps(_doc({KEY: {"config": {}, "time_ms": 1.0}}, triton_version="0.0.1")).encode(), "triton-0.0.1"),
    (json.dumps(_doc({}, arch="sm_90")).encode(), "arch-sm_90"),
])
def test_a_file_that_cannot_be_used_is_set_aside_never_over_an_earlier_one(content, why):
    """Each time record() finds a file it cannot use in its place it renames it to
    ``<name>.<why>.json``, then ``<name>.<why>.2.json``: both kept byte for byte."""
    path = cache.cache_file("interpret", "cpu")
    second = content.replace(b"{", b"{ ", 1)
    for data in (content, second):
        _write(path, data)
        cache.clear()
        new = {KEY: cache.make_entry(GemmConfig(16, 32, 64), 2.0)}
        _, messages = _caught(lambda: cache.record("interpret", "cpu", new))
        assert any("set aside" in m and str(path) in m for m in messages)
    stem = path.name[:-len(".json")]
    assert path.with_name(f"{stem}.{why}.json").read_bytes() == content
    assert path.with_name(f"{stem}.{why}.2.json").read_bytes() == second
    assert cache.lookup("interpret", "cpu", KEY)["block_n"] == 32


def test_an_unreadable_entry_replaced_by_new_tuning_is_kept_aside():
    """Re-tuning a shape whose entry this version cannot read replaces it, and the old
    entry goes to ``<name>.replaced.json`` verbatim."""
    path = cache.cache_file("interpret", "cpu")
    old = {**_entry(), "config": _fields(block_m=-16)}
    _write(path, _doc({KEY: old}))
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 5.0)}))
    assert cache.lookup("interpret", "cpu", KEY)["block_m"] == 32
    aside = json.loads(path.with_name(path.name[:-len(".json")] + ".replaced.json").read_text())
    assert aside["entries"] == {KEY: old}


def _record_some(args):
    directory, worker, count = args
    for i in range(count):
        cache.record("sm_100", "NVIDIA B200", {f"matmul|a:e2m1 b:e2m1|M{2 ** worker}xN{i + 1}xK1024":
                                               cache.make_entry(GemmConfig(128, 64, 128), 1.0 + i)},
                     directory=Path(directory))
    return worker


def test_concurrent_writers_keep_an_entry_of_a_newer_version(tmp_path):
    """Three processes record four shapes each into a file that holds an entry of a newer
    portable_mx: all twelve and the newer entry are there at the end."""
    path = cache.cache_file("sm_100", "NVIDIA B200", tmp_path)
    newer = {**_entry(GemmConfig(128, 64, 128)), "config": {**_entry()["config"], "persistent": 1}}
    _write(path, _doc({"matmul|a:bf16 b:e2m1|M1xN1xK1024": newer}, arch="sm_100", device_name="NVIDIA B200"))
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with ctx.Pool(3) as pool:
            assert sorted(pool.map(_record_some, [(str(tmp_path), w, 4) for w in range(3)])) == [0, 1, 2]
    doc = json.loads(path.read_text())
    assert len(doc["entries"]) == 13 and doc["entries"]["matmul|a:bf16 b:e2m1|M1xN1xK1024"] == newer


DEAD_KEYS = ["matmul|a:e2m1 b:e2m1|M10xN64xK256", "matmul|a:e2m1 b:e2m1|M16xN64xK70",
             "matmul|a:e2m1 b:e2m1/OF-1/MBS-128|M16xN64xK256", "mm|a:e2m1 b:e2m1|M16xN64xK256", "garbage",
             "matmul|a:e2m1 b:bf16|M16xN64xK256", "matmul|a:fp8 b:e2m1|M16xN64xK256", "matmul|a:e2m1 b:e2m1|M0xN64xK256",
             "matmul|a:e2m1 b:e2m1|M16xN0xK256"]


def test_entries_no_gemm_can_look_up_are_not_counted_as_in_use():
    """Keys no lookup can match (M not a power of two, K not padded, operand kinds in
    another order or that no GEMM launches, another op, no key at all) were read, counted
    by info as entries in use and never used, without a word. Now each is not used with a
    warning naming it, record refuses them, and every key a GEMM builds passes."""
    for tags in [("e2m1", "e2m1"), ("bf16", "e2m1"), ("fp16", "e2m1/MBS-64"), ("bf16/quant", "e2m1/MBS-128/OF-2"),
                 ("e2m1/MBS-128/OF-1", "e2m1/OF-1")]:
        for m, n, k in [(1, 1, 32), (3, 64, 96), (16, 8192, 8192), (300, 5, 2880)]:
            key = cache.entry_key("matmul", *tags, m, n, -(-k // 32) * 32)
            assert cache.key_problem(key) is None, key
    path = cache.cache_file("interpret", "cpu")
    _write(path, _doc({key: _entry() for key in [KEY, *DEAD_KEYS]}))
    found, messages = _caught(lambda: cache.entries("interpret", "cpu"))
    assert list(found) == [KEY]
    for key in DEAD_KEYS:
        assert len([m for m in messages if repr(key) in m]) == 1, (key, messages)
        with pytest.raises(ValueError, match="not recorded"):
            cache.record("interpret", "cpu", {key: cache.make_entry(GemmConfig(16, 32, 64), 2.0)})
    assert "is written b:e2m1/MBS-128/OF-1" in cache.key_problem(DEAD_KEYS[2])


def test_record_refuses_an_entry_the_kernels_cannot_launch():
    path = cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(16, 32, 64), 2.0)}).path
    before = path.read_bytes()
    with pytest.raises(ValueError, match=r"not recorded: .*block_n 24 is not a positive power of two"):
        cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(16, 24, 64), 1.0)})
    assert path.read_bytes() == before


# ----------------------------------------------------------------------------- unclear errors


def test_a_cache_file_that_is_not_utf8_is_a_warning_then_set_aside(cache_env, monkeypatch):
    """Bytes that are not UTF-8: the config lookup of every GEMM on the device and
    ``portable-mx info`` used to die with a bare UnicodeDecodeError, and re-tuning could not
    repair it. Now: one warning naming the file, the default config, the file listed by
    info; re-tuning sets it aside (kept byte for byte) and writes a fresh file."""
    path = cache.cache_file("interpret", "cpu")
    garbage = _write(path, b'{"schema_version": 2, "device_name": "\xff\xfe"}')
    a, b = REF.quantize(torch.randn(32, 128), QuantRecipe()), REF.quantize(torch.randn(64, 128), QuantRecipe())
    config, messages = _caught(lambda: INTERPRET.gemm_config(CPU, Operand.of(a), Operand.of(b), 32, 64, 128))
    assert config == INTERPRET.default_gemm_config(None, 32, None, False)
    assert [m for m in messages if str(path) in m and "UTF-8" in m]
    rows = [r for r in _info_rows(monkeypatch) if r["file"] == str(path)]
    assert len(rows) == 1 and rows[0]["entries"] == 0 and "UTF-8" in rows[0]["why"]
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(16, 32, 64), 2.0)}))
    assert path.with_name(path.name[:-len(".json")] + ".corrupt.json").read_bytes() == garbage
    assert cache.lookup("interpret", "cpu", KEY)["block_n"] == 32


def test_a_shipped_cache_with_an_invalid_config_falls_back_to_the_default(tmp_path):
    """The caches shipped in the package are checked like the user's: a config with zero
    warps is not launched; one warning names the shipped file and the entry."""
    shipped = tmp_path / "shipped" / "interpret-cpu.json"
    _write(shipped, _doc({KEY: {**_entry(), "config": _fields(num_warps=0)}}))
    config, messages = _caught(lambda: INTERPRET.gemm_config(CPU, MX, MX, 32, 64, 128))
    assert config == INTERPRET.default_gemm_config(None, 32, None, False)
    found = [m for m in messages if str(shipped) in m and repr(KEY) in m and "num_warps 0" in m]
    assert len(found) == 1


# (M, N, K, broken config field): each breaks the interpreted GEMM on the old code in its own
# way: uninitialised output, wrong tiles, an InterpreterError, a TypeError, a ZeroDivisionError
BROKEN = [(40, 48, 128, {"block_m": -16}), (40, 32, 128, {"group_m": 0}), (24, 48, 64, {"block_n": 24}),
          (8, 16, 64, {"block_m": "16"}), (16, 16, 64, {"block_k": 0}), (5, 48, 96, {"group_m": 2**31 - 1}),
          (8, 48, 64, {"num_stages": 64}), (8, 80, 64, {"block_k": 1024})]


@interpreted
def test_matmul_with_an_invalid_tuned_config_is_right_and_warns_once(monkeypatch):
    """Entries the kernels cannot launch, one per shape: each GEMM launches the default
    config and equals the float64 product of the dequantized operands; one warning per
    entry naming the file and the entry, however many calls."""
    from portable_mx.backends.triton import launch as L

    path = cache.cache_file("interpret", "cpu")
    keys = [cache.entry_key("matmul", "e2m1", "e2m1", m, n, k) for m, n, k, _ in BROKEN]
    _write(path, _doc({key: {**_entry(), "config": _fields(**broken)} for key, (*_, broken) in zip(keys, BROKEN)}))
    launched = []
    real = L.launch
    monkeypatch.setattr(L, "launch", lambda plan, args: launched.append(plan.config) or real(plan, args))
    gen = torch.Generator().manual_seed(25)

    def run():
        for m, n, k, _ in BROKEN:
            x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            a, b = REF.quantize(x, QuantRecipe()), REF.quantize(w, QuantRecipe())
            out = INTERPRET.matmul(a, b)
            exact = REF.dequantize(a, torch.float64) @ REF.dequantize(b, torch.float64).T
            torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
            assert launched[-1] == INTERPRET.default_gemm_config(None, m, None, False)

    _, messages = _caught(lambda: (run(), run()))
    for key, (*_, broken) in zip(keys, BROKEN):
        (name,) = broken
        assert len([m for m in messages if str(path) in m and repr(key) in m and name in m]) == 1, (key, messages)


@interpreted
def test_a_cached_block_m_below_16_cannot_split_the_sparse_outlier_tokens(monkeypatch):
    """W4A16 with an outlier weight at M <= 4 tokens on the upcast route (sm_90, gfx942;
    the interpreter's backend made to route so, as the tuning tests do) adds token j's
    outlier sums into column j of its row tile. A hand-written entry with block_m 2 used to
    be launched: rows 2 and 3 took rows 0 and 1's corrections (off by about 0.7 of the
    output's largest value, no warning). The entry is refused now (one warning naming it)
    and the product equals the float64 product of the dequantized operands."""
    from portable_mx.backends.triton.backend import GemmRoute
    from portable_mx.backends.triton.gemm_upcast import UpcastRoute
    from portable_mx.backends.triton.layouts import PLAIN_VALUES

    monkeypatch.setattr(INTERPRET, "gemm_route", lambda target, a, b: GemmRoute("upcast", upcast=UpcastRoute(PLAIN_VALUES)))
    monkeypatch.setattr(INTERPRET, "_devices", {})
    recipe = QuantRecipe(activations="bf16", outliers_per_block=1)
    gen = torch.Generator().manual_seed(26)
    w = torch.randn(64, 256, generator=gen)
    w[::3, ::7] *= 40  # (an outlier in most blocks)
    b = REF.quantize(w, recipe)
    assert b.outlier_values is not None
    path = cache.cache_file("interpret", "cpu")
    key = cache.entry_key("matmul", "bf16", "e2m1/OF-1", 4, 64, 256)
    _write(path, _doc({key: {**_entry(), "config": _fields(block_m=2, block_n=64, block_k=64)}}))
    x = torch.randn(4, 256, generator=gen).bfloat16()
    out, messages = _caught(lambda: INTERPRET.matmul(x, b))
    exact = x.double() @ REF.dequantize(b, torch.float64).T
    bound = (x.double().abs() @ REF.dequantize(b, torch.float64).abs().T) * 2.0**-22  # fp32 accumulation, K = 256
    assert ((out.double() - exact).abs() <= bound).all(), (out.double() - exact).abs().max(dim=1).values
    assert len([m for m in messages if repr(key) in m and "block_m 2 is less than 16" in m]) == 1, messages


# ----------------------------------------------------------------------------- the rules


@pytest.mark.parametrize("change, why", [
    ({"block_m": -16}, "block_m -16"), ({"block_m": 0}, "block_m 0"), ({"block_n": 24}, "block_n 24"),
    ({"block_k": 0}, "block_k 0"), ({"block_k": 16}, "block_k 16"), ({"block_k": 48}, "block_k 48"),
    ({"block_m": 1}, "block_m 1 is less than 16"), ({"block_m": 8}, "block_m 8 is less than 16"),
    ({"block_m": "16"}, "block_m must be an int"),
    ({"block_m": 16.0}, "block_m must be an int"), ({"num_warps": True}, "num_warps must be an int"),
    ({"num_warps": 0}, "num_warps 0"), ({"num_warps": 3}, "num_warps 3"), ({"num_warps": 64}, "1024 threads"),
    ({"num_stages": 0}, "num_stages 0"), ({"group_m": 0}, "group_m 0"), ({"group_m": -1}, "group_m -1"),
    ({"group_m": 2**31 - 1}, "group_m 2147483647 is not in 1 .. 64"),
    ({"split_k": -2}, "split_k -2"), ({"split_k": 5}, "split_k 5"),
    ({"block_m": 512}, "block_m 512 is more than 256"), ({"block_n": 1024}, "block_n 1024 is more than 256"),
    ({"block_k": 1024}, "block_k 1024 is more than 512"), ({"num_stages": 9}, "num_stages 9 is not in 1 .. 8"),
    ({"num_stages": 64}, "num_stages 64"), ({"num_stages": 10**30}, "num_stages 1000000000000000000000000000000"),
    ({"extra": [["waves_per_eu", 2]]}, "AMD's"), ({"extra": [["foo", 1]]}, "'foo'"), ({"extra": "kpack"}, "extra"),
    ({"extra": [["maxnreg", 128]]}, "NVIDIA's"), ({"persistent": 1}, "no field persistent"),
])
def test_the_rules_name_what_the_kernels_cannot_launch(change, why):
    found = config_rules.problems(_fields(**change), "interpret", kp=128)  # block_k 32: 4 K tiles
    assert any(why in p for p in found), found
    with pytest.raises(ValueError, match="invalid GEMM config"):
        config_rules.config_from_fields(_fields(**change), "interpret", kp=128)


def test_the_rules_follow_the_target():
    amd = _fields(extra=[["kpack", 1], ["matrix_instr_nonkdim", 16], ["waves_per_eu", 2]], num_warps=16)
    assert config_rules.problems(amd, "gfx950") == []
    assert any("1024 threads" in p for p in config_rules.problems({**amd, "num_warps": 32}, "gfx950"))
    assert config_rules.problems({**amd, "num_warps": 32, "extra": []}, "sm_90") == []
    assert any("kpack = 3" in p for p in config_rules.problems({**amd, "extra": [["kpack", 3]]}, "gfx942"))
    assert config_rules.problems(_fields(split_k=0), "sm_100", kp=32) == []  # 0: per shape
    assert config_rules.problems(_fields(split_k=4), "sm_100") == []  # no shape: no bound
    held = _fields(extra=[["maxnreg", 128]])  # ptxas' register cap: NVIDIA's
    assert config_rules.problems(held, "sm_90") == config_rules.problems(held, "sm_120") == []
    assert any("maxnreg is NVIDIA's; this config is for gfx942" in p for p in config_rules.problems(held, "gfx942"))
    for bad in (8, 256, "128", 128.0, True):
        assert any("is not an int in 16 .. 255" in p
                   for p in config_rules.problems(_fields(extra=[["maxnreg", bad]]), "sm_90")), bad


def test_the_rules_refuse_what_no_gpu_can_run():
    """The audit's configs: 64 pipeline stages of 64 x 64 x 128 tiles (564736 B of shared
    memory on sm_90, 232448 B the limit), 10**30 stages and 1024 x 1024 x 1024 tiles (its
    compile had not finished after 8 minutes) were accepted for every target."""
    for arch in (*TARGETS, "interpret"):
        for change, why in (({"num_stages": 64}, "num_stages 64 is not in 1 .. 8"),
                            ({"num_stages": 10**30}, "is not in 1 .. 8"),
                            ({"block_m": 1024, "block_n": 1024, "block_k": 1024}, "block_k 1024 is more than 512")):
            fields = _fields(**{"block_m": 64, "block_n": 64, "block_k": 128, **change})
            assert any(why in p for p in config_rules.problems(fields, arch)), (arch, change)
    assert config_rules.problems(_fields(block_m=256, block_n=256, block_k=512, num_stages=8), "interpret") == []


def test_the_shared_memory_floor_follows_the_target(cache_env):
    """(num_stages - 1) x (block_m + block_n) x block_k / 2 bytes (4-bit A and B tiles in
    every buffered stage) must fit the target's shared memory: 256 x 256 x 128 tiles in 5
    stages need at least 131072 B, within sm_90's 232448 B, over sm_120's 101376 B and
    gfx942's 65536 B; the interpreter has no limit. A cache entry with them is not used on
    sm_120 (one warning names it), as for any other broken rule."""
    big = _fields(block_m=256, block_n=256, block_k=128, num_stages=5, num_warps=8)
    assert config_rules.shared_memory_floor(256, 256, 128, 5) == 131072
    assert config_rules.shared_memory_floor(256, 256, 512, 1) == 0  # no pipeline buffer
    assert config_rules.problems(big, "sm_90") == config_rules.problems(big, "interpret") == []
    for arch, limit in (("sm_120", 101376), ("gfx942", 65536)):
        (why,) = config_rules.problems(big, arch)
        assert f"at least 131072 B of shared memory" in why and f"{arch}'s {limit} B" in why, why
    assert config_rules.problems({**big, "num_stages": 2}, "sm_120") == []  # 32768 B
    name = "NVIDIA GeForce RTX 5090"
    path = cache.cache_file("sm_120", name)
    _write(path, _doc({KEY: {**_entry(), "config": big}}, arch="sm_120", device_name=name))
    got, messages = _caught(lambda: cache.lookup("sm_120", name, KEY))
    assert got is None
    assert len([m for m in messages if str(path) in m and repr(KEY) in m and "shared memory" in m]) == 1, messages


def test_the_rules_accept_every_default_and_every_curated_candidate():
    """Not stricter than the code: every backend's default GEMM config and every candidate
    of the tuner's curated spaces (that passes the space's own rule) launch, except the
    few sm_120 candidates over the shared-memory floor, which overflow its 101376 B when
    compiled (the tuner's static stage prunes them; the next test compiles the closest)."""
    for name in ("cuda", "rocm", "triton-interpret"):
        for target, tiles in registry.get(name).gemm_tiles.items():
            for kind, config in tiles.items():
                assert config_rules.problems(config_to_json(config), target, 8192) == [], (name, target, kind)
    over = set()
    for target, a, b, m, kp, config in _curated_candidates():
        arch = target.name if target else "interpret"
        found = config_rules.problems(config_to_json(config), arch, kp)
        assert all("B of shared memory" in p for p in found), (arch, config, found)
        if found:
            over.add((arch, config))
    assert {arch for arch, _ in over} == {"sm_120"}, over
    assert len(over) == 32, len(over)  # (the 32 configs the static stage prunes there: the test after this one)


@pytest.mark.triton  # an ahead-of-time compile: triton >= 3.6
def test_the_curated_candidate_closest_over_the_floor_overflows_when_compiled(tmp_path):
    """The shared-memory floor is a lower bound: the sm_120 curated candidate it refuses by
    the least (its A4W4 form: 105472 B when compiled with triton 3.9, the floor 104448 B 3%
    over the 101376 B limit) does overflow, and the static stage prunes it for that."""
    from portable_mx.tuning import static

    over = []
    for target, a, b, m, kp, config in _curated_candidates():
        if target is not None and config_rules.problems(config_to_json(config), target.name, kp):
            floor = config_rules.shared_memory_floor(config.block_m, config.block_n, config.block_k,
                                                     config.num_stages)
            over.append((floor / target.shared_memory, target.name, a != MX, m, config.label(), target, a, b, kp, config))
    *_, target, a, b, kp, config = min(over, key=lambda x: x[:5])
    report = static.prune([config], a, b, target, registry.get("cuda"), kp,
                          static.VerdictStore(tmp_path / static.STORE_NAME), jobs=1)
    verdict = report.verdicts[config]
    assert not verdict.ok and verdict.shared_bytes > target.shared_memory, verdict
    assert any("shared memory" in r for r in verdict.reasons), verdict


def _curated_candidates():
    """(target, a, b, m, kp, config) of every curated candidate that passes its space's rule."""
    heavy = Operand(None, 128, 1)
    for target in [*TARGETS.values(), None]:
        for a, b in ((MX, MX), (Operand(torch.bfloat16, None, 0), MX), (heavy, heavy)):
            for m, kp in ((1, 64), (16, 8192), (4096, 8192)):
                space = gemm_space(target, a, b, m, kp)
                for config in space.candidates():
                    if not space.violation(config):
                        yield target, a, b, m, kp, config


def test_every_shipped_cache_entry_launches():
    """The caches shipped in the package (portable_mx/tuning/configs/) hold only entries
    this version can use: a shipped entry that fails the rules would be ignored on every
    user's machine with a warning."""
    shipped = Path(cache.__file__).with_name("configs")
    for path in sorted(shipped.glob("*.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        for key, value in doc["entries"].items():
            entry, why = cache.check_entry(key, value, doc["arch"])
            assert entry is not None, f"{path.name}: {key}: {why}"


def test_a_written_cache_file_keeps_its_permissions(tmp_path):
    """A cache file shared through a group-readable directory stays readable to the group
    after a write (the temporary file the write renames was owner-only: the others then
    found the file unreadable and set it aside), and a new file takes open()'s mode under
    the umask."""
    import os
    import stat

    from portable_mx.tuning import files

    path = tmp_path / "c.json"
    path.write_text("{}")
    os.chmod(path, 0o664)
    files.write_atomic(path, '{"a": 1}')
    assert stat.S_IMODE(path.stat().st_mode) == 0o664 and path.read_text() == '{"a": 1}'
    umask = os.umask(0o022)
    try:
        files.write_atomic(tmp_path / "new.json", "{}")
        aside = files.write_aside(path, "old", "{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
    assert stat.S_IMODE(aside.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json", "c.old.json", "new.json"]  # no temporaries left


def test_retuning_some_shapes_never_makes_the_others_look_fresh(monkeypatch):
    """Entries tuned with an older GEMM kernel source stay marked so after new shapes are
    recorded under this one: the file's hash becomes this version's, each carried entry
    keeps the old hash as its own, the reader still warns about them (and only them), and
    re-tuning one replaces it even when slower (its old time was another kernel's). Before,
    the file's hash alone said it: one new entry made every old one look fresh, silenced
    the warning, and a slower re-tune of an old shape was refused."""
    path = cache.cache_file("interpret", "cpu")
    old_key, other_key = (cache.entry_key("matmul", "e2m1", "e2m1", 32, n, 128) for n in (16, 32))
    _write(path, _doc({old_key: _entry(ms=1.0), other_key: _entry(ms=1.0)}, kernel_hash="0123456789abcdef"))
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}))
    doc = json.loads(path.read_text())
    assert doc["kernel_hash"] == cache.kernel_hash() != "0123456789abcdef"
    assert doc["entries"][old_key]["kernel_hash"] == doc["entries"][other_key]["kernel_hash"] == "0123456789abcdef"
    assert "kernel_hash" not in doc["entries"][KEY]
    cache.clear()
    _, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert [m for m in messages if "2 of its 3 entries" in m and "kernel source" in m], messages
    # a slower re-tune of a stale shape replaces it and makes it current
    _caught(lambda: cache.record("interpret", "cpu", {old_key: cache.make_entry(GemmConfig(16, 16, 32), 5.0)}))
    doc = json.loads(path.read_text())
    assert doc["entries"][old_key]["time_ms"] == 5.0 and "kernel_hash" not in doc["entries"][old_key]
    assert doc["entries"][other_key]["kernel_hash"] == "0123456789abcdef"
    # a slower re-tune of a current shape does not replace it
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(16, 16, 32), 9.0)}))
    assert json.loads(path.read_text())["entries"][KEY]["time_ms"] == 2.0
    cache.clear()
    _, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert [m for m in messages if "1 of its 3 entries" in m], messages


def test_a_repeated_entry_key_hides_nothing_for_good():
    """A file holding one key twice (merged by hand or by a tool): the last is used, as
    JSON says, with a warning; recording keeps the hidden one in <name>.duplicates.json
    (before, the rewrite dropped it without a word)."""
    path = cache.cache_file("interpret", "cpu")
    first, last = _entry(GemmConfig(16, 16, 32, group_m=1), 1.0), _entry(GemmConfig(32, 32, 64, group_m=1), 3.0)
    other = cache.entry_key("matmul", "e2m1", "e2m1", 32, 16, 128)
    text = json.dumps(_doc({"@": 0}))  # (a placeholder: json.dumps cannot write a repeated key)
    text = text.replace('{"@": 0}', "{%s: %s, %s: %s}" % (json.dumps(KEY), json.dumps(first), json.dumps(KEY),
                                                          json.dumps(last)))
    _write(path, text.encode())
    _, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert cache.lookup("interpret", "cpu", KEY)["block_m"] == 32
    assert [m for m in messages if repr(KEY) in m and "more than once" in m], messages
    _caught(lambda: cache.record("interpret", "cpu", {other: cache.make_entry(GemmConfig(16, 16, 32), 2.0)}))
    kept = json.loads(path.with_name(path.name[:-len(".json")] + ".duplicates.json").read_text())
    assert kept["entries"] == {KEY: first}
    doc = json.loads(path.read_text())
    assert doc["entries"][KEY] == last and other in doc["entries"]


def test_a_symlinked_cache_file_is_updated_where_it_points(tmp_path):
    """A cache file that links to a shared one: recording writes the shared file and
    leaves the link a link (os.replace over the link replaced the link with a copy)."""
    path = cache.cache_file("interpret", "cpu")
    shared = tmp_path / "shared" / "team.json"
    _write(shared, _doc({}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(shared)
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}))
    assert path.is_symlink() and KEY in json.loads(shared.read_text())["entries"]


def test_writers_through_two_links_to_one_file_share_its_lock(tmp_path):
    """Two cache files linking to one shared file: a writer through one link must wait for
    a writer through the other (each link had a lock of its own, and concurrent records
    through four links kept 34 of 60 entries)."""
    from portable_mx.tuning import files

    shared = tmp_path / "shared" / "team.json"
    _write(shared, _doc({}))
    a, b = tmp_path / "a" / "dev.json", tmp_path / "b" / "dev.json"
    for link in (a, b):
        link.parent.mkdir()
        link.symlink_to(shared)
    holders = iter((a, b))  # the first thread locks through a, the second through b
    assert_second_waits_for_first(lambda: files.locked(next(holders)))


def test_another_cache_dir_is_read_when_the_variable_points_there(tmp_path, monkeypatch):
    """The index of read entries is per user cache dir: pointing PORTABLE_MX_CACHE_DIR
    at another folder mid-process used to keep serving the first folder's entries."""
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}))
    assert cache.lookup("interpret", "cpu", KEY)["block_m"] == 32
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "empty"))
    assert _caught(lambda: cache.lookup("interpret", "cpu", KEY))[0] is None
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    assert cache.lookup("interpret", "cpu", KEY)["block_m"] == 32


def test_the_folder_read_is_the_one_the_index_key_names(tmp_path, monkeypatch):
    """The variable read once per lookup: a thread that pointed PORTABLE_MX_CACHE_DIR
    elsewhere between the index key's read and the files' read had the other folder's
    entries stored under this folder's key (simulated: the variable changes as the index
    is asked for the key)."""
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}))
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "other"))
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(16, 32, 64), 1.0)}))
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    cache.clear()

    class Meanwhile(dict):
        def get(self, key, default=None):
            monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "other"))
            return super().get(key, default)

    monkeypatch.setattr(cache, "_index", Meanwhile())
    assert cache.entries("interpret", "cpu")[KEY].config["block_m"] == 32
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "cache"))
    assert cache.lookup("interpret", "cpu", KEY)["block_m"] == 32


def test_a_cache_dir_that_is_a_file_is_a_clear_error(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(blocker / "sub"))
    with pytest.raises(NotADirectoryError, match="not-a-dir is a file"):
        cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)})
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(blocker))
    with pytest.raises(NotADirectoryError, match="not-a-dir"):
        cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)})


def test_a_cache_dir_the_process_may_not_search_serves_the_default_configs(tmp_path, monkeypatch):
    """A user cache dir inside a folder the process cannot search (another user's home:
    a container run under another uid with HOME=/root): Python before 3.12's Path.exists
    raised PermissionError there, and every GEMM on a Triton backend raised it. Simulated
    (the tests may run as root, whom no permission stops): Path.exists raises EACCES, as
    it does there, for every path inside the folder."""
    locked = tmp_path / "locked"
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(locked / "pmx"))
    real_exists = Path.exists

    def exists(self, *args, **kwargs):
        if str(self).startswith(str(locked) + "/"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", exists)
    cache.clear()
    assert cache.entries("interpret", "cpu") == {}
    assert cache.lookup("interpret", "cpu", KEY) is None
    assert cache.file_report("interpret", "cpu") == []
    if _NO_GEMM is None:  # the GEMM through the interpreter, with the default configs
        gen = torch.Generator().manual_seed(26)
        x, w = torch.randn(8, 64, generator=gen), torch.randn(16, 64, generator=gen)
        a, b = REF.quantize(x, QuantRecipe()), REF.quantize(w, QuantRecipe())
        exact = REF.dequantize(a, torch.float64) @ REF.dequantize(b, torch.float64).T
        torch.testing.assert_close(INTERPRET.matmul(a, b).double(), exact, rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- repeated keys, strict numbers


def _with(doc: dict, old: str, new: str) -> bytes:
    """``doc`` as JSON text with ``old`` (which must occur once) replaced by ``new``: the
    way to write a repeated key, which json.dumps cannot."""
    text = json.dumps(doc)
    assert text.count(old) == 1, old
    return text.replace(old, new).encode()


def _values(text: str, key: str, dotted: str) -> list:
    """Every value that the entry ``key`` of the cache file ``text`` gives the field
    ``dotted`` ("time_ms", "config.block_m"), a repeated key's included, in file order."""
    top = dict(json.loads(text, object_pairs_hook=lambda pairs: pairs))
    (pairs,) = [value for name, value in top["entries"] if name == key]
    *outer, last = dotted.split(".")
    for part in outer:
        (pairs,) = [value for name, value in pairs if name == part]
    return [value for name, value in pairs if name == last]


@pytest.mark.parametrize("key", ["entries", "arch", "schema_version", "kernel_hash"])
def test_a_repeated_top_level_key_makes_the_file_corrupt_never_a_silent_loss(key):
    """A top-level key written twice (two "entries" objects after a hand merge): JSON's
    last-wins hid the first object: its entries were missing without a word and the next
    record() rewrote the file without them. Now the whole file is ignored with a warning
    naming it and the key, and record() sets it aside byte for byte."""
    path = cache.cache_file("interpret", "cpu")
    first, second = (cache.entry_key("matmul", "e2m1", "e2m1", 32, n, 128) for n in (16, 32))
    doc = _doc({first: _entry()})
    repeated = {"entries": json.dumps({second: _entry()}), "arch": '"interpret"', "schema_version": "2",
                "kernel_hash": json.dumps(cache.kernel_hash())}[key]
    data = _write(path, _with(doc, '"entries": {', f'"{key}": {repeated}, "entries": {{'))
    found, messages = _caught(lambda: [cache.lookup("interpret", "cpu", k) for k in (first, second)])
    assert found == [None, None]
    assert [m for m in messages if str(path) in m and repr(key) in m and "more than once" in m], messages
    new = {KEY: cache.make_entry(GemmConfig(16, 32, 64), 2.0)}
    _, messages = _caught(lambda: cache.record("interpret", "cpu", new))
    assert any("set aside" in m and repr(key) in m for m in messages), messages
    assert path.with_name(path.name[:-len(".json")] + ".corrupt.json").read_bytes() == data
    assert list(json.loads(path.read_text())["entries"]) == [KEY]


@pytest.mark.parametrize("old, new, twice, values", [
    ('"time_ms": 1.0', '"time_ms": 1.0, "time_ms": 5.0', "time_ms", [1.0, 5.0]),
    ('"block_m": 16', '"block_m": 16, "block_m": 32', "config.block_m", [16, 32]),
])
def test_a_key_repeated_inside_an_entry_makes_it_unreadable_and_kept_whole(old, new, twice, values):
    """An entry that writes a key twice ("time_ms", or "block_m" in its config) was read
    with the last value, silently. Now it is not used, with a warning naming the file,
    the entry and the key; record() carries it through with both values, and a re-tune of
    its shape keeps it, both values, in <name>.replaced.json."""
    path = cache.cache_file("interpret", "cpu")
    other = cache.entry_key("matmul", "e2m1", "e2m1", 32, 16, 128)
    _write(path, _with(_doc({KEY: _entry()}), old, new))
    found, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert found is None
    assert [m for m in messages if str(path) in m and repr(KEY) in m and repr(twice) in m], messages
    _caught(lambda: cache.record("interpret", "cpu", {other: cache.make_entry(GemmConfig(16, 16, 32), 2.0)}))
    assert _values(path.read_text(), KEY, twice) == values
    assert cache.lookup("interpret", "cpu", KEY) is None and cache.lookup("interpret", "cpu", other) is not None
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}))
    aside = path.with_name(path.name[:-len(".json")] + ".replaced.json").read_text()
    assert _values(aside, KEY, twice) == values
    assert cache.lookup("interpret", "cpu", KEY)["block_m"] == 32


@pytest.mark.parametrize("field, value", [
    ("time_ms", "true"), ("time_ms", '"1.5"'), ("time_ms", "Infinity"), ("time_ms", "NaN"), ("time_ms", "1e400"),
    ("baseline_ms", "Infinity"), ("trials", "true"), ("trials", '"3"'), ("survivors", "2.0"),
])
def test_numbers_of_an_entry_are_strict(field, value):
    """true or "1.5" as a time, an infinite time, a string count: were accepted (true as
    1 ms, "1.5" as 1.5, Infinity as a time); now the entry is not used, with a warning
    naming the file, the entry and the field."""
    path = cache.cache_file("interpret", "cpu")
    _write(path, _with(_doc({KEY: {**_entry(), field: 7}}), f'"{field}": 7', f'"{field}": {value}'))
    found, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert found is None
    assert [m for m in messages if str(path) in m and repr(KEY) in m and field in m], messages


def test_a_byte_order_mark_is_no_corruption():
    """A file saved by an editor with a UTF-8 byte order mark was called corrupt (and set
    aside by the next record()): it is read."""
    path = cache.cache_file("interpret", "cpu")
    _write(path, b"\xef\xbb\xbf" + json.dumps(_doc({KEY: _entry()})).encode())
    found, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert found["block_n"] == 32 and not [m for m in messages if str(path) in m]


def test_a_schema_version_that_is_no_integer_is_set_aside_as_corrupt():
    """schema_version "2" (a string) was set aside as "<name>.schema-2.schema-2.json",
    as though it were of another schema: it is a malformed file, "<name>.corrupt.json"."""
    path = cache.cache_file("interpret", "cpu")
    data = _write(path, json.dumps(_doc({KEY: _entry()}, schema_version="2")).encode())
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(16, 16, 32), 2.0)}))
    stem = path.name[:-len(".json")]
    assert path.with_name(f"{stem}.corrupt.json").read_bytes() == data
    assert not list(path.parent.glob(f"{stem}.schema-*"))


def test_info_says_malformed_for_a_malformed_entry(monkeypatch):
    """``portable-mx info`` said "not readable by this version" of an entry with a negative
    time, as though a newer version could read it: it says malformed, and keeps that text
    for an entry with a field this version lacks."""
    path = cache.cache_file("interpret", "cpu")
    newer = {**_entry(), "config": {**_entry()["config"], "persistent": 1}}
    keys = [cache.entry_key("matmul", "e2m1", "e2m1", 32, n, 128) for n in (16, 32, 48)]
    _write(path, _doc({keys[0]: {**_entry(), "time_ms": -1}, keys[1]: {**_entry(), "time_ms": -2},
                       keys[2]: newer}))
    (row,) = [r for r in _caught(lambda: _info_rows(monkeypatch))[0] if r["file"] == str(path)]
    assert "2 entries malformed" in row["why"] and "1 entries not readable by this version" in row["why"], row


def test_an_unreadable_entry_carried_over_keeps_the_old_kernel_hash():
    """record() under a new kernel source stamped the old file's hash on the entries it
    could read, not on those it carries verbatim: they then looked measured with the new
    source. Both are stamped now (and one kept aside after a re-tune)."""
    path = cache.cache_file("interpret", "cpu")
    bad, worse = (cache.entry_key("matmul", "e2m1", "e2m1", 32, n, 128) for n in (16, 48))
    old = {bad: {**_entry(), "time_ms": -1}, worse: {**_entry(), "config": _fields(block_m=-16)}}
    _write(path, _doc(old, kernel_hash="0123456789abcdef"))
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}))
    doc = json.loads(path.read_text())
    assert doc["kernel_hash"] == cache.kernel_hash()
    for key, value in old.items():
        assert doc["entries"][key] == {**value, "kernel_hash": "0123456789abcdef"}
    _caught(lambda: cache.record("interpret", "cpu", {bad: cache.make_entry(GemmConfig(32, 32, 64), 2.0)}))
    aside = json.loads(path.with_name(path.name[:-len(".json")] + ".replaced.json").read_text())
    assert aside["entries"][bad]["kernel_hash"] == "0123456789abcdef"


# ----------------------------------------------------------------------------- the device


def test_a_file_tuned_on_another_device_name_is_used_with_a_warning():
    """The header's device_name was never checked: a file reached through the same file
    name from another device's name was used as this device's tuning. Its configs still
    launch (the arch is checked), so it is used, with one warning naming both."""
    path = cache.cache_file("interpret", "cpu")
    _write(path, _doc({KEY: _entry()}, device_name="CPU"))
    found, messages = _caught(lambda: (cache.lookup("interpret", "cpu", KEY), cache.lookup("interpret", "cpu", KEY)))
    assert found[0]["block_n"] == 32
    assert len([m for m in messages if str(path) in m and "'CPU'" in m and "'cpu'" in m]) == 1, messages


def test_recording_names_the_recording_device_so_the_warning_can_be_cleared():
    """record() kept the first device's name in the header: after this device re-tuned
    every entry the file still named the other one, and the warning could never clear."""
    path = cache.cache_file("interpret", "cpu")
    _write(path, _doc({KEY: _entry()}, device_name="CPU"))
    _caught(lambda: cache.record("interpret", "cpu", {KEY: cache.make_entry(GemmConfig(32, 32, 64), 9.0)},
                                 replace=True))
    assert json.loads(path.read_text())["device_name"] == "cpu"
    cache._warned.clear()  # (a warning is given once a process)
    _, messages = _caught(lambda: cache.lookup("interpret", "cpu", KEY))
    assert not [m for m in messages if "tuned on" in m], messages


def test_device_names_outside_ascii_get_distinct_slugs():
    """"GPU α" and "GPU β" both became "gpu", one file for two devices; ASCII names keep
    the names every cache file so far was written under."""
    assert cache.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert cache.slug("AMD Instinct MI300X (gfx942)") == "amd-instinct-mi300x-gfx942"
    assert cache.slug("***") == "device"
    alpha, beta = cache.slug("GPU α"), cache.slug("GPU β")
    assert alpha != beta and alpha.startswith("gpu-") and beta.startswith("gpu-")
    assert cache.slug("GPU α") == alpha and cache.slug("αβ") != cache.slug("γδ")
    assert all(part.isascii() for part in (alpha, beta, cache.slug("αβ")))
    for path in Path(cache.__file__).with_name("configs").glob("*.json"):  # the shipped files keep their names
        doc = json.loads(path.read_text(encoding="utf-8"))
        assert path.name.startswith(f"{doc['arch']}-{cache.slug(doc['device_name'])}."), path.name


def test_another_cache_dir_moves_the_generation(tmp_path, monkeypatch):
    """Launch plans are kept while cache.generation() stands still: pointing
    PORTABLE_MX_CACHE_DIR at another folder must move it (it did not)."""
    before = cache.generation()
    assert cache.generation() == before
    monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / "elsewhere"))
    moved = cache.generation()
    assert moved != before and cache.generation() == moved
    monkeypatch.delenv(cache.ENV_CACHE_DIR)
    assert cache.generation() != moved


@interpreted
def test_matmul_after_the_cache_dir_changes_launches_the_new_folders_config(tmp_path, monkeypatch):
    """Two folders tune one shape differently: a GEMM run under the first, then under the
    second, launched the first folder's config from its kept plan."""
    from portable_mx.backends.triton import launch as L

    launched = []
    real = L.launch
    monkeypatch.setattr(L, "launch", lambda plan, args: launched.append(plan.config) or real(plan, args))
    key = cache.entry_key("matmul", "e2m1", "e2m1", 16, 64, 128)
    for folder, block_n in (("a", 32), ("b", 64)):
        path = cache.cache_file("interpret", "cpu", tmp_path / folder)
        _write(path, _doc({key: _entry(GemmConfig(16, block_n, 64))}))
    gen = torch.Generator().manual_seed(6)
    a = REF.quantize(torch.randn(16, 128, generator=gen), QuantRecipe())
    b = REF.quantize(torch.randn(64, 128, generator=gen), QuantRecipe())
    for folder, block_n in (("a", 32), ("b", 64), ("a", 32)):
        monkeypatch.setenv(cache.ENV_CACHE_DIR, str(tmp_path / folder))
        out = INTERPRET.matmul(a, b)
        assert launched[-1].block_n == block_n, folder
        exact = REF.dequantize(a, torch.float64) @ REF.dequantize(b, torch.float64).T
        torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-4)
