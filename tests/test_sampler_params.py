"""Sampler: what it is asked and how it draws: stop strings (and the window the stop search decodes), seeds
(reproducible, all 64 bits), EOS and pad ids, greedy / top-k / top-p, the inverse-CDF draw and the nucleus,
SamplingParams, non-finite logits and prompts refused, the `fp4rl generate` command. What it computes (KV
cache, logprobs, routing, packed linears, TRACE): tests/test_sampler.py (its helpers are shared)."""

import warnings

import pytest
import torch
from test_sampler import PROMPTS, V, tiny

from fp4rl.precision import PrecisionContract
from fp4rl.qat import convert
from fp4rl.sampler import Sampler, SamplingParams, _generator_seed


class CharTokenizer:
    """A fake tokenizer: one token per ASCII character, 0 is EOS (a special token)."""

    eos_token_id, pad_token_id = 0, 0
    all_special_tokens = ["\x00"]

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def test_stop_strings_end_the_completion_and_cut_the_text():
    tokenizer = CharTokenizer()
    sampler = Sampler(tiny(), tokenizer, eos_token_ids=[])
    prompt = "Hello"
    free = sampler.generate([prompt], SamplingParams(greedy=True, max_new_tokens=12))[0]
    assert free.text == "".join(map(chr, free.completion_ids)) and free.finish_reason == "length"
    stop = free.text[5:7]
    first = free.text.find(stop)
    c = sampler.generate([prompt], SamplingParams(greedy=True, max_new_tokens=12, stop=("\x7f" * 3, stop)))[0]
    assert c.finish_reason == "stop"
    assert c.text == free.text[:first]
    assert c.completion_ids == free.completion_ids[:first + len(stop)]  # up to the token completing it
    assert c.logprobs == free.logprobs[:len(c.completion_ids)]
    for special in ("\x00", "ab\x00c"):  # the special token itself, or a string holding it: never in the text
        with pytest.raises(ValueError, match=r"stop string .* contains the special token '\\x00'.*eos_token"):
            sampler.generate([prompt], SamplingParams(greedy=True, max_new_tokens=4, stop=(stop, special)))


def test_stop_search_decodes_a_window_of_the_last_tokens():
    """The stop check after each token decodes the last tokens (the longest stop string + 16), not the whole
    completion (O(length^2) per row); its answer is the full decode's on every prefix: a stop string ending at
    the last token, one only in the earlier text (found at its step, not again), none, and a window of tokens
    that decode to nothing (the whole completion is decoded then)."""
    class Counting(CharTokenizer):
        decoded = 0

        def decode(self, ids, skip_special_tokens=False):
            Counting.decoded += len(ids)
            return super().decode(ids, skip_special_tokens)

    sampler = Sampler(tiny(), Counting(), eos_token_ids=[])
    g = torch.Generator().manual_seed(5)
    ids = (torch.randint(97, 100, (400,), generator=g)).tolist()  # 'a'..'c'
    ids[150:153] = [ord(c) for c in "xyz"]
    stops = ("xyz", "ccc" * 2)

    def full(prefix):
        text = "".join(map(chr, prefix))
        hits = [i for st in stops if (i := text.find(st)) >= 0]
        return text[:min(hits)] if hits else None

    for n in range(1, len(ids) + 1):
        if full(ids[:n - 1]) is None:  # the sampler stops at the first hit; later prefixes never get here
            assert sampler._find_stop(ids[:n], stops) == full(ids[:n]), n
    Counting.decoded = 0
    assert sampler._find_stop(ids[:140], stops) is None and Counting.decoded <= 6 + 16
    empty = ids[:100] + [0] * 30 + [ord(c) for c in "xyz"]  # 30 tokens that decode to nothing ...

    class Skipping(CharTokenizer):
        def decode(self, ids, skip_special_tokens=False):
            return super().decode(ids, skip_special_tokens=True)

    sampler.tokenizer = Skipping()
    assert sampler._find_stop(empty, stops) == "".join(map(chr, ids[:100]))  # ... still found


