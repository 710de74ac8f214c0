"""gpt-oss-layout checkpoints (portable_mx.checkpoints.gpt_oss): bytes <-> MXTensor, the
reader's checks, and write -> read -> write byte identity. Needs safetensors (the `hf`
extra); skips with the install command elsewhere."""

import hashlib
import json

import pytest
import torch

import portable_mx as pmx
from portable_mx.checkpoints import gpt_oss

st = pytest.importorskip("safetensors.torch", reason='needs safetensors: pip install "portable_mx[hf]"')

# openai/gpt-oss gpt_oss/torch/weights.py FP4_VALUES: code = sign << 3 | magnitude
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E, H, I = 2, 64, 32  # experts, hidden, intermediate: gate_up [E, 2I, H], down [E, H, I]
PREFIX = "model.layers.{}.mlp.experts"


def gpt_oss_decode(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The gpt-oss rule, written from its reference (low nibble = even element), in float64:
    blocks u8 [E, N, G, 16], scales u8 [E, N, G] -> [E, N, 32 G]."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float64)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * torch.pow(2.0, scales.to(torch.float64) - 127)[..., None]
    return vals.reshape(*blocks.shape[:2], -1)


def config() -> dict:
    return {"model_type": "gpt_oss", "num_local_experts": E, "hidden_size": H, "intermediate_size": I,
            "num_hidden_layers": 2}


def state_dict(seed: int = 0) -> dict:
    """transformers' GptOss layout for 2 layers: float experts [E, in, out], bf16 rest."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for layer in range(2):
        p = PREFIX.format(layer)
        sd[f"{p}.gate_up_proj"] = torch.randn(E, H, 2 * I, generator=g)
        sd[f"{p}.gate_up_proj_bias"] = torch.randn(E, 2 * I, generator=g).bfloat16()
        sd[f"{p}.down_proj"] = torch.randn(E, I, H, generator=g) * 4
        sd[f"{p}.down_proj_bias"] = torch.randn(E, H, generator=g).bfloat16()
        sd[f"model.layers.{layer}.mlp.router.weight"] = torch.randn(E, H, generator=g).bfloat16()
        sd[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(H).bfloat16()
    sd["model.embed_tokens.weight"] = torch.randn(16, H, generator=g).bfloat16()
    return sd


def digests(d) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_wrap_is_a_view_and_decodes_like_gpt_oss():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (3, 5, 2), dtype=torch.uint8, generator=g)
    mx = gpt_oss.wrap(blocks, scales, name="w")
    assert mx.shape == (3, 5, 64) and mx.axis == 2 and mx.dtype == torch.bfloat16
    assert mx.qdata.data_ptr() == blocks.data_ptr() and mx.scales.data_ptr() == scales.data_ptr()
    assert torch.equal(pmx.dequantize(mx, dtype=torch.float64), gpt_oss_decode(blocks, scales))
    b2, s2 = gpt_oss.unwrap(mx)
    assert b2.data_ptr() == blocks.data_ptr() and torch.equal(b2, blocks) and torch.equal(s2, scales)


def test_the_checkpoint_helpers_take_a_recipe_as_the_ops_do():
    """A mapping of the recipe's fields (or None) works as everywhere else; it raised an
    AttributeError ('dict' object has no attribute 'macro_block'; audit)."""
    g = torch.Generator().manual_seed(2)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(110, 140, (2, 3, 2), dtype=torch.uint8, generator=g)
    assert gpt_oss.wrap(blocks, scales, recipe={"scale_rule": "rceil"}).recipe == pmx.QuantRecipe(scale_rule="rceil")
    assert gpt_oss.wrap(blocks, scales, recipe=None).recipe == pmx.QuantRecipe()
    sd = state_dict()
    got = gpt_oss.quantize_experts(sd, recipe={"scale_rule": "rceil"})
    want = gpt_oss.quantize_experts(sd, recipe=pmx.QuantRecipe(scale_rule="rceil"))
    name = PREFIX.format(0) + ".gate_up_proj"
    assert torch.equal(got[name].qdata, want[name].qdata) and torch.equal(got[name].scales, want[name].scales)
    with pytest.raises(ValueError, match="cannot hold"):
        gpt_oss.wrap(blocks, scales, recipe={"macro_block": 64})
    with pytest.raises(TypeError, match="recipe must be a QuantRecipe"):
        gpt_oss.wrap(blocks, scales, recipe="rceil")


def test_quantize_experts_is_pmx_quantize_of_the_out_in_weight():
    """[E, in, out] quantized along in = the [E, out, in] weight quantized along its last
    axis: the checkpoint bytes are pmx.quantize(w, axis=-1) of W [E, N, K]."""
    sd = state_dict()
    q = gpt_oss.quantize_experts(sd)
    name = PREFIX.format(0) + ".gate_up_proj"
    blocks, scales = gpt_oss.unwrap(q[name])
    ref = pmx.quantize(sd[name].transpose(1, 2).contiguous(), axis=-1)
    assert torch.equal(blocks.reshape(E, 2 * I, H // 2), ref.qdata) and torch.equal(scales, ref.scales)
    assert q[PREFIX.format(0) + ".gate_up_proj_bias"] is sd[PREFIX.format(0) + ".gate_up_proj_bias"]


def test_save_read_save_is_byte_identical(tmp_path):
    sd = state_dict()
    q = gpt_oss.quantize_experts(sd)
    a, b = tmp_path / "a", tmp_path / "b"
    gpt_oss.save(a, q, config())
    with st.safe_open(str(a / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        blocks = f.get_tensor(PREFIX.format(1) + ".down_proj_blocks")
        assert f.metadata() == {"format": "pt"}
    assert PREFIX.format(1) + ".down_proj" not in names
    assert blocks.dtype == torch.uint8 and blocks.shape == (E, H, I // 32, 16)
    written = json.loads((a / "config.json").read_text())
    assert written["quantization_config"] == gpt_oss.QUANTIZATION_CONFIG and written["hidden_size"] == H

    ckpt = gpt_oss.GptOssCheckpoint(a)
    assert ckpt.expert_modules() == [PREFIX.format(0), PREFIX.format(1)]
    assert set(ckpt) == set(sd)
    for name, value in q.items():
        got = ckpt[name]
        if isinstance(value, pmx.MXTensor):
            assert isinstance(got, pmx.MXTensor) and got.shape == (value.shape[0], value.shape[2], value.shape[1])
            assert torch.equal(got.qdata, value.qdata) and torch.equal(got.scales, value.scales)
            # the values: the float weight's MXFP4 values, [E, out, in]
            assert torch.equal(pmx.dequantize(got, dtype=torch.float32),
                               pmx.dequantize(value, dtype=torch.float32).transpose(1, 2))
        else:
            assert torch.equal(got, value) and got.dtype == value.dtype
    layer = ckpt.experts(1)
    assert sorted(layer) == ["down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias"]

    gpt_oss.save(b, {name: ckpt[name] for name in ckpt}, ckpt.config)
    assert digests(a) == digests(b)


def test_sharded_checkpoint_round_trip_reads_one_file_at_a_time(tmp_path, monkeypatch):
    q = gpt_oss.quantize_experts(state_dict(2))
    stored = sorted(s for n, v in q.items() for s, _ in gpt_oss._stored_tensors(n, v))
    # a weight's _blocks and _scales in different files, as a sharded hub checkpoint may have them
    first = [s for s in stored if "layers.0" in s and not s.endswith("gate_up_proj_scales")]
    shards = {"model-00001-of-00002.safetensors": first,
              "model-00002-of-00002.safetensors": [s for s in stored if s not in first]}
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    gpt_oss.save(a, q, config(), shards=shards)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert index["weight_map"][PREFIX.format(0) + ".gate_up_proj_scales"] == "model-00002-of-00002.safetensors"

    reads = []
    real = gpt_oss._safetensors

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            reads.append(name)
            return self.f.get_tensor(name)

        def __getattr__(self, attr):
            return getattr(self.f, attr)

    class Module:
        @staticmethod
        def safe_open(path, framework):
            return Counting(real().safe_open(path, framework=framework))

    monkeypatch.setattr(gpt_oss, "_safetensors", lambda: Module)
    ckpt = gpt_oss.GptOssCheckpoint(a)
    assert reads == []  # opening reads headers only
    w = ckpt[PREFIX.format(0) + ".gate_up_proj"]
    assert reads == [PREFIX.format(0) + ".gate_up_proj_blocks", PREFIX.format(0) + ".gate_up_proj_scales"]
    assert torch.equal(w.scales, gpt_oss.unwrap(q[PREFIX.format(0) + ".gate_up_proj"])[1])
    reads.clear()
    gpt_oss.save(b, ckpt, ckpt.config)  # from the open checkpoint: each stored tensor read once
    assert sorted(reads) == stored
    gpt_oss.save(c, dict(ckpt.items()), ckpt.config, shards=ckpt.shards)  # through MXTensors
    assert digests(a) == digests(b) == digests(c)


# ----------------------------------------------------------------------------- bad checkpoints


def write_raw(d, tensors: dict, cfg: dict = None) -> None:
    d.mkdir()
    st.save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg or config()))


def raw_layer() -> dict:
    q = gpt_oss.quantize_experts({k: v for k, v in state_dict().items() if "layers.0" in k})
    return {s: t.contiguous() for n, v in q.items() for s, t in gpt_oss._stored_tensors(n, v)}


def test_missing_scales_names_the_tensor(tmp_path):
    raw = raw_layer()
    del raw[PREFIX.format(0) + ".down_proj_scales"]
    write_raw(tmp_path / "c", raw)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.down_proj_scales is missing"):
        gpt_oss.GptOssCheckpoint(tmp_path / "c")


def test_float_blocks_of_a_dequantized_save_are_refused(tmp_path):
    """transformers' save_pretrained of a dequantized gpt-oss: bf16 [E, H, 2I] under the
    _blocks name. Reading it raises, naming the tensor and its dtype; writing it too."""
    raw = raw_layer()
    name = PREFIX.format(0) + ".gate_up_proj_blocks"
    raw[name] = torch.zeros(E, H, 2 * I, dtype=torch.bfloat16)
    write_raw(tmp_path / "c", raw)
    with pytest.raises(ValueError, match=rf"{name}: dtype BF16, expected U8.*save_pretrained"):
        gpt_oss.GptOssCheckpoint(tmp_path / "c")
    with pytest.raises(ValueError, match=rf"{name}: dtype BF16, expected U8"):
        gpt_oss.save(tmp_path / "out", raw, config())
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj: a float expert weight.*quantize_experts"):
        gpt_oss.save(tmp_path / "out", state_dict(), config())


@pytest.mark.parametrize("bad", ["scales_dtype", "scales_shape", "blocks_vs_config", "bias_shape", "bias_float8"])
def test_wrong_dtype_or_shape_names_the_tensor(tmp_path, bad):
    raw = raw_layer()
    p = PREFIX.format(0)
    if bad == "scales_dtype":
        name = f"{p}.gate_up_proj_scales"
        raw[name] = raw[name].to(torch.float32)
        pattern = rf"{name}: dtype F32, expected U8"
    elif bad == "scales_shape":
        name = f"{p}.down_proj_scales"
        raw[name] = raw[name][:, :-1].contiguous()
        pattern = rf"{name}: shape \[{E}, {H - 1}, 1\], expected \[{E}, {H}, 1\]"
    elif bad == "blocks_vs_config":  # one expert short of config.json's num_local_experts
        name = f"{p}.gate_up_proj_blocks"
        raw[name] = raw[name][:1].contiguous()
        raw[f"{p}.gate_up_proj_scales"] = raw[f"{p}.gate_up_proj_scales"][:1].contiguous()
        raw[f"{p}.gate_up_proj_bias"] = raw[f"{p}.gate_up_proj_bias"][:1].contiguous()
        pattern = rf"{name}: shape \[1, {2 * I}, 2, 16\], expected \[{E}, {2 * I}, 2, 16\] from config.json"
    elif bad == "bias_float8":  # a float the grouped GEMM does not add: it used to pass and fail at the forward
        name = f"{p}.down_proj_bias"
        raw[name] = raw[name].to(torch.float8_e4m3fn)
        pattern = rf"{name}: dtype F8_E4M3, expected a BF16, F16, F32 or F64 bias"
    else:
        name = f"{p}.down_proj_bias"
        raw[name] = raw[name][:, :8].contiguous()
        pattern = rf"{name}: shape \[{E}, 8\], expected \[{E}, {H}\]"
    write_raw(tmp_path / "c", raw)
    with pytest.raises(ValueError, match=pattern):
        gpt_oss.GptOssCheckpoint(tmp_path / "c")
    if bad == "bias_float8":
        with pytest.raises(ValueError, match=pattern):
            gpt_oss.save(tmp_path / "out", raw, config())


def test_writer_keeps_or_checks_quantization_config(tmp_path):
    q = gpt_oss.quantize_experts(state_dict())
    cfg = {**config(), "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}
    gpt_oss.save(tmp_path / "a", q, cfg)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"] == \
        cfg["quantization_config"]
    with pytest.raises(ValueError, match="quant_method 'mxfp4'"):
        gpt_oss.save(tmp_path / "b", q, {**config(), "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ValueError, match="macro-block"):
        gpt_oss.unwrap(pmx.quantize(torch.randn(2, 4, 64), pmx.QuantRecipe(macro_block=64), axis=-1), name="w")


@pytest.mark.parametrize("recipe", [pmx.QuantRecipe(outliers_per_block=1), pmx.QuantRecipe(macro_block=64)],
                         ids=["outliers", "macro-blocks"])
def test_a_state_dict_with_outliers_or_macro_factors_is_refused(tmp_path, recipe):
    """The state dict of frozen MXExperts whose weights carry outliers or macro-block
    factors: writing it raises, naming the part (it wrote the outliers as stray tensors
    that reading ignored, so the experts read back without them), and so does reading a
    file that holds such a part."""
    g = torch.Generator().manual_seed(3)
    w1 = pmx.quantize(torch.randn(E, 2 * I, H, generator=g), recipe, axis=-1)
    w2 = pmx.quantize(torch.randn(E, H, I, generator=g), recipe, axis=-1)
    experts = pmx.nn.MXExperts.from_mx(w1, w2, torch.zeros(E, 2 * I).bfloat16(), torch.zeros(E, H).bfloat16())
    sd = {f"{PREFIX.format(0)}.{name}": t for name, t in experts.state_dict().items()}
    part = "outliers" if recipe.outliers_per_block else "macro-block factors"
    with pytest.raises(ValueError, match=rf"gate_up_proj_\w+: the experts .* carry {part}, which a gpt-oss"):
        gpt_oss.save(tmp_path / "out", sd, config())
    assert not (tmp_path / "out").exists()
    write_raw(tmp_path / "c", {n: t.contiguous() for n, t in sd.items()})
    with pytest.raises(ValueError, match=rf"carry {part}"):
        gpt_oss.GptOssCheckpoint(tmp_path / "c")


def test_load_experts_refuses_to_drop_a_bias_the_model_has(tmp_path):
    """A checkpoint without a projection's bias, loaded into a model whose experts have
    that bias: refused, naming it (the experts came back without it)."""
    g = torch.Generator().manual_seed(4)
    w1 = pmx.quantize(torch.randn(E, 2 * I, H, generator=g), axis=-1)
    w2 = pmx.quantize(torch.randn(E, H, I, generator=g), axis=-1)
    full = pmx.nn.MXExperts.from_mx(w1, w2, torch.zeros(E, 2 * I).bfloat16(), torch.zeros(E, H).bfloat16())
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.experts = full
    sd = {f"{PREFIX.format(0)}.{n}": t for n, t in full.state_dict().items() if n != "down_proj_bias"}
    gpt_oss.save(tmp_path / "c", sd, config())
    with pytest.raises(ValueError, match=r"experts\.down_proj_bias: the model's MXExperts has this bias but the "
                                         r"checkpoint stores none"):
        gpt_oss.load_experts(model, tmp_path / "c")


def _one_layer_model(experts: torch.nn.Module) -> torch.nn.Module:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].mlp = torch.nn.Module()
    model.model.layers[0].mlp.experts = experts
    return model


@pytest.mark.parametrize("e,h,i", [(E + 2, H, I), (E, H, 2 * I), (E, 2 * H, I)])
def test_load_experts_refuses_experts_of_another_size(tmp_path, e, h, i):
    """A checkpoint of E=2, H=64, I=32 experts loaded into a model built for others: a
    CheckpointError naming the module and both shapes, and the model left as it was (the
    experts were swapped in, and the model ran on experts its config does not describe, or
    failed later in forward with a message about token ids or x's width)."""
    g = torch.Generator().manual_seed(5)
    w1 = pmx.quantize(torch.randn(E, 2 * I, H, generator=g), axis=-1)
    w2 = pmx.quantize(torch.randn(E, H, I, generator=g), axis=-1)
    ckpt = pmx.nn.MXExperts.from_mx(w1, w2, torch.zeros(E, 2 * I).bfloat16(), torch.zeros(E, H).bfloat16())
    gpt_oss.save(tmp_path / "c", {f"{PREFIX.format(0)}.{n}": t for n, t in ckpt.state_dict().items()}, config())
    other = pmx.nn.MXExperts(e, h, i, activation="swiglu_oai", transposed=True, dtype=torch.bfloat16)
    model = _one_layer_model(other)
    with pytest.raises(gpt_oss.CheckpointError, match=r"experts: .*gate_up_proj weights of shape \[2, 64, 64\]"):
        gpt_oss.load_experts(model, tmp_path / "c")
    assert model.model.layers[0].mlp.experts is other


def _hook(module, *args) -> None:
    _HOOKED.append(module)


_HOOKED: list = []


def test_load_experts_hands_a_load_hook_to_the_new_module_only_once_swapped(tmp_path):
    """register_load_state_dict_pre_hook keeps its module: the new experts take the hook
    over when load_experts swaps them in; a load refused at a later layer leaves every
    module as it was, its hooks included (the hook was bound to the discarded new module,
    and once that was collected the model's load_state_dict and deepcopy raised; review)."""
    import copy
    import gc

    g = torch.Generator().manual_seed(6)

    def experts(i=I):
        return pmx.nn.MXExperts.from_mx(pmx.quantize(torch.randn(E, 2 * i, H, generator=g), axis=-1),
                                        pmx.quantize(torch.randn(E, H, i, generator=g), axis=-1),
                                        torch.zeros(E, 2 * i).bfloat16(), torch.zeros(E, H).bfloat16())

    sd = {f"{PREFIX.format(n)}.{k}": t for n in range(2) for k, t in experts().state_dict().items()}
    gpt_oss.save(tmp_path / "c", sd, config())
    first, second = experts(), experts()
    model = _one_layer_model(first)
    model.model.layers.append(_one_layer_model(second).model.layers[0])
    first.register_load_state_dict_pre_hook(_hook)
    gpt_oss.load_experts(model, tmp_path / "c")
    new = model.model.layers[0].mlp.experts
    assert new is not first
    del first
    gc.collect()
    _HOOKED.clear()
    model.load_state_dict(model.state_dict())
    copy.deepcopy(model)
    assert _HOOKED == [new]
    # layer 1 of another size: refused, and layer 0's hook is still its own
    first, other = experts(), experts(2 * I)
    model = _one_layer_model(first)
    model.model.layers.append(_one_layer_model(other).model.layers[0])
    first.register_load_state_dict_pre_hook(_hook)
    with pytest.raises(gpt_oss.CheckpointError, match=r"layers\.1\.mlp\.experts"):
        gpt_oss.load_experts(model, tmp_path / "c")
    gc.collect()
    _HOOKED.clear()
    model.load_state_dict(model.state_dict())
    copy.deepcopy(model)
    assert model.model.layers[0].mlp.experts is first and _HOOKED == [first]


def test_an_index_without_a_weight_map_is_a_checkpoint_error(tmp_path):
    (tmp_path / gpt_oss.INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(gpt_oss.CheckpointError, match="weight_map"):
        gpt_oss.GptOssCheckpoint(tmp_path)


# ----------------------------------------------------------------------------- hostile folders and files


def sharded(d, seed: int = 2) -> dict:
    """A two-shard checkpoint of state_dict(seed) in d; returns the quantized mapping."""
    q = gpt_oss.quantize_experts(state_dict(seed))
    stored = sorted(s for n, v in q.items() for s, _ in gpt_oss._stored_tensors(n, v))
    first = [s for s in stored if "layers.0" in s]
    gpt_oss.save(d, q, config(), shards={"model-00001-of-00002.safetensors": first,
                                         "model-00002-of-00002.safetensors": [s for s in stored if s not in first]})
    return q


def logical(ckpt) -> dict:
    """name -> stored bytes of every tensor of a checkpoint (MXTensors as qdata, scales)."""
    out = {}
    for name in ckpt:
        v = ckpt[name]
        out[name] = (v.qdata.clone(), v.scales.clone()) if isinstance(v, pmx.MXTensor) else (v.clone(),)
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(len(a[k]) == len(b[k]) and all(torch.equal(x, y) for x, y in zip(a[k], b[k]))
                                        for k in a)


def test_a_tensor_stored_in_two_shards_is_refused(tmp_path):
    """A tensor stored in two shards (a stale copy left in another one) was read from
    whichever file came last; readers disagree on which copy they take (transformers the
    last file's, whatever the index says), so it is refused, naming both files. A tensor
    a shard holds that the index does not list is read with that shard, as transformers
    reads it."""
    d = tmp_path / "c"
    sharded(d)
    name = "model.layers.0.mlp.router.weight"
    index = json.loads((d / gpt_oss.INDEX_FILE).read_text())
    assert index["weight_map"][name] == "model-00001-of-00002.safetensors"
    truth = gpt_oss.GptOssCheckpoint(d)[name].clone()
    other = d / "model-00002-of-00002.safetensors"
    tensors = st.load_file(str(other))
    st.save_file({**tensors, name: torch.zeros_like(truth)}, str(other), metadata={"format": "pt"})
    with pytest.raises(gpt_oss.CheckpointError, match=rf"{name}: stored in both model-0000[12]-of-00002\.safetensors "
                                                      r"and model-0000[12]-of-00002\.safetensors"):
        gpt_oss.GptOssCheckpoint(d)
    st.save_file({**tensors, "extra.unlisted": torch.ones(3)}, str(other), metadata={"format": "pt"})
    ckpt = gpt_oss.GptOssCheckpoint(d)
    assert torch.equal(ckpt["extra.unlisted"], torch.ones(3)) and torch.equal(ckpt[name], truth)
    index["weight_map"][name] = "model-00002-of-00002.safetensors"  # (the index naming another file)
    (d / gpt_oss.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(gpt_oss.CheckpointError, match=rf"{name}: listed in .* under model-00002.* but stored in "
                                                      r"model-00001"):
        gpt_oss.GptOssCheckpoint(d)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/x.safetensors", "ABSOLUTE", None])
def test_shard_names_outside_the_folder_are_refused(tmp_path, shard):
    """An index naming a shard outside its folder (or no file) is refused on opening, and
    save refuses such a shard name before writing anything: neither reads nor writes there."""
    d = tmp_path / "c"
    q = sharded(d)
    if shard == "ABSOLUTE":
        shard = str(tmp_path / "elsewhere.safetensors")
    index = json.loads((d / gpt_oss.INDEX_FILE).read_text())
    victim = next(iter(index["weight_map"]))
    index["weight_map"][victim] = shard
    (d / gpt_oss.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(gpt_oss.CheckpointError, match=rf"{victim}: shard .* is not a plain file name"):
        gpt_oss.GptOssCheckpoint(d)
    if shard is None:
        return
    stored = [s for n, v in q.items() for s, _ in gpt_oss._stored_tensors(n, v)]
    with pytest.raises(gpt_oss.CheckpointError, match="is not a plain file name"):
        gpt_oss.save(tmp_path / "out", q, config(), shards={shard: stored})
    assert not (tmp_path / "out").exists() and not (tmp_path / "outside.safetensors").exists()
    assert not (tmp_path / "elsewhere.safetensors").exists()


def test_save_over_an_earlier_checkpoint_leaves_nothing_a_reader_would_take(tmp_path):
    """Saving into a folder that holds an earlier checkpoint removes the earlier weight
    files a reader would prefer or mix in (transformers prefers model.safetensors to an
    index; this reader the index): both readers then see the new tensors only."""
    d = tmp_path / "c"
    sharded(d, seed=2)
    new = gpt_oss.quantize_experts(state_dict(5))
    gpt_oss.save(d, new, config())  # sharded -> one file
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    one = logical(gpt_oss.GptOssCheckpoint(d))
    assert same(one, logical(gpt_oss.GptOssCheckpoint(d / "model.safetensors")))
    sharded(d, seed=7)  # one file -> sharded
    assert not (d / "model.safetensors").exists()
    again = logical(gpt_oss.GptOssCheckpoint(d))
    assert not same(one, again)
    sharded(tmp_path / "ref", seed=7)
    assert same(again, logical(gpt_oss.GptOssCheckpoint(tmp_path / "ref")))
    other = d / "notes.txt"
    other.write_text("kept")
    gpt_oss.save(d, new, None)  # config=None keeps config.json; files that are no weights stay
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]


def test_save_refuses_model_safetensors_among_several_shards(tmp_path):
    q = gpt_oss.quantize_experts(state_dict())
    stored = sorted(s for n, v in q.items() for s, _ in gpt_oss._stored_tensors(n, v))
    with pytest.raises(ValueError, match="model.safetensors is the name of a one-file checkpoint"):
        gpt_oss.save(tmp_path / "c", q, config(), shards={"model.safetensors": stored[:3], "model-2.safetensors":
                                                          stored[3:]})
    assert not (tmp_path / "c").exists()


def test_a_folder_with_both_a_single_file_and_an_index_is_refused(tmp_path):
    d = tmp_path / "c"
    sharded(d)
    st.save_file({"x": torch.zeros(1)}, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(gpt_oss.CheckpointError, match="holds both model.safetensors and"):
        gpt_oss.GptOssCheckpoint(d)


def test_resharding_a_checkpoint_over_itself_keeps_every_tensor(tmp_path):
    """save(src, GptOssCheckpoint(src), shards=<other grouping>) wrote shard 1 over the file
    it still had to read shard 2's tensors from: it failed halfway and lost tensors. Every
    file is now written under a temporary name and renamed at the end."""
    d = tmp_path / "c"
    sharded(d)
    before = logical(gpt_oss.GptOssCheckpoint(d))
    ckpt = gpt_oss.GptOssCheckpoint(d)
    names = [s for file in ckpt.shards for s in ckpt.shards[file]]
    regroup = {"model-00001-of-00002.safetensors": [s for s in names if "layers.1" in s],
               "model-00002-of-00002.safetensors": [s for s in names if "layers.1" not in s]}
    gpt_oss.save(d, ckpt, ckpt.config, shards=regroup)
    assert same(before, logical(gpt_oss.GptOssCheckpoint(d)))
    assert not [p.name for p in d.iterdir() if p.name.endswith(".partial")]
    gpt_oss.save(d, gpt_oss.GptOssCheckpoint(d), ckpt.config, shards={"model.safetensors": names})
    assert sorted(p.name for p in d.iterdir()) == ["config.json", "model.safetensors"]
    assert same(before, logical(gpt_oss.GptOssCheckpoint(d)))


def test_a_failed_save_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    d = tmp_path / "c"
    sharded(d)
    before = digests(d)
    real = st.save_file
    calls, fail_at = [], [1]

    def failing(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == fail_at[0]:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(st, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):  # one file over two shards
        gpt_oss.save(d, gpt_oss.quantize_experts(state_dict(9)), config())
    calls.clear()
    fail_at[0] = 2
    with pytest.raises(OSError, match="disk full"):  # the second of two shards (the first was written)
        gpt_oss.save(d, gpt_oss.quantize_experts(state_dict(9)), config(),
                      shards=gpt_oss.GptOssCheckpoint(d).shards)
    assert len(calls) == 2
    assert digests(d) == before


def test_tied_weights_are_refused_before_writing(tmp_path):
    sd = gpt_oss.quantize_experts(state_dict())
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tie_word_embeddings: one tensor, two names
    with pytest.raises(gpt_oss.CheckpointError, match=r"lm_head\.weight and model\.embed_tokens\.weight share "
                                                      r"memory|model\.embed_tokens\.weight and lm_head\.weight share"):
        gpt_oss.save(tmp_path / "out", sd, config())
    assert not (tmp_path / "out").exists()
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    gpt_oss.save(tmp_path / "out", sd, config())
    # views of one buffer that do not overlap (vector_to_parameters makes them), an empty view,
    # and a strided one (written from a copy) are no tied weights
    flat = torch.randn(2 * 16 * H).bfloat16()
    sd["lm_head.weight"], sd["model.embed_tokens.weight"] = flat[: 16 * H].view(16, H), flat[16 * H:].view(16, H)
    sd["model.norm.weight"], sd["model.empty"] = flat[::2][:H], flat[:0]
    gpt_oss.save(tmp_path / "views", sd, config())
    back = gpt_oss.GptOssCheckpoint(tmp_path / "views")
    assert torch.equal(back["model.embed_tokens.weight"], flat[16 * H:].view(16, H))
    assert torch.equal(back["model.norm.weight"], flat[::2][:H])


def test_a_file_without_metadata_is_written_back_without_it(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    raw = raw_layer()
    st.save_file(raw, str(d / "model.safetensors"))  # no __metadata__
    (d / "config.json").write_text(json.dumps(config()))
    ckpt = gpt_oss.GptOssCheckpoint(d)
    assert ckpt.file_metadata == {"model.safetensors": None}
    gpt_oss.save(tmp_path / "again", ckpt, None)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (d / "model.safetensors").read_bytes()


def test_unreadable_json_and_another_quant_method_name_the_file(tmp_path):
    d = tmp_path / "c"
    write_raw(d, raw_layer())
    (d / "config.json").write_text("{not json")
    with pytest.raises(gpt_oss.CheckpointError, match=r"config\.json: not valid JSON"):
        gpt_oss.GptOssCheckpoint(d)
    (d / "config.json").write_text(json.dumps({**config(), "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(gpt_oss.CheckpointError, match=r"config\.json: quantization_config's quant_method is 'fp8'"):
        gpt_oss.GptOssCheckpoint(d)


def test_save_takes_a_config_object_with_to_dict(tmp_path):
    class Config:  # (what a transformers PretrainedConfig offers)
        def to_dict(self):
            return config()

    gpt_oss.save(tmp_path / "a", gpt_oss.quantize_experts(state_dict()), Config())
    assert json.loads((tmp_path / "a" / "config.json").read_text())["hidden_size"] == H
    with pytest.raises(TypeError, match="config must be config.json's content"):
        gpt_oss.save(tmp_path / "b", gpt_oss.quantize_experts(state_dict()), ["not", "a", "config"])
