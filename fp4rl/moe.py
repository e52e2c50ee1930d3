"""Sparse mixture-of-experts feed-forward, as in Qwen2-MoE and Qwen3-MoE.

For a token n (RMS-normalised hidden state) and E experts, each a SwiGLU MLP:
    p = softmax(gate(n))                      router probabilities [E], in fp32
    K = top_k(p)                              the chosen experts; w_k = p_k (or p_k / sum_K p when
                                              norm_topk_prob, so the weights sum to 1)
    y = sum_{k in K} w_k * expert_k(n)
Qwen2-MoE adds a shared expert every token passes through, scaled by a sigmoid gate:
    y += sigmoid(shared_expert_gate(n)) * shared_expert(n)

Routing replay. Under RL, the experts the sampler chose for a token are recorded and the
trainer forces the same experts (`forward(x, forced_experts)`): otherwise a tiny numerical
difference flips a near-tied top-k and the trainer scores a different network than the one
that sampled. The weights of the forced experts are still read from the router's softmax, so
the router keeps receiving gradients.

Every projection is a plain `nn.Linear` (each expert an `MLP` of three), so a precision
contract can swap the routed experts' linears by name. The routed compute goes through one
method, `run_experts`, that a grouped-matmul GPU path overrides (`routed`, route + run_experts, for a
path that does both at once); the default loops over the experts and touches only the tokens routed to
each, and while an expert runs, `EXPERT_ROWS` says which (token, slot) pairs its rows are (TRACE records
and applies the routed experts' guidance per token and slot with it, fp4rl.trace).
"""

from __future__ import annotations

import contextvars
import typing

import torch
import torch.nn.functional as F
from torch import nn


class ExpertRows(typing.NamedTuple):
    """The rows an expert is running: token [n] and slot [n] (its row r is token[r]'s slot[r]-th choice)
    of `tokens` tokens routed to `top_k` experts each."""

    token: torch.Tensor
    slot: torch.Tensor
    tokens: int
    top_k: int


# set by SparseMoeBlock.run_experts while an expert runs; None elsewhere
EXPERT_ROWS: contextvars.ContextVar[ExpertRows | None] = contextvars.ContextVar("fp4rl_expert_rows",
                                                                                default=None)


class SparseMoeBlock(nn.Module):
    """HF names: gate (the router, Linear H -> E), experts.{e}, shared_expert, shared_expert_gate."""

    def __init__(self, hidden_size: int, experts: list[nn.Module], *, top_k: int, norm_topk_prob: bool,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = len(experts), top_k, norm_topk_prob
        self.gate = nn.Linear(hidden_size, self.num_experts, bias=False)
        self.experts = nn.ModuleList(experts)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor, forced_experts: torch.Tensor | None = None):
        """x [N, H] -> (topk_idx [N, top_k] long, topk_weight [N, top_k] in x's dtype)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        if forced_experts is None:
            topk_weight, topk_idx = torch.topk(probs, self.top_k, dim=-1)  # [N, k]
        else:
            topk_idx = forced_experts
            topk_weight = probs.gather(-1, topk_idx)  # [N, k]
        if self.norm_topk_prob:
            topk_weight = topk_weight / topk_weight.sum(dim=-1, keepdim=True)
        return topk_idx, topk_weight.to(x.dtype)

    def run_experts(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """sum_k topk_weight[:, k] * experts[topk_idx[:, k]](x): x [N, H], topk_* [N, k] -> [N, H].

        Override point for a grouped-matmul GPU path. This default runs each expert on the rows
        routed to it only (one host sync to learn which experts got tokens).
        """
        y = torch.zeros_like(x)
        counts = torch.bincount(topk_idx.flatten(), minlength=self.num_experts).tolist()
        for e, expert in enumerate(self.experts):
            if counts[e] == 0:
                continue
            token, slot = torch.where(topk_idx == e)  # [n_e], [n_e]
            rows = EXPERT_ROWS.set(ExpertRows(token, slot, x.shape[0], topk_idx.shape[1]))
            try:
                out = expert(x[token])
            finally:
                EXPERT_ROWS.reset(rows)
            y.index_add_(0, token, out * topk_weight[token, slot, None])
        return y

    def routed(self, x: torch.Tensor, forced_experts: torch.Tensor | None = None):
        """x [N, H] -> (the routed experts' weighted sum [N, H], experts chosen [N, top_k] long): `route`,
        then `run_experts`. A path that routes and runs the experts together overrides this."""
        topk_idx, topk_weight = self.route(x, forced_experts)
        return self.run_experts(x, topk_idx, topk_weight), topk_idx

    def forward(self, x: torch.Tensor, forced_experts: torch.Tensor | None = None):
        """x [B, T, H], forced_experts [B, T, top_k] (any integer dtype) or None -> (y [B, T, H], experts used
        [B, T, top_k] long)."""
        B, T, H = x.shape
        flat = x.reshape(-1, H)  # [N, H]
        if forced_experts is not None:
            if tuple(forced_experts.shape) != (B, T, self.top_k):
                raise ValueError(f"routing replay: expected experts [B, T, top_k] = {[B, T, self.top_k]}, "
                                 f"got {list(forced_experts.shape)}")
            if forced_experts.dtype.is_floating_point or forced_experts.dtype.is_complex \
                    or forced_experts.dtype == torch.bool:
                raise TypeError(f"routing replay: expert ids must have an integer dtype, "
                                f"got {forced_experts.dtype}")
            # stored small (fp4rl.batch.ROUTING_DTYPE); long only here, where the experts are indexed
            forced_experts = forced_experts.reshape(-1, self.top_k).to(device=x.device, dtype=torch.long)
        y, topk_idx = self.routed(flat, forced_experts)
        shared = self.shared(flat)
        if shared is not None:
            y = y + shared
        return y.reshape(B, T, H), topk_idx.reshape(B, T, self.top_k)

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert's gated term for x [N, H] (added to the routed sum), or None without one."""
        if not hasattr(self, "shared_expert"):
            return None
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
