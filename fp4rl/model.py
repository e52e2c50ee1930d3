"""One decoder for Llama, Qwen2, Qwen3 and the MoE models built on them (Qwen2-MoE, Qwen3-MoE).

The trainer, the sampler and the exporter all run this file; only its `nn.Linear` modules are
swapped (by `qat.convert`, by name) when a precision contract asks for NVFP4. Parameter names are
Hugging Face's, so a checkpoint's state dict loads as it is.

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
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fp4rl.moe import SparseMoeBlock

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


# ----------------------------------------------------------------------------------------------
# Config


@dataclass
class ModelConfig:
    """The architecture, read from a Hugging Face config.json (`from_hf`) and written back (`to_hf`)."""

    model_type: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # width of the dense MLP (in MoE models: of the mlp_only_layers)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # fewer than num_attention_heads: grouped-query attention
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None, {"rope_type": "linear", "factor"} or llama3's fields
    tie_word_embeddings: bool = False  # lm_head.weight is embed_tokens.weight
    hidden_act: str = "silu"
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # biases on the dense MLP's projections (Llama's mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    num_experts: int = 0  # routed experts per MoE layer; 0 = dense model
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # width of each routed expert
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert (0: it contributes nothing)
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()  # ... and i is not listed here
    torch_dtype: str | None = None  # dtype of the checkpoint's weights ("bfloat16", ...)
    extra: dict = field(default_factory=dict, repr=False, compare=False)  # other config.json keys

    def __post_init__(self):
        def fail(key, value, fix):
            raise ValueError(f"config.json: {key}={value!r} is not supported; {fix}")

        if self.model_type not in SUPPORTED_MODEL_TYPES:
            fail("model_type", self.model_type, f"fp4rl supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) <= 0:
                fail(key, getattr(self, key), "it must be a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", self.num_key_value_heads,
                 f"it must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            fail("head_dim", self.head_dim, "RoPE needs an even head_dim")
        if self.hidden_act != "silu":
            fail("hidden_act", self.hidden_act, "only 'silu' (SwiGLU MLPs) is implemented")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling, self.max_position_embeddings)
        self.mlp_only_layers = tuple(sorted(int(i) for i in self.mlp_only_layers))

        t = self.model_type
        if t == "llama" and self.qkv_bias != self.o_bias:
            fail("attention_bias", (self.qkv_bias, self.o_bias), "Llama has one flag for q/k/v/o biases")
        if t.startswith("qwen3") and self.qkv_bias != self.o_bias:
            fail("attention_bias", (self.qkv_bias, self.o_bias), "Qwen3 has one flag for q/k/v/o biases")
        if t.startswith("qwen2") and self.o_bias:
            fail("o_bias", True, "Qwen2 models have no o_proj bias")
        if t == "qwen2" and not self.qkv_bias:
            fail("qkv_bias", False, "Qwen2 always has q/k/v biases")
        if t != "llama" and self.mlp_bias:
            fail("mlp_bias", True, "only Llama has MLP biases")
        if self.qk_norm != t.startswith("qwen3"):
            fail("qk_norm", self.qk_norm, "Qwen3 models always have qk-norm and the others never")
        if t in MOE_MODEL_TYPES:
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                fail("num_experts_per_tok", self.num_experts_per_tok,
                     f"an MoE needs num_experts > 0 and 0 < num_experts_per_tok <= num_experts "
                     f"(num_experts={self.num_experts})")
            if self.moe_intermediate_size <= 0:
                fail("moe_intermediate_size", self.moe_intermediate_size, "it must be positive")
            if self.decoder_sparse_step < 1:
                fail("decoder_sparse_step", self.decoder_sparse_step, "it must be >= 1")
            if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
                fail("mlp_only_layers", self.mlp_only_layers, "layer indices must be in range")
            if self.shared_expert_intermediate_size < 0:
                fail("shared_expert_intermediate_size", self.shared_expert_intermediate_size, "must be >= 0")
            if t == "qwen3_moe" and self.shared_expert_intermediate_size:
                fail("shared_expert_intermediate_size", self.shared_expert_intermediate_size,
                     "Qwen3-MoE has no shared expert; use model_type qwen2_moe")
        elif self.num_experts:
            fail("num_experts", self.num_experts, f"a {t} model is dense; MoE types are {MOE_MODEL_TYPES}")

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def moe_layers(self) -> list[int]:
        """Indices of the MoE layers, in the order `routing` lists them."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @classmethod
    def from_hf(cls, d: dict) -> ModelConfig:
        """Parse a config.json dict (transformers 4.x and 5.x spellings)."""
        d = dict(d)
        t = d.pop("model_type", None)
        if t not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type={t!r} is not supported; fp4rl supports "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        layer_types = d.pop("layer_types", None) or []
        if d.pop("use_sliding_window", False) or any(lt != "full_attention" for lt in layer_types):
            raise ValueError("config.json: sliding-window attention (use_sliding_window / layer_types) is "
                             "not implemented; fp4rl supports full attention only (set "
                             "use_sliding_window=false if the model was trained without it)")
        for key in ("sliding_window", "max_window_layers"):  # only meaningful with sliding windows
            d.pop(key, None)
        rope_theta, rope_scaling = _parse_rope(d)
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"]
        if t in MOE_MODEL_TYPES:
            required += ["num_experts_per_tok", "moe_intermediate_size"]
            if "num_experts" not in d and "num_local_experts" not in d:
                required.append("num_experts")
        if t == "qwen2_moe":
            required.append("shared_expert_intermediate_size")
        missing = [k for k in required if d.get(k) is None]
        if missing:
            raise ValueError(f"config.json: {t} needs {', '.join(missing)}, which the file does not set; "
                             "is it the model's own config.json?")
        if d.get("attention_dropout"):
            warnings.warn(f"config.json: attention_dropout={d['attention_dropout']} is ignored (fp4rl never "
                          "drops attention weights: RL logprobs must be those the sampler computed)",
                          stacklevel=2)
        heads = d.pop("num_attention_heads")
        # transformers' defaults: Qwen3's config class sets head_dim 128, Qwen3-MoE's none (hidden / heads)
        head_dim = d.pop("head_dim", None) or (128 if t == "qwen3" else d["hidden_size"] // heads)
        kw = dict(
            model_type=t,
            vocab_size=d.pop("vocab_size"),
            hidden_size=d.pop("hidden_size"),
            intermediate_size=d.pop("intermediate_size"),
            num_hidden_layers=d.pop("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=d.pop("num_key_value_heads", None) or heads,
            head_dim=head_dim,
            max_position_embeddings=d.pop("max_position_embeddings", 2048),
            rms_norm_eps=d.pop("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=d.pop("tie_word_embeddings", False),
            hidden_act={"swish": "silu"}.get(d.get("hidden_act"), d.pop("hidden_act", "silu")),
            torch_dtype=d.pop("torch_dtype", None) or d.pop("dtype", None),
            qk_norm=t.startswith("qwen3"),
        )
        d.pop("dtype", None)
        if t in ("llama", "qwen3", "qwen3_moe"):
            kw["qkv_bias"] = kw["o_bias"] = d.pop("attention_bias", False)
        elif t == "qwen2":
            kw["qkv_bias"] = True
        else:  # qwen2_moe
            kw["qkv_bias"] = d.pop("qkv_bias", True)
        if t == "llama":
            kw["mlp_bias"] = d.pop("mlp_bias", False)
        if t in MOE_MODEL_TYPES:
            kw.update(
                num_experts=d.pop("num_experts", None) or d.pop("num_local_experts"),
                num_experts_per_tok=d.pop("num_experts_per_tok"),
                moe_intermediate_size=d.pop("moe_intermediate_size"),
                norm_topk_prob=d.pop("norm_topk_prob", False),
                decoder_sparse_step=d.pop("decoder_sparse_step", 1),
                mlp_only_layers=tuple(d.pop("mlp_only_layers", None) or ()),
            )
            d.pop("num_local_experts", None)
            if t == "qwen2_moe":
                kw["shared_expert_intermediate_size"] = d.pop("shared_expert_intermediate_size")
        return cls(**kw, extra=d)

    def to_hf(self) -> dict:
        """The config.json dict, readable by transformers 4.x/5.x, vLLM and SGLang."""
        d = dict(self.extra)
        d.update(
            architectures=[ARCHITECTURES[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings,
            hidden_act=self.hidden_act,
            torch_dtype=self.torch_dtype,
        )
        t = self.model_type
        if t in ("llama", "qwen3", "qwen3_moe"):
            d["attention_bias"] = self.qkv_bias
        if t == "llama":
            d["mlp_bias"] = self.mlp_bias
        else:
            d["use_sliding_window"] = False
        if t in MOE_MODEL_TYPES:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        if t == "qwen2_moe":
            d["qkv_bias"] = self.qkv_bias
            d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        return d


def _parse_rope(d: dict) -> tuple[float, dict | None]:
    """Pop rope_theta and the scaling dict from either spelling: rope_parameters (transformers 5)
    or rope_theta + rope_scaling (older checkpoints)."""
    params = dict(d.pop("rope_parameters", None) or {})
    legacy = d.pop("rope_scaling", None) or {}
    theta = d.pop("rope_theta", None)
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"config.json: per-layer-type rope_parameters {sorted(params)} are not supported; "
                         "fp4rl supports one RoPE for every layer")
    params = {**legacy, **params}
    theta = float(params.pop("rope_theta", None) or theta or 10000.0)
    if (params.pop("partial_rotary_factor", None) or 1.0) != 1.0 or (d.pop("partial_rotary_factor", None)
                                                                      or 1.0) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 is not supported; RoPE covers head_dim")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    return theta, (None if rope_type == "default" else {"rope_type": rope_type, **params})


def _check_rope_scaling(s: dict | None, max_position_embeddings: int) -> dict | None:
    if s is None or s.get("rope_type", s.get("type")) in (None, "default"):
        return None
    s = dict(s)
    s["rope_type"] = s.pop("rope_type", None) or s.pop("type")
    s.pop("type", None)
    if s["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"config.json: rope_scaling rope_type={s['rope_type']!r} is not supported; fp4rl "
                         f"implements {', '.join(SUPPORTED_ROPE_TYPES)}")
    need = ("factor",) if s["rope_type"] == "linear" else ("factor", "low_freq_factor", "high_freq_factor")
    missing = [k for k in need if k not in s]
    if missing:
        raise ValueError(f"config.json: rope_scaling ({s['rope_type']}) lacks {missing}")
    if s["rope_type"] == "llama3":
        s.setdefault("original_max_position_embeddings", max_position_embeddings)
        if not s["high_freq_factor"] > s["low_freq_factor"]:
            raise ValueError("config.json: llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    return s


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
            if config.model_type == "qwen2_moe":
                with warnings.catch_warnings():  # width 0 is legal (no shared expert); init warns
                    warnings.filterwarnings("ignore", "Initializing zero-element tensors")
                    shared = MLP(H, config.shared_expert_intermediate_size)
            self.mlp = SparseMoeBlock(H, [MLP(H, I_e) for _ in range(config.num_experts)],
                                      top_k=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                                      shared_expert=shared)
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
        routing         MoE routing replay: one LongTensor [B, T, top_k] per MoE layer (in layer
                        order) of experts to use instead of the router's choice; their weights
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
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
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
