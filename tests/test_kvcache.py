"""KV caches: the model.KVCache contract, FP8/NVFP4 storage and error, per-token independence,
row selection, and decode with a quantized cache close to the unquantized one."""

import pytest
import torch

from fp4rl.kvcache import BF16KVCache, FP8KVCache, NVFP4KVCache, make_kv_cache
from fp4rl.model import CausalLM, ModelConfig
from fp4rl.nvfp4 import fake_quantize

CONFIG = ModelConfig(model_type="qwen3", vocab_size=80, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                     max_position_embeddings=64, qk_norm=True)
KINDS = ("bf16", "fp8", "nvfp4")


def kv(B=3, T=5, seed=0, scale=None):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, 2, T, 32, generator=g)  # [B, H_kv, T, D]
    v = torch.randn(B, 2, T, 32, generator=g)
    if scale is not None:
        k, v = k * scale, v * scale
    return k, v


def write(cache, layer, k, v):
    T = k.shape[2]
    out = cache.update(layer, k, v, torch.arange(cache.length, cache.length + T))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_update_follows_the_contract(kind):
    cache = make_kv_cache(kind, CONFIG, 3, 16, dtype=torch.float32, device="cpu")
    k1, v1 = kv(T=5)
    k_all, v_all = write(cache, 0, k1, v1)
    assert k_all.shape == (3, 2, 5, 32) and k_all.dtype == torch.float32
    write(cache, 1, k1, v1)
    cache.length = 5  # what the model does after a forward
    k2, v2 = kv(T=1, seed=1)
    k_all, v_all = write(cache, 0, k2, v2)
    assert k_all.shape == (3, 2, 6, 32) and v_all.shape == (3, 2, 6, 32)
    if kind == "bf16":
        assert torch.equal(k_all, torch.cat([k1, k2], 2)) and torch.equal(v_all, torch.cat([v1, v2], 2))


@pytest.mark.parametrize("kind,bytes_per_value,rel_err", [("fp8", 1 + 4 / 32, 0.04),
                                                          ("nvfp4", 0.5 + 1 / 16 + 4 / 32, 0.12)])
def test_quantized_caches_store_fewer_bytes_with_a_bounded_error(kind, bytes_per_value, rel_err):
    cache = make_kv_cache(kind, CONFIG, 3, 16, dtype=torch.float32, device="cpu")
    values_per_token = 2 * CONFIG.num_hidden_layers * 2 * 32  # k and v, layers, heads, head_dim
    assert cache.bytes_per_token() == pytest.approx(values_per_token * bytes_per_value)
    assert BF16KVCache(CONFIG, 3, 16, dtype=torch.bfloat16).bytes_per_token() == values_per_token * 2
    rows = torch.logspace(-3, 3, 3)[:, None, None, None]  # rows of very different magnitudes
    k, v = kv(T=7, scale=rows)
    k_all, v_all = write(cache, 0, k, v)
    for x, got in ((k, k_all), (v, v_all)):
        err = (got - x).norm(dim=-1) / x.norm(dim=-1)  # per token and head
        assert err.max() < rel_err and err.mean() > rel_err / 20  # quantized, not stored exactly
    if kind == "nvfp4":  # exactly fp4rl.nvfp4 with one FP32 scale per token and head
        expected = fake_quantize(k, tile=16, scale_rule="4/6", err="mse", scale_scope="row")
        assert torch.equal(k_all, expected)


@pytest.mark.parametrize("cls", [FP8KVCache, NVFP4KVCache])
def test_a_token_is_stored_the_same_whatever_its_batch_neighbours(cls):
    k, v = kv(B=4, T=3)
    alone = cls(CONFIG, 1, 8)
    crowd = cls(CONFIG, 4, 8)
    k_alone, _ = write(alone, 0, k[:1], v[:1])
    k_crowd, _ = write(crowd, 0, torch.cat([k[:1], 1e4 * k[1:]]), torch.cat([v[:1], 1e4 * v[1:]]))
    assert torch.equal(k_alone[0], k_crowd[0])
    zeros = cls(CONFIG, 1, 8)
    k0, _ = write(zeros, 0, torch.zeros(1, 2, 2, 32), torch.zeros(1, 2, 2, 32))
    assert torch.equal(k0, torch.zeros_like(k0))  # an all-zero token survives (no 0/0)


