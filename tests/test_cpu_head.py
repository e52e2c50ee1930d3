"""The fused sampling head (fp4rl/cpu_head.py): greedy tokens and logprobs as torch computes them,
temperature sampling from the right distribution, seeds, fallbacks, and the BF16 sampler using it."""

import pytest
import torch

from fp4rl import cpu_head
from fp4rl.model import CausalLM, ModelConfig
from fp4rl.precision import PrecisionContract
from fp4rl.qat import convert
from fp4rl.sampler import Sampler, SamplingParams, sample_next

pytestmark = pytest.mark.skipif(not cpu_head.available(), reason="no AVX-512 CPU / C compiler")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [5, 16, 1000, 49157])
def test_greedy_matches_torch(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(7, vocab, generator=g) * 3).to(dtype)
    logits[2, vocab // 2] = logits[2, -1] = logits[2].max() + 1  # a tie: the first index wins
    tokens, lp = cpu_head.sample_head(logits, True, 1.0, None)
    ref_tokens, ref_lp = sample_next(logits, SamplingParams(greedy=True), None)
    assert torch.equal(tokens, ref_tokens) and tokens[2] == vocab // 2
    assert (lp - ref_lp).abs().max() < 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_sampling_draws_softmax_of_logits_over_t(temperature):
    g = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.45, 0.0, 0.05, 0.3, 0.2])
    logits = (probs.log() * temperature)[None].repeat(40_000, 1)  # softmax(logits / T) = probs
    tokens, lp = cpu_head.sample_head(logits, False, temperature, g)
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert freq[1] == 0 and (freq - probs).abs().max() < 0.01  # ~4 sigma
    assert torch.allclose(lp, probs.log()[tokens], atol=1e-5)
    again = cpu_head.sample_head(logits[:100], False, temperature, torch.Generator().manual_seed(0))[0]
    assert torch.equal(again, tokens[:100])  # the seed fixes the tokens


def test_non_finite_or_unsupported_logits_fall_back():
    logits = torch.randn(3, 40)
    logits[1, 7] = float("nan")
    assert cpu_head.sample_head(logits, True, 1.0, None) is None
    assert cpu_head.sample_head(torch.full((2, 9), float("-inf")), True, 1.0, None) is None
    assert cpu_head.sample_head(torch.randn(2, 9).half(), True, 1.0, None) is None
    assert cpu_head.sample_head(torch.randn(2, 3, 9), True, 1.0, None) is None


def test_the_bf16_sampler_chooses_with_the_fused_head():
    torch.manual_seed(0)
    config = ModelConfig(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = CausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    convert(model.eval(), PrecisionContract("bf16"))
    fast = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, fast_head=True)
    slow = Sampler(model, eos_token_ids=[], dtype=torch.bfloat16, fast_head=False)
    assert Sampler(model, eos_token_ids=[], dtype=torch.bfloat16).fast_head  # the BF16 default
    assert not Sampler(model, eos_token_ids=[]).fast_head  # FP32: torch's ops, as before
    prompts = [[1, 2, 3], [4, 5]]
    greedy = SamplingParams(greedy=True, max_new_tokens=6)
    a, b = fast.generate(prompts, greedy), slow.generate(prompts, greedy)
    assert [c.completion_ids for c in a] == [c.completion_ids for c in b]
    assert max(abs(x - y) for c, d in zip(a, b) for x, y in zip(c.logprobs, d.logprobs)) < 1e-5
    sampled = SamplingParams(n=3, max_new_tokens=6, seed=3)
    assert [c.completion_ids for c in fast.generate(prompts, sampled)] == \
        [c.completion_ids for c in fast.generate(prompts, sampled)]
