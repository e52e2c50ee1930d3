"""Trainer: QAT logprobs at temperature, micro-batching, mismatch metrics, schedule, routing
replay, checkpoints (round trip, atomicity, retention). Tiny random models on CPU."""

import copy
import dataclasses
import math
import random
import shutil

import numpy as np
import pytest
import torch
from rl_fixtures import tiny_model

from fp4rl.batch import Batch
from fp4rl.config import ConfigError, RunConfig, load_config
from fp4rl.grpo import grpo_loss, token_logprobs
from fp4rl.hf import load_model
from fp4rl.precision import PrecisionContract
from fp4rl.trainer import Trainer, latest_checkpoint, list_checkpoints, lr_factor

NVFP4 = PrecisionContract("nvfp4-linear")


def config(**sets) -> RunConfig:
    base = {"trainer.autocast": "none", "trainer.lr": 1e-3, "trainer.micro_batch_size": 0}
    base.update(sets)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


class FakeCompletion:
    """What Batch.from_completions reads of a sampler Completion."""

    def __init__(self, prompt_ids, completion_ids, logprobs, policy_version=0, routing=None):
        self.prompt_ids, self.completion_ids, self.logprobs = prompt_ids, completion_ids, logprobs
        self.policy_version, self.routing = policy_version, routing


def make_batch(model, advantages=(1.0, -1.0, 0.5, -0.5), temperature=1.0, offset=0.0, seed=0, routing=False):
    """Random prompts/completions of different lengths; sampler logprobs = the model's own + offset."""
    g = torch.Generator().manual_seed(seed)
    completions = []
    for i, _ in enumerate(advantages):
        prompt = torch.randint(4, 64, (3 + i,), generator=g).tolist()
        completion = torch.randint(4, 64, (5 - i % 3,), generator=g).tolist()
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            out = model(ids[:, :-1], return_routing=routing)
            logits, chosen = out if routing else (out, None)
            lp = token_logprobs(logits.float() / temperature, ids[:, 1:])[0, len(prompt) - 1 :]
        r = torch.stack([c[0] for c in chosen]) if routing else None  # [layers, L-1, top_k]
        completions.append(FakeCompletion(prompt, completion, (lp + offset).tolist(), routing=r))
    return Batch.from_completions(completions, advantages)


def test_batch_alignment_and_micro_batches_trim_padding():
    model = tiny_model()
    batch = make_batch(model)
    assert batch.input_ids.shape == (4, 11) and batch.loss_mask.shape == (4, 10)
    # row 0: prompt 3 tokens, completion 5 -> targets 3..7 are completion tokens, columns 2..6
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1, 0, 0, 0]
    assert batch.num_tokens == 5 + 4 + 3 + 5
    first, second = batch.split(2)
    assert first.input_ids.shape == (2, 8) and second.input_ids.shape == (2, 11)
    assert torch.equal(first.sampler_logprobs, batch.sampler_logprobs[:2, :7])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_model_at_the_sampling_temperature(temperature):
    model = tiny_model()
    trainer = Trainer(model, PrecisionContract("bf16"), config(**{"sampler.temperature": temperature}))
    batch = make_batch(trainer.model, temperature=temperature)
    with torch.no_grad():
        lp = trainer.logprobs(batch)
    diff = (lp - batch.sampler_logprobs).abs() * batch.loss_mask
    assert diff.max() < 1e-5  # right padding changes nothing for the real tokens


