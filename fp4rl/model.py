"""One decoder for Llama, Qwen2, Qwen3 and the MoE models built on them (Qwen2-MoE, Qwen3-MoE).

The trainer, the sampler and the exporter all run this file; only its `nn.Linear` modules are
swapped (by `qat.convert`, by name) when a precision contract asks for NVFP4. Parameter names are
Hugging Face's, so a checkpoint's state dict loads as it is.
The architecture comes from `ModelConfig` (model_config.py: config.json parsing and checks),
re-exported here.

The network, for input ids x of length T (pre-norm residual blocks):
    h = embed_tokens[x]
    per layer:  h = h + o_proj(Attention(RoPE(q_proj(n)), RoPE(k_proj(n)), v_proj(n))),  n = RMSNorm(h)
                h = h + MLP(RMSNorm(h))          MLP(n) = down_proj(silu(gate_proj(n)) * up_proj(n))
    logits = lm_head(RMSNorm(h))                 (lm_head shares embed_tokens' weight when tied)
RMSNorm(x) = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back before the weight.
Qwen3 adds an RMSNorm over head_dim on q and k before RoPE ("qk-norm"); Qwen2 has q/k/v biases.
MoE layers replace the MLP with `moe.SparseMoeBlock` (router softmax -> top-k experts).

RoPE rotates each (i, i + D/2) pair of a head by angle position * inv_freq[i],
inv_freq[i] = theta^(-2i/D). "linear" scaling divides inv_freq by a factor; "llama3" divides the
low frequencies (wavelength > L/low_freq_factor, L the original context) by the factor, keeps the
high ones (wavelength < L/high_freq_factor) and interpolates between them.

Attention is `F.scaled_dot_product_attention` with an explicit boolean mask [B, 1, T, S]: key
slot s is visible to the query in slot p when s <= p and s holds a real token (attention_mask 1),
so left-padded batches and cached decoding use one code path. A padding query sees only itself
(its output is garbage nobody reads, but finite: a fully masked row would give NaN). Without
padding the mask is left out where SDPA's is_causal says the same (a fresh sequence) or nothing
is hidden (one new token after a cache), which lets SDPA pick its fastest kernels.

Slots and positions are different things: slots index the sequence as stored (padding included,
prompt then generated tokens); positions are the RoPE positions, by default counted over real
tokens only (cumsum of attention_mask - 1), so a left-padded prompt gets the same positions as
the unpadded one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The config lives in model_config.py; its public names are re-exported so that
# `from fp4rl.model import ModelConfig` (and hf.py's SUPPORTED_MODEL_TYPES) keep working.
from fp4rl.model_config import (  # noqa: F401
    ARCHITECTURES,
    MOE_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
)
from fp4rl.moe import SparseMoeBlock

# ----------------------------------------------------------------------------------------------
# RoPE frequencies


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """inv_freq [head_dim / 2] in fp32 on the CPU, with the config's scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device="cpu") / d))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    context = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    between = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(between, interpolated, scaled)


# ----------------------------------------------------------------------------------------------
# KV cache


