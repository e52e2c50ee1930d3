"""Batch: the one data type between rollout and training.

The sampler returns `Completion`s (prompt ids, completion ids, the sampler's per-token
logprobs, the policy version that sampled, MoE routing); the loop scores them and computes
GRPO advantages; `Batch.from_completions` packs the result into right-padded tensors, which
is all `Trainer.step` reads.

Alignment. Row i holds the tokens x = prompt + completion (L_i of them), right-padded to T.
The trainer feeds x[:, :-1] and scores x[:, 1:], so every per-token tensor has T - 1 columns
and column t is about token x[t + 1], predicted from x[: t + 1]:

    loss_mask[i, t] = 1   where x[i, t + 1] is a completion token
    sampler_logprobs[i, t] = log mu(x[i, t + 1])   on those columns, 0 elsewhere
    routing[l, i, t] = experts the sampler used in MoE layer l for input token x[i, t]

That is exactly the sampler's own view: it fed L_i - 1 tokens (the last completion token is
never fed back), which is why `Completion.routing` has L_i - 1 rows (and TRACE guidance, `guidance`
[B, T-1] per guided input, [B, T-1, top_k] for a routed experts' down input, with `guidance_valid`
marking real columns, likewise). Right padding needs no
attention mask: with a causal mask a real token never sees the padding after it, and RoPE
positions 0, 1, ... of a row are those the sampler used for the unpadded sequence.

Routing is stored as ROUTING_DTYPE (int16, any model up to 32767 experts; 2 bytes an id where long took 8:
Qwen3-30B-A3B's 48 layers x top-8 x ~8.5K tokens x 256 sequences are ~1.7 GB, not ~6.7 GB) in the sampler's
buffer, `Completion.routing` and `Batch.routing`; it becomes long only where experts are indexed
(fp4rl.moe.SparseMoeBlock.forward). Not uint8: one dtype for every model, and torch reads a uint8 index
tensor as a boolean mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

ROUTING_DTYPE = torch.int16
"""dtype of stored MoE routing (expert ids): sampler buffer, Completion.routing, Batch.routing."""
MAX_EXPERTS = torch.iinfo(ROUTING_DTYPE).max + 1  # ids 0 .. 32767


def as_routing(routing, what: str = "routing") -> torch.Tensor:
    """Expert ids (a tensor or nested lists) as ROUTING_DTYPE. Other integer dtypes are cast (ids outside
    [0, MAX_EXPERTS) raise: check_routing); float, complex and bool dtypes raise. Already ROUTING_DTYPE:
    returned as is, unchecked (no device sync; `check_routing` checks ids against a model's experts)."""
    routing = torch.as_tensor(routing)
    if routing.dtype == ROUTING_DTYPE:
        return routing
    check_routing(routing, MAX_EXPERTS, what)
    return routing.to(ROUTING_DTYPE)


def check_routing(routing: torch.Tensor | None, num_experts: int, what: str = "routing") -> None:
    """Raise unless `routing` has an integer dtype and every expert id is in [0, num_experts) (one
    min/max, one host sync)."""
    if routing is None:
        return
    if routing.dtype.is_floating_point or routing.dtype.is_complex or routing.dtype == torch.bool:
        raise TypeError(f"{what}: expert ids must have an integer dtype (stored as {ROUTING_DTYPE}), "
                        f"got {routing.dtype}")
    if routing.numel():
        lo, hi = (int(v) for v in torch.aminmax(routing))
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{what}: expert ids must lie in [0, {num_experts}), got ids in [{lo}, {hi}]")


@dataclass
class Batch:
    """Training data of one RL step; B sequences right-padded to T tokens."""

    input_ids: torch.Tensor  # [B, T] long: prompt + completion, then pad_id
    loss_mask: torch.Tensor  # [B, T-1] float: 1 where input_ids[:, 1:] is a completion token
    sampler_logprobs: torch.Tensor  # [B, T-1] fp32: log mu of input_ids[:, 1:], 0 off the mask
    advantages: torch.Tensor  # [B] fp32: one GRPO advantage per sequence
    policy_version: torch.Tensor  # [B] long: the policy version that sampled each sequence
    routing: torch.Tensor | None = None  # [num_moe_layers, B, T-1, top_k] int16, or None (dense)
    guidance: dict | None = None  # TRACE: input key -> fp4rl.trace.Guidance [B, T-1, ...], or None
    guidance_valid: torch.Tensor | None = None  # [B, T-1] bool: the columns the sampler fed (with guidance)

    def __post_init__(self):
        B, T = self.input_ids.shape
        want = {"loss_mask": (B, T - 1), "sampler_logprobs": (B, T - 1), "advantages": (B,),
                "policy_version": (B,)}
        for name, shape in want.items():
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(f"Batch.{name} has shape {list(getattr(self, name).shape)}, expected "
                                 f"{list(shape)} for input_ids {[B, T]}")
        if (self.guidance is None) != (self.guidance_valid is None):
            raise ValueError("Batch.guidance and Batch.guidance_valid come together (TRACE), or neither")
        if self.guidance_valid is not None and tuple(self.guidance_valid.shape) != (B, T - 1):
            raise ValueError(f"Batch.guidance_valid has shape {list(self.guidance_valid.shape)}, expected "
                             f"{[B, T - 1]}")
        for key, g in (self.guidance or {}).items():  # (a routed experts' down input: [B, T - 1, top_k])
            if tuple(g.amax.shape[:2]) != (B, T - 1) or g.amax.ndim > 3:
                raise ValueError(f"Batch.guidance[{key!r}] covers {list(g.amax.shape)} tokens, expected "
                                 f"{[B, T - 1]}")
        if self.routing is not None:  # another integer dtype handed in: cast (range-checked)
            self.routing = as_routing(self.routing, "Batch.routing")
        routing = self.routing
        if routing is not None and (routing.dim() != 4 or tuple(routing.shape[1:3]) != (B, T - 1)):
            raise ValueError(f"Batch.routing has shape {list(self.routing.shape)}, expected "
                             f"[num_moe_layers, {B}, {T - 1}, top_k]")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """Completion tokens the loss sees."""
        return int(self.loss_mask.sum().item())

    @classmethod
    def from_completions(cls, completions: Sequence, advantages: Sequence[float] | torch.Tensor, *,
                         pad_id: int = 0) -> Batch:
        """Completions (fp4rl.sampler.Completion) and one advantage each -> a Batch.

        A completion with no tokens contributes a row with an empty loss mask.
        """
        advantages = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
        if len(completions) != advantages.numel():
            raise ValueError(f"{len(completions)} completions but {advantages.numel()} advantages")
        rows = [list(c.prompt_ids) + list(c.completion_ids) for c in completions]
        B = len(rows)
        T = max((len(r) for r in rows), default=1)
        input_ids = torch.full((B, T), pad_id, dtype=torch.long)
        loss_mask = torch.zeros(B, T - 1)
        sampler_logprobs = torch.zeros(B, T - 1)
        routed = [c.routing is not None for c in completions]
        if any(routed) and not all(routed):
            raise ValueError("some completions carry MoE routing and some do not: one sampler, one model")
        routing = None
        if B and all(routed):
            layers, _, top_k = completions[0].routing.shape
            routing = torch.zeros(layers, B, T - 1, top_k, dtype=ROUTING_DTYPE)  # padding routes to expert 0
        for i, (c, row) in enumerate(zip(completions, rows)):
            P, C = len(c.prompt_ids), len(c.completion_ids)
            if len(c.logprobs) != C:
                raise ValueError(f"completion {i}: {C} tokens but {len(c.logprobs)} sampler logprobs")
            if P == 0:
                raise ValueError(f"completion {i}: empty prompt (the first token has nothing to predict it)")
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            loss_mask[i, P - 1 : P - 1 + C] = 1.0
            sampler_logprobs[i, P - 1 : P - 1 + C] = torch.tensor(c.logprobs, dtype=torch.float32)
            if routing is not None:
                r = as_routing(c.routing, f"completion {i}: routing")  # [layers, P + C - 1, top_k]
                if r.shape[1] != len(row) - 1:
                    raise ValueError(f"completion {i}: routing covers {r.shape[1]} tokens, expected "
                                     f"len(prompt) + len(completion) - 1 = {len(row) - 1}")
                routing[:, i, : len(row) - 1] = r
        versions = torch.tensor([c.policy_version for c in completions], dtype=torch.long)
        guidance, valid = _guidance(completions, B, T, rows)
        return cls(input_ids, loss_mask, sampler_logprobs, advantages, versions, routing, guidance, valid)

    def select(self, rows: slice | torch.Tensor) -> Batch:
        """The rows `rows`, trimmed to their longest sequence (so micro-batches pay no extra padding)."""
        mask = self.loss_mask[rows]
        used = torch.nonzero(mask.sum(0)).flatten()
        width = int(used.max().item()) + 2 if used.numel() else 2  # T of the trimmed rows
        width = min(width, self.input_ids.shape[1])
        return Batch(
            input_ids=self.input_ids[rows, :width],
            loss_mask=mask[:, : width - 1],
            sampler_logprobs=self.sampler_logprobs[rows, : width - 1],
            advantages=self.advantages[rows],
            policy_version=self.policy_version[rows],
            routing=None if self.routing is None else self.routing[:, rows, : width - 1],
            guidance=None if self.guidance is None else {
                k: g.index(rows, slice(0, width - 1)) for k, g in self.guidance.items()},
            guidance_valid=None if self.guidance_valid is None else self.guidance_valid[rows, : width - 1],
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive micro-batches of `size` rows (0: the whole batch as one)."""
        if len(self) == 0:
            return []
        size = size or len(self)
        return [self.select(slice(i, i + size)) for i in range(0, len(self), size)]

    def to(self, device: torch.device | str) -> Batch:
        """The tensors on `device` (TRACE guidance stays where it is: it is read where x is quantized)."""
        return Batch(**{f.name: getattr(self, f.name) if getattr(self, f.name) is None or f.name == "guidance"
                        else getattr(self, f.name).to(device) for f in fields(self)})


def _guidance(completions, B: int, T: int, rows) -> tuple[dict | None, torch.Tensor | None]:
    """TRACE guidance of the completions laid out as [B, T-1] columns (column t: input token t)."""
    from fp4rl.trace import Guidance

    guided = [getattr(c, "guidance", None) is not None for c in completions]
    if not B or not any(guided):
        return None, None
    if not all(guided):
        raise ValueError("some completions carry TRACE guidance and some do not: one sampler, one setting")
    keys = sorted(completions[0].guidance)
    out, valid = {}, torch.zeros(B, T - 1, dtype=torch.bool)
    for k in keys:
        first = completions[0].guidance[k]
        width = first["bits"].shape[-1] * 8
        out[k] = Guidance.empty((B, T - 1, *first["amax"].shape[1:]), width)  # (experts' down: [..., top_k])
    for i, (c, row) in enumerate(zip(completions, rows)):
        if sorted(c.guidance) != keys:
            raise ValueError(f"completion {i}: guided inputs {sorted(c.guidance)}, the first one's {keys}")
        n = len(row) - 1
        for k in keys:
            g = Guidance.from_dict(c.guidance[k])
            if g.amax.shape[0] != n:
                raise ValueError(f"completion {i}: TRACE guidance of {k!r} covers {g.amax.shape[0]} tokens, "
                                 f"expected len(prompt) + len(completion) - 1 = {n}")
            out[k].bits[i, :n], out[k].block_scale[i, :n], out[k].amax[i, :n] = g.bits, g.block_scale, g.amax
        valid[i, :n] = True
    return out, valid