def test_eos_ids_pad_ids_seeds_and_stop_none_are_normalized_or_refused():
    """eos_token_ids: an int, a list, a tensor or an array of ids all stop on the id (a tensor's 0-d elements
    never matched, an int raised TypeError); strings are refused by name; ids past the vocabulary are dropped
    with a warning. A pad id past the embeddings (a [PAD] added without resizing) pads with 0 instead of
    failing the lookup. Seeds outside [0, 2**64) and stop=None: refused / ()."""
    import numpy as np

    model = tiny()
    greedy = SamplingParams(greedy=True, max_new_tokens=8)
    free = Sampler(model, eos_token_ids=[]).generate([[3, 4, 5]], greedy)[0]
    eos = free.completion_ids[2]
    for ids in (eos, [eos], torch.tensor([eos]), np.array([eos]), (eos, 10 ** 6)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = Sampler(model, eos_token_ids=ids).generate([[3, 4, 5]], greedy)[0]
        assert c.finish_reason == "eos" and c.completion_ids == free.completion_ids[:3], ids
        assert any("not ids of the model" in str(w.message) for w in caught) == isinstance(ids, tuple)
    with pytest.raises(ValueError, match=r"eos_token_ids=\['</s>'\]: must be a token id or an iterable"):
        Sampler(model, eos_token_ids=["</s>"])

    class FarPad(CharTokenizer):
        pad_token_id = 10 ** 6

    sampler = Sampler(model, FarPad(), eos_token_ids=[])
    assert sampler.pad_token_id == 0
    both = sampler.generate([[3, 4, 5], [7]], greedy)
    assert both[0].completion_ids == free.completion_ids
    for seed in (-1, 2 ** 64):
        with pytest.raises(ValueError, match=r"seed.*\[0, 2\*\*64\)"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2 ** 64 - 1).seed == 2 ** 64 - 1 and SamplingParams(stop=None).stop == ()


def test_seeds_differ_in_their_high_32_bits_on_the_cpu():
    """torch's CPU generator keeps a seed's low 32 bits: seeds 5 and 5 + 2**32 (a base + (rank << 32)
    scheme) drew the same completions, and 0 and 2**63 too. Seeds below 2**32 keep their streams."""
    sampler = Sampler(tiny(), eos_token_ids=[])

    def ids(seed):
        out = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=8, seed=seed))
        return [c.completion_ids for c in out]

    assert ids(5) != ids(5 + 2 ** 32) and ids(0) != ids(2 ** 63) and ids(2 ** 63) == ids(2 ** 63)
    assert all(_generator_seed(s, torch.device("cpu")) == s for s in (0, 5, 2 ** 32 - 1))
    assert _generator_seed(2 ** 40, torch.device("cuda")) == 2 ** 40  # CUDA's generator keeps 64 bits


def test_seeds_are_reproducible_and_top_k_1_is_greedy():
    sampler = Sampler(tiny(), eos_token_ids=[])
    params = dict(n=4, temperature=1.3, max_new_tokens=10)
    a = sampler.generate(PROMPTS, SamplingParams(**params, seed=7))
    b = sampler.generate(PROMPTS, SamplingParams(**params, seed=7))
    c = sampler.generate(PROMPTS, SamplingParams(**params, seed=8))
    assert [x.completion_ids for x in a] == [x.completion_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.completion_ids for x in a] != [x.completion_ids for x in c]
    assert len({tuple(x.completion_ids) for x in a if x.prompt_index == 0}) > 1  # samples of a prompt differ

    greedy = sampler.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=10))
    for restricted in (dict(top_k=1), dict(top_p=1e-6)):
        got = sampler.generate(PROMPTS, SamplingParams(max_new_tokens=10, seed=3, **restricted))
        assert [x.completion_ids for x in got] == [x.completion_ids for x in greedy]
        # logprobs are under the untruncated softmax (T = 1 here, as greedy), not renormalised to 0
        assert [x.logprobs for x in got] == [x.logprobs for x in greedy]
        assert all(lp < 0 for x in got for lp in x.logprobs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(n=0), "n="), (dict(n=1.5), "n="), (dict(temperature=0.0), "temperature"),
    (dict(temperature=1e-38), "temperature=1e-38: must be a finite number >= 1e-06"),
    (dict(greedy=True, temperature=-1.0), "temperature"), (dict(greedy=True, temperature=float("inf")),
                                                            "temperature"),
    (dict(temperature=float("nan")), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"), (dict(max_new_tokens=0), "max_new_tokens"), (dict(stop="x"), "stop"),
    (dict(stop=("",)), "stop"), (dict(seed="1"), "seed"), (dict(greedy=1), "greedy"),
])
def test_bad_sampling_params_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=f"SamplingParams.{match}"):
        SamplingParams(**kwargs)


