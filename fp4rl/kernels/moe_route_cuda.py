"""The MoE router GEMV and the route of 1-8 decode tokens in one CUDA cluster launch (moe_router_route.cu),
compiled by NVRTC at run time: what `moe_route.router_route` (Triton) computes, without its last program's
serial route.

At one token the Triton router_route spends ~4.5 of its ~6-7 us in the grid's last program, which routes
alone after a global counter and a round trip through the column slices' partial sums, with a CTA barrier per
reduction (bench/gpu_kernels.md, sixteenth and thirtieth sessions). Here one cluster of CL CTAs copies the
router weight to shared memory before griddepcontrol.wait (it does not change during a decode step), sums
x @ Wr.T per warp, hands the logits to CTA 0 through distributed shared memory behind one cluster barrier,
and CTA 0 routes with warp-wide reductions (one warp per token; redux.sync for the top-k).

Outputs: those of `moe_route.router_route` (logits [T, E] bf16, idx [T, K] int64, w [T, K] bf16, rows,
pos [T K] int32, offsets [E + 1] int32), with the same meaning and the same top-k / tie / NaN-row rules. The
fp32 summation orders are the kernel's own (written out by `reference`, which runs the same arithmetic in
torch ops on any device): a logit can differ from cuBLAS's or the Triton kernel's in its last bf16 bit, a
probability from torch's softmax in its last fp32 bit (then only an exact or one-bit near tie can choose
another expert, and routing replay records the choice made). On a GPU the kernel equals `reference` on the
same device bit for bit (tests/test_moe_route_cuda.py, gpu marker: that assumes torch's exp and NVRTC's
libdevice expf agree, which the test checks); on a CPU `reference` is checked against torch's route and
grouping.

`norm_router_route` runs the decode step's residual add + RMSNorm before the router in the same launch (the
.cu's PRENORM build: every CTA normalises the token rows itself, CTA 0 writes x' and y), so the post-attention
fused.add_rmsnorm launch goes away (`gpu_decode.ROUTER_NORM`, FP4RL_MOE_ROUTER_NORM=1, off until timed);
`prenorm_reference` is its arithmetic (an IEEE sqrt and division for rstd, the sum in the kernel's order).

`gpu_experts.ROUTER_CUDA` (on by default; FP4RL_MOE_ROUTER_CUDA=0 turns it off) makes KernelMoeBlock take
it where `plan` fits, up to `gpu_experts.ROUTER_CUDA_MAX_TOKENS` tokens (4 by default: where the sampler's
step was measured faster), before the Triton router_route.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from fp4rl.kernels import gemv_cuda, pdl, prenorm
from fp4rl.kernels.prenorm import butterfly as _butterfly
from fp4rl.kernels.prenorm import reference as prenorm_reference  # (the PRENORM build's arithmetic)

_SOURCE = Path(__file__).with_name("moe_router_route.cu")
WARPS = 8
MAX_TOKENS = 8  # tokens: warps of CTA 0 that route
MAX_CLUSTER = 8  # CTAs of the cluster (the portable limit)
MAX_TOP_K = 16
MAX_WORDS = 16  # 16-byte chunks of router weight a lane copies and reads (EPW x NCH): 8 KB a warp
# the logits to CTA 0 by st.async on an mbarrier that CTA 0 alone waits on, instead of remote stores and a
# cluster barrier (whose release compiles to a MEMBAR.ALL.GPU); the same outputs.
# FP4RL_MOE_ROUTER_CUDA_ASYNC=1: for A/B, untimed (bench/moe_route_bench.py cuda times both)
ASYNC_LOGITS = os.environ.get("FP4RL_MOE_ROUTER_CUDA_ASYNC", "0") == "1"
# ok False: it failed here once (compile or launch); the Triton router_route from then on
STATE = {"ok": None, "error": None}
# the same for the PRENORM build alone (norm_router_route): its failure leaves router_route on
NORM_STATE = {"ok": None, "error": None}


def plan(tokens: int, top_k: int, experts: int, hidden: int) -> dict | None:
    """The build for this router (None where the kernel does not take it: the caller keeps the Triton
    router_route). EPW router rows per warp, NCH 16-byte chunks of a row per lane, CL CTAs."""
    if not (1 <= tokens <= MAX_TOKENS and 1 <= top_k <= min(MAX_TOP_K, experts) and hidden > 0
            and hidden % 8 == 0):
        return None
    epw = -(-experts // (MAX_CLUSTER * WARPS))
    nch = -(-hidden // 256)
    if epw * nch > MAX_WORDS:
        return None
    cl = -(-experts // (WARPS * epw))
    return {"T": tokens, "E": experts, "H": hidden, "K": top_k, "EPW": epw, "NCH": nch, "CL": cl}


def smem_bytes(cfg: dict) -> int:
    """The launch's dynamic shared memory: the warps' router rows and x, in 16-byte chunks (the .cu's
    W_CHUNKS + X_CHUNKS); PRENORM: also the h rows and the norm weight."""
    extra = cfg.get("PRENORM", 0) * (cfg["T"] + 1)
    return 16 * 32 * cfg["NCH"] * (WARPS * cfg["EPW"] + cfg["T"] + extra)


def static_smem_bytes(cfg: dict) -> int:
    """The kernel's static shared memory (at most: each array to 16 bytes): every expert's logit per token
    (lg), the chosen ids, with ASYNC the mbarrier, with PRENORM the warps' sums of squares."""
    sizes = (cfg["CL"] * WARPS * cfg["EPW"], cfg["K"]) + ((WARPS,) if cfg.get("PRENORM", 0) else ())
    arrays = sum(-(-4 * cfg["T"] * n // 16) * 16 for n in sizes)
    return arrays + 16 * cfg.get("ASYNC", 0)


def source(cfg: dict, norm: bool) -> str:
    defs = {**cfg, "NORM": int(norm)}
    return ("".join(f"#define {key} {val}\n" for key, val in defs.items()) + prenorm.header()
            + _SOURCE.read_text())


def available(device=None) -> bool:
    """gemv_cuda.hopper_nvrtc (clusters, redux.sync, griddepcontrol, NVRTC), and no failure here before."""
    return STATE["ok"] is not False and gemv_cuda.hopper_nvrtc(device)


def norm_available(device=None) -> bool:
    """`available`, and the PRENORM build has not failed here before."""
    return NORM_STATE["ok"] is not False and available(device)


def disable_norm(exc: Exception) -> None:
    NORM_STATE["ok"], NORM_STATE["error"] = False, repr(exc)[:300]
    warnings.warn(f"CUDA residual add + RMSNorm inside the MoE router's launch disabled "
                  f"({NORM_STATE['error']}); using fused.add_rmsnorm before the router", stacklevel=3)


def disable(exc: Exception) -> None:
    STATE["ok"], STATE["error"] = False, repr(exc)[:300]
    warnings.warn(f"CUDA MoE router + route kernel disabled ({STATE['error']}); using the Triton "
                  "router_route", stacklevel=3)


@functools.cache
def _kernel(key: tuple, device_index: int):
    cfg = dict(key[:-1])
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(source(cfg, key[-1]), "moe_router_route",
                                          nvcc_options=["-std=c++17"])


def aligned(t: torch.Tensor) -> bool:
    """Rows the kernel's 16-byte copies can read: unit column stride, a row stride that is a multiple of 8,
    a 16-byte aligned start."""
    return t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0


def _check(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, weight_dtype, what: str) -> dict:
    """The build of a launch for x [T, H] and gate_weight [E, H] (ValueError / TypeError naming `what`)."""
    if x.ndim != 2 or gate_weight.ndim != 2 or x.shape[1] != gate_weight.shape[1]:
        raise ValueError(f"{what}: x must be [T, H] and gate_weight [E, H], got {tuple(x.shape)} and "
                         f"{tuple(gate_weight.shape)}")
    if x.dtype != torch.bfloat16 or gate_weight.dtype != torch.bfloat16:
        raise TypeError(f"{what}: x and gate_weight must be bfloat16, got {x.dtype} and {gate_weight.dtype}")
    if (weight_dtype or torch.bfloat16) != torch.bfloat16:
        raise TypeError(f"{what}: the top-k weights are bfloat16, got weight_dtype {weight_dtype}; use "
                        "moe_route.router_route")
    if not x.is_cuda or x.device != gate_weight.device:
        raise ValueError(f"{what}: x and gate_weight must be on one CUDA device, got {x.device} and "
                         f"{gate_weight.device}")
    t, h = x.shape
    e = gate_weight.shape[0]
    cfg = plan(t, top_k, e, h)
    if cfg is None:
        raise ValueError(f"{what}: {t} tokens, top {top_k} of {e} experts, hidden {h} is outside the kernel "
                         f"(1-{MAX_TOKENS} tokens, top_k <= {MAX_TOP_K}, hidden % 8 == 0, ceil(E / "
                         f"{MAX_CLUSTER * WARPS}) x ceil(H / 256) <= {MAX_WORDS}); use "
                         "moe_route.router_route")
    if not aligned(gate_weight):
        raise ValueError(f"{what}: gate_weight rows must be 16-byte aligned with unit column stride (pass "
                         ".contiguous())")
    return cfg


def _launch(cfg: dict, x, gate_weight, top_k: int, norm: bool, pre=None):
    """Launch the build `cfg` (PRENORM when pre = (h, norm_weight, x', y, eps) is given) -> the route's
    outputs (logits, idx, w, rows, pos, offsets)."""
    from fp4rl.kernels.moe_route import _route_outputs

    t, h = x.shape
    e = gate_weight.shape[0]
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    logits = torch.empty(t, e, dtype=torch.bfloat16, device=x.device)
    idx, w, rows, pos, offsets = _route_outputs(t, top_k, e, torch.bfloat16, x.device)
    cfg = dict(cfg, ASYNC=int(ASYNC_LOGITS), PRENORM=int(pre is not None))
    kern = _kernel(tuple(sorted(cfg.items())) + (bool(norm),), dev)
    smem = smem_bytes(cfg)
    if pre is None:
        extra = [x, x, logits, logits, x.stride(0), 0, 0]  # (unused without PRENORM)
    else:
        hh, nw, xo, yo, eps = pre
        extra = [hh, nw, xo, yo, hh.stride(0), prenorm.f32_bits(1.0 / h), prenorm.f32_bits(eps)]
    with torch.cuda.device(dev):
        # past 48 KB of dynamic + static shared memory the launch needs the opt-in (the static part counts)
        gemv_cuda._set_smem(kern, smem + static_smem_bytes(cfg))
        pdl.launch(kern, (cfg["CL"], 1, 1), (WARPS * 32, 1, 1),
                   [x, gate_weight, logits, idx, w, rows, pos, offsets, x.stride(0), gate_weight.stride(0),
                    *extra], smem, torch.cuda.current_stream(dev), pdl.weights_flag(dev, "route"))
    STATE["ok"] = True
    return logits, idx, w, rows, pos, offsets


def router_route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm: bool,
                 weight_dtype: torch.dtype | None = None):
    """logits = x [T, H] @ gate_weight [E, H].T (bf16), then the route of the T tokens: (logits, idx, w, rows,
    pos, offsets) as `moe_route.router_route`. bfloat16 operands and weights; no host sync. Inside
    `pdl.step()` the launch carries PDL (kind "route") and reads the router weight before waiting for the
    kernel before it."""
    cfg = _check(x, gate_weight, top_k, weight_dtype, "router_route (CUDA)")
    if not aligned(x):  # cp.async reads 16-byte chunks of each row
        x = x.clone(memory_format=torch.contiguous_format)
    return _launch(cfg, x, gate_weight, top_k, norm)


def norm_router_route(x: torch.Tensor, h: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      gate_weight: torch.Tensor, top_k: int, norm: bool,
                      weight_dtype: torch.dtype | None = None):
    """The decode step's residual add + RMSNorm, then router_route of its output, in one launch: x' = bf16(x +
    h), y = bf16(norm_weight * bf16(x' * rstd)) with rstd = 1 / sqrt(sum(x'^2) / H + eps) (IEEE, the sum in
    the kernel's order: `prenorm_reference`), then the route of y. x, h [T, H] bfloat16 (the residual and the
    attention's output), norm_weight [H] bfloat16 (the post-attention RMSNorm's; read before the PDL wait, as
    the router weight: it does not change during a step). Returns (x', y, logits, idx, w, rows, pos,
    offsets), x' and y new contiguous [T, H] tensors."""
    what = "norm_router_route (CUDA)"
    cfg = _check(x, gate_weight, top_k, weight_dtype, what)
    t, hd = x.shape
    prenorm.check(x, h, norm_weight, what)
    x = x if aligned(x) else x.clone(memory_format=torch.contiguous_format)
    h = h if aligned(h) else h.clone(memory_format=torch.contiguous_format)
    xo = torch.empty(t, hd, dtype=torch.bfloat16, device=x.device)
    yo = torch.empty(t, hd, dtype=torch.bfloat16, device=x.device)
    out = (xo, yo, *_launch(cfg, x, gate_weight, top_k, norm, pre=(h, norm_weight, xo, yo, eps)))
    NORM_STATE["ok"] = True
    return out


def norm_reference(x, h, norm_weight, eps: float, gate_weight, top_k: int, norm: bool):
    """norm_router_route's outputs in torch ops: prenorm_reference, then `reference` of y."""
    xs, y = prenorm_reference(x, h, norm_weight, eps)
    return (xs, y, *reference(y, gate_weight, top_k, norm))


def _sums(x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """The router's fp32 sums [T, E] in the kernel's order: lane l sums its 16-byte chunks c = l + 32 i (i
    ascending, the 8 exact products of a chunk in order), then the warp's xor butterfly adds the lanes."""
    t, h = x.shape
    e = gate_weight.shape[0]
    nch = -(-h // 256)
    dev = x.device
    pad = 256 * nch
    xf = torch.zeros(t, pad, device=dev)
    xf[:, :h] = x.float()
    wf = torch.zeros(e, pad, device=dev)
    wf[:, :h] = gate_weight.float()
    xl = xf.view(t, nch, 32, 8)  # [t, i, lane, element]: column 8 (lane + 32 i) + element
    wl = wf.view(e, nch, 32, 8)
    acc = torch.zeros(t, e, 32, device=dev)
    for i in range(nch):
        for el in range(8):
            acc = acc + xl[:, None, i, :, el] * wl[None, :, i, :, el]  # exact product, one rounding per add
    return _butterfly(acc, torch.add)[..., 0]


def reference(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, norm: bool):
    """The kernel's arithmetic in torch ops (any device; each op one IEEE rounding, as the kernel's fmaf of an
    exact product and its adds: the bf16 products are exact in fp32 except below ~2^-133 or from 2^128,
    where the kernel's fmaf and torch's rounded product can part): (logits, idx, w, rows, pos, offsets) as
    `router_route`. On the GPU that ran the kernel, torch's exp is libdevice's expf as the kernel's, so the
    outputs are the kernel's bit for bit (a NaN as a NaN: the kernel writes 0x7FC0)."""
    t = x.shape[0]
    e = gate_weight.shape[0]
    dev = x.device
    logits = _sums(x, gate_weight).bfloat16()
    # the route: lane l holds experts l + 32 s (s ascending), past E: none
    el_ = -(-e // 32)
    lg = torch.full((t, 32 * el_), float("-inf"), device=dev)
    lg[:, :e] = logits.float()
    real = torch.arange(32 * el_, device=dev) < e
    lane_major = lg.view(t, el_, 32)  # [t, s, lane]
    mx = _fmax_over(lg)[:, None]  # fmaxf in any order: the largest logit that is not NaN
    ex = torch.where(real.view(el_, 32), torch.exp(lane_major - mx[:, :, None]), torch.zeros((), device=dev))
    s = torch.zeros(t, 32, device=dev)
    for i in range(el_):
        s = s + ex[:, i]
    total_e = _butterfly(s, torch.add)[:, :1]  # [t, 1]
    p = (ex / total_e[:, :, None]).reshape(t, 32 * el_)  # expert l + 32 s at s * 32 + l
    bad = (p[:, :e] != p[:, :e]).any(1)
    key = torch.where(bad[:, None], torch.ones_like(p, dtype=torch.int64),
                      p.view(torch.int32).to(torch.int64) + 1)
    key = torch.where(real[None, :], key, torch.zeros_like(key))
    ids = torch.empty(t, top_k, dtype=torch.int64, device=dev)
    vals = torch.empty(t, top_k, device=dev)
    total = torch.zeros(t, device=dev)
    cols = torch.arange(32 * el_, device=dev)
    for j in range(top_k):
        top = key.max(1).values
        i = torch.where(key == top[:, None], cols[None, :], torch.full_like(cols, 1 << 30)).min(1).values
        key = torch.where(cols[None, :] == i[:, None], torch.zeros_like(key), key)
        v = torch.where(bad, torch.zeros_like(total), (top - 1).to(torch.int32).view(torch.float32))
        total = total + v
        ids[:, j], vals[:, j] = i, v
    w = vals / total[:, None] if norm else vals
    w = torch.where(bad[:, None], torch.full_like(w, float("nan")), w).bfloat16()
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(t * top_k, device=dev)
    offsets = torch.searchsorted(flat[order], torch.arange(e + 1, device=dev))
    return logits, ids, w, (order // top_k).int(), pos.int(), offsets.int()


def _fmax_over(v: torch.Tensor) -> torch.Tensor:
    """fmaxf over dim 1 (a NaN operand is skipped, as CUDA's fmaxf; NaN only if all are)."""
    out = v[:, 0]
    for i in range(1, v.shape[1]):
        out = torch.fmax(out, v[:, i])
    return out
