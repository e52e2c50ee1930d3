"""The architecture of a model (`ModelConfig`), read from a Hugging Face config.json and written back.

`ModelConfig.from_hf` reads the spellings of transformers 4.x and 5.x (rope_theta + rope_scaling or
rope_parameters, torch_dtype or dtype, num_experts or num_local_experts) and fills in transformers'
defaults; keys fp4rl does not use are kept in `extra`, and `to_hf` writes them back with the rest, so
transformers, vLLM and SGLang read the result. What the decoder does not implement is refused here,
naming the key and what is supported: sliding-window attention, partial or per-layer RoPE, RoPE
scaling other than "linear" and "llama3", activations other than SiLU, and bias / qk-norm / expert
layouts no supported family (Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE) has. `__post_init__` does
the field checks, so a config built in code is held to the same rules as a parsed one.

This is plain data (no torch): parsing and validating config.json is one idea, the modules that the
config shapes (fp4rl.model, which re-exports `ModelConfig`) another. `model.rope_inv_freq` turns the
RoPE fields into frequencies.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

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
        def integer(v):  # a bool is not a count here
            return isinstance(v, int) and not isinstance(v, bool)

        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim", "decoder_sparse_step"):
            if not integer(getattr(self, key)) or getattr(self, key) <= 0:
                fail(key, getattr(self, key), "it must be a positive integer")
        # the MoE sizes are 0 in a dense model; a float (2.0, 1.5) failed late or made no layer MoE
        for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "shared_expert_intermediate_size"):
            if not integer(getattr(self, key)) or getattr(self, key) < 0:
                fail(key, getattr(self, key), "it must be a non-negative integer")
        if self.num_attention_heads % self.num_key_value_heads:
            fail("num_key_value_heads", self.num_key_value_heads,
                 f"it must divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            fail("head_dim", self.head_dim, "RoPE needs an even head_dim")
        if self.hidden_act != "silu":
            fail("hidden_act", self.hidden_act, "only 'silu' (SwiGLU MLPs) is implemented")
        if not _positive_number(self.rope_theta):  # 0 made every inv_freq inf
            fail("rope_theta", self.rope_theta, "it must be a finite number > 0 (RoPE's usual base: 10000.0)")
        self.rope_theta = float(self.rope_theta)
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
            if self.num_experts <= 0:
                fail("num_experts", self.num_experts, f"a {t} model needs num_experts > 0 routed experts "
                     f"(a dense model is model_type {t.replace('_moe', '')})")
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                fail("num_experts_per_tok", self.num_experts_per_tok,
                     f"an MoE needs num_experts > 0 and 0 < num_experts_per_tok <= num_experts "
                     f"(num_experts={self.num_experts})")
            if self.moe_intermediate_size <= 0:
                fail("moe_intermediate_size", self.moe_intermediate_size, "it must be positive")
            if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
                fail("mlp_only_layers", self.mlp_only_layers, "layer indices must be in range")
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
        sliding = d.pop("use_sliding_window", False) and d.get("sliding_window") is not None
        if sliding and not layer_types and t in ("qwen2", "qwen3"):
            # transformers' rule for these two: the layers from max_window_layers on slide (its MoE models
            # slide by other rules: refused whenever the switch is on with a window)
            first = d.get("max_window_layers")
            sliding = first is None or first < d.get("num_hidden_layers", first + 1)
        if sliding or any(lt != "full_attention" for lt in layer_types):
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
            if d.get("num_experts") is None and d.get("num_local_experts") is None:
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
        head_dim = d.pop("head_dim", None)  # 0 (as num_key_value_heads 0) is kept: __post_init__ refuses it
        if head_dim is None:
            head_dim = 128 if t == "qwen3" else d["hidden_size"] // heads
        kv_heads = d.pop("num_key_value_heads", None)
        kw = dict(
            model_type=t,
            vocab_size=d.pop("vocab_size"),
            hidden_size=d.pop("hidden_size"),
            intermediate_size=d.pop("intermediate_size"),
            num_hidden_layers=d.pop("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
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
            experts = d.pop("num_experts", None)  # 0 is kept, for __post_init__ to refuse by name
            local = d.pop("num_local_experts", None)
            kw.update(
                num_experts=experts if experts is not None else local,
                num_experts_per_tok=d.pop("num_experts_per_tok"),
                moe_intermediate_size=d.pop("moe_intermediate_size"),
                norm_topk_prob=d.pop("norm_topk_prob", False),
                decoder_sparse_step=d.pop("decoder_sparse_step", 1),
                mlp_only_layers=tuple(d.pop("mlp_only_layers", None) or ()),
            )
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
    new_theta = params.pop("rope_theta", None)  # 0 is kept, for __post_init__ to refuse
    theta = new_theta if new_theta is not None else 10000.0 if theta is None else theta
    if (params.pop("partial_rotary_factor", None) or 1.0) != 1.0 or (d.pop("partial_rotary_factor", None)
                                                                      or 1.0) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 is not supported; RoPE covers head_dim")
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "llama3" and d.get("original_max_position_embeddings") is not None:
        # transformers reads a top-level original_max_position_embeddings before rope_scaling's own
        params["original_max_position_embeddings"] = d.pop("original_max_position_embeddings")
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
        need += ("original_max_position_embeddings",)
    for key in need:  # factor 0 made inv_freq inf and cos/sin NaN, which CPU attention silently zeroes
        if not _positive_number(s[key]):
            raise ValueError(f"config.json: rope_scaling {key}={s[key]!r} is not supported; it must be a "
                             f"finite number > 0: fix {key} in rope_scaling (rope_parameters), or drop the "
                             "scaling")
    if s["rope_type"] == "llama3" and not s["high_freq_factor"] > s["low_freq_factor"]:
        raise ValueError("config.json: llama3 rope_scaling needs high_freq_factor > low_freq_factor")
    return s


def _positive_number(v) -> bool:
    """A finite int or float > 0 (not a bool, not a string)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
