"""GRPO: group-normalised advantages, the clipped policy loss, and sampler/trainer mismatch.

Notation. A prompt q gets a group of n completions o_1..o_n from the sampler policy mu (the
NVFP4 rollout engine) with rewards r_1..r_n. Three log-probabilities exist per token t of o_i:

    sampler_logprobs  log mu(o_it)          what the sampler computed while generating
    old_logprobs      log pi_old(o_it)      the trainer's policy before this batch's first update
    logprobs          log pi_theta(o_it)    the trainer's policy now, with gradient

In a perfectly matched system mu == pi_old. With NVFP4 rollout, other kernels and (async) stale
weights, they differ; the difference is what `mismatch_metrics` measures (in an async run it
holds the policy's drift over the batch's staleness as well as the sampler's numerics).

Advantage (GRPO, shared by every token of a completion):

    A_i = (r_i - mean(r)) / (std(r) + eps)      or  A_i = r_i - mean(r)  (normalize_std=False)

std is the sample std (Bessel-corrected, as TRL does). A group whose rewards are all equal has
A == 0 exactly: it contributes no gradient, only cost, so it is reported (the loop may drop it).

Policy loss per token (PPO clip with asymmetric "clip-higher" bounds, DAPO):

    rho_t = exp(logprobs - old_logprobs)
    l_t   = -min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)

Importance-sampling correction for mu != pi_old (Yao et al. 2025, "off-policy RL from your
efficient RL framework"; FlashRL; the NVFP4 recipe): the data came from mu, the objective is
about pi_old, so each token's loss is weighted by w = pi_old / mu, detached:

    token level     w_t = exp(old_logprobs_t - sampler_logprobs_t)
    sequence level  w_t = exp(sum_s (old_logprobs_s - sampler_logprobs_s))   for every t of o_i
    TIS  w <- min(w, C)                            (truncate; bias for variance)
    MIS  keep only tokens (sequences) with lo <= w <= hi; they leave the loss and its
         denominator (rejection, as verl does), kept ones are weighted by w.

The log-ratio is clamped to +-20 before exp so a long sequence cannot overflow to inf; with
C, hi < e^20 and lo > e^-20 (validated) this changes no weight that is used.

KL to a frozen reference policy (optional, GRPO paper), k3 estimator (Schulman), unbiased and
always >= 0:

    kl_t = exp(ref_t - logprobs_t) - (ref_t - logprobs_t) - 1

Aggregation over the masked tokens of the batch:

    "token-mean"           sum_{i,t} l_it / sum_{i,t} 1           (every token weighs the same)
    "seq-mean-token-mean"  mean_i ( sum_t l_it / |o_i| )          (every sequence weighs the same)

For gradient accumulation over micro-batches pass `loss_denominator` = the whole batch's token
count (token-mean) or sequence count (seq-mean-token-mean) so the sum of micro-batch losses
equals the full-batch loss. With MIS the denominator is the count left after rejection, known
only once every micro-batch has run: each reports it (metrics["train/loss_units"]) and the
caller multiplies the summed loss and gradients by loss_denominator / sum(loss_units)
(Trainer.step does).

Mismatch estimate: with r = pi_old / mu evaluated on samples from mu, k3 = r - 1 - log r is an
unbiased, non-negative estimate of KL(mu || pi_old) per token.

Everything here is a pure function over tensors; nothing knows about models or samplers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4rl.config_fields import ConfigError, _knob, validate_fields

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
IS_MODES = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence")
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 4.9e8: far above any sensible TIS cap or MIS bound


@dataclass
class GRPOConfig:
    """Knobs of the GRPO objective (the [grpo] table of a run config)."""

    normalize_std: bool = _knob(True, "divide group-centred rewards by the group std (False: Dr. GRPO)")
    adv_eps: float = _knob(1e-6, "added to the group std before dividing", gt=0.0)
    skip_zero_variance_groups: bool = _knob(True, "drop groups whose rewards are all equal (zero advantage)")
    clip_eps_low: float = _knob(0.2, "PPO ratio clip below: rho >= 1 - clip_eps_low", ge=0.0, lt=1.0)
    clip_eps_high: float = _knob(0.2, "PPO ratio clip above: rho <= 1 + clip_eps_high (DAPO: 0.28; inf: "
                                 "no upper clip)", ge=0.0, inf=True)
    loss_agg: str = _knob("token-mean", "how token losses are averaged", choices=LOSS_AGGREGATIONS)
    kl_coef: float = _knob(0.0, "coefficient of the k3 KL to the reference policy (0: no reference)", ge=0.0)
    is_correction: str = _knob("tis", "sampler/trainer importance-sampling correction", choices=IS_MODES)
    is_level: str = _knob("token", "importance weights per token or per sequence", choices=IS_LEVELS)
    tis_cap: float = _knob(2.0, "TIS: weights are truncated at this value C", gt=0.0)
    mis_low: float = _knob(0.5, "MIS: tokens/sequences with weight below this are masked out", gt=0.0)
    mis_high: float = _knob(2.0, "MIS: tokens/sequences with weight above this are masked out", gt=0.0)

    def __post_init__(self):
        validate_fields(self, "grpo")
        if self.mis_low >= self.mis_high:
            raise ConfigError(f"grpo.mis_low = {self.mis_low} must be < grpo.mis_high = {self.mis_high}")
        bound = math.exp(_MAX_LOG_RATIO)
        for key in ("tis_cap", "mis_low", "mis_high"):
            value = getattr(self, key)
            if not 1 / bound < value < bound:
                raise ConfigError(f"grpo.{key} = {value} must lie in ({1 / bound:.3g}, {bound:.3g})")


# ---------------------------------------------------------------------------------- advantages


def group_advantages(
    rewards: torch.Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [G, n] -> (advantages [G, n] fp32, zero_variance [G] bool).

    Groups whose rewards are all identical get advantage exactly 0 and are flagged.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [num_groups, n], got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"a GRPO group needs n >= 2 completions, got n = {rewards.shape[1]}")
    if not torch.isfinite(rewards).all():
        group, i = (~torch.isfinite(rewards)).nonzero()[0].tolist()
        raise ValueError(
            f"rewards contain NaN or Inf (first: {rewards[group, i].item()} for group {group}, "
            f"completion {i}): "
            "the task's score() must return a finite float per completion (for task.name = 'jsonl', fix the "
            "function named by task.kwargs.reward)"
        )
    rewards = rewards.float()
    zero_variance = rewards.amax(dim=1) == rewards.amin(dim=1)  # [G]
    centred = rewards - rewards.mean(dim=1, keepdim=True)  # [G, n]
    if normalize_std:
        centred = centred / (rewards.std(dim=1, keepdim=True) + eps)
    advantages = torch.where(zero_variance[:, None], torch.zeros_like(centred), centred)
    return advantages, zero_variance


def reward_metrics(
    rewards: torch.Tensor, correct: torch.Tensor | None = None, zero_variance: torch.Tensor | None = None
) -> dict[str, float]:
    """rewards [G, n] (and correct [G, n] bool) -> reward/* metrics."""
    rewards = rewards.float()
    out = {"reward/mean": rewards.mean().item(), "reward/std": rewards.std(correction=0).item()}
    if correct is not None:
        out["reward/accuracy"] = correct.float().mean().item()
        # pass@n over the group: did any completion of the prompt succeed?
        out["reward/pass_at_n"] = correct.bool().any(dim=1).float().mean().item()
    if zero_variance is not None:
        out["reward/zero_var_frac"] = zero_variance.float().mean().item()
    return out


# ---------------------------------------------------------------------------------- logprobs


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, chunk_rows: int = 2048) -> torch.Tensor:
    """log p(tokens) under logits, in fp32: logits [B, T, V], tokens [B, T] -> [B, T].

    The logits must already be aligned with the tokens they score: for a causal LM pass
    `logits[:, :-1]` and `input_ids[:, 1:]`. log_softmax is computed in fp32 as
    logit[token] - logsumexp(logits), `chunk_rows` rows of [V] at a time, so a bf16 [B, T, V]
    tensor is never copied to fp32 in full.
    """
    if logits.shape[:-1] != tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and tokens {tuple(tokens.shape)} disagree; "
            "logits must be [..., V] with the leading dims of tokens (shift them first)"
        )
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)  # [N, V]
    flat_tokens = tokens.reshape(-1)  # [N]
    out = []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[start : start + chunk_rows].float()  # [c, V]
        picked = chunk.gather(1, flat_tokens[start : start + chunk_rows, None]).squeeze(1)  # [c]
        out.append(picked - torch.logsumexp(chunk, dim=-1))
    if not out:
        return logits.new_zeros(tokens.shape, dtype=torch.float32)
    return torch.cat(out).view(tokens.shape)


# ---------------------------------------------------------------------------------- IS weights


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


def importance_weights(
    old_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    mode: str = "tis",
    level: str = "token",
    tis_cap: float = 2.0,
    mis_low: float = 0.5,
    mis_high: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """pi_old/mu correction -> (weights [B, T], keep_mask [B, T], metrics); all detached.

    weights multiply the per-token policy loss; keep_mask (0/1) multiplies the loss mask (MIS
    rejects tokens there; for "none" and "tis" it equals loss_mask). Fractions are over masked
    tokens at level "token" and over sequences with at least one token at level "sequence".
    """
    if mode not in IS_MODES:
        raise ValueError(f"mode = {mode!r}: allowed values are {IS_MODES}")
    if level not in IS_LEVELS:
        raise ValueError(f"level = {level!r}: allowed values are {IS_LEVELS}")
    mask = loss_mask.float()
    if mode == "none":
        return torch.ones_like(mask), mask, {}
    log_ratio = (old_logprobs.detach().float() - sampler_logprobs.float()) * mask  # [B, T]
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(mask)  # [B, T]
        # count each sequence once
        unit_mask = (mask.cumsum(dim=1) == 1).float() * mask  # the first masked token of each
    else:
        unit_mask = mask
    raw = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B, T]
    metrics = {"mismatch/is_weight_mean": _masked_mean(raw, unit_mask).item()}
    if mode == "tis":
        metrics["mismatch/tis_clip_frac"] = _masked_mean((raw > tis_cap).float(), unit_mask).item()
        return raw.clamp(max=tis_cap) * mask, mask, metrics
    keep = ((raw >= mis_low) & (raw <= mis_high)).float() * mask  # [B, T]
    metrics["mismatch/mis_mask_frac"] = _masked_mean(1.0 - keep, unit_mask).item()
    return raw * keep, keep, metrics


# ---------------------------------------------------------------------------------- loss


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_agg: str, denominator: float | None):
    # masked positions select 0 (not x * 0: a NaN or Inf there would make the sum NaN)
    per_token = torch.where(mask > 0, per_token * mask, torch.zeros_like(per_token))
    if loss_agg == "token-mean":
        total = per_token.sum()
        return total / (denominator if denominator is not None else mask.sum().clamp_min(1))
    if loss_agg == "seq-mean-token-mean":
        tokens_per_seq = mask.sum(dim=1)  # [B]
        seq_loss = per_token.sum(dim=1) / tokens_per_seq.clamp_min(1)  # [B]
        num_seqs = (tokens_per_seq > 0).sum().clamp_min(1)
        return seq_loss.sum() / (denominator if denominator is not None else num_seqs)
    raise ValueError(f"loss_agg = {loss_agg!r}: allowed values are {LOSS_AGGREGATIONS}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    loss_agg: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    loss_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate: logprobs/old_logprobs/loss_mask [B, T], advantages [B] or [B, T].

    Returns (scalar loss, {"train/clip_frac", "train/ratio_mean"}) over the masked tokens.
    """
    mask = loss_mask.float()
    if advantages.dim() == 1:
        advantages = advantages[:, None]  # [B, 1]
    advantages = advantages.float()
    # masked positions (padding, MIS-rejected tokens) at ratio 1 and the log-ratio clamped as in
    # importance_weights: an overflowing exp there would turn the backward's 0 * inf into NaN
    log_ratio = torch.where(mask > 0, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))  # [B, T]
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)  # [B, T]
    if is_weights is not None:
        per_token = per_token * is_weights.detach()
    loss = _aggregate(per_token, mask, loss_agg, loss_denominator)
    with torch.no_grad():
        metrics = {
            # tokens whose gradient the clip switched off
            "train/clip_frac": _masked_mean((clipped < unclipped).float(), mask).item(),
            "train/ratio_mean": _masked_mean(ratio, mask).item(),
        }
    return loss, metrics


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref) on samples from pi: [B, T] -> [B, T], >= 0. The log-ratio is
    clamped to +-_MAX_LOG_RATIO (as the importance weights'), so a padding position or a far-drifted token
    cannot overflow exp into a NaN loss or gradient."""
    delta = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(delta) - delta - 1.0


def grpo_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    config: GRPOConfig,
    *,
    old_logprobs: torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    loss_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The whole GRPO objective for one (micro-)batch -> (scalar loss, metrics).

    logprobs [B, T] (with grad), advantages [B], loss_mask [B, T]. old_logprobs defaults to
    logprobs.detach() (one optimizer step per rollout batch). With sampler_logprobs the IS
    correction of `config` is applied and mismatch/* metrics are reported.
    """
    if old_logprobs is None:
        old_logprobs = logprobs.detach()
    mask = loss_mask.float()
    metrics: dict[str, float] = {}
    is_weights = None
    if sampler_logprobs is not None:
        bad = ~torch.isfinite(sampler_logprobs) & (mask > 0)
        if bool(bad.any()):
            row, tok = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"sampler logprobs are NaN or Inf at {int(bad.sum())} completion tokens "
                             f"(first: row {row} of this batch, token {tok}): the sampler saw non-finite "
                             "logits; check the synced weights (weight_sync verify=True) and the rollout's "
                             "model before training on it")
        # padding can hold anything (NaN * 0 is NaN in the weights): the trainer's own values there
        sampler_logprobs = torch.where(mask > 0, sampler_logprobs, old_logprobs.detach())
        metrics.update(mismatch_metrics(old_logprobs, sampler_logprobs, mask))
        if config.is_correction != "none":
            is_weights, mask, is_metrics = importance_weights(
                old_logprobs,
                sampler_logprobs,
                mask,
                mode=config.is_correction,
                level=config.is_level,
                tis_cap=config.tis_cap,
                mis_low=config.mis_low,
                mis_high=config.mis_high,
            )
            metrics.update(is_metrics)
    loss, pg_metrics = policy_loss(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_eps_low=config.clip_eps_low,
        clip_eps_high=config.clip_eps_high,
        loss_agg=config.loss_agg,
        is_weights=is_weights,
        loss_denominator=loss_denominator,
    )
    metrics.update(pg_metrics)
    metrics["train/pg_loss"] = loss.item()
    # what the loss divides by without loss_denominator: tokens (token-mean) or sequences with a token
    # (seq-mean-token-mean) left after MIS; a caller that divided by the whole batch's count rescales by it
    units = mask.sum() if config.loss_agg == "token-mean" else (mask.sum(1) > 0).sum()
    metrics["train/loss_units"] = float(units)
    # the tokens train/clip_frac and train/ratio_mean average over (those MIS kept): a caller adding up
    # micro-batches weights them by this
    metrics["train/kept_tokens"] = float(mask.sum())
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("grpo.kl_coef > 0 needs ref_logprobs (the reference policy's logprobs)")
        kl = _aggregate(kl_k3(logprobs, ref_logprobs.detach()), mask, config.loss_agg, loss_denominator)
        loss = loss + config.kl_coef * kl
        metrics["train/kl_ref"] = kl.item()
    metrics["train/loss"] = loss.item()
    return loss, metrics


# ---------------------------------------------------------------------------------- mismatch


def logprob_abs_diff(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """Mean |log pi_trainer - log mu| over masked tokens."""
    diff = (trainer_logprobs.detach().float() - sampler_logprobs.float()).abs()
    return _masked_mean(diff, mask.float()).item()


def logprob_abs_diff_max(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """Max |log pi_trainer - log mu| over masked tokens (0 when nothing is masked in)."""
    diff = (trainer_logprobs.detach().float() - sampler_logprobs.float()).abs()
    selected = diff[mask.bool()]
    return selected.max().item() if selected.numel() else 0.0


def mismatch_kl_k3(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """k3 estimate of KL(mu || pi_trainer) per token, tokens sampled from mu (the sampler)."""
    log_r = trainer_logprobs.detach().float() - sampler_logprobs.float()
    k3 = torch.exp(log_r.clamp(max=_MAX_LOG_RATIO)) - 1.0 - log_r
    return _masked_mean(k3, mask.float()).item()


def tis_clip_frac(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> float:
    """Fraction of tokens (or sequences) whose pi_trainer/mu weight exceeds the TIS cap."""
    _, _, metrics = importance_weights(
        trainer_logprobs, sampler_logprobs, mask, mode="tis", level=level, tis_cap=cap
    )
    return metrics["mismatch/tis_clip_frac"]


def mis_mask_frac(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float = 0.5,
    high: float = 2.0,
    level: str = "token",
) -> float:
    """Fraction of tokens (or sequences) whose pi_trainer/mu weight lies outside [low, high]."""
    _, _, metrics = importance_weights(
        trainer_logprobs, sampler_logprobs, mask, mode="mis", level=level, mis_low=low, mis_high=high
    )
    return metrics["mismatch/mis_mask_frac"]


def mismatch_metrics(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The trainer-vs-sampler dashboard: mean/max |logprob diff| and k3 KL (DESIGN.md keys)."""
    return {
        "mismatch/logprob_abs_diff": logprob_abs_diff(trainer_logprobs, sampler_logprobs, mask),
        "mismatch/logprob_abs_diff_max": logprob_abs_diff_max(trainer_logprobs, sampler_logprobs, mask),
        "mismatch/kl_k3": mismatch_kl_k3(trainer_logprobs, sampler_logprobs, mask),
    }
