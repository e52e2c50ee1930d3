"""Fused BF16 CPU kernels for the sampler's decoder: everything in a layer but the linears.

`fast_cpu_ops(model)` switches a sampler copy (fp4rl.packed.build_sampler_model's CausalLM,
BF16 on the CPU) to `FastCPUDecoder`, a subclass of model.Decoder whose forward runs, per layer:

    h = RMSNorm(x)                                   cpu_add_rms_norm (first layer only)
    q, k, v = q_proj(h), k_proj(h), v_proj(h)        the model's linears, as they are
    RoPE(q), RoPE(k), k/v -> KV cache slots,         cpu_rope_attention: cpu_rope_qkv writing straight
    a = attention(q, cache)                          into a BF16 cache, then cpu_attention (GQA, padding
                                                     mask, any T)
    x = x + o_proj(a); h = RMSNorm(x)                cpu_add_rms_norm (x updated in place)
    x = x + down_proj(silu(gate_proj(h)) * up_proj(h)); h = RMSNorm(x)   cpu_silu_mul, cpu_add_rms_norm

so a layer is 4 C calls and the linears, instead of ~40 torch ops. A decode step (one new token per
row) of dense layers whose linears all run fp4rl.nvfp4.cpu_gemm (q/k/v and gate/up fused, W4A16 or
BF16, at most 64 rows) with a plain BF16 cache is one C call for all layers (fp4rl/cpu_step.py: the
same kernels in the same order, so the same bits, without ~8 Python-side calls per layer). The
trainer's model (model.py) is untouched: only the sampler's copy changes class, and everything the
kernels do not cover (no C compiler, FP32 or CUDA tensors, autograd on) runs model.Decoder.forward
unchanged; a cache whose `update` is not the plain BF16 one (FP8, NVFP4) gets the same kernels around
its own `update`; a linear output without evenly strided rows is copied first.

Numerics (BF16, computed in float32): the residual adds, RoPE, and RMSNorm's two casts and weight
multiply round where the eager code rounds, so they give torch's bits (RoPE and the adds exactly;
RMSNorm up to its mean of squares, summed in another order). SiLU uses a Cephes-style exp and a
Newton-refined reciprocal (about 1 ulp in float32) before the two BF16 roundings torch also does.
Attention computes scores (BF16 products, float32 sums: AVX512-BF16 dot products where the CPU has
them), softmax and the weighted sum of values in float32 and rounds once (SDPA's CPU kernels round
differently), so results differ from the eager path by BF16 rounding only. On the default model
(16 x 33 teacher-forced positions) the logprobs are as close to an FP32 sampler's as the eager BF16
path's are; tests/test_cpu_ops.py checks each kernel against the torch formula and the sampler's
logprobs with and without this path.

The C file is compiled on first use with the same build cache as fp4rl.nvfp4.cpu (keyed by source,
flags, compiler and CPU); without a compiler, `available()` is False (one warning) and
`fast_cpu_ops` leaves the model as it is. FP4RL_CPU_OPS=0 turns the fast path off. A prefill's
kernels are split over torch.get_num_threads() pool threads (by rows, attention by batch rows; the
same bits as one thread); a decode step's run on the calling thread (they are shorter than a
hand-off).
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
from functools import partial
from pathlib import Path

import torch

from fp4rl import cpu_step
from fp4rl.model import CausalLM, Decoder, KVCache
from fp4rl.nvfp4 import cpu

__all__ = ["FastCPUDecoder", "add_rms_norm", "attention", "available", "fast_cpu_ops", "rope_qkv", "silu_mul"]

_SOURCE_FILE = Path(__file__).with_name("cpu_ops.c")
_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11", "-fPIC", "-shared")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


# ---- build and load ----------------------------------------------------------------------------


def build(cflags: tuple[str, ...] = _CFLAGS) -> Path:
    """Compile cpu_ops.c (or find it in the cache; fp4rl.nvfp4.cpu.build); returns the shared
    library's path. Tests pass other -march flags to check the AVX-512 and the scalar code on one
    machine."""
    return cpu.build(_SOURCE_FILE, cflags, ldflags=("-lm",))


def _load(cflags: tuple[str, ...] = _CFLAGS) -> ctypes.CDLL:
    lib = cpu.open_library(partial(build, cflags))
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.cpu_add_rms_norm.argtypes = [i64, i64, ptr, i64, ptr, i64, ptr, f32, ptr, i64]
    lib.cpu_add_rms_norm.restype = None
    lib.cpu_silu_mul.argtypes = [i64, i64, ptr, i64, ptr, i64, ptr, i64]
    lib.cpu_silu_mul.restype = None
    lib.cpu_rope_qkv.argtypes = [i64] * 5 + [ptr, i64] * 3 + [ptr] * 5 + [i64] * 4
    lib.cpu_rope_qkv.restype = None
    lib.cpu_attention.argtypes = [i64] * 6 + [ptr] * 3 + [i64] * 3 + [ptr, i64, f32, ptr]
    lib.cpu_attention.restype = ctypes.c_int
    lib.cpu_rope_attention.argtypes = ([i64] * 6 + [ptr, i64] * 3 + [ptr] * 4 + [i64] * 3
                                       + [ptr, i64, f32, ptr])
    lib.cpu_rope_attention.restype = ctypes.c_int
    lib.cpu_decode_layers.argtypes = [ptr, i64, ptr, i64, i64]
    lib.cpu_decode_layers.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernels can run (builds and loads them on the first call; warns once if not)."""
    return cpu.load_once(globals(), _load, lambda failed: (
        f"fp4rl.cpu_ops: the fused CPU kernels are unavailable ({failed}); the sampler runs the eager model "
        "code"))


