"""PrecisionContract: presets, rule precedence, errors, summary."""

import pytest
import torch.nn as nn

from fp4rl.precision import PrecisionContract, layer_index, module_kind


def _mlp(d, f):
    m = nn.Module()
    m.gate_proj, m.up_proj, m.down_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), \
        nn.Linear(f, d, bias=False)
    return m


def tiny_model(num_layers=4, moe=True, d=32, f=64, experts=4, ef=16, fused_experts=False):
    """A module tree with Hugging Face names (Qwen2-MoE when moe=True, Llama otherwise)."""
    root, model = nn.Module(), nn.Module()
    root.model = model
    model.embed_tokens = nn.Embedding(64, d)
    model.layers = nn.ModuleList()
    for _ in range(num_layers):
        layer, attn = nn.Module(), nn.Module()
        attn.q_proj, attn.k_proj, attn.v_proj = nn.Linear(d, d), nn.Linear(d, 16), nn.Linear(d, 16)
        attn.o_proj = nn.Linear(d, d, bias=False)
        layer.self_attn = attn
        if moe:
            mlp = nn.Module()
            mlp.gate = nn.Linear(d, experts, bias=False)
            if fused_experts:  # the transformers 5 layout
                mlp.experts = nn.Module()
                mlp.experts.gate_up_proj = nn.Parameter(nn.init.zeros_(nn.Linear(1, 1).weight.new_empty(
                    experts, 2 * ef, d)))
            else:
                mlp.experts = nn.ModuleList(_mlp(d, ef) for _ in range(experts))
            mlp.shared_expert = _mlp(d, f)
            mlp.shared_expert_gate = nn.Linear(d, 1, bias=False)
        else:
            mlp = _mlp(d, f)
        layer.mlp = mlp
        layer.input_layernorm, layer.post_attention_layernorm = nn.LayerNorm(d), nn.LayerNorm(d)
        model.layers.append(layer)
    model.norm = nn.LayerNorm(d)
    root.lm_head = nn.Linear(d, 64, bias=False)
    return root


def test_kinds_and_layers():
    assert module_kind("model.layers.3.self_attn.q_proj") == "attention"
    assert module_kind("model.layers.3.mlp.gate_proj") == "mlp"
    assert module_kind("model.layers.3.mlp.gate") == "router"
    assert module_kind("model.layers.3.mlp.shared_expert_gate") == "router"
    assert module_kind("model.layers.3.mlp.experts.7.down_proj") == "routed_experts"
    assert module_kind("model.layers.3.mlp.shared_expert.up_proj") == "shared_experts"
    assert module_kind("model.layers.3.input_layernorm") == "norms"
    assert module_kind("model.norm") == "norms"
    assert module_kind("model.embed_tokens") == "embeddings"
    assert module_kind("lm_head") == "lm_head"
    assert layer_index("model.layers.12.mlp.experts.3.up_proj") == 12
    assert layer_index("model.layers.12") == 12
    assert layer_index("lm_head") is None


def test_bf16_preset_resolves_every_linear_to_bf16():
    model = tiny_model()
    resolved = PrecisionContract("bf16").resolve(model)
    assert len(resolved) == sum(isinstance(m, nn.Linear) for m in model.modules())
    assert set(resolved.values()) == {"bf16"}


def test_last_fraction_rounds_to_the_nearest_and_keeps_one():
    c = PrecisionContract("nvfp4-linear")
    assert list(c.bf16_last_layers(4)) == [3]  # 0.6 -> 1
    assert list(c.bf16_last_layers(2)) == [1]  # 0.3: at least one
    assert list(c.bf16_last_layers(20)) == [17, 18, 19]  # 0.15 * 20 = 3.0000000000000004 -> 3
    assert len(c.bf16_last_layers(48)) == 7  # 7.2: the recipe's 7 of 48 (Qwen3-30B-A3B)
    assert len(c.bf16_last_layers(30)) == 5  # 4.5 (a float ulp under): halves up
    assert len(c.bf16_last_layers(36)) == 5  # 5.4
    assert len(c.bf16_last_layers(7)) == 1  # 1.05
    assert list(PrecisionContract("nvfp4-linear", bf16_last_fraction=0).bf16_last_layers(8)) == []
    assert list(PrecisionContract("nvfp4-linear", bf16_last_fraction=1).bf16_last_layers(3)) == [0, 1, 2]


