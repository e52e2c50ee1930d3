"""fp4rl.kernels.sample_head (the GPU sampler's token choice in one kernel) against the torch path
(fp4rl.sampler.sample_next): the same tokens for the same generator state, logprobs within fp32 rounding,
the sampling distribution, non-finite rows, and the Sampler's use of it with the kernel engine. On a
machine without CUDA the kernel runs in Triton's interpreter."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (decoration time)

from fp4rl.kernels import sample_head  # noqa: E402
from fp4rl.model import CausalLM, ModelConfig  # noqa: E402
from fp4rl.precision import PrecisionContract  # noqa: E402
from fp4rl.qat import convert  # noqa: E402
from fp4rl.sampler import Sampler, SamplingParams, sample_next  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
N_DRAWS = 20000 if DEV == "cuda" else 300  # rows of one distribution test (the interpreter: ~50 ms a row)


def _gen(seed):
    return torch.Generator(DEV).manual_seed(seed)


@pytest.fixture(params=["merged, slices of 2048", "three kernels, slices of 8192"])
def layout(request, monkeypatch):
    """The head's default (one slice kernel, slices of 2048) and its A/B alternative (MERGED = False: maxima,
    then sums relative to the row's maximum, over slices of 8192)."""
    if request.param.startswith("three"):
        monkeypatch.setattr(sample_head, "MERGED", False)
        monkeypatch.setattr(sample_head, "SLICE", 8192)
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [37, 4096, 9001, 17000])  # 1 to 9 slices of 2048 (1 to 3 of 8192)
@pytest.mark.parametrize("greedy,temperature", [(True, 1.0), (False, 1.0), (False, 0.6)])
def test_same_tokens_and_logprobs_as_torch(dtype, v, greedy, temperature, layout):
    logits = (torch.randn(5, v, generator=torch.Generator().manual_seed(v)) * 3).to(dtype).to(DEV)
    tok, lp = sample_head.sample_head(logits, greedy, temperature, _gen(3))
    ref_tok, ref_lp = sample_next(logits, SamplingParams(greedy=greedy, temperature=temperature), _gen(3))
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32 and tok.device == logits.device
    assert torch.equal(tok, ref_tok)
    assert torch.allclose(lp, ref_lp, rtol=0, atol=2e-6)


def test_strided_rows_and_ties(layout):
    wide = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)).to(DEV)
    logits = wide[:, :250]  # row stride 300
    logits[1, 10] = logits[1, 200] = logits[1].max() + 1  # a tie for the max: the first index wins
    tok, lp = sample_head.sample_head(logits, True, 1.0, None)
    ref_tok, ref_lp = sample_next(logits, SamplingParams(greedy=True), None)
    assert int(tok[1]) == 10 and torch.equal(tok, ref_tok)
    assert torch.allclose(lp, ref_lp, rtol=0, atol=2e-6)
    tok, _ = sample_head.sample_head(logits, False, 1.0, _gen(0))
    ref_tok, _ = sample_next(logits, SamplingParams(), _gen(0))
    assert torch.equal(tok, ref_tok)


@pytest.mark.parametrize("greedy", [True, False])
def test_the_logprobs_recorded_into_the_samplers_table(greedy, layout):
    """record=(table, rows, col): the pick kernel also writes each row's logprob at table[rows[i], col] (the
    sampler's per-step record, no index_put), and nothing else of the table."""
    logits = (torch.randn(3, 9001, generator=torch.Generator().manual_seed(5)) * 2).to(DEV)
    table = torch.full((6, 4), -5.0, device=DEV)
    rows = torch.tensor([4, 0, 2], device=DEV)
    tok, lp = sample_head.sample_head(logits, greedy, 0.8, _gen(1), (table, rows, 3))
    again, lp2 = sample_head.sample_head(logits, greedy, 0.8, _gen(1))  # the same draws without the record
    assert torch.equal(tok, again) and torch.equal(lp, lp2)
    want = torch.full((6, 4), -5.0, device=DEV)
    want[rows, 3] = lp
    assert torch.equal(table, want)
    for bad, what in (((table.double(), rows, 0), "float32"), ((table, rows[:2], 0), "rows"),
                      ((table, rows, 4), "column 4"), ((table.t(), rows, 0), "unit column stride")):
        with pytest.raises(ValueError, match=what):
            sample_head.sample_head(logits, greedy, 0.8, _gen(1), bad)