def test_greedy_ignores_the_temperature_and_non_finite_logits_are_refused():
    """greedy=True ignores T (0 accepted, as the docstring says; the error message itself suggests greedy);
    logits holding NaN or +inf, or a row of -inf, give a ValueError instead of a token (the torch fallback
    drew the last id with a -inf or NaN logprob)."""
    from fp4rl.sampler import sample_next

    assert SamplingParams(greedy=True, temperature=0.0).greedy
    logits = torch.randn(3, 50)
    logits[1, 3] = float("inf")
    for bad in (float("inf"), float("nan")):
        logits[1, 3] = bad
        for params in (SamplingParams(greedy=True), SamplingParams(temperature=0.7, top_k=5)):
            with pytest.raises(ValueError, match=r"logits of batch rows \[1\] are not finite"):
                sample_next(logits, params, torch.Generator().manual_seed(0))
    logits[1] = float("-inf")
    with pytest.raises(ValueError, match=r"rows \[1\] are not finite"):
        sample_next(logits, SamplingParams(), None)
    model = tiny()
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):  # the fused C head hands such rows to the torch code
        with pytest.raises(ValueError, match="not finite"):
            Sampler(model, eos_token_ids=[], dtype=dtype).generate([[3, 4]], SamplingParams(max_new_tokens=2))


def test_bad_prompts_are_refused_with_a_clear_error():
    sampler = Sampler(tiny(), eos_token_ids=[])
    params = SamplingParams(max_new_tokens=4)
    cases = [([], "non-empty list"), ([[1, 2], []], "prompt 1 is empty"), ([[1, V]], "outside"),
             ([[1, -1]], "outside"), (["text"], "no tokenizer"), ([[1.0]], "int token ids"),
             ([list(range(62))], "context of 64"), ("abc", "non-empty list")]
    for prompts, match in cases:
        with pytest.raises(ValueError, match=match):
            sampler.generate(prompts, params)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        sampler.generate([[1]], SamplingParams(stop=("x",)))
    with pytest.raises(TypeError, match="SamplingParams"):
        sampler.generate([[1]], dict(max_new_tokens=3))
    with pytest.raises(ValueError, match="kv_cache"):
        Sampler(tiny(), kv_cache="int8")
    assert len(sampler.generate([list(range(60))], params)[0].completion_ids) == 4  # exactly fits


def test_generate_command_prints_the_greedy_completion(capsys):
    import argparse

    from fp4rl import generate as command
    from fp4rl.hf import load_model
    from fp4rl.tasks import apply_chat_template

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--prompt", "What is 2 + 3?", "--greedy", "--max-new-tokens", "6",
                              "--kv-cache", "fp8"])
    assert command.run(args) == 0
    printed = capsys.readouterr().out
    model, tokenizer = load_model("default")
    prompt = apply_chat_template(tokenizer, "What is 2 + 3?", tokenize=True)  # a chat model: templated
    expected = Sampler(convert(model, PrecisionContract("bf16")), tokenizer, kv_cache="fp8").generate(
        [prompt], SamplingParams(greedy=True, max_new_tokens=6))[0]
    assert printed == expected.text + "\n" and expected.text.strip()