def test_nvfp4_experts_on_qwen2_moe_quantizes_routed_experts_only():
    model = tiny_model(num_layers=7)  # round(0.15 * 7) = 1 -> layer 6 BF16
    c = PrecisionContract("nvfp4-experts")
    resolved = c.resolve(model)
    quantized = {n for n, p in resolved.items() if p != "bf16"}
    assert set(resolved[n] for n in quantized) == {"w4a4"}
    expected = {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(6) for e in range(4)
                for p in ("gate_proj", "up_proj", "down_proj")}
    assert quantized == expected
    text = c.summary(model)
    lines = {line[:18].strip(): line for line in text.splitlines()[3:]}  # kind label -> row
    experts_params = 7 * 4 * 3 * 32 * 16
    routed = lines["routed experts"].split()
    assert routed[2:4] == [f"{experts_params:,}", f"{6 * 4 * 3 * 32 * 16:,}"]  # total, NVFP4
    assert routed[-1] == f"{100 * 6 / 7:.1f}%"
    for kind in ("attention", "shared experts", "router", "lm_head", "embeddings", "norms"):
        assert lines[kind].split()[-1] == "0.0%", kind
    assert "= 1 BF16: 6" in text
    assert "layers with every linear BF16: 6" in text


def test_nvfp4_linear_and_w4a16_presets():
    model = tiny_model(num_layers=4, moe=False)
    for preset, prec in (("nvfp4-linear", "w4a4"), ("nvfp4-w4a16", "w4a16")):
        resolved = PrecisionContract(preset).resolve(model)
        for name, p in resolved.items():
            in_decoder = name.startswith("model.layers.") and layer_index(name) < 3
            assert p == (prec if in_decoder else "bf16"), name
    # MoE: routers stay BF16 even under nvfp4-linear; shared experts and attention quantized
    resolved = PrecisionContract("nvfp4-linear").resolve(tiny_model(num_layers=4))
    assert resolved["model.layers.0.mlp.gate"] == resolved["model.layers.0.mlp.shared_expert_gate"] == "bf16"
    assert resolved["model.layers.0.mlp.shared_expert.up_proj"] == "w4a4"
    assert resolved["model.layers.0.self_attn.k_proj"] == "w4a4"
    assert resolved["model.layers.3.self_attn.k_proj"] == "bf16"
    assert resolved["lm_head"] == "bf16"


def test_rules_later_wins_and_override_last_layers():
    model = tiny_model(num_layers=4)
    c = PrecisionContract("nvfp4-experts", rules=[
        ("model.layers.*.self_attn.*", "w4a16"),
        ("model.layers.0.*", "bf16"),  # later: wins over the attention rule for layer 0
        ("model.layers.3.mlp.experts.*", "w4a4"),  # overrides the last-layer rule
        ("lm_head", "w4a16"),
    ])
    r = c.resolve(model)
    assert r["model.layers.0.self_attn.q_proj"] == "bf16"
    assert r["model.layers.0.mlp.experts.1.up_proj"] == "bf16"
    assert r["model.layers.1.self_attn.q_proj"] == "w4a16"
    assert r["model.layers.3.self_attn.q_proj"] == "w4a16"
    assert r["model.layers.3.mlp.experts.2.down_proj"] == "w4a4"
    assert r["model.layers.2.mlp.experts.2.down_proj"] == "w4a4"
    assert r["lm_head"] == "w4a16"
    # the same rules in the other order: the attention rule now wins for layer 0
    swapped = PrecisionContract("nvfp4-experts", rules={"model.layers.0.*": "bf16",
                                                        "model.layers.*.self_attn.*": "w4a16"})
    assert swapped.rules[0] == ("model.layers.0.*", "bf16")
    assert swapped.resolve(model)["model.layers.0.self_attn.q_proj"] == "w4a16"


