"""fp4rl.upcycle: the MoE equals its dense source at initialisation, saves, loads, and trains."""

import dataclasses

import pytest
import torch
import transformers as tf

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
    kw = {"qkv_bias": model_type == "qwen2", "qk_norm": model_type == "qwen3", **kw}
    config = ModelConfig(model_type=model_type, vocab_size=V, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **kw)
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
        hf = tf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # a standard checkpoint
        assert (hf(IDS).logits - expected).abs().max() <= 1e-5


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
    with pytest.raises(ValueError, match="bias"):
        upcycle(dense("llama", qkv_bias=True, o_bias=True), num_experts=4, top_k=2)
    moe = upcycle(dense("llama"), num_experts=4, top_k=2)
    with pytest.raises(ValueError, match="dense"):
        upcycle(moe, num_experts=4, top_k=2)


@pytest.mark.parametrize("preset", ["nvfp4-linear", "nvfp4-w4a16", "nvfp4-experts"])
def test_upcycled_moe_without_shared_expert_converts_to_every_preset(preset):
    """The default upcycle of a Llama (shared expert width 0) under each NVFP4 preset: the zero-width
    shared-expert linears stay BF16 (nothing to quantize; quantizing them failed on the empty amax) and the
    converted model runs forward and backward."""
    from fp4rl.precision import PrecisionContract
    from fp4rl.qat import NVFP4Linear, convert

    moe = upcycle(dense("llama", **LLAMA), num_experts=4, top_k=2)
    contract = PrecisionContract(preset)
    resolved = contract.resolve(moe)
    empty = [n for n, m in moe.named_modules() if isinstance(m, torch.nn.Linear) and m.weight.numel() == 0]
    assert empty and all(resolved[n] == "bf16" for n in empty)
    convert(moe, contract)
    assert any(isinstance(m, NVFP4Linear) for m in moe.modules())
    logits = moe(IDS)
    assert torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