def _need_lib() -> ctypes.CDLL:
    if not available():
        raise RuntimeError(f"fp4rl.cpu_ops: the fused CPU kernels are unavailable ({_failed})")
    return _lib


_MIN_ROWS_PER_THREAD = 32  # prefill-sized calls only: a decode step's kernels are shorter than a hand-off


def _chunks(n: int, min_per_thread: int = _MIN_ROWS_PER_THREAD) -> list[tuple[int, int]]:
    """[0, n) in up to torch.get_num_threads() pieces of at least min_per_thread."""
    k = max(1, min(torch.get_num_threads(), n // max(min_per_thread, 1)))
    step = -(-n // k)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)] if n else [(0, 0)]


def _run(calls: list) -> list:
    """Results of the zero-argument callables (C calls: ctypes releases the GIL), the first run here."""
    if len(calls) == 1:
        return [calls[0]()]
    pool = cpu.thread_pool(len(calls) - 1)
    futures = [pool.submit(c) for c in calls[1:]]
    first = calls[0]()
    return [first] + [f.result() for f in futures]


# ---- checked wrappers ----------------------------------------------------------------------------


def _check(t: torch.Tensor, name: str, dim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"cpu_ops: {name} must be a tensor, got {type(t).__name__}")
    if t.dtype != torch.bfloat16 or t.device.type != "cpu":
        raise ValueError(f"cpu_ops: {name} must be a bfloat16 CPU tensor, got {t.dtype} on {t.device}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"cpu_ops: {name} must have {dim} dims, got shape {list(t.shape)}")


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """t [..., n] as a [rows, n] view with unit inner stride (a copy when no such view exists)."""
    _check(t, name)
    if t.dim() == 0:
        raise ValueError(f"cpu_ops: {name} must have at least one dim")
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.stride(1) != 1 or t2.stride(0) < t2.shape[1]:
        t2 = t2.contiguous()
    return t2


def _flat(t: torch.Tensor, rows: int) -> torch.Tensor:
    """The forward's fast _rows: a [rows, N] BF16 view of a linear's output (a copy if needed)."""
    if t.dtype != torch.bfloat16:
        raise ValueError(f"cpu_ops: a linear returned {t.dtype}, the fused path needs bfloat16")
    if t.is_contiguous():
        return t.view(rows, -1)
    t2 = t.reshape(rows, -1)
    return t2 if t2.stride(1) == 1 and t2.stride(0) >= t2.shape[1] else t2.contiguous()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x += delta (in place, BF16, skipped when delta is None), then return RMSNorm(x) * weight
    as model.RMSNorm computes it. x [..., n] must be writable in place as a [rows, n] view."""
    _check(x, "x")
    n = x.shape[-1]
    x2 = x.view(-1, n) if x.is_contiguous() else None
    if x2 is None:
        raise ValueError("cpu_ops.add_rms_norm: x must be contiguous (it is updated in place)")
    _check(weight, "weight", 1)
    if weight.shape[0] != n or not weight.is_contiguous():
        raise ValueError(f"cpu_ops.add_rms_norm: weight must be a contiguous [{n}], got {list(weight.shape)}")
    d2 = None
    if delta is not None:
        if tuple(delta.shape) != tuple(x.shape):
            raise ValueError(f"cpu_ops.add_rms_norm: delta {list(delta.shape)} != x {list(x.shape)}")
        d2 = _rows(delta, "delta")
    if out is None:
        out = torch.empty_like(x)
    elif tuple(out.shape) != tuple(x.shape) or not out.is_contiguous():
        raise ValueError("cpu_ops.add_rms_norm: out must be contiguous and shaped like x")
    _check(out, "out")
    lib = _need_lib()
    lib.cpu_add_rms_norm(x2.shape[0], n, x2.data_ptr(), n, 0 if d2 is None else d2.data_ptr(),
                         0 if d2 is None else d2.stride(0), weight.data_ptr(), float(eps), out.data_ptr(), n)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in BF16 (rounded after silu and after the product, as torch); [..., n]."""
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"cpu_ops.silu_mul: gate {list(gate.shape)} and up {list(up.shape)} differ")
    g2, u2 = _rows(gate, "gate"), _rows(up, "up")
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    n = gate.shape[-1]
    _need_lib().cpu_silu_mul(g2.shape[0], n, g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0),
                             out.data_ptr(), n)
    return out


def _kv_strides(t: torch.Tensor, name: str, B: int, Hkv: int, D: int, min_slots: int) -> tuple[int, int, int]:
    _check(t, name, 4)
    if t.shape[0] != B or t.shape[1] != Hkv or t.shape[3] != D or t.shape[2] < min_slots or t.stride(3) != 1:
        raise ValueError(f"cpu_ops: {name} must be [{B}, {Hkv}, >= {min_slots}, {D}] with unit inner stride, "
                         f"got shape {list(t.shape)} strides {list(t.stride())}")
    return t.stride(0), t.stride(1), t.stride(2)


def rope_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
             k_out: torch.Tensor | None = None, v_out: torch.Tensor | None = None, start: int = 0):
    """model.py's RoPE on q [B, T, H, D] and k [B, T, H_kv, D] (any layout whose rows (b, t) are
    evenly strided), v copied. Returns q_rot [B, T, H, D] (contiguous), k_rot and v as
    [B, H_kv, T, D], written into k_out / v_out [B, H_kv, >= start + T, D] at slots
    start.. when given (a KV cache's buffers), else into new tensors (start must be 0)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check(t, name, 4)
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    if tuple(k.shape) != (B, T, Hkv, D) or tuple(v.shape) != (B, T, Hkv, D) or D % 2 or H % Hkv:
        raise ValueError(f"cpu_ops.rope_qkv: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} must be "
                         "[B, T, H, D], [B, T, H_kv, D] x2 with D even and H_kv dividing H")
    for t, name in ((cos, "cos"), (sin, "sin")):
        _check(t, name, 3)
        if tuple(t.shape) != (B, T, D):
            raise ValueError(f"cpu_ops.rope_qkv: {name} must be [{B}, {T}, {D}], got {list(t.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    q2, k2, v2 = (_rows(t.reshape(B, T, -1), n) for t, n in ((q, "q"), (k, "k"), (v, "v")))
    if (k_out is None) != (v_out is None):
        raise ValueError("cpu_ops.rope_qkv: pass both k_out and v_out, or neither")
    if k_out is None:
        if start != 0:
            raise ValueError("cpu_ops.rope_qkv: start must be 0 without k_out / v_out")
        k_out = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
        v_out = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
    strides = _kv_strides(k_out, "k_out", B, Hkv, D, start + T)
    if _kv_strides(v_out, "v_out", B, Hkv, D, start + T) != strides:
        raise ValueError("cpu_ops.rope_qkv: k_out and v_out must have the same strides")
    q_out = torch.empty(B, T, H, D, dtype=torch.bfloat16)
    _need_lib().cpu_rope_qkv(B, T, H, Hkv, D, q2.data_ptr(), q2.stride(0), k2.data_ptr(), k2.stride(0),
                             v2.data_ptr(), v2.stride(0), cos.data_ptr(), sin.data_ptr(), q_out.data_ptr(),
                             k_out.data_ptr(), v_out.data_ptr(), *strides, start)
    return q_out, k_out[:, :, start:start + T], v_out[:, :, start:start + T]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int = 0,
              attention_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of the T queries q [B, T, H, D] in slots start.. over key slots [0, start + T) of
    k, v [B, H_kv, >= start + T, D], with model.py's mask: causal, keys where attention_mask
    [B, start + T] is 0 hidden (a query always sees its own slot); query head h reads kv head
    h // (H / H_kv). Returns [B, T, H, D] (BF16; float32 inside)."""
    _check(q, "q", 4)
    B, T, H, D = q.shape
    Hkv = k.shape[1] if k.dim() == 4 else -1
    if Hkv <= 0 or H % Hkv:
        raise ValueError(f"cpu_ops.attention: k must be [B, H_kv, S, D] with H_kv dividing H={H}, "
                         f"got {list(k.shape)}")
    if start < 0:
        raise ValueError(f"cpu_ops.attention: start must be >= 0, got {start}")
    S = start + T
    strides = _kv_strides(k, "k", B, Hkv, D, S)
    if _kv_strides(v, "v", B, Hkv, D, S) != strides:
        raise ValueError("cpu_ops.attention: k and v must have the same strides")
    q = q.contiguous()
    real = None
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (B, S) or attention_mask.device.type != "cpu":
            raise ValueError(f"cpu_ops.attention: attention_mask must be a CPU [B, start + T] = {[B, S]}, "
                             f"got {list(attention_mask.shape)}")
        real = (attention_mask != 0).contiguous()  # bool: one byte, 0 or 1
    out = torch.empty(B, T, H, D, dtype=torch.bfloat16)
    rc = _need_lib().cpu_attention(B, T, H, Hkv, D, start, q.data_ptr(), k.data_ptr(), v.data_ptr(), *strides,
                                   None if real is None else real.data_ptr(), 0 if real is None else S,
                                   1.0 / math.sqrt(D) if scale is None else float(scale), out.data_ptr())
    if rc != 0:
        raise MemoryError("cpu_ops.attention: out of memory for the scratch buffer")
    return out


# ---- the sampler's decoder --------------------------------------------------------------------------


def _plain_bf16_cache(kv_cache, layer_idx: int, B: int, S: int) -> bool:
    """Whether kv_cache is the unquantized cache (model.KVCache's update) in BF16 that the
    kernels can write directly."""
    if type(kv_cache).update is not KVCache.update:
        return False
    k, v = kv_cache.k[layer_idx], kv_cache.v[layer_idx]
    return (k.dtype == v.dtype == torch.bfloat16 and k.device.type == "cpu" and k.is_contiguous()
            and v.is_contiguous() and k.shape == v.shape and k.shape[0] == B and k.shape[2] >= S)


class FastCPUDecoder(Decoder):
    """model.Decoder whose forward runs the fused kernels (BF16, CPU, no autograd); anything else
    goes to Decoder.forward. Set on a sampler copy by `fast_cpu_ops`."""

    def _fast_ok(self, input_ids, attention_mask, kv_cache) -> bool:
        if torch.is_grad_enabled() or input_ids.device.type != "cpu" or input_ids.dim() != 2 \
                or input_ids.numel() == 0:
            return False
        if self.embed_tokens.weight.dtype != torch.bfloat16 or os.environ.get("FP4RL_CPU_OPS", "1") == "0":
            return False
        B, T = input_ids.shape
        start = 0 if kv_cache is None else kv_cache.length
        if kv_cache is not None and (kv_cache.max_len < start + T or kv_cache.batch_size != B):
            return False  # Decoder.forward raises its error
        if attention_mask is not None and (tuple(attention_mask.shape) != (B, start + T)
                                           or attention_mask.device.type != "cpu"):
            return False
        return available()

    @staticmethod
    def _silu_mul(lib, gate, up, B, T, rows):
        g2, u2 = _flat(gate, rows), _flat(up, rows)
        width = g2.shape[1]
        if u2.shape[1] != width:
            raise ValueError(f"cpu_ops: gate_proj / up_proj widths differ ({width}, {u2.shape[1]})")
        a = torch.empty(B, T, width, dtype=torch.bfloat16)
        g_p, g_r, u_p, u_r, a_p = g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0), a.data_ptr()
        _run([partial(lib.cpu_silu_mul, hi - lo, width, g_p + 2 * lo * g_r, g_r, u_p + 2 * lo * u_r, u_r,
                      a_p + 2 * lo * width, width) for lo, hi in _chunks(rows)])
        return a

    def _plan(self) -> list[tuple]:
        """The modules each layer calls, looked up once (nn.Module attribute access is slow) and
        checked against the modules' dicts on every forward, so a replaced module is noticed."""
        plan = self.__dict__.get("_cpu_plan")
        if plan is not None and len(plan) == len(self.layers) and all(
                self.layers._modules[str(i)] is p[0] and p[0]._modules["self_attn"] is p[1]
                and p[0]._modules["mlp"] is p[8] and p[1]._modules["q_proj"] is p[3]
                and p[1]._modules["k_proj"] is p[4] and p[1]._modules["v_proj"] is p[5]
                and p[1]._modules["o_proj"] is p[6] and (p[9] is None or (
                    p[8]._modules["gate_proj"] is p[9] and p[8]._modules["up_proj"] is p[10]
                    and p[8]._modules["down_proj"] is p[11]))
                and p[0]._modules["post_attention_layernorm"] is p[12] for i, p in enumerate(plan)) \
                and all(plan[i][13] is self.layers[i + 1].input_layernorm for i in range(len(plan) - 1)) \
                and plan[-1][13] is self.norm:
            return plan
        layers = list(self.layers)
        plan = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            dense = not layer.is_moe
            plan.append((layer, attn, attn.layer_idx, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                         hasattr(attn, "q_norm"), mlp, mlp.gate_proj if dense else None,
                         mlp.up_proj if dense else None, mlp.down_proj if dense else None,
                         layer.post_attention_layernorm,
                         layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm))
        self.__dict__["_cpu_plan"] = plan
        return plan

    def forward(self, input_ids, position_ids=None, attention_mask=None, kv_cache=None, routing=None):
        if not self._fast_ok(input_ids, attention_mask, kv_cache):
            return super().forward(input_ids, position_ids, attention_mask, kv_cache, routing)
        B, T = input_ids.shape
        start = 0 if kv_cache is None else kv_cache.length
        S = start + T
        moe_layers = [layer for layer in self.layers if layer.is_moe]
        if routing is not None and len(routing) != len(moe_layers):
            return super().forward(input_ids, position_ids, attention_mask, kv_cache, routing)  # raises
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B, T]
            else:
                position_ids = torch.arange(start, S).expand(B, T)
        elif tuple(position_ids.shape) != (B, T):  # [T] or [1, T]: as broadcast by Decoder.forward
            position_ids = position_ids.expand(B, T)  # (the kernels read B * T rows of cos and sin)
        x = self.embed_tokens(input_ids).contiguous()  # [B, T, hidden], updated in place below
        cos, sin = self.rope_tables(position_ids, torch.bfloat16)  # [B, T, D], as Decoder.forward
        cos, sin = cos.contiguous(), sin.contiguous()
        real = None if attention_mask is None else (attention_mask != 0).contiguous()  # [B, S] bool
        real_p, cos_p, sin_p = None if real is None else real.data_ptr(), cos.data_ptr(), sin.data_ptr()
        lib = _need_lib()
        cfg = self.config
        H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        scale = 1.0 / math.sqrt(D)
        hidden = x.shape[-1]
        rows = B * T
        slots = None

        x_shape, x_ptr = x.shape, x.data_ptr()
        row_chunks = _chunks(rows)  # one piece per thread for a prefill, one in all for a decode step
        batch_chunks = _chunks(B, 1) if T > 1 else [(0, B)]

        def norm(module, delta):
            out = torch.empty_like(x)
            d_ptr = 0
            if delta is not None:
                if delta.dtype != torch.bfloat16 or delta.shape != x_shape:
                    raise ValueError(f"cpu_ops: a layer returned {delta.dtype} {list(delta.shape)}, expected "
                                     f"bfloat16 {list(x_shape)}")
                if not delta.is_contiguous():
                    delta = delta.contiguous()
                d_ptr = delta.data_ptr()
            w = module.weight
            if w.dtype != torch.bfloat16 or not w.is_contiguous():
                raise ValueError(f"cpu_ops: RMSNorm weight must be contiguous bfloat16, got {w.dtype}")
            w_ptr, o_ptr, row_bytes = w.data_ptr(), out.data_ptr(), 2 * hidden
            _run([partial(lib.cpu_add_rms_norm, hi - lo, hidden, x_ptr + lo * row_bytes, hidden,
                          d_ptr and d_ptr + lo * row_bytes, hidden, w_ptr, module.eps, o_ptr + lo * row_bytes,
                          hidden) for lo, hi in row_chunks])
            return out

        chosen, moe_i = [], 0
        plan = self._plan()
        plain = kv_cache is not None and type(kv_cache).update is KVCache.update
        h = norm(plan[0][0].input_layernorm, None)
        if (T == 1 and plain and not moe_layers
                and all(_plain_bf16_cache(kv_cache, p[2], B, S) for p in plan)
                and cpu_step.whole_step(self, lib, plan, kv_cache, B, start, x, h, cos, sin, real, scale)):
            kv_cache.length = S
            return h, []
        for (_layer, attn, layer_idx, q_proj, k_proj, v_proj, o_proj, qk_norm, mlp, gate_proj, up_proj,
             down_proj, post_norm, next_norm) in plan:
            q, k, v = q_proj(h), k_proj(h), v_proj(h)
            if qk_norm:
                q = attn.q_norm(q.view(B, T, H, D))
                k = attn.k_norm(k.view(B, T, Hkv, D))
            q2, k2, v2 = _flat(q, rows), _flat(k, rows), _flat(v, rows)
            if q2.shape[1] != H * D or k2.shape[1] != Hkv * D or v2.shape[1] != Hkv * D:
                raise ValueError(f"cpu_ops: q/k/v projections returned widths {q2.shape[1]}, {k2.shape[1]}, "
                                 f"{v2.shape[1]}; expected {H * D}, {Hkv * D}, {Hkv * D}")
            a = torch.empty(B, T, H * D, dtype=torch.bfloat16)
            if plain and _plain_bf16_cache(kv_cache, layer_idx, B, S):  # RoPE, cache write, attention
                k_buf, v_buf = kv_cache.k[layer_idx], kv_cache.v[layer_idx]
                qp, qr, kp, kr, vp, vr = q2.data_ptr(), q2.stride(0), k2.data_ptr(), k2.stride(0), \
                    v2.data_ptr(), v2.stride(0)
                kcp, vcp, kv_b, ap = k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(0), a.data_ptr()
                # batch rows [lo, hi): their tokens (rows lo * T..), cache rows, mask rows and outputs
                rc = max(_run([partial(
                    lib.cpu_rope_attention, hi - lo, T, H, Hkv, D, start, qp + 2 * lo * T * qr, qr,
                    kp + 2 * lo * T * kr, kr, vp + 2 * lo * T * vr, vr, cos_p + 2 * lo * T * D,
                    sin_p + 2 * lo * T * D, kcp + 2 * lo * kv_b, vcp + 2 * lo * kv_b, kv_b, k_buf.stride(1),
                    k_buf.stride(2), real_p and real_p + lo * S, S, scale, ap + 2 * lo * T * H * D)
                    for lo, hi in batch_chunks]), key=abs)
            else:  # no cache, or another cache: RoPE into new tensors, the cache's own update, attention
                q_rot = torch.empty(B, T, H, D, dtype=torch.bfloat16)
                k_buf = torch.empty(B, Hkv, T, D, dtype=torch.bfloat16)
                v_buf = torch.empty_like(k_buf)
                lib.cpu_rope_qkv(B, T, H, Hkv, D, q2.data_ptr(), q2.stride(0), k2.data_ptr(), k2.stride(0),
                                 v2.data_ptr(), v2.stride(0), cos_p, sin_p, q_rot.data_ptr(),
                                 k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(0), k_buf.stride(1),
                                 k_buf.stride(2), 0)
                if kv_cache is not None:  # quantize and dequantize (FP8, NVFP4 caches)
                    if slots is None:
                        slots = torch.arange(start, S)
                    k_buf, v_buf = kv_cache.update(layer_idx, k_buf, v_buf, slots)
                    k_buf, v_buf = k_buf.to(torch.bfloat16), v_buf.to(torch.bfloat16)
                    if k_buf.stride(3) != 1 or v_buf.stride() != k_buf.stride():
                        k_buf, v_buf = k_buf.contiguous(), v_buf.contiguous()
                if (tuple(k_buf.shape[:2]) != (B, Hkv) or k_buf.shape[2] < S or k_buf.shape[3] != D
                        or v_buf.shape != k_buf.shape):
                    raise ValueError(f"cpu_ops: the KV cache returned keys {list(k_buf.shape)}, expected "
                                     f"[{B}, {Hkv}, {S}, {D}]")
                rc = lib.cpu_attention(B, T, H, Hkv, D, start, q_rot.data_ptr(), k_buf.data_ptr(),
                                       v_buf.data_ptr(), k_buf.stride(0), k_buf.stride(1), k_buf.stride(2),
                                       real_p, S, scale, a.data_ptr())
            if rc != 0:
                raise MemoryError("cpu_ops.attention: out of memory for the scratch buffer")
            h = norm(post_norm, o_proj(a))
            if gate_proj is None:  # MoE
                forced = None
                if routing is not None:
                    forced, moe_i = routing[moe_i], moe_i + 1
                d, experts = mlp(h, forced)
                chosen.append(experts)
            else:
                d = down_proj(self._silu_mul(lib, gate_proj(h), up_proj(h), B, T, rows))
            h = norm(next_norm, d)
        if kv_cache is not None:
            kv_cache.length = S
        return h, chosen


def fast_cpu_ops(model: CausalLM, enable: bool = True) -> bool:
    """Make a sampler's CausalLM (BF16 weights on the CPU) run its decoder with the fused kernels;
    returns whether it does. Not for a model being trained (the kernels have no backward; with
    autograd on, the forward is the eager one anyway). enable=False restores model.Decoder."""
    if not isinstance(model, CausalLM):
        raise TypeError(f"fast_cpu_ops needs an fp4rl CausalLM, got {type(model).__name__}")
    decoder = model.model
    if not enable:
        if type(decoder) is FastCPUDecoder:
            decoder.__class__ = Decoder
        return False
    if type(decoder) not in (Decoder, FastCPUDecoder):
        return False
    w = decoder.embed_tokens.weight
    norms = [decoder.norm] + [m for layer in decoder.layers
                              for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    if w.dtype != torch.bfloat16 or w.device.type != "cpu" or any(
            n.weight.dtype != torch.bfloat16 or n.weight.device.type != "cpu" for n in norms):
        return False
    if not available():
        return False
    decoder.__class__ = FastCPUDecoder
    return True