def test_generate_command_refuses_a_bad_sampling_option_before_loading_the_model(monkeypatch):
    import argparse

    from fp4rl import generate as command
    from fp4rl import hf

    monkeypatch.setattr(hf, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    for bad in (["--n", "0"], ["--temperature", "-1"], ["--max-new-tokens", "0"]):
        with pytest.raises(SystemExit, match="fp4rl generate: SamplingParams"):
            command.run(parser.parse_args(["--prompt", "hi", *bad]))


def test_inverse_cdf_sampling_draws_the_distribution_and_never_a_zero():
    from fp4rl.sampler import inverse_cdf_sample

    g = torch.Generator().manual_seed(0)
    probs = torch.zeros(4, 300)
    probs[:, [0, 2, 3, 299]] = torch.tensor([0.5, 0.2, 0.25, 0.05])
    probs[1] = probs[1].roll(7)  # rows differ
    draws = torch.stack([inverse_cdf_sample(probs, g) for _ in range(20_000)])  # [draws, rows]
    for r in range(4):
        freq = torch.bincount(draws[:, r], minlength=300).float() / draws.shape[0]
        assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(probs[r]).flatten().tolist())
        assert (freq - probs[r]).abs().max() < 0.012  # ~4 sigma at 20k draws
    again = torch.Generator().manual_seed(0)
    assert torch.equal(inverse_cdf_sample(probs, again), draws[0])  # seeded: reproducible


def test_nucleus_keeps_what_a_full_sort_keeps():
    from fp4rl.sampler import nucleus

    def full_sort(logits, top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[:, 0] = False
        return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))

    g = torch.Generator().manual_seed(0)
    for scale in (0.3, 1.0, 4.0, 12.0):  # flat to peaked: the top-k prefix grows when it must
        logits = torch.randn(6, 3000, generator=g) * scale
        for top_p in (0.05, 0.5, 0.9, 0.999):
            got, expected = nucleus(logits, top_p, first=32), full_sort(logits, top_p)
            assert torch.equal(got.isinf(), expected.isinf()) and torch.equal(got[~got.isinf()],
                                                                                expected[~expected.isinf()])


def test_default_eos_is_the_tokenizers_and_the_model_configs():
    """A chat model may end its turns on a token other than the tokenizer's eos_token_id: config.json's
    eos_token_id (one id or a list) ends completions too."""
    model = tiny()
    model.config.extra["eos_token_id"] = [5, 7]
    assert Sampler(model, CharTokenizer()).eos_token_ids == {0, 5, 7}
    model.config.extra["eos_token_id"] = 9
    assert Sampler(model, None).eos_token_ids == {9}
    assert Sampler(model, CharTokenizer(), eos_token_ids=[3]).eos_token_ids == {3}


def test_max_seq_len_past_the_models_positions_and_a_flat_prompt_are_refused():
    """max_seq_len above max_position_embeddings (positions the model never had) or 0 (it used to mean "the
    model's" silently) is refused; so is a prompt list of bare ints (one prompt not wrapped in a list)."""
    from rl_fixtures import tiny_model

    model = tiny_model()
    limit = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"more positions than the model's max_position_embeddings = "
                                         f"{limit}"):
        Sampler(model, max_seq_len=limit + 1)
    with pytest.raises(ValueError, match="max_seq_len=0: must be an integer >= 2"):
        Sampler(model, max_seq_len=0)
    sampler = Sampler(model, max_seq_len=limit, eos_token_ids=[])
    with pytest.raises(ValueError, match=r"prompt 0 is the int 5: .*wrap one prompt as \[\[id"):
        sampler.generate([5, 6, 7], SamplingParams(max_new_tokens=2))
