"""The AMX W4A16 GEMM on packed NVFP4 bytes (fp4rl.nvfp4.cpu_gemm) and the sampler's fast BF16 CPU
linears (oneDNN-prepacked weights, the AMX kernel): exact dequantization, results vs F.linear,
odd shapes, fused stacks, refusals, and weight sync invalidating every derived copy."""

import pytest
import torch
import torch.nn.functional as F
from rl_fixtures import converted_model, optimizer_step

from fp4rl.nvfp4 import cpu_gemm, dequantize, quantize
from fp4rl.packed import PrepackedLinear, onednn_bf16_available
from fp4rl.sampler import Sampler, SamplingParams
from fp4rl.weight_sync import build_payload

needs_amx = pytest.mark.skipif(not cpu_gemm.available(), reason="no AMX-BF16 CPU / compiler for cpu_gemm")
needs_onednn = pytest.mark.skipif(not onednn_bf16_available(), reason="torch's oneDNN has no BF16 here")

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
              tie_word_embeddings=True)
PROMPTS = [[3, 4, 5], [9, 1], [7, 7, 7, 7, 2]]


def weight(n, k, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(n, k, generator=g) * 0.05, **kw)


@needs_amx
def test_the_kernel_dequantizes_exactly_what_dequantize_returns():
    """With one-hot rows of x, y[m, n] is one product DQ(W)[n, k] * 1: exact in bf16."""
    for n, k in ((40, 48), (16, 64), (33, 80)):
        q = weight(n, k, seed=n, scale_rule="4/6")
        x = torch.eye(k, dtype=torch.bfloat16)  # k rows
        y = cpu_gemm.linear(x, cpu_gemm.GemmWeight([q]))
        assert torch.equal(y.T, dequantize(q, torch.bfloat16))
        assert torch.equal(cpu_gemm.dequantize_bf16(cpu_gemm.GemmWeight([q])), dequantize(q, torch.bfloat16))


def test_the_lookup_tables_hold_the_dequantized_values_subnormals_included():
    for scale in (1.0, 1e-36):  # 1e-36: many values are float32 / bfloat16 subnormals
        q = weight(24, 48, scale_rule="4/6")
        q.global_scale.mul_(scale)
        w = cpu_gemm.GemmWeight([q])
        codes = torch.stack((q.data & 15, q.data >> 4), -1).reshape(24, 48).long()
        block = q.block_scale.view(torch.uint8).reshape(24, 3).long().repeat_interleave(16, -1)
        looked_up = w.tables[w.row_table[:24].long()[:, None] * 256 + block, codes]
        assert torch.equal(looked_up.view(torch.int16), dequantize(q, torch.bfloat16).view(torch.int16))


@needs_amx
def test_subnormal_weights_are_flushed_as_by_torchs_own_amx_linear():
    """AMX treats bf16 subnormal inputs as zero; oneDNN's F.linear on this CPU does the same."""
    q = weight(32, 64)
    q.global_scale.mul_(1e-36)
    x = torch.eye(64, dtype=torch.bfloat16)
    dq = dequantize(q, torch.bfloat16)
    assert torch.equal(cpu_gemm.linear(x, cpu_gemm.GemmWeight([q])), F.linear(x, dq))


@needs_amx
@pytest.mark.parametrize("n,k,m", [(48, 64, 1), (37, 80, 17), (128, 96, 16), (200, 48, 64), (24, 32, 70)])
def test_products_match_f_linear_on_the_dequantized_weight(n, k, m):
    q = weight(n, k, seed=m)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    got = cpu_gemm.linear(x, cpu_gemm.GemmWeight([q]), bias)
    exact = F.linear(x.double(), dequantize(q, torch.bfloat16).double(), bias.double())
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # float32 accumulation, one rounding to bf16: within one bf16 ulp of the exact sum (plus fp32 noise)
    ulp = exact.abs().clamp(min=1e-30).log2().floor().exp2() * 2.0 ** -7
    assert ((got.double() - exact).abs() <= ulp + 1e-5).all()
    # and what F.linear in bf16 gives, up to its own rounding
    ref = F.linear(x, dequantize(q, torch.bfloat16), bias)
    assert ((got.double() - ref.double()).abs() <= 2 * ulp + 1e-5).all()


