"""GRPO maths checked against values computed by hand."""

import math

import pytest
import torch

from fp4rl.config import ConfigError
from fp4rl.grpo import (
    GRPOConfig,
    group_advantages,
    grpo_loss,
    importance_weights,
    kl_k3,
    logprob_abs_diff,
    logprob_abs_diff_max,
    mis_mask_frac,
    mismatch_kl_k3,
    mismatch_metrics,
    policy_loss,
    reward_metrics,
    tis_clip_frac,
    token_logprobs,
)


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv, zero = group_advantages(rewards, eps=0.0)
    # group 0: mean 0.5, sample std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s)
    assert torch.equal(adv[1], torch.zeros(4))
    # group 2: mean 0.75, std sqrt((3 * 0.5625 + 5.0625) / 3) = 1.5
    assert torch.allclose(adv[2], torch.tensor([-0.5, -0.5, -0.5, 1.5]))
    assert zero.tolist() == [False, True, False]
    centred, _ = group_advantages(rewards, normalize_std=False)
    assert torch.allclose(centred[2], torch.tensor([-0.75, -0.75, -0.75, 2.25]))


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="n >= 2"):
        group_advantages(torch.ones(3, 1))
    with pytest.raises(ValueError, match="num_groups"):
        group_advantages(torch.ones(4))
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[0.0, float("nan")]]))


def test_reward_metrics():
    rewards = torch.tensor([[1.0, 0.0], [0.5, 0.5]])
    correct = rewards >= 1
    m = reward_metrics(rewards, correct, torch.tensor([False, True]))
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["reward/accuracy"] == pytest.approx(0.25)
    assert m["reward/pass_at_n"] == pytest.approx(0.5)
    assert m["reward/zero_var_frac"] == pytest.approx(0.5)


def test_token_logprobs_matches_log_softmax_in_chunks():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g) * 4
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    expected = torch.log_softmax(logits.double(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    for chunk in (1, 4, 2048):
        got = token_logprobs(logits, tokens, chunk_rows=chunk)
        assert got.dtype == torch.float32 and got.shape == (3, 5)
        assert torch.allclose(got.double(), expected, atol=1e-5)
    # bf16 logits are promoted to fp32 before the softmax
    got = token_logprobs(logits.bfloat16(), tokens)
    ref = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, atol=1e-6)
    with pytest.raises(ValueError, match="shift"):
        token_logprobs(logits, tokens[:, 1:])


def test_token_logprobs_gradient():
    logits = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)  # p = [1/4, 3/4]
    lp = token_logprobs(logits, torch.tensor([[1]]))
    assert lp.item() == pytest.approx(math.log(0.75))
    lp.sum().backward()
    assert torch.allclose(logits.grad, torch.tensor([[[-0.25, 0.25]]]))  # onehot - softmax


def test_policy_loss_clipping_by_hand():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.1, 1.5; advantages per token +1, +1, -1, -1
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.5]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, m = policy_loss(logprobs, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    # per token: -min(1.5, 1.2) = -1.2 (clipped), -min(.5, .8) = -.5, -min(-1.1, -1.1) = 1.1,
    # -min(-1.5, -1.2) = 1.5
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.1 + 1.5) / 4)
    loss.backward()
    # d/dlogp of -A * rho = -A * rho where unclipped, 0 where clipped
    assert torch.allclose(logprobs.grad, torch.tensor([[0.0, -0.5, 1.1, 1.5]]) / 4)
    assert m["train/clip_frac"] == pytest.approx(0.25)
    assert m["train/ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5) / 4)


def test_clip_higher_is_asymmetric():
    logprobs = torch.log(torch.tensor([[1.25]]))
    loss_sym, _ = policy_loss(logprobs, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1))
    loss_dapo, _ = policy_loss(
        logprobs, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), clip_eps_high=0.28
    )
    assert loss_sym.item() == pytest.approx(-1.2)
    assert loss_dapo.item() == pytest.approx(-1.25)


def test_loss_aggregation_and_mask():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, 2.0])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    tok, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, loss_agg="token-mean")
    seq, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, loss_agg="seq-mean-token-mean")
    assert tok.item() == pytest.approx(-(1 + 2 * 3) / 4)
    assert seq.item() == pytest.approx(-(1 + 2) / 2)
    # micro-batches with the global denominator add up to the full-batch loss
    parts = [
        policy_loss(
            logprobs[i : i + 1],
            logprobs[i : i + 1].detach(),
            adv[i : i + 1],
            mask[i : i + 1],
            loss_denominator=4.0,
        )[0]
        for i in range(2)
    ]
    assert sum(parts).item() == pytest.approx(tok.item())
    # masked tokens get no gradient
    tok.backward()
    assert logprobs.grad[0, 1:].abs().sum() == 0


