"""The sampler's KV caches: unquantized, FP8 (E4M3) and NVFP4, behind model.KVCache's contract.

Every cache keeps, per layer, the keys and values of B rows x T_max slots, [B, H_kv, T_max, D],
preallocated once: a decode step writes one slot per row and allocates nothing. `update` returns
the keys and values of slots [0, length + T) in the model's dtype, so attention itself never
changes; a quantized cache quantizes what it stores and dequantizes what it returns.

- "bf16": the model's own dtype (BF16, or FP32 in an FP32 sampler: the name is the contract's,
  "not quantized").
- "fp8": E4M3 codes with one FP32 scale per (row, head, slot), i.e. per token and head, over its
  D values: s = amax / 448, code = e4m3_rn(x / s), x' = fp32(code) * s. 1 + 4/D bytes per value.
- "nvfp4": fp4rl.nvfp4.quantize(x, scale_scope="row") on each token's head vector: 16-element
  blocks along head_dim with E4M3 block scales and one FP32 scale per (row, head, slot).
  0.5 + 1/16 + 4/D bytes per value (0.625 at D = 64, 3.2x fewer than BF16).

The per-token scales are computed from that token alone, so what a row stores does not depend on
the other rows of the batch or on later tokens. The trainer never reads a cache (it scores with a
full forward), so a quantized cache is a sampler-side approximation; its effect on the sampler's
logprobs is measured (`fp4rl bench rollout`), not hidden.

`select(rows)` re-indexes the batch dimension of every buffer: the sampler uses it to copy each
prompt's prefill to its n samples and to drop finished rows (compaction).
"""

from __future__ import annotations

import torch

from fp4rl.model import KVCache, ModelConfig
from fp4rl.nvfp4 import BLOCK, NVFP4Tensor, dequantize, quantize

KV_CACHE_KINDS = ("bf16", "fp8", "nvfp4")
E4M3_MAX = 448.0
_FP32_TINY = torch.finfo(torch.float32).tiny  # the smallest positive normal float32, 2^-126


