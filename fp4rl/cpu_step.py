"""A whole decode step of the sampler's dense layers in one C call (`cpu_decode_layers` in cpu_ops.c).

FastCPUDecoder (fp4rl/cpu_ops.py) runs a layer as ~8 Python-side calls (4 GEMMs, 4 fused kernels).
For a decode step (one new token per row) of dense layers whose linears all run fp4rl.nvfp4.cpu_gemm
(q/k/v and gate/up fused, W4A16 or BF16, at most GEMM_MAX_ROWS rows) over a plain BF16 cache, the same
kernels run in the same order from one C call for all layers, reading int64 records built here: the
same bits, without the per-call overhead (1.24x per generate on the default model at 1 thread, 1.32x
at 2; bench/cpu_decode_ab.py). The C step is serial, so with more than 2 torch threads the per-kernel
loop, whose GEMMs split over the threads, runs instead. `WHOLE_STEP = False` turns this path off.

The per-layer records (GEMM sites, norm weights) are kept per set of weight copies and rebuilt when
any of them changes; the KV-cache pointers and the step record are written per step.
"""

from __future__ import annotations

import array
import ctypes
import struct

import torch

from fp4rl.nvfp4 import cpu_gemm
from fp4rl.packed import GEMM_MAX_ROWS, gemm_site

WHOLE_STEP = True
"""Run a decode step of dense layers as one C call (cpu_decode_layers) where every linear is a GEMM of
fp4rl.nvfp4.cpu_gemm; False: one Python call per kernel (the same kernels, the same bits)."""

# the records of cpu_ops.c (a step: ST_LEN = 24 values; a layer: LY_LEN); cpu_decode_layers refuses others
_SITE_LEN = 8
_LAYER_LEN = 4 * _SITE_LEN + 9


def _f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _site(weight, bias) -> list[int]:
    """[kind, ptr0..ptr3, bias, N, K] of cpu_ops.c's GEMM site."""
    ptrs = list(weight.ptrs) + [0] * (4 - len(weight.ptrs))
    return [0 if weight.packed else 1, *ptrs, 0 if bias is None else bias.data_ptr(), weight.N, weight.K]


class _StepPlan:
    """The per-layer records of cpu_decode_layers for one set of weight copies, the objects they point
    into (kept alive), the MLP width and the GEMM entry points."""

    def __init__(self, key, layers: array.array, keep: list, inter: int):
        self.key, self.layers, self.keep, self.inter = key, layers, keep, inter
        self.gemm_fns = tuple(ctypes.cast(fn, ctypes.c_void_p).value
                              for fn in (cpu_gemm._lib.nvfp4_gemm, cpu_gemm._lib.bf16_gemm))


def _layer_sites(decoder, plan, hidden: int):
    """(per-layer [(weight, bias)] of q/k/v, o, gate/up, down; per-layer (post norm, next norm)), or None
    where a layer is not of the form cpu_decode_layers runs."""
    cfg = decoder.config
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    sites, norms = [], []
    for (_layer, _attn, _layer_idx, q_proj, k_proj, v_proj, o_proj, qk_norm, _mlp, gate_proj, up_proj,
         down_proj, post_norm, next_norm) in plan:
        qkv, gu = getattr(q_proj, "group", None), getattr(gate_proj, "group", None)
        if (qk_norm or gate_proj is None or qkv is None or gu is None
                or qkv.members != [q_proj, k_proj, v_proj] or gu.members != [gate_proj, up_proj]):
            return None
        layer_sites = [gemm_site(qkv), gemm_site(o_proj), gemm_site(gu), gemm_site(down_proj)]
        if any(site is None for site in layer_sites):
            return None
        (wq, _), (wo, _), (wg, _), (wd, _) = layer_sites
        inter = sites[0][3][0].K if sites else wd.K  # one intermediate size: the step's buffers
        shapes = (wq.N, wq.K, wo.N, wo.K, wg.N, wg.K, wd.N)
        if shapes != ((H + 2 * Hkv) * D, hidden, hidden, H * D, 2 * inter, hidden, hidden) or inter != wd.K:
            return None
        for n in (post_norm, next_norm):
            w = n.weight
            if w.dtype != torch.bfloat16 or not w.is_contiguous() or w.numel() != hidden:
                return None
        sites.append(layer_sites)
        norms.append((post_norm, next_norm))
    return sites, norms


