"""Weight sync: payload contents and size, in-place load with equality checks, refusal of corrupted or
mismatched payloads (old weights kept), serialisation."""

import copy
import dataclasses

import pytest
import torch
from rl_fixtures import converted_model, optimizer_step

from fp4rl.precision import PrecisionContract
from fp4rl.qat import NVFP4Linear, packed_state
from fp4rl.sampler import Sampler, SamplingParams
from fp4rl.weight_sync import Payload, build_payload, verify_equal

CONFIG = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
              tie_word_embeddings=True)
MOE = dict(CONFIG, model_type="qwen2_moe", qkv_bias=True, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=48, tie_word_embeddings=False)
PROMPTS = [[3, 4, 5], [9, 1]]
GREEDY = SamplingParams(greedy=True, max_new_tokens=6)


def trainer(config=CONFIG, preset="nvfp4-linear", seed=0):
    return converted_model(config, preset, seed)


def snapshot(sampler):
    return {k: v.clone() for k, v in sampler.model.state_dict().items()}


def assert_unchanged(sampler, before, version):
    after = sampler.model.state_dict()
    assert all(torch.equal(after[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
               for k, v in before.items())
    assert sampler.policy_version == version


def test_payload_ships_the_bytes_the_trainer_forward_used_at_4_5_bits_per_param():
    model, contract = trainer()
    payload = build_payload(model, contract, version=3)
    quantized = {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    assert set(payload.packed) == set(quantized) and len(quantized) == 14  # 7 linears x layers 0-1
    for name, q in payload.packed.items():
        assert q is quantized[name].quantized_weight()  # the forward's cached Q(W) itself
    assert 4.5 < payload.bits_per_quantized_param <= 4.6
    assert payload.packed_bytes == sum(q.nbytes for q in packed_state(model).values())
    # the rest in BF16, tied embeddings once, no master weight of a quantized linear
    assert {t.dtype for t in payload.dense.values()} == {torch.bfloat16}
    assert "model.embed_tokens.weight" in payload.dense and "lm_head.weight" not in payload.dense
    assert not set(payload.dense) & set(quantized)
    assert payload.nbytes == payload.packed_bytes + payload.dense_bytes
    assert "bits/param" in payload.summary()


@pytest.mark.parametrize("config,preset", [(CONFIG, "nvfp4-linear"), (MOE, "nvfp4-experts")])
def test_load_applies_a_training_step_in_place_and_proves_byte_equality(config, preset):
    model, contract = trainer(config, preset)
    sampler = Sampler(model, eos_token_ids=[])
    old = sampler.generate(PROMPTS, GREEDY)
    buffers = {k: v.data_ptr() for k, v in sampler.model.state_dict().items()}
    optimizer_step(model)
    with pytest.raises(ValueError, match="differs from the bytes"):
        verify_equal(sampler, model)  # stale sampler
    payload = build_payload(model, contract, version=1, dense_dtype=torch.float32)
    sampler.load(payload, verify=True)
    verify_equal(sampler, model)
    assert sampler.policy_version == 1
    assert {k: v.data_ptr() for k, v in sampler.model.state_dict().items()} == buffers  # in place
    new = sampler.generate(PROMPTS, GREEDY)
    fresh = Sampler(model, eos_token_ids=[]).generate(PROMPTS, GREEDY)
    assert [c.completion_ids for c in new] == [c.completion_ids for c in fresh]
    assert [c.logprobs for c in new] == [c.logprobs for c in fresh]  # dequantized caches were rebuilt
    assert [c.logprobs for c in new] != [c.logprobs for c in old]
    assert {c.policy_version for c in new} == {1}


def test_dense_tensors_travel_in_bf16_by_default():
    model, contract = trainer()
    sampler = Sampler(model)
    optimizer_step(model)
    sampler.load(build_payload(model, contract, version=1), verify=True)
    ours = dict(sampler.model.named_parameters())["model.norm.weight"]
    assert torch.equal(ours, model.model.norm.weight.detach().bfloat16().float())
    verify_equal(sampler, model)  # packed bytes are exact whatever dense_dtype is


def _flip_byte(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.reshape(-1).view(torch.uint8)[t.numel() * t.element_size() // 2] ^= 0x10
    return t


def test_a_corrupted_payload_is_refused_and_the_old_weights_are_kept():
    model, contract = trainer()
    sampler = Sampler(model)
    optimizer_step(model)
    good = build_payload(model, contract, version=1)
    before = snapshot(sampler)
    name = "model.layers.1.mlp.down_proj.weight"
    corruptions = {
        "packed data": dataclasses.replace(good, packed={**good.packed, name: dataclasses.replace(
            good.packed[name], data=_flip_byte(good.packed[name].data))}),
        "block scale": dataclasses.replace(good, packed={**good.packed, name: dataclasses.replace(
            good.packed[name], block_scale=_flip_byte(good.packed[name].block_scale))}),
        "dense": dataclasses.replace(good, dense={**good.dense, "model.norm.weight": _flip_byte(
            good.dense["model.norm.weight"])}),
    }
    for what, payload in corruptions.items():
        with pytest.raises(ValueError, match="does not match its checksum"):
            sampler.load(payload, verify=True)
        assert_unchanged(sampler, before, 0), what
    relabelled = dataclasses.replace(good, version=5)  # version changed without resealing
    with pytest.raises(ValueError, match="digest"):
        sampler.load(relabelled)
    assert_unchanged(sampler, before, 0)
    sampler.load(good)  # the intact payload still applies
    assert sampler.policy_version == 1


def test_mismatched_or_stale_payloads_are_refused_and_the_old_weights_are_kept():
    model, contract = trainer()
    sampler = Sampler(model)
    sampler.load(build_payload(model, contract, version=2))
    before = snapshot(sampler)
    other_shape, _ = trainer(dict(CONFIG, intermediate_size=128))
    w4a16, w4a16_contract = trainer(preset="nvfp4-w4a16")
    missing = build_payload(model, contract, version=3)
    missing.dense.pop("model.norm.weight")
    cases = [
        (build_payload(model, contract, version=1), "older than the sampler's policy v2"),
        (build_payload(other_shape, contract, version=3),
         r"gate_proj.weight.data is torch.uint8 \[128, 32\] in the payload, the sampler holds"),
        (build_payload(w4a16, w4a16_contract, version=3), "w4a16 in the payload, w4a4 in the sampler"),
        (missing.seal(), "dense tensors do not match .*missing \\['model.norm.weight'\\]"),
        (build_payload(trainer(MOE, "nvfp4-experts")[0], PrecisionContract("nvfp4-experts"), version=3),
         "packed tensors do not match"),
    ]
    for payload, match in cases:
        with pytest.raises(ValueError, match=match):
            sampler.load(payload)
        assert_unchanged(sampler, before, 2)
    with pytest.raises(TypeError, match="Payload"):
        sampler.load({"version": 3})
    sampler.load(build_payload(model, contract, version=2))  # the same version again: an idempotent re-push
    optimizer_step(model)  # other weights under the version the sampler holds: refused
    with pytest.raises(ValueError, match="v2 holds other weights than the v2 the sampler has"):
        sampler.load(build_payload(model, contract, version=2))
    assert_unchanged(sampler, before, 2)
    sampler.load(build_payload(model, contract, version=3))
    assert sampler.policy_version == 3


@pytest.mark.parametrize("seal", [True, False], ids=["sealed", "unsealed"])
def test_a_failed_verification_stops_generation_until_a_load_succeeds(monkeypatch, seal):
    """verify=True finds other bytes after the copy (a memory fault, simulated by one linear whose packed
    data reads back with a flipped bit): the old weights are gone, so generate refuses until a load
    succeeds. Unsealed (no checksums), verify compares the bytes directly and finds it too."""
    from fp4rl import weight_sync
    model, contract = trainer()
    sampler = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    payload = build_payload(model, contract, version=1, seal=seal)
    linear = sampler.model.get_submodule("model.layers.1.mlp.down_proj")
    honest = linear.quantized_weight

    def faulty():
        q = honest()
        data = q.data.clone()
        data.view(-1)[0] ^= 1
        return dataclasses.replace(q, data=data)

    monkeypatch.setattr(linear, "quantized_weight", faulty)
    with pytest.raises(weight_sync.VerifyError, match="down_proj.weight.data in the sampler does not hold"):
        sampler.load(payload, verify=True)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="not a known version.*v1 failed verification.*load a payload"):
        sampler.generate(PROMPTS, GREEDY)
    assert sampler.policy_version == 0
    sampler.load(payload, verify=True)
    assert sampler.policy_version == 1 and sampler.weights_error is None
    assert len(sampler.generate(PROMPTS, GREEDY)) == 2


def test_build_payload_refuses_a_model_converted_with_another_contract():
    model, _ = trainer(preset="nvfp4-linear")
    with pytest.raises(ValueError, match="not converted with this contract"):
        build_payload(model, PrecisionContract("nvfp4-w4a16"), version=1)
    with pytest.raises(ValueError, match="not converted with this contract"):
        build_payload(model, PrecisionContract("nvfp4-linear", bf16_last_fraction=0.0), version=1)
    with pytest.raises(ValueError, match="version"):
        build_payload(model, PrecisionContract("nvfp4-linear"), version=-1)


def test_payload_round_trips_through_bytes_and_files(tmp_path):
    model, contract = trainer()
    sampler = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    payload = build_payload(model, contract, version=4)
    blob = payload.to_bytes()
    assert len(blob) < payload.nbytes + 64 * 1024  # tensors plus a JSON header
    again = Payload.from_bytes(blob)
    assert again.digest == payload.digest and again.checksums == payload.checksums
    again.check()
    payload.save(tmp_path / "v4.fp4rl")
    from_file = Payload.load(tmp_path / "v4.fp4rl")
    sampler.load(from_file, verify=True)
    verify_equal(sampler, model)

    before = snapshot(sampler)
    tampered = bytearray(blob)
    tampered[-100] ^= 0x01  # inside the tensor data
    with pytest.raises(ValueError, match="does not match its checksum"):
        sampler.load(Payload.from_bytes(bytes(tampered)))
    assert_unchanged(sampler, before, 4)
    with pytest.raises(ValueError, match="not a readable fp4rl payload"):
        Payload.from_bytes(blob[:1000])


def test_a_load_drops_what_moe_blocks_derived_from_the_old_experts():
    """Sampler.load invalidates every derived copy, including a MoE block's expert plan (its decode copies
    are refreshed only from tensor versions otherwise: tensors made under inference_mode have none)."""
    from types import SimpleNamespace

    model, contract = trainer(MOE, preset="nvfp4-experts")
    sampler = Sampler(model)
    calls = []
    blocks = [m for m in sampler.model.modules() if type(m).__name__.endswith("MoeBlock")]
    assert blocks
    for b in blocks:
        b.plan = SimpleNamespace(invalidate=lambda: calls.append(1))
    optimizer_step(model)
    sampler.load(build_payload(model, contract, version=1))
    assert len(calls) == len(blocks)


def test_a_load_interrupted_while_copying_stops_generation_until_a_load_succeeds(monkeypatch):
    """A KeyboardInterrupt (or a device error) after validation, between two tensors' copies, leaves the
    sampler with some old and some new weights: it re-raises, and generate refuses (it used to label that
    mix with the old version and digest) until a load succeeds. An interruption before any copy keeps the
    old weights usable."""
    model, contract = trainer()
    sampler = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    payload = build_payload(model, contract, version=1)
    real_copy, calls = torch.Tensor.copy_, []

    def interrupted(self, *a, **kw):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_copy(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sampler.load(payload)
    monkeypatch.undo()
    assert sampler.policy_version == 0 and "interrupted halfway (KeyboardInterrupt" in sampler.weights_error
    with pytest.raises(RuntimeError, match="not a known version.*loading v1 was interrupted halfway"):
        sampler.generate(PROMPTS, GREEDY)
    sampler.load(payload)
    assert sampler.policy_version == 1 and sampler.weights_error is None
    assert len(sampler.generate(PROMPTS, GREEDY)) == 2
    with pytest.raises(ValueError, match="older than"):  # refused before any copy: nothing marked
        sampler.load(build_payload(model, contract, version=0))
    assert sampler.weights_error is None


def test_a_payload_with_non_finite_values_is_refused_before_any_copy():
    """NaN / Inf in a dense tensor or a packed global scale (a diverged trainer, sealed as it is) passes the
    checksums: it is refused by name before anything is copied, with or without verify, and the sampler
    keeps its weights and version (it used to load them silently, or with verify=True report a failed copy
    after overwriting the old weights)."""
    model, contract = trainer()
    sampler = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    good = build_payload(model, contract, version=1)
    before = snapshot(sampler)
    name = "model.layers.1.mlp.down_proj.weight"
    cases = {}
    for bad in (float("nan"), float("inf"), float("-inf")):
        norm = good.dense["model.norm.weight"].clone()
        norm[3] = bad
        cases["model.norm.weight", bad] = dataclasses.replace(
            good, dense={**good.dense, "model.norm.weight": norm}).seal()
        q = good.packed[name]
        cases[f"{name}.global_scale", bad] = dataclasses.replace(good, packed={**good.packed, name: (
            dataclasses.replace(q, global_scale=torch.full_like(q.global_scale, bad)))}).seal()
    for verify in (False, True):
        for (tensor, _), payload in cases.items():
            with pytest.raises(ValueError, match=f"{tensor} holds non-finite values.*refused"):
                sampler.load(Payload.from_bytes(payload.to_bytes()), verify=verify)
            assert_unchanged(sampler, before, 0)
            assert sampler.weights_error is None
    assert len(sampler.generate(PROMPTS, GREEDY)) == 2
    sampler.load(good, verify=True)
    assert sampler.policy_version == 1


def test_verify_compares_dense_tensors_by_bytes(monkeypatch):
    """verify=True checks the sampler's bytes: a dense tensor that reads back +0.0 where the payload has
    -0.0 (equal as numbers, torch.equal) is a failed copy."""
    from fp4rl import weight_sync
    model, contract = trainer()
    sampler = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    payload = build_payload(model, contract, version=1)
    norm = payload.dense["model.norm.weight"].clone()
    norm[5] = -0.0
    payload = dataclasses.replace(payload, dense={**payload.dense, "model.norm.weight": norm}).seal()
    target = sampler.model.get_parameter("model.norm.weight")
    real_copy = torch.Tensor.copy_

    def sign_losing_copy(self, src, *a, **kw):  # a faulty copy into that one parameter
        if self.data_ptr() == target.data_ptr():
            src = src.abs()
        return real_copy(self, src, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "copy_", sign_losing_copy)
    with pytest.raises(weight_sync.VerifyError, match="model.norm.weight in the sampler differs"):
        sampler.load(payload, verify=True)
    monkeypatch.undo()
    assert sampler.policy_version == 0 and "failed verification" in sampler.weights_error
    sampler.load(payload, verify=True)
    assert sampler.policy_version == 1 and sampler.weights_error is None
    assert target[5].item() == 0.0 and torch.signbit(target[5])


@pytest.mark.parametrize("exc", [KeyboardInterrupt, torch.OutOfMemoryError], ids=["ctrl-c", "oom"])
def test_a_verify_interrupted_after_the_copy_stops_generation_until_a_load_succeeds(monkeypatch, exc):
    """An exception other than VerifyError while verifying (Ctrl-C, an out-of-memory error in a copy the
    check makes) comes after the new bytes are in: the sampler must not go on generating with them labelled
    as the old version. It re-raises and generate refuses until a load succeeds."""
    from fp4rl import weight_sync
    model, contract = trainer()
    sampler = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    payload = build_payload(model, contract, version=1)
    real_checksum, calls = weight_sync.tensor_checksum, []

    def interrupted(name, t):
        calls.append(name)
        if len(calls) == len(payload.checksums) + 1:  # after check(): the first checksum verify takes
            raise exc()
        return real_checksum(name, t)

    monkeypatch.setattr(weight_sync, "tensor_checksum", interrupted)
    with pytest.raises(exc):
        sampler.load(payload, verify=True)
    monkeypatch.undo()
    assert sampler.policy_version == 0 and sampler.weights_error is not None
    assert f"loading v1 was interrupted halfway ({exc.__name__}" in sampler.weights_error
    with pytest.raises(RuntimeError, match="not a known version.*loading v1 was interrupted"):
        sampler.generate(PROMPTS, GREEDY)
    sampler.load(payload, verify=True)
    assert sampler.policy_version == 1 and sampler.weights_error is None


def _with_header(blob: bytes, edit) -> bytes:
    """`blob` (Payload.to_bytes) with its fp4rl JSON header replaced by edit(header)."""
    import json

    from safetensors.torch import load, save

    n = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8:8 + n])["__metadata__"]
    header = json.loads(meta["fp4rl"])
    edit(header)
    return save(load(blob), metadata={**meta, "fp4rl": json.dumps(header)})


def test_a_malformed_payload_header_is_refused_as_unreadable():
    """Missing or mistyped header fields raise the documented ValueError, not a bare KeyError,
    AttributeError or TypeError; a dtype name must name a torch.dtype."""
    model, contract = trainer()
    blob = build_payload(model, contract, version=2).to_bytes()
    name = "model.layers.0.self_attn.q_proj.weight"
    edits = {
        "no packed": lambda h: h.pop("packed"),
        "no checksums": lambda h: h.pop("checksums"),
        "no version": lambda h: h.pop("version"),
        "no modes": lambda h: h.pop("modes"),
        "no digest": lambda h: h.pop("digest"),
        "no input_kwargs": lambda h: h.pop("input_kwargs"),
        "version a str": lambda h: h.update(version="2"),
        "unknown dtype": lambda h: h["packed"][name].update(dtype="bfloat17"),
        "dtype names a function": lambda h: h["packed"][name].update(dtype="zeros"),
        "dtype names a module": lambda h: h["packed"][name].update(dtype="nn"),
        "dtype not a str": lambda h: h["packed"][name].update(dtype=7),
        "meta lacks tile": lambda h: h["packed"][name].pop("tile"),
        "meta a list": lambda h: h["packed"].update({name: [1, 2]}),
        "shape of strs": lambda h: h["packed"][name].update(shape=["a"]),
        "packed a list": lambda h: h.update(packed=[name]),
        "checksums a list": lambda h: h.update(checksums=["x"]),
    }
    for what, edit in edits.items():
        with pytest.raises(ValueError, match="not a readable fp4rl payload"):
            Payload.from_bytes(_with_header(blob, edit))
            pytest.fail(what)
    again = Payload.from_bytes(_with_header(blob, lambda h: None))
    again.check()
    assert again.version == 2


def test_an_unsealed_payload_loads_without_hashing_and_is_sealed_when_it_travels(monkeypatch):
    """build_payload(seal=False), the RL loop's in-process sync: no checksum is computed to build or load it
    (BLAKE2b over a host copy of every byte cost the default job ~0.8 s of a 1.3 s step on the H200), its
    digest names the object, verify=True compares bytes directly, and to_bytes seals it before it travels."""
    from fp4rl import weight_sync
    model, contract = trainer()
    sampler = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    hashed = []
    real_checksum = weight_sync.tensor_checksum
    monkeypatch.setattr(weight_sync, "tensor_checksum", lambda n, t: hashed.append(n) or real_checksum(n, t))
    payload = build_payload(model, contract, version=1, dense_dtype=torch.float32, seal=False)
    assert not payload.sealed and payload.checksums == {} and payload.digest.startswith("local-")
    with pytest.raises(ValueError, match="not sealed"):
        payload.check()
    sampler.load(payload, verify=True)
    sampler.load(payload)  # the same object again: an idempotent re-push
    assert hashed == [] and sampler.policy_version == 1 and sampler.weights_digest == payload.digest
    verify_equal(sampler, model)
    fresh = Sampler(model, eos_token_ids=[])
    assert [c.logprobs for c in sampler.generate(PROMPTS, GREEDY)] == \
        [c.logprobs for c in fresh.generate(PROMPTS, GREEDY)]

    # (verify=True on an unsealed payload that reads back other bytes:
    # test_a_failed_verification_stops_generation_until_a_load_succeeds[unsealed])
    optimizer_step(model)
    second = build_payload(model, contract, version=2, seal=False)
    sampler.load(second, verify=True)
    # other weights under the same version: a copy of the payload is another object, another digest (however
    # it was copied: an edited copy must not pass for the payload the sampler holds; pickle fails on the FP8
    # scales, as ray_pool notes)
    before = snapshot(sampler)
    edited = copy.deepcopy(second)
    edited.dense["model.norm.weight"] *= 2
    for other in (dataclasses.replace(second, dense={**second.dense}), copy.copy(second), edited):
        assert other.digest != second.digest and other.digest.startswith("local-") and not other.sealed
        with pytest.raises(ValueError, match="v2 is not the v2 payload the sampler holds.*known by its obj"):
            sampler.load(other)
        assert_unchanged(sampler, before, 2)
    assert hashed == []

    # it travels sealed: to_bytes seals it in place, the receiver checks every checksum
    local = second.digest
    blob = second.to_bytes()
    assert second.sealed and second.digest == second.compute_digest(second.checksums) != local
    assert len(hashed) == len(second.checksums)
    received = Payload.from_bytes(blob)
    assert received.sealed and received.digest == second.digest
    remote = Sampler(model, eos_token_ids=[])
    remote.load(received, verify=True)
    assert remote.weights_digest == second.digest
    sampler.load(second)  # the sampler that holds it unsealed accepts it sealed (its name before sealing)
    assert sampler.policy_version == 2
    # sealed only to travel, it is not hashed again by a load in this process (async + Ray: the trainer
    # thread's eval sampler loads the payload the rollout thread's pool sealed)
    n = len(hashed)
    evaluator = Sampler(model, eos_token_ids=[])
    evaluator.load(second)
    assert len(hashed) == n and evaluator.policy_version == 2
    assert not copy.copy(second).sealed_to_travel  # a copy of it is checked as any sealed payload


def test_a_payload_given_checksums_is_sealed_and_checked():
    """A Payload built from its parts with checksums and a digest (an outside reader of to_bytes' format, as
    from_bytes is) is sealed: its bytes are checked against them, not taken unchecked as an unsealed one."""
    model, contract = trainer()
    sampler = Sampler(model)
    optimizer_step(model)
    good = build_payload(model, contract, version=1)
    parts = dict(version=good.version, packed=good.packed, modes=good.modes, input_kwargs=good.input_kwargs,
                 checksums=good.checksums, digest=good.digest)
    norm = "model.norm.weight"
    rebuilt = Payload(dense={**good.dense, norm: _flip_byte(good.dense[norm])}, **parts)
    assert rebuilt.sealed
    with pytest.raises(ValueError, match="model.norm.weight does not match its checksum"):
        sampler.load(rebuilt)
    sampler.load(Payload(dense=good.dense, **parts))
    assert sampler.policy_version == 1 and sampler.weights_digest == good.digest


def test_an_unsealed_payload_with_non_finite_values_is_refused_before_any_copy():
    model, contract = trainer()
    sampler = Sampler(model, eos_token_ids=[])
    optimizer_step(model)
    good = build_payload(model, contract, version=1, seal=False)
    before = snapshot(sampler)
    for bad in (float("nan"), float("inf"), float("-inf")):
        emb = good.dense["model.embed_tokens.weight"].clone()
        emb[-1, -1] = bad
        payload = dataclasses.replace(good, dense={**good.dense, "model.embed_tokens.weight": emb})
        with pytest.raises(ValueError, match="model.embed_tokens.weight holds non-finite values.*refused"):
            sampler.load(payload)
        assert_unchanged(sampler, before, 0)
    sampler.load(good)
    assert sampler.policy_version == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_first_nonfinite_names_the_first_tensor_holding_nan_or_inf(dtype):
    """weight_sync.first_nonfinite (one aminmax per tensor, one host sync) agrees with torch.isfinite."""
    from fp4rl.weight_sync import first_nonfinite
    g = torch.Generator().manual_seed(0)
    named = [(f"t{i}", (torch.randn(17, 33, generator=g) * 100).to(dtype)) for i in range(6)]
    named += [("empty", torch.empty(0, dtype=dtype)), ("ints", torch.arange(5))]
    assert first_nonfinite(named) is None
    for spots in ([(4, float("nan"))], [(2, float("-inf")), (4, float("nan"))], [(5, float("inf"))],
                  [(0, float("nan")), (1, float("inf"))]):
        case = [(n, t.clone()) for n, t in named]
        for i, value in spots:
            case[i][1].view(-1)[int(torch.randint(0, 17 * 33, (1,), generator=g))] = value
        want = next(n for n, t in case if t.is_floating_point() and not bool(torch.isfinite(t).all()))
        assert first_nonfinite(case) == want == f"t{spots[0][0]}"


def test_first_nonfinite_in_each_dtype_s_own_range():
    """float64 past float32's range is finite; float8 (no aminmax on a CPU) is checked through float32."""
    from fp4rl.weight_sync import first_nonfinite
    big = torch.tensor([1e300, -1e300, 3.0], dtype=torch.float64)
    assert first_nonfinite([("big", big)]) is None
    assert first_nonfinite([("big", big), ("inf", torch.tensor([1.0, float("inf")], dtype=torch.float64))]) \
        == "inf"
    def f8(values, dtype):
        return torch.tensor(values).to(dtype)

    e5m2 = f8([1.0, -2.0, 57344.0], torch.float8_e5m2)
    assert first_nonfinite([("e5m2", e5m2)]) is None
    assert first_nonfinite([("e5m2", e5m2), ("e5m2 inf", f8([1.0, float("-inf")], torch.float8_e5m2)),
                            ("e4m3 nan", f8([float("nan")], torch.float8_e4m3fn))]) == "e5m2 inf"
    assert first_nonfinite([("e4m3", f8([448.0, -1.0], torch.float8_e4m3fn)),
                            ("e4m3 nan", f8([2.0, float("nan")], torch.float8_e4m3fn))]) == "e4m3 nan"