class KVCache:
    """Preallocated keys and values of every layer: k[layer], v[layer] are [B, H_kv, T_max, D].

    The contract between the model and a cache (all that a subclass has to keep):
      `length`   slots already written (a Python int). A forward of T tokens writes slots
                 [length, length + T), then the model sets `length += T`.
      `max_len`  number of slots (the model refuses to write past it).
      `update(layer_idx, k, v, positions) -> (k_all, v_all)`
                 store k, v [B, H_kv, T, D] (already rotated by RoPE) at the slots `positions`
                 (LongTensor [T], = arange(length, length + T)) and return the keys and values of
                 slots [0, length + T) as [B, H_kv, length + T, D] in k's dtype.
    A subclass that stores FP8 or NVFP4 overrides `__init__` (its own buffers) and `update`
    (quantize on write, dequantize what it returns); the model code does not change. The
    attention mask passed to the model covers the same slots: attention_mask [B, length + T].
    `reset()` empties the cache for a new batch.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        end = self.length + k.shape[2]
        self.k[layer_idx].index_copy_(2, positions, k.to(self.k[layer_idx].dtype))
        self.v[layer_idx].index_copy_(2, positions, v.to(self.v[layer_idx].dtype))
        k_all = self.k[layer_idx][:, :, :end]  # [B, H_kv, end, D]
        v_all = self.v[layer_idx][:, :, :end]
        return k_all.to(k.dtype), v_all.to(v.dtype)

    def reset(self) -> None:
        self.length = 0


# ----------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward; also one expert of an MoE layer."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_tables(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """RoPE's (cos, sin) [..., D] for positions [...] (integer), inv_freq [D/2] fp32 on positions' device:
    angles in fp32, the tables rounded to dtype (the activations'), as every forward and decode step uses."""
    freqs = positions[..., None].float() * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx, self.head_dim = layer_idx, config.head_dim
        self.n_rep = config.num_attention_heads // config.num_key_value_heads  # query heads per kv head
        q_dim = config.num_attention_heads * config.head_dim
        kv_dim = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache=None, slots=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, -1, self.head_dim)  # [B, T, H_kv, D]
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H(_kv), T, D]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v, slots)  # [B, H_kv, S, D]
        # enable_gqa: query head h reads kv head h // n_rep without copying K/V n_rep times
        # (measured on an H200, decode at 4K context: 56 us, against 690 us with repeat_interleave)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1,
                                           enable_gqa=self.n_rep > 1)  # [B, H, T, D]
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        if self.is_moe:
            H, I_e = config.hidden_size, config.moe_intermediate_size
            shared = None
            if config.model_type == "qwen2_moe" and config.shared_expert_intermediate_size:
                shared = MLP(H, config.shared_expert_intermediate_size)
            self.mlp = SparseMoeBlock(H, [MLP(H, I_e) for _ in range(config.num_experts)],
                                      top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                                      shared_expert=shared)
            if config.model_type == "qwen2_moe" and shared is None:
                # Width 0: no shared expert (vLLM builds none and its loader rejects shared_expert.*
                # tensors), but vLLM and transformers both keep shared_expert_gate [1, H] and vLLM's
                # strict load needs it in the checkpoint: kept here, unused (it gates nothing).
                self.mlp.shared_expert_gate = nn.Linear(H, 1, bias=False)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache=None, slots=None, forced_experts=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache, slots)
        h = self.post_attention_layernorm(x)
        if self.is_moe:
            h, experts = self.mlp(h, forced_experts)  # experts: [B, T, top_k]
            return x + h, experts
        return x + self.mlp(h), None