def test_micro_batches_give_the_full_batch_update():
    base = tiny_model()
    results = []
    for mbs in (0, 1, 3):
        trainer = Trainer(copy.deepcopy(base), NVFP4, config(**{"trainer.micro_batch_size": mbs}))
        batch = make_batch(trainer.model, offset=0.05)
        metrics = trainer.step(batch)
        results.append((metrics, [p.detach().clone() for p in trainer.params]))
    (m0, p0), *others = results
    for m, p in others:
        assert m["train/loss"] == pytest.approx(m0["train/loss"], rel=1e-5, abs=1e-7)
        assert m["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-4)
        assert m["mismatch/logprob_abs_diff"] == pytest.approx(m0["mismatch/logprob_abs_diff"], rel=1e-5)
        # Adam's first step moves each weight by lr * g / (|g| + eps): ~lr = 1e-3 for ordinary gradients,
        # but for entries whose gradient is near eps, rounding-level differences between the micro-batch
        # sums move it by up to ~1e-5 (5.7e-6 seen on an AMD EPYC). A lost micro-batch moves weights by
        # ~lr; a doubled one (scale-free for Adam's first step) shows in the loss and gradient norm above.
        assert all(torch.allclose(a, b, atol=2e-5) for a, b in zip(p0, p))


def test_grad_norm_is_that_of_the_grpo_loss_before_clipping():
    model = tiny_model()
    cfg = config(**{"trainer.grad_clip": 1e-3})
    trainer = Trainer(copy.deepcopy(model), NVFP4, cfg)
    batch = make_batch(trainer.model)
    reference = Trainer(copy.deepcopy(model), NVFP4, cfg)
    loss, _ = grpo_loss(reference.logprobs(batch), batch.advantages, batch.loss_mask, cfg.grpo,
                        sampler_logprobs=batch.sampler_logprobs)
    loss.backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.params])).item()
    metrics = trainer.step(batch)
    assert metrics["train/grad_norm"] == pytest.approx(expected, rel=1e-4)
    assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    assert expected > 1e-3  # so the clip was active


def test_mismatch_metrics_measure_the_sampler_offset():
    trainer = Trainer(tiny_model(), NVFP4, config())
    exact = trainer.step(make_batch(trainer.model))
    assert exact["mismatch/logprob_abs_diff"] < 1e-5 and exact["mismatch/kl_k3"] < 1e-9

    trainer = Trainer(tiny_model(), NVFP4, config())
    shifted = trainer.step(make_batch(trainer.model, offset=0.1))  # mu = pi * e^0.1: r = e^-0.1
    assert shifted["mismatch/logprob_abs_diff"] == pytest.approx(0.1, abs=1e-5)
    assert shifted["mismatch/logprob_abs_diff_max"] == pytest.approx(0.1, abs=1e-5)
    assert shifted["mismatch/kl_k3"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-3)
    assert shifted["mismatch/tis_clip_frac"] == 0.0

    trainer = Trainer(tiny_model(), NVFP4, config())
    clipped = trainer.step(make_batch(trainer.model, offset=-1.0))  # r = e^1 > tis_cap 2
    assert clipped["mismatch/tis_clip_frac"] == 1.0


def test_a_step_moves_logprobs_along_the_advantages():
    trainer = Trainer(tiny_model(), NVFP4, config(**{"trainer.lr": 3e-3}))
    batch = make_batch(trainer.model, advantages=(1.0, -1.0, 1.0, -1.0))
    with torch.no_grad():
        before = (trainer.logprobs(batch) * batch.loss_mask).sum(1)
    assert trainer.policy_version == 0
    trainer.step(batch)
    assert trainer.policy_version == 1 and trainer.updates == 1
    with torch.no_grad():
        after = (trainer.logprobs(batch) * batch.loss_mask).sum(1)
    assert (torch.sign(after - before) == batch.advantages.sign()).all()


