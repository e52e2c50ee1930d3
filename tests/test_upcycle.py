"""fp4rl.upcycle: the MoE equals its dense source at initialisation, saves, loads, and trains."""

import dataclasses
import json

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from fp4rl.hf import load_model, save_model
from fp4rl.model import CausalLM, ModelConfig
from fp4rl.upcycle import upcycle

V = 89


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: OpenMP threads only add barrier waits, badly so on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dense(model_type="llama", **kw):
    """A random dense model with weights large enough that errors show in the logits."""
    torch.manual_seed(0)
    kw = {"qkv_bias": model_type == "qwen2", "qk_norm": model_type == "qwen3", "head_dim": 8, **kw}
    config = ModelConfig(model_type=model_type, vocab_size=V, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, **kw)
    model = CausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.15)
    return model


IDS = torch.randint(0, V, (3, 10), generator=torch.Generator().manual_seed(0))
LLAMA = dict(tie_word_embeddings=True,
             rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8))
CASES = {  # source model kwargs, upcycle kwargs
    "llama": (("llama", LLAMA), dict(num_experts=4, top_k=2)),
    "llama_shared": (("llama", LLAMA), dict(num_experts=4, top_k=2, shared_expert_intermediate_size=16)),
    "qwen2_shared_3of5": (("qwen2", {}), dict(num_experts=5, top_k=3, shared_expert_intermediate_size=8)),
    "qwen3_some_layers": (("qwen3", {}), dict(num_experts=3, top_k=2, layers=[0, 2])),
}


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # transformers, shared width 0
@pytest.mark.parametrize("case", list(CASES))
def test_upcycled_moe_equals_dense_and_round_trips(case, tmp_path):
    (model_type, kw), up_kw = CASES[case]
    src = dense(model_type, **kw)
    moe = upcycle(src, **up_kw).eval()
    c = moe.config
    assert c.model_type == {"qwen3": "qwen3_moe"}.get(model_type, "qwen2_moe")
    assert c.moe_layers == up_kw.get("layers", [0, 1, 2]) and c.norm_topk_prob
    with torch.no_grad():
        expected = src(IDS)
        logits, routing = moe(IDS, return_routing=True)
    assert (logits - expected).abs().max() <= 1e-5
    assert all(len(r.unique()) > up_kw["top_k"] for r in routing)  # the router spreads tokens

    save_model(moe, None, tmp_path)
    with pytest.warns(UserWarning, match="no tokenizer"):
        loaded, _ = load_model(tmp_path)
    assert loaded.config == dataclasses.replace(c, torch_dtype="float32")
    with torch.no_grad():
        assert torch.equal(loaded(IDS), logits)
        hf, info = tf.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)  # standard
        assert (hf.eval()(IDS).logits - expected).abs().max() <= 1e-5
    # only a zero-width shared expert (nothing to initialise) may be missing for transformers
    params = dict(hf.named_parameters())
    assert not info["unexpected_keys"] and all(params[k].numel() == 0 for k in info["missing_keys"])