def test_kl_k3_by_hand():
    logprobs = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    # ratio ref/pi = 0.5: 0.5 - log 0.5 - 1; equal -> 0
    assert torch.allclose(kl_k3(logprobs, ref), torch.tensor([[0.5 - math.log(0.5) - 1, 0.0]]))


def test_importance_weights_token_level():
    old = torch.log(torch.tensor([[3.0, 0.5, 1.0, 9.0]]))
    sampler = torch.zeros(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, keep, m = importance_weights(old, sampler, mask, mode="tis", level="token", tis_cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0, 0.0]]))
    assert torch.equal(keep, mask)
    assert m["mismatch/tis_clip_frac"] == pytest.approx(1 / 3)
    assert m["mismatch/is_weight_mean"] == pytest.approx((3 + 0.5 + 1) / 3)
    w, keep, m = importance_weights(old, sampler, mask, mode="mis", level="token", mis_low=0.6, mis_high=2.0)
    assert torch.allclose(keep, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    assert m["mismatch/mis_mask_frac"] == pytest.approx(2 / 3)
    w, keep, m = importance_weights(old, sampler, mask, mode="none")
    assert torch.equal(w, torch.ones(1, 4)) and torch.equal(keep, mask) and m == {}


def test_importance_weights_sequence_level():
    # sequence 0: log-ratios log 2 + log 2 (weight 4); sequence 1: log 0.5 + padding (weight 0.5)
    old = torch.log(torch.tensor([[2.0, 2.0], [0.5, 100.0]]))
    sampler = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w, _, m = importance_weights(old, sampler, mask, mode="tis", level="sequence", tis_cap=3.0)
    assert torch.allclose(w, torch.tensor([[3.0, 3.0], [0.5, 0.0]]))
    assert m["mismatch/tis_clip_frac"] == pytest.approx(0.5)  # one of two sequences
    w, keep, m = importance_weights(
        old, sampler, mask, mode="mis", level="sequence", mis_low=0.4, mis_high=2.0
    )
    assert torch.allclose(keep, torch.tensor([[0.0, 0.0], [1.0, 0.0]]))
    assert torch.allclose(w, torch.tensor([[0.0, 0.0], [0.5, 0.0]]))
    assert m["mismatch/mis_mask_frac"] == pytest.approx(0.5)
    # a long sequence's weight stays finite
    w, _, _ = importance_weights(
        torch.full((1, 500), 1.0), torch.zeros(1, 500), torch.ones(1, 500), level="sequence"
    )
    assert torch.isfinite(w).all() and w.max() == 2.0


def test_mismatch_metrics_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    sampler = torch.tensor([[-1.5, -2.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert logprob_abs_diff(trainer, sampler, mask) == pytest.approx(0.25)
    assert logprob_abs_diff_max(trainer, sampler, mask) == pytest.approx(0.5)
    # log r = 0.5, 0: k3 = e^0.5 - 1 - 0.5 and 0
    assert mismatch_kl_k3(trainer, sampler, mask) == pytest.approx((math.exp(0.5) - 1.5) / 2)
    assert tis_clip_frac(trainer, sampler, mask, cap=1.5) == pytest.approx(0.5)
    assert mis_mask_frac(trainer, sampler, mask, low=0.9, high=1.5) == pytest.approx(0.5)
    m = mismatch_metrics(trainer, sampler, mask)
    assert set(m) == {"mismatch/logprob_abs_diff", "mismatch/logprob_abs_diff_max", "mismatch/kl_k3"}
    assert all(isinstance(v, float) for v in m.values())
    assert logprob_abs_diff_max(trainer, sampler, torch.zeros(1, 3)) == 0.0


def test_kl_k3_estimates_true_kl():
    # samples from mu; k3 mean approaches KL(mu || pi)
    g = torch.Generator().manual_seed(0)
    mu = torch.tensor([0.5, 0.3, 0.2])
    pi = torch.tensor([0.4, 0.4, 0.2])
    x = torch.multinomial(mu, 200_000, replacement=True, generator=g)[None]
    est = mismatch_kl_k3(pi.log()[x], mu.log()[x], torch.ones_like(x, dtype=torch.float32))
    true = (mu * (mu / pi).log()).sum().item()
    assert est == pytest.approx(true, rel=0.05)


def test_grpo_loss_combines_tis_and_kl():
    cfg = GRPOConfig(is_correction="tis", tis_cap=2.0, kl_coef=0.1)
    logprobs = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    sampler = torch.log(torch.tensor([[0.1, 0.5]]))  # token 0 weight 5 -> truncated to 2
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    loss, m = grpo_loss(
        logprobs, torch.tensor([1.0]), torch.ones(1, 2), cfg, sampler_logprobs=sampler, ref_logprobs=ref
    )
    # ratio 1 everywhere: pg = -(2 * 1 + 1 * 1) / 2; kl = (0.5 - log 0.5 - 1 + 0) / 2
    kl = (0.5 - math.log(0.5) - 1) / 2
    assert m["train/pg_loss"] == pytest.approx(-1.5)
    assert m["train/kl_ref"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(-1.5 + 0.1 * kl)
    assert m["mismatch/tis_clip_frac"] == pytest.approx(0.5)
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(math.log(5) / 2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logprobs, torch.tensor([1.0]), torch.ones(1, 2), cfg)


def test_grpo_loss_mis_drops_tokens_from_denominator():
    cfg = GRPOConfig(is_correction="mis", mis_low=0.5, mis_high=2.0)
    logprobs = torch.zeros(1, 2, requires_grad=True)
    sampler = torch.tensor([[0.0, -3.0]])  # token 1 weight e^3: rejected
    loss, m = grpo_loss(logprobs, torch.tensor([1.0]), torch.ones(1, 2), cfg, sampler_logprobs=sampler)
    assert loss.item() == pytest.approx(-1.0)  # only token 0, weight 1, denominator 1
    loss.backward()
    assert logprobs.grad[0, 1] == 0
    assert m["mismatch/mis_mask_frac"] == pytest.approx(0.5)


def test_grpo_loss_refuses_non_finite_sampler_logprobs():
    cfg = GRPOConfig(is_correction="tis")
    logprobs = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    sampler = torch.zeros(2, 3)
    sampler[0, 2] = float("nan")  # padding: ignored, and kept out of the weights, the loss and the metrics
    for mode in ("tis", "mis", "none"):
        loss, m = grpo_loss(logprobs, torch.tensor([1.0, -1.0]), mask, GRPOConfig(is_correction=mode),
                            sampler_logprobs=sampler)
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in m.values()), (mode, m)
    sampler[1, 1] = float("nan")
    with pytest.raises(ValueError, match="row 1 of this batch, token 1.*non-finite logits"):
        grpo_loss(logprobs, torch.tensor([1.0, -1.0]), mask, cfg, sampler_logprobs=sampler)


def test_grpo_config_validation():
    assert GRPOConfig().loss_agg == "token-mean"
    with pytest.raises(ConfigError, match="grpo.loss_agg.*token-mean"):
        GRPOConfig(loss_agg="sum")
    with pytest.raises(ConfigError, match="grpo.clip_eps_low"):
        GRPOConfig(clip_eps_low=1.0)
    with pytest.raises(ConfigError, match="mis_low"):
        GRPOConfig(mis_low=2.0, mis_high=1.0)
    with pytest.raises(ConfigError, match="grpo.tis_cap"):
        GRPOConfig(tis_cap=1e12)
    assert GRPOConfig(tis_cap=3).tis_cap == 3.0 and isinstance(GRPOConfig(tis_cap=3).tis_cap, float)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_an_overflowing_masked_position_leaves_the_loss_and_gradient_finite(loss_agg):
    """A padding or MIS-rejected token whose log-ratio to pi_old (or to the KL reference) would overflow exp:
    the loss and every gradient stay finite and the masked token gets no gradient (x * 0 would be NaN)."""
    logprobs = torch.tensor([[0.0, -1.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-200.0, -1.1, -0.4]])  # exp(0 - (-200)) overflows float32
    ref = torch.tensor([[150.0, -1.0, -0.6]])  # exp(150 - 0) overflows too
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    config = GRPOConfig(kl_coef=0.1, loss_agg=loss_agg)
    loss, metrics = grpo_loss(logprobs, torch.tensor([-1.0]), mask, config, old_logprobs=old,
                              ref_logprobs=ref)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 0] == 0.0 and (logprobs.grad[0, 1:] != 0).all()
    # the unmasked tokens' loss is what it was (nothing near the clamp there)
    ref_loss, _ = grpo_loss(logprobs.detach()[:, 1:], torch.tensor([-1.0]), mask[:, 1:], config,
                            old_logprobs=old[:, 1:], ref_logprobs=ref[:, 1:])
    assert torch.allclose(loss, ref_loss)