@pytest.mark.parametrize("kwargs, message", [
    (dict(preset="nvfp4"), "unknown preset"),
    (dict(bf16_last_fraction=1.5), "bf16_last_fraction"),
    (dict(bf16_last_fraction=-0.1), "bf16_last_fraction"),
    (dict(weight_err="l1"), "weight_err"),
    (dict(act_err="max"), "act_err"),
    (dict(weight_tile=32), "weight_tile"),
    (dict(backward="fp8"), "backward"),
    (dict(weight_four_over_six="yes"), "weight_four_over_six"),
    (dict(weight_four_over_six=False, weight_err="mae"), "weight_err='mae' chooses between the 4/6 scalings"),
    (dict(act_four_over_six=False, act_err="mae"), "act_err='mae'.*set act_four_over_six = true"),
    (dict(rules=[("*", "fp4")]), "precision must be one of"),
    (dict(rules=["*"]), "not a \\(glob, precision\\) pair"),
])
def test_construction_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrecisionContract(**kwargs)


def test_tile_forms():
    assert PrecisionContract(weight_tile="16x16").weight_tile == (16, 16)
    assert PrecisionContract(weight_tile=[16, 16]).weight_tile == (16, 16)
    assert PrecisionContract(weight_tile="1x16").weight_tile == 16
    kw = PrecisionContract(weight_tile=(16, 16), weight_four_over_six=False, act_err="mae")
    assert kw.weight_quantize_kwargs() == dict(tile=(16, 16), scale_rule="6", err="mse", scale_scope="tensor")
    assert kw.input_quantize_kwargs() == dict(tile=16, scale_rule="4/6", err="mae", scale_scope="row")


def test_resolve_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="matches no nn.Linear.*non-linear modules.*embed_tokens"):
        PrecisionContract("nvfp4-experts", rules=[("model.embed_tokens", "w4a4")]).resolve(model)
    with pytest.raises(ValueError, match="matches no nn.Linear"):
        PrecisionContract("bf16", rules=[("model.layer.*.q_proj", "w4a4")]).resolve(model)  # typo
    with pytest.raises(ValueError, match="routers must stay BF16"):
        PrecisionContract("bf16", rules=[("model.layers.*", "w4a4")]).resolve(model)
    ok = PrecisionContract("bf16", rules=[("model.layers.*", "w4a4"), ("*.mlp.gate", "bf16"),
                                          ("*.shared_expert_gate", "bf16")]).resolve(model)
    assert ok["model.layers.3.mlp.experts.0.up_proj"] == "w4a4"
    with pytest.raises(ValueError, match="no routed experts.*nvfp4-linear"):
        PrecisionContract("nvfp4-experts").resolve(tiny_model(moe=False))
    with pytest.raises(ValueError, match="fused 3D parameters"):
        PrecisionContract("nvfp4-experts").resolve(tiny_model(fused_experts=True))
    flat = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="no decoder layers"):
        PrecisionContract("nvfp4-linear").resolve(flat)
    assert PrecisionContract("bf16").resolve(flat) == {"0": "bf16"}


def test_summary_counts_tied_weights_once_and_bias_as_bf16():
    model = tiny_model(num_layers=2, moe=False)
    model.lm_head.weight = model.model.embed_tokens.weight
    c = PrecisionContract("nvfp4-linear", bf16_last_fraction=0.5)
    text = c.summary(model)
    total = sum(p.numel() for p in model.parameters())
    nvfp4 = sum(m.weight.numel() for n, m in model.named_modules()
                if isinstance(m, nn.Linear) and n.startswith("model.layers.0."))
    total_line = next(line for line in text.splitlines() if line.strip().startswith("total")).split()
    assert total_line[1:3] == [f"{total:,}", f"{nvfp4:,}"]
    assert "layers with every linear BF16: 1" in text
    assert "tied (counted once, under the first owner): lm_head.weight is model.embed_tokens.weight" in text


