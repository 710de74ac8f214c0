"""A tiny gpt-oss and one Qwen3-MoE layer (and the families with its expert layout) end to
end on the CPU, against transformers.

gpt-oss: GptOssForCausalLM from a small config (2 layers, 4 experts, random weights), its
experts quantized and saved in the gpt-oss layout by portable_mx's writer; transformers'
own loader (Mxfp4Config(dequantize=True): the CPU path, bf16) and the same model with its
experts on portable_mx (W4A16 grouped GEMMs on the checkpoint's bytes) give the same
logits up to bf16 rounding; save -> load -> save is byte-identical. Qwen3-MoE: one
Qwen3MoeSparseMoeBlock with quantized experts against the block's own forward on the
dequantized weights. Needs transformers and safetensors (the `hf` extra)."""

import hashlib
import json
import warnings

import pytest
import torch

import portable_mx as pmx
from portable_mx.checkpoints import gpt_oss
from portable_mx.nn import MXExperts

transformers = pytest.importorskip("transformers", reason='needs transformers: pip install "portable_mx[hf]"')
pytest.importorskip("safetensors", reason='needs safetensors: pip install "portable_mx[hf]"')

W4A16 = pmx.QuantRecipe(activations="bf16")
BF16_ULP = 2.0 ** -7  # the spacing of bf16 numbers in [1, 2)


def digests(d) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    """(config, checkpoint dir): a random tiny GptOss written by portable_mx's writer."""
    cfg = transformers.GptOssConfig(
        num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, hidden_size=64, intermediate_size=96,
        head_dim=16, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, sliding_window=8,
        max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # routers with a spread, so that routing is not a near-tie anywhere
        for layer in model.model.layers:
            layer.mlp.router.weight.normal_(0, 0.5)
            layer.mlp.experts.gate_up_proj.normal_(0, 0.2)
            layer.mlp.experts.down_proj.normal_(0, 0.2)
            layer.mlp.experts.gate_up_proj_bias.normal_(0, 0.1)
            layer.mlp.experts.down_proj_bias.normal_(0, 0.1)
    sd = {k: v if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v.bfloat16()
          for k, v in model.state_dict().items()}
    path = tmp_path_factory.mktemp("gpt_oss") / "ckpt"
    gpt_oss.save(path, gpt_oss.quantize_experts(sd), cfg.to_dict())
    return cfg, path


def load(path, dtype=torch.bfloat16):
    """transformers' loader on a CPU: MXFP4 experts dequantized to `dtype`."""
    return transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=dtype).eval()


def test_transformers_loads_our_checkpoint_to_our_values(gpt_oss_checkpoint):
    _, path = gpt_oss_checkpoint
    ckpt = gpt_oss.GptOssCheckpoint(path)
    hf = load(path)
    for layer in range(2):
        experts = hf.model.layers[layer].mlp.experts  # [E, in, out] bf16
        ours = ckpt.experts(layer)
        for proj in ("gate_up_proj", "down_proj"):
            want = pmx.dequantize(ours[proj], dtype=torch.bfloat16).transpose(1, 2)
            assert torch.equal(getattr(experts, proj).data, want)
            assert torch.equal(getattr(experts, f"{proj}_bias").data, ours[f"{proj}_bias"])
    assert torch.equal(hf.model.layers[1].mlp.router.weight.data, ckpt["model.layers.1.mlp.router.weight"])