@pytest.mark.parametrize("tiny", [1e-44, 1e-40, 2e-38])
def test_fp8_cache_survives_a_tiny_amax(tiny):
    """A token whose amax is below 448 * 2^-149 (amax / 448 underflows to 0) or in the subnormal range:
    the scale stays > 0, nothing decodes to NaN/Inf, zeros stay zero and values stay within amax."""
    x = torch.zeros(1, 2, 1, 32)
    x[0, 0, 0, 0], x[0, 1, 0, 5] = tiny, -tiny  # one nonzero value per head, the rest zeros
    codes, scale = FP8KVCache.quantize(x)
    assert (scale > 0).all() and torch.isfinite(scale).all()
    back = codes.float() * scale
    assert torch.isfinite(back).all() and (back.abs() <= tiny * (1 + 2 ** -3)).all()
    assert torch.equal(back[x == 0], torch.zeros_like(back[x == 0]))
    k_all, v_all = write(FP8KVCache(CONFIG, 1, 4), 0, x, x)  # and through the cache
    assert torch.isfinite(k_all).all() and torch.isfinite(v_all).all()


@pytest.mark.parametrize("kind", KINDS)
def test_select_copies_and_drops_rows(kind):
    cache = make_kv_cache(kind, CONFIG, 2, 8, dtype=torch.float32, device="cpu")
    k, v = kv(B=2, T=4)
    k_all, v_all = write(cache, 0, k, v)
    cache.length = 4
    cache.select(torch.tensor([1, 1, 0]))
    assert cache.batch_size == 3
    k_new, v_new = kv(B=3, T=1, seed=1)
    got_k, got_v = write(cache, 0, k_new, v_new)
    assert torch.equal(got_k[:, :, :4], k_all[[1, 1, 0]]) and torch.equal(got_v[:, :, :4], v_all[[1, 1, 0]])


def test_nvfp4_cache_needs_head_dim_multiple_of_16():
    config = ModelConfig(**{**vars(CONFIG), "head_dim": 24, "extra": {}})
    with pytest.raises(ValueError, match="head_dim to be a multiple of 16"):
        make_kv_cache("nvfp4", config, 1, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="kv_cache='int4'"):
        make_kv_cache("int4", CONFIG, 1, 8, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("kind", ["nvfp4", "fp8"])
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_kv_names_the_layer_and_the_cause(kind, which, bad):
    """A NaN/Inf key or value: the NVFP4 and FP8 caches say which layer and K or V, and what to do (not a
    quantize flag the model cannot pass), and write nothing of that update."""
    cache = make_kv_cache(kind, CONFIG, 2, 8, dtype=torch.float32, device="cpu")
    k, v = kv(B=2, T=2)
    write(cache, 1, k, v)  # a first, finite update
    before = {n: [b.clone() for b in getattr(cache, n)] for n in cache.buffer_names}
    k, v = kv(B=2, T=2, seed=1)  # other values for the same slots: a partial write would show
    (k if which == "k" else v)[1, 0, 1, 3] = bad
    name = r"keys \(K\)" if which == "k" else r"values \(V\)"
    with pytest.raises(ValueError, match=f"{kind.upper()} KV cache: the {name} of layer 1 hold 1 NaN/Inf") \
            as err:
        write(cache, 1, k, v)
    assert "allow_nonfinite" not in str(err.value) and "learning rate" in str(err.value)
    for n in cache.buffer_names:  # nothing of the update written, neither K nor V
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(getattr(cache, n), before[n])), n


def teacher_forced_logprobs(model, kind, ids, n_prompt):
    """log p(ids[n_prompt:]) decoding token by token through a `kind` cache (prefill, then 1 per step)."""
    cache = make_kv_cache(kind, CONFIG, 1, len(ids), dtype=torch.float32, device="cpu")
    with torch.no_grad():
        h, _ = model.model(torch.tensor([ids[:n_prompt]]), kv_cache=cache)
        hidden = [h[:, -1]]
        for t in ids[n_prompt:-1]:
            h, _ = model.model(torch.tensor([[t]]), kv_cache=cache)
            hidden.append(h[:, -1])
        logits = model.lm_head(torch.cat(hidden))  # [T, V]
    return logits.log_softmax(-1).gather(1, torch.tensor(ids[n_prompt:])[:, None]).squeeze(1)


def test_decoding_with_quantized_caches_stays_close_to_bf16():
    torch.manual_seed(0)
    model = CausalLM(CONFIG).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.1)
    g = torch.Generator().manual_seed(0)
    diffs = {kind: [] for kind in KINDS}
    for _ in range(4):
        ids = torch.randint(0, 80, (40,), generator=g).tolist()
        with torch.no_grad():
            full = model(torch.tensor([ids]))[0, 7:-1].log_softmax(-1)  # the trainer's full forward
        expected = full.gather(1, torch.tensor(ids[8:])[:, None]).squeeze(1)
        for kind in KINDS:
            diffs[kind].append((teacher_forced_logprobs(model, kind, ids, 8) - expected).abs().mean())
    mean = {kind: float(torch.stack(d).mean()) for kind, d in diffs.items()}
    assert mean["bf16"] < 1e-5  # the cached decode is the full forward
    assert 1e-4 < mean["fp8"] < 0.05 and 2 * mean["fp8"] < mean["nvfp4"] < 0.2
