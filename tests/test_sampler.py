"""Sampler: KV-cache decode vs full forward, parity with transformers, logprobs vs the trainer,
routing replay, shared prefill, compaction, packed and fused linears, TRACE guidance. Stop strings,
seeds, EOS ids, the draw and bad input: tests/test_sampler_params.py."""

import pytest
import torch

from fp4rl.batch import Batch
from fp4rl.grpo import token_logprobs
from fp4rl.model import CausalLM, ModelConfig
from fp4rl.precision import PrecisionContract
from fp4rl.qat import NVFP4Linear, convert
from fp4rl.sampler import Completion, PackedNVFP4Linear, Sampler, SamplingParams

V = 128
DENSE = dict(model_type="llama", vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MOE = dict(DENSE, model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, norm_topk_prob=True)
PROMPTS = [[5, 17, 99, 3], [42], [7, 8, 9, 10, 11, 12, 13]]


def tiny(config=DENSE, contract="bf16", seed=0):
    """A random fp4rl model with peaked logits, converted with the contract preset."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.8, 1.2) if "norm" in name else p.normal_(0.0, 0.2)
    return convert(model.eval(), PrecisionContract(contract))


def greedy_full_forward(model, prompt, steps):
    """Greedy decoding by a full forward over the whole sequence at every step (no cache)."""
    ids, logprobs = list(prompt), []
    for _ in range(steps):
        logits = model(torch.tensor([ids]))[0, -1].float()
        t = int(logits.argmax())
        logprobs.append(float(logits.log_softmax(-1)[t]))
        ids.append(t)
    return ids[len(prompt):], logprobs


def trainer_logprobs(model, c: Completion, temperature=1.0, replay=True):
    """What the trainer computes: a full forward over prompt + completion, scoring the completion."""
    ids = torch.tensor([c.prompt_ids + c.completion_ids])
    routing = [r[None] for r in c.routing] if replay and c.routing is not None else None
    with torch.no_grad():
        logits = model(ids[:, :-1], routing=routing) / temperature
    return token_logprobs(logits, ids[:, 1:])[0, len(c.prompt_ids) - 1:]


@pytest.mark.parametrize("config,contract", [(DENSE, "bf16"), (DENSE, "nvfp4-linear"), (MOE, "bf16"),
                                             (MOE, "nvfp4-experts")])
def test_greedy_kv_cache_decode_equals_full_forward(config, contract):
    sampler = Sampler(tiny(config, contract), eos_token_ids=[])
    out = sampler.generate(PROMPTS, SamplingParams(n=2, greedy=True, max_new_tokens=8))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(3) for s in range(2)]
    for c in out:
        assert c.completion_ids == out[2 * c.prompt_index].completion_ids
    for c in out[::2]:
        expected, logprobs = greedy_full_forward(sampler.model, PROMPTS[c.prompt_index], 8)
        assert c.completion_ids == expected and c.finish_reason == "length"
        assert c.prompt_ids == PROMPTS[c.prompt_index]
        assert max(abs(a - b) for a, b in zip(c.logprobs, logprobs)) < 1e-5


@pytest.mark.parametrize("config", [DENSE, MOE])
def test_sampler_logprobs_equal_trainer_recompute_fp32(config):
    trainer = tiny(config)
    sampler = Sampler(trainer, eos_token_ids=[])
    params = SamplingParams(n=3, temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=12, seed=1)
    out = sampler.generate(PROMPTS, params)
    diffs = [float((trainer_logprobs(trainer, c, 0.7) - torch.tensor(c.logprobs)).abs().max()) for c in out]
    assert max(diffs) < 1e-5
    assert len({tuple(c.completion_ids) for c in out}) > 3  # it did sample


def test_moe_routing_is_returned_and_replay_reproduces_the_sampler():
    trainer = tiny(MOE, "nvfp4-experts")
    sampler = Sampler(trainer, eos_token_ids=[])
    out = sampler.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=8, seed=0))
    top_k, num_moe = MOE["num_experts_per_tok"], len(trainer.config.moe_layers)
    for c in out:
        L = len(c.prompt_ids) + len(c.completion_ids)
        # stored small (2 bytes an id, not long's 8): the sampler's buffer and Completion.routing
        assert c.routing.shape == (num_moe, L - 1, top_k) and c.routing.dtype == torch.int16
        ids = torch.tensor([c.prompt_ids + c.completion_ids])[:, :-1]
        with torch.no_grad():
            _, chosen = trainer(ids, return_routing=True)
        assert torch.equal(torch.stack(chosen)[:, 0], c.routing)  # the router's own choices
        # replaying the int16 record computes exactly what replaying it as long did, and it is the
        # sampler's own logprobs
        replayed = trainer_logprobs(trainer, c)
        as_long = Completion(**{**c.__dict__, "routing": c.routing.long()})
        assert torch.equal(replayed, trainer_logprobs(trainer, as_long))
        assert (replayed - torch.tensor(c.logprobs)).abs().max() < 1e-5
    batch = Batch.from_completions(out, [0.0] * len(out))
    assert batch.routing.dtype == torch.int16
    for i, c in enumerate(out):
        assert torch.equal(batch.routing[:, i, : c.routing.shape[1]], c.routing)
    # Perturb the trainer's routers: left alone it routes differently; replay forces the sampler's experts.
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p) * 0.5)
    c = out[0]
    ids = torch.tensor([c.prompt_ids + c.completion_ids])[:, :-1]
    with torch.no_grad():
        _, free = trainer(ids, return_routing=True)
        _, replayed = trainer(ids, routing=[r[None] for r in c.routing], return_routing=True)
    assert not torch.equal(torch.stack(free)[:, 0], c.routing)
    assert torch.equal(torch.stack(replayed)[:, 0], c.routing)


def test_matches_transformers_generate_on_the_default_model():
    transformers = pytest.importorskip("transformers")
    from fp4rl.hf import default_model_dir, load_model

    model, tokenizer = load_model("default")
    convert(model, PrecisionContract("bf16"))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(default_model_dir()), dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    sampler = Sampler(model, tokenizer)
    out = sampler.generate(prompts, SamplingParams(greedy=True, max_new_tokens=12))
    for prompt, c in zip(prompts, out):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                              pad_token_id=tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id in ref:  # transformers pads after EOS; we stop
            ref = ref[:ref.index(tokenizer.eos_token_id) + 1]
        assert c.completion_ids == ref, (prompt, c.text)
        assert c.text == tokenizer.decode(ref, skip_special_tokens=True)


def test_n_samples_share_one_prefill_and_finished_rows_leave_the_batch():
    sampler = Sampler(tiny(), eos_token_ids=[])
    batch_sizes = []
    embed = sampler.model.model.embed_tokens
    embed.register_forward_pre_hook(lambda m, a: batch_sizes.append(tuple(a[0].shape)))
    params = SamplingParams(n=3, greedy=True, max_new_tokens=6)
    out = sampler.generate(PROMPTS, params)
    assert batch_sizes[0] == (3, 7)  # one prefill of the 3 distinct prompts, padded to the longest
    assert set(batch_sizes[1:]) == {(9, 1)}  # then 3 x 3 rows decode
    for p in range(3):
        assert len({tuple(c.completion_ids) for c in out if c.prompt_index == p}) == 1

    # Make the second token of prompt 1's greedy completion an EOS: that row stops and leaves the batch.
    eos = out[3].completion_ids[1]
    sampler.eos_token_ids = {eos}
    batch_sizes.clear()
    stopped = sampler.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=6))
    assert stopped[1].completion_ids == out[3].completion_ids[:2] and stopped[1].finish_reason == "eos"
    assert batch_sizes[1] == (3, 1) and batch_sizes[-1][0] < 3
    for c in stopped:
        if eos not in c.completion_ids:  # the other rows are unchanged by their neighbour leaving
            assert c.completion_ids == out[3 * c.prompt_index].completion_ids and c.finish_reason == "length"


@pytest.mark.parametrize("mode", ["w4a4", "w4a16"])
def test_packed_linear_computes_the_trainer_linear_exactly(mode):
    trainer = tiny(DENSE, "nvfp4-linear" if mode == "w4a4" else "nvfp4-w4a16")
    name = "model.layers.0.mlp.up_proj"
    sampler = Sampler(trainer, eos_token_ids=[])
    theirs, ours = trainer.get_submodule(name), sampler.model.get_submodule(name)
    assert isinstance(theirs, NVFP4Linear) and isinstance(ours, PackedNVFP4Linear) and ours.mode == mode
    assert not any(p.numel() == theirs.weight.numel() for p in ours.parameters())  # no master weight
    x = torch.randn(3, 5, 64) * torch.logspace(-2, 2, 5)[:, None]
    with torch.no_grad():
        expected = theirs(x)
    assert torch.equal(ours(x), expected)
    ours.cache_dequantized = False
    assert torch.equal(ours(x), expected)
    mem = sampler.memory()
    assert 0.28 < mem["packed_vs_bf16"] < 0.29  # 0.5625 B/param + one FP32 scale per linear, vs 2 B
    assert mem["quantized_params"] == 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 96)  # layers 0-1 (2 is BF16)


def test_the_sampler_copy_shares_nothing_with_the_trainer():
    trainer = tiny(DENSE, "nvfp4-linear")
    sampler = Sampler(trainer, eos_token_ids=[])
    before = sampler.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=5))
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(-1.0)
    after = sampler.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=5))
    assert [c.completion_ids for c in before] == [c.completion_ids for c in after]
    assert [c.policy_version for c in after] == [0, 0, 0]


def test_state_keys_inside_packed_modules_are_found_by_their_ancestors():
    from fp4rl.packed import _inside

    names = {"model.layers.0.mlp.experts.3.gate_proj", "lm_head"}
    assert _inside("model.layers.0.mlp.experts.3.gate_proj.weight_data", names)
    assert _inside("model.layers.0.mlp.experts.3.gate_proj.inner.scale", names)
    assert not _inside("model.layers.0.mlp.experts.30.gate_proj.weight", names)  # experts.3 is not experts.30
    assert not _inside("model.layers.0.mlp.experts.3.gate_proj_b.weight", names)
    assert not _inside("lm_head", names)  # a key is inside a module, not the module


def test_a_bfloat16_sampler_computes_what_the_trainer_computes_on_bfloat16_inputs():
    trainer = tiny(DENSE, "nvfp4-linear")
    sampler = Sampler(trainer, eos_token_ids=[], dtype=torch.bfloat16)
    assert {p.dtype for p in sampler.model.parameters()} == {torch.bfloat16}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        k = trainer.get_submodule(name).in_features
        with torch.no_grad():
            torch.manual_seed(0)
            x = torch.randn(4, k).bfloat16()
            expected = trainer.get_submodule(name)(x)
        got = sampler.model.get_submodule(name)(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    out = sampler.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=3))
    assert all(len(c.completion_ids) == 3 and all(lp <= 0 for lp in c.logprobs) for c in out)


@pytest.mark.parametrize("config,contract,groups", [(DENSE, "bf16", 6), (DENSE, "nvfp4-linear", 6),
                                                    (MOE, "nvfp4-experts", 3 + 3 * 8)])
def test_fused_qkv_and_gate_up_compute_exactly_the_separate_linears(config, contract, groups):
    trainer = tiny(config, contract)
    fused = Sampler(trainer, eos_token_ids=[], fuse=True)
    plain = Sampler(trainer, eos_token_ids=[], fuse=False)
    assert len(fused.model.fused_groups) == groups and not plain.model.fused_groups
    params = SamplingParams(n=2, max_new_tokens=6, seed=0)
    a, b = fused.generate(PROMPTS, params), plain.generate(PROMPTS, params)
    assert [c.completion_ids for c in a] == [c.completion_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    attn = fused.model.model.layers[2].self_attn  # BF16 (last layer): weights are views of one buffer
    assert attn.k_proj.weight.data_ptr() == attn.q_proj.weight.data_ptr() + attn.q_proj.weight.nbytes


def test_the_step_clock_stamps_each_step_once_and_changes_nothing():
    sampler = Sampler(tiny(), eos_token_ids=[])
    params = SamplingParams(n=2, max_new_tokens=5, seed=3)
    plain = sampler.generate(PROMPTS, params)
    sampler.step_clock = clock = []
    clocked = sampler.generate(PROMPTS, params)
    assert len(clock) == 5 and clock == sorted(clock)  # one stamp per step's tokens on the host
    assert [c.completion_ids for c in clocked] == [c.completion_ids for c in plain]
    sampler.step_clock = None
    sampler.generate(PROMPTS, params)
    assert len(clock) == 5


def test_trace_guidance_is_collected_per_step_to_the_real_lengths(monkeypatch):
    """TRACE guidance: each decode step's rows are kept as they come and joined to each completion's real
    length at the end; nothing is allocated for max_new_tokens. A completion's guidance is its prompt's
    prefill rows, then the rows of the steps that fed its tokens (rebuilt here from every step's record:
    step s feeds the rows, in order, whose completion has more than s + 1 tokens)."""
    from fp4rl import trace

    takes, leads = [], []
    take, empty = trace.Recording.take, trace.Guidance.empty
    monkeypatch.setattr(trace.Recording, "take", lambda self: takes.append(take(self)) or takes[-1])
    monkeypatch.setattr(trace.Guidance, "empty",
                        staticmethod(lambda lead, width: leads.append(lead) or empty(lead, width)))
    sampler = Sampler(tiny(contract="nvfp4-linear"), eos_token_ids=list(range(0, V, 3)))
    max_new = 48
    out = sampler.generate(PROMPTS, SamplingParams(n=3, max_new_tokens=max_new, guidance=1.0, seed=3))
    lengths = [len(c.completion_ids) for c in out]
    assert 1 < max(lengths) < max_new and len(set(lengths)) > 2  # some rows finish early, at other steps
    assert all(max_new not in lead for lead in leads)  # no [B, max_new_tokens] buffers
    T_p = max(map(len, PROMPTS))
    pre, steps = takes[0], takes[1:]
    assert len(steps) == max(lengths) - 1
    for r, c in enumerate(out):
        assert c.guidance.keys() == pre.keys() and len(pre) == 2 * 4  # q, o, gate, down of the W4A4 layers
        for k, g in c.guidance.items():
            p = PROMPTS[r // 3]
            rows = [pre[k].index(slice((r // 3) * T_p + T_p - len(p), (r // 3 + 1) * T_p))]
            for s in range(len(c.completion_ids) - 1):
                i = sum(len(o.completion_ids) > s + 1 for o in out[:r])  # r's place among the rows fed at s
                rows.append(steps[s][k].index(slice(i, i + 1)))
            want = trace.Guidance.cat(rows)
            assert g["amax"].shape == (len(p) + len(c.completion_ids) - 1,)
            for f in ("bits", "block_scale", "amax"):
                assert torch.equal(g[f].view(torch.uint8), getattr(want, f).view(torch.uint8))


@pytest.mark.parametrize("contract", ["bf16", "nvfp4-w4a16"])
def test_guidance_without_a_w4a4_linear_is_refused(contract):
    """SamplingParams.guidance records the W4A4 linears' guidance: a model without one would return empty
    guidance silently; generate refuses, naming the fix."""
    sampler = Sampler(tiny(contract=contract))
    with pytest.raises(ValueError, match="has none: convert it with a W4A4 contract, e.g. "
                                         r"PrecisionContract\('nvfp4-linear'\)"):
        sampler.generate(PROMPTS, SamplingParams(max_new_tokens=2, guidance=1.0))
    assert sampler.generate(PROMPTS, SamplingParams(max_new_tokens=2))[0].guidance is None


def test_trace_guidance_of_the_routed_experts_reaches_the_trainer():
    """TRACE on the recipe (W4A4 routed experts, nvfp4-experts): the sampler records each completion's
    experts' guidance ([L-1] token rows for gate/up, [L-1, top_k] for down), Batch lays it out as [B, T-1,
    ...], and the trainer's forward, replaying the routing, is guided by it (every expert row counted) and
    scores the sampler's logprobs."""
    from fp4rl import trace

    trainer = tiny(MOE, "nvfp4-experts")
    sampler = Sampler(trainer, eos_token_ids=[])
    out = sampler.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, seed=2, guidance=1.0))
    top_k = MOE["num_experts_per_tok"]
    guided_layers = sorted({trace.layer_of(n) for n in trace.guided_modules(trainer)})
    keys = sorted(f"model.layers.{i}.mlp.experts.{p}" for i in guided_layers
                  for p in ("gate_proj", "down_proj"))
    for c in out:
        L = len(c.prompt_ids) + len(c.completion_ids)
        assert sorted(c.guidance) == keys
        for k, g in c.guidance.items():
            assert tuple(g["amax"].shape) == ((L - 1, top_k) if k.endswith("down_proj") else (L - 1,))
    batch = Batch.from_completions(out, [1.0] * len(out))
    B, T1 = batch.guidance_valid.shape
    assert tuple(batch.guidance[keys[0]].amax.shape[:2]) == (B, T1)
    stats = trace.TraceStats()
    for b, c in enumerate(out):
        n = len(c.prompt_ids) + len(c.completion_ids) - 1
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        guidance = {k: g.index(slice(b, b + 1), slice(0, n)) for k, g in batch.guidance.items()}
        with torch.no_grad(), trace.guiding(trainer, guidance, torch.ones(1, n, dtype=torch.bool), stats):
            logits = trainer(ids[:, :-1], routing=[r[None] for r in c.routing])
        lp = token_logprobs(logits, ids[:, 1:])[0, len(c.prompt_ids) - 1:]
        assert float((lp - torch.tensor(c.logprobs)).abs().max()) < 1e-5
    assert stats.elements > 0 and stats.disagree_rtn == 0
