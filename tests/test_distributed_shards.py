"""fp4rl.distributed.shards: the sharding and seeding rule every scale-out backend uses, and LocalShards."""

import dataclasses

import pytest
import torch

from fp4rl.distributed import LocalShards, generate_sharded, merge, shard_bounds, shard_params, shard_seed
from fp4rl.model import CausalLM, ModelConfig
from fp4rl.precision import PrecisionContract
from fp4rl.qat import convert
from fp4rl.sampler import Sampler, SamplingParams

CFG = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, qk_norm=True)


def tiny_sampler():
    torch.manual_seed(0)
    model = convert(CausalLM(ModelConfig(**CFG)).eval(), PrecisionContract("nvfp4-w4a16"))
    return Sampler(model, eos_token_ids=[])


def test_bounds_cover_every_prompt_once_in_order():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    assert shard_bounds(0, 2) == [(0, 0), (0, 0)]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="shards"):
            shard_bounds(5, bad)


def test_seeds():
    assert shard_seed(7, 0) == 7 and shard_seed(None, 3) is None
    seeds = {shard_seed(7, i) for i in range(64)} | {shard_seed(8, i) for i in range(1, 64)}
    assert len(seeds) == 127, "shard seeds must differ across shards and runs"
    assert all(0 <= s < 2 ** 63 for s in seeds)
    p = shard_params(SamplingParams(n=2, seed=7, max_new_tokens=3), 2)
    assert p.seed == shard_seed(7, 2) and p.n == 2 and p.max_new_tokens == 3


def test_one_shard_is_generate_and_shards_are_the_sequential_reference():
    s = tiny_sampler()
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11]]
    params = SamplingParams(n=2, seed=11, max_new_tokens=4)
    assert LocalShards(s, 1).generate(prompts, params) == s.generate(prompts, params)
    got = LocalShards(s, 3).generate(prompts, params)
    want = []
    for i, (a, b) in enumerate(shard_bounds(len(prompts), 3)):
        part = s.generate(prompts[a:b], dataclasses.replace(params, seed=shard_seed(11, i)))
        want += [dataclasses.replace(c, prompt_index=c.prompt_index + a) for c in part]
    assert got == want
    assert [c.prompt_index for c in got] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert [c.prompt_ids for c in got[::2]] == prompts
    assert got != s.generate(prompts, params), "other shards sample with other seeds"
    more = LocalShards(s, 8).generate(prompts, params)  # more shards than prompts: empty shards
    assert [c.prompt_ids for c in more[::2]] == prompts
    two = LocalShards(s, 2)
    assert two.policy_version == s.policy_version and two.max_seq_len == s.max_seq_len


def test_merge_refuses_mismatched_parts():
    c = generate_sharded(lambda i, p, sp: [], [], SamplingParams(), 2)
    assert c == []
    with pytest.raises(ValueError, match="2 shard results for 3 shards"):
        merge([[], []], shard_bounds(3, 3))
    s = tiny_sampler()
    part = s.generate([[1, 2]], SamplingParams(max_new_tokens=2, seed=0))
    with pytest.raises(ValueError, match="outside its 0 prompts"):
        merge([part, []], [(0, 0), (0, 1)])


def test_local_shards_refuse_no_prompts_like_sampler_generate():
    s = tiny_sampler()
    params = SamplingParams(max_new_tokens=2, seed=0)
    with pytest.raises(ValueError, match="non-empty list of prompts"):
        s.generate([], params)
    for shards in (1, 3):
        for bad in ([], (), "abc"):
            with pytest.raises(ValueError, match="non-empty list of prompts"):
                LocalShards(s, shards).generate(bad, params)
