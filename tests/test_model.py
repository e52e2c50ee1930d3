"""fp4rl.model against transformers, on tiny random models of every supported family (fp32, CPU)."""

import copy

import pytest
import torch
import transformers as tf

from fp4rl.hf import load_model
from fp4rl.model import CausalLM, KVCache, ModelConfig

V = 97
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
FAMILIES = {
    # GQA, tied embeddings, llama3 rope scaling
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)),
    # every bias, linear rope scaling, head_dim != hidden / heads
    "llama_bias": (tf.LlamaConfig, tf.LlamaForCausalLM,
                   dict(attention_bias=True, mlp_bias=True, head_dim=16,
                        rope_scaling=dict(rope_type="linear", factor=2.0))),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(rope_theta=1e6)),  # q/k/v biases
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=16)),  # qk-norm
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  dict(MOE, head_dim=8, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM, dict(MOE, shared_expert_intermediate_size=24)),
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: OpenMP threads only add barrier waits, badly so on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_hf(family, seed=0):
    """A transformers model of the family with weights large enough that errors show in the logits."""
    config_cls, model_cls, kw = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**copy.deepcopy({**BASE, **kw}))).eval()  # transformers edits dicts in place
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(transformers model, fp4rl model loaded from its save_pretrained directory)."""
    hf = make_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    with pytest.warns(UserWarning, match="no tokenizer"):
        ours, tokenizer = load_model(path)
    assert tokenizer is None
    return hf, ours.eval()


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_hf(request.param).save_pretrained(path)
    with pytest.warns(UserWarning):
        return load_model(path)[0].eval()


def left_pad(seqs, pad_id=0):
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, T - len(s):], mask[b, T - len(s):] = torch.tensor(s), 1
    return ids, mask


@torch.no_grad()
def test_logits_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    expected = hf(ids).logits
    got = ours(ids)
    assert got.shape == (2, 11, V) and got.dtype == torch.float32
    assert expected.std() > 0.1  # the comparison below is not trivially small
    assert (got - expected).abs().max() <= 1e-4


@torch.no_grad()
def test_left_padded_batch_matches_single_sequences(pair):
    _, ours = pair
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(1, V, (n,), generator=g).tolist() for n in (7, 4, 1)]
    ids, mask = left_pad(seqs)
    batched = ours(ids, attention_mask=mask)
    assert torch.isfinite(batched).all()  # padding rows too
    for b, s in enumerate(seqs):
        single = ours(torch.tensor([s]))[0]
        assert (batched[b, -len(s):] - single).abs().max() <= 1e-5


@torch.no_grad()
def test_kv_cache_chunks_and_decode_match_full_forward(pair):
    _, ours = pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 3)]
    ids, mask = left_pad(prompts)
    ids = torch.cat([ids, torch.randint(1, V, (2, 4), generator=g)], dim=1)  # [2, 9]: prompt + 4 new
    mask = torch.cat([mask, torch.ones(2, 4, dtype=torch.long)], dim=1)
    full = ours(ids, attention_mask=mask)

    cache = KVCache(ours.config, batch_size=2, max_len=12)
    start = 0
    for chunk in (3, 2, 1, 1, 2):  # a prefill in two chunks, then one-token decode steps
        end = start + chunk
        step = ours(ids[:, start:end], attention_mask=mask[:, :end], kv_cache=cache)
        real = mask[:, start:end].bool()
        assert (step - full[:, start:end])[real].abs().max() <= 1e-5
        start = end
    assert cache.length == 9
    with pytest.raises(ValueError, match="KVCache"):
        ours(ids[:, :4], kv_cache=cache)  # 9 + 4 slots > 12


@torch.no_grad()
def test_kv_cache_subclass_needs_only_update(tmp_path):
    """A cache with a different storage (here: growing lists, no preallocation) plugs in by
    overriding __init__ and update; the model code is unchanged."""

    class ListCache(KVCache):
        def __init__(self, config, batch_size, max_len):
            self.batch_size, self.max_len, self.length = batch_size, max_len, 0
            self.kv = [[] for _ in range(config.num_hidden_layers)]
            self.positions_seen = []

        def update(self, layer_idx, k, v, positions):
            self.kv[layer_idx].append((k, v))
            self.positions_seen.append(positions.tolist())
            return tuple(torch.cat(t, dim=2) for t in zip(*self.kv[layer_idx]))

    make_hf("llama").save_pretrained(tmp_path)
    with pytest.warns(UserWarning):
        ours, _ = load_model(tmp_path)
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(4))
    cache = ListCache(ours.config, 1, 6)
    steps = [ours(ids[:, :4], kv_cache=cache)] + [ours(ids[:, t:t + 1], kv_cache=cache) for t in (4, 5)]
    assert (torch.cat(steps, dim=1) - ours(ids)).abs().max() <= 1e-5
    assert cache.positions_seen[0] == [0, 1, 2, 3] and cache.positions_seen[-1] == [5]


def test_routing_replay_reproduces_logits_and_trains_the_router(moe):
    ids = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, routing = moe(ids, return_routing=True)
    assert len(routing) == len(moe.config.moe_layers)
    assert all(r.shape == (2, 8, moe.config.num_experts_per_tok) and r.dtype == torch.long for r in routing)
    with torch.no_grad():
        assert torch.equal(moe(ids, routing=routing), logits)

    # another router (think: the trainer's policy after a step) would pick other experts;
    # replay forces the recorded ones and the router still gets a gradient
    other = copy.deepcopy(moe)
    with torch.no_grad():
        for i in other.config.moe_layers:
            other.model.layers[i].mlp.gate.weight.add_(torch.randn_like(other.model.layers[i].mlp.gate.weight))
        free_routing = other(ids, return_routing=True)[1]
    assert any(not torch.equal(a, b) for a, b in zip(free_routing, routing))
    replayed, used = other(ids, routing=routing, return_routing=True)
    assert all(torch.equal(a, b) for a, b in zip(used, routing))
    replayed.logsumexp(-1).mean().backward()
    for i in other.config.moe_layers:
        mlp = other.model.layers[i].mlp
        assert mlp.gate.weight.grad.abs().sum() > 0
        assert any(e.gate_proj.weight.grad is not None for e in mlp.experts)
    with pytest.raises(ValueError, match="routing"):
        moe(ids, routing=routing[:-1])


@torch.no_grad()
def test_run_experts_touches_only_routed_tokens(moe):
    block = moe.model.layers[moe.config.moe_layers[0]].mlp
    rows = [0] * block.num_experts
    hooks = [e.register_forward_pre_hook(lambda m, a, e=e_i: rows.__setitem__(e, rows[e] + a[0].shape[0]))
             for e_i, e in enumerate(block.experts)]
    x = torch.randn(3, 5, moe.config.hidden_size)
    y, idx = block(x)
    for h in hooks:
        h.remove()
    assert rows == torch.bincount(idx.flatten(), minlength=block.num_experts).tolist()
    # the loop equals the dense definition: every expert on every token, weighted by the routing
    flat = x.reshape(-1, x.shape[-1])
    topk_idx, topk_weight = block.route(flat)
    dense = torch.stack([e(flat) for e in block.experts], dim=1)  # [N, E, H]
    picked = dense.gather(1, topk_idx[..., None].expand(-1, -1, flat.shape[1]))  # [N, k, H]
    expected = (picked * topk_weight[..., None]).sum(1)
    assert (block.run_experts(flat, topk_idx, topk_weight) - expected).abs().max() <= 1e-6


def hf_dict(**kw):
    return {"model_type": "llama", **BASE, **kw}


@pytest.mark.parametrize("kw, match", [
    (dict(model_type="mistral"), "model_type"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16), "sliding"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "sliding"),
    # the MoE models slide by other rules than max_window_layers (qwen3_moe: every layer)
    (dict(model_type="qwen3_moe", use_sliding_window=True, sliding_window=8, max_window_layers=2, **MOE),
     "sliding"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8), "experts"),
    (dict(model_type="qwen3_moe", num_experts_per_tok=2, moe_intermediate_size=8),  # no expert count
     "qwen3_moe needs num_experts, which the file does not set"),
    (dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8),
     "needs shared_expert_intermediate_size"),
    # num_experts 0 fell through to a pop of num_local_experts: KeyError 'num_local_experts'
    (dict(model_type="qwen3_moe", num_experts=0, num_experts_per_tok=2, moe_intermediate_size=8),
     r"num_experts=0 is not supported; a qwen3_moe model needs num_experts > 0"),
    (dict(model_type="qwen2_moe", num_experts=0, num_experts_per_tok=2, moe_intermediate_size=8,
          shared_expert_intermediate_size=8), r"num_experts=0 is not supported.*model_type qwen2\)"),
    (dict(model_type="qwen3_moe", num_experts=None, num_experts_per_tok=2, moe_intermediate_size=8),
     "qwen3_moe needs num_experts, which the file does not set"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}),
     "partial_rotary"),
])
def test_unsupported_configs_raise_naming_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf_dict(**kw))


@pytest.mark.parametrize("kw", [dict(sliding_window=None), dict(sliding_window=16, max_window_layers=2)])
def test_sliding_window_switched_on_for_no_layer_is_full_attention(kw):
    """use_sliding_window = true with no window, or with max_window_layers >= the layer count: transformers
    runs every layer with full attention, and so does fp4rl (they were refused)."""
    cfg = ModelConfig.from_hf(hf_dict(model_type="qwen2", use_sliding_window=True, **kw))
    assert cfg.num_hidden_layers == 2


def test_a_tied_head_that_differs_from_the_embedding_is_refused():
    """tie_word_embeddings = true and an lm_head.weight of its own: it was dropped without a word (the logits
    then differ from transformers', which unties them); an equal copy is fine."""
    from fp4rl.model import build_model

    cfg = ModelConfig.from_hf(hf_dict(tie_word_embeddings=True))
    state = {k: v.clone() for k, v in CausalLM(cfg).state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    build_model(cfg, dict(state))
    state["lm_head.weight"] += 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        build_model(cfg, state)


@pytest.mark.parametrize("scaling, key", [
    ({"rope_type": "linear", "factor": 0}, "factor"),  # inv_freq inf, cos/sin NaN, attention silently zero
    ({"rope_type": "linear", "factor": -2.0}, "factor"),
    ({"rope_type": "linear", "factor": "2"}, "factor"),
    ({"rope_type": "linear", "factor": float("nan")}, "factor"),
    ({"rope_type": "linear", "factor": True}, "factor"),
    ({**LLAMA3_ROPE, "factor": 0.0}, "factor"),
    ({**LLAMA3_ROPE, "low_freq_factor": 0}, "low_freq_factor"),
    ({**LLAMA3_ROPE, "low_freq_factor": -1.0}, "low_freq_factor"),
    ({**LLAMA3_ROPE, "high_freq_factor": None}, "high_freq_factor"),
    ({**LLAMA3_ROPE, "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
])
def test_rope_scaling_needs_positive_finite_numbers(scaling, key):
    with pytest.raises(ValueError, match=f"rope_scaling {key}=.* must be a finite number > 0: fix {key}"):
        ModelConfig.from_hf(hf_dict(rope_scaling=scaling))
    with pytest.raises(ValueError, match=f"rope_scaling {key}="):  # a config built in code too
        ModelConfig(**hf_dict(), head_dim=8, rope_scaling=scaling)


@pytest.mark.parametrize("key, value, match", [
    ("num_experts", 4.0, "non-negative integer"),
    ("num_experts_per_tok", 2.0, "non-negative integer"),
    ("moe_intermediate_size", 8.0, "non-negative integer"),
    ("moe_intermediate_size", True, "non-negative integer"),
    ("decoder_sparse_step", 1.5, "positive integer"),  # made no layer MoE: (i + 1) % 1.5 is never 0
    ("decoder_sparse_step", 2.0, "positive integer"),
    ("decoder_sparse_step", 0, "positive integer"),
    ("shared_expert_intermediate_size", 24.0, "non-negative integer"),
    ("shared_expert_intermediate_size", -1, "non-negative integer"),
])
def test_moe_sizes_must_be_integers(key, value, match):
    moe = dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
               shared_expert_intermediate_size=24)
    assert ModelConfig.from_hf(hf_dict(**moe)).moe_layers == [0, 1]
    with pytest.raises(ValueError, match=f"{key}={value!r} is not supported; it must be a {match}"):
        ModelConfig.from_hf(hf_dict(**{**moe, key: value}))


@pytest.mark.parametrize("kw, key", [
    (dict(num_key_value_heads=0), "num_key_value_heads=0"),  # became num_attention_heads
    (dict(head_dim=0), "head_dim=0"),  # became hidden / heads
    (dict(rope_theta=0), "rope_theta=0"),  # became 10000
    (dict(rope_theta=-1.0), "rope_theta=-1.0"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}), "rope_theta=0.0"),
    (dict(rope_theta="1e6"), "rope_theta='1e6'"),
])
def test_zero_sizes_and_rope_theta_are_refused_not_replaced(kw, key):
    with pytest.raises(ValueError, match=f"{key} is not supported; it must be a "):
        ModelConfig.from_hf(hf_dict(**kw))


def test_absent_or_null_sizes_and_rope_theta_take_the_defaults():
    c = ModelConfig.from_hf(hf_dict(num_key_value_heads=None, head_dim=None, rope_theta=None))
    assert (c.num_key_value_heads, c.head_dim, c.rope_theta) == (4, 8, 10000.0)
    assert ModelConfig.from_hf(hf_dict(rope_theta=1000000)).rope_theta == 1e6
    assert isinstance(ModelConfig.from_hf(hf_dict(rope_theta=1000000)).rope_theta, float)


def test_config_reads_both_rope_spellings_and_writes_back():
    legacy = ModelConfig.from_hf(hf_dict(rope_theta=5e5, rope_scaling=dict(LLAMA3_ROPE)))
    v5 = ModelConfig.from_hf(hf_dict(rope_parameters={"rope_theta": 5e5, **LLAMA3_ROPE}))
    assert legacy == v5 and legacy.rope_theta == 5e5 and legacy.rope_scaling["rope_type"] == "llama3"
    assert ModelConfig.from_hf(legacy.to_hf()) == legacy
    q2 = ModelConfig.from_hf(hf_dict(model_type="qwen2", use_sliding_window=False, sliding_window=4096))
    assert q2.qkv_bias and not q2.o_bias and q2.rope_scaling is None


def test_llama3_rope_reads_a_top_level_original_max_position_embeddings_first():
    """transformers (modeling_rope_utils, llama3) takes a top-level original_max_position_embeddings before
    rope_scaling's own, and max_position_embeddings only when neither is there; fp4rl ignored the top-level
    one (logits 0.41 apart on a 60-token prompt)."""
    inner = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    top = ModelConfig.from_hf(hf_dict(rope_scaling=dict(inner), original_max_position_embeddings=16))
    both = ModelConfig.from_hf(hf_dict(rope_scaling=dict(LLAMA3_ROPE), original_max_position_embeddings=32))
    neither = ModelConfig.from_hf(hf_dict(rope_scaling=dict(inner)))
    assert top.rope_scaling["original_max_position_embeddings"] == 16
    assert both.rope_scaling["original_max_position_embeddings"] == 32
    assert neither.rope_scaling["original_max_position_embeddings"] == neither.max_position_embeddings
    assert ModelConfig.from_hf(top.to_hf()) == top


def test_config_defaults_and_spellings_transformers_accepts():
    """head_dim absent: Qwen3 takes its config class's 128, Qwen3-MoE (whose class has none) hidden / heads,
    as transformers does; partial_rotary_factor null is full rotary; 'swish' is silu; a non-zero
    attention_dropout is ignored, loudly."""
    moe = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    assert ModelConfig.from_hf(hf_dict(**moe)).head_dim == BASE["hidden_size"] // BASE["num_attention_heads"]
    local = dict(moe, num_experts=None, num_local_experts=4)  # the other spelling, when num_experts is null
    assert ModelConfig.from_hf(hf_dict(**local)).num_experts == 4
    assert "num_local_experts" not in ModelConfig.from_hf(hf_dict(**local)).extra
    assert ModelConfig.from_hf(hf_dict(model_type="qwen3")).head_dim == 128
    assert ModelConfig.from_hf(hf_dict(partial_rotary_factor=None)).rope_scaling is None
    assert ModelConfig.from_hf(hf_dict(hidden_act="swish")).hidden_act == "silu"
    with pytest.warns(UserWarning, match="attention_dropout=0.1 is ignored"):
        ModelConfig.from_hf(hf_dict(attention_dropout=0.1))


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2_moe"])
def test_cuda_matches_cpu_and_decodes_with_a_cache_in_bf16(family, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    make_hf(family).save_pretrained(tmp_path)
    with pytest.warns(UserWarning):
        cpu, _ = load_model(tmp_path)
        gpu, _ = load_model(tmp_path, device="cuda", dtype=torch.float32)
        bf16, _ = load_model(tmp_path, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    ids, mask = left_pad([torch.randint(1, V, (n,), generator=g).tolist() for n in (9, 5, 7)])
    with torch.no_grad():
        expected = cpu(ids, attention_mask=mask)
        assert (gpu(ids.cuda(), attention_mask=mask.cuda()).cpu() - expected).abs().max() <= 1e-4

        ids, mask = ids.cuda(), mask.cuda()
        full = bf16(ids, attention_mask=mask)
        assert (full.float() - expected.cuda()).abs().max() <= 0.1  # bf16 vs fp32: close, not equal
        cache = KVCache(bf16.config, batch_size=3, max_len=9, dtype=torch.bfloat16, device="cuda")
        steps = [bf16(ids[:, :6], attention_mask=mask[:, :6], kv_cache=cache)]
        steps += [bf16(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], kv_cache=cache) for t in (6, 7, 8)]
        real = mask.bool()
        assert (torch.cat(steps, dim=1) - full).float()[real].abs().max() <= 0.05