def test_draws_follow_the_softmax(layout):
    p = torch.tensor([0.05, 0.1, 0.0, 0.25, 0.6])
    logits = p.log().expand(N_DRAWS, 5).contiguous().to(DEV)  # log 0 = -inf: never drawn
    tok, lp = sample_head.sample_head(logits, False, 1.0, _gen(11))
    counts = torch.bincount(tok.cpu(), minlength=5).double() / N_DRAWS
    assert counts[2] == 0
    sigma = (p * (1 - p) / N_DRAWS).sqrt().double()
    assert bool(((counts - p.double()).abs() <= 5 * sigma + 1e-12).all()), counts
    assert torch.allclose(lp.cpu(), p.log()[tok.cpu()], atol=1e-6)
    # temperature 0.5 squares the probabilities (renormalized)
    tok, _ = sample_head.sample_head(logits, False, 0.5, _gen(12))
    q = p ** 2 / (p ** 2).sum()
    counts = torch.bincount(tok.cpu(), minlength=5).double() / N_DRAWS
    assert bool(((counts - q.double()).abs() <= 5 * (q * (1 - q) / N_DRAWS).sqrt().double() + 1e-12).all())


def test_a_token_without_mass_is_never_drawn_at_a_rounding_boundary(layout):
    """u * total landing on the float64 rounding of the mass before a slice (u = 2^-53, a draw torch.rand can
    make): the scan of the next slice must not take its first token, whose logit is -inf."""
    v = 8192 + 64
    logits = torch.full((1, v), float("-inf"))
    logits[0, 100] = math.log(1.2 * 2.0 ** -53)  # slice 0: all its mass, ~1.2 float64 ulps of the total
    logits[0, 8192 + 5] = 0.0  # the slice from 8192 (after 1 of 8192 or 3 empty of 2048): the maximum;
    # 8192..8196 have no mass
    logits[0, 8192 + 9] = math.log(0.5)
    logits = logits.to(DEV)
    for u in (2.0 ** -53, 0.0, 1.0 - 2.0 ** -53, 0.5):
        tok, lp = sample_head.choose(logits, torch.tensor([u], dtype=torch.float64, device=DEV))
        assert bool(torch.isfinite(logits[0, tok])), (u, int(tok))
        assert bool(torch.isfinite(lp).all())
    with pytest.raises(ValueError, match="float64"):
        sample_head.choose(logits, torch.tensor([0.5], device=DEV))


@pytest.mark.parametrize("v,bad", [(50, 7), (9001, 4100)])  # one slice; a later slice of several
def test_non_finite_rows_get_nan_logprobs_and_tokens_in_range(layout, v, bad):
    logits = torch.randn(5, v, generator=torch.Generator().manual_seed(2)).to(DEV)
    logits[1, bad] = float("nan")
    logits[2, bad - 4] = float("inf")
    logits[3] = float("-inf")
    logits[4, : v // 2] = float("-inf")  # the first slices without mass: the row's sums come from the rest
    for greedy in (True, False):
        tok, lp = sample_head.sample_head(logits, greedy, 1.0, _gen(0))
        assert bool(lp[1:4].isnan().all()) and bool(lp[0].isfinite()) and bool(lp[4].isfinite())
        assert bool(((tok >= 0) & (tok < v)).all()) and int(tok[4]) >= v // 2
        ref = torch.log_softmax(logits.float(), -1)  # the finite rows' logprobs of the tokens drawn
        assert torch.allclose(lp[[0, 4]], ref[[0, 4], tok[[0, 4]]], rtol=0, atol=2e-6)


def test_what_it_does_not_take():
    assert sample_head.sample_head(torch.zeros(2, 3, 4, device=DEV), True, 1.0, None) is None
    half = torch.zeros(2, 4, dtype=torch.float16, device=DEV)
    assert sample_head.sample_head(half, True, 1.0, None) is None
    with pytest.raises(ValueError, match="temperature"):
        sample_head.sample_head(torch.zeros(2, 4, device=DEV), False, 0.0, None)
    tok, lp = sample_head.sample_head(torch.zeros(0, 4, device=DEV), False, 1.0, _gen(0))
    assert tok.shape == (0,) and lp.shape == (0,)
    with pytest.raises(ValueError, match="empty vocabulary"):
        sample_head.sample_head(torch.zeros(2, 0, device=DEV), False, 1.0, _gen(0))


def test_sampler_with_kernels_uses_it_and_matches_the_torch_head(monkeypatch):
    config = dict(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=64, qk_norm=True)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.3)
    model = convert(model.to(torch.bfloat16).eval(), PrecisionContract("nvfp4-w4a16", bf16_last_fraction=0.0))
    fast = Sampler(model, kernels=True, device=DEV, dtype=torch.bfloat16, eos_token_ids=[])
    slow = Sampler(model, kernels=True, device=DEV, dtype=torch.bfloat16, eos_token_ids=[], fast_head=False)
    assert fast.fast_head and not slow.fast_head
    calls = []
    real = sample_head.sample_head
    monkeypatch.setattr(sample_head, "sample_head", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts = [[1, 2, 3, 4], [5, 6]]
    for params in (SamplingParams(n=2, temperature=0.9, max_new_tokens=5, seed=7),
                   SamplingParams(greedy=True, max_new_tokens=5)):
        a, b = fast.generate(prompts, params), slow.generate(prompts, params)
        assert [c.completion_ids for c in a] == [c.completion_ids for c in b]
        for x, y in zip(a, b):
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-5
    assert len(calls) == 10  # one per step of each fast generate