def test_empty_batch_counts_a_step_without_an_update():
    trainer = Trainer(tiny_model(), NVFP4, config())
    params = [p.detach().clone() for p in trainer.params]
    metrics = trainer.step(Batch.from_completions([], []))
    assert trainer.policy_version == 1 and trainer.updates == 0
    assert metrics["train/sequences"] == 0 and metrics["train/loss"] == metrics["train/grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(params, trainer.params))


def test_bf16_autocast_and_updates_per_batch():
    cfg = config(**{"trainer.autocast": "bf16", "loop.updates_per_batch": 3})
    trainer = Trainer(tiny_model(), NVFP4, cfg)
    batch = make_batch(trainer.model)
    metrics = trainer.step(batch)
    assert trainer.updates == 3 and trainer.policy_version == 1
    assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
    # pi_old is the bf16-autocast trainer before the first update, mu the fp32 model: they differ
    assert 0 < metrics["mismatch/logprob_abs_diff"] < 1.0


def test_kl_to_the_reference_policy_starts_at_zero():
    trainer = Trainer(tiny_model(), NVFP4, config(**{"grpo.kl_coef": 0.1}))
    batch = make_batch(trainer.model)
    assert trainer.step(batch)["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert trainer.step(batch)["train/kl_ref"] > 1e-6


def test_lr_schedules():
    assert [lr_factor(u, schedule="constant", warmup=2, total=6) for u in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert [lr_factor(u, schedule="linear", warmup=0, total=4) for u in range(4)] == [1.0, 0.75, 0.5, 0.25]
    cos = [lr_factor(u, schedule="cosine", warmup=1, total=5) for u in range(5)]
    c1, c3 = (1 + math.cos(math.pi / 4)) / 2, (1 + math.cos(3 * math.pi / 4)) / 2
    assert cos == pytest.approx([1.0, 1.0, c1, 0.5, c3])
    trainer = Trainer(tiny_model(), NVFP4, config(**{"trainer.lr_schedule": "linear", "trainer.steps": 4}))
    batch = make_batch(trainer.model)
    assert [trainer.step(batch)["train/lr"] for _ in range(3)] == pytest.approx([1e-3, 7.5e-4, 5e-4])


def test_routing_replay_scores_the_sampler_experts():
    model = tiny_model(moe=True)
    trainer = Trainer(model, PrecisionContract("nvfp4-experts"), config())
    batch = make_batch(trainer.model, routing=True)  # the completions carry the model's long experts
    assert batch.routing.shape[:3] == (4, 4, batch.input_ids.shape[1] - 1)  # 4 MoE layers
    assert batch.routing.dtype == torch.int16  # cast on the way in: 2 bytes an id, not 8
    assert all(mb.routing.dtype == torch.int16 for mb in batch.split(2))
    with torch.no_grad():
        replayed = trainer.logprobs(batch)
        flipped = copy.copy(batch)
        flipped.routing = 3 - batch.routing  # other experts (4 experts, top-2)
        other = trainer.logprobs(flipped)
    mask = batch.loss_mask.bool()
    assert torch.allclose(replayed[mask], batch.sampler_logprobs[mask], atol=1e-5)
    assert (other[mask] - replayed[mask]).abs().max() > 1e-3
    assert math.isfinite(trainer.step(batch)["train/grad_norm"])


def test_routing_of_another_integer_dtype_is_cast_and_bad_routing_raises():
    model = tiny_model(moe=True)
    trainer = Trainer(model, PrecisionContract("nvfp4-experts"), config())
    batch = make_batch(trainer.model, routing=True)
    base = torch.no_grad()(trainer.logprobs)(batch)
    completions = [FakeCompletion([5, 6, 7], [8, 9], [-1.0, -1.0], routing=batch.routing[:, i, :4])
                   for i in range(2)]
    for dtype in (torch.uint8, torch.int32, torch.int64):  # handed in by a user: cast, same replay
        given = [FakeCompletion(c.prompt_ids, c.completion_ids, c.logprobs, routing=c.routing.to(dtype))
                 for c in completions]
        b = Batch.from_completions(given, [1.0, -1.0])
        assert b.routing.dtype == torch.int16 and torch.equal(b.routing, batch.routing[:, :2, :4])
        direct = dataclasses.replace(batch, routing=batch.routing.to(dtype))  # Batch(...) casts too
        assert direct.routing.dtype == torch.int16
        with torch.no_grad():
            assert torch.equal(trainer.logprobs(direct), base)
    with torch.no_grad():  # the model itself replays any integer dtype, as long
        ids = batch.input_ids[:1, :-1]
        want = trainer.model(ids, routing=[r[:1] for r in batch.routing.long()])
        assert torch.equal(trainer.model(ids, routing=[r[:1].to(torch.int32) for r in batch.routing]), want)
        with pytest.raises(TypeError, match="routing replay: expert ids must have an integer dtype"):
            trainer.model(ids, routing=[r[:1].float() for r in batch.routing])
    # float ids: a clear error, not a silent truncation
    bad = [FakeCompletion(c.prompt_ids, c.completion_ids, c.logprobs, routing=c.routing.float())
           for c in completions]
    with pytest.raises(TypeError, match=r"completion 0: routing: .* integer dtype .*, got torch.float32"):
        Batch.from_completions(bad, [1.0, -1.0])
    with pytest.raises(TypeError, match="Batch.routing: expert ids must have an integer dtype"):
        dataclasses.replace(batch, routing=batch.routing.to(torch.float16))
    with pytest.raises(TypeError, match="integer dtype"):
        dataclasses.replace(batch, routing=batch.routing.bool())
    # ids that int16 cannot hold
    for wrong in (-1, 40000):
        r = completions[1].routing.to(torch.int32).clone()
        r[0, 0, 0] = wrong
        bad = [completions[0], FakeCompletion([5, 6, 7], [8, 9], [-1.0, -1.0], routing=r)]
        match = rf"completion 1: routing: expert ids must lie in \[0, 32768\).*{wrong}"
        with pytest.raises(ValueError, match=match):
            Batch.from_completions(bad, [1.0, -1.0])
    # ids the model does not have (4 experts): refused before any forward
    out_of_range = dataclasses.replace(batch, routing=batch.routing.clone())
    out_of_range.routing[2, 1, 0, 1] = 4
    with pytest.raises(ValueError, match=r"Batch.routing: expert ids must lie in \[0, 4\).*\[0, 4\]"):
        trainer.step(out_of_range)


def test_bad_settings_fail_early():
    with pytest.raises(ValueError, match="sampler.temperature"):
        Trainer(tiny_model(), NVFP4, config(**{"sampler.temperature": 0.0}))
    with pytest.raises(ValueError, match="Batch.advantages"):
        Batch(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(3),
              torch.zeros(2, dtype=torch.long))


# ---------------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_resumes_identically(tmp_path):
    cfg = config()
    trainer = Trainer(tiny_model(), NVFP4, cfg)
    batch = make_batch(trainer.model)
    trainer.step(batch)
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    path = trainer.save_checkpoint(tmp_path, step=1, extra={"note": [1, 2]})
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    saved = trainer.model.model.embed_tokens.weight.detach().clone()
    after = trainer.step(batch)

    fresh = Trainer(tiny_model(seed=5), NVFP4, cfg)  # other weights: the checkpoint must overwrite them
    state = fresh.load_checkpoint(path)
    assert state == {"step": 1, "policy_version": 1, "extra": {"note": [1, 2]}}
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws
    again = fresh.step(batch)
    assert again["train/loss"] == after["train/loss"]
    assert all(torch.equal(a, b) for a, b in zip(trainer.params, fresh.params))
    assert fresh.policy_version == trainer.policy_version == 2

    with pytest.warns(UserWarning, match="no tokenizer"):
        loaded, _ = load_model(path)  # the model part is a plain HF checkpoint
    assert torch.equal(loaded.model.embed_tokens.weight, saved)

    # a config that now resolves some linears to another precision (a changed contract, or a changed rule
    # for the BF16 last layers) is refused instead of switching them mid-run
    other = Trainer(tiny_model(), PrecisionContract("nvfp4-linear", bf16_last_fraction=0.0), cfg)
    with pytest.raises(ConfigError, match=r"another precision than this config resolves to now.*mid-run"):
        other.load_checkpoint(path)


def test_checkpoints_keep_the_newest_and_ignore_partial_ones(tmp_path):
    trainer = Trainer(tiny_model(), NVFP4, config())
    for step in (1, 2, 3):
        trainer.save_checkpoint(tmp_path, step=step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    # a kill during a save leaves a temporary directory, and maybe a half-written step dir
    partial = tmp_path / "checkpoints" / ".tmp-step_000004-abc"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"half")
    half = tmp_path / "checkpoints" / "step_000005"
    half.mkdir()
    assert latest_checkpoint(tmp_path).name == "step_000003"
    assert partial.exists()  # a reader leaves it (it may be a live run's save in progress) ...
    assert latest_checkpoint(tmp_path, clean=True).name == "step_000003"
    assert not partial.exists()  # ... the run's own resume removes it
    assert trainer.load_checkpoint(latest_checkpoint(tmp_path))["step"] == 3


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_rejected_tokens_leave_the_denominator_with_micro_batches(loss_agg, level):
    """MIS drops the rejected tokens (sequences) from the loss and from its denominator (grpo.py), with or
    without micro-batches; train/kl_ref is the whole batch's k3 mean whatever the micro-batch size."""
    base = tiny_model()
    sets = {"grpo.is_correction": "mis", "grpo.is_level": level, "grpo.loss_agg": loss_agg,
            "grpo.kl_coef": 0.1, "grpo.mis_low": 0.5, "grpo.mis_high": 2.0}
    g = torch.Generator().manual_seed(3)
    results = []
    for mbs in (0, 1, 3):
        cfg = config(**sets, **{"trainer.micro_batch_size": mbs})
        trainer = Trainer(copy.deepcopy(base), NVFP4, cfg)
        torch.manual_seed(0)
        with torch.no_grad():  # a reference policy apart from the trainer's, so the KL is not 0
            for p in trainer.ref_model.parameters():
                p.add_(torch.randn(p.shape) * 0.05)
        batch = make_batch(trainer.model, advantages=(1.0, -1.0, 0.5, -0.5, 0.8, -0.3), seed=1)
        if not results:
            spread = 0.8 if level == "token" else 0.3
            noise = torch.randn(batch.sampler_logprobs.shape, generator=g) * spread
        batch.sampler_logprobs += noise * batch.loss_mask  # some tokens (sequences) rejected, some kept
        if not results:  # the full-batch objective as grpo.py defines it (no loss_denominator)
            ref = copy.deepcopy(trainer)
            lp = ref.logprobs(batch)
            with torch.no_grad():
                ref_lp = ref.logprobs(batch, ref.ref_model)
            loss, m = grpo_loss(lp, batch.advantages, batch.loss_mask, cfg.grpo,
                                sampler_logprobs=batch.sampler_logprobs, ref_logprobs=ref_lp)
            loss.backward()
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.params])).item()
            assert 0.1 < m["mismatch/mis_mask_frac"] < 0.9  # the case this test is about
            if level == "sequence" or loss_agg == "token-mean":  # (token-level: every sequence keeps some)
                assert m["train/loss_units"] < (batch.num_tokens if loss_agg == "token-mean" else len(batch))
        metrics = trainer.step(batch)
        results.append(metrics)
        assert metrics["train/loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-7), mbs
        assert metrics["train/grad_norm"] == pytest.approx(norm, rel=1e-4), mbs
        assert metrics["train/kl_ref"] == pytest.approx(m["train/kl_ref"], rel=1e-4), mbs


def test_mis_clip_and_ratio_metrics_do_not_depend_on_the_micro_batch_size():
    """train/clip_frac and train/ratio_mean are means over the tokens MIS kept: micro-batches are weighted by
    their kept tokens (they were weighted by all their tokens, so a micro-batch with many rejected ones
    counted for more), so every micro_batch_size reports the whole batch's value. Three updates per batch,
    so that the ratio moves off 1 and the clip engages."""
    base = tiny_model()
    sets = {"grpo.is_correction": "mis", "grpo.mis_low": 0.5, "grpo.mis_high": 2.0, "trainer.lr": 3e-2,
            "loop.updates_per_batch": 3}
    noise = None
    out = []
    for mbs in (0, 1, 3):
        trainer = Trainer(copy.deepcopy(base), NVFP4, config(**sets, **{"trainer.micro_batch_size": mbs}))
        batch = make_batch(trainer.model, advantages=(1.0, -1.0, 0.5, -0.5, 0.8, -0.3), seed=1)
        if noise is None:
            noise = torch.randn(batch.sampler_logprobs.shape, generator=torch.Generator().manual_seed(4))
        batch.sampler_logprobs += noise * batch.loss_mask
        out.append(trainer.step(batch))
    assert 0.1 < out[0]["mismatch/mis_mask_frac"] < 0.9 and out[0]["train/clip_frac"] > 0
    for m in out[1:]:
        for key in ("train/clip_frac", "train/ratio_mean"):
            assert m[key] == pytest.approx(out[0][key], rel=2e-3), key


def test_trace_guides_the_policy_and_not_the_reference():
    """TRACE guidance (the sampler's rounding of the policy's activations) applies to the policy's forward
    only: the KL reference's logprobs are the same with and without the rollout's guidance."""
    import dataclasses

    from fp4rl import trace

    trainer = Trainer(tiny_model(), NVFP4, config(**{"grpo.kl_coef": 0.1}))
    plain = make_batch(trainer.model)
    B, T1 = plain.loss_mask.shape
    with torch.no_grad(), trace.recording(trainer.model) as rec:
        trainer.model.model(plain.input_ids[:, :-1])
    g = torch.Generator().manual_seed(5)
    guidance = {}
    for k, r in rec.take().items():  # the rows' own scales, random bits: guidance that moves codes
        bits = torch.randint(0, 256, r.bits.shape, dtype=torch.uint8, generator=g)
        guidance[k] = trace.Guidance(bits.view(B, T1, -1), r.block_scale.view(B, T1, -1), r.amax.view(B, T1))
    assert guidance
    guided = dataclasses.replace(plain, guidance=guidance, guidance_valid=torch.ones(B, T1, dtype=torch.bool))
    with torch.no_grad():
        ref_plain = trainer.logprobs(plain, trainer.ref_model)
        ref_guided = trainer.logprobs(guided, trainer.ref_model)
        assert trainer.trace_stats.elements == 0  # the reference's forward guided nothing
        pol_plain, pol_guided = trainer.logprobs(plain), trainer.logprobs(guided)
    assert torch.equal(ref_guided, ref_plain)
    assert trainer.trace_stats.elements > 0 and not torch.equal(pol_guided, pol_plain)  # the policy is guided
    assert torch.equal(pol_plain, ref_plain)  # same weights before any update


def test_a_non_finite_update_is_refused_before_the_weights_or_optimizer_change(monkeypatch):
    """A NaN loss / gradient: the step raises naming the cause and the fix, and neither the weights nor the
    AdamW state move (an optimizer step would write NaN into both, and into every later checkpoint)."""
    import fp4rl.trainer as trainer_module

    trainer = Trainer(tiny_model(), NVFP4, config())
    batch = make_batch(trainer.model)
    trainer.step(batch)  # a finite update first: the optimizer holds state
    params = [p.detach().clone() for p in trainer.params]
    state = copy.deepcopy(trainer.optimizer.state_dict())
    real = trainer_module.grpo_loss

    def nan_loss(*a, **kw):
        loss, m = real(*a, **kw)
        return loss * float("nan"), m

    monkeypatch.setattr(trainer_module, "grpo_loss", nan_loss)
    with pytest.raises(ValueError, match=r"trainer step 2 \(update 2\).*not finite.*not applied.*--resume"):
        trainer.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(params, trainer.params))
    after = trainer.optimizer.state_dict()["state"]
    for key, st in state["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after[key][name])), (key, name)
    assert trainer.updates == 1 and all(p.grad is None for p in trainer.params)


def test_resume_uses_the_configs_betas_and_weight_decay_and_names_a_damaged_checkpoint(tmp_path):
    """`--resume --set trainer.weight_decay=...` (or betas): the optimizer state comes from the checkpoint,
    its hyperparameters from the config (the run's config.toml records them; the checkpoint's used to win,
    only lr was set again). A truncated model.safetensors or trainer.pt, or another model's tensors: a
    ConfigError naming the file and the fix (move the checkpoint away: the one before it continues)."""
    trainer = Trainer(tiny_model(), NVFP4, config())
    trainer.step(make_batch(trainer.model))
    first = trainer.save_checkpoint(tmp_path, step=1)
    path = trainer.save_checkpoint(tmp_path, step=2)
    changed = config()
    changed.trainer.weight_decay, changed.trainer.betas = 0.5, [0.5, 0.9]
    fresh = Trainer(tiny_model(), NVFP4, changed)
    fresh.load_checkpoint(path)
    groups = fresh.optimizer.param_groups
    assert all(g["weight_decay"] == 0.5 and tuple(g["betas"]) == (0.5, 0.9) for g in groups)
    assert fresh.optimizer.state_dict()["state"].keys() == trainer.optimizer.state_dict()["state"].keys()

    for name in ("model.safetensors", "trainer.pt"):
        broken = tmp_path / f"broken_{name}"
        shutil.copytree(tmp_path, broken)
        target = broken / "checkpoints" / "step_000002" / name
        target.write_bytes(target.read_bytes()[:100])
        with pytest.raises(ConfigError, match=r"checkpoint .*step_000002.* cannot be read .*damaged: move "
                                              r".*step_000002 out of .* continue from step_000001"):
            Trainer(tiny_model(), NVFP4, config()).load_checkpoint(broken / "checkpoints" / "step_000002")
    other = Trainer(tiny_model(moe=True), NVFP4, config())  # another model.name: other tensors
    with pytest.raises(ConfigError, match=r"does not match the model of model.name: .*model.name changed"):
        other.load_checkpoint(first)


def test_a_step_with_nothing_to_train_measures_the_mismatch_on_the_rollout():
    """Every group dropped (equal rewards): no update, a zero gradient, and the mismatch/* metrics from the
    whole rollout (`measure`): here sampler logprobs 0.25 above the trainer's, on every completion token."""
    trainer = Trainer(tiny_model(), PrecisionContract("bf16"), config())
    before = [p.detach().clone() for p in trainer.model.parameters()]
    rollout = make_batch(trainer.model, offset=0.25)
    empty = Batch.from_completions([], [])
    m = trainer.step(empty, measure=rollout)
    assert m["train/sequences"] == 0 and m["train/grad_norm"] == 0.0 and m["train/loss"] == 0.0
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(0.25, abs=1e-4)
    assert m["mismatch/tis_clip_frac"] == 0.0  # pi / mu = exp(-0.25) < the cap everywhere
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert trainer.policy_version == 1 and trainer.updates == 0
    assert "mismatch/logprob_abs_diff" not in trainer.step(empty)  # nothing to measure on


def test_a_warmup_longer_than_the_run_warns():
    with pytest.warns(UserWarning, match=r"trainer.warmup_steps = 50 is more than the run's 20 optimizer"):
        Trainer(tiny_model(), PrecisionContract("bf16"),
                config(**{"trainer.warmup_steps": 50, "trainer.steps": 10, "loop.updates_per_batch": 2}))
