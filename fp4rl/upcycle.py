"""Sparse upcycling: a dense model becomes an MoE that computes the same function at initialisation.

The experts-only NVFP4 recipe quantizes routed experts; a dense checkpoint has none. Upcycling
gives it some without changing what it computes, so the recipe runs on real pretrained weights
(the default SmolLM2 among them).

Each chosen layer's dense SwiGLU MLP, with intermediate channels c = 1..I,
    MLP(x) = sum_c down[:, c] * silu(gate[c] . x) * (up[c] . x),
is a sum over channels, so splitting the channels into a set S (s of them) and the rest R gives
MLP = MLP_S + MLP_R exactly (up to summation order). Then:
  routed experts   each a copy of MLP_R (width I - s). With norm_topk_prob the top-k weights sum
                   to 1, so sum_k w_k MLP_R(x) = MLP_R(x) whatever the router says.
  shared expert    (Qwen2-MoE only; s > 0) MLP_S with down_proj doubled and shared_expert_gate
                   zero: sigmoid(0) * 2 * MLP_S(x) = MLP_S(x), exact in floating point (x2 and
                   x0.5 are exact). S is the first s channels; channels have no order, so any
                   split is exact, and s trades BF16 shared width against quantized routed width.
                   With s = 0 there is no shared expert: no shared_expert.* tensors are written,
                   only shared_expert_gate (zero), which vLLM and transformers build whatever the width.
  router           random (normal, router_std). Not zero: with identical experts the mixture
                   does not depend on the router, so its gradient is zero at first, and a zero
                   router would send every token to the same k experts forever (a tie nothing
                   breaks). A random router spreads tokens, the experts see different tokens and
                   drift apart, and the router then has something to learn.
The result is a Qwen2-MoE (from Llama or Qwen2: no qk-norm) or a Qwen3-MoE (from Qwen3: qk-norm,
no shared expert) that hf.save_model writes and transformers, vLLM and SGLang read. vLLM's Qwen2-MoE
(vllm-project/vllm, vllm/model_executor/models/qwen2_moe.py) fixes three things a Llama source
must be fitted to:
  q/k/v biases     qkv_proj is built with bias=True whatever the config says, and the default
                   loader's strict check (model_loader/default_loader.py, track_weights_loading)
                   fails on any parameter the checkpoint lacks. A Llama has none, so zero biases
                   are written and qkv_bias is true (transformers' Qwen2MoeConfig.qkv_bias, default
                   true, then builds and loads them too): x W^T + 0 is exact.
  shared expert    built only when shared_expert_intermediate_size > 0; shared_expert_gate
                   (Linear H -> 1) always. load_weights has no parameter for a shared_expert.*
                   tensor of width 0 and fails on it, so none is written (transformers builds a
                   zero-width shared expert and reports its tensors missing: they hold nothing;
                   fp4rl builds none and keeps only the gate).
  head_dim         hidden_size // num_attention_heads; a config head_dim is ignored. A source
                   with another head_dim is refused (transformers would honour it, vLLM would not).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from fp4rl.model import CausalLM, build_model

TARGET = {"llama": "qwen2_moe", "qwen2": "qwen2_moe", "qwen3": "qwen3_moe"}


def upcycle(model: CausalLM, num_experts: int, top_k: int, *, shared_expert_intermediate_size: int = 0,
            layers: Iterable[int] | None = None, router_std: float = 0.02, seed: int = 0) -> CausalLM:
    """A new MoE CausalLM equal to `model` at initialisation (`model` is left unchanged).

    num_experts, top_k     routed experts per MoE layer and experts per token.
    shared_expert_intermediate_size
                           channels of each dense MLP given to a shared expert (Qwen2-MoE only).
    layers                 layers to make MoE (default all); the others keep their dense MLP.
    router_std, seed       the router's random init.
    """
    src = model.config
    if src.model_type not in TARGET:
        raise ValueError(f"upcycle needs a dense llama, qwen2 or qwen3 model, got {src.model_type!r}")
    target = TARGET[src.model_type]
    if (src.o_bias and target == "qwen2_moe") or src.mlp_bias:  # Qwen3-MoE's o_proj takes attention_bias
        raise ValueError(f"upcycle: {target} has no {'o_proj or ' if target == 'qwen2_moe' else ''}MLP "
                         f"biases; this {src.model_type} model has o_proj bias={src.o_bias}, "
                         f"mlp_bias={src.mlp_bias}")
    vllm_head_dim = src.hidden_size // src.num_attention_heads
    if target == "qwen2_moe" and src.head_dim != vllm_head_dim:
        raise ValueError(
            f"upcycle: this {src.model_type} model has head_dim={src.head_dim}, but vLLM's Qwen2-MoE (the "
            f"target for {src.model_type}) ignores a config head_dim and uses hidden_size // "
            f"num_attention_heads = {src.hidden_size} // {src.num_attention_heads} = {vllm_head_dim}, so the "
            "checkpoint would not load there; no function-preserving change of head_dim exists (RoPE pairs "
            "and scales by head_dim). Upcycle a source whose head_dim equals hidden_size // "
            "num_attention_heads, or a Qwen3 model (its Qwen3-MoE target honours head_dim)")
    s = shared_expert_intermediate_size
    if target == "qwen3_moe" and s:
        raise ValueError("upcycle: a Qwen3 model becomes a Qwen3-MoE, which has no shared expert; "
                         "use shared_expert_intermediate_size=0")
    if not 0 <= s < src.intermediate_size:
        raise ValueError(f"upcycle: shared_expert_intermediate_size={s} must be in [0, intermediate_size="
                         f"{src.intermediate_size}) so the routed experts keep some channels")
    moe_layers = sorted(set(range(src.num_hidden_layers) if layers is None else layers))
    if not moe_layers or not all(0 <= i < src.num_hidden_layers for i in moe_layers):
        raise ValueError(f"upcycle: layers={moe_layers} must be non-empty, all < {src.num_hidden_layers}")

    extra = {k: v for k, v in src.extra.items() if k not in ("architectures", "pretraining_tp")}
    config = dataclasses.replace(
        src, model_type=target, num_experts=num_experts, num_experts_per_tok=top_k,
        qkv_bias=src.qkv_bias or target == "qwen2_moe",  # vLLM's Qwen2-MoE always has q/k/v biases
        moe_intermediate_size=src.intermediate_size - s, shared_expert_intermediate_size=s,
        norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=tuple(i for i in range(src.num_hidden_layers) if i not in moe_layers), extra=extra)

    weight = model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(seed)
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if config.qkv_bias and not src.qkv_bias:
        for i in range(src.num_hidden_layers):
            for n in ("q", "k", "v"):
                w = state_dict[f"model.layers.{i}.self_attn.{n}_proj.weight"]  # [out, H]
                state_dict[f"model.layers.{i}.self_attn.{n}_proj.bias"] = w.new_zeros(w.shape[0])
    for i in moe_layers:
        p = f"model.layers.{i}.mlp"
        gate, up, down = (state_dict.pop(f"{p}.{n}_proj.weight") for n in ("gate", "up", "down"))
        router = torch.randn(num_experts, src.hidden_size, generator=generator) * router_std  # [E, H]
        state_dict[f"{p}.gate.weight"] = router.to(weight.dtype)
        for e in range(num_experts):
            state_dict[f"{p}.experts.{e}.gate_proj.weight"] = gate[s:].clone()  # [I - s, H]
            state_dict[f"{p}.experts.{e}.up_proj.weight"] = up[s:].clone()
            state_dict[f"{p}.experts.{e}.down_proj.weight"] = down[:, s:].clone()  # [H, I - s]
        if target == "qwen2_moe":
            if s:
                state_dict[f"{p}.shared_expert.gate_proj.weight"] = gate[:s].clone()  # [s, H]
                state_dict[f"{p}.shared_expert.up_proj.weight"] = up[:s].clone()
                state_dict[f"{p}.shared_expert.down_proj.weight"] = down[:, :s] * 2  # [H, s]
            state_dict[f"{p}.shared_expert_gate.weight"] = torch.zeros_like(gate[:1])  # [1, H]
    return build_model(config, state_dict, device=weight.device)