@needs_amx
@pytest.mark.parametrize("n,k,m", [(48, 64, 1), (37, 80, 17), (130, 96, 16), (200, 48, 64), (24, 32, 3)])
def test_bf16_weights_in_the_tiled_layout_match_f_linear(n, k, m):
    g = torch.Generator().manual_seed(m)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    got = cpu_gemm.linear(x, cpu_gemm.BF16Weight(w), bias)
    exact = F.linear(x.double(), w.double(), bias.double())
    ulp = exact.abs().clamp(min=1e-30).log2().floor().exp2() * 2.0 ** -7
    assert got.shape == (m, n) and ((got.double() - exact).abs() <= ulp + 1e-5).all()


@needs_amx
def test_a_row_of_the_product_does_not_depend_on_the_batch():
    """Every C tile sums its chunks in the same order whatever M: decode (<= 16 rows), the 17-64 row
    path and one row alone give the same bits for the same row of x."""
    q = weight(100, 96, seed=3)
    dense = (torch.randn(100, 96) * 0.05).bfloat16()
    x = torch.randn(40, 96).bfloat16()
    for w in (cpu_gemm.GemmWeight([q]), cpu_gemm.BF16Weight(dense)):
        full = cpu_gemm.linear(x, w)
        assert torch.equal(cpu_gemm.linear(x[:16], w), full[:16])
        assert torch.equal(cpu_gemm.linear(x[5:6], w), full[5:6])
        assert torch.equal(cpu_gemm.linear(x[20:23], w), full[20:23])


def test_bf16_weight_refuses_what_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_gemm.BF16Weight(torch.zeros(8, 24, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_gemm.BF16Weight(torch.zeros(8, 32))


@needs_amx
def test_a_stack_of_weights_with_their_own_global_scales_is_one_product():
    parts = [weight(32, 64, seed=1), weight(16, 64, seed=2), weight(48, 64, seed=3)]
    parts[1].global_scale.mul_(4.0)  # a different global scale per member (fused q/k/v)
    x = torch.randn(5, 64).bfloat16()
    got = cpu_gemm.linear(x, cpu_gemm.GemmWeight(parts))
    separate = torch.cat([cpu_gemm.linear(x, cpu_gemm.GemmWeight([q])) for q in parts], -1)
    assert torch.equal(got, separate)
    assert torch.equal(cpu_gemm.linear(torch.eye(64, dtype=torch.bfloat16), cpu_gemm.GemmWeight(parts)).T,
                       torch.cat([dequantize(q, torch.bfloat16) for q in parts]))


def test_swizzle_is_a_permutation_of_the_nibbles():
    q = weight(8, 80)  # 2 groups of 32 + one of 16
    s = cpu_gemm.swizzle(q.data)
    codes = torch.stack((q.data & 15, q.data >> 4), -1).reshape(8, 80)
    for g in range(2):
        for w in range(32):  # weight w of a group: qword (w // 4) % 2, position p in that qword
            p = (w // 8) * 4 + w % 4
            byte = 16 * g + 8 * ((w // 4) % 2) + p // 2
            assert torch.equal((s[:, byte] >> (4 * (p % 2))) & 15, codes[:, 32 * g + w])
    assert torch.equal(s[:, 32:], q.data[:, 32:])


@needs_amx
def test_bad_inputs_are_refused_or_left_to_the_fallback():
    q = weight(32, 64)
    w = cpu_gemm.GemmWeight([q])
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_gemm.linear(torch.randn(2, 64), w)
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        cpu_gemm.linear(torch.randn(2, 48).bfloat16(), w)
    with pytest.raises(ValueError, match="bias"):
        cpu_gemm.linear(torch.randn(2, 64).bfloat16(), w, torch.zeros(31, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="1x16"):
        cpu_gemm.GemmWeight([weight(32, 64, tile=(16, 16))])
    assert not cpu_gemm.supported_weight(weight(32, 64, hadamard_seed=3))
    bad = weight(32, 64)
    bad.global_scale.fill_(float("inf"))
    assert not cpu_gemm.GemmWeight([bad]).ok
    with pytest.raises(ValueError, match="global scale"):
        cpu_gemm.linear(torch.randn(2, 64).bfloat16(), cpu_gemm.GemmWeight([bad]))
    rows = weight(80, 64, scale_scope="row")  # one global scale per row: more tables than allowed
    assert not cpu_gemm.GemmWeight([rows]).ok
    assert cpu_gemm.linear(torch.randn(0, 64).bfloat16(), w).shape == (0, 32)


def tiny_model(preset):
    return converted_model(CONFIG, preset)


def outputs(sampler):
    out = sampler.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=0))
    return [c.completion_ids for c in out], [c.logprobs for c in out]


@needs_onednn
def test_prepacked_bf16_linears_are_bit_identical_and_follow_weight_sync():
    model, contract = tiny_model("bf16")
    fast = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, prepack=True, nvfp4_gemm=False)
    plain = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, prepack=False, nvfp4_gemm=False)
    assert isinstance(fast.model.model.layers[0].self_attn.o_proj, PrepackedLinear)
    assert fast.model.lm_head.weight is fast.model.model.embed_tokens.weight  # still tied
    assert outputs(fast) == outputs(plain)
    optimizer_step(model)
    payload = build_payload(model, contract, version=1)
    fast.load(payload, verify=True)
    plain.load(payload)
    assert outputs(fast) == outputs(plain)  # the reordered copies were rebuilt
    assert fast.memory()["prepacked_dense_bytes"] > 0


@needs_amx
@pytest.mark.parametrize("preset", ["nvfp4-w4a16", "nvfp4-linear"])
def test_the_amx_sampler_matches_the_dequantizing_one_and_follows_weight_sync(preset):
    model, contract = tiny_model(preset)
    fast = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, nvfp4_gemm=True)
    slow = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, nvfp4_gemm=False, prepack=False)

    def close(a, b):
        (ids_a, lp_a), (ids_b, lp_b) = a, b
        # same products, float32 sums in another order: the first token of every row agrees, and the
        # logprobs of tokens where both took the same path agree to BF16 rounding
        assert [i[0] for i in ids_a] == [i[0] for i in ids_b]
        diffs = [abs(x - y) for ia, ib, la, lb in zip(ids_a, ids_b, lp_a, lp_b) for x, y, s, t in
                 zip(la, lb, ia, ib) if s == t]
        assert max(diffs) < 0.1

    close(outputs(fast), outputs(slow))
    assert fast.memory()["dequantized_cache_bytes"] < slow.memory()["dequantized_cache_bytes"]  # no DQ(W)
    before = outputs(fast)
    optimizer_step(model)
    payload = build_payload(model, contract, version=1)
    fast.load(payload, verify=True)
    slow.load(payload)
    after = outputs(fast)
    assert after != before  # the kernel's copy of the weights was rebuilt ...
    close(after, outputs(slow))  # ... from the new bytes
    fresh = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, nvfp4_gemm=True)
    assert outputs(fresh) == after