def test_an_nvfp4_lm_head_tied_to_the_embeddings_is_refused_in_resolve():
    """tie_word_embeddings with an NVFP4 lm_head was accepted: summary() miscounted, the sampler copy got a
    stray weight and export refused the checkpoint only after training. resolve refuses it, as export does."""
    from fp4rl.model import CausalLM, ModelConfig

    kw = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tied = CausalLM(ModelConfig(**kw, tie_word_embeddings=True))
    for precision in ("w4a16", "w4a4"):
        for preset in ("bf16", "nvfp4-linear"):
            c = PrecisionContract(preset, rules=(("lm_head", precision),))
            with pytest.raises(ValueError, match=rf"lm_head resolves to {precision} but is tied to "
                               r"embed_tokens \(tie_word_embeddings\).*Keep lm_head BF16"):
                c.resolve(tied)
            with pytest.raises(ValueError, match="Keep lm_head BF16"):
                c.summary(tied)
    # a later rule sending it back to BF16, a preset (which keeps lm_head BF16), an untied model: accepted
    back = PrecisionContract("bf16", rules=(("lm_head", "w4a4"), ("lm_head", "bf16")))
    assert back.resolve(tied)["lm_head"] == "bf16"
    assert PrecisionContract("nvfp4-linear").resolve(tied)["lm_head"] == "bf16"
    untied = CausalLM(ModelConfig(**kw, tie_word_embeddings=False))
    assert PrecisionContract("bf16", rules=(("lm_head", "w4a16"),)).resolve(untied)["lm_head"] == "w4a16"


def test_fp4rl_qwen2_moe_model_under_nvfp4_experts():
    from fp4rl.model import CausalLM, ModelConfig

    cfg = ModelConfig(model_type="qwen2_moe", vocab_size=96, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      qkv_bias=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64)
    model = CausalLM(cfg)
    c = PrecisionContract("nvfp4-experts")
    resolved = c.resolve(model)
    assert len(resolved) == sum(isinstance(m, nn.Linear) for m in model.modules())
    quantized = {n for n, p in resolved.items() if p == "w4a4"}
    assert quantized == {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in range(6) for e in range(4)
                         for p in ("gate_proj", "up_proj", "down_proj")}
    assert set(resolved.values()) == {"bf16", "w4a4"}
    text = c.summary(model)
    rows = {line[:18].strip(): line.split()[-1] for line in text.splitlines()[3:]}
    assert rows["routed experts"] == f"{100 * 6 / 7:.1f}%"
    assert all(rows[k] == "0.0%" for k in ("attention", "shared experts", "router", "lm_head", "embeddings"))
    assert "round(0.15 * 7) = 1 BF16: 6" in text


def test_resolve_reads_a_samplers_packed_model():
    """resolve / summary also take a Sampler's model, whose packed NVFP4 linears hold bytes, not .weight."""
    import torch

    from fp4rl.model import CausalLM, ModelConfig
    from fp4rl.qat import convert
    from fp4rl.sampler import Sampler

    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    c = PrecisionContract("nvfp4-linear")
    model = convert(CausalLM(config), c)
    sampler = Sampler(model, eos_token_ids=[])
    assert c.resolve(sampler.model) == c.resolve(model)
    assert "decoder layers: 4" in c.summary(sampler.model)


def test_an_nvfp4_preset_that_would_quantize_nothing_is_refused():
    """Every decoder layer among the BF16-kept last ones (1 layer at the default 0.15, or a fraction of 1):
    the model would train and sample in BF16 under an NVFP4 label; refused, naming the fix."""
    with pytest.raises(ValueError, match=r"quantizes nothing.*1 decoder layer\(s\).*bf16_last_fraction=0.15"):
        PrecisionContract("nvfp4-linear").resolve(tiny_model(num_layers=1, moe=False))
    with pytest.raises(ValueError, match=r"quantizes nothing.*Lower bf16_last_fraction"):
        PrecisionContract("nvfp4-w4a16", bf16_last_fraction=1.0).resolve(tiny_model(num_layers=3))
    with pytest.raises(ValueError, match="quantizes nothing"):  # rules that send everything back to BF16
        PrecisionContract("nvfp4-linear", bf16_last_fraction=0.0,
                          rules=[("model.layers.*", "bf16")]).resolve(tiny_model(num_layers=2, moe=False))
    resolved = PrecisionContract("nvfp4-linear", bf16_last_fraction=0.0).resolve(tiny_model(1, moe=False))
    assert "w4a4" in resolved.values()  # one layer, nothing kept BF16: quantized