def test_gpt_oss_logits_match_transformers_and_save_is_byte_identical(gpt_oss_checkpoint, tmp_path, monkeypatch):
    """Tolerance: both models are bf16 and share every module but the experts. Inside
    them transformers rounds each GEMM output to bf16, adds the bias in bf16 and runs
    the SwiGLU in bf16; portable_mx accumulates in fp32, adds bias and activation in fp32
    and rounds once. Those roundings differ by a bf16 ulp here and there and reach the
    logits through the rest of the network: allowed, 4 bf16 ulps of the largest logit,
    and portable_mx must be at least as close as transformers' own bf16 model to the
    fp32 model of the same weights (within 2x). Wrong experts (re-initialized, the wrong
    activation, a dropped bias) move the logits by far more."""
    cfg, path = gpt_oss_checkpoint
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf = load(path)(ids).logits.float()
        fp32 = load(path, torch.float32)(ids).logits

    ours_model = gpt_oss.load_experts(load(path), path)  # the checkpoint's bytes, W4A16 by default
    assert sum(isinstance(m, MXExperts) and m.frozen for m in ours_model.modules()) == 2
    assert not any(type(m).__name__ == "GptOssExperts" for m in ours_model.modules())
    import portable_mx.nn.experts as experts_module

    calls = []
    real = experts_module.grouped_matmul
    monkeypatch.setattr(experts_module, "grouped_matmul",
                        lambda *a, **k: (calls.append(k.get("activation")), real(*a, **k))[1])
    with torch.no_grad():
        ours = ours_model(ids).logits.float()
    assert calls == ["swiglu_oai", None] * 2  # one grouped launch per projection per layer

    scale = hf.abs().max()
    assert (ours - hf).abs().max() <= 4 * BF16_ULP * scale
    assert (ours - fp32).abs().max() <= 2 * (hf - fp32).abs().max()

    # convert() of transformers' dequantized experts (float Parameters quantized per
    # forward) runs the same values: the same logits bit for bit
    converted = pmx.nn.convert(load(path), W4A16, skip=lambda name, m: isinstance(m, torch.nn.Linear))
    assert sum(isinstance(m, MXExperts) and not m.frozen for m in converted.modules()) == 2
    with torch.no_grad():
        assert torch.equal(converted(ids).logits.float(), ours)
    # the checkpoint's own modules_to_not_convert, as skip, keeps attention and the head in float too
    not_convert = gpt_oss.GptOssCheckpoint(path).config["quantization_config"]["modules_to_not_convert"]
    model = load(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (every pattern names modules: no typo warning)
        by_config = pmx.nn.convert(model, W4A16, skip=not_convert)
    assert not any(isinstance(m, pmx.nn.MXLinear) for m in by_config.modules())
    assert sum(isinstance(m, MXExperts) for m in by_config.modules()) == 2
    with torch.no_grad():
        assert torch.equal(by_config(ids).logits.float(), ours)

    # save -> load -> save: the loaded model's state dict is the checkpoint, byte for byte
    gpt_oss.save(tmp_path / "again", ours_model.state_dict(), gpt_oss.GptOssCheckpoint(path).config)
    assert digests(tmp_path / "again") == digests(path)


def test_transformers_save_of_a_dequantized_model_is_not_taken_for_mxfp4(gpt_oss_checkpoint, tmp_path):
    """transformers' save_pretrained of the dequantized model drops quantization_config
    and writes bf16 experts (5.23: under the _blocks names; 5.24: under the plain ones).
    Either way load_experts refuses it, naming the tensor or saying there are no MXFP4
    experts, and gpt_oss.save refuses the dequantized state dict."""
    _, path = gpt_oss_checkpoint
    hf = load(path)
    hf.save_pretrained(tmp_path / "resaved")
    with pytest.raises(ValueError, match=r"(_blocks: dtype BF16, expected U8|quantizes no experts)"):
        gpt_oss.load_experts(load(path), tmp_path / "resaved")
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj: a float expert weight"):
        gpt_oss.save(tmp_path / "ours", hf.state_dict(), hf.config.to_dict())


@pytest.mark.parametrize("via", ["from_mx", "convert"])
def test_qwen3_moe_layer_matches_the_block_on_dequantized_weights(via):
    """One Qwen3MoeSparseMoeBlock (4 experts, top-2, [gate | up] concatenated, SiLU, no
    biases): its experts quantized, the block's forward on the dequantized weights (bf16)
    against the same block with MXExperts (W4A16). Tolerance: as for gpt-oss, bf16
    roundings inside the experts, here 4 bf16 ulps of the largest output."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(2)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.normal_(0, 0.5)
        w1 = pmx.quantize(torch.randn(4, 64, 64) * 0.2, axis=-1)  # gate_up [E, 2I, H] along H
        w2 = pmx.quantize(torch.randn(4, 64, 32) * 0.2, axis=-1)  # down [E, H, I] along I
        block.experts.gate_up_proj.copy_(pmx.dequantize(w1))
        block.experts.down_proj.copy_(pmx.dequantize(w2))
    block = block.to(torch.bfloat16)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        ref = block(x).float()
    if via == "from_mx":
        block.experts = MXExperts.from_mx(w1, w2, activation="swiglu", recipe=W4A16)
    else:
        assert pmx.nn.convert(block, W4A16) is block and isinstance(block.experts, MXExperts)
        assert block.experts.gate_up_proj.dtype == torch.bfloat16 and not block.experts.transposed
    with torch.no_grad():
        ours = block(x).float()
    assert (ours - ref).abs().max() <= 4 * BF16_ULP * ref.abs().max()


def _stacked_block(family: str):
    """A tiny sparse-MoE block of a transformers family whose experts copy Qwen3-MoE's
    class (4 experts of hidden 64, intermediate 32, top-2), seeded, and the skip rule
    that keeps its other Linear layers (a shared expert) in float."""
    torch.manual_seed(2)
    common = dict(hidden_size=64, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        return MixtralSparseMoeBlock(transformers.MixtralConfig(intermediate_size=32, num_local_experts=4,
                                                                **common)), ()
    if family == "qwen2_moe":
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        cfg = transformers.Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                                          **common)
        return Qwen2MoeSparseMoeBlock(cfg), ("*shared_expert*",)
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    return OlmoeSparseMoeBlock(transformers.OlmoeConfig(intermediate_size=32, num_experts=4, **common)), ()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_families_with_qwen3_moes_expert_layout_convert_and_match_the_block(family):
    """Mixtral, Qwen2-MoE and OLMoE keep their experts in Qwen3-MoE's class under their
    own names (transformers >= 5): convert makes them MXExperts (no warning), and the
    block's forward with them equals the block's own forward on the dequantized weights
    (bf16) within 4 bf16 ulps of the largest output, as for Qwen3-MoE."""
    block, keep = _stacked_block(family)
    experts = block.experts
    e, two_i, h = experts.gate_up_proj.shape
    with torch.no_grad():
        for mod in block.modules():  # routers and a shared expert's gate: larger logits than the default init
            if mod is not experts:
                for p in mod.parameters(recurse=False):
                    p.normal_(0, 0.5)
        w1 = pmx.quantize(torch.randn(e, two_i, h) * 0.2, axis=-1)
        w2 = pmx.quantize(torch.randn(e, h, two_i // 2) * 0.2, axis=-1)
        experts.gate_up_proj.copy_(pmx.dequantize(w1))
        experts.down_proj.copy_(pmx.dequantize(w2))
    block = block.to(torch.bfloat16).eval()  # (eval: no router jitter in any family)
    x = torch.randn(2, 5, h, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        ref = block(x)
    ref = (ref[0] if isinstance(ref, tuple) else ref).float()
    # a predicate written for Linear layers is asked about the experts too, and fails
    # there (no out_features): it skips nothing there, and convert goes on
    linear_rule = lambda name, m: m.out_features == 1  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "stays in float" warning
        assert pmx.nn.convert(block, W4A16, skip=(*keep, linear_rule)) is block
    assert isinstance(block.experts, MXExperts) and block.experts.activation == "swiglu"
    assert block.experts.gate_up_proj is experts.gate_up_proj  # the Parameters shared, not copied
    with torch.no_grad():
        ours = block(x)
    ours = (ours[0] if isinstance(ours, tuple) else ours).float()
    assert (ours - ref).abs().max() <= 4 * BF16_ULP * ref.abs().max()


def test_expert_modules_convert_does_not_map_stay_in_float_and_are_named():
    """A transformers expert module whose decorator attributes say another layout (here a
    Mixtral expert module marked with a post-expert norm, as MuseSpark's is; likewise
    Aria's transposed, NemotronH's gateless, DeepSeek-V4's own gate) or whose activation is
    not SiLU stays in float: one UserWarning names it and its class; skip silences it; the
    rest of the model converts."""
    block, _ = _stacked_block("mixtral")
    model = torch.nn.Sequential(block, torch.nn.Linear(64, 64))
    block.experts.has_post_expert_norm = True
    experts = block.experts
    with pytest.warns(UserWarning, match=r"1 transformers expert module\(s\) stay in float \('0\.experts' "
                                         r"\(MixtralExperts\)\)"):
        pmx.nn.convert(model)
    assert model[0].experts is experts and isinstance(model[1], pmx.nn.MXLinear)
    block2, _ = _stacked_block("mixtral")
    block2.experts.act_fn = torch.nn.GELU()
    shared = torch.nn.ModuleDict({"a": block2, "b": torch.nn.ModuleDict({"again": block2.experts})})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pmx.nn.convert(block2, skip="experts")  # skipped: nothing to say
        pmx.nn.convert(shared, skip="b.*")  # skipped under one of its two names: nothing to say
        with pytest.raises(UserWarning, match="stay in float"):
            pmx.nn.convert(block2)
    # a predicate written for Linear layers (no out_features on the expert module) makes no
    # failed convert: it skips nothing there, and the warning comes
    with pytest.warns(UserWarning, match="stay in float"):
        pmx.nn.convert(block2, skip=lambda name, m: m.out_features == 1)
    assert not isinstance(block2.experts, MXExperts)
    block3, _ = _stacked_block("mixtral")
    del block3.experts.act_fn  # (a child module: replaced by a plain attribute)
    block3.experts.act_fn = torch.nn.functional.silu  # the function itself, as LFM2-MoE keeps it: SiLU still
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pmx.nn.convert(block3)
    assert isinstance(block3.experts, MXExperts) and block3.experts.activation == "swiglu"


def test_convert_carries_an_expert_modules_hooks_and_additions():
    """convert took a transformers expert module's Parameters only: a forward hook on it
    stopped running (the block's output changed, no warning), a buffer and a child module
    a user added left the state dict (audit). Now MXExperts takes over its hook tables (a
    handle still removes the hook) and what was added, as the same objects; a child Linear
    is converted inside the new module; a name MXExperts uses is refused with the layer
    named, and nothing of the model changes."""
    block, _ = _stacked_block("mixtral")
    with torch.no_grad():
        for p in block.parameters():  # (transformers leaves the experts' weights uninitialised)
            p.normal_(0, 0.2)
    experts = block.experts
    calls = []
    handle = experts.register_forward_hook(lambda m, args, out: (calls.append(type(m).__name__), out * 0)[1])
    experts.register_buffer("mask", torch.ones(4))
    experts.register_parameter("gain", torch.nn.Parameter(torch.ones(64)))
    experts.adapter = torch.nn.Linear(64, 8)
    before = block.state_dict(keep_vars=True)
    x = torch.randn(1, 5, 64)
    with torch.no_grad():
        ref = block(x)
    ref = ref[0] if isinstance(ref, tuple) else ref
    assert calls == ["MixtralExperts"] and ref.abs().max() == 0  # (the hook zeroes the experts' sum)
    pmx.nn.convert(block, W4A16)
    new = block.experts
    assert isinstance(new, MXExperts)
    after = block.state_dict(keep_vars=True)
    assert sorted(after) == sorted(before) and all(after[k] is before[k] for k in before if "adapter" not in k)
    assert isinstance(new.adapter, pmx.nn.MXLinear) and new.adapter.weight is experts.adapter.weight
    with torch.no_grad():
        out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    assert calls == ["MixtralExperts", "MXExperts"] and out.abs().max() == 0
    handle.remove()
    with torch.no_grad():
        out = block(x)
    out = out[0] if isinstance(out, tuple) else out
    assert calls == ["MixtralExperts", "MXExperts"] and out.abs().max() > 0
    clash, _ = _stacked_block("mixtral")
    clash.experts.register_buffer("transposed", torch.zeros(1))
    old = clash.experts
    with pytest.raises(TypeError, match=r"convert: layer 'experts': experts_from_module: this MixtralExperts has a buffer 'transposed', a "
                                        r"name MXExperts uses itself.*skip=\['experts'\]"):
        pmx.nn.convert(clash)
    assert clash.experts is old


def test_a_parametrized_expert_module_is_named_not_silently_kept():
    """torch.nn.utils.parametrize makes an expert module a subclass of its own module
    (Parametrized<class>): convert kept it in float without a word (a parametrized Linear
    was named). Now the warning names it; skip silences it."""
    block, _ = _stacked_block("mixtral")
    torch.nn.utils.parametrize.register_parametrization(block.experts, "gate_up_proj", torch.nn.Identity())
    torch.nn.utils.parametrize.register_parametrization(block.experts, "down_proj", torch.nn.Identity())
    experts = block.experts
    with pytest.warns(UserWarning, match=r"1 parametrized layer\(s\) .* stay in float \('experts'\)"):
        pmx.nn.convert(block)
    assert block.experts is experts
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pmx.nn.convert(block, skip="experts")


def readme_blocks(marker: str = "readme-gpt-oss") -> list[str]:
    """The ```python blocks of README.md between `<!-- {marker}: ...` and its end marker."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index(f"<!-- {marker}:")
    section = text[start:text.index(f"<!-- {marker}: end -->", start)]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_readme_gpt_oss_example_runs(gpt_oss_checkpoint, tmp_path, monkeypatch, sharded):
    """The README's gpt-oss code, as written, on the tiny checkpoint named gpt-oss-20b, in
    one file and in shards with an index, as the published gpt-oss-20b is (the copy was
    one model.safetensors there: not the same files)."""
    import shutil

    _, path = gpt_oss_checkpoint
    if sharded:  # the same tensors in two shards, the layers' in the second
        ckpt = gpt_oss.GptOssCheckpoint(path)
        (names,) = ckpt.shards.values()
        second = [n for n in names if n.startswith("model.layers.1.")]
        shards = {"model-00001-of-00002.safetensors": [n for n in names if n not in second],
                  "model-00002-of-00002.safetensors": second}
        gpt_oss.save(tmp_path / "gpt-oss-20b", ckpt, ckpt.config, shards=shards,
                     index_metadata={"total_size": 1})
    else:
        shutil.copytree(path, tmp_path / "gpt-oss-20b")
    monkeypatch.chdir(tmp_path)
    blocks = readme_blocks()
    assert len(blocks) == 2
    scope: dict = {}
    exec(compile(blocks[0], "README.md (gpt-oss layer)", "exec"), scope)
    assert scope["y"].shape == (16, 64) and scope["y"].dtype == torch.bfloat16 and scope["y"].isfinite().all()
    exec(compile(blocks[1], "README.md (gpt-oss model)", "exec"), scope)
    assert scope["logits"].shape == (1, 3, 128)
    layer0 = scope["model"].model.layers[0].mlp.experts  # the model's layer-0 experts: the example's
    with torch.no_grad():
        assert torch.equal(layer0(scope["x"], scope["ids"], scope["top"].softmax(dim=-1)), scope["y"])
    assert digests(tmp_path / "gpt-oss-20b-copy") == digests(tmp_path / "gpt-oss-20b")


def test_convert_skips_experts_it_cannot_run_and_names_them_otherwise():
    """A Qwen3-MoE block with GELU experts (MXExperts' swiglu is SiLU): convert with
    skip="*experts" keeps them and converts the rest (it raised before the skip rules were
    asked); without the skip, the error names the layer and the skip that keeps it."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                      num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu")
    model = torch.nn.Sequential(Qwen3MoeSparseMoeBlock(cfg), torch.nn.Linear(64, 64))
    experts = model[0].experts
    with pytest.raises(ValueError, match=r"layer '0\.experts': .*SiLU.*skip=\['0\.experts'\]"):
        pmx.nn.convert(model)
    assert model[0].experts is experts and type(model[1]) is torch.nn.Linear  # nothing half-converted
    pmx.nn.convert(model, skip="*experts")
    assert model[0].experts is experts and isinstance(model[1], pmx.nn.MXLinear)


def test_mx_experts_bad_arguments_are_clear():
    m = MXExperts.from_mx(pmx.quantize(torch.randn(4, 64, 64), axis=-1), pmx.quantize(torch.randn(4, 64, 32), axis=-1))
    with pytest.raises(TypeError, match="top_k_weights must be a float tensor or None"):
        m(torch.randn(2, 64), torch.tensor([[0, 1], [2, 3]]), [[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        MXExperts(True, 64, 32)


def test_save_pretrained_after_load_experts_reloads_in_transformers_as_the_checkpoint(gpt_oss_checkpoint, tmp_path):
    """transformers drops quantization_config when it dequantizes gpt-oss; load_experts puts
    MXFP4 experts back, so the model's save_pretrained writes _blocks / _scales, and without
    the config transformers' from_pretrained took them for unknown tensors and initialized
    every expert at random (its log only). load_experts gives the model the checkpoint's
    quantization_config: the folder loads in transformers to exactly the model it loads
    from the original checkpoint (its own dequantized experts, logits bit for bit)."""
    cfg, path = gpt_oss_checkpoint
    model = load(path)
    assert getattr(model.config, "quantization_config", None) is None  # (what transformers leaves)
    gpt_oss.load_experts(model, path)
    model.save_pretrained(tmp_path / "resaved")
    saved = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "mxfp4"
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "resaved")(ids).logits, load(path)(ids).logits)
    # and the folder is a checkpoint portable_mx reads back to the same bytes
    again = gpt_oss.GptOssCheckpoint(tmp_path / "resaved").experts(1)["down_proj"]
    want = gpt_oss.GptOssCheckpoint(path).experts(1)["down_proj"]
    assert torch.equal(again.qdata, want.qdata) and torch.equal(again.scales, want.scales)


def test_experts_that_keep_their_weights_in_a_child_are_named_when_they_stay_in_float():
    """DBRX's experts hold their weights stacked 2-D in a child module (DbrxExpertGLU's
    w1, v1, w2), no 3-D Parameter on the experts module itself: convert left them in float
    without a word. They still stay (no family maps them), now with the warning."""
    if not hasattr(transformers, "DbrxConfig"):
        pytest.skip("this transformers has no DBRX")
    cfg = transformers.DbrxConfig(d_model=64, n_heads=4, n_layers=1, max_seq_len=64, vocab_size=128,
                                  attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                                  ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.warns(UserWarning, match=r"1 transformers expert module\(s\) stay in float "
                                         r"\('transformer\.blocks\.0\.ffn\.experts' \(DbrxExperts\)\)"):
        pmx.nn.convert(model)
    assert type(model.transformer.blocks[0].ffn.experts).__name__ == "DbrxExperts"