def test_fast_paths_are_refused_where_they_cannot_run():
    model, _ = tiny_model("nvfp4-w4a16")
    with pytest.raises(ValueError, match="prepack=True"):
        Sampler(model, dtype=torch.float32, prepack=True)
    with pytest.raises(ValueError, match="nvfp4_gemm=True"):
        Sampler(model, dtype=torch.float32, nvfp4_gemm=True)
    with pytest.raises(ValueError, match="cpu_ops=True"):
        Sampler(model, dtype=torch.float32, cpu_ops=True)
    fp32 = Sampler(model, eos_token_ids=[])
    assert not fp32.prepack and not fp32.nvfp4_gemm and not fp32.cpu_ops and not fp32.fast_head


@needs_amx
def test_two_threads_give_the_same_bits_as_one():
    q = weight(272, 256, seed=5)  # 17 panels: an uneven split
    w = cpu_gemm.GemmWeight([q])
    x = torch.randn(40, 256).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.linear(x, w)
        torch.set_num_threads(2)
        two = cpu_gemm.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_amx
def test_a_long_prefill_dequantizes_per_call_and_matches_the_dequantizing_sampler():
    """More than GEMM_MAX_ROWS rows: each NVFP4 linear dequantizes into one reused buffer and runs
    oneDNN; every layer must still see its own weight."""
    from fp4rl.packed import GEMM_MAX_ROWS

    model, _ = tiny_model("nvfp4-w4a16")
    fast = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, nvfp4_gemm=True)
    slow = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, nvfp4_gemm=False, prepack=False)
    prompts = [[(7 * i + j) % 90 + 1 for j in range(20)] for i in range(6)]  # 120 prefill rows
    assert sum(map(len, prompts)) > GEMM_MAX_ROWS
    greedy = SamplingParams(greedy=True, max_new_tokens=4)
    a, b = fast.generate(prompts, greedy), slow.generate(prompts, greedy)
    assert [c.completion_ids[0] for c in a] == [c.completion_ids[0] for c in b]
    assert max(abs(x.logprobs[0] - y.logprobs[0]) for x, y in zip(a, b)) < 0.05