def written(path):
    """(config.json, the tensors) of a saved checkpoint."""
    return json.loads((path / "config.json").read_text()), load_file(path / "model.safetensors")


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # transformers, shared width 0
@pytest.mark.parametrize("shared", [0, 16])
def test_upcycled_llama_checkpoint_fits_vllms_qwen2_moe(shared, tmp_path):
    """vLLM's Qwen2-MoE always has q/k/v biases (its strict loader needs them in the checkpoint), builds no
    shared expert at width 0 (and fails on shared_expert.* tensors then) but always a shared_expert_gate:
    the checkpoint has zero q/k/v biases and qkv_bias true, no zero-width tensor, the gate, and
    transformers and fp4rl compute the dense model's function from it."""
    src = dense("llama", **LLAMA).eval()
    assert not src.config.qkv_bias
    moe = upcycle(src, num_experts=4, top_k=2, shared_expert_intermediate_size=shared).eval()
    assert moe.config.qkv_bias
    save_model(moe, None, tmp_path)
    config, tensors = written(tmp_path)
    assert config["model_type"] == "qwen2_moe" and config["qkv_bias"] is True
    assert config["shared_expert_intermediate_size"] == shared
    for i in range(3):
        for n in "qkv":
            bias = tensors[f"model.layers.{i}.self_attn.{n}_proj.bias"]
            assert bias.shape == tensors[f"model.layers.{i}.self_attn.{n}_proj.weight"].shape[:1]
            assert not bias.any()
        assert not tensors[f"model.layers.{i}.mlp.shared_expert_gate.weight"].any()
    assert all(t.numel() for t in tensors.values())  # no zero-width tensor
    has_shared = any(".mlp.shared_expert." in k for k in tensors)
    assert has_shared == bool(shared)

    with torch.no_grad():
        expected = src(IDS)
        with pytest.warns(UserWarning, match="no tokenizer"):
            loaded, _ = load_model(tmp_path)
        assert (loaded(IDS) - expected).abs().max() <= 1e-5
        assert hasattr(loaded.model.layers[0].mlp, "shared_expert") == bool(shared)
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert hf.config.qkv_bias and hf.model.layers[0].self_attn.q_proj.bias is not None
        assert (hf(IDS).logits - expected).abs().max() <= 1e-5

        # transformers writes its zero-width shared expert back; fp4rl still loads that checkpoint
        hf.save_pretrained(tmp_path / "hf")
        _, hf_tensors = written(tmp_path / "hf")
        assert any(not t.numel() for t in hf_tensors.values()) == (not shared)
        with pytest.warns(UserWarning, match="no tokenizer"):
            again, _ = load_model(tmp_path / "hf")
        assert (again(IDS) - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_upcycle_refuses_a_head_dim_vllms_qwen2_moe_ignores(model_type):
    """vLLM's Qwen2-MoE uses hidden_size // num_attention_heads (32 // 4 = 8) whatever head_dim says."""
    with pytest.raises(ValueError, match=r"head_dim=16.*hidden_size // num_attention_heads = 32 // 4 = 8"):
        upcycle(dense(model_type, head_dim=16), num_experts=4, top_k=2)
    moe = upcycle(dense("qwen3", head_dim=16), num_experts=4, top_k=2)  # Qwen3-MoE honours head_dim
    assert moe.config.head_dim == 16


def test_upcycled_moe_trains_and_its_experts_drift_apart():
    moe = upcycle(dense("llama", **LLAMA), num_experts=4, top_k=2, shared_expert_intermediate_size=16)
    opt = torch.optim.SGD(moe.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        logits = moe(IDS[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, V), IDS[:, 1:].reshape(-1)).backward()
        grads = [p.grad for p in moe.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        opt.step()
    block = moe.model.layers[0].mlp
    assert block.shared_expert.gate_proj.weight.grad.abs().sum() > 0
    assert block.gate.weight.grad.abs().sum() > 0  # once experts differ, the router learns
    w = [e.up_proj.weight for e in block.experts]
    assert not torch.equal(w[0], w[1])


@pytest.mark.parametrize("kw, match", [
    (dict(num_experts=4, top_k=5), "num_experts"),
    (dict(num_experts=4, top_k=2, shared_expert_intermediate_size=48), "shared_expert_intermediate_size"),
    (dict(num_experts=4, top_k=2, layers=[3]), "layers"),
])
def test_bad_upcycle_arguments_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        upcycle(dense("llama"), **kw)


def test_upcycle_refuses_what_the_target_cannot_express():
    with pytest.raises(ValueError, match="shared expert"):
        upcycle(dense("qwen3"), num_experts=4, top_k=2, shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="qwen2_moe has no o_proj or MLP biases"):
        upcycle(dense("llama", qkv_bias=True, o_bias=True), num_experts=4, top_k=2)
    # Qwen3-MoE's o_proj has attention_bias (transformers: bias=config.attention_bias): upcycled, equal
    biased = dense("qwen3", qkv_bias=True, o_bias=True)
    with torch.no_grad():
        assert torch.allclose(upcycle(biased, num_experts=4, top_k=2)(IDS), biased(IDS), atol=1e-5)
    moe = upcycle(dense("llama"), num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="dense"):
        upcycle(moe, num_experts=4, top_k=2)


@pytest.mark.parametrize("preset", ["nvfp4-linear", "nvfp4-w4a16", "nvfp4-experts"])
def test_upcycled_moe_without_shared_expert_converts_to_every_preset(preset):
    """The default upcycle of a Llama (shared expert width 0) under each NVFP4 preset: there is no shared
    expert (no zero-width linear to quantize), its gate stays BF16 (a router) and the converted model runs
    forward and backward."""
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import NVFP4Linear, convert

    moe = upcycle(dense("llama", **LLAMA), num_experts=4, top_k=2)
    contract = PrecisionContract(preset)
    resolved = contract.resolve(moe)
    assert not [n for n, m in moe.named_modules() if isinstance(m, torch.nn.Linear) and not m.weight.numel()]
    assert not any(".shared_expert." in n for n in resolved)
    assert all(resolved[f"model.layers.{i}.mlp.shared_expert_gate"] == "bf16" for i in range(3))
    convert(moe, contract)
    assert any(isinstance(m, NVFP4Linear) for m in moe.modules())
    logits = moe(IDS)
    assert torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