def _write(buffer: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """buffer[:, :, positions] = values (index_copy_ has no float8 kernel on the CPU: copy the bytes)."""
    if buffer.dtype == torch.float8_e4m3fn:
        buffer, values = buffer.view(torch.uint8), values.view(torch.uint8)
    buffer.index_copy_(2, positions, values)


def _nonfinite(cache: str, x: str, layer_idx: int, values: torch.Tensor) -> ValueError:
    """The error for NaN/Inf keys or values: which cache, layer and K or V, how many, and what to do."""
    return ValueError(
        f"{cache} KV cache: the {'keys (K)' if x == 'k' else 'values (V)'} of layer {layer_idx} hold "
        f"{int((~torch.isfinite(values)).sum())} NaN/Inf of {values.numel()}: the model produced "
        "non-finite activations. Check the weights the sampler was given (a diverged update: lower "
        "the learning rate or clip gradients, and resume from a checkpoint before the step that "
        "produced them)")


class SamplerKVCache(KVCache):
    """KVCache whose per-layer buffers are listed in `buffer_names` (each a list of [B, ...] tensors)."""

    buffer_names: tuple[str, ...] = ("k", "v")

    def select(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` (LongTensor [B'], repeats allowed), in that order."""
        for name in self.buffer_names:
            setattr(self, name, [b.index_select(0, rows) for b in getattr(self, name)])
        self.batch_size = int(rows.numel())

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for name in self.buffer_names for b in getattr(self, name))

    def bytes_per_token(self) -> float:
        """Bytes one token (one row, one slot) occupies over all layers, keys and values."""
        return self.nbytes / (self.batch_size * self.max_len)


class BF16KVCache(SamplerKVCache):
    """The unquantized cache, in the model's dtype (model.KVCache plus `select`)."""


class FP8KVCache(SamplerKVCache):
    """E4M3 codes [B, H_kv, T_max, D] and FP32 scales [B, H_kv, T_max, 1] per layer, for k and v."""

    buffer_names = ("k", "v", "k_scale", "v_scale")

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        shape = (batch_size, config.num_key_value_heads, max_len, config.head_dim)
        layers = range(config.num_hidden_layers)
        self.k = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device) for _ in layers]
        self.v = [torch.zeros(shape, dtype=torch.float8_e4m3fn, device=device) for _ in layers]
        self.k_scale = [torch.ones(*shape[:3], 1, device=device) for _ in layers]
        self.v_scale = [torch.ones(*shape[:3], 1, device=device) for _ in layers]
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0

    @staticmethod
    def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (E4M3 codes [..., D], FP32 scale [..., 1]); an all-zero vector gets scale 1. The
        scale is at least the smallest normal float32: below 448 * 2^-149, amax / 448 would be 0 and the
        vector's zeros 0 / 0 = NaN (its values, all below 2^-126 * 2^-9 then, store as 0)."""
        x = x.float()
        amax = x.abs().amax(-1, keepdim=True)  # [..., 1]
        # amax / 448 as an IEEE division on every device: CUDA's tensor / python-scalar multiplies by the
        # rounded reciprocal (1-ulp different scales from the CPU's), a tensor divisor does not (filled on the
        # device: no host copy, so a CUDA graph can capture it)
        scale = torch.where(amax > 0, (amax / torch.full_like(amax, E4M3_MAX)).clamp(min=_FP32_TINY),
                            torch.ones_like(amax))
        return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        end = self.length + k.shape[2]
        # a NaN would be stored as E4M3's NaN and an Inf turn its vector into NaN / 0: refused, as the NVFP4
        # cache refuses them, before anything of the update (K or V) is written
        for name, x in (("k", k), ("v", v)):
            if not bool(torch.isfinite(x).all()):
                raise _nonfinite("FP8", name, layer_idx, x)
        out = []
        for codes, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = self.quantize(x)  # [B, H_kv, T, D], [B, H_kv, T, 1]
            _write(codes[layer_idx], positions, q)
            _write(scales[layer_idx], positions, s)
            out.append((codes[layer_idx][:, :, :end].float() * scales[layer_idx][:, :, :end]).to(x.dtype))
        return out[0], out[1]


class NVFP4KVCache(SamplerKVCache):
    """Packed E2M1 codes [B, H_kv, T_max, D/2], E4M3 block scales [B, H_kv, T_max, D/16] and FP32
    per-token scales [B, H_kv, T_max, 1] per layer, for k and v."""

    buffer_names = ("k_data", "k_block_scale", "k_global_scale", "v_data", "v_block_scale", "v_global_scale")

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 scale_rule: str = "4/6", err: str = "mse"):
        D = config.head_dim
        if D % BLOCK:
            raise ValueError(f"kv_cache='nvfp4' needs head_dim to be a multiple of {BLOCK} (one E4M3 scale "
                             f"per {BLOCK} values), the model has head_dim={D}; use kv_cache='fp8' or 'bf16'")
        lead = (batch_size, config.num_key_value_heads, max_len)
        layers = range(config.num_hidden_layers)
        for x in ("k", "v"):
            setattr(self, f"{x}_data", [torch.zeros(*lead, D // 2, dtype=torch.uint8, device=device)
                                        for _ in layers])
            setattr(self, f"{x}_block_scale", [torch.zeros(*lead, D // BLOCK, dtype=torch.float8_e4m3fn,
                                                           device=device) for _ in layers])
            setattr(self, f"{x}_global_scale", [torch.ones(*lead, 1, device=device) for _ in layers])
        self.quantize_kwargs = dict(tile=16, scale_rule=scale_rule, err=err, scale_scope="row")
        self.batch_size, self.max_len, self.length = batch_size, max_len, 0
        self.dtype = dtype

    def _quantize(self, x: str, layer_idx: int, values: torch.Tensor):
        try:
            return quantize(values, **self.quantize_kwargs)  # per (row, head, slot) global scale
        except ValueError as exc:
            if bool(torch.isfinite(values).all()):
                raise
            raise _nonfinite("NVFP4", x, layer_idx, values) from exc

    def _store(self, x: str, layer_idx: int, q, values: torch.Tensor, positions: torch.Tensor, end: int):
        data = getattr(self, f"{x}_data")[layer_idx]
        block_scale = getattr(self, f"{x}_block_scale")[layer_idx]
        global_scale = getattr(self, f"{x}_global_scale")[layer_idx]
        _write(data, positions, q.data)
        _write(block_scale, positions, q.block_scale)
        _write(global_scale, positions, q.global_scale)
        stored = NVFP4Tensor(data=data[:, :, :end], block_scale=block_scale[:, :, :end],
                             global_scale=global_scale[:, :, :end],
                             shape=torch.Size((*data.shape[:2], end, values.shape[-1])), dtype=values.dtype,
                             scale_rule=q.scale_rule)
        return dequantize(stored, values.dtype)  # [B, H_kv, end, D]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        end = self.length + k.shape[2]
        qk, qv = self._quantize("k", layer_idx, k), self._quantize("v", layer_idx, v)  # both before a write
        return (self._store("k", layer_idx, qk, k, positions, end),
                self._store("v", layer_idx, qv, v, positions, end))


def make_kv_cache(kind: str, config: ModelConfig, batch_size: int, max_len: int, *,
                  dtype: torch.dtype, device: torch.device | str) -> SamplerKVCache:
    """A cache of `kind` (one of KV_CACHE_KINDS) for batch_size rows of max_len slots."""
    classes = {"bf16": BF16KVCache, "fp8": FP8KVCache, "nvfp4": NVFP4KVCache}
    if kind not in classes:
        raise ValueError(f"kv_cache={kind!r}: use one of {KV_CACHE_KINDS}")
    return classes[kind](config, batch_size, max_len, dtype=dtype, device=device)
