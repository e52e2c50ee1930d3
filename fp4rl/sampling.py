"""Sampling parameters and the token choice of fp4rl.sampler: `SamplingParams` (checked on construction),
`sample_next` (softmax(logits / T) restricted by top-k then top-p, drawn by inverse CDF from a seeded
torch.Generator, with the log_softmax(logits / T) logprob the trainer scores), `inverse_cdf_sample`,
`nucleus`. The fused heads (fp4rl/cpu_head.py, fp4rl/kernels/sample_head.py) draw the same tokens for the
same generator state. fp4rl.sampler re-exports these names."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from fp4rl.config import MIN_TEMPERATURE

__all__ = ["SamplingParams", "inverse_cdf_sample", "nucleus", "sample_next"]


@dataclass
class SamplingParams:
    n: int = 1
    """completions per prompt (they share the prompt's prefill)."""
    temperature: float = 1.0
    """softmax temperature T >= MIN_TEMPERATURE (ignored when greedy: any finite T >= 0 then)."""
    top_p: float = 1.0
    """nucleus sampling: the smallest set of most likely tokens with mass >= top_p, in (0, 1]."""
    top_k: int = 0
    """sample among the k most likely tokens; 0 = all."""
    greedy: bool = False
    """argmax decoding (logprobs then use T = 1)."""
    max_new_tokens: int = 32
    """completion length limit (finish_reason "length")."""
    stop: tuple[str, ...] = ()
    """stop strings: a completion ends when its decoded text contains one (finish_reason "stop")."""
    seed: int | None = None
    """seed of the sampling generator; None draws a fresh one."""
    guidance: float = 0.0
    """TRACE: record the guidance (fp4rl.trace) of the W4A4 linears in the deepest fraction of the
    decoder layers into each Completion (0: off)."""

    def __post_init__(self):
        def fail(key, fix):
            raise ValueError(f"SamplingParams.{key}={getattr(self, key)!r}: {fix}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            fail("n", "must be an integer >= 1")
        if not isinstance(self.greedy, bool):
            fail("greedy", "must be True or False")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float) \
                or not math.isfinite(self.temperature) \
                or self.temperature < (0 if self.greedy is True else MIN_TEMPERATURE):  # greedy ignores T
            fail("temperature", f"must be a finite number >= {MIN_TEMPERATURE} (use greedy=True for argmax "
                 "decoding: a smaller T is greedy in effect, and far below it logits / T overflow float32 "
                 "and the logprobs turn -inf or NaN)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1] (1 disables nucleus sampling)")
        if not is_int(self.top_k) or self.top_k < 0:
            fail("top_k", "must be an integer >= 0 (0 disables top-k)")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            fail("max_new_tokens", "must be an integer >= 1")
        if isinstance(self.stop, str):
            fail("stop", "must be a tuple of strings, e.g. ('\\n\\n',), not one string")
        if self.stop is None:
            self.stop = ()
        self.stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "every stop string must be a non-empty str")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2 ** 64):
            fail("seed", "must be an integer in [0, 2**64) or None")
        if isinstance(self.guidance, bool) or not isinstance(self.guidance, int | float) \
                or not 0 <= self.guidance <= 1:
            fail("guidance", "must be a fraction of the decoder layers in [0, 1] (0 records nothing)")


def sample_next(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None):
    """Next tokens [b] and their logprobs [b] (fp32, under log_softmax(logits / T)) from logits [b, V].

    Sampling is by inverse CDF: one uniform per row from `generator`, located in the float64
    cumulative sum of the (top-k / top-p filtered) exp(z - max) (the softmax before its normalization,
    as the fused heads fp4rl/cpu_head.py and fp4rl/kernels/sample_head.py scan it). It draws from the
    same distribution as torch.multinomial at a fraction of its CPU cost (1 ms against ~26 ms for
    16 x 49152), and top-p sorts only the top candidates (see `nucleus`) instead of the whole
    vocabulary."""
    logits = logits.float()
    # a NaN or +inf logit, or a row of -inf: no distribution to draw from (checked on the CPU only: on CUDA
    # it would cost a host sync per step; the NaN logprobs are refused there by rollout.make_batch)
    bad = ~torch.isfinite(logits.amax(-1)) if logits.device.type == "cpu" else None
    if bad is not None and bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise ValueError(f"sampler: the logits of batch rows {rows[:8]} are not finite (NaN or +inf, or all "
                         "-inf): no token can be drawn; the model's weights or the prompt's activations "
                         "hold NaN/Inf (check the loaded weights: torch.isfinite(p).all() per parameter)")
    if params.greedy:
        scaled = logits
        tokens = logits.argmax(-1)
    else:
        scaled = logits / params.temperature if params.temperature != 1.0 else logits
        filtered = scaled
        if 0 < params.top_k < scaled.shape[-1]:
            kth = torch.topk(scaled, params.top_k, dim=-1).values[:, -1:]  # [b, 1]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if params.top_p < 1.0:
            filtered = nucleus(filtered, params.top_p)
        # unnormalized weights exp(z - max) (fp32), as the fused heads scan them: same u, same token
        tokens = inverse_cdf_sample((filtered - filtered.amax(-1, keepdim=True)).exp(), generator)
    picked = scaled.gather(-1, tokens[:, None]).squeeze(1)
    return tokens, picked - torch.logsumexp(scaled, dim=-1)  # as grpo.token_logprobs computes it


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [b, V] (non-negative weights, any total; zeros never drawn): the first index
    whose float64 cumulative weight exceeds u * total, u ~ U[0, 1) from `generator`."""
    cdf = probs.double().cumsum(-1)  # [b, V]
    u = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64, device=probs.device)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)  # right: skips p = 0 plateaus
    return tokens.clamp_(max=probs.shape[-1] - 1)


def nucleus(logits: torch.Tensor, top_p: float, first: int = 1024) -> torch.Tensor:
    """logits [b, V] with every token outside the top-p nucleus set to -inf: the smallest set of most
    likely tokens whose mass reaches top_p (a token is kept when the mass of the more likely ones is
    still < top_p). Only the `first` most likely tokens are sorted (x8 until their mass reaches top_p
    in every row): tokens past a prefix of mass >= top_p are dropped anyway."""
    probs = logits.softmax(-1)
    V, k = logits.shape[-1], min(first, logits.shape[-1])
    while True:
        top, order = probs.sort(-1, descending=True) if k == V else probs.topk(k, dim=-1)  # descending
        if k == V or bool((top.sum(-1) >= top_p).all()):
            break
        k = min(V, 8 * k)
    keep = (top.cumsum(-1) - top) < top_p  # mass before the token < top_p
    keep[:, 0] = True
    out = torch.full_like(logits, float("-inf"))
    return out.scatter(-1, order, logits.gather(-1, order).masked_fill(~keep, float("-inf")))


def _generator_seed(seed: int, device: torch.device) -> int:
    """The seed given to torch's generator for SamplingParams.seed: itself, except above 2**32 on the CPU,
    whose generator keeps only a seed's low 32 bits (seed and seed + 2**32 drew the same numbers: a
    `base + (rank << 32)` scheme repeated its samples): there the 64 bits are hashed down to 32."""
    if torch.device(device).type != "cpu" or seed < 2 ** 32:
        return seed
    return int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=4).digest(), "little")