def _step_plan(decoder, sites, norms) -> _StepPlan:
    """The decoder's cached plan, or a new one when a weight copy, bias or norm weight changed."""
    # the records hold pointers: key them by object and storage (a Parameter given new storage keeps its
    # id), and keep every object they point into alive with the plan
    key = tuple((id(o), o.data_ptr() if isinstance(o, torch.Tensor) else 0) for layer_sites in sites
                for site in layer_sites for o in site) + tuple(
        (id(n.weight), n.weight.data_ptr()) for pair in norms for n in pair)
    step_plan = decoder.__dict__.get("_step_plan")
    if step_plan is None or step_plan.key != key:
        records = []
        for layer_sites, (post_norm, next_norm) in zip(sites, norms):
            for weight, bias in layer_sites:
                records += _site(weight, bias)
            records += [post_norm.weight.data_ptr(), _f32_bits(post_norm.eps),
                        next_norm.weight.data_ptr(), _f32_bits(next_norm.eps), 0, 0, 0, 0, 0]
        keep = [sites, [n.weight for pair in norms for n in pair]]
        step_plan = decoder.__dict__["_step_plan"] = _StepPlan(key, array.array("q", records), keep,
                                                               sites[0][3][0].K)
    return step_plan


def whole_step(decoder, lib, plan, kv_cache, B: int, start: int, x, h, cos, sin, real, scale: float) -> bool:
    """One decode step (T = 1) of every layer of a FastCPUDecoder in one C call (lib: cpu_ops' library);
    x (the residual stream) and h (the normed hidden state) are updated in place. False (nothing done)
    where a layer is not of the form cpu_decode_layers runs: dense MLP, no q/k norm, q/k/v and gate/up
    each one fused GEMM of the AMX kernel, o/down too, at most GEMM_MAX_ROWS rows. The caller has
    checked that every layer's cache is the plain BF16 one with room for this step."""
    if not WHOLE_STEP or B > GEMM_MAX_ROWS or not cpu_gemm.available() or torch.get_num_threads() > 2:
        return False
    cfg = decoder.config
    H, Hkv, D, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, x.shape[-1]
    found = _layer_sites(decoder, plan, hidden)
    if found is None:
        return False
    step_plan = _step_plan(decoder, *found)
    layers, inter = step_plan.layers, step_plan.inter
    for i, p in enumerate(plan):
        k_buf, v_buf = kv_cache.k[p[2]], kv_cache.v[p[2]]
        at = i * _LAYER_LEN + 4 * _SITE_LEN + 4
        layers[at:at + 5] = array.array("q", (k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(0),
                                              k_buf.stride(1), k_buf.stride(2)))
    K32 = -(-max(hidden, inter, H * D) // 32) * 32
    bufs = [torch.empty(B, n, dtype=torch.bfloat16)
            for n in ((H + 2 * Hkv) * D, H * D, hidden, 2 * inter, inter, hidden)]
    step = array.array("q", [
        B, start, x.data_ptr(), h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        0 if real is None else real.data_ptr(), start + 1, hidden, H, Hkv, D, _f32_bits(scale),
        *(b.data_ptr() for b in bufs), cpu_gemm._scratch("x_vnni", -(-B // 16) * K32 * 16),
        cpu_gemm._work(B, K32), *step_plan.gemm_fns, inter])
    rc = lib.cpu_decode_layers(step.buffer_info()[0], len(step), layers.buffer_info()[0], _LAYER_LEN,
                               len(plan))
    if rc == -1:
        raise MemoryError("cpu_ops.attention: out of memory for the scratch buffer")
    if rc != 0:
        raise RuntimeError(f"cpu_decode_layers failed ({rc}: -2 record layout, -3 a GEMM refused its "
                           "arguments)")
    return True