class Decoder(nn.Module):
    """HF's `model.`: embed_tokens, layers, norm. Returns the final hidden states."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_inv_freq = rope_inv_freq(config)  # fp32, not a buffer: .to(bf16) must not round it

    def forward(self, input_ids, position_ids=None, attention_mask=None, kv_cache=None, routing=None):
        B, T = input_ids.shape
        device = input_ids.device
        start = 0 if kv_cache is None else kv_cache.length
        S = start + T  # key slots attended over
        if kv_cache is not None and (kv_cache.max_len < S or kv_cache.batch_size != B):
            raise ValueError(f"kv_cache holds {kv_cache.batch_size} x {kv_cache.max_len} slots with "
                             f"{start} used; this forward needs {B} x {S}: allocate a larger KVCache")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"attention_mask must be [B, cached + new tokens] = {[B, S]} (1 = real token), "
                             f"got {list(attention_mask.shape)}")
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B, T]
            else:
                position_ids = torch.arange(start, S, device=device).expand(B, T)
        moe_layers = [layer for layer in self.layers if layer.is_moe]
        if routing is not None and len(routing) != len(moe_layers):
            raise ValueError(f"routing must list one [B, T, top_k] tensor per MoE layer ({len(moe_layers)}), "
                             f"got {len(routing)}")

        slots = torch.arange(start, S, device=device)  # [T]
        if attention_mask is None and (start == 0 or T == 1):
            mask = None  # causal (T > 1) or all visible (one new token): SDPA needs no mask tensor
        else:
            key_slots = torch.arange(S, device=device)  # [S]
            mask = key_slots[None, :] <= slots[:, None]  # [T, S] causal
            if attention_mask is not None:
                real = attention_mask.bool()[:, None, :]  # [B, 1, S]
                mask = mask & (real | (key_slots[None, :] == slots[:, None]))  # [B, T, S]
            mask = mask.expand(B, T, S)[:, None]  # [B, 1, T, S]

        x = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rope_tables(position_ids, x.dtype)  # [B, T, D]

        chosen, moe_i = [], 0
        for layer in self.layers:
            forced = None
            if layer.is_moe and routing is not None:
                forced, moe_i = routing[moe_i], moe_i + 1
            x, experts = layer(x, cos, sin, mask, kv_cache, slots, forced)
            if experts is not None:
                chosen.append(experts)
        if kv_cache is not None:
            kv_cache.length = S
        return self.norm(x), chosen

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """rope_tables for these positions; inv_freq moves to their device once (kept there, so a CUDA-graph
        capture of a decode step copies nothing from the host)."""
        if self.rope_inv_freq.device != positions.device:
            self.rope_inv_freq = self.rope_inv_freq.to(positions.device)
        return rope_tables(self.rope_inv_freq, positions, dtype)


class CausalLM(nn.Module):
    """`model(input_ids [B, T]) -> logits [B, T, V]`; `forward` lists the sampler's and trainer's options."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, kv_cache: KVCache | None = None,
                routing: list[torch.Tensor] | None = None, return_routing: bool = False):
        """
        input_ids       [B, T] token ids (the new tokens only when a kv_cache holds earlier ones).
        position_ids    [B, T] RoPE positions; default: real tokens counted by attention_mask
                        (left padding gets positions 0, 1, ... from the first real token), or
                        length .. length + T - 1 without a mask.
        attention_mask  [B, kv_cache.length + T], 1 = real token, 0 = padding.
        kv_cache        KVCache; the T new tokens go to slots [length, length + T).
        routing         MoE routing replay: one integer tensor [B, T, top_k] per MoE layer (in layer
                        order; the sampler's int16 ids or long) of experts to use instead of the
                        router's choice; their weights
                        still come from the router's softmax, so the router gets gradients.
        return_routing  also return the experts used, one [B, T, top_k] per MoE layer.
        Returns logits [B, T, V] (and the routing list when return_routing).
        """
        h, chosen = self.model(input_ids, position_ids, attention_mask, kv_cache, routing)
        logits = self.lm_head(h)  # [B, T, V]
        return (logits, chosen) if return_routing else logits


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], *,
                dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> CausalLM:
    """A CausalLM holding `state_dict` (HF names), built on the meta device so that no random
    initialisation runs first. A tied lm_head.weight may be absent (it is embed_tokens.weight)."""
    state_dict = {k: v for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.model_type == "qwen2_moe" and not config.shared_expert_intermediate_size:
        # transformers builds a zero-width shared expert and its save_pretrained writes it: nothing to load
        state_dict = {k: v for k, v in state_dict.items()
                      if not (".mlp.shared_expert." in k and not v.numel())}
    if config.tie_word_embeddings:
        head, embed = state_dict.pop("lm_head.weight", None), state_dict.get("model.embed_tokens.weight")
        if head is not None and embed is not None and not torch.equal(head, embed):
            raise ValueError("checkpoint: config.json says tie_word_embeddings = true, but its "
                             "lm_head.weight differs from model.embed_tokens.weight; tied, it would be "
                             "dropped (and the logits change). Set tie_word_embeddings = false in "
                             "config.json if the head is its own, or remove lm_head.weight if it is a stale "
                             "copy")
    with torch.device("meta"):
        model = CausalLM(config)
    expected = set(model.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match a {config.model_type} model built from its config: "
                         f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    for name, tensor in model.state_dict().items():
        if name in state_dict and tuple(state_dict[name].shape) != tuple(tensor.shape):
            raise ValueError(f"checkpoint tensor {name} has shape {list(state_dict[name].shape)}, the config "
                             f"gives {list(tensor.shape)}")
    state_dict = {k: v.to(device=device, dtype=dtype if dtype and v.is_floating_point() else v.dtype)
                  for k, v in state_dict.items()}
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()
    return model
